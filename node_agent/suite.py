"""Suite definitions (``suites/*.yaml``): which checks run, in what order, with what limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.checks import REGISTRY
from node_agent.yamlfile import ConfigError, load_yaml

SUITE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "mode", "checks"],
    "properties": {
        "name": {"type": "string"},
        "description": {"type": "string"},
        "mode": {"enum": ["delivery", "service"]},
        "checks": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["check"],
                "properties": {
                    "check": {"type": "string"},
                    "timeout_s": {"type": "number", "exclusiveMinimum": 0},
                    "params": {"type": "object"},
                    # the daemon's cadence for this check (periodic suite); ignored by accept/check
                    "every_s": {"type": "number", "exclusiveMinimum": 0},
                },
            },
        },
    },
}

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CheckSpec:
    check: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    params: dict[str, Any] = field(default_factory=dict)
    every_s: float | None = None  # daemon cadence; None: the daemon's default_every_s


@dataclass(frozen=True)
class Suite:
    name: str
    mode: str
    checks: tuple[CheckSpec, ...]
    source: str
    description: str = ""

    def only(self, names: list[str]) -> Suite:
        """The suite restricted to ``names`` (``--only``), in the suite's order."""
        unknown = [n for n in names if n not in {c.check for c in self.checks}]
        if unknown:
            raise ConfigError(
                f"--only: {', '.join(unknown)} not in suite {self.name!r} "
                f"(it has: {', '.join(c.check for c in self.checks)})"
            )
        return Suite(
            self.name,
            self.mode,
            tuple(c for c in self.checks if c.check in names),
            self.source,
            self.description,
        )


def load_suite(name_or_path: str, suites_dir: Path) -> Suite:
    """A suite by name (``suites_dir/NAME.yaml``) or by path to a YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or "/" in name_or_path):
        path = suites_dir / f"{name_or_path}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in suites_dir.glob("*.yaml"))
            raise ConfigError(
                f"suite {name_or_path!r} not found in {suites_dir}; "
                f"known suites: {', '.join(known)}"
            )
    data = load_yaml(path, SUITE_SCHEMA, what="suite file")
    checks = []
    for i, raw in enumerate(data["checks"]):
        if raw["check"] not in REGISTRY:
            raise ConfigError(
                f"{path}: key 'checks.{i}.check': unknown check {raw['check']!r}; "
                f"known checks: {', '.join(sorted(REGISTRY))}"
            )
        checks.append(
            CheckSpec(
                check=raw["check"],
                timeout_s=float(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
                params=dict(raw.get("params") or {}),
                every_s=None if raw.get("every_s") is None else float(raw["every_s"]),
            )
        )
    return Suite(
        name=data["name"],
        mode=data["mode"],
        checks=tuple(checks),
        source=str(path),
        description=data.get("description", ""),
    )
