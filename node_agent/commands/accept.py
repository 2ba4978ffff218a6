"""``node-agent accept`` and ``node-agent check``: run a suite, grade, report, and act on it
when asked (``--act``)."""

from __future__ import annotations

import argparse
import sys

from node_agent.commands import act
from node_agent.commands.reporting import execute, print_report
from node_agent.config import load_config
from node_agent.environment import open_environment, report_dir
from node_agent.report import json_report
from node_agent.report.outputs import check_outputs, write_outputs
from node_agent.report.terminal import ProgressPrinter, render_summary
from node_agent.resources import suites_dir
from node_agent.suite import load_suite


def cmd_run_suite(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    suite = load_suite(args.suite, suites_dir(config))
    only = getattr(args, "only", None)
    if only:
        suite = suite.only([n.strip() for n in only.split(",") if n.strip()])
    check_outputs(args.html, args.junit)
    acting = act.prepare(args, config)
    env = open_environment(config, args.simulate)
    try:
        out_dir, note = report_dir(env, args.out)
        report = execute(suite, env, progress=ProgressPrinter() if sys.stderr.isatty() else None)
        act.act_on_report(acting, env, report)
        path = json_report.write(report, out_dir)
    finally:
        env.close()
    code = print_report(
        report,
        path,
        note,
        args.json,
        lambda r: render_summary(r, colour=sys.stdout.isatty(), verbose=args.verbose),
    )
    write_outputs(report, args.html, args.junit)
    return code
