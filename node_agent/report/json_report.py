"""The JSON report: write atomically, read back with a schema check."""

from __future__ import annotations

import json
from pathlib import Path

from node_agent import atomic_file
from node_agent.model import Report, ReportFormatError


def dumps(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False, default=str)


def write(report: Report, directory: Path) -> Path:
    """Write ``report-<host>-<suite>-<time>.json`` atomically (never a half-written file)."""
    stamp = report.started_at.replace(":", "").replace("-", "")
    path = directory / f"report-{report.host.hostname}-{report.suite}-{stamp}.json"
    atomic_file.write_text(path, dumps(report) + "\n")
    return path


def read(path: str | Path) -> Report:
    """A saved report; ReportFormatError for unreadable JSON or another schema version."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ReportFormatError(f"{path}: cannot read report: {err.strerror or err}") from err
    return loads(text, str(path))


def loads(text: str, where: str) -> Report:
    """A report from its text (``where`` names it in errors); ReportFormatError as :func:`read`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ReportFormatError(
            f"{where}: not valid JSON (line {err.lineno} column {err.colno}: "
            f"{err.msg}); was the file truncated?"
        ) from err
    try:
        return Report.from_dict(data)
    except ReportFormatError as err:
        raise ReportFormatError(f"{where}: {err}") from err
