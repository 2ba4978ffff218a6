"""Re-grade saved reports with other rules and show what changed (``node-agent grade --rules``).

An operator tries a threshold change on last week's reports before rolling it out::

    cp -r /etc/node-agent/graders /tmp/try && $EDITOR /tmp/try/rules.yaml
    node-agent grade --rules /tmp/try /var/lib/node-agent/reports/

Only grading is re-applied (``rules.yaml`` and ``xid.yaml``): the results themselves — and the
per-SKU minima a check compared its figures with when it ran — are what was recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from node_agent.commands.reporting import EXIT_FOR_LEVEL, UsageError
from node_agent.config import load_config
from node_agent.environment import load_data
from node_agent.fleet.reports import expand_paths
from node_agent.grading.rules import Grader
from node_agent.model import Grade, Level, Reason, Report, ReportFormatError
from node_agent.report import json_report
from node_agent.report.outputs import check_outputs, write_outputs
from node_agent.report.terminal import render_summary
from node_agent.yamlfile import ConfigError


@dataclass
class Regraded:
    path: str
    report: Report
    saved: Grade
    regraded: Grade

    @property
    def changed(self) -> bool:
        return (self.saved.level, self.saved.action, set(self.saved.reasons)) != (
            self.regraded.level,
            self.regraded.action,
            set(self.regraded.reasons),
        )

    @property
    def added(self) -> list[Reason]:
        before = set(self.saved.reasons)
        return [r for r in self.regraded.reasons if r not in before]

    @property
    def removed(self) -> list[Reason]:
        after = set(self.regraded.reasons)
        return [r for r in self.saved.reasons if r not in after]

    def to_dict(self) -> dict[str, Any]:
        return {
            "report": self.path,
            "hostname": self.report.host.hostname,
            "changed": self.changed,
            "saved": self.saved.to_dict(),
            "regraded": self.regraded.to_dict(),
            "added_reasons": [r.to_dict() for r in self.added],
            "removed_reasons": [r.to_dict() for r in self.removed],
        }


def regrade(paths: Sequence[Path], grader: Grader) -> tuple[list[Regraded], list[tuple[str, str]]]:
    """(re-graded reports, [(path, why unreadable)]); the saved files are not modified."""
    done, unreadable = [], []
    for path in paths:
        try:
            report = json_report.read(path)
        except ReportFormatError as err:
            unreadable.append((str(path), str(err)))
            continue
        done.append(
            Regraded(
                path=str(path),
                report=report,
                saved=report.grade,
                regraded=grader.grade(report.results, report.mode),
            )
        )
    return done, unreadable


def render_diff(items: list[Regraded], unreadable: list[tuple[str, str]], rules: str) -> str:
    changed = [i for i in items if i.changed]
    lines = [
        f"re-graded {len(items)} report(s) with the rules in {rules}: {len(changed)} changed"
        + (f", {len(unreadable)} unreadable" if unreadable else "")
    ]
    for item in changed:
        lines.append(
            f"{item.report.host.hostname}: {item.saved.level.name} -> "
            f"{item.regraded.level.name} (action {item.saved.action.value} -> "
            f"{item.regraded.action.value})  [{item.path}]"
        )
        for sign, reasons in (("+", item.added), ("-", item.removed)):
            for r in reasons:
                lines.append(f"  {sign} {r.level.name:7} {r.target:10} [{r.rule}] {r.message}")
    for path, err in unreadable:
        lines.append(f"unreadable: {err if err.startswith(path) else path + ': ' + err}")
    return "\n".join(lines)


def run(
    inputs: Sequence[str],
    grader: Grader,
    rules_label: str,
    *,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> tuple[Level, list[Regraded]]:
    """Re-grade and print the diff; returns (the worst re-graded level, items).

    ConfigError (exit 2) when no input is a readable report.
    """
    paths = expand_paths(inputs)
    items, unreadable = regrade(paths, grader)
    if not items:
        first = f": {unreadable[0][1]}" if unreadable else ""
        raise ConfigError(f"grade: no readable report among {len(paths)} file(s){first}")
    if as_json:
        print(
            json.dumps(
                {
                    "rules": rules_label,
                    "reports": [i.to_dict() for i in items],
                    "unreadable": [{"path": p, "error": e} for p, e in unreadable],
                },
                indent=2,
            ),
            file=out,
        )
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
        raise ConfigError(
            f"--rules {rules_dir}: not a directory; expected a graders directory "
            "holding rules.yaml and xid.yaml (copy the shipped graders/ and edit it)"
        )
    from node_agent.grading.rules import load_grader

    return load_grader(path), str(path)


def cmd_grade(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.simulate:
        raise UsageError("grade reads a saved report; --simulate does not apply")
    grader, _ = load_data(config)
    several = len(args.report) > 1 or os.path.isdir(args.report[0])
    pages = bool(args.html or args.junit)
    if several and pages:
        raise UsageError(
            "--html/--junit write one report's page; name a single report, not several or a "
            "directory"
        )
    grader, label = rules_grader(args.rules, grader)
    if several or (args.rules and not pages):
        worst, _ = run(args.report, grader, label, as_json=args.json)
        return EXIT_FOR_LEVEL[worst]
    check_outputs(args.html, args.junit)
    saved = json_report.read(args.report[0])
    regraded = grader.grade(saved.results, saved.mode)
    if regraded.level != saved.grade.level:
        print(
            f"node-agent: note: the saved grade was {saved.grade.level.name}; with the "
            f"{'current rules' if args.rules is None else 'rules in ' + label} it is "
            f"{regraded.level.name}",
            file=sys.stderr,
        )
    saved.grade = regraded
    if args.json:
        print(json_report.dumps(saved))
    else:
        print(render_summary(saved, colour=sys.stdout.isatty()))
    write_outputs(saved, args.html, args.junit)
    return EXIT_FOR_LEVEL[regraded.level]
