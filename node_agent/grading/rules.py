"""Grading: results + the declarative rules in ``graders/`` -> a Grade with its reasons.

``graders/rules.yaml`` maps (check, metric, status) to a level; a rule whose level is
``xid_catalog`` or ``sxid_catalog`` hands the result to ``graders/xid.yaml`` / ``sxid.yaml``
(read by :mod:`node_agent.grading.xid_catalog`, which decodes the lines and applies the
recurrence thresholds); a result no rule matches falls back by its status. The worst reason
decides the grade; every reason above HEALTHY is kept. A rule's ``remedy`` marker (and the
fallback's for a check that could not run) is carried on its Reason for the remediation plan,
with the typed facts the plan reads: the catalog code and name, the driver's recovery action
(:func:`recovery_of`); the entity and job come from the target (``model.Target``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.grading.xid_catalog import Catalog, load_sxid_catalog, load_xid_catalog
from node_agent.model import (
    ACTION_FOR_LEVEL,
    REMEDIES,
    Action,
    Grade,
    Level,
    Reason,
    Recovery,
    Remedy,
    Result,
    Status,
)
from node_agent.yamlfile import load_yaml

_LEVELS = ["HEALTHY", "WARN", "ERROR", "FAULT"]
_STR_OR_LIST = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

RULES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["rules", "fallback"],
    "properties": {
        "rules": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id", "level"],
                "properties": {
                    "id": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9-]*$"},
                    "check": {"type": "string"},
                    "metric": _STR_OR_LIST,
                    "status": _STR_OR_LIST,
                    "level": {"enum": [*_LEVELS, "xid_catalog", "sxid_catalog"]},
                    "why": {"type": "string"},
                    "remedy": {"enum": list(REMEDIES)},
                },
            },
        },
        "fallback": {
            "type": "object",
            "additionalProperties": False,
            "required": ["fail", "warn", "error"],
            "properties": {
                "fail": {"enum": _LEVELS},
                "warn": {"enum": _LEVELS},
                "error": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["delivery", "service"],
                    "properties": {
                        "delivery": {"enum": _LEVELS},
                        "service": {"enum": _LEVELS},
                        "remedy": {"enum": list(REMEDIES)},
                    },
                },
            },
        },
    },
}

#: The rule SXid findings get when ``rules.yaml`` routes none to the SXid catalog (a rules file
#: written before SXids were read): without it they would fall through to "unclassified" and
#: grade ERROR even when the NVSwitch printed Non-fatal.
SXID_RULE = {"id": "sxid", "check": "xid", "metric": "sxid", "level": "sxid_catalog"}


@dataclass(frozen=True)
class Rule:
    id: str
    level: str  # a level name, "xid_catalog" or "sxid_catalog"
    check: str | None = None
    metrics: tuple[str, ...] | None = None
    statuses: tuple[str, ...] = ("fail",)
    remedy: Remedy | None = None  # carried on the Reason

    def matches(self, result: Result) -> bool:
        return (
            (self.check is None or self.check == result.check)
            and (self.metrics is None or result.metric in self.metrics)
            and result.status.value in self.statuses
        )


@dataclass(frozen=True)
class Grader:
    rules: tuple[Rule, ...]
    fallback: dict[str, Any]
    xid: Catalog
    sxid: Catalog

    def grade(self, results: list[Result], mode: str = "delivery") -> Grade:
        """The grade of a run; ``mode`` decides how a check that could not run counts.

        Catalog findings are judged with the run's other findings of the same code on other
        targets (an application-class Xid spread across GPUs is the job's: graders/xid.yaml),
        so the ``xid`` check's run and the daemon's kept findings are judged alike.
        """
        by_code: dict[tuple[str, str, Any], list[Result]] = {}
        for result in results:
            if result.check == "xid" and result.status is Status.FAIL:
                by_code.setdefault((result.check, result.metric, result.value), []).append(result)
        reasons: list[Reason] = []
        for result in results:
            same = by_code.get((result.check, result.metric, result.value), [])
            elsewhere = [r for r in same if r.target != result.target]
            reason = self._reason(result, mode, elsewhere)
            if reason is not None and reason.level > Level.HEALTHY:
                reasons.append(reason)
        reasons.sort(key=lambda r: (-r.level, r.target, r.rule))
        level = max((r.level for r in reasons), default=Level.HEALTHY)
        return Grade(level=level, action=action_for(level, reasons), reasons=tuple(reasons))

    def _catalog_reason(
        self, rule: Rule, result: Result, elsewhere: list[Result] | None = None
    ) -> Reason:
        catalog, noun = (self.sxid, "SXid") if rule.level == "sxid_catalog" else (self.xid, "Xid")
        try:
            verdict = catalog.judge(result, elsewhere)
        except (TypeError, ValueError):  # a hand-edited report without a numeric code
            return Reason(
                rule=rule.id,
                level=catalog.default,
                target=result.target,
                message=f"{result.detail} [{noun} {result.value!r}: not a code]",
                remedy=rule.remedy,
                catalog=catalog.kind,
                recovery=recovery_of(result),
            )
        code = int(result.value)  # type: ignore[arg-type]
        message = f"{result.detail} [{noun} {code}: {verdict.name}]"
        if verdict.note:
            message += f" ({verdict.note})"
        return Reason(
            rule=rule.id,
            level=verdict.level,
            target=result.target,
            message=message,
            remedy=(
                Remedy.APPLICATION
                if verdict.application
                else Remedy.ELSEWHERE
                if verdict.elsewhere
                else rule.remedy
            ),
            catalog=catalog.kind,
            code=code,
            restarts_before_fault=verdict.restarts_before_fault,
            name=verdict.name,
            recovery=recovery_of(result),
        )

    def _reason(
        self, result: Result, mode: str, elsewhere: list[Result] | None = None
    ) -> Reason | None:
        if result.status in (Status.PASS, Status.SKIP):
            return None
        for rule in self.rules:
            if rule.matches(result):
                if rule.level in ("xid_catalog", "sxid_catalog"):
                    return self._catalog_reason(rule, result, elsewhere)
                return Reason(
                    rule=rule.id,
                    level=Level.parse(rule.level),
                    target=result.target,
                    message=result.detail,
                    remedy=rule.remedy,
                    recovery=recovery_of(result),
                    planned=result.planned,
                )
        if result.status is Status.ERROR:
            level = Level.parse(self.fallback["error"][mode])
            why = (
                "a check that could not run is not evidence of health"
                if mode == "delivery"
                else "a check could not run"
            )
            return Reason(
                rule=f"check-error-{mode}",
                level=level,
                target=result.target,
                message=f"{result.check}/{result.metric} could not run ({why}): {result.detail}",
                remedy=_remedy(self.fallback["error"].get("remedy")),
                recovery=recovery_of(result),
            )
        level = Level.parse(self.fallback[result.status.value])
        return Reason(
            rule=f"unclassified-{result.status.value}",
            level=level,
            target=result.target,
            message=f"{result.check}/{result.metric}: {result.detail}",
            remedy=Remedy.UNCLASSIFIED,
            recovery=recovery_of(result),
        )


def action_for(level: Level, reasons: list[Reason]) -> Action:
    """The grade's action: :data:`ACTION_FOR_LEVEL`, except an ERROR whose every ERROR reason is
    an announced maintenance (``remedy: planned``), which asks for a drain alone (no restart:
    the cloud takes the host; docs/cloud.md)."""
    serious = [r for r in reasons if r.level >= Level.ERROR]
    if level is Level.ERROR and serious and all(r.remedy is Remedy.PLANNED for r in serious):
        return Action.DRAIN
    return ACTION_FOR_LEVEL[level]


#: the metric whose value names the driver's recovery action (``nvml_health``)
RECOVERY_METRIC = "recovery_action"


def recovery_of(result: Result) -> Recovery | None:
    """The driver's recovery action a result reports, as the Reason carries it.

    ``Result.recovery`` when the check set it; else, for the ``recovery_action`` metric, its
    value (the ``nvmlGpuRecoveryAction_t`` name the check reports, e.g. ``node_reboot``): a
    typed value, never the detail text.
    """
    if result.recovery is not None:
        return result.recovery
    if result.metric == RECOVERY_METRIC and isinstance(result.value, str):
        return Recovery.parse(result.value)
    return None


def _remedy(value: str | None) -> Remedy | None:
    return None if value is None else Remedy(value)


def load_grader(graders_dir: Path) -> Grader:
    """Load ``rules.yaml``, ``xid.yaml`` and ``sxid.yaml`` from ``graders_dir`` (ConfigError
    when invalid)."""
    rules_data = load_yaml(graders_dir / "rules.yaml", RULES_SCHEMA, what="grading rules")
    rules = []
    raw_rules = list(rules_data["rules"])
    if not any(r["level"] == "sxid_catalog" for r in raw_rules):
        raw_rules.insert(0, SXID_RULE)
    for raw in raw_rules:
        metric, status = raw.get("metric"), raw.get("status", "fail")
        rules.append(
            Rule(
                id=raw["id"],
                level=raw["level"],
                check=raw.get("check"),
                metrics=(metric,) if isinstance(metric, str) else tuple(metric) if metric else None,
                statuses=(status,) if isinstance(status, str) else tuple(status),
                remedy=_remedy(raw.get("remedy")),
            )
        )
    return Grader(
        rules=tuple(rules),
        fallback=rules_data["fallback"],
        xid=load_xid_catalog(graders_dir / "xid.yaml"),
        sxid=load_sxid_catalog(graders_dir / "sxid.yaml"),
    )
