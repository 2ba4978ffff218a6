"""Grading: results + the declarative rules in ``graders/`` -> a Grade with its reasons.

``graders/rules.yaml`` maps (check, metric, status) to a level; ``graders/xid.yaml`` gives
each XID its level; a result no rule matches falls back by its status. The worst reason decides
the grade; every reason above HEALTHY is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.model import ACTION_FOR_LEVEL, Grade, Level, Reason, Result, Status
from node_agent.yamlfile import ConfigError, load_yaml

_LEVELS = ["HEALTHY", "WARN", "ERROR", "FAULT"]
_STR_OR_LIST = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

RULES_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["rules", "fallback"],
    "properties": {
        "rules": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["id", "level"],
            "properties": {
                "id": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9-]*$"},
                "check": {"type": "string"},
                "metric": _STR_OR_LIST,
                "status": _STR_OR_LIST,
                "level": {"enum": [*_LEVELS, "xid_catalog"]},
                "why": {"type": "string"},
            }}},
        "fallback": {"type": "object", "additionalProperties": False,
                     "required": ["fail", "warn", "error"],
                     "properties": {
                         "fail": {"enum": _LEVELS}, "warn": {"enum": _LEVELS},
                         "error": {"type": "object", "additionalProperties": False,
                                   "required": ["delivery", "service"],
                                   "properties": {"delivery": {"enum": _LEVELS},
                                                  "service": {"enum": _LEVELS}}}}},
    },
}

XID_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["default", "codes"],
    "properties": {
        "default": {"type": "object", "additionalProperties": False, "required": ["level"],
                    "properties": {"level": {"enum": _LEVELS}, "description": {"type": "string"}}},
        "codes": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": False, "required": ["name", "level"],
            "properties": {"name": {"type": "string"}, "level": {"enum": _LEVELS},
                           "why": {"type": "string"}}}},
    },
}


@dataclass(frozen=True)
class Rule:
    id: str
    level: str  # a level name or "xid_catalog"
    check: str | None = None
    metrics: tuple[str, ...] | None = None
    statuses: tuple[str, ...] = ("fail",)

    def matches(self, result: Result) -> bool:
        return ((self.check is None or self.check == result.check)
                and (self.metrics is None or result.metric in self.metrics)
                and result.status.value in self.statuses)


@dataclass(frozen=True)
class XidEntry:
    name: str
    level: Level


@dataclass(frozen=True)
class Grader:
    rules: tuple[Rule, ...]
    fallback: dict[str, Any]
    xid_codes: dict[int, XidEntry]
    xid_default: Level

    def xid_level(self, code: int) -> tuple[Level, str]:
        entry = self.xid_codes.get(code)
        if entry is None:
            return self.xid_default, "not in the XID catalog"
        return entry.level, entry.name

    def grade(self, results: list[Result], mode: str = "delivery") -> Grade:
        """The grade of a run; ``mode`` decides how a check that could not run counts."""
        reasons: list[Reason] = []
        for result in results:
            reason = self._reason(result, mode)
            if reason is not None and reason.level > Level.HEALTHY:
                reasons.append(reason)
        reasons.sort(key=lambda r: (-r.level, r.target, r.rule))
        level = max((r.level for r in reasons), default=Level.HEALTHY)
        return Grade(level=level, action=ACTION_FOR_LEVEL[level], reasons=tuple(reasons))

    def _reason(self, result: Result, mode: str) -> Reason | None:
        if result.status in (Status.PASS, Status.SKIP):
            return None
        for rule in self.rules:
            if rule.matches(result):
                if rule.level == "xid_catalog":
                    level, name = self.xid_level(int(result.value))
                    message = f"{result.detail} [Xid {result.value}: {name}]"
                    return Reason(rule=rule.id, level=level, target=result.target,
                                  message=message)
                return Reason(rule=rule.id, level=Level.parse(rule.level),
                              target=result.target, message=result.detail)
        if result.status is Status.ERROR:
            level = Level.parse(self.fallback["error"][mode])
            why = ("a check that could not run is not evidence of health"
                   if mode == "delivery" else "a check could not run")
            return Reason(rule=f"check-error-{mode}", level=level, target=result.target,
                          message=f"{result.check}/{result.metric} could not run ({why}): "
                                  f"{result.detail}")
        level = Level.parse(self.fallback[result.status.value])
        return Reason(rule=f"unclassified-{result.status.value}", level=level,
                      target=result.target, message=f"{result.check}/{result.metric}: "
                                                    f"{result.detail}")


def load_grader(graders_dir: Path) -> Grader:
    """Load ``rules.yaml`` and ``xid.yaml`` from ``graders_dir`` (ConfigError when invalid)."""
    rules_data = load_yaml(graders_dir / "rules.yaml", RULES_SCHEMA, what="grading rules")
    xid_data = load_yaml(graders_dir / "xid.yaml", XID_SCHEMA, what="XID catalog")
    rules = []
    for raw in rules_data["rules"]:
        metric, status = raw.get("metric"), raw.get("status", "fail")
        rules.append(Rule(
            id=raw["id"], level=raw["level"], check=raw.get("check"),
            metrics=(metric,) if isinstance(metric, str) else tuple(metric) if metric else None,
            statuses=(status,) if isinstance(status, str) else tuple(status)))
    codes: dict[int, XidEntry] = {}
    for key, entry in xid_data["codes"].items():
        try:
            code = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"{graders_dir / 'xid.yaml'}: key 'codes.{key}': expected an "
                              "integer XID code") from None
        codes[code] = XidEntry(name=entry["name"], level=Level.parse(entry["level"]))
    return Grader(rules=tuple(rules), fallback=rules_data["fallback"], xid_codes=codes,
                  xid_default=Level.parse(xid_data["default"]["level"]))
