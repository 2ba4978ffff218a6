"""Folding kernel-log events: the same code on the same GPU (or NVSwitch) is one finding.

A flood cannot become thousands of results: NVSentinel's users report 800K Xid 95 lines with
29 distinct events on one node (NVIDIA/NVSentinel#1120) and 168,924 Xid 45 events in two days
(NVIDIA/NVSentinel#1712). Every event on the same (target, code) folds into one :class:`Fold`:
its count, first and last time, rate, its *bursts* (events closer than ``burst_gap_s`` are one
burst) and the distinct things the lines said (*variants*: the unit/severity/status of an NVLink 5
Xid, the recovery action of a 154, the severity of an SXid), which the grader decodes. Memory
per fold is bounded whatever the flood.

Used by the ``xid`` check (one read of the log) and its watcher in the daemon (events as they
come, ``checks/xid/watch.py``), and by ``kernel_distress`` for its bursts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from node_agent.kernel_log import DriverLine, Stamp, SxidLine, XidLine
from node_agent.model import Result, Status, utc_iso

T = TypeVar("T")

#: Events closer than this belong to one burst: NVSentinel's health-events-analyzer default
#: ``burst_gap_seconds`` (3 minutes, NVIDIA/NVSentinel#248), which its repeated-XID rule counts.
BURST_GAP_S = 180.0
#: Burst start times kept per fold (the newest): recurrence thresholds count bursts within a
#: window, and graders/xid.yaml caps a threshold at this many bursts.
MAX_BURST_STARTS = 100
#: Distinct variants kept per fold; further ones are counted under "other" (a flood varies in
#: registers, not in what the decode table reads, so this is never reached in practice).
MAX_VARIANTS = 32
MAX_LINKS = 64  # an NVSwitch has 64 ports; a GPU at most 18 NVLinks


@dataclass
class Fold:
    kind: str  # "xid" | "sxid"
    target: str  # "gpu:3", "pci:0000:3b:00", "nvswitch:1"
    code: int
    count: int = 0  # kernel-log lines
    nvml_events: int = 0  # the same XIDs as NVML events (no text: never decoded)
    clock: str | None = None  # the clock of first/last ("boot" or "wall"), from the first stamp
    first_s: float | None = None
    last_s: float | None = None
    bursts: int = 0
    burst_starts: list[float] = field(default_factory=list)
    untimed: int = 0  # lines without a time (or in another clock): counted, not in the rate
    first_line: str = ""
    last_line: str = ""
    variants: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = field(default_factory=dict)
    gpu_instances: set[int] = field(default_factory=set)
    links: set[int] = field(default_factory=set)
    pci_bus: str | None = None
    sources: set[str] = field(default_factory=set)
    caused_by: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # how a line without an Xid number was read

    def add(
        self,
        event: XidLine | SxidLine,
        source: str,
        now: Stamp | None = None,
        burst_gap_s: float = BURST_GAP_S,
    ) -> bool:
        """Count one kernel-log event; True when it changed what a grader could conclude (the
        first line, a new variant, or a new burst). ``now`` stands in for a line without a
        time (the daemon's watch: the moment it read the line)."""
        self.count += 1
        self.sources.add(source)
        self.pci_bus = self.pci_bus or event.pci_bus
        if not self.first_line:
            self.first_line = event.raw
        self.last_line = event.raw
        if event.link is not None and event.link >= 0 and len(self.links) < MAX_LINKS:
            self.links.add(event.link)
        if isinstance(event, XidLine):
            if event.gpu_instance is not None:
                self.gpu_instances.add(event.gpu_instance)
            if event.caused_by is not None:
                self.caused_by.add(event.caused_by)
            if event.origin != "xid" and event.message not in self.notes and len(self.notes) < 4:
                self.notes.append(event.message)
            fields = event.decode_fields()
        else:
            fields = {"severity": event.severity} if event.severity else {}
        changed = self.count == 1
        if fields or self.kind == "xid":
            changed |= self._variant(fields, event.raw)
        changed |= self._time(event.stamp or now, burst_gap_s)
        return changed

    def add_nvml(
        self, message: str, now: Stamp | None = None, burst_gap_s: float = BURST_GAP_S
    ) -> bool:
        """Count an NVML XID event. It carries no line, so it makes no variant: when the kernel
        log has the same event, the line decides; alone, the code's own level does."""
        self.nvml_events += 1
        self.sources.add("nvml-event")
        if not self.first_line:
            self.first_line = f"NVML event: Xid {self.code} {message}".strip()
        changed = self.nvml_events == 1 and self.count == 0
        if self.count == 0:
            changed |= self._time(now, burst_gap_s)
        return changed

    def _variant(self, fields: dict[str, Any], raw: str) -> bool:
        key = tuple(sorted(fields.items()))
        entry = self.variants.get(key)
        if entry is None:
            if len(self.variants) >= MAX_VARIANTS:
                key = (("other", True),)
                entry = self.variants.setdefault(
                    key, {"fields": {"other": True}, "count": 0, "line": raw}
                )
            else:
                self.variants[key] = {"fields": fields, "count": 1, "line": raw}
                return True
        entry["count"] += 1
        return False

    def _time(self, stamp: Stamp | None, burst_gap_s: float) -> bool:
        if stamp is None or (self.clock is not None and stamp.clock != self.clock):
            self.untimed += 1
            if self.bursts == 0:  # nothing timed yet: the untimed lines are one burst
                self.bursts = 1
                return True
            return False
        t = stamp.seconds
        if self.clock is None:
            self.clock, self.first_s, self.last_s = stamp.clock, t, t
            self.bursts = 1
            self.burst_starts = [t]
            return True
        assert self.first_s is not None and self.last_s is not None
        new_burst = t - self.last_s > burst_gap_s
        self.first_s, self.last_s = min(self.first_s, t), max(self.last_s, t)
        if new_burst:
            self.bursts += 1
            self.burst_starts.append(t)
            del self.burst_starts[:-MAX_BURST_STARTS]
        return new_burst

    @property
    def events(self) -> int:
        """Occurrences: kernel-log lines when the log had any, else NVML events (the two report
        the same XIDs, so they are never added up)."""
        return self.count or self.nvml_events

    def rate_per_hour(self) -> float | None:
        """Events per hour between the first and the last timed event (None under 1 s)."""
        if self.first_s is None or self.last_s is None:
            return None
        span = self.last_s - self.first_s
        timed = self.events - self.untimed
        return round(timed / span * 3600.0, 3) if span >= 1.0 and timed > 1 else None

    def seen(self, seconds: float | None, boot_epoch: float | None) -> str | None:
        """A time for people: ISO UTC for wall times (and boot times when the boot moment is
        known), else 'N s after boot'."""
        if seconds is None:
            return None
        if self.clock == "boot":
            if boot_epoch is None:
                return f"{seconds:.3f} s after boot"
            seconds += boot_epoch
        return utc_iso(seconds)

    def evidence(self, boot_epoch: float | None = None) -> dict[str, Any]:
        evidence: dict[str, Any] = {
            "count": self.events,
            "log_lines": self.count,
            "nvml_events": self.nvml_events,
            "first_seen": self.seen(self.first_s, boot_epoch),
            "last_seen": self.seen(self.last_s, boot_epoch),
            "rate_per_hour": self.rate_per_hour(),
            "bursts": self.bursts,
            "burst_gap_s": BURST_GAP_S,
            "clock": self.clock,
            "burst_starts_s": list(self.burst_starts),
            "untimed_lines": self.untimed,
            "lines": [self.first_line]
            + ([self.last_line] if self.last_line and self.last_line != self.first_line else []),
            "variants": [
                {**v["fields"], "count": v["count"], "line": v["line"]}
                for v in self.variants.values()
            ],
            "sources": sorted(self.sources),
            # the kernel's line and NVML's event API both reported it: two independent witnesses
            "corroborated_by_nvml": self.count > 0 and self.nvml_events > 0,
        }
        if self.pci_bus:
            evidence["pci_bus"] = self.pci_bus
        if self.gpu_instances:
            evidence["gpu_instances"] = sorted(self.gpu_instances)
        if self.links:
            evidence["links"] = sorted(self.links)
        if self.caused_by:
            evidence["caused_by"] = sorted(self.caused_by)
        if self.notes:
            evidence["read_as"] = list(self.notes)
        return evidence

    def result(
        self, check: str = "xid", window: str = "", boot_epoch: float | None = None
    ) -> Result:
        """The fold as one ``fail`` result; the grader gives it its level from the catalog."""
        noun = "SXid" if self.kind == "sxid" else "Xid"
        rate = self.rate_per_hour()
        how_often = f"{self.events} time(s)" + (
            f" in {self.bursts} burst(s)" if self.bursts > 1 else ""
        )
        if rate is not None:
            how_often += f", {rate:g}/h"
        where = f" {window}" if window else ""
        said = [
            (
                ", ".join(
                    str(v["fields"][k])
                    for k in ("unit", "severity", "recovery_action")
                    if k in v["fields"]
                ),
                v["count"],
            )
            for v in self.variants.values()
        ]
        said = [(text, n) for text, n in said if text]
        printed = (
            ("; printed " + ", ".join(f"{text} x{n}" for text, n in said)) if len(said) > 1 else ""
        )
        if self.notes:
            printed += f" ({'; '.join(self.notes)})"
        if self.count and self.nvml_events:
            printed += f"; corroborated by {self.nvml_events} NVML event(s)"
        return Result(
            check=check,
            target=self.target,
            metric=self.kind,
            status=Status.FAIL,
            value=self.code,
            evidence=self.evidence(boot_epoch),
            detail=f"{noun} {self.code} on {self.target}, {how_often}{where}{printed}: "
            f"{self.first_line}",
        )


class Folder:
    """All folds of one read (the check) or of the daemon's life (the watch)."""

    def __init__(self, burst_gap_s: float = BURST_GAP_S) -> None:
        self.burst_gap_s = burst_gap_s
        self.folds: dict[tuple[str, str, int], Fold] = {}

    def fold(self, kind: str, target: str, code: int) -> Fold:
        key = (kind, target, code)
        fold = self.folds.get(key)
        if fold is None:
            fold = self.folds[key] = Fold(kind=kind, target=target, code=code)
        return fold

    def add(
        self, event: XidLine | SxidLine, target: str, source: str, now: Stamp | None = None
    ) -> tuple[Fold, bool]:
        kind = "sxid" if isinstance(event, SxidLine) else "xid"
        fold = self.fold(kind, target, event.code)
        return fold, fold.add(event, source, now, self.burst_gap_s)

    def sorted(self) -> list[Fold]:
        return [self.folds[k] for k in sorted(self.folds, key=lambda k: (k[0], k[1], k[2]))]


@dataclass
class DriverFold:
    """Every driver line of one kind on one target (``graders/driver_lines.yaml``), folded the
    same way: count, first and last line and time, the RM status codes printed."""

    kind: str
    target: str
    count: int = 0
    clock: str | None = None
    first_s: float | None = None
    last_s: float | None = None
    first_line: str = ""
    last_line: str = ""
    pci_bus: str | None = None
    driver_gpus: set[int] = field(default_factory=set)
    statuses: set[int] = field(default_factory=set)
    ports: set[str] = field(default_factory=set)
    severities: set[str] = field(default_factory=set)
    sources: set[str] = field(default_factory=set)

    def add(self, line: DriverLine, source: str) -> None:
        self.count += 1
        self.sources.add(source)
        self.pci_bus = self.pci_bus or line.pci_bus
        self.first_line = self.first_line or line.raw
        self.last_line = line.raw
        _add_bounded(self.driver_gpus, line.driver_gpu)
        _add_bounded(self.statuses, line.status)
        _add_bounded(self.ports, line.port)
        _add_bounded(self.severities, line.severity)
        stamp = line.stamp
        if stamp is not None and (self.clock is None or stamp.clock == self.clock):
            self.clock = stamp.clock
            self.first_s = (
                stamp.seconds if self.first_s is None else min(self.first_s, stamp.seconds)
            )
            self.last_s = stamp.seconds if self.last_s is None else max(self.last_s, stamp.seconds)

    def result(
        self,
        metric: str,
        status: Status,
        name: str,
        window: str = "",
        boot_epoch: float | None = None,
        check: str = "xid",
    ) -> Result:
        """The fold as one result; ``metric``/``status`` from its kind's catalog entry."""
        times = Fold(kind="driver", target=self.target, code=0, clock=self.clock)
        evidence: dict[str, Any] = {
            "kind": self.kind,
            "count": self.count,
            "first_seen": times.seen(self.first_s, boot_epoch),
            "last_seen": times.seen(self.last_s, boot_epoch),
            "clock": self.clock,
            "lines": [self.first_line]
            + ([self.last_line] if self.last_line != self.first_line else []),
            "sources": sorted(self.sources),
        }
        if self.pci_bus:
            evidence["pci_bus"] = self.pci_bus
        if self.driver_gpus:
            evidence["driver_gpus"] = sorted(self.driver_gpus)
        if self.statuses:
            evidence["rm_status"] = [f"0x{s:x}" for s in sorted(self.statuses)]
        if self.ports:
            evidence["aer_ports"] = sorted(self.ports)
        if self.severities:
            evidence["aer_severity"] = sorted(self.severities)
        where = f" {window}" if window else ""
        named = (
            ""
            if self.pci_bus or not self.driver_gpus
            else f" (the driver's GPU {', '.join(map(str, sorted(self.driver_gpus)))}: the line "
            "names no bus)"
        )
        return Result(
            check=check,
            target=self.target,
            metric=metric,
            status=status,
            value=self.count,
            unit="lines",
            evidence=evidence,
            detail=f"{name} on {self.target}{named}, {self.count} line(s){where}: "
            f"{self.first_line}",
        )


def counted(result: Result) -> int:
    """The occurrences a folded Xid/SXid result counted (0 when it carries no count)."""
    count = (result.evidence or {}).get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def keep_fuller(kept: Result, new: Result) -> Result:
    """Of two findings on one (target, code), the one that counted more lines; the newer one
    on a tie. A later run that read a shorter window (``since: last_run``) does not replace a
    fuller finding."""
    return new if counted(new) >= counted(kept) else kept


def _add_bounded(values: set[T], value: T | None) -> None:
    """Add a distinct value to a fold's set, at most ``MAX_VARIANTS`` of them."""
    if value is not None and len(values) < MAX_VARIANTS:
        values.add(value)
