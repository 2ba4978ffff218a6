"""``nvme smart-log /dev/nvmeN -o json``: an NVMe controller's SMART / Health log (log page 02h).

The JSON has changed with nvme-cli's versions (``nvme-print-json.c`` / ``nvme-print.c``,
``json_smart_log``):

* 1.x (to 2.1): 128-bit counters printed through a long double as plain integers
  (``"media_errors" : 0``);
* 2.2 and 2.3 (Sept 2022 "Output 128bit values as uint128 type", to Feb 2023 "Revert JSON output
  to plain numbers"): the 128-bit counters are JSON strings (``"media_errors":"0"``);
* 2.4 on: numbers again;
* with ``-H``/verbose, ``critical_warning`` is an object: ``{"value": 4, "available_spare": 0,
  "temp_threshold": 0, "reliability_degraded": 1, "ro": 0, "vmbu_failed": 0, "pmr_ro": 0}``.

smartctl's JSON (``smartctl -x -j /dev/nvmeN``, smartmontools 7.0 on: ``nvmeprint.cpp``,
``print_smart_log``) names the same fields ``percentage_used``, ``available_spare`` and
``available_spare_threshold`` under ``nvme_smart_health_information_log``, with the temperature in
Celsius; :func:`parse_smartctl_json` reads it with the device, model and serial smartctl prints
beside it and the messages it gives where it could not read the log.

Available Spare and its threshold are percentages (0-100; NVMe Base Specification, SMART / Health
log bytes 3 and 4): spare below the threshold is a drive out of the blocks it remaps failing
flash to, whether or not the drive also set critical-warning bit 0. A threshold over 100 is
reserved by the specification and is not compared. Percentage Used may exceed 100 (255 stands
for anything over 254): 100 is the rated endurance reached.

Critical warning bits (NVM Express Base Specification, SMART / Health Information, byte 0):
0 available spare below threshold, 1 temperature, 2 reliability degraded (media or internal
errors), 3 media read-only, 4 volatile memory backup failed, 5 persistent memory region
read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_agent.parsers import ParseError, json_document

WARNING_BITS = {
    0: "available spare below threshold",
    1: "temperature over threshold",
    2: "reliability degraded (media or internal errors)",
    3: "media read-only",
    4: "volatile memory backup failed",
    5: "persistent memory region read-only",
}
#: bits that mean the media itself is failing: spare exhausted, reliability degraded, read-only
MEDIA_BITS = (0, 2, 3)


@dataclass(frozen=True)
class SmartLog:
    critical_warning: int
    percent_used: int | None
    avail_spare: int | None
    spare_thresh: int | None
    media_errors: int | None
    temperature_k: int | None

    @property
    def warnings(self) -> list[str]:
        return [text for bit, text in WARNING_BITS.items() if self.critical_warning >> bit & 1]

    @property
    def media_warning(self) -> bool:
        return any(self.critical_warning >> bit & 1 for bit in MEDIA_BITS)

    @property
    def spare_below_threshold(self) -> bool:
        """Available Spare under its threshold (a threshold the spec reserves, over 100, is
        never compared)."""
        return (
            self.avail_spare is not None
            and self.spare_thresh is not None
            and 0 <= self.spare_thresh <= 100
            and self.avail_spare < self.spare_thresh
        )


def _number(doc: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        if key not in doc:
            continue
        value = doc[key]
        if isinstance(value, bool):
            break
        if isinstance(value, (int, float)):
            return int(value)
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
        raise ParseError(f"nvme smart-log: key {key!r} is {value!r}, expected a number")
    return None


def parse_smart_log(text: str) -> SmartLog:
    """The figures of one ``nvme smart-log -o json`` document (any nvme-cli version above),
    or ParseError naming what is missing."""
    doc = json_document(text, "nvme smart-log", "-o json output")
    if not isinstance(doc, dict):
        raise ParseError(f"nvme smart-log JSON is a {type(doc).__name__}, expected an object")
    if "nvme_smart_health_information_log" in doc:  # smartctl --json
        return parse_smartctl_json(text).log
    return _health_log(doc, kelvin=True)


@dataclass(frozen=True)
class SmartctlReport:
    """What ``smartctl -x -j /dev/nvmeN`` says of one NVMe controller."""

    log: SmartLog
    device: str | None
    model: str | None
    serial: str | None
    exit_status: int | None  # smartctl's bit mask (smartctl(8), RETURN VALUES)
    messages: tuple[str, ...]


def _object(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _messages(doc: dict[str, Any]) -> tuple[str, ...]:
    found = _object(doc, "smartctl").get("messages")
    if not isinstance(found, list):
        return ()
    return tuple(str(m.get("string", ""))[:200] for m in found if isinstance(m, dict))


def parse_smartctl_json(text: str) -> SmartctlReport:
    """One ``smartctl -x -j`` (or ``-a -j``, ``--json=c``) document of an NVMe device.

    ParseError when it is not JSON, or holds no ``nvme_smart_health_information_log`` (a device
    smartctl could not open or read: its own messages are in the error, e.g. "Permission
    denied"; an ATA or SCSI disk, which has no NVMe health log)."""
    doc = json_document(text, "smartctl", "-j output")
    if not isinstance(doc, dict):
        raise ParseError(f"smartctl JSON is a {type(doc).__name__}, expected an object")
    said = _messages(doc)
    device = _object(doc, "device")
    tool = _object(doc, "smartctl")
    health = doc.get("nvme_smart_health_information_log")
    if not isinstance(health, dict):
        protocol = device.get("protocol")
        raise ParseError(
            "smartctl JSON has no nvme_smart_health_information_log"
            + (
                f" (the device speaks {protocol}, not NVMe)"
                if protocol not in (None, "NVMe")
                else ""
            )
            + (f": smartctl said {'; '.join(said)}" if said else "")
        )
    status = tool.get("exit_status")
    return SmartctlReport(
        log=_health_log(health, kelvin=False),
        device=str(device.get("name")) if device.get("name") else None,
        model=str(doc["model_name"]).strip() if doc.get("model_name") else None,
        serial=str(doc["serial_number"]).strip() if doc.get("serial_number") else None,
        exit_status=status if isinstance(status, int) and not isinstance(status, bool) else None,
        messages=said,
    )


def _health_log(doc: dict[str, Any], kelvin: bool) -> SmartLog:
    """The SMART / Health figures of nvme-cli's object (``kelvin``: its temperature is in
    kelvin) or smartctl's ``nvme_smart_health_information_log`` (Celsius)."""
    raw = doc.get("critical_warning")
    if isinstance(raw, dict):  # -H: the bits spelt out, the byte under "value"
        raw = raw.get("value")
    if isinstance(raw, str) and raw.strip().lower().startswith("0x"):
        raw = int(raw.strip(), 16)
    warning = _number({"critical_warning": raw}, "critical_warning") if raw is not None else None
    if warning is None:
        raise ParseError(
            "nvme smart-log JSON has no critical_warning (expected the SMART / "
            f"Health log's fields; got keys {sorted(doc)[:12]})"
        )
    return SmartLog(
        critical_warning=warning,
        percent_used=_number(doc, "percent_used", "percentage_used"),
        avail_spare=_number(doc, "avail_spare", "available_spare"),
        spare_thresh=_number(doc, "spare_thresh", "available_spare_threshold"),
        media_errors=_number(doc, "media_errors"),
        temperature_k=_temperature_k(doc, kelvin),
    )


def _temperature_k(doc: dict[str, Any], kelvin: bool) -> int | None:
    if isinstance(doc.get("temperature"), dict):
        return None
    value = _number(doc, "temperature")
    return value if value is None or kelvin else value + 273
