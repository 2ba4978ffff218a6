"""What the host checks share: where they read (the host, a test's tree, or the tree of the
node's ``ports``), their thresholds (``graders/host.yaml``), and counters kept between runs.

Params every host check takes (tests point them at trees of their own): ``sys_root`` (default
``/sys``), ``proc_root`` (``/proc``), ``dev_root`` (``/dev``); the tools come from the config
(``host.ipmitool``, ``host.nvme``, ``host.smartctl``, and FreeIPMI's ``host.ipmi_sensors`` and
``host.ipmi_sel``) unless ``params`` name them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from node_agent import atomic_file
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import load_topic
from node_agent.host.paths import HostPaths
from node_agent.model import Result

_NUM = {"type": "number", "minimum": 0}
HOST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "memory": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "ce_per_24h_max": _NUM,
                "missing_dimm_fraction": _NUM,
                "dimm_gib_default": _NUM,
                "memtotal_reserved_fraction": _NUM,
            },
        },
        "nvme": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"percent_used_max": _NUM},
        },
        "pcie_aer": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"correctable_growth_max": _NUM, "correctable_per_hour_max": _NUM},
        },
        "cpu": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"throttle_growth_max": _NUM},
        },
        "power": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"sel_recent_h": _NUM},
        },
    },
}


def thresholds(ctx: CheckContext, section: str) -> dict[str, float]:
    """``graders/host.yaml``'s ``section``: the operator's keys over the shipped file's
    (:func:`~node_agent.checking.thresholds.load_topic`; the shipped file holds every key and
    its source). ConfigError when a file is malformed."""
    data = load_topic(ctx.config, "host", HOST_SCHEMA, "host grading file")
    values: dict[str, float] = data[section]
    return values


H = TypeVar("H", bound="HostParams")


@dataclass(frozen=True)
class HostParams:
    """The roots and tools a host check reads (a suite's ``params``, for tests: a tree of
    their own), validated by :meth:`parse`; each host check's ``Params`` subclasses it.
    None: the node's (this host's ``/sys``, ``/proc``, ``/dev`` and config ``host.*`` tools,
    or a stand-in's tree)."""

    CHECK: ClassVar[str] = "host"

    sys_root: str | None = None
    proc_root: str | None = None
    dev_root: str | None = None
    ipmitool: str | None = None
    nvme: str | None = None
    smartctl: str | None = None
    ipmi_sensors: str | None = None
    ipmi_sel: str | None = None

    @classmethod
    def parse(cls: type[H], raw: Mapping[str, Any]) -> H:
        """ValueError naming the key and what was expected."""
        r = Reader(cls.CHECK, raw, cls)
        return cls(**{f.name: r.optional_string(f.name) for f in fields(cls)})

    @classmethod
    def of(cls, check: str) -> type[HostParams]:
        """The ``Params`` of the host check ``check``: these fields, its errors naming it."""
        named = type("Params", (cls,), {"CHECK": check, "__doc__": cls.__doc__})
        return dataclass(frozen=True)(named)


@contextlib.contextmanager
def host_paths(ctx: CheckContext, parts: tuple[str, ...]) -> Iterator[HostPaths]:
    """The roots and tools to read: a ``sys_root`` param's tree (a test's), else the tree the
    node's ports build for ``parts`` (a stand-in host's, written to a temporary directory for
    this run), else the real host's."""
    p = ctx.typed_params(HostParams)
    if ctx.ports.host_tree is not None and p.sys_root is None:
        with ctx.ports.host_tree(parts) as paths:
            yield paths
        return
    tools = ctx.config.host
    yield HostPaths(
        sys=Path(p.sys_root or "/sys"),
        proc=Path(p.proc_root or "/proc"),
        dev=Path(p.dev_root or "/dev"),
        ipmitool=p.ipmitool or tools.ipmitool,
        nvme=p.nvme or tools.nvme,
        smartctl=p.smartctl or tools.smartctl,
        ipmi_sensors=p.ipmi_sensors or tools.ipmi_sensors,
        ipmi_sel=p.ipmi_sel or tools.ipmi_sel,
    )


def not_recorded(ctx: CheckContext, metric: str) -> list[Result] | None:
    """For a node whose host hardware cannot be judged (a captured node replayed through
    ``--simulate``, docs/capture.md: its host was not recorded), the skip that says so, rather
    than a judgment of a model of it; None where the host checks read it."""
    if ctx.ports.host_unrecorded is not None and ctx.typed_params(HostParams).sys_root is None:
        return [ctx.skip(ctx.ports.host_unrecorded, metric=metric)]
    return None


def read_host(
    ctx: CheckContext,
    metric: str,
    parts: tuple[str, ...],
    judge: Callable[[CheckContext, HostPaths], list[Result]],
) -> list[Result]:
    """A host check's ``run``: on a node whose host was not recorded, the skip that says so
    (reported as ``metric``); else ``judge`` over the paths of ``parts`` (:func:`host_paths`)."""
    if skip := not_recorded(ctx, metric):
        return skip
    with host_paths(ctx, parts) as paths:
        return judge(ctx, paths)


def tool_timeout_s(ctx: CheckContext) -> float:
    """``host.timeout_s``, kept under the check's own timeout."""
    return max(1.0, min(ctx.config.host.timeout_s, ctx.timeout_s * 0.8))


@dataclass
class Counters:
    """Counters a check compares between runs, kept in ``state_dir/<name>.json``.

    ``previous(key)`` is the value of the last run (None on a first run or without a state
    directory: then growth counts from boot, the counters' own zero). A value below the last one
    is a reset (a reboot, a cleared counter), never negative growth."""

    path: Path | None
    last: dict[str, Any]
    now: dict[str, Any]

    @classmethod
    def load(cls, ctx: CheckContext, name: str) -> Counters:
        path = ctx.state_dir / f"{name}.json" if ctx.state_dir else None
        last: dict[str, Any] = {}
        if path is not None:
            try:
                data = json.loads(path.read_text())
                if isinstance(data, dict):
                    last = data
            except (OSError, ValueError):
                last = {}
        return cls(path=path, last=last, now={})

    def growth(self, key: str, value: int) -> int:
        """How much ``value`` grew since the last run (from zero on a first run)."""
        self.now[key] = value
        before = self.last.get(key)
        if not isinstance(before, int) or isinstance(before, bool) or before > value:
            before = 0
        return value - before

    def save(self) -> None:
        if self.path is None:
            return
        try:
            atomic_file.write_json(self.path, {**self.now, "_at": time.time()})
        except OSError:
            pass  # the next run counts from boot again; nothing here is a verdict
