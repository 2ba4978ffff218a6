"""The kernel log as a source of XIDs: ``/dev/kmsg``, else ``journalctl -k``, else unavailable.

Parsing never raises: a truncated or garbled line is simply not an XID line.
"""

from __future__ import annotations

import errno
import os
import re
import select
from dataclasses import dataclass
from typing import Protocol

from node_agent import proc

# Driver 418..570 forms seen in the field:
#   NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0000:18:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception ...
#   NVRM: Xid (0000:3b:00): 48, An uncorrectable double bit error (DBE) has been detected ...
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.\d)?\): "
    r"(?P<code>\d{1,4})(?:,\s*(?P<rest>.*))?$")


@dataclass(frozen=True)
class XidLine:
    code: int
    pci_bus: str  # normalised "0000:3b:00"
    message: str
    raw: str


@dataclass(frozen=True)
class LogRecord:
    seq: int  # monotonically increasing position (kmsg sequence number or line number)
    text: str


def normalise_bus(bus: str) -> str:
    """``00000000:3B:00.0`` (NVML) and ``0000:3b:00`` (kernel) -> ``0000:3b:00``."""
    bus = bus.lower().split(".")[0]
    domain, _, rest = bus.partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def parse_xid_line(line: str) -> XidLine | None:
    """The XID in one kernel-log line, or None when the line is not a (complete) XID line."""
    if "Xid" not in line:
        return None
    match = _XID_RE.search(line.strip())
    if match is None:
        return None
    try:
        bus = normalise_bus(match["bus"])
    except ValueError:
        return None
    return XidLine(code=int(match["code"]), pci_bus=bus, message=(match["rest"] or "").strip(),
                   raw=line.strip())


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


def _parse_kmsg_record(raw: str) -> LogRecord | None:
    header, sep, message = raw.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    try:
        seq = int(fields[1])
    except (IndexError, ValueError):
        return None
    return LogRecord(seq, message.split("\n", 1)[0])


class JournalKernelLog:
    """``journalctl -k -b``: the kernel messages of this boot (when /dev/kmsg is unreadable)."""

    source = "journalctl -k -b"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        result = proc.run(["journalctl", "-k", "-b", "-o", "cat", "--no-pager", "-q"],
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
