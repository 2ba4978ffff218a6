"""Event-driven XID detection for the daemon: NVML events and the kernel log, as they happen.

Two threads, each blocking on its source with a short timeout so it notices a stop request:
- NVML: ``GpuBackend.wait_xid_events`` (``nvmlEventSetWait``); a backend that does not report
  events (NotSupported) is logged once and left to the kernel log.
- Kernel log: ``/dev/kmsg`` followed from an open fd (``KmsgFollower``); other sources (the
  journal, the simulator's lines) are re-read every ``poll_s``.
Every sighting goes to ``on_xid``; the daemon deduplicates and grades. The sources are read
through getters because the daemon swaps its environment (driver reload, scenario change).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.gpu.base import GpuBackend, GpuError, NotSupported
from node_agent.kernel_log import (
    KernelLog,
    KmsgFollower,
    KmsgKernelLog,
    normalise_bus,
    parse_xid_line,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XidSighting:
    code: int
    gpu_index: int | None   # None when the source names no GPU we know
    pci_bus: str | None     # normalised "0000:3b:00" from the kernel log
    source: str             # "nvml-event" or the kernel-log source
    line: str


class XidWatch:
    def __init__(self, gpu: Callable[[], GpuBackend], kernel_log: Callable[[], KernelLog],
                 on_xid: Callable[[XidSighting], None], poll_s: float = 0.5) -> None:
        self._gpu = gpu
        self._kernel_log = kernel_log
        self._on_xid = on_xid
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("xid-nvml", self._nvml_loop), ("xid-kernel-log", self._log_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _nvml_loop(self) -> None:
        unsupported_by: GpuBackend | None = None
        while not self._stop.is_set():
            backend = self._gpu()
            if backend.unavailable_reason or backend is unsupported_by:
                self._stop.wait(self._poll_s)
                continue
            try:
                events = backend.wait_xid_events(self._poll_s)
            except NotSupported as err:
                log.info("NVML does not report XID events here (%s); the kernel log is watched",
                         err)
                unsupported_by = backend
                continue
            except GpuError as err:
                log.warning("NVML XID event wait failed: %s; retrying", err)
                self._stop.wait(1.0)
                continue
            for event in events:
                self._emit(XidSighting(event.code, event.gpu_index, None, "nvml-event",
                                       f"NVML event: Xid {event.code} {event.message}".strip()))

    def _log_loop(self) -> None:
        follower: KmsgFollower | None = None
        followed: KernelLog | None = None
        seen_seq: dict[int, str] = {}
        while not self._stop.is_set():
            source = self._kernel_log()
            if source.unavailable_reason:
                self._stop.wait(self._poll_s * 4)
                continue
            try:
                if isinstance(source, KmsgKernelLog):
                    if followed is not source:
                        if follower:
                            follower.close()
                        follower, followed = KmsgFollower(source.path), source
                    records = follower.wait(self._poll_s)
                else:
                    records = [r for r in source.read() if seen_seq.get(r.seq) != r.text]
                    seen_seq.update((r.seq, r.text) for r in records)
                    self._stop.wait(self._poll_s)
            except OSError as err:
                log.warning("kernel log %s unreadable: %s; retrying", source.source, err)
                self._stop.wait(2.0)
                continue
            for record in records:
                xid = parse_xid_line(record.text)
                if xid is not None:
                    self._emit(XidSighting(xid.code, None, normalise_bus(xid.pci_bus),
                                           source.source, xid.raw))
        if follower:
            follower.close()

    def _emit(self, sighting: XidSighting) -> None:
        try:
            self._on_xid(sighting)
        except Exception:  # noqa: BLE001 - the watch must outlive a bad handler
            log.exception("handling %s failed", sighting)
