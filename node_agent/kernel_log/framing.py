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
import json
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


# -- the framing grammar: what a log puts in front of the kernel's message -----------------------
#: a PCI bus, domain:bus:device (``0000:3b:00``, NVML's ``00000000:3B:00``); BDF adds ``.fn``
BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}"
BDF = BUS + r"\.[0-7]"
_ISO = (
    r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[,.]\d{1,9})?(?: ?(?:Z|[+-]\d\d:?\d\d|UTC|[A-Z]{3,5}))?"
)
#: a month's name in any language (``Dec``, ``Dez``, ``déc.``, ``дек``) or as CJK prints it (``12月``)
_ANY_MONTH = r"(?:[^\W\d_]{2,10}\.?|\d{1,2}[月월])"
_P_KMSG = re.compile(r"^(?P<prio>\d+),\d+,\d+,[^;]*;")
#: a syslog PRI (RFC 3164 and 5424): facility << 3 | severity
_P_PRI = re.compile(r"^<(?P<prio>\d{1,3})>(?P<v5424>1 )?")
#: Talos (``talosctl dmesg``): "<node>: <facility>: <level>: [<ISO time>]: "
_P_TALOS = re.compile(
    r"^(?P<node>[^\s:]{1,255}): +(?P<fac>[a-z0-9]{2,8}): *"
    r"(?:emerg|alert|crit|err|warning|warn|notice|info|debug): +\[(?P<t>[^\]\n]{8,40})\]: "
)
#: ``dmesg --decode``: "<facility>:<level>: " padded
_P_DECODE = re.compile(
    r"^(?P<fac>[a-z0-9]+)\s*:\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*:\s"
)
#: a time in brackets: dmesg's ``[ 123.456]``, ``--show-delta``'s ``[ 123.456 < 0.001>]``,
#: ``--human``'s ``[  +0.000012]`` and ``[Dec 2 11:38]``, ``-T``/``--ctime`` in any language
_P_BRACKET_TIME = re.compile(
    r"^\[(?:\s*\+?\d+\.\d+(?:\s*<\s*\d+\.\d+>)?"
    rf"|[^\W\d_]{{2,10}}\.? +{_ANY_MONTH} +\d{{1,2}} \d\d:\d\d:\d\d \d{{4}}"
    rf"|{_ANY_MONTH} ?\d{{1,2}} \d\d:\d\d(?::\d\d)?"
    rf"|{_ISO})\]:?(?: |$|(?=\[))"
)
#: OpenWrt's ``logread``: "<ctime> <facility>.<level> " before "kernel: " (no host)
_P_LOGREAD = re.compile(
    rf"^[^\W\d_]{{2,10}}\.? +{_ANY_MONTH} +\d{{1,2}} \d\d:\d\d:\d\d \d{{4}} "
    r"(?P<fac>[a-z0-9]{2,8})\.(?:emerg|alert|crit|err|warning|warn|notice|info|debug) "
)
#: a time without brackets: syslog's ``Dec  2 11:38:27`` (any month name, ``.123456`` from
#: ``journalctl -o short-precise``), ISO / RFC 3339 / RFC 5424 and ``dmesg --time-format iso``,
#: ``journalctl -o short-full`` (``Tue 2024-01-02 03:04:05 UTC``) and ``short-unix``
_P_TIME = re.compile(
    rf"^(?:{_ANY_MONTH} +\d{{1,2}},? \d\d:\d\d:\d\d(?:\.\d{{1,9}})?"
    rf"|\d{{1,2}}\. ?{_ANY_MONTH} \d\d:\d\d:\d\d"
    rf"|(?:[^\W\d_]{{2,10}}\.? )?{_ISO}"
    r"|\d{9,11}\.\d{1,9}) "
)
#: ``dmesg --time-format iso``: a comma before the microseconds, the offset with a colon, no host
_P_DMESG_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{6}[+-]\d\d:\d\d ")
#: the printk caller (``CONFIG_PRINTK_CALLER``): ``[ T1946]`` (a task) or ``[ C3]`` (a CPU)
_P_CALLER = re.compile(r"^\[\s*[TC]\d{1,10}\] ?")
#: "[<host> ]<identifier>[<pid>]: " after a syslog time; only the identifier "kernel" is the kernel
_P_HOST_IDENT = re.compile(
    r"^(?:(?P<host>[^\s\[\]:]{1,255}) )?(?P<ident>[^\s\[\]:]{1,64})(?:\[\d+\])?: "
)
#: RFC 5424 after the time: "<host> <app> <procid> <msgid> <structured data> "
_P_5424 = re.compile(r"^(?P<host>\S{1,255}) (?P<app>\S{1,48}) \S{1,128} \S{1,32} (?:-|\[.*?\]) ?")
_P_KERNEL = re.compile(r"^kernel: ")
DRIVER_START = re.compile(r"^(?:NVRM: |nvidia-nvswitch\d+:? )")
#: the kernel's device prefix, dev_printk's "<driver> <domain:bus:dev.fn>: "
DEVICE_START = re.compile(rf"^(?P<drv>[A-Za-z0-9_.-]+) (?P<bdf>{BDF}): ")
#: kernel messages of the distress forms that look like a syslog "<host> <ident>: " after a dmesg
#: time ("[ 5.1] nvme nvme0: ...", "[ 5.1] XFS (dm-0): ..."): the device's driver and name
_DISTRESS_START = re.compile(
    r"^(?:nvme nvme\d+: |EXT[234]-fs \(|XFS \(|Memory failure: |NMI watchdog: )"
)
#: a message a tool quotes whole (``msg="NVRM: ..."``, ``"NVRM: ..."``): a JSON string at the end
_P_QUOTED = re.compile(r'^(?:[a-z_]{1,16}=)?(?P<q>"(?:[^"\\\n]|\\.)*")$')


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
    None when the framing says another writer wrote the line (a user program's syslog line, a
    kmsg record or syslog PRI of another facility, ``dmesg --decode`` or Talos of another
    facility). Nothing is refused here for what the message says: see :func:`kernel_message`.

    The grammar, each part at most once and in this order (docs/xid.md, "Framings"): leading
    blanks; a kmsg header or a syslog PRI (RFC 3164, RFC 5424); Talos' ``<node>: kern: <level>:
    [<time>]:``; ``dmesg --decode``'s ``kern  :err   :``; a time (bracketed: ``dmesg`` in every
    ``--time-format``; or bare: syslog with any month name, ISO, the journal's outputs); the
    printk caller ``[ T1946]``; then, after a bare time, ``[<host> ]kernel[<pid>]:`` (RFC 5424:
    ``<host> kernel <procid> <msgid> <sd>``), after a bracketed one an optional ``<host>
    kernel:`` (``journalctl -o short-monotonic``); a bare ``kernel:``; the kernel's own time
    and caller that a syslog line repeats; and a message a tool quotes whole.
    """
    rest = line.lstrip()
    rest, ok, rfc5424 = _source_marks(rest)
    if not ok:
        return None
    bracketed = _P_BRACKET_TIME.match(rest) or _P_DMESG_ISO.match(rest)
    bare = None if bracketed is not None else _P_TIME.match(rest)
    if bracketed is not None:
        rest = _after_bracket_time(rest[bracketed.end() :])
    elif bare is not None:
        rest = rest[bare.end() :]
        if (m := _P_CALLER.match(rest)) is not None:
            rest = rest[m.end() :]
        sender = (_P_5424 if rfc5424 else _P_HOST_IDENT).match(rest)
        if sender is None:
            return None  # a time and no sender: no line of a known form
        who = sender.groupdict().get("app") or sender["ident"]
        if who != "kernel":
            return None  # a user program's syslog line
        rest = rest[sender.end() :]
    if (m := _P_KERNEL.match(rest)) is not None:
        rest = rest[m.end() :]
        bare = bare or m
    if bare is not None and (m := _P_BRACKET_TIME.match(rest)) is not None:
        rest = _after_bracket_time(rest[m.end() :], host=False)  # syslog repeats the kernel's
    return line[: len(line) - len(rest)], _unquoted(rest.rstrip())


def _source_marks(rest: str) -> tuple[str, bool, bool]:
    """``(rest, the writer may be the kernel, RFC 5424)`` after what names the writer up front:
    a kmsg header or a syslog PRI (facility 0 only), Talos' and ``--decode``'s facility
    (``kern`` only)."""
    rfc5424 = False
    if (m := _P_KMSG.match(rest)) is not None:
        if int(m["prio"]) >> 3 != KERNEL_FACILITY:
            return rest, False, False
        rest = rest[m.end() :]
    elif (m := _P_PRI.match(rest)) is not None:
        if int(m["prio"]) >> 3 != KERNEL_FACILITY:
            return rest, False, False
        rfc5424 = m["v5424"] is not None
        rest = rest[m.end() :]
    if (m := _P_TALOS.match(rest)) is not None:
        if m["fac"] != "kern":
            return rest, False, False
        rest = rest[m.end() :]
    if (m := _P_DECODE.match(rest)) is not None:
        if m["fac"] != "kern":
            return rest, False, False
        rest = rest[m.end() :]
    if (m := _P_LOGREAD.match(rest)) is not None:
        if m["fac"] != "kern":
            return rest, False, False
        rest = rest[m.end() :]
    return rest, True, rfc5424


def _after_bracket_time(after: str, host: bool = True) -> str:
    """What follows a bracketed time: the caller id, and (``host``) the ``<host> kernel:`` of
    ``journalctl -o short-monotonic`` where it is one (a syslog-looking ``<host> <ident>:`` of
    another identifier is left in place: the message then starts with it and is no driver's)."""
    if (m := _P_CALLER.match(after)) is not None:
        after = after[m.end() :]
    if not host:
        return after
    sender = _P_HOST_IDENT.match(after)
    if (
        sender is not None
        and sender["host"] is not None
        and sender["ident"] == "kernel"
        and not DRIVER_START.match(after)
        and not DEVICE_START.match(after)
        and not _DISTRESS_START.match(after)
    ):
        after = after[sender.end() :]
    return after


def _unquoted(message: str) -> str:
    """A message a tool quotes whole (``"NVRM: ..."``, ``msg="NVRM: ..."``) without its quotes;
    any other message as it is."""
    m = _P_QUOTED.match(message)
    if m is None:
        return message
    try:
        text = json.loads(m["q"])
    except ValueError:
        return message
    return text if isinstance(text, str) else message


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

    @property
    def inside(self) -> bool:
        """True while the lines read are a text log's API-mismatch record."""
        return self._left > 0

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
