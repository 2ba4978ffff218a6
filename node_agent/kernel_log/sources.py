"""Where the kernel log comes from: ``/dev/kmsg``, the journal, a file the operator named, a list
of lines. Each source gives :class:`LogRecord` in order; the source says who wrote a record
(kmsg facility 0, the journal's ``_TRANSPORT=kernel``), and the framing grammar
(:mod:`node_agent.kernel_log.framing`) reads the lines of a file or a list."""

from __future__ import annotations

import errno
import os
import re
import select
import stat
from collections.abc import Iterator
from typing import Protocol

from node_agent import proc
from node_agent.kernel_log.framing import kernel_message
from node_agent.kernel_log.journal import journal_file_records, journal_form, journal_records
from node_agent.kernel_log.record import LogRecord


class KernelLog(Protocol):
    source: str
    unavailable_reason: str | None
    #: True for this host's own log (kmsg, the journal), where the host's PCI bus can say which
    #: bus ids are NVIDIA devices; False for a file or a list of lines from anywhere
    live: bool

    def read(self) -> list[LogRecord]: ...


class LinesKernelLog:
    """A fixed list of lines (the simulator, tests, a saved dmesg)."""

    def __init__(self, lines: list[str], source: str = "lines", live: bool = False) -> None:
        self._lines = lines
        self.source = source
        self.live = live
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        return [LogRecord(i + 1, line) for i, line in enumerate(self._lines)]


#: the most of a kernel-log file that is read (its end): a kernel ring buffer is 128 KiB-16 MiB
#: (CONFIG_LOG_BUF_SHIFT, log_buf_len=); a saved log larger than this is read from its tail
FILE_READ_BYTES = 16 << 20


class FileKernelLog:
    """A file read as the kernel log (config ``kernel_log.path``): a saved ``dmesg``, syslog or
    ``journalctl -k`` text, a capture's tail, or the journal's ``-o export``/``verbose``/``json``
    output (:func:`file_records`). The framing grammar reads its lines as it reads any log's.

    Read with ``O_NOFOLLOW|O_NONBLOCK`` and checked with ``fstat``: a regular file; when the
    agent runs as root, owned by root and writable by nobody else (a file another user can write
    would let them write "kernel" lines). Re-read whole on every ``read()`` (the daemon polls it),
    and read as this boot's kernel log (:func:`this_boot`), as ``/dev/kmsg`` is.
    """

    live = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.source = path
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{self.path} is not a regular file")
            if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
                raise OSError(
                    errno.EPERM,
                    f"{self.path} is owned by uid {st.st_uid} or writable "
                    "by others: a kernel log must be root's alone",
                )
            skip = max(0, st.st_size - FILE_READ_BYTES)
            head = os.pread(fd, 1 << 16, 0) if skip else None
            if head is not None:
                _refuse_a_cut_journal(self.path, head)
            os.lseek(fd, skip, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return this_boot(file_records(b"".join(chunks), cut=bool(skip), head=head))


#: journalctl's line between two boots in its text output ("-- Boot <id> --"; "-- Reboot --"
#: before systemd 250)
_JOURNAL_BOOT = re.compile(r"^-- (?:Boot [0-9a-f]{32}|Reboot) --$")
#: the banner the kernel prints first at every boot (init/main.c, start_kernel: linux_banner)
_BANNER = "Linux version "


def this_boot(records: list[LogRecord]) -> list[LogRecord]:
    """The records of the last boot a saved log shows: from the kernel's last banner ("Linux
    version ...", believed as any kernel line is) or after journalctl's last "-- Boot <id> --".

    A file that spans boots (an rsyslog ``kern.log``, a ``journalctl -k`` of several boots) is
    then read as ``/dev/kmsg`` is, this boot only: an Xid 79 of a GPU replaced since, or a fault
    a reboot has cleared, is not graded again after every restart (it had escalated a repaired
    node to a replacement). A log that shows no boot is read whole."""
    start = 0
    for i, record in enumerate(records):
        text = record.text.split("\n", 1)[0]
        if _JOURNAL_BOOT.match(text.strip()):
            start = i + 1
        elif _BANNER in text and record.from_kernel:
            found = kernel_message(text)
            if found is not None and found[1].startswith(_BANNER):
                start = i
    return records[start:]


def _refuse_a_cut_journal(path: str, head: bytes) -> None:
    """A journal ``export`` or ``verbose`` file too large to read whole cannot be read from its
    tail: an entry's field may hold any bytes (export's binary fields, a multi-line message), so
    the first line break after the cut may fall inside a user's message and make entries of it.
    The form is judged by the file's head, which no user writes."""
    form = journal_form(head)
    if form in ("export", "verbose"):
        raise OSError(
            errno.EFBIG,
            f"{path} is a journal '-o {form}' file of more than {FILE_READ_BYTES >> 20} MiB, which "
            "cannot be read from its tail (an entry boundary cannot be found safely in it): "
            f"save a shorter span (journalctl -k -o {form} --since ...), or leave "
            "kernel_log.path unset to read this host's kernel log",
        )


def file_records(data: bytes, cut: bool = False, head: bytes | None = None) -> list[LogRecord]:
    """A saved log's records, by its form: the journal's ``-o export``, ``-o verbose`` or
    ``-o json`` (each entry believed only with ``_TRANSPORT=kernel``, as the journal source),
    else text, one line per record (a line with a kmsg header keeps its facility, sequence
    number and time). ``cut``: the data starts inside a line (a file read from its tail), and
    ``head``, the file's first bytes, judges its form."""
    if cut:
        data = data[data.find(b"\n") + 1 :]
    form = journal_form(data if head is None else head)
    if form is not None:
        return journal_file_records(data, form)
    lines = data.decode("utf-8", "replace").split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line:
            continue
        record = _parse_kmsg_record(line) if _KMSG_LINE.match(line) else None
        records.append(
            LogRecord(i + 1, line)
            if record is None
            else LogRecord(i + 1, record.text, record.boot_s, record.facility)
        )
    return records


class KmsgKernelLog:
    """``/dev/kmsg``: every record still in the ring buffer, with its sequence number."""

    live = True

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
    for chunk in kmsg_chunks(fd):
        record = _parse_kmsg_record(chunk.decode("utf-8", "replace"))
        if record is not None:
            records.append(record)
    return records


def kmsg_chunks(fd: int) -> Iterator[bytes]:
    """The records a non-blocking ``/dev/kmsg`` fd has ready, one read each, until none is
    (EAGAIN); a record overwritten while reading (EPIPE) is skipped; other errors raise."""
    while True:
        try:
            chunk = os.read(fd, 8192)
        except OSError as err:
            if err.errno == errno.EAGAIN:
                return
            if err.errno == errno.EPIPE:  # overwritten while reading: skip ahead
                continue
            raise
        if not chunk:
            return
        yield chunk


_KMSG_LINE = re.compile(r"^\d+,\d+,\d+,[^;]*;")
_KMSG_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _parse_kmsg_record(raw: str) -> LogRecord | None:
    """``prio,seq,usec,flags;message\\n KEY=value...`` (Documentation/ABI/testing/dev-kmsg).

    ``prio`` is the syslog priority and facility (``facility << 3 | level``): 0-7 for the kernel's
    own printk, 8 and up for what user space wrote to /dev/kmsg (facility 1 at least). The kernel
    escapes a newline inside a message as ``\\x0a``: a multi-line message (the three-line "fallen
    off the bus") comes back as one record whose text holds the newlines.
    """
    header, sep, message = raw.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    try:
        prio = int(fields[0])
        seq = int(fields[1])
        boot_s: float | None = int(fields[2]) / 1e6
    except (IndexError, ValueError):
        return None
    text = _KMSG_ESCAPE.sub(lambda m: chr(int(m[1], 16)), message.split("\n", 1)[0])
    return LogRecord(seq, text, boot_s, facility=prio >> 3)


class JournalKernelLog:
    """The kernel messages of this boot from the journal (when /dev/kmsg is unreadable):
    ``journalctl -k -b -o json``. ``-k`` adds the match ``_TRANSPORT=kernel``
    (journalctl(1)), and each entry is checked again: ``_TRANSPORT`` must be ``kernel`` and
    ``SYSLOG_FACILITY`` 0 where given. ``__MONOTONIC_TIMESTAMP`` (or the kernel's own
    ``_SOURCE_MONOTONIC_TIMESTAMP``) becomes the record's time since boot.
    """

    source = "journalctl -k -b"
    live = True

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.unavailable_reason: str | None = None

    def read(self) -> list[LogRecord]:
        result = proc.run(
            ["journalctl", "-k", "-b", "-o", "json", "--no-pager", "-q"], timeout_s=self.timeout_s
        )
        if not result.ok:
            raise OSError(result.describe_failure())
        return journal_records(result.stdout)


class UnavailableKernelLog:
    source = "none"
    live = False

    def __init__(self, reason: str) -> None:
        self.unavailable_reason: str | None = reason

    def read(self) -> list[LogRecord]:
        return []


def open_kernel_log(path: str | None = None, kmsg_path: str = "/dev/kmsg") -> KernelLog:
    """The kernel log to read: ``path`` (config ``kernel_log.path``) when given, else the best
    readable source on this host, or one that says why there is none.

    A ``path`` that is a character device is read as kmsg (``/dev/kmsg`` named explicitly);
    anything else as a :class:`FileKernelLog`.
    """
    if path is not None:
        try:
            st = os.stat(path)
        except OSError as err:
            return UnavailableKernelLog(f"kernel_log.path {path}: {err.strerror or err}")
        if stat.S_ISCHR(st.st_mode):
            return KmsgKernelLog(path)
        return FileKernelLog(path)
    if os.access(kmsg_path, os.R_OK):
        return KmsgKernelLog(kmsg_path)
    if proc.which("journalctl"):
        return JournalKernelLog()
    if os.path.exists(kmsg_path):
        return UnavailableKernelLog(
            f"no permission to read the kernel log ({kmsg_path}): run as root or grant CAP_SYSLOG"
        )
    return UnavailableKernelLog(
        f"no kernel log: {kmsg_path} does not exist and journalctl is not installed"
    )
