"""The extra report files a command writes on request (``--html PATH``, ``--junit PATH``).

:func:`check_outputs` runs before anything else, so a missing extra or a directory that does
not exist is a usage error (exit 2) with nothing run; :func:`write_outputs` writes after the
verdict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from node_agent.model import Report
from node_agent.yamlfile import ConfigError


def check_outputs(html: str | None, junit: str | None) -> None:
    """ConfigError when a requested output cannot be written (missing directory, no extra)."""
    for option, path in (("--html", html), ("--junit", junit)):
        if path is None:
            continue
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"{option} {path}: is a directory; name the file to write")
        if not p.parent.is_dir():
            raise ConfigError(
                f"{option} {path}: directory {p.parent} does not exist; create it "
                "or choose another path"
            )
    if html:
        from node_agent.report.html import require_matplotlib

        require_matplotlib()


def write_outputs(
    report: Report, html: str | None, junit: str | None, err: TextIO = sys.stderr
) -> list[Path]:
    """Write the requested files; name each on ``err`` (stdout may carry the JSON report)."""
    written = []
    if html:
        from node_agent.report.html import write_html

        written.append(write_html(report, html))
        print(f"html: {written[-1]}", file=err)
    if junit:
        from node_agent.report.junit import write_junit

        written.append(write_junit(report, junit))
        print(f"junit: {written[-1]}", file=err)
    return written


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--html PATH`` and ``--junit PATH`` on an argparse parser."""
    parser.add_argument(
        "--html",
        metavar="PATH",
        help="also write a self-contained HTML report with plots (needs the `report` extra; "
        "without it, the error names the command that installs it)",
    )
    parser.add_argument(
        "--junit", metavar="PATH", help="also write JUnit XML: one test case per check and target"
    )
