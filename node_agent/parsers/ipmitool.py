"""``ipmitool sdr type "Power Supply"``: the BMC's power-supply sensors, and what they say.

ipmitool prints one line per sensor for ``sdr type``/``sdr elist`` (``lib/ipmi_sdr.c``,
``ipmi_sdr_print_sensor_fc`` with ``sdr_extended``)::

    PS1 Status       | C8h | ok  | 10.1 | Presence detected, Failure detected

name (16 wide), sensor number, status (``ok``, ``ns`` no reading, or a threshold state: ``cr``,
``nc``, ``nr``, ``lcr`` ...), entity id.instance (10 is a power supply, 20 a power unit), and the
asserted states joined by ``", "`` (``ipmi_sdr_print_discrete_state_mini``), an analog value
(``120 Watts``), or both (``0 Watts, Presence detected, Failure detected``). The plain ``sdr list`` form has three fields (``PS1 Status | 0x01 | ok``).

The state words are ipmitool's (``include/ipmitool/ipmi_sel.h``): sensor type 08h Power Supply
offsets 0-7 "Presence detected", "Failure detected", "Predictive failure", "Power Supply AC
lost", "AC lost or out-of-range", "AC out-of-range, but present", "Config Error...", "Power
Supply Inactive"; generic availability "Device Absent"/"Device Present"; generic redundancy
"Fully Redundant", "Redundancy Lost", "Redundancy Degraded", "Non-Redundant: ...". FreeIPMI and
some BMC firmwares print "Power Supply Failure detected" for offset 1; both are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from node_agent.parsers import ParseError

_ANALOG = re.compile(r"^-?\d+(?:[.,]\d+)?\s+\S")
_NUMBER = re.compile(r"^(?:[0-9A-Fa-f]{2}h|0x[0-9A-Fa-f]+)$")
_ENTITY = re.compile(r"^\s*(\d+)\.(\d+)\s*$")

PRESENT = frozenset({"presence detected", "device present", "device inserted/device present"})
ABSENT = frozenset({"device absent", "device removed/device absent"})
FAILED = frozenset(
    {
        "failure detected",
        "power supply failure detected",
        "power supply ac lost",
        "ac lost or out-of-range",
        "power supply inactive",
    }
)
DEGRADED = frozenset({"predictive failure", "ac out-of-range, but present"})
REDUNDANCY_LOST = frozenset(
    {
        "redundancy lost",
        "non-redundant: sufficient from redundant",
        "non-redundant: sufficient from insufficient",
        "non-redundant: insufficient resources",
    }
)
REDUNDANCY_DEGRADED = frozenset(
    {
        "redundancy degraded",
        "redundancy degraded from fully redundant",
        "redundancy degraded from non-redundant",
    }
)
REDUNDANT = frozenset({"fully redundant"})
_PSU_WORDS = PRESENT | ABSENT | FAILED | DEGRADED
_REDUNDANCY_WORDS = REDUNDANCY_LOST | REDUNDANCY_DEGRADED | REDUNDANT
#: entity id 10: power supply (IPMI 2.0 table 43-13)
POWER_SUPPLY_ENTITY = 10


@dataclass(frozen=True)
class SdrRow:
    """One sensor line."""

    name: str
    number: str | None  # "C8h"
    status: str  # ok, ns, cr, nc, nr, lcr ...
    entity: str | None  # "10.1"
    reading: str  # the last field as printed
    states: tuple[str, ...]  # asserted states of a discrete sensor
    analog: bool

    @property
    def entity_id(self) -> int | None:
        match = _ENTITY.match(self.entity or "")
        return int(match.group(1)) if match else None

    @property
    def instance(self) -> int | None:
        match = _ENTITY.match(self.entity or "")
        return int(match.group(2)) if match else None


def _states(reading: str) -> tuple[str, ...]:
    """``"Presence detected, AC out-of-range, but present"`` -> the two states."""
    out: list[str] = []
    for piece in (p.strip() for p in reading.split(",")):
        if not piece:
            continue
        if piece.lower() == "but present" and out:
            out[-1] = f"{out[-1]}, {piece}"
        else:
            out.append(piece)
    return tuple(out)


def parse_sdr(text: str) -> list[SdrRow]:
    """Every sensor line of ``ipmitool sdr type ...`` / ``sdr elist`` / ``sdr list`` output.
    Lines without a ``|`` (a banner, a BMC's complaint) are not sensors and are passed over; a
    line with ``|`` that is neither form raises ParseError."""
    rows = []
    for line in text.splitlines():
        if "|" not in line:
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 5:
            name, number, status, entity, reading = fields
        elif len(fields) == 3:
            name, reading, status = fields
            number, entity = None, None
        else:
            raise ParseError(
                f"ipmitool sdr line has {len(fields)} fields, expected 5 "
                f"(sdr type/elist) or 3 (sdr list): {line.strip()[:160]!r}"
            )
        if not name:
            raise ParseError(f"ipmitool sdr line without a sensor name: {line.strip()[:160]!r}")
        if number is not None and number and not _NUMBER.match(number):
            raise ParseError(
                f"ipmitool sdr line: {number!r} is not a sensor number: {line.strip()[:160]!r}"
            )
        analog = bool(_ANALOG.match(reading))
        states: tuple[str, ...] = ()
        if analog:  # an analog value, then the states a discrete sensor also asserts
            states = _states(reading.partition(",")[2])
        elif reading not in (
            "No Reading",
            "Disabled",
            "Not Readable",
        ) and not reading.lower().startswith("0x"):
            states = _states(reading)
        rows.append(
            SdrRow(
                name=name,
                number=number or None,
                status=status.lower(),
                entity=entity or None,
                reading=reading,
                states=states,
                analog=analog,
            )
        )
    return rows


@dataclass(frozen=True)
class PsuState:
    """One power supply's status sensor, judged."""

    psu: str  # a name for the target: "PS1"
    sensor: str  # the sensor's own name: "PS1 Status"
    entity: str | None
    verdict: str  # ok | failed | absent | degraded | unreadable
    states: tuple[str, ...]
    reading: str


@dataclass(frozen=True)
class Redundancy:
    sensor: str
    verdict: str  # redundant | lost | degraded
    states: tuple[str, ...]


def _psu_name(row: SdrRow) -> str:
    stripped = re.sub(r"[\s_-]*status$", "", row.name, flags=re.IGNORECASE).strip()
    if stripped:
        return stripped
    return f"PS{row.instance}" if row.instance is not None else row.name


_PSU_NAME = re.compile(r"\bPSU?[\s_]?\d|\bpower[\s_]?supply", re.IGNORECASE)
#: a sensor named for the supply itself ("Power Supply 1", "PSU2"; FreeIPMI's HPE rows), not
#: one of its readings ("PSU2_PWRGD", "PS 1 Output")
_SUPPLY_ITSELF = re.compile(r"^(?:power[\s_]?supply|PSU?)[\s_]?\d{1,2}$", re.IGNORECASE)


def _is_status_sensor(row: SdrRow) -> bool:
    lowered = {s.lower() for s in row.states}
    if lowered & _REDUNDANCY_WORDS:
        return False
    if lowered & _PSU_WORDS:
        # "Presence detected" is also a CPU's or a battery's: only a supply's counts
        return row.entity_id in (None, POWER_SUPPLY_ENTITY) or bool(_PSU_NAME.search(row.name))
    if row.analog:
        return False
    # a power-supply status sensor that asserts nothing: the supply is not there
    named = "status" in row.name.lower()
    return row.entity_id == POWER_SUPPLY_ENTITY and named and not row.states


def judge_psus(rows: list[SdrRow]) -> tuple[list[PsuState], list[Redundancy]]:
    """Each power supply's status sensor and each redundancy sensor, judged:

    * failed: "Failure detected", AC lost, inactive or a configuration error asserted;
    * absent: "Device Absent", or a status sensor that asserts no presence;
    * degraded: "Predictive failure", AC out of range but present;
    * unreadable: the status sensor gives no reading (``ns``);
    * redundancy lost ("Redundancy Lost", "Non-Redundant: ...") or degraded.
    """
    psus: list[PsuState] = []
    redundancy: list[Redundancy] = []
    for row in rows:
        lowered = {s.lower() for s in row.states}
        if lowered & _REDUNDANCY_WORDS:
            verdict = (
                "lost"
                if lowered & REDUNDANCY_LOST
                else "degraded"
                if lowered & REDUNDANCY_DEGRADED
                else "redundant"
            )
            redundancy.append(Redundancy(sensor=row.name, verdict=verdict, states=row.states))
            continue
        unreadable = (
            row.status == "ns"
            and row.entity_id == POWER_SUPPLY_ENTITY
            and ("status" in row.name.lower() or bool(_SUPPLY_ITSELF.match(row.name)))
            and not row.analog
        )
        if not (unreadable or _is_status_sensor(row)):
            continue
        if unreadable:
            verdict = "unreadable"
        elif lowered & FAILED or any(s.startswith("config error") for s in lowered):
            verdict = "failed"
        elif lowered & ABSENT or not lowered & PRESENT:
            verdict = "absent"
        elif lowered & DEGRADED:
            verdict = "degraded"
        else:
            verdict = "ok"
        psus.append(
            PsuState(
                psu=_psu_name(row),
                sensor=row.name,
                entity=row.entity,
                verdict=verdict,
                states=row.states,
                reading=row.reading,
            )
        )
    # two sensors named alike (Dell names each "Status"): tell them apart by entity
    names = [p.psu for p in psus]
    psus = [
        p
        if names.count(p.psu) == 1 or p.entity is None
        else PsuState(
            psu=f"{p.psu}@{p.entity}",
            sensor=p.sensor,
            entity=p.entity,
            verdict=p.verdict,
            states=p.states,
            reading=p.reading,
        )
        for p in psus
    ]
    return psus, redundancy


#: what ipmitool prints when there is no BMC device to open (src/plugins/open/open.c)
NO_DEVICE = re.compile(
    r"Could not open device at|No such file or directory.*ipmi|"
    r"Unable to open.*interface|Error loading interface|could not find inband device",
    re.IGNORECASE,
)


def no_bmc_reason(stderr: str) -> str | None:
    """The line of ipmitool's stderr that says no BMC could be reached, or None."""
    for line in stderr.splitlines():
        if NO_DEVICE.search(line):
            return line.strip()[:300]
    return None


# -- the verbose form: `ipmitool -v sdr type "Power Unit"` ---------------------------------------

_V_ID = re.compile(r"^Sensor ID\s*:\s*(?P<name>.*?)\s*\((?P<num>0x[0-9A-Fa-f]+)\)\s*$")
_V_ENTITY = re.compile(r"^\s*Entity ID\s*:\s*(?P<entity>\d+\.\d+)")
_V_ASSERTED = re.compile(r"^\s*States Asserted\s*:\s*(?P<rest>.*)$")
_V_STATE = re.compile(r"^\s*\[(?P<state>[^\]]+)\]\s*$")
_V_FIELD = re.compile(r"^\s*[A-Z][A-Za-z ()/-]*:\s")


def parse_sdr_verbose(text: str) -> list[SdrRow]:
    """The discrete sensors of ``ipmitool -v sdr ...`` (``ipmi_sdr_print_sensor_full``/
    ``_compact`` verbose): one record per ``Sensor ID : <name> (0xNN)``, its ``Entity ID`` and
    the bracketed states under ``States Asserted``. The list view prints the same sensor as
    ``Pwr Unit Redund | 0x00 | ok`` with no states (ipmitool issue 176: "ok" while "Redundancy
    Lost" is asserted); this form names them.

    >>> [r.states for r in parse_sdr_verbose("Sensor ID : Pwr Unit Redund (0x2)\\n"
    ...     " Entity ID : 21.1 (Power Management)\\n States Asserted : Power Unit\\n"
    ...     "                  [Redundancy Lost]\\n")]
    [('Redundancy Lost',)]
    """
    rows: list[SdrRow] = []
    current: dict[str, Any] | None = None
    in_states = False
    for line in text.splitlines():
        if (m := _V_ID.match(line.strip())) is not None:
            if current is not None:
                rows.append(_verbose_row(current))
            current, in_states = {"name": m["name"], "number": m["num"], "states": []}, False
            continue
        if current is None:
            continue
        if (m := _V_ENTITY.match(line)) is not None:
            current["entity"] = m["entity"]
        elif (m := _V_ASSERTED.match(line)) is not None:
            in_states = True
            if (s := _V_STATE.match(m["rest"])) is not None:
                current["states"].append(s["state"].strip())
        elif in_states and (s := _V_STATE.match(line)) is not None:
            current["states"].append(s["state"].strip())
        elif in_states and (_V_FIELD.match(line) or not line.strip()):
            in_states = False
    if current is not None:
        rows.append(_verbose_row(current))
    return rows


def _verbose_row(record: dict[str, Any]) -> SdrRow:
    states = tuple(record["states"])
    return SdrRow(
        name=record["name"],
        number=record["number"],
        status="ok",
        entity=record.get("entity"),
        reading=", ".join(states),
        states=states,
        analog=False,
    )
