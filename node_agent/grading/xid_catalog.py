"""The XID and SXid catalogs (``graders/xid.yaml``, ``graders/sxid.yaml``): a finding -> a level.

An ``xid`` result is one folded finding (``checking/xid_fold.py``): a code on a GPU, its count,
bursts and the *variants* its lines printed. Its level comes from, in order:

1. the code's entry (or ``default`` for a code the catalog does not list);
2. for codes whose lines NVIDIA's catalog decodes (144-150 by the "XID 144-150 Decode" sheet,
   154 by the recovery action it names): each variant is matched against the code's ``decode``
   rows, first match wins, and the worst variant decides. A finding with no line to decode (an
   NVML event alone) takes the code's own level;
3. ``recurrence``: where the catalog says to count, the level rises once the code came back in
   ``bursts`` bursts within ``within_h`` hours on the same GPU;
4. ``class: application`` (13, 31, 43, 45: the catalog's RESTART_APP/IGNORE codes that NVIDIA's
   XID 13/31 workflows tell apart by where they repeat): the same code on *other* GPUs within the
   window makes the finding the job's, at most WARN and never escalated by recurrence; repeated
   on one GPU while the others are clean, the recurrence applies and it is that GPU's.

``restarts_before_fault`` is carried on the verdict for the remediation plan: how many restarts
(GPU resets, reboots) the same code gets before it counts as hardware (``safety.max_restarts``
where the catalog gives none).

An ``sxid`` result (an NVSwitch) takes its code's level, or ``nonfatal_level`` when every line of
it that printed a severity said Non-fatal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.kernel_log import SxidLine, XidLine, parse_line
from node_agent.model import Level, Result
from node_agent.yamlfile import ConfigError, load_yaml

_LEVELS = ["HEALTHY", "WARN", "ERROR", "FAULT"]
_STR_OR_LIST = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]
}

#: ``class`` values of an XID entry: ``application`` marks a code that is the job's when it is
#: spread across GPUs and the GPU's when it repeats on one (NVIDIA's WORKFLOW_XID_13/31);
#: ``link`` a link error the GPU at either end reports (WORKFLOW_NVLINK_ERR), which points at
#: the far end when several GPUs report it at once
XID_CLASSES = ("application", "link")
APPLICATION = "application"
LINK = "link"
#: the window in which an application-class code without a ``recurrence`` counts as spread
SPREAD_WINDOW_S = 24 * 3600.0

_RECURRENCE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["bursts", "within_h", "level", "why"],
    "properties": {
        "bursts": {"type": "integer", "minimum": 2, "maximum": 100},
        "within_h": {"type": "number", "exclusiveMinimum": 0, "maximum": 720},
        "level": {"enum": _LEVELS},
        "why": {"type": "string"},
    },
}

_DECODE_ROW = {
    "type": "object",
    "additionalProperties": False,
    "required": ["resolution", "level", "why"],
    "properties": {
        "unit": _STR_OR_LIST,
        "severity": {"enum": ["Fatal", "Nonfatal"]},
        "error_status": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFFFF},
        },
        "subcode": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "pattern": "^[01]{6}$"},
        },
        "recovery_action": _STR_OR_LIST,
        "resolution": {"type": "string"},
        "level": {"enum": _LEVELS},
        "why": {"type": "string"},
    },
}


def _catalog_schema(default: dict[str, Any], code: dict[str, Any]) -> dict[str, Any]:
    """A code catalog's schema: a ``default`` with its level, and ``codes`` keyed by code,
    each with a name and a level; ``default`` and ``code`` are their further properties."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["default", "codes"],
        "properties": {
            "default": {
                "type": "object",
                "additionalProperties": False,
                "required": ["level"],
                "properties": {"level": {"enum": _LEVELS}, **default},
            },
            "codes": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "level"],
                    "properties": {"name": {"type": "string"}, "level": {"enum": _LEVELS}, **code},
                },
            },
        },
    }


XID_SCHEMA: dict[str, Any] = _catalog_schema(
    {"description": {"type": "string"}},
    {
        "why": {"type": "string"},
        "decode": {"type": "array", "items": _DECODE_ROW, "minItems": 1},
        "recurrence": _RECURRENCE,
        "restarts_before_fault": {"type": "integer", "minimum": 0, "maximum": 1000},
        "class": {"enum": list(XID_CLASSES)},
    },
)

SXID_SCHEMA: dict[str, Any] = _catalog_schema(
    {"nonfatal_level": {"enum": _LEVELS}, "description": {"type": "string"}},
    {"nonfatal_level": {"enum": _LEVELS}, "why": {"type": "string"}, "recurrence": _RECURRENCE},
)

_MATCH_KEYS = ("unit", "severity", "error_status", "subcode", "recovery_action")


@dataclass(frozen=True)
class DecodeRow:
    match: tuple[tuple[str, frozenset[Any]], ...]
    resolution: str
    level: Level

    def matches(self, fields: dict[str, Any]) -> bool:
        for key, allowed in self.match:
            value = fields.get(key)
            if isinstance(value, str):
                value = value.casefold()
            if value is None or value not in allowed:
                return False
        return True

    def describe(self, fields: dict[str, Any]) -> str:
        said = " ".join(
            str(fields[k]) for k in ("unit", "severity", "recovery_action") if k in fields
        )
        return f"{said or 'line'} -> {self.resolution}"


@dataclass(frozen=True)
class Recurrence:
    bursts: int
    within_s: float
    level: Level

    def count(self, evidence: dict[str, Any]) -> int:
        """Bursts within the window that ends at the newest burst (1 when the finding carries no
        burst times: untimed lines, or a report from before bursts were recorded)."""
        starts = [s for s in evidence.get("burst_starts_s") or [] if isinstance(s, (int, float))]
        if not starts:
            return 1
        newest = max(starts)
        return sum(1 for s in starts if s >= newest - self.within_s)


@dataclass(frozen=True)
class CodeEntry:
    name: str
    level: Level
    decode: tuple[DecodeRow, ...] = ()
    recurrence: Recurrence | None = None
    nonfatal_level: Level | None = None  # SXid only
    restarts_before_fault: int | None = None  # None: safety.max_restarts
    cls: str | None = None  # "application" (XID_CLASSES) or None


@dataclass(frozen=True)
class Verdict:
    level: Level
    name: str  # the catalog's name, with the decoded variant that decided
    note: str  # recurrence, or why a line could not be decoded ("" when nothing to add)
    restarts_before_fault: int | None = None
    application: bool = False  # the code's class is application: a user's code can cause it
    elsewhere: bool = False  # a link error several GPUs report: the far end's (Remedy.ELSEWHERE)


class Catalog:
    """One catalog file: ``xid`` (``graders/xid.yaml``) or ``sxid`` (``graders/sxid.yaml``)."""

    def __init__(
        self,
        kind: str,
        codes: dict[int, CodeEntry],
        default: Level,
        default_nonfatal: Level | None = None,
    ) -> None:
        self.kind = kind
        self.codes = codes
        self.default = default
        self.default_nonfatal = default_nonfatal

    def level(self, code: int) -> tuple[Level, str]:
        """The code's own level and name, before reading any line."""
        entry = self.codes.get(code)
        if entry is None:
            return self.default, f"not in the {'SXid' if self.kind == 'sxid' else 'XID'} catalog"
        return entry.level, entry.name

    def judge(self, result: Result, elsewhere: list[Result] | None = None) -> Verdict:
        """The verdict on one finding. ``elsewhere``: the findings of the same code on *other*
        targets of the same run (what an ``application``-class code is judged against)."""
        code = int(result.value)  # type: ignore[arg-type]
        evidence = result.evidence or {}
        variants = _variants(result, evidence)
        entry = self.codes.get(code)
        if self.kind == "sxid":
            verdict = self._sxid(entry, variants)
        else:
            verdict = self._xid(entry, variants)
        if entry is None:
            return verdict
        spread = _spread(entry, evidence, elsewhere or []) if entry.cls else []
        if spread and entry.cls == LINK:
            # WORKFLOW_NVLINK_ERR: the GPUs at both ends report it; several GPUs at once point
            # at what they share, the far end (an NVSwitch)
            note = (
                f"also on {_shown(spread)} within {_window_h(entry):g} h: a link error several "
                "GPUs report points at the far end of their links (an NVSwitch), not at this "
                "GPU; held for an operator, never this GPU replaced for it"
            )
            return Verdict(
                verdict.level,
                verdict.name,
                _join(verdict.note, note),
                entry.restarts_before_fault,
                elsewhere=True,
            )
        if spread:
            # WORKFLOW_XID_13/31: the same fault on different GPUs is the application's
            note = (
                f"also on {_shown(spread)} within {_window_h(entry):g} h: an application error "
                "spread across GPUs is the job's, not the node's (no drain)"
            )
            level = min(verdict.level, Level.WARN)
            return Verdict(
                level, verdict.name, _join(verdict.note, note), entry.restarts_before_fault
            )
        if entry.recurrence is not None:
            rec = entry.recurrence
            bursts = rec.count(evidence)
            if bursts >= rec.bursts and rec.level > verdict.level:
                note = (
                    f"recurred: {bursts} bursts within {rec.within_s / 3600:g} h on "
                    f"{result.target} (threshold {rec.bursts})"
                )
                if entry.cls == APPLICATION:
                    note += (
                        ": repeated on this GPU while the other GPUs are clean, so it is "
                        "this GPU's, not the job's"
                    )
                verdict = Verdict(rec.level, verdict.name, _join(verdict.note, note))
        return Verdict(
            verdict.level,
            verdict.name,
            verdict.note,
            entry.restarts_before_fault,
            application=entry.cls == APPLICATION,
        )

    def _xid(self, entry: CodeEntry | None, variants: list[dict[str, Any]]) -> Verdict:
        if entry is None:
            return Verdict(self.default, "not in the XID catalog", "")
        if not entry.decode:
            return Verdict(entry.level, entry.name, "")
        if not variants:
            return Verdict(
                entry.level,
                entry.name,
                "no kernel-log line to decode (NVML event only): graded by the code",
            )
        worst: tuple[Level, str] | None = None
        undecoded = 0
        for fields in variants:
            row = next((r for r in entry.decode if r.matches(fields)), None)
            if row is None:
                undecoded += 1
                level, label = entry.level, _said(fields) + " -> no decode row, graded by the code"
            else:
                level, label = row.level, row.describe(fields)
            if worst is None or level > worst[0]:
                worst = (level, label)
        assert worst is not None
        note = f"{undecoded} variant(s) not decoded" if undecoded and len(variants) > 1 else ""
        return Verdict(worst[0], f"{entry.name}, {worst[1]}", note)

    def _sxid(self, entry: CodeEntry | None, variants: list[dict[str, Any]]) -> Verdict:
        severities = {v.get("severity") for v in variants if v.get("severity")}
        nonfatal_only = severities == {"Nonfatal"}
        if entry is None:
            if nonfatal_only and self.default_nonfatal is not None:
                return Verdict(
                    self.default_nonfatal, "not in the SXid catalog, printed Non-fatal", ""
                )
            return Verdict(self.default, "not in the SXid catalog", "")
        if nonfatal_only and entry.nonfatal_level is not None:
            return Verdict(entry.nonfatal_level, f"{entry.name}, printed Non-fatal", "")
        said = ", printed Fatal" if "Fatal" in severities else ""
        return Verdict(entry.level, entry.name + said, "")


def _said(fields: dict[str, Any]) -> str:
    parts = [str(fields[k]) for k in ("unit", "severity") if k in fields]
    if "error_status" in fields:
        parts.append(
            f"status {fields['error_status']:#x}"
            if isinstance(fields["error_status"], int)
            else f"status {fields['error_status']}"
        )
    if "subcode" in fields:
        parts.append(f"subcode {fields['subcode']}")
    if "recovery_action" in fields:
        parts.append(f"to {fields['recovery_action']}")
    return " ".join(parts) or "a line without unit or severity"


def _shown(targets: list[str]) -> str:
    more = f" and {len(targets) - 8} more" if len(targets) > 8 else ""
    return ", ".join(targets[:8]) + more


def _window_h(entry: CodeEntry) -> float:
    return (entry.recurrence.within_s if entry.recurrence else SPREAD_WINDOW_S) / 3600.0


def _spread(entry: CodeEntry, evidence: dict[str, Any], elsewhere: list[Result]) -> list[str]:
    """The other targets whose finding of this code falls in this finding's window: within the
    recurrence's ``within_h`` (else 24 h) before this finding's newest burst, on the same clock.
    A finding without times (a saved log without stamps, an NVML event) counts: the run saw it.
    For a ``link`` code the window is both ways (each GPU of a pair judges the other alike), and
    only findings with times on the same clock count: one that cannot be placed in time never
    turns another GPU's own link error into the far end's."""
    window_s = entry.recurrence.within_s if entry.recurrence else SPREAD_WINDOW_S
    newest = _newest(evidence)
    clock = evidence.get("clock")
    link = entry.cls == LINK
    targets = []
    for other in elsewhere:
        theirs = other.evidence or {}
        last = _newest(theirs)
        if link:
            placed = newest is not None and last is not None and theirs.get("clock") == clock
            if not placed or abs(last - newest) > window_s:  # type: ignore[operator]
                continue
        elif (
            newest is not None
            and last is not None
            and theirs.get("clock") == clock
            and last < newest - window_s
        ):
            continue
        targets.append(other.target)
    return sorted(set(targets), key=_target_order)


def _newest(evidence: dict[str, Any]) -> float | None:
    starts = [s for s in evidence.get("burst_starts_s") or [] if isinstance(s, (int, float))]
    return float(max(starts)) if starts else None


def _target_order(target: str) -> tuple[int, str]:
    kind, _, index = target.partition(":")
    return (int(index), kind) if index.isdigit() else (1 << 30, target)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _variants(result: Result, evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """What the finding's lines printed. Reports from before findings carried ``variants`` (and
    a daemon that keeps only the line) are decoded from the lines they kept."""
    raw = evidence.get("variants")
    if isinstance(raw, list):
        return [
            {k: v for k, v in item.items() if k in _MATCH_KEYS}
            for item in raw
            if isinstance(item, dict)
        ]
    code = int(result.value)  # type: ignore[arg-type]
    lines = evidence.get("lines") or ([evidence["line"]] if evidence.get("line") else [])
    variants: list[dict[str, Any]] = []
    for line in lines if isinstance(lines, list) else []:
        event = parse_line(str(line))
        if isinstance(event, XidLine) and event.code == code:
            fields = event.decode_fields()
        elif isinstance(event, SxidLine) and event.code == code:
            fields = {"severity": event.severity} if event.severity else {}
        else:
            continue
        if fields not in variants:
            variants.append(fields)
    return variants


def _decode_row(raw: dict[str, Any]) -> DecodeRow:
    match: list[tuple[str, frozenset[Any]]] = []
    for key in _MATCH_KEYS:
        if key not in raw:
            continue
        value = raw[key]
        values = value if isinstance(value, list) else [value]
        match.append((key, frozenset(v.casefold() if isinstance(v, str) else v for v in values)))
    return DecodeRow(
        match=tuple(match), resolution=raw["resolution"], level=Level.parse(raw["level"])
    )


def _recurrence(raw: dict[str, Any] | None) -> Recurrence | None:
    if raw is None:
        return None
    return Recurrence(
        bursts=raw["bursts"],
        within_s=float(raw["within_h"]) * 3600.0,
        level=Level.parse(raw["level"]),
    )


def _codes(path: Path, data: dict[str, Any], what: str) -> dict[int, CodeEntry]:
    codes: dict[int, CodeEntry] = {}
    for key, entry in data["codes"].items():
        try:
            code = int(key)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{path}: key 'codes.{key}': expected an integer {what} code"
            ) from None
        codes[code] = CodeEntry(
            name=entry["name"],
            level=Level.parse(entry["level"]),
            decode=tuple(_decode_row(r) for r in entry.get("decode", [])),
            recurrence=_recurrence(entry.get("recurrence")),
            nonfatal_level=Level.parse(entry["nonfatal_level"])
            if "nonfatal_level" in entry
            else None,
            restarts_before_fault=entry.get("restarts_before_fault"),
            cls=entry.get("class"),
        )
    return codes


def load_xid_catalog(path: Path) -> Catalog:
    data = load_yaml(path, XID_SCHEMA, what="XID catalog")
    return Catalog("xid", _codes(path, data, "XID"), Level.parse(data["default"]["level"]))


def load_sxid_catalog(path: Path) -> Catalog:
    data = load_yaml(path, SXID_SCHEMA, what="SXid catalog")
    default = data["default"]
    return Catalog(
        "sxid",
        _codes(path, data, "SXid"),
        Level.parse(default["level"]),
        Level.parse(default["nonfatal_level"]) if "nonfatal_level" in default else None,
    )
