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

and the driver's lines that carry no Xid number, and the PCIe AER lines of the kernel
(:class:`DriverLine`, graded through ``graders/driver_lines.yaml``):

    NVRM: GPU0 nvAssertOkFailedNoLog: Assertion failed: Reset required [NV_ERR_RESET_REQUIRED] ...
    NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)
    NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: GPU lost from the bus [NV_ERR_GPU_IS_LOST] ...
    nvidia 0000:18:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, ...
    pcieport 0000:17:00.0: AER: device recovery failed

**What is believed** (docs/xid.md, "Rules of belief"). A line is a source only where the driver
or the kernel's PCI core wrote it:

- a ``/dev/kmsg`` record (or a saved line with its ``prio,seq,usec,flags;`` header) of facility
  0, the kernel; a user's write to ``/dev/kmsg`` is facility 1 (``devkmsg_write`` never lets user
  space claim facility 0) and is never read;
- after one known prefix is stripped (the kmsg header; ``dmesg``'s ``[ 123.456]``, ``-T``/
  ``--ctime``, ISO and ``--decode``'s ``kern  :err   :``; syslog or journal ``<time> <host>
  kernel:``, where any identifier but ``kernel`` is a user program), the message must *start*
  with ``NVRM: `` or ``nvidia-nvswitch<N>: `` (for AER: ``<driver> <domain:bus:dev.fn>: ``). The
  middle of a line is never searched: the kernel's report of a user's segfault prints the name of
  the user's file there (``comm[pid]: segfault at ... in <file>[...]``);
- the kernel's reports of user faults (``comm[pid]: segfault at``, ``traps:``, ``general
  protection``) are never sources, even where a user named their process ``NVRM: ...``;
- in a record of several lines (a kmsg message with embedded newlines), only the first line is
  a message; the others only complete the driver's three-line "fallen off the bus".

The time in the prefix, where there is one, becomes the event's :class:`Stamp`.
"""

from __future__ import annotations

import calendar
import errno
import json
import os
import re
import select
import stat
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
    #: syslog facility from the kmsg header (0 = kernel, 1 = user: a write to /dev/kmsg);
    #: None where the source does not say (a saved text line: its prefix is checked instead)
    facility: int | None = None

    @property
    def from_kernel(self) -> bool:
        """False for a record the kernel did not write itself (facility other than 0)."""
        return self.facility is None or self.facility == KERNEL_FACILITY


#: syslog facility 0 (LOG_KERN): printk's own; /dev/kmsg writes get 1 (LOG_USER) unless they
#: name another non-zero one (kernel/printk/printk.c, devkmsg_write)
KERNEL_FACILITY = 0


_KMSG_HEADER = re.compile(r"^\s*\d+,\d+,(?P<us>\d+),[^;]*;")
_BOOT_STAMP = re.compile(r"\[\s*(?P<s>\d+\.\d+)\]")
_CTIME_STAMP = re.compile(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<t>(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
    r" +\d{1,2} \d\d:\d\d:\d\d \d{4})\]"
)
_ISO_STAMP = re.compile(
    r"(?P<t>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.](?P<frac>\d{1,9}))?"
    r"(?P<tz>Z|[+-]\d\d:?\d\d)?"
)


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
            return Stamp(
                "wall",
                float(
                    calendar.timegm(time.strptime(" ".join(m["t"].split()), "%b %d %H:%M:%S %Y"))
                ),
            )
        if (m := _ISO_STAMP.search(prefix)) is not None:
            seconds = float(calendar.timegm(time.strptime(m["t"], "%Y-%m-%dT%H:%M:%S")))
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
        fields = {
            "unit": self.unit,
            "severity": self.severity,
            "error_status": self.error_status,
            "subcode": None if self.subcode is None else format(self.subcode, "06b"),
            "recovery_action": self.recovery_action,
        }
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


@dataclass(frozen=True)
class DriverLine:
    """A line of the NVIDIA driver (or the kernel's PCIe AER) that reports a GPU in trouble
    without an Xid number. ``kind`` is a key of ``graders/driver_lines.yaml``:

    - ``reset-required``: ``Reset required [NV_ERR_RESET_REQUIRED] (0x00000062)`` (RM status
      0x62, ``src/common/sdk/nvidia/inc/nvstatuscodes.h``), printed by ``nvAssertOkFailedNoLog``/
      ``nvCheckOkFailedNoLog`` (``src/nvidia/src/libraries/nvport/...``, ``NV_ASSERT_OK``);
    - ``init-failed``: ``GPU <bdf>: RmInitAdapter failed! (0x..:0x..:N)``
      (``src/nvidia/arch/nvalloc/unix/src/osinit.c``, ``RmInitAdapter``);
    - ``gpu-lost``: ``GPU lost from the bus [NV_ERR_GPU_IS_LOST] (0x0000000F)``;
    - ``aer-uncorrectable``: ``<drv> <bdf>: PCIe Bus Error: severity=Uncorrected (Fatal)`` (or
      ``Uncorrectable``, kernels from 6.10 on; ``drivers/pci/pcie/aer.c``, ``aer_print_error``);
    - ``aer-recovery-failed``: ``pcieport <port>: AER: device recovery failed``
      (``drivers/pci/pcie/err.c``, ``pcie_do_recovery``) after an uncorrectable error on a
      device below that port: the event is the *device's* (``pci_bus``), the port in ``port``.

    ``pci_bus`` is normalised (``0000:3b:00``) where the line names a bus; ``driver_gpu`` is the
    driver's own GPU number of ``NVRM: GPU5 ...`` (the RM's instance, not NVML's index), for
    lines that name no bus.
    """

    kind: str
    pci_bus: str | None
    message: str
    raw: str
    driver_gpu: int | None = None
    status: int | None = None  # the RM status code printed (0x62, 0xf), where there is one
    severity: str | None = None  # AER: "Fatal" | "Non-Fatal"
    port: str | None = None  # AER recovery: the port that reported it ("0000:17:00.0")
    device_driver: str | None = None  # AER: the kernel driver named in front ("nvidia")
    stamp: Stamp | None = None


Event = XidLine | SxidLine

_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
_BDF = _BUS + r"\.[0-7]"
_XID = re.compile(r"^NVRM: Xid \((?P<inner>[^()\n]*)\)(?P<after>.*)$")
_SXID = re.compile(r"^nvidia-nvswitch(?P<sw>\d+):?\s*SXid \((?P<inner>[^()\n]*)\)(?P<after>.*)$")
_XID_ADDRESS = re.compile(
    rf"^(?:PCI:)?(?P<bus>{_BUS})(?:\.[0-7])?"
    r"(?:\s+GPU-I:(?P<gi>\d{1,3}))?(?:\s+GPU-CI:(?P<ci>\d{1,3}))?\s*$"
)
_SXID_ADDRESS = re.compile(rf"^(?:PCI:)?(?P<bus>{_BUS}(?:\.[0-7])?)\s*$")
_CODE = re.compile(r"^:\s*(?P<code>\d{1,6})(?=$|[,\s])(?:,\s*(?P<rest>.*))?$")
_PID = re.compile(r"^pid=(?P<pid>[^,]*),\s*")
_NAME = re.compile(r"^name=(?P<name>[^,]*),\s*")
_NVLINK5 = re.compile(
    r"^(?P<unit>[A-Z][A-Z0-9_]*)\s+(?P<sev>Non-?fatal|Nonfatal|Fatal)\s+XC\s?\d+\s+i\s?\d+\s+"
    r"Link\s+(?P<link>-?\d+)(?:\s*\((?P<words>[^)]*)\)|\s*\[(?P<bracket>[^\]]*)\])?"
)
_RECOVERY = re.compile(
    r"recovery action changed from 0x[0-9a-fA-F]+ \((?P<old>[^)]*)\) "
    r"to 0x[0-9a-fA-F]+ \((?P<new>[^)]*)\)"
)
_CAUSED_BY = re.compile(r"caused by previous Xid (?P<code>\d{1,4})")
_SXID_HEADLINE = re.compile(
    r"^(?P<sev>Non-?fatal|Fatal)\s*,\s*(?:Link\s+(?P<link>\d+)\s*)?(?P<name>.*)$"
)
_THE_GPU = re.compile(rf"^NVRM: The NVIDIA GPU (?P<bdf>{_BUS}(?:\.[0-7])?)")
_GPU_FALLEN = re.compile(rf"^NVRM: GPU (?P<bdf>{_BUS}(?:\.[0-7])?): GPU has fallen off the bus")
_PCI_ID = re.compile(r"PCI ID: (?P<id>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})")

# -- where a kernel message starts: the prefixes a log puts in front of it --------------------
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_P_KMSG = re.compile(r"^(?P<prio>\d+),\d+,\d+,[^;]*;")
_P_BOOT = re.compile(r"^\[\s*\d+\.\d+\]\s?")
_P_CTIME = re.compile(
    rf"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) {_MONTH} +\d{{1,2}} "
    r"\d\d:\d\d:\d\d \d{4}\]\s?"
)
_P_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?\s")
_P_DECODE = re.compile(
    r"^(?P<fac>[a-z0-9]+)\s*:\s*(?:emerg|alert|crit|err|warn|notice|info|debug)"
    r"\s*:\s"
)
_P_SYSLOG_TIME = re.compile(
    rf"^(?:{_MONTH} +\d{{1,2}} \d\d:\d\d:\d\d"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?"
    r"|\[\s*\d+\.\d+\])\s+"
)
#: "<host> <identifier>[pid]: " after a syslog/journal time; only "kernel" is the kernel
_P_SYSLOG_HOST = re.compile(r"^(?P<host>[^\s\[\]:]+) (?P<ident>[^\s\[\]:]+)(?:\[\d+\])?: ")
_P_KERNEL = re.compile(r"^kernel: ")
#: the kernel's reports of a user's fault, which print the user's process and file names:
#: "comm[pid]: segfault at ..." (arch/x86/mm/fault.c, show_signal_msg), "traps: comm[pid] general
#: protection ..." / "... trap ..." (arch/x86/kernel/traps.c), arm64's "comm[pid]: unhandled ..."
_USER_FAULT = re.compile(
    r"^(?:traps: )?[^\n]{0,16}[\[(]\d+[\])]:?\s+(?:segfault at|general "
    r"protection|trap |unhandled |potentially unexpected)|^traps: "
)
#: a kernel message that begins with a process's name (comm, at most 15 characters) and its pid,
#: "NVRM: Xid (PCI:[1234]: ..." / "NVRM: Xid (PC (1234): drop_caches": the name is a user's
_COMM_LED = re.compile(r"^[^\n]{1,16}?(?:\[\d+\]|\(\d+\)):? ")
_DRIVER_START = re.compile(r"^(?:NVRM: |nvidia-nvswitch\d+:? )")
_DEVICE_START = re.compile(rf"^(?P<drv>[A-Za-z0-9_.-]+) (?P<bdf>{_BDF}): ")
#: kernel messages of the distress forms that look like a syslog "<host> <ident>: " after a dmesg
#: time ("[ 5.1] nvme nvme0: ...", "[ 5.1] XFS (dm-0): ..."): the device's driver and name
_DISTRESS_START = re.compile(
    r"^(?:nvme nvme\d+: |EXT[234]-fs \(|XFS \(|Memory failure: |NMI watchdog: )"
)

_RESET_REQUIRED = re.compile(r"Reset required \[NV_ERR_RESET_REQUIRED\]|\bNV_ERR_RESET_REQUIRED\b")
_GPU_LOST = re.compile(r"GPU lost from the bus \[NV_ERR_GPU_IS_LOST\]|\bNV_ERR_GPU_IS_LOST\b")
_INIT_FAILED = re.compile(r"\bRmInitAdapter failed!")
_RM_STATUS = re.compile(r"\((?:0x)?(?P<hex>[0-9A-Fa-f]{8})\)|status[= ](?:0x)?(?P<st>[0-9A-Fa-f]+)")
_INIT_STATUS = re.compile(r"RmInitAdapter failed! \(0x(?P<hex>[0-9A-Fa-f]+):")
_NVRM_GPU = re.compile(rf"^NVRM: GPU (?P<bdf>{_BUS}(?:\.[0-7])?):|^NVRM: GPU(?P<n>\d{{1,3}}) ")
_AER_ERROR = re.compile(
    r"^PCIe Bus Error: severity=Uncorrect(?:ed|able) \((?P<sev>Fatal|Non-Fatal)\)"
)
_AER_RECOVERY_FAILED = re.compile(r"^AER: (?:device recovery failed|Device recovery failed)")


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


def kernel_message(line: str) -> tuple[str, str] | None:
    """``(prefix, message)``: the kernel's message in one log line, with the known prefix in front
    of it, or None when the line is not the kernel's own.

    Strips, in this order and each at most once: leading blanks, a kmsg header (None unless
    facility 0), ``dmesg --decode``'s ``kern  :err   :`` (None unless ``kern``), a ``dmesg`` time
    (``[ 123.456]``, ``-T``/``--ctime``, ISO), a syslog/journal ``<time> <host> <ident>:`` (None
    unless the identifier is ``kernel``), a bare ``kernel:``, then the kernel's own
    ``[ 123.456]`` a syslog line repeats. What is left is the message; nothing is searched for
    further in.

    >>> kernel_message("Dec  2 11:38:27 worker4 kernel: [  218.25] NVRM: GPU 0000:0a:00.0: x")[1]
    'NVRM: GPU 0000:0a:00.0: x'
    >>> kernel_message("Dec  2 11:38:27 worker4 python3[77]: NVRM: Xid (PCI:0000:0a:00): 79") is None
    True
    """
    rest = line.lstrip()
    if (m := _P_KMSG.match(rest)) is not None:
        if int(m["prio"]) >> 3 != KERNEL_FACILITY:
            return None
        rest = rest[m.end() :]
    if (m := _P_DECODE.match(rest)) is not None:
        if m["fac"] != "kern":
            return None
        rest = rest[m.end() :]
    if (m := _P_CTIME.match(rest) or _P_ISO.match(rest) or _P_BOOT.match(rest)) is not None:
        after = rest[m.end() :]
        host = _P_SYSLOG_HOST.match(after)
        if (
            host is not None
            and not _DRIVER_START.match(after)
            and not _DEVICE_START.match(after)
            and not _DISTRESS_START.match(after)
        ):
            # "<time> host ident: msg" (journalctl -o short-monotonic / short-iso, RFC 3339 syslog)
            if host["ident"] != "kernel":
                return None
            after = after[host.end() :]
        rest = after
    elif (m := _P_SYSLOG_TIME.match(rest)) is not None:
        host = _P_SYSLOG_HOST.match(rest[m.end() :])
        if host is None or host["ident"] != "kernel":
            return None  # a user program's syslog line, or a line of no known form
        rest = rest[m.end() + host.end() :]
    if (m := _P_KERNEL.match(rest)) is not None:
        rest = rest[m.end() :]
    if (m := _P_BOOT.match(rest)) is not None:  # syslog repeats the kernel's own time
        rest = rest[m.end() :]
    return line[: len(line) - len(rest)], rest.rstrip()


#: words one of which every line read here holds: a cheap test before the prefixes are parsed
_WORTH_PARSING = ("NVRM", "nvidia-nvswitch", "PCIe Bus Error", "AER:")


def _driver_message(line: str) -> tuple[str, str] | None:
    """The kernel message of ``line`` if it is one the NVIDIA driver or the PCI core could have
    written (starts with ``NVRM: ``, ``nvidia-nvswitchN: `` or ``<driver> <bdf>: ``) and is not a
    report of a user's fault."""
    if not any(word in line for word in _WORTH_PARSING):
        return None
    found = kernel_message(line)
    if found is None:
        return None
    prefix, message = found
    if _USER_FAULT.search(message) or _COMM_LED.match(message):
        return None
    if not (_DRIVER_START.match(message) or _DEVICE_START.match(message)):
        return None
    return prefix, message


def parse_line(line: str) -> Event | Unreadable | None:
    """What one kernel-log line reports: an Xid, an SXid, an :class:`Unreadable` line that names
    one, or None for any other line (including ``_kgspLogXid119:`` and the like, which mention
    the word but report nothing, and every line whose message does not *start* with the
    driver's prefix: see the module's rules of belief)."""
    found = _driver_message(line)
    return None if found is None else _parse_message(*found)


def _parse_message(prefix: str, text: str) -> Event | Unreadable | None:
    if (m := _SXID.match(text)) is not None:
        return _sxid(m, text, prefix)
    if (m := _XID.match(text)) is not None:
        return _xid(m, text, prefix)
    if re.match(r"^(?:NVRM: Xid|nvidia-nvswitch\d+:?\s*SXid) \(", text):
        return Unreadable("truncated inside the address: no ')' after 'Xid ('", text)
    return None


def parse_xid_line(line: str) -> XidLine | None:
    """The GPU Xid in one line, or None (not an Xid line, an SXid, or unreadable)."""
    event = parse_line(line)
    return event if isinstance(event, XidLine) else None


def parse_driver_line(line: str) -> DriverLine | None:
    """A driver line without an Xid number, or an AER uncorrectable-error line (see
    :class:`DriverLine`); ``AER: device recovery failed`` needs the lines before it and is read by
    :class:`KernelLogScanner` alone."""
    found = _driver_message(line)
    return None if found is None else _parse_driver_message(*found)


def _parse_driver_message(prefix: str, text: str) -> DriverLine | None:
    line = prefix + text
    stamp = line_stamp(prefix)
    if text.startswith("NVRM: "):
        kind = (
            "gpu-lost"
            if _GPU_LOST.search(text)
            else "reset-required"
            if _RESET_REQUIRED.search(text)
            else "init-failed"
            if _INIT_FAILED.search(text)
            else None
        )
        if kind is None:
            return None
        who = _NVRM_GPU.match(text)
        bus = normalise_bus(who["bdf"]) if who is not None and who["bdf"] else None
        gpu_n = int(who["n"]) if who is not None and who["n"] else None
        status: int | None = None
        if kind == "init-failed" and (s := _INIT_STATUS.search(text)) is not None:
            status = int(s["hex"], 16)
        elif (s := _RM_STATUS.search(text)) is not None:
            status = int(s["hex"] or s["st"], 16)
        return DriverLine(
            kind=kind,
            pci_bus=bus,
            message=text,
            raw=line.strip(),
            driver_gpu=gpu_n,
            status=status,
            stamp=stamp,
        )
    device = _DEVICE_START.match(text)
    if device is None:
        return None
    aer = _AER_ERROR.match(text[device.end() :])
    if aer is None:
        return None
    return DriverLine(
        kind="aer-uncorrectable",
        pci_bus=normalise_bus(device["bdf"]),
        message=text,
        raw=line.strip(),
        severity=aer["sev"],
        device_driver=device["drv"],
        stamp=stamp,
    )


def _code(after: str) -> tuple[int, str] | str:
    m = _CODE.match(after)
    if m is None:
        return (
            "truncated: no code after the address"
            if not after.strip(": ")
            else f"no numeric code after the address ({after.strip()[:40]!r})"
        )
    return int(m["code"]), (m["rest"] or "").strip()


def _xid(m: re.Match[str], text: str, prefix: str) -> XidLine | Unreadable:
    code_rest = _code(m["after"])
    code = code_rest[0] if isinstance(code_rest, tuple) else None
    address = _XID_ADDRESS.match(m["inner"].strip())
    if address is None:
        return Unreadable(
            f"the PCI address is not readable ({m['inner'][:40]!r}): the line names no GPU",
            text,
            code,
        )
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
        rest = rest[p.end() :]
        if (n := _NAME.match(rest)) is not None:
            process = n["name"] if n["name"] != "<unknown>" else None
            rest = rest[n.end() :]
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
        code=code,
        pci_bus=bus,
        message=rest,
        raw=(prefix + text).strip(),
        gpu_instance=int(address["gi"]) if address["gi"] else None,
        compute_instance=int(address["ci"]) if address["ci"] else None,
        pid=pid,
        process=process,
        stamp=line_stamp(prefix),
        **fields,
    )


def _sxid(m: re.Match[str], text: str, prefix: str) -> SxidLine | Unreadable:
    code_rest = _code(m["after"])
    address = _SXID_ADDRESS.match(m["inner"].strip())
    if address is None:
        return Unreadable(
            f"the NVSwitch PCI address is not readable ({m['inner'][:40]!r})",
            text,
            code_rest[0] if isinstance(code_rest, tuple) else None,
        )
    if isinstance(code_rest, str):
        return Unreadable(code_rest, text)
    code, rest = code_rest
    severity: str | None = None
    link: int | None = None
    if (h := _SXID_HEADLINE.match(rest)) is not None:
        severity = _severity(h["sev"])
        link = int(h["link"]) if h["link"] else None
    return SxidLine(
        code=code,
        switch=int(m["sw"]),
        pci_bus=address["bus"].lower(),
        message=rest,
        raw=(prefix + text).strip(),
        severity=severity,
        link=link,
        stamp=line_stamp(prefix),
    )


class KernelLogScanner:
    """Records in, events out, keeping what a message split over several lines needs.

    - A record the kernel did not write (facility other than 0) gives nothing.
    - ``NVRM: The NVIDIA GPU <bdf>`` / ``(PCI ID: ...) installed in this system has`` /
      ``fallen off the bus and is not responding to commands.`` (driver 570.158.01, no Xid line;
      ../shared/realworld/xid/x19) becomes Xid 79 on that GPU, as gpud (PR #1209) and NVSentinel
      (``pkg/gpufallen``, #195) map it. The three lines may come as one record or as three.
    - ``NVRM: GPU <bdf>: GPU has fallen off the bus.`` follows the driver's Xid 79 line (x04, x09,
      x17) and is not counted again; alone (the Xid line lost) it becomes Xid 79 itself.
    - ``<drv> <bdf>: PCIe Bus Error: severity=Uncorrect... `` is remembered for the next
      ``_AER_LOOKAHEAD`` lines; ``pcieport <port>: AER: device recovery failed`` within them
      makes an ``aer-recovery-failed`` line for each such device (the port is not the GPU).
    """

    _FALLEN_LOOKAHEAD = 3  # the two continuation lines, plus one for an interleaved record
    #: lines an uncorrectable AER error waits for its "device recovery failed": the kernel prints
    #: the error, its TLP header and status lines (about 5-10), the drivers' callbacks, the result
    _AER_LOOKAHEAD = 40

    def __init__(self) -> None:
        self._pending: tuple[str, list[str], Stamp | None, int] | None = None
        self._fallen_buses: set[str] = set()
        self._aer: dict[str, tuple[DriverLine, int]] = {}  # device bus -> (its error, lines left)

    def feed(self, record: LogRecord) -> list[Event | Unreadable | DriverLine]:
        if not record.from_kernel:
            return []
        stamp = Stamp("boot", record.boot_s) if record.boot_s is not None else None
        out: list[Event | Unreadable | DriverLine] = []
        for i, line in enumerate(record.text.split("\n")):
            out.extend(self._line(line, stamp, continuation=i > 0))
        return out

    def _line(
        self, line: str, record_stamp: Stamp | None, continuation: bool = False
    ) -> list[Event | Unreadable | DriverLine]:
        if self._pending is not None:
            bdf, lines, stamp, left = self._pending
            lines.append(line.strip())
            if "fallen off the bus" in line:
                self._pending = None
                return [self._fallen(bdf, lines, stamp)]
            self._pending = (bdf, lines, stamp, left - 1) if left > 1 else None
        if continuation:
            return []  # only the first line of a record is a message of its own
        self._age_aer()
        found = _driver_message(line)
        if found is None:
            return []
        prefix, text = found
        if (m := _THE_GPU.match(text)) is not None:
            stamp = record_stamp or line_stamp(prefix)
            if "fallen off the bus" in text:
                return [self._fallen(m["bdf"], [line.strip()], stamp)]
            self._pending = (m["bdf"], [line.strip()], stamp, self._FALLEN_LOOKAHEAD)
            return []
        if (m := _GPU_FALLEN.match(text)) is not None:
            if normalise_bus(m["bdf"]) in self._fallen_buses:
                return []  # the Xid 79 line just before said it
            return [self._fallen(m["bdf"], [line.strip()], record_stamp or line_stamp(prefix))]
        if (device := _DEVICE_START.match(text)) is not None and _AER_RECOVERY_FAILED.match(
            text[device.end() :]
        ):
            return self._aer_failed(device["bdf"], line.strip(), record_stamp or line_stamp(prefix))
        event: Event | Unreadable | DriverLine | None = _parse_message(prefix, text)
        if event is None:
            event = _parse_driver_message(prefix, text)
        if event is None:
            return []
        if record_stamp is not None and not isinstance(event, Unreadable):
            event = replace(event, stamp=record_stamp)
        if isinstance(event, XidLine) and event.code == 79:
            self._fallen_buses.add(event.pci_bus)
        if isinstance(event, DriverLine) and event.kind == "aer-uncorrectable" and event.pci_bus:
            self._aer[event.pci_bus] = (event, self._AER_LOOKAHEAD)
        return [event]

    def _age_aer(self) -> None:
        for bus, (event, left) in list(self._aer.items()):
            if left <= 1:
                del self._aer[bus]
            else:
                self._aer[bus] = (event, left - 1)

    def _aer_failed(
        self, port: str, raw: str, stamp: Stamp | None
    ) -> list[Event | Unreadable | DriverLine]:
        out: list[Event | Unreadable | DriverLine] = [
            DriverLine(
                kind="aer-recovery-failed",
                pci_bus=bus,
                raw=raw,
                port=port.lower(),
                message=f"{raw} (after {error.raw})",
                severity=error.severity,
                device_driver=error.device_driver,
                stamp=stamp or error.stamp,
            )
            for bus, (error, _) in sorted(self._aer.items())
        ]
        self._aer.clear()
        return out

    def _fallen(self, bdf: str, lines: list[str], stamp: Stamp | None) -> XidLine:
        bus = normalise_bus(bdf)
        self._fallen_buses.add(bus)
        joined = " / ".join(x for x in lines if x)
        pci_id = _PCI_ID.search(joined)
        return XidLine(
            code=79,
            pci_bus=bus,
            raw=joined,
            origin="fallen-off-bus",
            stamp=stamp,
            message="GPU has fallen off the bus (printed without an Xid line"
            + (f"; PCI ID {pci_id['id']}" if pci_id else "")
            + "; read as Xid 79, as gpud and NVSentinel do)",
        )


def scan(records: Iterable[LogRecord]) -> list[Event | Unreadable | DriverLine]:
    """Every event in ``records``, in order (a fresh :class:`KernelLogScanner`)."""
    scanner = KernelLogScanner()
    return [event for record in records for event in scanner.feed(record)]


def scan_lines(lines: Iterable[str]) -> list[Event | Unreadable | DriverLine]:
    """Every event in plain text lines (a saved ``dmesg``, a test sample)."""
    return scan(LogRecord(i + 1, line) for i, line in enumerate(lines))


# --- sources ---------------------------------------------------------------------------------


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
    """A file read as the kernel log (config ``kernel_log.path``): a saved ``dmesg`` or
    ``journalctl -k`` text, a capture's tail, one line per record. A line that carries a kmsg
    header (``6,123,456789,-;NVRM: ...``) keeps its facility, sequence number and time.

    Read with ``O_NOFOLLOW|O_NONBLOCK`` and checked with ``fstat``: a regular file; when the
    agent runs as root, owned by root and writable by nobody else (a file another user can write
    would let them write "kernel" lines). Re-read whole on every ``read()`` (the daemon polls it).
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
            os.lseek(fd, skip, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        lines = b"".join(chunks).decode("utf-8", "replace").split("\n")
        if skip:
            lines = lines[1:]  # the first line was cut
        records = []
        for i, line in enumerate(lines):
            if not line:
                continue
            record = _parse_kmsg_record(line) if _P_KMSG.match(line) else None
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


def journal_records(text: str) -> list[LogRecord]:
    """``journalctl -o json`` output -> the kernel's records (see :class:`JournalKernelLog`)."""
    records: list[LogRecord] = []
    for i, line in enumerate(text.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("_TRANSPORT") != "kernel":
            continue
        facility = entry.get("SYSLOG_FACILITY")
        if facility is not None and str(facility) != str(KERNEL_FACILITY):
            continue
        message = entry.get("MESSAGE")
        if isinstance(message, list):  # journald stores non-UTF-8 text as a byte array
            message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode(
                "utf-8", "replace"
            )
        if not isinstance(message, str):
            continue
        boot_s: float | None = None
        for key in ("_SOURCE_MONOTONIC_TIMESTAMP", "__MONOTONIC_TIMESTAMP"):
            try:
                boot_s = int(entry[key]) / 1e6
                break
            except (KeyError, TypeError, ValueError):
                continue
        records.append(LogRecord(i + 1, message, boot_s, facility=KERNEL_FACILITY))
    return records


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
