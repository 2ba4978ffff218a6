"""``node-agent fleet``: many nodes' reports -> outliers, fleet stragglers and hung jobs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from node_agent.commands.reporting import UsageError
from node_agent.config import Config, load_config
from node_agent.fleet.domains import DEFAULT_BAD_SHARE
from node_agent.fleet.topology import load_topology
from node_agent.report.terminal import printable
from node_agent.resources import graders_dir
from node_agent.yamlfile import ConfigError

EXIT_NO_SUSPECTS, EXIT_SUSPECTS = 0, 3


def run(
    inputs: Sequence[str],
    graders_dir: Path,
    *,
    as_json: bool = False,
    html: str | None = None,
    topology: str | None = None,
    owners: frozenset[int] | None = None,
    domain_bad_share: float = DEFAULT_BAD_SHARE,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``node-agent fleet``: 0 nothing found, 3 suspects, fleet stragglers, hung jobs or an
    escalated NVLink domain found; ConfigError (exit 2) when no report could be read, an input
    does not exist, a rules/topology file is invalid, or ``domain_bad_share`` is not in (0, 1].

    ``owners``: believe only report files owned by these uids (the others are named on stderr
    and in the output as skipped). ``domain_bad_share``: an NVLink domain whose share of trays
    graded ERROR or FAULT reaches it is escalated. ``out``/``err``: where the analysis and the
    notes go (default: this process's stdout and stderr at the time of the call)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if not 0 < domain_bad_share <= 1:
        raise ConfigError(
            f"fleet: --domain-bad-share must be in (0, 1] (a share of the domain's trays), "
            f"found {domain_bad_share:g}"
        )
    # the analysis needs numpy: imported here, not by every node-agent command's start
    from node_agent.fleet.analysis import analyse, load_fleet_rules
    from node_agent.fleet.html import write_fleet_html
    from node_agent.fleet.text import render_text
    from node_agent.report.html import require_matplotlib

    rules = load_fleet_rules(graders_dir)
    groups = load_topology(topology) if topology else None
    if html:
        require_matplotlib()
    if not inputs:
        raise ConfigError("fleet: name report files or a directory of reports")
    analysis = analyse(inputs, rules, topology=groups, owners=owners, bad_share=domain_bad_share)
    for path, why in analysis.skipped[:20]:
        print(printable(f"fleet: skipped {path}: {why}"), file=err)
    if len(analysis.skipped) > 20:
        print(f"fleet: ... and {len(analysis.skipped) - 20} more skipped", file=err)
    if not analysis.nodes:
        raise ConfigError(
            printable(
                f"fleet: none of {analysis.reports} file(s) is a readable report "
                f"({len(analysis.unreadable)} unreadable"
                + (f", first: {analysis.unreadable[0][1]}" if analysis.unreadable else "")
                + (
                    f"; {len(analysis.skipped)} skipped, first: {analysis.skipped[0][0]}: "
                    f"{analysis.skipped[0][1]}"
                    if analysis.skipped
                    else ""
                )
                + ")"
            )
        )
    if html:
        written = write_fleet_html(analysis, html)
        print(f"fleet html: {written}", file=err)
    if as_json:
        print(json.dumps(analysis.to_dict(), indent=2), file=out)
    else:
        print(render_text(analysis), file=out)
    return EXIT_SUSPECTS if analysis.found else EXIT_NO_SUSPECTS


def report_owners(config: Config, euid: int | None = None) -> frozenset[int] | None:
    """The uids whose report files fleet believes: ``fleet.report_owner_uids`` when it runs as
    root (a report is then a root action's input: one forged by a user could hide a node's
    hung job), None (any owner) otherwise, where it reads only what its user may read."""
    euid = os.geteuid() if euid is None else euid
    return frozenset(config.fleet.report_owner_uids) if euid == 0 else None


def add_options(parser: argparse.ArgumentParser) -> None:
    """The fleet's options that this module reads (the parser in commands/main.py calls it)."""
    parser.add_argument(
        "--domain-bad-share",
        type=float,
        default=DEFAULT_BAD_SHARE,
        metavar="SHARE",
        help="escalate an NVLink domain (rack) when this share of its trays is graded ERROR "
        f"or FAULT: its trays drain together (default {DEFAULT_BAD_SHARE:g})",
    )


def cmd_fleet(args: argparse.Namespace) -> int:
    if args.simulate:
        raise UsageError("fleet reads saved reports; --simulate does not apply")
    config = load_config(args.config)
    return run(
        args.reports,
        graders_dir(config),
        as_json=args.json,
        html=args.html,
        topology=args.topology,
        owners=report_owners(config),
        # the option is added by add_options (see commands/main.py)
        domain_bad_share=getattr(args, "domain_bad_share", DEFAULT_BAD_SHARE),
    )
