"""Check ``xid``: XIDs and SXids the NVIDIA drivers reported, from the kernel log and NVML events.

Every (GPU, code) becomes one ``fail`` result (metric ``xid``) and every (NVSwitch, code) one
(metric ``sxid``, target ``nvswitch:N``), however many lines the driver printed: count, first and
last time, rate, bursts and the distinct things the lines said (``checking/xid_fold.py``). The
grader gives each its level from ``graders/xid.yaml`` / ``sxid.yaml``, reading the lines where
NVIDIA's catalog decodes them (Xid 144-150, 154). ``since: boot`` (default) reads everything the
kernel still holds for this boot; ``since: last_run`` keeps a cursor in the state directory and
reads only what is new.

In the daemon the check is event-driven as well: its watcher (``watch.py``, declared in
``SERVICE``) follows NVML's Xid events and the kernel log as they happen, and the daemon grades
each finding it hands back at once, under the same sticky key as this run's findings.

Only what the driver wrote is believed (``kernel_log``'s rules of belief: kernel facility, the
message starting with the driver's prefix, never a user's fault report). On this host's own log
(kmsg, the journal) a bus id that the PCI bus in sysfs shows is no NVIDIA device (vendor
0x10de) is never graded as a GPU: the line becomes ``xid_unreadable`` (WARN) with that reason.
A saved log (``kernel_log.path``) and a stand-in node (``ports.bus_ids_as_printed``) have no
sysfs of their own to ask: their bus ids are taken as printed, and the result says which
applied. Where NVML reported the same
Xid through its event API (``watch_s``), the finding says it is corroborated.

The driver's lines without an Xid (reset required, RmInitAdapter failed, GPU lost) and PCIe AER
uncorrectable errors on a GPU's bus become one result per (target, kind) whose metric and status
``graders/driver_lines.yaml`` gives; a driver line that names no GPU's bus (``NVRM: GPU5 ...``)
is the node's, metric ``driver_line_no_gpu``, WARN at most whatever its kind.

The kernel log is read even when NVML cannot be: a GPU that fell off the bus can stop the driver
from loading (realworld/xid/x19: "fallen off the bus" and "probe routine failed"), and that is
exactly when the log must be read. With no finding, such a run still reports why the GPUs could
not be queried (skip or error), never a pass.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import resources
from node_agent.checking import log_cursor
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.xid_fold import DriverFold, Folder, keep_fuller
from node_agent.checks.xid.buses import nvidia_buses
from node_agent.checks.xid.watch import watcher
from node_agent.gpu.base import GpuError
from node_agent.hardware.driver_lines import (
    DRIVER_LINE_KINDS,
    OPTIONAL_KINDS,
    DriverLineKind,
    load_driver_lines,
)
from node_agent.kernel_log import (
    DriverLine,
    KernelLogScanner,
    SxidLine,
    Unreadable,
    normalise_bus,
)
from node_agent.model import Result, Status

_UNREADABLE_KEPT = 5  # example lines kept for a person to look at
#: the metric of a driver line that names no GPU (``NVRM: GPU5 ...``: the driver's own number,
#: not NVML's index; no bus): WARN at most, whatever its kind. Which GPU it is cannot be known,
#: and a line that names none is the form a user's text could most easily take (issue 34).
NO_GPU_METRIC = "driver_line_no_gpu"


def sticky_key(result: Result) -> tuple[str, int] | tuple[str, str, str] | None:
    """A finding stays part of the daemon's grade for its life, whichever window a later run
    reads (the periodic suite reads ``since: last_run``: a line is read once): an Xid or SXid
    one per (target, code), and a driver line's (gpu-lost, reset-required, init-failed, AER,
    ...: ``graders/driver_lines.yaml``, fail or warn) one per (metric, target, kind). The
    check's watcher (``watch.py``) files its Xid findings under the same key."""
    if result.metric in ("xid", "sxid") and result.status is Status.FAIL:
        if isinstance(result.value, (int, float)) and not isinstance(result.value, bool):
            return (result.target, int(result.value))
    kind = (result.evidence or {}).get("kind")
    if (
        result.status in (Status.FAIL, Status.WARN)
        and isinstance(kind, str)
        and kind in DRIVER_LINE_KINDS + OPTIONAL_KINDS
    ):
        return (result.metric, result.target, kind)
    return None


SERVICE = ServiceBehaviour(sticky=sticky_key, fold=keep_fuller, watcher=watcher)


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    since: str = "boot"  # the kernel lines read: since boot, or since the last run
    watch_s: float = 0.0  # above 0: also wait this long for NVML's Xid events

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("xid", raw, cls)
        return cls(
            since=r.choice("since", ("boot", "last_run")),
            watch_s=r.number("watch_s", at_least=0),
        )


def run(ctx: CheckContext) -> list[Result]:
    unavailable = ctx.gpus_unavailable()
    params = ctx.typed_params(Params)
    since = params.since
    gpus = ctx.inventory.gpus if ctx.inventory is not None else []
    bus_to_target = {normalise_bus(g.pci_bus_id): f"gpu:{g.index}" for g in gpus}
    folder = Folder()
    driver_folds: dict[tuple[str, str], DriverFold] = {}
    results: list[Result] = []
    unreadable: list[Unreadable] = []

    log = ctx.kernel_log
    nvidia = None if ctx.ports.bus_ids_as_printed else nvidia_buses(log)
    read, problem = log_cursor.read_log(ctx)
    records = read or []
    if problem is not None:
        results.append(problem)
    cursor = log_cursor.load(_cursor_path(ctx), log.source) if since == "last_run" else None
    scanner = KernelLogScanner()
    for record in records:
        if cursor is not None and record.seq <= cursor:
            continue
        for event in scanner.feed(record):
            if isinstance(event, Unreadable):
                unreadable.append(event)
                continue
            if isinstance(event, DriverLine):
                _add_driver_line(event, bus_to_target, nvidia, driver_folds, unreadable, log.source)
                continue
            bus = normalise_bus(event.pci_bus)
            if nvidia is not None and bus not in bus_to_target and bus not in nvidia:
                unreadable.append(Unreadable(_not_nvidia(bus), event.raw, event.code))
                continue
            target = (
                event.target
                if isinstance(event, SxidLine)
                else bus_to_target.get(event.pci_bus, f"pci:{event.pci_bus}")
            )
            folder.add(event, target, log.source)
    if since == "last_run" and records:
        log_cursor.save(_cursor_path(ctx), log.source, records[-1].seq)

    watch_s = params.watch_s
    if watch_s > 0 and not unavailable:
        watch_s = _watch_nvml(ctx, folder, watch_s, results)

    window = "since boot" if since == "boot" else "since the last run"
    boot_epoch = time.time() - time.monotonic() if log.live else None
    results.extend(fold.result(window=window, boot_epoch=boot_epoch) for fold in folder.sorted())
    results.extend(_driver_results(ctx, driver_folds, window, boot_epoch))
    for result in results:  # every finding says whether its bus ids were checked
        if result.status is not Status.SKIP and result.metric != "kernel_log":
            result.evidence.setdefault("bus_ids", _bus_check(ctx, nvidia))
    if unreadable:
        results.append(_unreadable_result(ctx, unreadable, window))
    if unavailable:
        # no GPU to query: findings in the log still count, but silence is not a pass
        return unavailable + [r for r in results if r.status is not Status.SKIP]
    looked = not log.unavailable_reason or watch_s > 0
    if (
        not folder.folds
        and not driver_folds
        and not unreadable
        and looked
        and not any(r.status is Status.ERROR for r in results)
    ):
        results.append(
            ctx.result(
                "node",
                "xid",
                Status.PASS,
                f"no XIDs, SXids or driver errors {window} ({log.source}: "
                f"{len(records)} lines read"
                + (f"; NVML events watched {watch_s:g} s" if watch_s else "")
                + f"; {_bus_check(ctx, nvidia)})",
                value=0,
                bus_ids=_bus_check(ctx, nvidia),
            )
        )
    return results


def _watch_nvml(ctx: CheckContext, folder: Folder, watch_s: float, results: list[Result]) -> float:
    """NVML's Xid events for ``watch_s`` folded in; the seconds watched (0 when NVML cannot
    watch, with a skip appended to ``results``)."""
    try:
        events = ctx.gpu.wait_xid_events(watch_s)
    except GpuError as err:  # no NVML events here, or a hung driver (nvml_health grades
        # that); the kernel log still carries the Xids
        results.append(ctx.skip(f"NVML Xid events not watched: {err}", metric="nvml_events"))
        return 0
    for nvml_event in events:
        target = f"gpu:{nvml_event.gpu_index}" if nvml_event.gpu_index is not None else "node"
        folder.fold("xid", target, nvml_event.code).add_nvml(nvml_event.message)
    return watch_s


def _driver_results(
    ctx: CheckContext,
    driver_folds: dict[tuple[str, str], DriverFold],
    window: str,
    boot_epoch: float | None,
) -> list[Result]:
    """One result per (bus, kind) of the driver's other error lines, graded by its kind."""
    if not driver_folds:
        return []
    kinds = driver_line_kinds(ctx)
    out = []
    for key in sorted(driver_folds):
        fold, kind = driver_folds[key], kinds[key[1]]
        if fold.pci_bus is None:  # the line names no GPU: never more than a WARN
            out.append(fold.result(NO_GPU_METRIC, Status.WARN, kind.name, window, boot_epoch))
            continue
        out.append(fold.result(kind.metric, Status(kind.status), kind.name, window, boot_epoch))
    return out


def driver_line_kinds(ctx: CheckContext) -> dict[str, DriverLineKind]:
    """``driver_lines.yaml`` from the configured graders directory (the shipped one where an
    operator's directory predates the file)."""
    path = resources.graders_dir(ctx.config) / "driver_lines.yaml"
    if not path.exists():
        path = resources.shipped_graders_dir() / "driver_lines.yaml"
    return load_driver_lines(path)


def _bus_check(ctx: CheckContext, nvidia: frozenset[str] | None) -> str:
    if nvidia is not None:
        return "bus ids checked against this host's PCI bus (sysfs)"
    if ctx.ports.bus_ids_as_printed:
        return ctx.ports.bus_ids_as_printed
    if not ctx.kernel_log.live:
        return "bus ids taken as printed (a saved log: no sysfs of its host to ask)"
    return "bus ids taken as printed (sysfs could not be listed)"


def _not_nvidia(bus: str) -> str:
    return (
        f"the line names bus {bus}, which this host's PCI bus (sysfs) shows is no NVIDIA "
        "device (vendor 0x10de): not graded as a GPU"
    )


def _add_driver_line(
    line: DriverLine,
    bus_to_target: dict[str, str],
    nvidia: frozenset[str] | None,
    folds: dict[tuple[str, str], DriverFold],
    unreadable: list[Unreadable],
    source: str,
) -> None:
    bus = line.pci_bus
    if line.kind.startswith("aer-"):
        # AER on any device is printed alike: only a GPU's is this check's business
        is_gpu = bus is not None and (
            bus in bus_to_target
            or (bus in nvidia if nvidia is not None else line.device_driver == "nvidia")
        )
        if not is_gpu:
            return
    elif bus is not None and nvidia is not None and bus not in bus_to_target and bus not in nvidia:
        unreadable.append(Unreadable(_not_nvidia(bus), line.raw))
        return
    target = "node" if bus is None else bus_to_target.get(bus, f"pci:{bus}")
    key = (target, line.kind)
    fold = folds.get(key)
    if fold is None:
        fold = folds[key] = DriverFold(kind=line.kind, target=target)
    fold.add(line, source)


def _unreadable_result(ctx: CheckContext, lines: list[Unreadable], window: str) -> Result:
    reasons = sorted({u.reason for u in lines})
    codes = sorted({u.code for u in lines if u.code is not None})
    return ctx.result(
        "node",
        "xid_unreadable",
        Status.WARN,
        f"{len(lines)} kernel-log line(s) {window} name an Xid or SXid that cannot be read "
        f"({reasons[0]}{' and other reasons' if len(reasons) > 1 else ''}): {lines[0].raw[:200]}",
        value=len(lines),
        reasons=reasons,
        codes=codes,
        lines=[u.raw for u in lines[:_UNREADABLE_KEPT]],
    )


def _cursor_path(ctx: CheckContext) -> Path | None:
    return ctx.state_dir / "xid_cursor.json" if ctx.state_dir else None
