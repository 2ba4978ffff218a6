"""The terminal view: progress lines while a suite runs, a summary table at the end.

Much of what is shown came from other users (spool file names, a job's details, a process's
environment and command line): :func:`printable` escapes every control character before it
reaches a terminal, so no text can move the cursor, rewrite earlier lines, set the window
title or hide itself behind a bidirectional override.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import TextIO

from node_agent.model import Level, Report, Result, Status
from node_agent.suite import CheckSpec

# C0 and C1 controls (ESC starts a terminal escape, CR/LF/BS rewrite what was shown), DEL, the
# invisible or reordering Unicode formats (zero-width, line/paragraph separators,
# bidirectional embeddings, overrides and isolates: "Trojan Source", CVE-2021-42574), and lone
# surrogates (from JSON's "\ud800": no encoding can print them, so they would crash the print)
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)


def printable(text: object) -> str:
    """``text`` with every control character escaped (``\\x1b``, ``\\n``, ``\\u202e``).

    >>> printable("gpu:1 \\x1b[2Jok")
    'gpu:1 \\\\x1b[2Jok'
    """
    return _UNSAFE.sub(
        lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), str(text)
    )


_COLOURS = {
    "pass": "32",
    "warn": "33",
    "fail": "31",
    "skip": "90",
    "error": "35",
    "HEALTHY": "32",
    "WARN": "33",
    "ERROR": "35",
    "FAULT": "31",
}


def _paint(text: str, key: str, colour: bool) -> str:
    return f"\033[{_COLOURS[key]}m{text}\033[0m" if colour and key in _COLOURS else text


class ProgressPrinter:
    """Prints ``[2/3] nvml_health ... 40 pass, 1 fail (0.3 s)`` lines to a stream."""

    def __init__(self, stream: TextIO = sys.stderr, colour: bool | None = None) -> None:
        self.stream = stream
        self.colour = stream.isatty() if colour is None else colour

    def __call__(
        self, event: str, spec: CheckSpec, index: int, total: int, results: list[Result]
    ) -> None:
        if event == "start":
            self.stream.write(f"[{index}/{total}] {printable(spec.check)} ... ")
            self.stream.flush()
            return
        counts = Counter(r.status.value for r in results)
        parts = [
            _paint(f"{n} {s}", s, self.colour)
            for s in ("pass", "warn", "fail", "error", "skip")
            if (n := counts.get(s))
        ]
        seconds = max((r.duration_s for r in results), default=0.0)
        self.stream.write(f"{', '.join(parts)} ({seconds:.1f} s)\n")
        self.stream.flush()


def _collapse_skips(results: list[Result]) -> list[Result]:
    """One row for a skip repeated on many targets (e.g. a reading no GPU of the SKU has)."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if r.status is Status.SKIP:
            groups.setdefault((r.check, r.metric), []).append(r)
    rows: list[Result] = []
    for r in results:
        group = groups.get((r.check, r.metric)) if r.status is Status.SKIP else None
        if group is None or len(group) == 1:
            rows.append(r)
        elif group[0] is r:
            targets = ",".join(g.target.split(":")[-1] for g in group)
            rows.append(
                Result(
                    check=r.check,
                    target=f"gpu:{targets}"
                    if r.target.startswith("gpu:")
                    else f"{len(group)} targets",
                    metric=r.metric,
                    status=r.status,
                    detail=r.detail,
                )
            )
    return [
        Result(
            check=printable(r.check),
            target=printable(r.target),
            metric=printable(r.metric),
            status=r.status,
            detail=printable(r.detail),
        )
        for r in rows
    ]


def render_summary(report: Report, colour: bool = False, verbose: bool = False) -> str:
    """The table people read: findings first, then a count of what passed, then the verdict."""
    lines: list[str] = []
    head = (
        f"node-agent {report.suite} on {report.host.hostname}"
        f"{' (SIMULATED)' if report.simulated else ''}: {len(report.gpus)} GPU(s)"
        f"{', SKU ' + report.sku if report.sku else ''}, driver {report.host.driver or 'n/a'}"
    )
    lines.append(printable(head))
    shown = _collapse_skips([r for r in report.results if verbose or r.status is not Status.PASS])
    if shown:
        width_check = max(len(r.check) for r in shown)
        width_target = max(len(r.target) for r in shown)
        width_metric = max(len(r.metric) for r in shown)
        lines.append("")
        lines.append(
            f"{'STATUS':6}  {'CHECK':{width_check}}  {'TARGET':{width_target}}  "
            f"{'METRIC':{width_metric}}  DETAIL"
        )
        for r in shown:
            status = _paint(f"{r.status.value:6}", r.status.value, colour)
            detail = r.detail if len(r.detail) <= 110 else r.detail[:107] + "..."
            lines.append(
                f"{status}  {r.check:{width_check}}  {r.target:{width_target}}  "
                f"{r.metric:{width_metric}}  {detail}"
            )
    counts = Counter(r.status.value for r in report.results)
    lines.append("")
    lines.append(
        "results: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("pass", "warn", "fail", "error", "skip"))
    )
    grade = report.grade
    verdict = _paint(grade.level.name, grade.level.name, colour)
    lines.append(f"grade: {verdict}   action: {grade.action.value}")
    for reason in grade.reasons:
        if reason.level > Level.HEALTHY:
            lines.append(
                f"  - {reason.level.name:7} {printable(reason.target):10} "
                f"[{printable(reason.rule)}] {printable(reason.message)}"
            )
    for action in report.actions:
        lines.append(
            printable(
                f"action {action.action} via {action.adapter}: {action.outcome} ({action.detail})"
            )
        )
    return "\n".join(lines)
