"""Check ``xid``: XIDs and SXids the NVIDIA drivers reported, from the kernel log and NVML events.

Every (GPU, code) becomes one ``fail`` result (metric ``xid``) and every (NVSwitch, code) one
(metric ``sxid``, target ``nvswitch:N``), however many lines the driver printed: count, first and
last time, rate, bursts and the distinct things the lines said (``checks/xid_fold.py``). The
grader gives each its level from ``graders/xid.yaml`` / ``sxid.yaml``, reading the lines where
NVIDIA's catalog decodes them (Xid 144-150, 154). ``since: boot`` (default) reads everything the
kernel still holds for this boot; ``since: last_run`` keeps a cursor in the state directory and
reads only what is new.

The kernel log is read even when NVML cannot be: a GPU that fell off the bus can stop the driver
from loading (realworld/xid/x19: "fallen off the bus" and "probe routine failed"), and that is
exactly when the log must be read. With no finding, such a run still reports why the GPUs could
not be queried (skip or error), never a pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from node_agent.checks import CheckContext
from node_agent.checks.xid_fold import Folder
from node_agent.gpu.base import GpuError
from node_agent.kernel_log import (
    JournalKernelLog,
    KernelLogScanner,
    KmsgKernelLog,
    LogRecord,
    SxidLine,
    Unreadable,
    normalise_bus,
)
from node_agent.model import Result, Status

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_UNREADABLE_KEPT = 5  # example lines kept for a person to look at


def run(ctx: CheckContext) -> list[Result]:
    unavailable = ctx.gpus_unavailable()
    since = ctx.params.get("since", "boot")
    gpus = ctx.inventory.gpus if ctx.inventory is not None else []
    bus_to_target = {normalise_bus(g.pci_bus_id): f"gpu:{g.index}" for g in gpus}
    folder = Folder()
    results: list[Result] = []
    unreadable: list[Unreadable] = []

    log = ctx.kernel_log
    if log.unavailable_reason:
        results.append(ctx.skip(log.unavailable_reason, metric="kernel_log"))
        records: list[LogRecord] = []
    else:
        try:
            records = log.read()
        except OSError as err:
            results.append(ctx.result("node", "kernel_log", Status.ERROR,
                                      f"cannot read the kernel log ({log.source}): {err}",
                                      error=str(err)))
            records = []
    cursor = _load_cursor(ctx, log.source) if since == "last_run" else None
    scanner = KernelLogScanner()
    for record in records:
        if cursor is not None and record.seq <= cursor:
            continue
        for event in scanner.feed(record):
            if isinstance(event, Unreadable):
                unreadable.append(event)
                continue
            target = event.target if isinstance(event, SxidLine) \
                else bus_to_target.get(event.pci_bus, f"pci:{event.pci_bus}")
            folder.add(event, target, log.source)
    if since == "last_run" and records:
        _save_cursor(ctx, log.source, records[-1].seq)

    watch_s = float(ctx.params.get("watch_s", 0))
    if watch_s > 0 and not unavailable:
        try:
            events = ctx.gpu.wait_xid_events(watch_s)
        except GpuError as err:  # no NVML events here, or a hung driver (nvml_health grades
            # that); the kernel log still carries the Xids
            results.append(ctx.skip(f"NVML Xid events not watched: {err}", metric="nvml_events"))
            events, watch_s = [], 0
        for event in events:
            target = f"gpu:{event.gpu_index}" if event.gpu_index is not None else "node"
            folder.fold("xid", target, event.code).add_nvml(event.message)

    window = "since boot" if since == "boot" else "since the last run"
    live = isinstance(log, (KmsgKernelLog, JournalKernelLog))
    boot_epoch = time.time() - time.monotonic() if live else None
    results.extend(fold.result(window=window, boot_epoch=boot_epoch) for fold in folder.sorted())
    if unreadable:
        results.append(_unreadable_result(ctx, unreadable, window))
    if unavailable:
        # no GPU to query: findings in the log still count, but silence is not a pass
        return unavailable + [r for r in results if r.status is not Status.SKIP]
    looked = not log.unavailable_reason or watch_s > 0
    if not folder.folds and not unreadable and looked \
            and not any(r.status is Status.ERROR for r in results):
        results.append(ctx.result("node", "xid", Status.PASS,
                                  f"no XIDs or SXids {window} ({log.source}: {len(records)} "
                                  "lines read"
                                  + (f"; NVML events watched {watch_s:g} s)" if watch_s else ")"),
                                  value=0))
    return results


def _unreadable_result(ctx: CheckContext, lines: list[Unreadable], window: str) -> Result:
    reasons = sorted({u.reason for u in lines})
    codes = sorted({u.code for u in lines if u.code is not None})
    return ctx.result(
        "node", "xid_unreadable", Status.WARN,
        f"{len(lines)} kernel-log line(s) {window} name an Xid or SXid that cannot be read "
        f"({reasons[0]}{' and other reasons' if len(reasons) > 1 else ''}): {lines[0].raw[:200]}",
        value=len(lines), reasons=reasons, codes=codes,
        lines=[u.raw for u in lines[:_UNREADABLE_KEPT]])


def _cursor_path(ctx: CheckContext) -> Path | None:
    return ctx.state_dir / "xid_cursor.json" if ctx.state_dir else None


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def _load_cursor(ctx: CheckContext, source: str) -> int | None:
    path = _cursor_path(ctx)
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("boot_id") == _boot_id() and data.get("source") == source:
            return int(data["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a corrupt cursor means: read since boot, which over-reports rather than hides
    return None


def _save_cursor(ctx: CheckContext, source: str, seq: int) -> None:
    path = _cursor_path(ctx)
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"boot_id": _boot_id(), "source": source, "seq": seq}))
    tmp.replace(path)
