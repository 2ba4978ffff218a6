"""Suite definitions (``suites/*.yaml``): which checks run, in what order, with what limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.checking.registry import REGISTRY, parse_params
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
#: the params key whose values apply over the others on a stand-in node (DESIGN.md: load checks
#: run their real code on the CPU at small sizes); on a real host it is dropped
STAND_IN_OVERLAY = "simulated"


@dataclass(frozen=True)
class CheckSpec:
    """One entry of a suite. Its ``params`` are parsed through the check's ``Params``
    (checking/params.py) when the entry is made, for a real host and for a stand-in node (the
    ``simulated`` overlay applied): a bad value is a ConfigError naming the check and the key,
    before anything runs."""

    check: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    params: dict[str, Any] = field(default_factory=dict)
    every_s: float | None = None  # daemon cadence; None: the daemon's default_every_s
    typed: object | None = field(default=None, init=False, compare=False, repr=False)
    typed_stand_in: object | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for attr, stand_in in (("typed", False), ("typed_stand_in", True)):
            try:
                parsed = parse_params(self.check, self.params_for(stand_in))
            except ValueError as err:
                overlay = f" (with its {STAND_IN_OVERLAY!r} overlay)" if stand_in else ""
                raise ConfigError(f"check {self.check!r}{overlay}: {err}") from None
            object.__setattr__(self, attr, parsed)

    def params_for(self, stand_in: bool) -> dict[str, Any]:
        """The params the check gets on a real host, or on a stand-in node (the overlay over
        the others)."""
        params = dict(self.params)
        overlay = params.pop(STAND_IN_OVERLAY, None) or {}
        if stand_in:
            params.update(overlay)
        return params

    def typed_for(self, stand_in: bool) -> object | None:
        return self.typed_stand_in if stand_in else self.typed


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
        try:
            spec = CheckSpec(
                check=raw["check"],
                timeout_s=float(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
                params=dict(raw.get("params") or {}),
                every_s=None if raw.get("every_s") is None else float(raw["every_s"]),
            )
        except ConfigError as err:
            raise ConfigError(
                f"{path}: suite {data['name']!r}, key 'checks.{i}.params': {err}"
            ) from None
        checks.append(spec)
    return Suite(
        name=data["name"],
        mode=data["mode"],
        checks=tuple(checks),
        source=str(path),
        description=data.get("description", ""),
    )
