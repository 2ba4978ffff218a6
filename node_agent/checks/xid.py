"""Check ``xid``: XIDs the NVIDIA driver reported, from the kernel log and NVML events.

Each distinct (GPU, code) becomes one ``fail`` result with its count and first/last lines; the
grader gives it a level from the XID catalog (``graders/xid.yaml``). ``since: boot`` (default)
reads everything the kernel still holds for this boot; ``since: last_run`` keeps a cursor in
the state directory and reads only what is new.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.checks import CheckContext
from node_agent.gpu.base import GpuError, XidEvent
from node_agent.kernel_log import LogRecord, normalise_bus, parse_xid_line
from node_agent.model import Result, Status

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass
class _Seen:
    target: str
    code: int
    count: int = 0
    lines: list[str] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)


def run(ctx: CheckContext) -> list[Result]:
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return unavailable
    since = ctx.params.get("since", "boot")
    bus_to_target = {normalise_bus(g.pci_bus_id): f"gpu:{g.index}" for g in ctx.inventory.gpus}
    seen: dict[tuple[str, int], _Seen] = {}
    results: list[Result] = []

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
    for record in records:
        if cursor is not None and record.seq <= cursor:
            continue
        xid = parse_xid_line(record.text)
        if xid is None:
            continue
        target = bus_to_target.get(xid.pci_bus, f"pci:{xid.pci_bus}")
        entry = seen.setdefault((target, xid.code), _Seen(target, xid.code))
        entry.count += 1
        entry.sources.add(log.source)
        if len(entry.lines) < 2:
            entry.lines.append(xid.raw)
        else:
            entry.lines[-1] = xid.raw  # keep the first and the latest line
    if since == "last_run" and records:
        _save_cursor(ctx, log.source, records[-1].seq)

    watch_s = float(ctx.params.get("watch_s", 0))
    events: list[XidEvent] = []
    if watch_s > 0:
        try:
            events = ctx.gpu.wait_xid_events(watch_s)
        except GpuError as err:  # no NVML events here, or a hung driver (nvml_health grades
            # that); the kernel log still carries the Xids
            results.append(ctx.skip(f"NVML Xid events not watched: {err}", metric="nvml_events"))
            watch_s = 0
        for event in events:
            target = f"gpu:{event.gpu_index}" if event.gpu_index is not None else "node"
            entry = seen.setdefault((target, event.code), _Seen(target, event.code))
            entry.count += 1
            entry.sources.add("nvml-event")
            if len(entry.lines) < 2:
                entry.lines.append(f"NVML event: Xid {event.code} {event.message}".strip())

    window = "since boot" if since == "boot" else "since the last run"
    for (target, code), entry in sorted(seen.items()):
        results.append(ctx.result(
            target, "xid", Status.FAIL,
            f"Xid {code} on {target}, {entry.count} time(s) {window}: {entry.lines[0]}",
            value=code, count=entry.count, lines=entry.lines, sources=sorted(entry.sources)))
    looked = not log.unavailable_reason or watch_s > 0
    if not seen and looked and not any(r.status is Status.ERROR for r in results):
        results.append(ctx.result("node", "xid", Status.PASS,
                                  f"no XIDs {window} ({log.source}: {len(records)} lines read"
                                  + (f"; NVML events watched {watch_s:g} s)" if watch_s else ")"),
                                  value=0))
    return results


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
