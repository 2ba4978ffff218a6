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
rules as ipmitool's.
"""

from __future__ import annotations

import re

from node_agent.parsers import ParseError
from node_agent.parsers.ipmitool import SdrRow

_QUOTED = re.compile(r"'([^']*)'")
_ENTITY = {"power supply": "10.0", "power unit": "19.0"}


def parse_ipmi_sensors(text: str) -> list[SdrRow]:
    """The sensors of ``ipmi-sensors`` output (any column set with ``Name``, ``Type`` and
    ``Event``). ParseError without a header naming them."""
    lines = [line for line in text.splitlines() if "|" in line]
    header = next((line for line in lines if re.match(r"^\s*ID\s*\|", line)), None)
    if header is None:
        raise ParseError(
            "ipmi-sensors printed no header (ID | Name | Type | ... | Event); got "
            f"{text.strip()[:160]!r}"
        )
    names = [h.strip().lower() for h in header.split("|")]
    if not {"name", "type", "event"} <= set(names):
        raise ParseError(f"ipmi-sensors header lacks Name, Type or Event: {header.strip()[:160]!r}")
    rows = []
    for line in lines[lines.index(header) + 1 :]:
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
