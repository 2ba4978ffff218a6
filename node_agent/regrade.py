"""Re-grade saved reports with other rules and show what changed (``node-agent grade --rules``).

An operator tries a threshold change on last week's reports before rolling it out::

    cp -r /etc/node-agent/graders /tmp/try && $EDITOR /tmp/try/rules.yaml
    node-agent grade --rules /tmp/try /var/lib/node-agent/reports/

Only grading is re-applied (``rules.yaml`` and ``xid.yaml``): the results themselves — and the
per-SKU minima a check compared its figures with when it ran — are what was recorded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .fleet import expand_paths
from .grading import Grader
from .model import Grade, Level, Reason, Report, ReportFormatError
from .report import json_report
from .yamlfile import ConfigError


@dataclass
class Regraded:
    path: str
    report: Report
    saved: Grade
    regraded: Grade

    @property
    def changed(self) -> bool:
        return (self.saved.level, self.saved.action, set(self.saved.reasons)) != (
            self.regraded.level, self.regraded.action, set(self.regraded.reasons))

    @property
    def added(self) -> list[Reason]:
        before = set(self.saved.reasons)
        return [r for r in self.regraded.reasons if r not in before]

    @property
    def removed(self) -> list[Reason]:
        after = set(self.regraded.reasons)
        return [r for r in self.saved.reasons if r not in after]

    def to_dict(self) -> dict:
        return {"report": self.path, "hostname": self.report.host.hostname,
                "changed": self.changed, "saved": self.saved.to_dict(),
                "regraded": self.regraded.to_dict(),
                "added_reasons": [r.to_dict() for r in self.added],
                "removed_reasons": [r.to_dict() for r in self.removed]}


def regrade(paths: Sequence[Path], grader: Grader
            ) -> tuple[list[Regraded], list[tuple[str, str]]]:
    """(re-graded reports, [(path, why unreadable)]); the saved files are not modified."""
    done, unreadable = [], []
    for path in paths:
        try:
            report = json_report.read(path)
        except ReportFormatError as err:
            unreadable.append((str(path), str(err)))
            continue
        done.append(Regraded(path=str(path), report=report, saved=report.grade,
                             regraded=grader.grade(report.results, report.mode)))
    return done, unreadable


def render_diff(items: list[Regraded], unreadable: list[tuple[str, str]], rules: str) -> str:
    changed = [i for i in items if i.changed]
    lines = [f"re-graded {len(items)} report(s) with the rules in {rules}: {len(changed)} changed"
             + (f", {len(unreadable)} unreadable" if unreadable else "")]
    for item in changed:
        lines.append(f"{item.report.host.hostname}: {item.saved.level.name} -> "
                     f"{item.regraded.level.name} (action {item.saved.action.value} -> "
                     f"{item.regraded.action.value})  [{item.path}]")
        for sign, reasons in (("+", item.added), ("-", item.removed)):
            for r in reasons:
                lines.append(f"  {sign} {r.level.name:7} {r.target:10} [{r.rule}] {r.message}")
    for path, err in unreadable:
        lines.append(f"unreadable: {err if err.startswith(path) else path + ': ' + err}")
    return "\n".join(lines)


def run(inputs: Sequence[str], grader: Grader, rules_label: str, *, as_json: bool = False,
        out: TextIO = sys.stdout) -> tuple[int | None, list[Regraded]]:
    """Re-grade and print the diff; returns (worst re-graded level or None, items).

    ConfigError (exit 2) when no input is a readable report.
    """
    paths = expand_paths(inputs)
    items, unreadable = regrade(paths, grader)
    if not items:
        first = f": {unreadable[0][1]}" if unreadable else ""
        raise ConfigError(f"grade: no readable report among {len(paths)} file(s){first}")
    if as_json:
        print(json.dumps({"rules": rules_label, "reports": [i.to_dict() for i in items],
                          "unreadable": [{"path": p, "error": e} for p, e in unreadable]},
                         indent=2), file=out)
    else:
        print(render_diff(items, unreadable, rules_label), file=out)
    worst = max((i.regraded.level for i in items), default=Level.HEALTHY)
    return worst, items


def rules_grader(rules_dir: str | None, current: Grader) -> tuple[Grader, str]:
    """The grader of ``--rules DIR`` (its rules.yaml and xid.yaml), or the current one."""
    if rules_dir is None:
        return current, "current graders directory"
    path = Path(rules_dir)
    if not path.is_dir():
        raise ConfigError(f"--rules {rules_dir}: not a directory; expected a graders directory "
                          "holding rules.yaml and xid.yaml (copy the shipped graders/ and edit it)")
    from .grading import load_grader

    return load_grader(path), str(path)
