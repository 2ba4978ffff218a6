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

smartctl's JSON names the same fields ``percentage_used``, ``available_spare`` and
``available_spare_threshold`` under ``nvme_smart_health_information_log``; those are read too.

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
    doc = doc.get("nvme_smart_health_information_log", doc)  # smartctl --json
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
        temperature_k=_number(doc, "temperature")
        if not isinstance(doc.get("temperature"), dict)
        else None,
    )
