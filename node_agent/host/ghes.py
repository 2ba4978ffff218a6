"""Memory errors the firmware reports (APEI GHES, firmware-first), from the kernel log.

Where the firmware handles memory errors first (most servers' default; a BIOS "eMCA"/"firmware
first" setting), it hands them to Linux as UEFI CPER records through the ACPI Generic Hardware
Error Source, and the kernel prints each record line by line (``drivers/acpi/apei/ghes.c``,
``ghes_print_estatus``; ``drivers/firmware/efi/cper.c``, ``cper_estatus_print``,
``cper_print_mem``), every line led by the record's number and ``[Hardware Error]:``::

    {37}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 162
    {37}[Hardware Error]: event severity: corrected
    {37}[Hardware Error]:  Error 0, type: corrected
    {37}[Hardware Error]:   section_type: memory error
    {37}[Hardware Error]:   node: 1 card: 4 module: 0 rank: 0 bank: 1 device: 14 row: 58165 ...
    {37}[Hardware Error]:   error_type: 2, single-bit ECC
    {37}[Hardware Error]:   DIMM location: CPU 2 DIMM 30

A record has an event severity and one or more sections (``Error N, type: <severity>``), each
with its own severity and type; only ``memory error`` sections are read here, by their own
severity (UEFI CPER: ``recoverable`` is uncorrected but contained, ``fatal`` uncorrected, the
node was stopped; ``corrected`` ECC repaired it). The DIMM is the ``DIMM location`` line (the
SMBIOS bank and device locators, ``dmi_memdev_name``), else a ``fru_text`` that names a slot,
else the node/card/module the firmware gave; records the kernel reprints from the previous boot
(``BERT: Error records from previous boot``) carry no ``{N}``. EDAC (``ghes_edac``) counts the
same errors where it loads; this is the reading where it does not.

Only a message that starts with ``{N}[Hardware Error]: `` (or ``[Hardware Error]: ``) is read;
``mce: [Hardware Error]: ...`` lines are the machine-check handler's, read elsewhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(?:\{(?P<seq>\d{1,10})\})?\[Hardware Error\]: ?(?P<body>.*)$")
_START = re.compile(r"^Hardware error from APEI Generic Hardware Error Source: (?P<src>\d+)")
_EVENT = re.compile(r"^event severity: (?P<sev>\w+)")
_SECTION = re.compile(r"^Error (?P<n>\d+), type: (?P<sev>\w+)")
_MEMORY = re.compile(r"^section_type: memory error\b")
_OTHER_SECTION = re.compile(r"^section_type: ")
_DIMM = re.compile(r"^DIMM location: (?P<loc>.*?)\s*$")
_FRU = re.compile(r"^fru_text: (?P<text>.*?)\s*$")
_PLACE = re.compile(
    r"^node: ?(?P<node>\d+)(?: card: ?(?P<card>\d+))?(?: module: ?(?P<module>\d+))?"
)
_ERROR_TYPE = re.compile(r"^error_type: (?P<type>.*?)\s*$")
#: a fru_text that names a slot ("B1", "D2", "DIMM_A1", "CPU1_DIMM_C2"), not a word
#: ("CorrectedErr", "Memory"): firmware fills the field with either
_SLOT = re.compile(r"^(?:[A-Za-z0-9]+[_ -])*(?:DIMM[_ -]?)?[A-Za-z]{0,2}\d{1,2}$")
SEVERITIES = ("corrected", "recoverable", "fatal")


@dataclass
class GhesMemoryError:
    """One memory-error section of a GHES record."""

    severity: str  # corrected | recoverable | fatal (the section's own)
    label: str | None  # the DIMM's, where the record names one
    place: str | None  # "node 1 card 4 module 0" where the firmware gave it
    error_type: str | None  # "2, single-bit ECC"
    seq: int | None  # the record's {N}
    line_index: int  # where the record started, in the messages given

    @property
    def uncorrected(self) -> bool:
        return self.severity in ("recoverable", "fatal")


@dataclass
class _Record:
    seq: int | None
    start: int
    event: str | None = None  # the record's event severity
    sections: list[dict[str, Any]] = field(default_factory=list)


def _finish(record: _Record | None, out: list[GhesMemoryError]) -> None:
    if record is None:
        return
    for section in record.sections:
        severity = section.get("severity") or record.event
        if not section.get("memory") or severity not in SEVERITIES:
            continue
        fru = section.get("fru")
        label = section.get("dimm") or (fru if fru and _SLOT.match(fru) else None)
        out.append(
            GhesMemoryError(
                severity=severity,
                label=label,
                place=section.get("place"),
                error_type=section.get("error_type"),
                seq=record.seq,
                line_index=record.start,
            )
        )


def parse_ghes(messages: Iterable[str]) -> list[GhesMemoryError]:
    """Every memory-error section in ``messages`` (kernel messages, in order, each from its
    first character on). Lines of one record share its ``{N}``; a new "Hardware error from
    APEI" line, or another number, starts the next record.

    >>> [e.severity for e in parse_ghes(["{3}[Hardware Error]: event severity: recoverable",
    ...   "{3}[Hardware Error]:  Error 0, type: recoverable",
    ...   "{3}[Hardware Error]:   section_type: memory error"])]
    ['recoverable']
    """
    out: list[GhesMemoryError] = []
    record: _Record | None = None
    for index, message in enumerate(messages):
        m = _LINE.match(message)
        if m is None:
            continue
        seq = int(m["seq"]) if m["seq"] is not None else None
        body = m["body"].strip()
        if record is None or seq != record.seq or _START.match(body):
            _finish(record, out)
            record = _Record(seq=seq, start=index)
        _line(record, body)
    _finish(record, out)
    return out


def _line(record: _Record, body: str) -> None:
    if (e := _EVENT.match(body)) is not None:
        record.event = e["sev"].lower()
        return
    if (s := _SECTION.match(body)) is not None:
        record.sections.append({"severity": s["sev"].lower()})
        return
    if not record.sections:
        if _MEMORY.match(body):  # a record printed without its "Error N" line
            record.sections.append({"severity": None, "memory": True})
        return
    section = record.sections[-1]
    if _MEMORY.match(body):
        section["memory"] = True
    elif _OTHER_SECTION.match(body):
        section["memory"] = False
    elif (d := _DIMM.match(body)) is not None:
        location = " ".join(d["loc"].split())
        if location and not location.lower().startswith("not present"):
            section["dimm"] = location
    elif (f := _FRU.match(body)) is not None:
        section["fru"] = f["text"]
    elif (p := _PLACE.match(body)) is not None:
        section["place"] = " ".join(
            f"{k} {p[k]}" for k in ("node", "card", "module") if p[k] is not None
        )
    elif (t := _ERROR_TYPE.match(body)) is not None:
        section["error_type"] = t["type"]


#: words one of which every message read here holds
GHES_WORDS = ("[Hardware Error]",)


def ghes_sources(sys_root: Path = Path("/sys")) -> int:
    """How many firmware error sources the kernel registered (``GHES.N`` platform devices,
    one per Generic Hardware Error Source in the ACPI HEST table); 0 on a host without them
    (most VMs, firmware without APEI), where no record is no evidence."""
    try:
        return sum(1 for n in os.listdir(sys_root / "bus/platform/devices") if n.startswith("GHES"))
    except OSError:
        return 0
