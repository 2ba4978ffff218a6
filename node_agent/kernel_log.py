"""The kernel log as a source of GPU and NVSwitch errors: ``/dev/kmsg``, else ``journalctl -k``.

Two halves: the *sources* (``/dev/kmsg``, the journal, a fixed list of lines) give
:class:`LogRecord`; the *parser* turns records into :class:`XidLine` (a GPU Xid, with what the
driver printed on the line), :class:`SxidLine` (an NVSwitch SXid) or :class:`Unreadable` (the line
names an Xid/SXid but cannot be read, and says why). Parsing never raises: a truncated or garbled
line is unreadable or not an Xid line, never a crash.

Forms read (real samples: ``../shared/realworld/xid/``):

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (0000:00:05): 13, 0000 e0019700 00004497 ...           (pre-"PCI:" drivers)
    NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: ...  (MIG: GPU instance)
    NVRM: Xid (PCI:0018:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 ...)
    NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)
    nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up
    NVRM: The NVIDIA GPU 0000:b3:00.0 / (PCI ID: 10de:26b5) installed in this system has /
          fallen off the bus and is not responding to commands.      (three lines, no Xid: -> 79)

with any prefix in front (``dmesg``/``dmesg -T``/``--ctime``, ``journalctl``, syslog, raw kmsg
records); the time in the prefix, where there is one, becomes the event's :class:`Stamp`.
"""

from __future__ import annotations

import calendar
import errno
import os
import re
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from node_agent import proc

# --- records and times -----------------------------------------------------------------------


@dataclass(frozen=True)
class Stamp:
    """When a line was logged: ``boot`` = seconds since boot (kmsg, ``dmesg``), ``wall`` = Unix
    seconds (``dmesg -T``, ISO times). Times of different clocks are never compared."""

    clock: str  # "boot" | "wall"
    seconds: float


@dataclass(frozen=True)
class LogRecord:
    seq: int  # monotonically increasing position (kmsg sequence number or line number)
    text: str  # may hold several lines (a multi-line kmsg record, a journal entry)
    boot_s: float | None = None  # the record's own time since boot, where the source gives it


_KMSG_HEADER = re.compile(r"^\s*\d+,\d+,(?P<us>\d+),[^;]*;")
_BOOT_STAMP = re.compile(r"\[\s*(?P<s>\d+\.\d+)\]")
_CTIME_STAMP = re.compile(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<t>(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
    r" +\d{1,2} \d\d:\d\d:\d\d \d{4})\]")
_ISO_STAMP = re.compile(r"(?P<t>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.](?P<frac>\d{1,9}))?"
                        r"(?P<tz>Z|[+-]\d\d:?\d\d)?")


def line_stamp(prefix: str) -> Stamp | None:
    """The time in the text in front of a kernel message, if it carries one.

    ``6,3964,206764307,-;`` (a saved kmsg record, microseconds since boot), ``[ 1843.308145]``
    (dmesg, syslog's kernel time, ``journalctl -o short-monotonic``), ``[Sun Feb 23 16:24:18
    2025]`` (``dmesg -T``/``--ctime``, read as UTC: only differences are used) and ISO 8601
    (``dmesg --time-format iso``). A syslog ``Dec  2 11:38:27`` has no year and is not used.
    """
    try:
        if (m := _KMSG_HEADER.match(prefix)) is not None:
            return Stamp("boot", int(m["us"]) / 1e6)
        if (m := _BOOT_STAMP.search(prefix)) is not None:
            return Stamp("boot", float(m["s"]))
        if (m := _CTIME_STAMP.search(prefix)) is not None:
            return Stamp("wall", float(calendar.timegm(time.strptime(
                " ".join(m["t"].split()), "%b %d %H:%M:%S %Y"))))
        if (m := _ISO_STAMP.search(prefix)) is not None:
            seconds = calendar.timegm(time.strptime(m["t"], "%Y-%m-%dT%H:%M:%S"))
            seconds += float("0." + m["frac"]) if m["frac"] else 0.0
            tz = m["tz"]
            if tz and tz != "Z":
                sign = -1 if tz[0] == "+" else 1
                digits = tz[1:].replace(":", "")
                seconds += sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
            return Stamp("wall", seconds)
    except (ValueError, OverflowError):
        return None
    return None


# --- what a line says ------------------------------------------------------------------------


@dataclass(frozen=True)
class XidLine:
    """One GPU Xid as the driver printed it. ``pci_bus`` is normalised (``0000:3b:00``)."""

    code: int
    pci_bus: str
    message: str
    raw: str
    gpu_instance: int | None = None  # MIG: "GPU-I:05"
    compute_instance: int | None = None  # MIG: "GPU-CI:02"
    pid: int | None = None
    process: str | None = None
    # NVLink 5 (Xid 144-150): "<unit> <Fatal|Nonfatal> XC<n> i<n> Link <n> (<IntrInfo> <ErrorStatus> ...)"
    unit: str | None = None
    severity: str | None = None  # "Fatal" | "Nonfatal", as printed (normalised spelling)
    link: int | None = None
    intrinfo: int | None = None
    error_status: int | None = None
    recovery_action: str | None = None  # Xid 154: the action it changed to ("Drain and Reset")
    caused_by: int | None = None  # Xid 45 on newer drivers: "caused by previous Xid 149"
    origin: str = "xid"  # "xid", or "fallen-off-bus" for the message without an Xid line
    stamp: Stamp | None = None

    @property
    def subcode(self) -> int | None:
        """IntrInfo bits 25..20: the NETIR_LINK_EVT reason (NVIDIA's XID 144-150 Decode sheet
        gives them as the 6-character mask after the first 6 don't-care bits)."""
        return None if self.intrinfo is None else (self.intrinfo >> 20) & 0x3F

    def decode_fields(self) -> dict[str, Any]:
        """What a decode row of ``graders/xid.yaml`` may match, where the line printed it."""
        fields = {"unit": self.unit, "severity": self.severity,
                  "error_status": self.error_status,
                  "subcode": None if self.subcode is None else format(self.subcode, "06b"),
                  "recovery_action": self.recovery_action}
        return {k: v for k, v in fields.items() if v is not None}


@dataclass(frozen=True)
class SxidLine:
    """One NVSwitch SXid line. One event often prints several lines under the same code; only
    ``<Fatal|Non-fatal>, Link N <name>`` carries the severity and the link."""

    code: int
    switch: int | None  # N of "nvidia-nvswitchN", when the line has it
    pci_bus: str  # the NVSwitch's PCI address as printed, lower case ("0000:86:00.0")
    message: str
    raw: str
    severity: str | None = None  # "Fatal" | "Nonfatal"
    link: int | None = None
    stamp: Stamp | None = None

    @property
    def target(self) -> str:
        return f"nvswitch:{self.switch}" if self.switch is not None else f"nvswitch:{self.pci_bus}"


@dataclass(frozen=True)
class Unreadable:
    """A line that names an Xid or SXid but cannot be read; ``reason`` says why."""

    reason: str
    raw: str
    code: int | None = None


Event = XidLine | SxidLine

_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
_XID = re.compile(r"(?<![A-Za-z])Xid \((?P<inner>[^()\n]*)\)(?P<after>.*)$")
_SXID = re.compile(r"(?:nvidia-nvswitch(?P<sw>\d+):?\s*)?(?<![A-Za-z])SXid \((?P<inner>[^()\n]*)\)"
                   r"(?P<after>.*)$")
_XID_ADDRESS = re.compile(rf"^(?:PCI:)?(?P<bus>{_BUS})(?:\.[0-7])?"
                          r"(?:\s+GPU-I:(?P<gi>\d{1,3}))?(?:\s+GPU-CI:(?P<ci>\d{1,3}))?\s*$")
_SXID_ADDRESS = re.compile(rf"^(?:PCI:)?(?P<bus>{_BUS}(?:\.[0-7])?)\s*$")
_CODE = re.compile(r"^:\s*(?P<code>\d{1,6})(?=$|[,\s])(?:,\s*(?P<rest>.*))?$")
_PID = re.compile(r"^pid=(?P<pid>[^,]*),\s*")
_NAME = re.compile(r"^name=(?P<name>[^,]*),\s*")
_NVLINK5 = re.compile(
    r"^(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<sev>Non-?fatal|Nonfatal|Fatal)\s+XC\s?\d+\s+i\s?\d+\s+"
    r"Link\s+(?P<link>-?\d+)(?:\s*\((?P<words>[^)]*)\)|\s*\[(?P<bracket>[^\]]*)\])?")
_RECOVERY = re.compile(r"recovery action changed from 0x[0-9a-fA-F]+ \((?P<old>[^)]*)\) "
                       r"to 0x[0-9a-fA-F]+ \((?P<new>[^)]*)\)")
_CAUSED_BY = re.compile(r"caused by previous Xid (?P<code>\d{1,4})")
_SXID_HEADLINE = re.compile(r"^(?P<sev>Non-?fatal|Fatal)\s*,\s*(?:Link\s+(?P<link>\d+)\s*)?(?P<name>.*)$")
_THE_GPU = re.compile(r"NVRM: The NVIDIA GPU (?P<bdf>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
                      r"(?:\.[0-7])?)")
_GPU_FALLEN = re.compile(r"NVRM: GPU (?P<bdf>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
                         r"(?:\.[0-7])?): GPU has fallen off the bus")
_PCI_ID = re.compile(r"PCI ID: (?P<id>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})")


def normalise_bus(bus: str) -> str:
    """``00000000:3B:00.0`` (NVML) and ``0000:3b:00`` (kernel) -> ``0000:3b:00``."""
    bus = bus.lower().split(".")[0]
    domain, _, rest = bus.partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def _severity(word: str) -> str:
    return "Nonfatal" if word.lower().startswith("non") else "Fatal"


def _hex(word: str) -> int | None:
    try:
        return int(word, 16) if word.lower().startswith("0x") else None
    except ValueError:
        return None


def parse_line(line: str) -> Event | Unreadable | None:
    """What one kernel-log line reports: an Xid, an SXid, an :class:`Unreadable` line that names
    one, or None for any other line (including ``_kgspLogXid119:`` and the like, which mention
    the word but report nothing)."""
    if "Xid (" not in line:
        return None
    text = line.strip()
    if (m := _SXID.search(text)) is not None:
        return _sxid(m, text)
    if (m := _XID.search(text)) is not None:
        return _xid(m, text)
    if re.search(r"(?<![A-Za-z])S?Xid \(", text):
        return Unreadable("truncated inside the address: no ')' after 'Xid ('", text)
    return None


def parse_xid_line(line: str) -> XidLine | None:
    """The GPU Xid in one line, or None (not an Xid line, an SXid, or unreadable)."""
    event = parse_line(line)
    return event if isinstance(event, XidLine) else None


def _code(after: str) -> tuple[int, str] | str:
    m = _CODE.match(after)
    if m is None:
        return "truncated: no code after the address" if not after.strip(": ") \
            else f"no numeric code after the address ({after.strip()[:40]!r})"
    return int(m["code"]), (m["rest"] or "").strip()


def _xid(m: re.Match[str], text: str) -> XidLine | Unreadable:
    code_rest = _code(m["after"])
    code = code_rest[0] if isinstance(code_rest, tuple) else None
    address = _XID_ADDRESS.match(m["inner"].strip())
    if address is None:
        return Unreadable(f"the PCI address is not readable ({m['inner'][:40]!r}): the line names "
                          "no GPU", text, code)
    if isinstance(code_rest, str):
        return Unreadable(code_rest, text)
    code, rest = code_rest
    try:
        bus = normalise_bus(address["bus"])
    except ValueError:
        return Unreadable(f"the PCI domain is not hexadecimal ({address['bus']!r})", text, code)
    pid: int | None = None
    process: str | None = None
    if (p := _PID.match(rest)) is not None:
        pid = int(p["pid"]) if p["pid"].isdigit() else None
        rest = rest[p.end():]
        if (n := _NAME.match(rest)) is not None:
            process = n["name"] if n["name"] != "<unknown>" else None
            rest = rest[n.end():]
    fields: dict[str, Any] = {}
    if (v := _NVLINK5.match(rest)) is not None:
        fields.update(unit=v["unit"], severity=_severity(v["sev"]), link=int(v["link"]))
        words = (v["words"] or "").split()
        if len(words) >= 2:
            fields.update(intrinfo=_hex(words[0]), error_status=_hex(words[1]))
    if code == 154 and (r := _RECOVERY.search(rest)) is not None:
        fields["recovery_action"] = r["new"].strip()
    if (c := _CAUSED_BY.search(rest)) is not None:
        fields["caused_by"] = int(c["code"])
    return XidLine(
        code=code, pci_bus=bus, message=rest, raw=text,
        gpu_instance=int(address["gi"]) if address["gi"] else None,
        compute_instance=int(address["ci"]) if address["ci"] else None,
        pid=pid, process=process, stamp=line_stamp(text[:m.start()]), **fields)


def _sxid(m: re.Match[str], text: str) -> SxidLine | Unreadable:
    code_rest = _code(m["after"])
    address = _SXID_ADDRESS.match(m["inner"].strip())
    if address is None:
        return Unreadable(f"the NVSwitch PCI address is not readable ({m['inner'][:40]!r})", text,
                          code_rest[0] if isinstance(code_rest, tuple) else None)
    if isinstance(code_rest, str):
        return Unreadable(code_rest, text)
    code, rest = code_rest
    severity: str | None = None
    link: int | None = None
    if (h := _SXID_HEADLINE.match(rest)) is not None:
        severity = _severity(h["sev"])
        link = int(h["link"]) if h["link"] else None
    return SxidLine(code=code, switch=int(m["sw"]) if m["sw"] else None,
                    pci_bus=address["bus"].lower(), message=rest, raw=text, severity=severity,
                    link=link, stamp=line_stamp(text[:m.start()]))


class KernelLogScanner:
    """Records in, events out, keeping what a message split over several lines needs.

    - ``NVRM: The NVIDIA GPU <bdf>`` / ``(PCI ID: ...) installed in this system has`` /
      ``fallen off the bus and is not responding to commands.`` (driver 570.158.01, no Xid line;
      ../shared/realworld/xid/x19) becomes Xid 79 on that GPU, as gpud (PR #1209) and NVSentinel
      (``pkg/gpufallen``, #195) map it. The three lines may come as one record or as three.
    - ``NVRM: GPU <bdf>: GPU has fallen off the bus.`` follows the driver's Xid 79 line (x04, x09,
      x17) and is not counted again; alone (the Xid line lost) it becomes Xid 79 itself.
    """

    _FALLEN_LOOKAHEAD = 3  # the two continuation lines, plus one for an interleaved record

    def __init__(self) -> None:
        self._pending: tuple[str, list[str], Stamp | None, int] | None = None
        self._fallen_buses: set[str] = set()

    def feed(self, record: LogRecord) -> list[Event | Unreadable]:
        stamp = Stamp("boot", record.boot_s) if record.boot_s is not None else None
        out: list[Event | Unreadable] = []
        for line in record.text.split("\n"):
            out.extend(self._line(line, stamp))
        return out

    def _line(self, line: str, record_stamp: Stamp | None) -> list[Event | Unreadable]:
        if self._pending is not None:
            bdf, lines, stamp, left = self._pending
            lines.append(line.strip())
            if "fallen off the bus" in line:
                self._pending = None
                return [self._fallen(bdf, lines, stamp)]
            self._pending = (bdf, lines, stamp, left - 1) if left > 1 else None
        if (m := _THE_GPU.search(line)) is not None:
            stamp = record_stamp or line_stamp(line[:m.start()])
            if "fallen off the bus" in line:
                return [self._fallen(m["bdf"], [line.strip()], stamp)]
            self._pending = (m["bdf"], [line.strip()], stamp, self._FALLEN_LOOKAHEAD)
            return []
        if "fallen off the bus" in line and (m := _GPU_FALLEN.search(line)) is not None \
                and "Xid (" not in line:
            if normalise_bus(m["bdf"]) in self._fallen_buses:
                return []  # the Xid 79 line just before said it
            return [self._fallen(m["bdf"], [line.strip()], record_stamp or line_stamp(line[:m.start()]))]
        event = parse_line(line)
        if event is None:
            return []
        if record_stamp is not None and isinstance(event, (XidLine, SxidLine)):
            event = _with_stamp(event, record_stamp)
        if isinstance(event, XidLine) and event.code == 79:
            self._fallen_buses.add(event.pci_bus)
        return [event]

    def _fallen(self, bdf: str, lines: list[str], stamp: Stamp | None) -> XidLine:
        bus = normalise_bus(bdf)
        self._fallen_buses.add(bus)
        joined = " / ".join(x for x in lines if x)
        pci_id = _PCI_ID.search(joined)
        return XidLine(code=79, pci_bus=bus, raw=joined, origin="fallen-off-bus", stamp=stamp,
                       message="GPU has fallen off the bus (printed without an Xid line"
                               + (f"; PCI ID {pci_id['id']}" if pci_id else "")
                               + "; read as Xid 79, as gpud and NVSentinel do)")


def _with_stamp(event: Event, stamp: Stamp) -> Event:
    return replace(event, stamp=stamp)


def scan(records: Iterable[LogRecord]) -> list[Event | Unreadable]:
    """Every event in ``records``, in order (a fresh :class:`KernelLogScanner`)."""
    scanner = KernelLogScanner()
    return [event for record in records for event in scanner.feed(record)]


def scan_lines(lines: Iterable[str]) -> list[Event | Unreadable]:
    """Every event in plain text lines (a saved ``dmesg``, a test sample)."""
    return scan(LogRecord(i + 1, line) for i, line in enumerate(lines))


# --- sources ---------------------------------------------------------------------------------


class KernelLog(Protocol):
    source: str
    unavailable_reason: str | None

    def read(self) -> list[LogRecord]: ...


class LinesKernelLog:
    """A fixed list of lines (the simulator, tests, a saved dmesg)."""

    def __init__(self, lines: list[str], source: str = "lines") -> None:
        self._lines = lines
        self.source = source
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        return [LogRecord(i + 1, line) for i, line in enumerate(self._lines)]


class KmsgKernelLog:
    """``/dev/kmsg``: every record still in the ring buffer, with its sequence number."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self.source = path
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return _read_available(fd)
        finally:
            os.close(fd)


class KmsgFollower:
    """New ``/dev/kmsg`` records as they arrive, from an fd kept open at the buffer's end.

    The daemon's XID watch waits here instead of re-reading the whole ring buffer: ``wait()``
    blocks in ``select`` until the kernel appends a record or the timeout passes.
    """

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)  # kmsg: SEEK_END skips what is already there

    def wait(self, timeout_s: float) -> list[LogRecord]:
        if self._fd < 0:
            return []
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        return _read_available(self._fd) if ready else []

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_available(fd: int) -> list[LogRecord]:
    """Every record a non-blocking ``/dev/kmsg`` fd has ready (one record per read)."""
    records: list[LogRecord] = []
    while True:
        try:
            chunk = os.read(fd, 8192)
        except OSError as err:
            if err.errno == errno.EAGAIN:
                break
            if err.errno == errno.EPIPE:  # overwritten while reading: skip ahead
                continue
            raise
        if not chunk:
            break
        record = _parse_kmsg_record(chunk.decode("utf-8", "replace"))
        if record is not None:
            records.append(record)
    return records


_KMSG_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _parse_kmsg_record(raw: str) -> LogRecord | None:
    """``prio,seq,usec,flags;message\\n KEY=value...`` (Documentation/ABI/testing/dev-kmsg).

    The kernel escapes a newline inside a message as ``\\x0a``: a multi-line message (the
    three-line "fallen off the bus") comes back as one record whose text holds the newlines.
    """
    header, sep, message = raw.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    try:
        seq = int(fields[1])
        boot_s: float | None = int(fields[2]) / 1e6
    except (IndexError, ValueError):
        return None
    text = _KMSG_ESCAPE.sub(lambda m: chr(int(m[1], 16)), message.split("\n", 1)[0])
    return LogRecord(seq, text, boot_s)


class JournalKernelLog:
    """``journalctl -k -b``: the kernel messages of this boot (when /dev/kmsg is unreadable).

    ``-o short-monotonic`` puts the time since boot in front of each message (``[ 1843.308145]``),
    which the parser reads as the event's time.
    """

    source = "journalctl -k -b"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        result = proc.run(["journalctl", "-k", "-b", "-o", "short-monotonic", "--no-pager", "-q"],
                          timeout_s=self.timeout_s)
        if not result.ok:
            raise OSError(result.describe_failure())
        return [LogRecord(i + 1, line) for i, line in enumerate(result.stdout.splitlines())]


class UnavailableKernelLog:
    source = "none"

    def __init__(self, reason: str) -> None:
        self.unavailable_reason: str | None = reason

    def read(self) -> list[LogRecord]:
        return []


def open_kernel_log(kmsg_path: str = "/dev/kmsg") -> KernelLog:
    """The best readable kernel-log source on this host, or one that says why there is none."""
    if os.access(kmsg_path, os.R_OK):
        return KmsgKernelLog(kmsg_path)
    if proc.which("journalctl"):
        return JournalKernelLog()
    if os.path.exists(kmsg_path):
        return UnavailableKernelLog(
            f"no permission to read the kernel log ({kmsg_path}): run as root or grant "
            "CAP_SYSLOG")
    return UnavailableKernelLog(f"no kernel log: {kmsg_path} does not exist and journalctl "
                                "is not installed")
