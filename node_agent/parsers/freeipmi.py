"""FreeIPMI's ``ipmi-sensors``: the BMC's sensors where ipmitool is absent.

``ipmi-sensors`` prints a header and one sensor a line, its columns by name (``ipmi-sensors``
default ``ID | Name | Type | Reading | Units | Event``; ``--output-sensor-state`` adds ``State``,
``--output-sensor-thresholds`` the threshold columns)::

    165 | PSU2 Status      | Power Supply | Nominal  | N/A | N/A | ... | 'Presence detected'
    168 | PS Redundancy    | Power Supply | Nominal  | N/A | N/A | ... | 'Fully Redundant'

A discrete sensor's ``Event`` is its asserted states, each in single quotes (``'Presence detected'
'Power Supply Failure detected'``), ``'OK'`` when none, ``N/A`` when the BMC gave no reading.
Each row becomes an :class:`~node_agent.parsers.ipmitool.SdrRow` (entity 10 for a Power Supply
sensor, 19 for a Power Unit: FreeIPMI prints no entity), so the supplies are judged by the same
rules as ipmitool's. Rows whose header a ``grep`` took away are read by their width (6, 7 or 13
columns: the three forms above).
"""

from __future__ import annotations

import re

from node_agent.parsers import ParseError
from node_agent.parsers.ipmitool import SdrRow

_QUOTED = re.compile(r"'([^']*)'")
_ENTITY = {"power supply": "10.0", "power unit": "19.0"}
#: the columns of ipmi-sensors' forms, by width, for rows whose header was filtered away:
#: the default, ``--output-sensor-state``, and that with ``--output-sensor-thresholds``
_DEFAULT_COLUMNS = {
    6: ["id", "name", "type", "reading", "units", "event"],
    7: ["id", "name", "type", "state", "reading", "units", "event"],
    13: [
        "id",
        "name",
        "type",
        "state",
        "reading",
        "units",
        "lower nr",
        "lower c",
        "lower nc",
        "upper nc",
        "upper c",
        "upper nr",
        "event",
    ],
}


def parse_ipmi_sensors(text: str) -> list[SdrRow]:
    """The sensors of ``ipmi-sensors`` output (any column set with ``Name``, ``Type`` and
    ``Event``). ParseError without a header naming them."""
    lines = [line for line in text.splitlines() if "|" in line]
    if not text.strip():
        return []  # a BMC with no sensor of the types asked for
    header = next((line for line in lines if re.match(r"^\s*ID\s*\|", line)), None)
    if header is not None:
        names = [h.strip().lower() for h in header.split("|")]
        body = lines[lines.index(header) + 1 :]
    elif lines and (names := _DEFAULT_COLUMNS.get(lines[0].count("|") + 1, [])):
        body = lines  # rows without their header (a `grep` of the output): known widths only
    else:
        raise ParseError(
            "ipmi-sensors printed no header (ID | Name | Type | ... | Event); got "
            f"{text.strip()[:160]!r}"
        )
    if not {"name", "type", "event"} <= set(names):
        raise ParseError(f"ipmi-sensors header lacks Name, Type or Event: {header!r}")
    rows = []
    for line in body:
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != len(names):
            continue
        cell = dict(zip(names, fields, strict=True))
        event = cell["event"]
        states = tuple(s for s in _QUOTED.findall(event) if s.lower() != "ok")
        units = cell.get("units", "N/A")
        reading = cell.get("reading", "N/A")
        analog = units not in ("N/A", "") or reading not in ("N/A", "")
        rows.append(
            SdrRow(
                name=cell["name"],
                number=None,
                status="ns" if event == "N/A" and not analog else "ok",
                entity=_ENTITY.get(cell["type"].lower()),
                reading=event,
                states=states,
                analog=analog,
            )
        )
    return rows
