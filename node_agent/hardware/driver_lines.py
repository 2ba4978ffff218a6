"""The driver's kernel-log lines that carry no Xid (``graders/driver_lines.yaml``): what each
kind becomes as a result, and the level the grading rules must give it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.model import Level
from node_agent.yamlfile import load_yaml

_LEVELS = ["HEALTHY", "WARN", "ERROR", "FAULT"]

#: the kinds node_agent.kernel_log.DriverLine reads; the file must give each of them
DRIVER_LINE_KINDS = (
    "gpu-lost",
    "reset-required",
    "init-failed",
    "aer-uncorrectable",
    "aer-recovery-failed",
)

#: kinds a graders directory may leave out: the built-in entry below applies where it does
OPTIONAL_KINDS = ("va-space-exhausted",)

DRIVER_LINES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kinds"],
    "properties": {
        "kinds": {
            "type": "object",
            "additionalProperties": False,
            "required": list(DRIVER_LINE_KINDS),
            "properties": {
                kind: {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "metric", "status", "level", "why"],
                    "properties": {
                        "name": {"type": "string"},
                        "metric": {"type": "string", "pattern": r"^[a-z][a-z0-9_]*$"},
                        "status": {"enum": ["fail", "warn"]},
                        "level": {"enum": _LEVELS},
                        "why": {"type": "string"},
                    },
                }
                for kind in DRIVER_LINE_KINDS + OPTIONAL_KINDS
            },
        }
    },
}


@dataclass(frozen=True)
class DriverLineKind:
    """One kind of driver line: the result it becomes (metric, status) and the level the rules
    must give it (checked by the tests against graders/rules.yaml)."""

    kind: str
    name: str
    metric: str
    status: str  # "fail" | "warn"
    level: Level


#: The built-in entries of the optional kinds. ``va-space-exhausted`` (issue 37): WARN. The
#: driver ran out of a GPU's virtual address space for mappings (BAR1), which a workload's own
#: allocations do (open-gpu-kernel-modules#1140, #1187: a browser, a desktop session); in the
#: field it ended in a locked GPU, which the driver then reports itself (an RC watchdog, an Xid,
#: NVML), graded by those. The line names no GPU, and a driver line that names none is WARN at
#: most (docs/xid.md, "Rules of belief").
BUILTIN_KINDS = {
    "va-space-exhausted": DriverLineKind(
        kind="va-space-exhausted",
        name="GPU virtual address space exhausted (can't alloc VA space, NV_ERR_NO_MEMORY)",
        metric="gpu_va_space_exhausted",
        status="warn",
        level=Level.WARN,
    ),
}


def load_driver_lines(path: Path) -> dict[str, DriverLineKind]:
    """``graders/driver_lines.yaml`` (ConfigError when invalid or a kind is missing); the
    optional kinds it leaves out get their built-in entries."""
    data = load_yaml(path, DRIVER_LINES_SCHEMA, what="driver-line catalog")
    kinds = dict(BUILTIN_KINDS)
    for kind, raw in data["kinds"].items():
        kinds[kind] = DriverLineKind(
            kind=kind,
            name=raw["name"],
            metric=raw["metric"],
            status=raw["status"],
            level=Level.parse(raw["level"]),
        )
    return kinds
