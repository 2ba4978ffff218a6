"""``node-agent hang-check [--pid PID ...] [--json]``: is a training process on this node hung?

It runs the ``training_progress`` check once, as a one-check suite ``hang-check`` in service
mode, with the params of the ``training_progress`` entry of the periodic (daemon) suite, so an
operator's thresholds apply here too. ``--pid`` limits it to those processes (found even when
they write no heartbeats and NVML does not list them: the operator names them).

A one-shot has no earlier run to compare with, so the hold time that processes without
heartbeats need across daemon runs (``confirm_s``) is not applied: the stack samples taken now
(``--samples``, ``--interval``) are the only window, and every process's stack is sampled
and shown, suspect or not (within the check's sampling deadline and its ``stack_max_calls``
budget, shared fairly between uids: docs/training_hangs.md). Exit codes follow the contract:
0 no hang, or only WARNs (stragglers, and hangs of jobs the kernel does not vouch for, which
name the uid), 3 a verified job's hang (ERROR), 2 usage errors.

``commands.main`` only wires the sub-command to :func:`add_parser` and :func:`run`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from node_agent.config import Config
from node_agent.suite import CheckSpec, Suite, load_suite
from node_agent.yamlfile import ConfigError

CHECK = "training_progress"


def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "hang-check",
        help="one-shot hang and straggler check of the training processes on this node",
    )
    common(p)
    p.add_argument(
        "--pid",
        type=int,
        action="append",
        metavar="PID",
        help="look only at this process (repeatable); default: every training "
        "process found (heartbeats, NVML compute processes)",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="py-spy stack samples per process (default: the periodic suite's, 3)",
    )
    p.add_argument(
        "--interval",
        type=float,
        metavar="S",
        help="seconds between stack samples (default: the periodic suite's, 1)",
    )
    p.add_argument("--json", action="store_true", help="print the report alone on stdout")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="directory for the JSON report (default: <state_dir>/reports, or a temp dir)",
    )


def build_suite(
    config: Config,
    suites_dir: Any,
    pids: list[int] | None,
    samples: int | None,
    interval_s: float | None,
) -> Suite:
    """A one-check suite from the periodic suite's ``training_progress`` entry (or defaults)."""
    base: CheckSpec | None = None
    try:
        periodic = load_suite("periodic", suites_dir)
        base = next((c for c in periodic.checks if c.check == CHECK), None)
    except ConfigError:
        base = None  # an operator's suites dir without a periodic suite: the check's defaults
    params: dict[str, Any] = dict(base.params) if base else {}
    params["one_shot"] = True  # no earlier run: confirm_s is not applied
    params["sample_all"] = True  # an operator asking wants every stack, suspect or not
    if pids:
        params["pids"] = pids
    if samples is not None:
        params["stack_samples"] = samples
    if interval_s is not None:
        params["stack_interval_s"] = interval_s
    return Suite(
        name="hang-check",
        mode="service",
        checks=(CheckSpec(CHECK, base.timeout_s if base else 60.0, params),),
        source=f"node-agent hang-check (params from {'periodic suite' if base else 'defaults'})",
        description="training hang and straggler check, one-shot",
    )


def run(args: argparse.Namespace) -> int:
    """The ``hang-check`` sub-command (``cli.main`` maps exceptions to exit codes)."""
    from node_agent.commands.reporting import run_and_report
    from node_agent.config import load_config
    from node_agent.environment import open_environment
    from node_agent.resources import suites_dir

    for pid in args.pid or []:
        if pid <= 0:
            raise ConfigError(f"--pid {pid}: expected a process id (a positive integer)")
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: expected at least 1")
    if args.interval is not None and not (math.isfinite(args.interval) and args.interval >= 0):
        raise ConfigError(f"--interval {args.interval:g}: expected a finite number of seconds >= 0")
    config = load_config(args.config)
    suite = build_suite(config, suites_dir(config), args.pid, args.samples, args.interval)
    return run_and_report(
        open_environment(config, args.simulate), suite, args.out, args.json, render
    )


def render(report: Any) -> str:
    """One line per training process, then the grade and its reasons (plain text; what the
    training processes wrote has its control characters escaped)."""
    from node_agent.report.terminal import printable

    lines = [
        f"training processes on {report.host.hostname}"
        + ("  (SIMULATED)" if report.simulated else "")
    ]
    for r in report.results:
        ev = r.evidence
        agreeing = ", ".join(str(a) for a in ev.get("agreeing") or []) or "-"
        lines.append(f"  {r.status.value:<5} {r.metric:<20} {r.target}  signals: {agreeing}")
        lines.append(f"        {r.detail}")
    g = report.grade
    lines.append(f"grade: {g.level.name} (action {g.action.value})")
    lines += [f"  {x.level.name} {x.target} [{x.rule}] {x.message}" for x in g.reasons]
    return "\n".join(printable(line) for line in lines)
