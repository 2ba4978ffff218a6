"""What every command that runs a suite shares: the exit codes of the command-line contract,
running a suite to a graded report, and printing it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from node_agent.environment import Environment, report_dir
from node_agent.model import Level, Report, utc_iso
from node_agent.report import json_report
from node_agent.report.build import build_report
from node_agent.runner import Progress, run_suite
from node_agent.suite import Suite

EXIT_OK, EXIT_AGENT_FAILED, EXIT_USAGE, EXIT_ERROR, EXIT_FAULT = 0, 1, 2, 3, 4
EXIT_FOR_LEVEL = {
    Level.HEALTHY: EXIT_OK,
    Level.WARN: EXIT_OK,
    Level.ERROR: EXIT_ERROR,
    Level.FAULT: EXIT_FAULT,
}


class UsageError(Exception):
    """Arguments that parse but do not make sense together (exit 2)."""


def print_report(
    report: Report, path: Path, note: str | None, as_json: bool, render: Callable[[Report], str]
) -> int:
    """The end of a run: the note, the report (JSON or ``render(report)``), where it was
    written; returns the contract's exit code for its grade."""
    if note:
        print(f"node-agent: note: {note}", file=sys.stderr)
    print(json_report.dumps(report) if as_json else render(report))
    print(f"report: {path}", file=sys.stderr)
    return EXIT_FOR_LEVEL[report.grade.level]


def run_and_report(
    env: Environment,
    suite: Suite,
    out: str | None,
    as_json: bool,
    render: Callable[[Report], str],
    progress: Progress | None = None,
) -> int:
    """Run ``suite`` on ``env`` (closed afterwards), write the report and print it: the whole
    of a command that runs a suite and does not act on it (``sdc``, ``hang-check``)."""
    try:
        out_dir, note = report_dir(env, out)
        report = execute(suite, env, progress=progress)
        path = json_report.write(report, out_dir)
    finally:
        env.close()
    return print_report(report, path, note, as_json, render)


def execute(suite: Suite, env: Environment, progress: Progress | None = None) -> Report:
    """Run a suite against an environment and grade it: the whole path to a verdict."""
    started = utc_iso()
    results = run_suite(suite, env, progress=progress)
    grade = env.grader.grade(results, suite.mode)
    return build_report(env, suite.name, suite.mode, started, results, grade)
