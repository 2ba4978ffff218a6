"""Per-SKU baselines (``graders/skus/*.yaml``): expected GPUs, limits and performance minima."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.yamlfile import ConfigError, load_yaml

_INT_OR_NULL = {"type": ["integer", "null"]}
_NUM = {"type": "number"}

SKU_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "display_name", "match", "gpus_per_node"],
    "properties": {
        "id": {"type": "string"},
        "display_name": {"type": "string"},
        "match": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "gpus_per_node": {"type": "integer", "minimum": 1},
        "memory_total_mib_min": {"type": "integer"},
        "memory_total_mib_max": {"type": "integer"},
        # streaming multiprocessors per GPU: SDC probe shapes are sized so every SM runs tiles
        "sm_count": {"type": "integer", "minimum": 1},
        "pcie": {"type": "object", "additionalProperties": False,
                 "properties": {"gen": {"type": "integer"}, "width": {"type": "integer"}}},
        "nvlink": {"type": "object", "additionalProperties": False,
                   "properties": {"links": {"type": "integer", "minimum": 0}}},
        "power": {"type": "object", "additionalProperties": False,
                  "properties": {"tdp_w": _NUM}},
        "thermal": {"type": "object", "additionalProperties": False,
                    "properties": {"slowdown_c": _INT_OR_NULL, "shutdown_c": _INT_OR_NULL}},
        "limits": {"type": "object", "additionalProperties": _NUM},
        # the precisions gpu_burn runs, in order (intersected with what the device supports)
        "burn": {"type": "object", "additionalProperties": False,
                 "properties": {"precisions": {
                     "type": "array", "minItems": 1, "uniqueItems": True,
                     "items": {"enum": ["bf16", "fp16", "tf32", "fp32", "fp8"]}}}},
        "performance": {"type": "object", "additionalProperties": _NUM},
    },
}


@dataclass(frozen=True)
class Sku:
    """One SKU file. ``limit()`` and ``minimum()`` read the thresholds checks grade against."""

    id: str
    display_name: str
    match: tuple[str, ...]
    gpus_per_node: int
    data: dict[str, Any]
    source: str

    def limit(self, key: str, default: float | None = None) -> float | None:
        return self.data.get("limits", {}).get(key, default)

    def minimum(self, key: str) -> float | None:
        return self.data.get("performance", {}).get(key)

    def section(self, key: str) -> dict[str, Any]:
        return dict(self.data.get(key) or {})


def load_sku(path: Path) -> Sku:
    data = load_yaml(path, SKU_SCHEMA, what="SKU file")
    if data["id"] != path.stem:
        raise ConfigError(f"{path}: key 'id': {data['id']!r} must equal the file name "
                          f"{path.stem!r}")
    return Sku(id=data["id"], display_name=data["display_name"], match=tuple(data["match"]),
               gpus_per_node=data["gpus_per_node"], data=data, source=str(path))


def load_skus(graders_dir: Path) -> dict[str, Sku]:
    skus_dir = graders_dir / "skus"
    return {p.stem: load_sku(p) for p in sorted(skus_dir.glob("*.yaml"))}


def match_sku(gpu_names: list[str], skus: dict[str, Sku]) -> Sku | None:
    """The SKU whose ``match`` list names the node's GPUs (all GPUs must agree)."""
    names = {n.strip().lower() for n in gpu_names}
    if len(names) != 1:
        return None
    (name,) = names
    for sku in skus.values():
        if name in (m.lower() for m in sku.match):
            return sku
    return None
