"""``node-agent fleet``: many nodes' reports -> outliers, fleet stragglers and hung jobs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from node_agent.commands.reporting import UsageError
from node_agent.config import load_config
from node_agent.fleet.analysis import analyse, load_fleet_rules, load_topology
from node_agent.fleet.html import write_fleet_html
from node_agent.fleet.text import render_text
from node_agent.report.html import require_matplotlib
from node_agent.resources import graders_dir
from node_agent.yamlfile import ConfigError

EXIT_NO_SUSPECTS, EXIT_SUSPECTS = 0, 3


def run(inputs: Sequence[str], graders_dir: Path, *, as_json: bool = False,
        html: str | None = None, topology: str | None = None,
        out=sys.stdout, err=sys.stderr) -> int:
    """``node-agent fleet``: 0 nothing found, 3 suspects, fleet stragglers or hung jobs found;
    ConfigError (exit 2) when no report could be read, an input does not exist, or a
    rules/topology file is invalid."""
    rules = load_fleet_rules(graders_dir)
    groups = load_topology(topology) if topology else None
    if html:
        require_matplotlib()
    if not inputs:
        raise ConfigError("fleet: name report files or a directory of reports")
    analysis = analyse(inputs, rules, topology=groups)
    if not analysis.nodes:
        raise ConfigError(f"fleet: none of {analysis.reports} file(s) is a readable report "
                          f"({len(analysis.unreadable)} unreadable"
                          + (f", first: {analysis.unreadable[0][1]}" if analysis.unreadable
                             else "") + ")")
    if html:
        path = write_fleet_html(analysis, html)
        print(f"fleet html: {path}", file=err)
    if as_json:
        print(json.dumps(analysis.to_dict(), indent=2), file=out)
    else:
        print(render_text(analysis), file=out)
    return EXIT_SUSPECTS if analysis.found else EXIT_NO_SUSPECTS


def cmd_fleet(args: argparse.Namespace) -> int:
    if args.simulate:
        raise UsageError("fleet reads saved reports; --simulate does not apply")
    return run(args.reports, graders_dir(load_config(args.config)), as_json=args.json,
                html=args.html, topology=args.topology)
