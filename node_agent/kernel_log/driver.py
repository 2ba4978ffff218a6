"""The NVIDIA drivers' own lines in the kernel log: Xids, SXids, the driver's lines without an
Xid, and the PCI core's AER lines about a GPU (docs/xid.md).

Records in, :class:`XidLine` / :class:`SxidLine` / :class:`DriverLine` / :class:`Unreadable`
out. A message is read only where the framing grammar (:mod:`.framing`) says the kernel wrote
it, it is no never-source record, and it *starts* with the driver's or the PCI core's text.
Parsing never raises: a truncated or garbled line is unreadable or not a driver line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from node_agent.host.aer_lines import parse_aer_message
from node_agent.kernel_log.framing import (
    BUS,
    DEVICE_START,
    DRIVER_START,
    MessageReader,
    Stamp,
    kernel_message,
    line_stamp,
    refusal,
)
from node_agent.kernel_log.record import LogRecord


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
    - ``va-space-exhausted``: ``dmaAllocMapping_GM107: can't alloc VA space for mapping.``
      (the GPU's virtual address space used up; it comes with ``NV_ERR_NO_MEMORY``);
    - ``aer-uncorrectable``: ``<drv> <bdf>: PCIe Bus Error: severity=Uncorrected (Fatal)`` (or
      ``Uncorrectable``, kernels from 6.10 on; ``AER: `` in front on some;
      ``drivers/pci/pcie/aer.c``, ``aer_print_error``), read by ``host/aer_lines.py`` as the
      ``pcie_aer`` check reads it;
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

#: a PCI bus with or without its function (``0000:3b:00``, ``00000000:3B:00.0``)
_BUS_FN = rf"{BUS}(?:\.[0-7])?"
#: "NVRM: " and the GPU a driver message is about, by the RM's number or by bus, if it names one
_NVRM_GPU = rf"^NVRM: (?:GPU(?P<n>\d{{1,3}}) |GPU (?P<bdf>{_BUS_FN}): )?"

_XID = re.compile(r"^NVRM: Xid \((?P<inner>[^()\n]*)\)(?P<after>.*)$")
_SXID = re.compile(r"^nvidia-nvswitch(?P<sw>\d+):?\s*SXid \((?P<inner>[^()\n]*)\)(?P<after>.*)$")
_XID_ADDRESS = re.compile(
    rf"^(?:PCI:)?(?P<bus>{BUS})(?:\.[0-7])?"
    r"(?:\s+GPU-I:(?P<gi>\d{1,3}))?(?:\s+GPU-CI:(?P<ci>\d{1,3}))?\s*$"
)
_SXID_ADDRESS = re.compile(rf"^(?:PCI:)?(?P<bus>{_BUS_FN})\s*$")
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
_THE_GPU = re.compile(rf"^NVRM: The NVIDIA GPU (?P<bdf>{_BUS_FN})")
_GPU_FALLEN = re.compile(rf"^NVRM: GPU (?P<bdf>{_BUS_FN}): GPU has fallen off the bus")
_PCI_ID = re.compile(r"PCI ID: (?P<id>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})")

#: the driver's assertion forms (src/nvidia/src/libraries/utils/nvassert.c: NV_ASSERT_OK and
#: NV_CHECK_OK print "Assertion failed: %s (0x%08X) returned from <expr> @ <file>:<line>" or
#: "Check failed: ...", the string being nvstatusToString's "<text> [<NV_ERR_name>]" from
#: src/common/sdk/nvidia/inc/nvstatuscodes.h), under "NVRM: " and the GPU's number or bus id.
#: Read only whole and anchored: the name, its text and its code must agree.
_ASSERTION = re.compile(
    _NVRM_GPU + r"(?:nv(?:Assert|Check)(?:Ok)?Failed(?:NoLog)?: )?(?:Assertion|Check) failed: "
    r"(?P<text>[A-Za-z ]{1,40}) \[(?P<name>NV_ERR_[A-Z_]{1,40})\]"
    r"(?: \(0x(?P<hex>[0-9A-Fa-f]{8})\)(?: returned from \S.*)?)?$"
)
#: status name -> (its text, its code, the kind it is read as)
_ASSERTED = {
    "NV_ERR_GPU_IS_LOST": ("GPU lost from the bus", 0x0F, "gpu-lost"),
    "NV_ERR_RESET_REQUIRED": ("Reset required", 0x62, "reset-required"),
}
#: the driver's GPU virtual-address exhaustion (virt_mem_allocator_gm107.c, dmaAllocMapping_GM107:
#: "can't alloc VA space for mapping."; open-gpu-kernel-modules#1140, #1187: BAR1 VA space used
#: up by a workload, each followed by "Assertion failed: Out of memory [NV_ERR_NO_MEMORY]" and in
#: the field by an RC watchdog "GPU is probably locked"). The line names no GPU.
_VA_SPACE = re.compile(
    _NVRM_GPU + r"dmaAllocMapping_[A-Z0-9]{2,8}: can't alloc VA space for mapping\.?$"
)
#: osinit.c, RmInitAdapter: NV_DEV_PRINTF(..., "RmInitAdapter failed! (0x%x:0x%x:%d)") under
#: "NVRM: GPU <domain:bus:dev.fn>: " (init status, RM status, source line)
_INIT_FAILED = re.compile(
    rf"^NVRM: (?:GPU (?P<bdf>{_BUS_FN}): )?RmInitAdapter failed! "
    r"\(0x(?P<hex>[0-9A-Fa-f]{1,8}):0x[0-9A-Fa-f]{1,8}:\d{1,6}\)$"
)
#: the AER forms' names for an uncorrectable error's severity, as ``DriverLine.severity`` says them
_AER_SEVERITY = {"fatal": "Fatal", "nonfatal": "Non-Fatal"}


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


#: words one of which every line read here holds: a cheap test before the prefixes are parsed
_WORTH_PARSING = ("NVRM", "nvidia-nvswitch", "PCIe Bus Error", "AER:")
#: what a record must hold for the scanner to look at it (the API-mismatch record's first line
#: starts a text log's quarantine, see framing.MessageReader)
_FEED_WORDS = (*_WORTH_PARSING, "API mismatch")


def _driver_message(line: str, reader: MessageReader | None = None) -> tuple[str, str] | None:
    """The kernel message of ``line`` if it is one the NVIDIA driver or the PCI core could have
    written (starts with ``NVRM: ``, ``nvidia-nvswitchN: `` or ``<driver> <bdf>: ``) and no
    never-source record (``framing.refusal``); ``reader`` keeps what a text log's records need."""
    if reader is not None:
        found = reader.message(line, _WORTH_PARSING)
    elif any(word in line for word in _WORTH_PARSING):
        found = kernel_message(line)
    else:
        return None
    if found is None:
        return None
    prefix, message = found
    if not (DRIVER_START.match(message) or DEVICE_START.match(message)):
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
        kind, bdf, gpu_n, status = _nvrm_kind(text)
        if kind is None:
            return None
        return DriverLine(
            kind=kind,
            pci_bus=normalise_bus(bdf) if bdf else None,
            message=text,
            raw=line.strip(),
            driver_gpu=gpu_n,
            status=status,
            stamp=stamp,
        )
    aer = parse_aer_message(text)
    if aer is None or aer.kind != "bus_error" or aer.severity not in _AER_SEVERITY:
        return None
    return DriverLine(
        kind="aer-uncorrectable",
        pci_bus=normalise_bus(aer.bdf),
        message=text,
        raw=line.strip(),
        severity=_AER_SEVERITY[aer.severity],
        device_driver=aer.driver,
        stamp=stamp,
    )


def _nvrm_kind(text: str) -> tuple[str | None, str | None, int | None, int | None]:
    """(kind, bus, the driver's GPU number, RM status) of a driver line without an Xid, read
    only in the driver's own anchored forms; (None, ...) for any other ``NVRM:`` line."""
    if (m := _INIT_FAILED.match(text)) is not None:
        return "init-failed", m["bdf"], None, int(m["hex"], 16)
    if (m := _VA_SPACE.match(text)) is not None:
        return "va-space-exhausted", m["bdf"], int(m["n"]) if m["n"] else None, None
    m = _ASSERTION.match(text)
    if m is None or m["name"] not in _ASSERTED:
        return None, None, None, None
    words, code, kind = _ASSERTED[m["name"]]
    if m["text"] != words or (m["hex"] is not None and int(m["hex"], 16) != code):
        return None, None, None, None
    return kind, m["bdf"], int(m["n"]) if m["n"] else None, code


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
        self._reader = MessageReader()

    def feed(self, record: LogRecord) -> list[Event | Unreadable | DriverLine]:
        if not record.from_kernel:
            return []
        if (
            self._pending is None
            and not self._reader.inside
            and not any(word in record.text for word in _FEED_WORDS)
        ):
            self._age_aer()  # a line of no driver: counts only as a line passing
            return []
        # a record of kmsg or the journal holds all its lines: it is refused whole (a netfilter
        # prefix with a newline puts the tail on a later line); a text log's line is one line
        whole = record.whole
        if whole and refusal(record.text.lstrip()) is not None:
            return []
        stamp = Stamp("boot", record.boot_s) if record.boot_s is not None else None
        out: list[Event | Unreadable | DriverLine] = []
        for i, line in enumerate(record.text.split("\n")):
            out.extend(self._line(line, stamp, continuation=i > 0, whole=whole))
        return out

    def _line(
        self, line: str, record_stamp: Stamp | None, continuation: bool = False, whole: bool = False
    ) -> list[Event | Unreadable | DriverLine]:
        reader = None if whole else self._reader
        found = None if continuation else _driver_message(line, reader)
        if self._pending is not None:
            # a later line of the same record, or the driver's next message in a text log
            said = line if continuation else found[1] if found is not None else ""
            bdf, lines, stamp, left = self._pending
            lines.append(line.strip())
            if said.startswith("NVRM: ") and "fallen off the bus" in said:
                self._pending = None
                return [self._fallen(bdf, lines, stamp)]
            self._pending = (bdf, lines, stamp, left - 1) if left > 1 else None
        if continuation:
            return []  # only the first line of a record is a message of its own
        self._age_aer()
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
        if (aer := parse_aer_message(text)) is not None and aer.kind == "recovery_failed":
            return self._aer_failed(aer.bdf, line.strip(), record_stamp or line_stamp(prefix))
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
        if not self._aer:
            return
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
