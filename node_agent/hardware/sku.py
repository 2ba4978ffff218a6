"""Per-SKU baselines (``graders/skus/*.yaml``): expected GPUs, limits and performance minima."""

from __future__ import annotations

from collections.abc import Sequence
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
        # the board's GPUs (an HGX baseboard: 8). A VM given part of a board sees fewer: there
        # the count is checked only against node.expected_gpus or a trace of a lost GPU
        # (checks/nvml_health/__init__.py, docs/hosts.md)
        "gpus_per_node": {"type": "integer", "minimum": 1},
        # false for add-in cards: a server carries as many as its build has, so gpus_per_node
        # is only the common full build (and a simulated node's default); the agent then
        # expects what the PCI bus shows unless node.expected_gpus says otherwise
        "gpus_per_node_fixed": {"type": "boolean"},
        # what NVML reports as memory.total (MiB): with the name, it identifies the SKU
        "memory_total_mib_min": {"type": "integer", "minimum": 1},
        "memory_total_mib_max": {"type": "integer", "minimum": 1},
        # streaming multiprocessors per GPU: SDC probe shapes are sized so every SM runs tiles
        "sm_count": {"type": "integer", "minimum": 1},
        # the node's CPUs where they shape a judgment: "grace" (GB200, GB300) has soldered
        # LPDDR5X (no DIMM to name) and may see its GPUs' memory as CPU-less NUMA nodes
        "host_cpu": {"enum": ["grace"]},
        "pcie": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"gen": {"type": "integer"}, "width": {"type": "integer"}},
        },
        # links: NVLinks expected active (0 for PCIe cards, whose bridge is optional); the
        # board's wiring, which a VM may not see (node.expected_nvlinks overrides it);
        # indices: link indices NVML answers for on this part (default: links). A PCIe card
        # answers for its die's links, inactive without a bridge; the simulator reports them.
        # fabric: what nvmlDeviceGetGpuFabricInfoV reports on this hardware (multi_node: a
        # GB200/GB300 NVL72 tray in a rack-wide NVLink domain; nvswitch: an HGX board whose
        # NVSwitches are its own; absent: no fabric), so the simulator answers as it would.
        "nvlink": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "links": {"type": "integer", "minimum": 0},
                "indices": {"type": "integer", "minimum": 0},
                "fabric": {"enum": ["multi_node", "nvswitch"]},
            },
        },
        # the node's RDMA ports as the vendor builds the system (checks/hca_ports.py): how
        # many, and the least rate each should run at
        "hca": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ports": {"type": "integer", "minimum": 1},
                "min_rate_gbps": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        # host software the system needs (checks/software_drift.py): fabric manager on NVSwitch
        # systems, nvidia_peermem for GPUDirect RDMA
        "needs": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"fabricmanager": {"type": "boolean"}, "peermem": {"type": "boolean"}},
        },
        "power": {"type": "object", "additionalProperties": False, "properties": {"tdp_w": _NUM}},
        "thermal": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"slowdown_c": _INT_OR_NULL, "shutdown_c": _INT_OR_NULL},
        },
        "limits": {"type": "object", "additionalProperties": _NUM},
        # the precisions gpu_burn runs, in order (intersected with what the device supports)
        "burn": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "precisions": {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"enum": ["bf16", "fp16", "tf32", "fp32", "fp8"]},
                }
            },
        },
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
        value: float | None = self.data.get("limits", {}).get(key, default)
        return value

    def minimum(self, key: str) -> float | None:
        value: float | None = self.data.get("performance", {}).get(key)
        return value

    def section(self, key: str) -> dict[str, Any]:
        return dict(self.data.get(key) or {})

    @property
    def grace_host(self) -> bool:
        """The node's CPUs are Grace (``host_cpu: grace``): soldered memory, and the GPUs'
        memory possibly onlined as CPU-less NUMA nodes (host/memory.py)."""
        return self.data.get("host_cpu") == "grace"

    @property
    def fixed_gpu_count(self) -> bool:
        """True for a baseboard (HGX, NVL72 tray): every node has ``gpus_per_node`` GPUs."""
        return bool(self.data.get("gpus_per_node_fixed", True))

    @property
    def memory_range(self) -> tuple[int | None, int | None]:
        """``memory_total_mib_min``, ``memory_total_mib_max`` (None where not given)."""
        return self.data.get("memory_total_mib_min"), self.data.get("memory_total_mib_max")

    def names_gpu(self, name: str) -> bool:
        """Whether NVML product name ``name`` is one of this SKU's ``match`` names.

        Case-insensitive, and a leading ``NVIDIA `` is optional on both sides: drivers
        before R470 reported ``A100-SXM4-40GB`` where later ones report
        ``NVIDIA A100-SXM4-40GB`` (public nvidia-smi captures of both).
        """
        return _name_key(name) in {_name_key(m) for m in self.match}

    def memory_problem(self, memory_mib: int | None) -> str | None:
        """Why ``memory_mib`` (NVML memory.total) is not this SKU's, or None when it fits
        (or is unknown)."""
        low, high = self.memory_range
        if memory_mib is None:
            return None
        if low is not None and memory_mib < low:
            return f"{memory_mib} MiB is below the {low} MiB of SKU {self.id}"
        if high is not None and memory_mib > high:
            return f"{memory_mib} MiB is above the {high} MiB of SKU {self.id}"
        return None

    def describe_memory(self) -> str:
        low, high = self.memory_range
        return (
            f"{self.id}: {low if low is not None else '?'}-{high if high is not None else '?'} MiB"
        )


def _name_key(name: str) -> str:
    key = " ".join(name.split()).lower()
    return key.removeprefix("nvidia ")


def load_sku(path: Path) -> Sku:
    data = load_yaml(path, SKU_SCHEMA, what="SKU file")
    if data["id"] != path.stem:
        raise ConfigError(
            f"{path}: key 'id': {data['id']!r} must equal the file name {path.stem!r}"
        )
    low, high = data.get("memory_total_mib_min"), data.get("memory_total_mib_max")
    if low is not None and high is not None and low > high:
        raise ConfigError(
            f"{path}: key 'memory_total_mib_max': {high} is below "
            f"memory_total_mib_min {low}; expected max >= min"
        )
    nvlink = data.get("nvlink") or {}
    if nvlink.get("indices", nvlink.get("links", 0)) < nvlink.get("links", 0):
        raise ConfigError(
            f"{path}: key 'nvlink.indices': {nvlink['indices']} is below "
            f"nvlink.links {nvlink['links']}; expected indices >= links"
        )
    return Sku(
        id=data["id"],
        display_name=data["display_name"],
        match=tuple(data["match"]),
        gpus_per_node=data["gpus_per_node"],
        data=data,
        source=str(path),
    )


def load_skus(graders_dir: Path) -> dict[str, Sku]:
    skus_dir = graders_dir / "skus"
    return {p.stem: load_sku(p) for p in sorted(skus_dir.glob("*.yaml"))}


@dataclass(frozen=True)
class SkuMatch:
    """The SKU a node's GPUs are, or (``sku`` None) why none could be chosen."""

    sku: Sku | None
    problem: str | None = None


def match_sku(gpus: Sequence[tuple[str, int | None]], skus: dict[str, Sku]) -> SkuMatch:
    """The SKU whose ``match`` names the node's GPUs and whose memory range holds their
    memory.total (``gpus``: NVML name and MiB, None where not reported).

    All GPUs must share one name. The node's median memory decides between SKU files of the
    same name (H20 96 GB / 141 GB, GB300 NVL72 / DGX Station); a GPU off that range on an
    otherwise matching node is reported per GPU by the inventory check, not here.
    """
    if not gpus:
        return SkuMatch(None)
    names = sorted({" ".join(n.split()) for n, _ in gpus}, key=str.lower)
    if len({_name_key(n) for n in names}) != 1:
        return SkuMatch(
            None,
            f"the GPUs are of different models ({', '.join(names)}): no "
            "one SKU baseline applies; set node.sku to grade them against one",
        )
    name = names[0]
    candidates = [s for s in skus.values() if s.names_gpu(name)]
    if not candidates:
        return SkuMatch(
            None,
            f"no SKU file under graders/skus/ matches GPU name {name!r}: "
            "expected GPU count, NVLinks and performance minima are unknown "
            "(limits come from NVML alone); add a SKU file or set node.sku",
        )
    memories = sorted(m for _, m in gpus if m is not None)
    typical = memories[(len(memories) - 1) // 2] if memories else None
    fitting = [s for s in candidates if s.memory_problem(typical) is None]
    if len(fitting) == 1:
        return SkuMatch(fitting[0])
    ranges = "; ".join(s.describe_memory() for s in candidates)
    if not fitting:
        return SkuMatch(
            None,
            f"GPU name {name!r} is that of SKU file(s) {ranges}, but these "
            f"GPUs report {typical} MiB: another variant of this GPU; add a "
            "SKU file for it or set node.sku",
        )
    return SkuMatch(
        None,
        f"GPU {name!r} with {typical} MiB matches several SKU files "
        f"({ranges}): narrow their memory_total_mib_min/max, or set node.sku",
    )
