"""The xid check's watcher: XIDs and SXids as they happen, from NVML events and the kernel log.

The daemon starts it (the check's ``SERVICE.watcher``, ``checking/behaviour.py``) and grades
each finding it hands back at once, as the check's own sticky result. Two threads, each blocking
on its source with a short timeout so it notices a stop request:
- NVML: ``GpuBackend.wait_xid_events`` (``nvmlEventSetWait``); a backend that does not report
  events (NotSupported) is logged once and left to the kernel log.
- Kernel log: ``/dev/kmsg`` followed from an open fd (``KmsgFollower``); other sources (the
  journal, a stand-in node's lines) are re-read every ``poll_s`` (``daemon.xid_poll_s``).

Every sighting is folded (``checking/xid_fold.py``): the same code on the same GPU or NVSwitch is
one finding with its count, first/last time, rate, bursts and the variants its lines printed.
``on_xid`` is called with the whole finding, and only when a grader could conclude something new
(the first line, a new variant such as a Fatal line after Nonfatal ones, a new burst) or, while
it keeps counting, at most every ``update_s``. A flood of 800K lines therefore makes a handful
of calls, results and reasons, not 800K.

An NVML event carries the code but not the line, and the line is what decides Xid 144-150 and
154. When the kernel log is readable, an NVML-only finding waits ``nvml_grace_s`` for its kernel
line before it is reported (graded by its code if the line never comes), so a Nonfatal 149 is
never graded by its code first. The sources are read through getters because the daemon swaps
its node (driver reload, scenario change).

The kernel log is believed only where the driver wrote it (``kernel_log``'s rules of belief:
kernel facility, the message starting with ``NVRM: ``/``nvidia-nvswitchN: ``, never a user's
fault report). On this host's own log, a line whose bus the PCI bus in sysfs shows is no NVIDIA
device is logged and dropped, never reported as a GPU's (``buses.py``). The driver's lines
without an Xid and PCIe AER errors are left to the periodic check, which grades them
(``graders/driver_lines.yaml``). When NVML's event and the kernel's line report the same Xid on
the same GPU, the finding's evidence says it is corroborated.

SXids are reported only with ``report_sxid=True`` (the daemon's watcher passes it: its findings
are named ``nvswitch:N``); without it an SXid would be filed under a PCI address as an Xid, so
SXids are then left to the periodic check.

With ``gpus`` (a getter of the inventory's GPUs) every sighting reaches the handler named: a
GPU's index found from its bus where the source printed only the bus, its ``target``
(``gpu:N``, else ``pci:<bus>``). The watch is also a Prometheus collector
(``node_agent_gpu_xid_errors_total``: occurrences per GPU and code, following the fold's count),
labelled by ``labels``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from node_agent.checking.behaviour import NodeLabels, Sighting, WatchContext
from node_agent.checking.xid_fold import Fold, Folder
from node_agent.checks.xid.buses import nvidia_buses
from node_agent.gpu.base import GpuBackend, GpuError, NotSupported
from node_agent.kernel_log import (
    DriverLine,
    KernelLog,
    KernelLogScanner,
    KmsgFollower,
    KmsgKernelLog,
    LogRecord,
    Stamp,
    SxidLine,
    Unreadable,
    normalise_bus,
)
from node_agent.model import Result, Status

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger(__name__)


class _InventoryGpu(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def pci_bus_id(self) -> str: ...


_GPU_TARGET = re.compile(r"^gpu:(\d+)$")


@dataclass(frozen=True)
class XidSighting:
    """One finding as the watch has folded it so far (the daemon keeps the latest per key)."""

    code: int
    gpu_index: int | None  # None when the source names no GPU we know
    pci_bus: str | None  # normalised "0000:3b:00" from the kernel log (the NVSwitch's for SXid)
    source: str  # "nvml-event" and/or the kernel-log source
    line: str  # the line most likely to decide (a Fatal one when there is one)
    kind: str = "xid"  # "xid" | "sxid"
    target: str | None = None  # "nvswitch:N" for an SXid; a GPU's is set by named()
    count: int = 1  # occurrences folded so far
    evidence: dict[str, Any] = field(default_factory=dict, compare=False)  # the fold's evidence
    why: str = "first"  # first | new variant | new burst | update | nvml event without a line

    @property
    def noun(self) -> str:
        return "SXid" if self.kind == "sxid" else "Xid"

    def named(self, gpus: Sequence[_InventoryGpu]) -> XidSighting:
        """The sighting with its GPU index found from its bus among ``gpus`` where the source
        printed only the bus, and its ``target`` set (``gpu:N``, else ``pci:<bus>``)."""
        index = self.gpu_index
        if index is None and self.pci_bus and self.kind == "xid":
            index = next(
                (g.index for g in gpus if normalise_bus(g.pci_bus_id) == self.pci_bus), None
            )
        target = self.target or (
            f"gpu:{index}" if index is not None else f"pci:{self.pci_bus or '?'}"
        )
        return dataclasses.replace(self, gpu_index=index, target=target)

    @property
    def headline(self) -> str:
        """``Xid 79 on gpu:5 from nvml-event``, for the daemon's log."""
        return f"{self.noun} {self.code} on {self.target or self.pci_bus} from {self.source}"

    def result(self, target: str | None = None) -> Result:
        """The finding as the ``xid`` check reports it (metric ``xid`` or ``sxid``), for the
        daemon to keep one per (target, code) and grade; ``target`` defaults to the
        sighting's own (:meth:`named`)."""
        target = target or self.target or f"pci:{self.pci_bus or '?'}"
        noun = self.noun
        rate = self.evidence.get("rate_per_hour")
        how = f"{self.count} time(s)" + (f", {rate:g}/h" if isinstance(rate, (int, float)) else "")
        evidence: dict[str, Any] = dict(self.evidence) if self.evidence else {"count": self.count}
        evidence.setdefault("source", self.source)
        evidence.setdefault("line", self.line)
        return Result(
            check="xid",
            target=target,
            metric=self.kind,
            status=Status.FAIL,
            value=self.code,
            evidence=evidence,
            detail=f"{noun} {self.code} on {target} seen by the daemon's watch "
            f"({self.source}), {how}: {self.line}",
        )


class XidWatch:
    """The watch (see the module docstring); :func:`watcher` builds the daemon's."""

    def __init__(
        self,
        gpu: Callable[[], GpuBackend],
        kernel_log: Callable[[], KernelLog],
        on_xid: Callable[[XidSighting], None],
        poll_s: float = 0.5,
        update_s: float = 60.0,
        nvml_grace_s: float = 2.0,
        report_sxid: bool = False,
        clock: Callable[[], float] = time.monotonic,
        gpus: Callable[[], Sequence[_InventoryGpu]] | None = None,
        labels: Callable[[], NodeLabels] | None = None,
    ) -> None:
        self._gpus = gpus
        self._labels = labels
        #: (GPU index or None, code) -> occurrences, following each fold's cumulative count
        self.xid_counts: dict[tuple[int | None, int], int] = {}
        self._gpu = gpu
        self._kernel_log = kernel_log
        self._on_xid = on_xid
        self._poll_s = poll_s
        self._update_s = update_s
        self._nvml_grace_s = nvml_grace_s
        self._report_sxid = report_sxid
        self._clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._folder = Folder()
        self._reported: dict[tuple[str, str, int], float] = {}  # key -> clock of last report
        self._dirty: set[tuple[str, str, int]] = set()  # counted since its last report
        self._nvml_pending: dict[tuple[str, str, int], float] = {}  # key -> report deadline
        self._bus_map: tuple[GpuBackend | None, dict[str, int]] = (None, {})
        self._nvidia: tuple[float, frozenset[str] | None] = (float("-inf"), None)
        self.kernel_log_watched = False  # set by the log loop while a readable source is followed

    def start(self) -> None:
        for name, target in (("xid-nvml", self._nvml_loop), ("xid-kernel-log", self._log_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    # -- sources --------------------------------------------------------------------------------
    def _nvml_loop(self) -> None:
        unsupported_by: GpuBackend | None = None
        while not self._stop.is_set():
            self._flush()
            backend = self._gpu()
            if backend.unavailable_reason or backend is unsupported_by:
                self._stop.wait(self._poll_s)
                continue
            try:
                events = backend.wait_xid_events(self._poll_s)
            except NotSupported as err:
                log.info(
                    "NVML does not report XID events here (%s); the kernel log is watched", err
                )
                unsupported_by = backend
                continue
            except GpuError as err:
                log.warning("NVML XID event wait failed: %s; retrying", err)
                self._stop.wait(1.0)
                continue
            for event in events:
                self.nvml_event(event.gpu_index, event.code, event.message)

    def _log_loop(self) -> None:
        follower: KmsgFollower | None = None
        followed: KernelLog | None = None
        scanner = KernelLogScanner()
        seen_seq: dict[int, str] = {}
        while not self._stop.is_set():
            self._flush()
            source = self._kernel_log()
            if source.unavailable_reason:
                self.kernel_log_watched = False
                self._stop.wait(self._poll_s * 4)
                continue
            try:
                if isinstance(source, KmsgKernelLog):
                    if followed is not source:
                        if follower:
                            follower.close()
                        follower, followed = KmsgFollower(source.path), source
                        scanner = KernelLogScanner()
                    assert follower is not None  # made above for this source
                    self.kernel_log_watched = True
                    records = follower.wait(self._poll_s)
                else:
                    if followed is not source:
                        followed, scanner = source, KernelLogScanner()
                    self.kernel_log_watched = True
                    records = [r for r in source.read() if seen_seq.get(r.seq) != r.text]
                    seen_seq.update((r.seq, r.text) for r in records)
                    self._stop.wait(self._poll_s)
            except OSError as err:
                self.kernel_log_watched = False
                log.warning("kernel log %s unreadable: %s; retrying", source.source, err)
                self._stop.wait(2.0)
                continue
            self.kernel_records(records, scanner, source.source)
        if follower:
            follower.close()

    # -- folding (public for tests: the sources above only feed these) --------------------------
    def kernel_records(
        self, records: list[LogRecord], scanner: KernelLogScanner, source: str
    ) -> None:
        """Fold kernel-log records; report what changed."""
        reports: list[XidSighting] = []
        now = Stamp("wall", time.time())
        with self._lock:
            for record in records:
                for event in scanner.feed(record):
                    if isinstance(event, Unreadable):
                        log.warning(
                            "kernel log names an Xid/SXid that cannot be read (%s): %s",
                            event.reason,
                            event.raw[:200],
                        )
                        continue
                    if isinstance(event, DriverLine):
                        continue  # graded by the periodic xid check (driver_lines.yaml)
                    if isinstance(event, SxidLine) and not self._report_sxid:
                        continue  # left to the periodic xid check (see report_sxid)
                    key_target = (
                        event.target
                        if isinstance(event, SxidLine)
                        else self._gpu_target(event.pci_bus)
                    )
                    if key_target.startswith(("pci:", "nvswitch:")) and not self._nvidia_bus(
                        event.pci_bus, source
                    ):
                        log.warning(
                            "kernel log names bus %s, which the PCI bus (sysfs) shows "
                            "is no NVIDIA device: not graded as a GPU: %s",
                            normalise_bus(event.pci_bus),
                            event.raw[:200],
                        )
                        continue
                    fold, changed = self._folder.add(event, key_target, source, now)
                    key = (fold.kind, fold.target, fold.code)
                    self._nvml_pending.pop(key, None)
                    why = (
                        "first"
                        if fold.count == 1 and fold.nvml_events == 0
                        else "kernel line of an NVML event"
                        if fold.count == 1
                        else "new variant or burst"
                    )
                    reports.extend(self._consider(key, fold, changed, why))
        self._report(reports)

    def nvml_event(self, gpu_index: int | None, code: int, message: str = "") -> None:
        """Fold one NVML XID event; an NVML-only finding waits for its kernel line."""
        target = f"gpu:{gpu_index}" if gpu_index is not None else "node"
        reports: list[XidSighting] = []
        with self._lock:
            fold = self._folder.fold("xid", target, code)
            changed = fold.add_nvml(message, Stamp("wall", time.time()))
            key = (fold.kind, fold.target, fold.code)
            if fold.count == 0 and self.kernel_log_watched and self._nvml_grace_s > 0:
                self._nvml_pending.setdefault(key, self._clock() + self._nvml_grace_s)
            else:
                reports.extend(self._consider(key, fold, changed, "nvml event"))
        self._report(reports)

    def _consider(
        self, key: tuple[str, str, int], fold: Fold, changed: bool, why: str
    ) -> list[XidSighting]:
        now = self._clock()
        if changed or now - self._reported.get(key, float("-inf")) >= self._update_s:
            self._reported[key] = now
            self._dirty.discard(key)
            return [self._sighting(fold, why if changed else "update")]
        self._dirty.add(key)
        return []

    def _flush(self) -> None:
        """Report NVML-only findings whose grace ran out, and counts not reported for update_s."""
        now = self._clock()
        reports: list[XidSighting] = []
        with self._lock:
            for key, deadline in list(self._nvml_pending.items()):
                if now >= deadline:
                    del self._nvml_pending[key]
                    fold = self._folder.folds[key]
                    self._reported[key] = now
                    self._dirty.discard(key)
                    reports.append(self._sighting(fold, "nvml event without a kernel-log line"))
            for key in list(self._dirty):
                if now - self._reported.get(key, float("-inf")) >= self._update_s:
                    self._dirty.discard(key)
                    self._reported[key] = now
                    reports.append(self._sighting(self._folder.folds[key], "update"))
        self._report(reports)

    #: how long the set of NVIDIA buses read from sysfs is reused (hot-plug is rare)
    NVIDIA_BUSES_TTL_S = 60.0

    def _nvidia_bus(self, pci_bus: str, source: str) -> bool:
        """False only when this host's own log names a bus that sysfs shows is no NVIDIA
        device; True for a saved or simulated log (no sysfs of its own to ask)."""
        kernel_log = self._kernel_log()
        if kernel_log.source != source or not kernel_log.live:
            return True
        read_at, buses = self._nvidia
        if self._clock() - read_at >= self.NVIDIA_BUSES_TTL_S:
            buses = nvidia_buses(kernel_log)
            self._nvidia = (self._clock(), buses)
        return buses is None or normalise_bus(pci_bus) in buses

    def _gpu_target(self, pci_bus: str) -> str:
        backend = self._gpu()
        cached_for, mapping = self._bus_map
        if cached_for is not backend:
            mapping = {}
            if not backend.unavailable_reason:
                try:
                    mapping = {
                        normalise_bus(d.identity().pci_bus_id): d.index for d in backend.devices()
                    }
                except (GpuError, ValueError) as err:
                    log.info("cannot map PCI buses to GPU indices (%s); XIDs named by bus", err)
            self._bus_map = (backend, mapping)
        index = mapping.get(pci_bus)
        return f"gpu:{index}" if index is not None else f"pci:{pci_bus}"

    @staticmethod
    def _sighting(fold: Fold, why: str) -> XidSighting:
        match = _GPU_TARGET.match(fold.target)
        decisive = next(
            (v["line"] for v in fold.variants.values() if v["fields"].get("severity") == "Fatal"),
            None,
        )
        return XidSighting(
            code=fold.code,
            gpu_index=int(match.group(1)) if match else None,
            pci_bus=normalise_bus(fold.pci_bus)
            if fold.pci_bus and fold.kind == "xid"
            else fold.pci_bus,
            source=", ".join(sorted(fold.sources)),
            line=decisive or fold.last_line or fold.first_line,
            kind=fold.kind,
            target=fold.target if fold.kind == "sxid" else None,
            count=fold.events,
            evidence=fold.evidence(),
            why=why,
        )

    def _report(self, sightings: list[XidSighting]) -> None:
        for sighting in sightings:
            if self._gpus is not None:
                sighting = sighting.named(self._gpus())
            if sighting.kind == "xid":
                key = (sighting.gpu_index, sighting.code)
                with self._lock:  # the fold's count is cumulative: never goes back
                    self.xid_counts[key] = max(sighting.count, self.xid_counts.get(key, 0))
            try:
                self._on_xid(sighting)
            except Exception:  # noqa: BLE001 - the watch must outlive a bad handler
                log.exception("handling %s failed", sighting)

    # -- metrics --------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        """``node_agent_gpu_xid_errors_total{gpu, uuid, code}`` (a Prometheus collector; the
        daemon registers every check's watcher in its registry)."""
        from prometheus_client.core import CounterMetricFamily  # the daemon's alone

        node = self._labels() if self._labels is not None else NodeLabels("", {})
        family = CounterMetricFamily(
            "node_agent_gpu_xid_errors",
            "XID errors seen by the daemon's watch, per code: occurrences (kernel-log lines, "
            "else NVML events), not reports; a flood's count is brought up to date at least "
            "once a minute",
            labels=["hostname", "gpu", "uuid", "code"],
        )
        with self._lock:
            counts = sorted(self.xid_counts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))
        for (gpu, code), count in counts:
            uuid = node.gpu_uuids.get(gpu, "") if gpu is not None else ""
            family.add_metric(
                [node.hostname, "" if gpu is None else str(gpu), uuid, str(code)], count
            )
        yield family


def watcher(ctx: WatchContext) -> XidWatch:
    """The xid check's watcher in the daemon (its ``SERVICE.watcher``): NVML's events and the
    kernel log of the node the daemon has now, SXids included, every finding named and handed
    back as the check's result."""

    def report(sighting: XidSighting) -> None:
        ctx.report(Sighting(sighting.result(), sighting.why, sighting.headline))

    return XidWatch(
        lambda: ctx.node().gpu,
        lambda: ctx.node().kernel_log,
        report,
        poll_s=ctx.node().config.daemon.xid_poll_s,
        report_sxid=True,
        gpus=lambda: ctx.node().inventory.gpus,
        labels=ctx.labels,
    )
