"""What surrounds a kernel message in a log line, and which messages are never sources.

The *framing* is what a log puts around the kernel's message: a kmsg header, a ``dmesg`` time,
a syslog or journal ``<time> <host> kernel:``. :func:`kernel_message` strips it and returns the
message; the message is then believed only where it *starts* with a form of the kernel's or the
driver's own text (docs/xid.md, "Rules of belief"). The middle of a line is never searched.

Some kernel printers put a *user's* text at the start of the kernel's own record, and those
records are **never sources**, whatever they start with (:func:`refusal` says why):

- the kernel's reports of a user's fault: ``comm[pid]: segfault at ... in <file>[...]``
  (arch/x86/mm/fault.c, ``show_signal_msg``), ``traps: comm[pid] general protection ...``
  (arch/x86/kernel/traps.c), arm64's ``comm[pid]: unhandled ...``, and any message led by a
  process name and its pid (``comm[pid]:``, ``comm (pid):``);
- netfilter's LOG target (``xt_LOG``, nftables ``log``, ``ebt_log``): the rule's prefix first,
  then `` IN=<dev> OUT=<dev> ...`` (net/netfilter/nf_log_syslog.c, ``nf_log_dump_packet_common``:
  ``"%sIN=%s OUT=%s "``). The prefix is up to 127 characters (nftables) of the rule owner's
  choosing; a record with that tail is refused;
- the NVIDIA driver's ``NVRM: API mismatch: the client has the version <string>, but ...``
  (``RmCheckVersion``, src/nvidia/arch/nvalloc/unix/src/osapi.c): any user who can open
  ``/dev/nvidiactl`` chooses the 63-character string, newlines included. The whole record is
  refused, and in a text log its later lines too (:class:`MessageReader`).
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass

#: syslog facility 0 (LOG_KERN): printk's own; /dev/kmsg writes get 1 (LOG_USER) unless they
#: name another non-zero one (kernel/printk/printk.c, devkmsg_write)
KERNEL_FACILITY = 0


@dataclass(frozen=True)
class Stamp:
    """When a line was logged: ``boot`` = seconds since boot (kmsg, ``dmesg``), ``wall`` = Unix
    seconds (``dmesg -T``, ISO times). Times of different clocks are never compared."""

    clock: str  # "boot" | "wall"
    seconds: float


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


# -- where a kernel message starts: the prefixes a log puts in front of it --------------------
_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
_BDF = _BUS + r"\.[0-7]"
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
DRIVER_START = re.compile(r"^(?:NVRM: |nvidia-nvswitch\d+:? )")
#: the kernel's device prefix, dev_printk's "<driver> <domain:bus:dev.fn>: "
DEVICE_START = re.compile(rf"^(?P<drv>[A-Za-z0-9_.-]+) (?P<bdf>{_BDF}): ")
#: kernel messages of the distress forms that look like a syslog "<host> <ident>: " after a dmesg
#: time ("[ 5.1] nvme nvme0: ...", "[ 5.1] XFS (dm-0): ..."): the device's driver and name
_DISTRESS_START = re.compile(
    r"^(?:nvme nvme\d+: |EXT[234]-fs \(|XFS \(|Memory failure: |NMI watchdog: )"
)

# -- messages that are never sources ----------------------------------------------------------
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
#: netfilter's LOG tail: "<prefix>IN=<in> OUT=<out> " (nf_log_syslog.c; ebt_log prints a blank
#: before IN=). Interface names hold no blank, '/' or ':' (net/core/dev.c, dev_valid_name) and
#: at most 15 characters (IFNAMSIZ); either may be empty.
_NETFILTER_TAIL = re.compile(r"IN=[^\s/:=]{0,15} OUT=[^\s/:=]{0,15}(?: |$)")
#: the driver's version check, which prints the client's string (osapi.c, RmCheckVersion)
API_MISMATCH = re.compile(r"^NVRM: API mismatch:")


def refusal(message: str) -> str | None:
    """Why a kernel message is never a source (a user's text may start it), or None.

    ``message`` is the whole record (all its lines): a netfilter tail on a later line of the
    record still marks it, since a rule's prefix may hold a newline.
    """
    if _NETFILTER_TAIL.search(message):
        return "netfilter LOG record: it starts with a firewall rule's prefix"
    first = message.split("\n", 1)[0]
    if API_MISMATCH.match(first):
        return "the driver's API-mismatch record prints a client's version string"
    if _USER_FAULT.search(first) or _COMM_LED.match(first):
        return "the kernel's report of a user's fault (a process name leads it)"
    return None


def frame(line: str) -> tuple[str, str] | None:
    """``(prefix, message)``: the framing in front of the kernel's message and the message, or
    None when the line is not the kernel's own (a user program's syslog line, a kmsg record of
    another facility, ``dmesg --decode`` of another facility). Nothing is refused here for
    what the message says: see :func:`kernel_message`.

    Strips, in this order and each at most once: leading blanks, a kmsg header (None unless
    facility 0), ``dmesg --decode``'s ``kern  :err   :`` (None unless ``kern``), a ``dmesg`` time
    (``[ 123.456]``, ``-T``/``--ctime``, ISO), a syslog/journal ``<time> <host> <ident>:`` (None
    unless the identifier is ``kernel``), a bare ``kernel:``, then the kernel's own
    ``[ 123.456]`` a syslog line repeats.
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
            and not DRIVER_START.match(after)
            and not DEVICE_START.match(after)
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


def kernel_message(line: str) -> tuple[str, str] | None:
    """``(prefix, message)``: the kernel's message in one log line, with the framing in front of
    it, or None when the line is not the kernel's own or its message is never a source (a
    user's text may start it: :func:`refusal`). What is left after the framing is the message;
    nothing is searched for further in.

    >>> kernel_message("Dec  2 11:38:27 worker4 kernel: [  218.25] NVRM: GPU 0000:0a:00.0: x")[1]
    'NVRM: GPU 0000:0a:00.0: x'
    >>> kernel_message("Dec  2 11:38:27 worker4 python3[77]: NVRM: Xid (PCI:0000:0a:00): 79") is None
    True
    >>> kernel_message("[ 9.1] NVRM: Xid (PCI:0000:18:00): 79, IN=eth0 OUT= MAC=00:11") is None
    True
    """
    found = frame(line)
    if found is None or refusal(found[1]) is not None:
        return None
    return found


#: the lines of an API-mismatch record after its first (R535/R550: "NVRM: this kernel module has
#: the version ...", "NVRM: make sure that this kernel module and all NVIDIA driver", "NVRM:
#: components have the same version."; R570 on: "NVRM: has the version <s>, but this kernel
#: module has", ..., "NVRM: kernel module and all NVIDIA driver components", "NVRM: have the same
#: version."). The client's string comes before them; each form's last two lines together are
#: longer than the 63 characters a client has, so a client cannot end the record early.
_API_TAILS = (
    (
        "NVRM: make sure that this kernel module and all NVIDIA driver",
        "NVRM: components have the same version.",
    ),
    ("NVRM: kernel module and all NVIDIA driver components", "NVRM: have the same version."),
)
#: the most lines an API-mismatch record can print: 5 of the driver's and one for each newline
#: in the client's 63-character string and 15-character process name
API_MISMATCH_MAX_LINES = 5 + 63 + 15


class MessageReader:
    """Kernel messages from log lines in order, refusing the later lines of a record a user's
    text may have split.

    A kmsg record keeps its lines together (its newlines are escaped), but a text log (syslog,
    ``dmesg``) prints each line of a record as a line of its own, with the record's framing in
    front. The driver's API-mismatch record prints a client's string that may hold newlines, so
    in a text log every line up to the record's own last two lines is refused: lines with the
    same time as its first, or with none (``dmesg`` indents a record's later lines), at most
    :data:`API_MISMATCH_MAX_LINES`. A line with another time is another record.
    """

    def __init__(self) -> None:
        self._left = 0
        self._stamp: Stamp | None = None
        self._last = ""

    def message(self, line: str, words: tuple[str, ...] = ()) -> tuple[str, str] | None:
        """What :func:`kernel_message` gives, or None for a line inside an API-mismatch record.
        ``words``: the caller reads only messages that hold one of them (a cheap test first)."""
        if (
            words
            and not self._left
            and "API mismatch" not in line
            and not any(word in line for word in words)
        ):
            return None
        found = frame(line)
        if self._left:
            if self._inside(line, found):
                return None
            self._left = 0
        if found is None:
            return None
        if API_MISMATCH.match(found[1]):
            self._left, self._stamp, self._last = API_MISMATCH_MAX_LINES, line_stamp(found[0]), ""
            return None
        return None if refusal(found[1]) is not None else found

    def _inside(self, line: str, found: tuple[str, str] | None) -> bool:
        stamp = line_stamp(found[0]) if found is not None else None
        indented = line[:1].isspace()  # dmesg and journalctl indent a record's later lines
        if not indented and stamp is not None and self._stamp is not None and stamp != self._stamp:
            return False  # another record
        self._left -= 1
        text = found[1] if found is not None else ""
        if any(self._last == one and text == two for one, two in _API_TAILS):
            self._left = 0  # the driver's own last line: the record ends here
        self._last = text
        return True
