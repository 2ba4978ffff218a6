"""The BMC's System Event Log: ``ipmitool sel list``/``sel elist`` (and ``-c`` CSV) and FreeIPMI's
``ipmi-sel``, and the power events in it.

ipmitool (``lib/ipmi_sel.c``, ``ipmi_sel_print_std_entry``) prints one event a line::

       1 | 04/25/2019 | 13:45:12 | Power Supply PS2 Status | Failure detected | Asserted
      3a | Pre-Init   |  0000012 | Power Unit #0x01 | Redundancy Lost | Asserted

id (hex), date (``MM/DD/YYYY``, or ``Pre-Init`` before the BMC's clock was set), time, the
sensor (its type, then its name under ``elist`` or ``#0xNN`` under ``list``), the event (the
state words of ``include/ipmitool/ipmi_sel.h``) and its direction; ``-c`` prints the same fields
separated by commas. FreeIPMI's ``ipmi-sel`` prints a header and its columns by name::

    ID   | Date        | Time     | Name                      | Type         | State    | Event
    3    | Dec-09-2024 | 21:12:29 | Power Supply 2 PS2 Status | Power Supply | Critical | Power Supply Failure detected

(``State`` with ``--output-event-state``). Times are the BMC's clock, read as UTC; a clear of the
log is itself an event (``Log area reset/cleared``; FreeIPMI ``Log Area Reset/Cleared``).

The power events judged (IPMI 2.0 table 42-3): sensor type 08h Power Supply offsets 01h failure,
03h/04h input lost, 06h configuration error, 07h inactive; 09h Power Unit offsets 04h AC lost,
06h failure; and the generic redundancy states (lost, degraded, non-redundant), asserted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from node_agent.parsers import ParseError
from node_agent.parsers.ipmitool import REDUNDANCY_DEGRADED, REDUNDANCY_LOST

POWER_TYPES = ("Power Supply", "Power Unit")
#: events that mean a supply or the node's input failed (both tools' words, lower case)
FAILURE_EVENTS = frozenset(
    {
        "failure detected",
        "power supply failure detected",
        "power supply ac lost",
        "ac lost or out-of-range",
        "power supply input lost (ac/dc)",
        "power supply input lost or out-of-range",
        "power supply inactive",
        "ac lost",
        "ac lost / power input lost",
        "power unit failure detected",
        "configuration error",
    }
)
CLEARED = frozenset({"log area reset/cleared"})
_IPMITOOL_DATE = "%m/%d/%Y %H:%M:%S"
_FREEIPMI_DATE = "%b-%d-%Y %H:%M:%S"


@dataclass(frozen=True)
class SelEvent:
    """One SEL entry: ``when`` in UTC (None before the BMC's clock was set), the sensor's type
    where the tool says it, its name, the event's words, and whether it was asserted."""

    id: str
    when: datetime | None
    sensor_type: str | None
    sensor: str
    event: str
    asserted: bool

    @property
    def kind(self) -> str | None:
        """``failure``, ``redundancy_lost``, ``redundancy_degraded``, ``cleared`` or None."""
        words = self.event.lower().strip()
        if words in CLEARED:
            return "cleared"
        if self.sensor_type not in POWER_TYPES or not self.asserted:
            return None
        if words in FAILURE_EVENTS or words.startswith("config error"):
            return "failure"
        if words in REDUNDANCY_LOST or words.startswith("non-redundant"):
            return "redundancy_lost"
        if words in REDUNDANCY_DEGRADED:
            return "redundancy_degraded"
        return None


def _when(date: str, time: str, form: str) -> datetime | None:
    try:
        return datetime.strptime(f"{date.strip()} {time.strip()}", form).replace(
            tzinfo=timezone.utc
        )
    except ValueError:
        return None  # Pre-Init, N/A, PostInit: no clock yet


def _split_type(sensor: str) -> tuple[str | None, str]:
    """ipmitool's sensor field ``Power Supply PS2 Status`` -> (``Power Supply``, ``PS2 Status``)."""
    for kind in (*POWER_TYPES, "Event Logging Disabled"):
        if sensor.startswith(kind):
            return kind, sensor[len(kind) :].strip() or sensor
    return None, sensor


def parse_sel(text: str) -> list[SelEvent]:
    """Every entry of ``ipmitool [-c] sel list|elist`` or ``ipmi-sel`` output. Empty for an
    empty log (``SEL has no entries``); ParseError for text that holds no entry of either form."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if re.match(r"^\s*ID\s*\|", line)), None)
    if header is not None:
        return _freeipmi(lines, header)
    events = []
    for line in lines:
        sep = "|" if "|" in line else "," if line.count(",") >= 4 else None
        if sep is None:
            continue
        fields = [f.strip() for f in line.split(sep)]
        if len(fields) < 6 or not re.fullmatch(r"[0-9a-fA-F]{1,4}", fields[0]):
            continue
        sensor_type, sensor = _split_type(fields[3])
        events.append(
            SelEvent(
                id=fields[0],
                when=_when(fields[1], fields[2], _IPMITOOL_DATE),
                sensor_type=sensor_type,
                sensor=sensor,
                event=fields[4],
                asserted=fields[5].lower() != "deasserted",
            )
        )
    if not events and lines and not any("no entries" in line.lower() for line in lines):
        raise ParseError(
            f"no SEL entry in the output (expected `ipmitool sel elist` or `ipmi-sel`); got "
            f"{lines[0].strip()[:160]!r}"
        )
    return events


def _freeipmi(lines: list[str], header: str) -> list[SelEvent]:
    names = [h.strip().lower() for h in header.split("|")]
    try:
        at = {key: names.index(key) for key in ("id", "date", "time", "name", "type", "event")}
    except ValueError:
        raise ParseError(f"ipmi-sel header lacks a column: {header.strip()[:160]!r}") from None
    events = []
    for line in lines[lines.index(header) + 1 :]:
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != len(names) or not fields[at["id"]].isdigit():
            continue
        event = fields[at["event"]]
        events.append(
            SelEvent(
                id=fields[at["id"]],
                when=_when(fields[at["date"]], fields[at["time"]], _FREEIPMI_DATE),
                sensor_type=fields[at["type"]] or None,
                sensor=fields[at["name"]],
                event=event,
                asserted="deasserted" not in event.lower(),
            )
        )
    return events


def parse_sel_time(text: str) -> datetime | None:
    """``ipmitool sel time get`` (``04/25/2019 13:50:00``) as UTC, or None."""
    m = re.search(r"(\d\d/\d\d/\d{4}) (\d\d:\d\d:\d\d)", text)
    return _when(m.group(1), m.group(2), _IPMITOOL_DATE) if m else None
