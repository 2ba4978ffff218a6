"""Reading many nodes' reports for the fleet: each parsed once, only its figures kept.

Reading is the cost at fleet scale (10,000 reports), so each report is parsed once, only its
numeric figures are kept (in flat arrays), its grade, its NVLink domain and the per-process
results of ``training_progress``, and files are read by a process pool when there are many. A
file that cannot be read — truncated, not JSON, another schema version — is listed as
unreadable with the reason. A file is opened without following a symlink and must be a regular
file; with ``owners`` (``node-agent fleet`` as root), one owned by any other uid is *skipped*,
listed with the reason: a forged newer report would replace a node's real one.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from node_agent.fleet.domains import TrayFacts, tray_facts
from node_agent.model import REPORT_SCHEMA, ReportFormatError
from node_agent.report import json_report
from node_agent.yamlfile import ConfigError

#: above this many files, read them in a process pool (below, the pool costs more than it saves)
PARALLEL_MIN_FILES = 256

# -- reading ---------------------------------------------------------------------------------

#: the check whose per-process results carry a training job's ranks (docs/training_hangs.md);
#: its evidence is the one kept when a report is read
TRAINING_CHECK = "training_progress"
#: its per-process results of ranks that step (their step time is compared) and of hung ones
STEPPING = ("training_progress", "training_straggler")
HUNG = "training_hang"


class TrainingRow(NamedTuple):
    """One training process in a node's report: what ``training_progress`` said about it."""

    metric: str  # training_progress | training_straggler | training_hang
    target: str
    job: str
    rank: int | None
    pid: int | None
    step_time_s: float | None  # recent mean step time from its heartbeats
    likely_origin: bool | None  # for a hung rank: the stack says it stopped first


@dataclass
class NodeFigures:
    """The numeric figures of one report: rows of (check, target, metric, unit, value), and
    its training processes."""

    hostname: str
    sku: str
    finished_at: str
    path: str
    rows: list[tuple[str, str, str, str, float]]
    training: list[TrainingRow] = field(default_factory=list)
    level: str = ""  # the report's grade
    tray: TrayFacts | None = None  # its NVLink domain and bad GPUs (None: not in a domain)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _training_row(r: dict[str, Any]) -> TrainingRow | None:
    """A per-process ``training_progress`` result as a row; None for anything else (discovery
    problems, skips) or one without a job."""
    if r["metric"] not in (*STEPPING, HUNG) or r["status"] in ("skip", "error"):
        return None
    ev = r.get("evidence") or {}
    if not isinstance(ev, dict) or ev.get("job") is None:
        return None
    step = ev.get("step_time_s")
    origin = ev.get("likely_origin")
    return TrainingRow(
        sys.intern(str(r["metric"])),
        str(r["target"]),
        str(ev["job"]),
        _int_or_none(ev.get("rank")),
        _int_or_none(ev.get("pid")),
        float(step) if _is_number(step) and step > 0 else None,
        origin if isinstance(origin, bool) else None,
    )


class ReportSkipped(Exception):
    """A report file fleet does not believe (not a regular file, a symlink, another owner)."""


def open_report(path: str | Path, owners: frozenset[int] | None = None) -> str:
    """The text of a report file, opened without following a symlink and without blocking on
    a FIFO; ReportSkipped when it is not a regular file or, with ``owners``, when its owner's
    uid is not among them (a report another user wrote is a forgery until proven otherwise:
    a newer one for a node replaces that node's real report). OSError when it cannot be read."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ReportSkipped("a symbolic link (fleet reads report files themselves)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ReportSkipped("not a regular file")
        if owners is not None and st.st_uid not in owners:
            raise ReportSkipped(
                f"owned by uid {st.st_uid}, not one of fleet.report_owner_uids {sorted(owners)}"
            )
        return f.read().decode("utf-8")


def read_figures(path: str | Path, owners: frozenset[int] | None = None) -> NodeFigures:
    """The numeric figures of one saved report; ReportFormatError when it cannot be read,
    ReportSkipped when it is not believed (:func:`open_report`).

    Results that are skipped or errored carry no measurement and are left out. The per-process
    results of ``training_progress`` are kept, with the job, rank, step time and likely origin
    from their evidence, as :class:`TrainingRow`. A file the
    fast path cannot read is handed to :func:`node_agent.report.json_report.read`, so the
    reason given for an unreadable file is the same one ``node-agent grade`` gives.
    """
    path = Path(path)
    text = ""
    try:
        text = open_report(path, owners)
        try:
            data = json.loads(_without_evidence(text, keep=TRAINING_CHECK))
        except ValueError:
            data = json.loads(text)
        if data.get("schema") != REPORT_SCHEMA:
            raise ValueError("schema")
        host = data["host"]
        hostname = host["hostname"]
        if not isinstance(hostname, str):
            raise TypeError("hostname")
        sku = data.get("sku") or "unknown-sku"
        rows = []
        training = []
        intern = sys.intern
        for r in data["results"]:
            if r["check"] == TRAINING_CHECK:
                row = _training_row(r)
                if row is not None:
                    training.append(row)
            value = r.get("value")
            if r["status"] in ("skip", "error") or not _is_number(value):
                continue
            rows.append(
                (
                    intern(str(r["check"])),
                    intern(str(r["target"])),
                    intern(str(r["metric"])),
                    intern(str(r.get("unit", ""))),
                    float(value),
                )
            )
        return NodeFigures(
            hostname=hostname,
            sku=str(sku),
            finished_at=str(data.get("finished_at", "")),
            path=str(path),
            rows=rows,
            training=training,
            level=str((data.get("grade") or {}).get("level", "")),
            tray=tray_facts(data),
        )
    except OSError as err:
        raise ReportFormatError(f"{path}: cannot read report: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        json_report.loads(text, str(path))  # raises ReportFormatError with the canonical reason
        raise ReportFormatError(f"{path}: report fields missing or malformed") from None


_EVIDENCE_OPEN = '\n      "evidence": {\n'
_EVIDENCE_CLOSE = "\n      }"


_CHECK_KEY = '\n      "check": '


def _without_evidence(text: str, keep: str | None = None) -> str:
    """The report's text with each result's evidence emptied, when written by our writer.

    Evidence (traces, argv, tool output) is most of a report's bytes and none of its figures,
    and parsing it is most of fleet's time. The writer indents by 2, so a result's keys sit at
    6 spaces and its evidence object closes at the first line that is 6 spaces and ``}``
    (deeper lines are indented more; a newline inside a JSON string is always escaped). Text in
    another layout comes back unchanged; a cut that does not parse is retried whole.

    ``keep``: a check whose results keep their evidence (its ``"check"`` key is the result's
    first, after the previous result's evidence), looked for only when the text names it.
    """
    keep_mark = None
    if keep is not None:
        keep_mark = f"{_CHECK_KEY}{json.dumps(keep)},"
        if keep_mark not in text:
            keep_mark = None
    parts = []
    seg = pos = 0
    while True:
        start = text.find(_EVIDENCE_OPEN, pos)
        if start < 0:
            break
        end = text.find(_EVIDENCE_CLOSE, start + len(_EVIDENCE_OPEN) - 1)
        if end < 0:
            return text
        if keep_mark is not None:
            head = text.rfind(_CHECK_KEY, pos, start)
            if head >= 0 and text.startswith(keep_mark, head):
                pos = end + 1
                continue
        parts.append(text[seg : start + len(_EVIDENCE_OPEN) - 1])
        seg = pos = end + 1
    if not parts:
        return text
    parts.append(text[seg:])
    return "".join(parts)


#: (path, why) of a report that could not be read, or was not believed (``skipped``)
Problem = tuple[str, str, bool]


def _read_chunk(
    paths: Sequence[str], owners: frozenset[int] | None = None
) -> list[NodeFigures | Problem]:
    out: list[NodeFigures | Problem] = []
    for p in paths:
        try:
            out.append(read_figures(p, owners))
        except ReportFormatError as err:
            out.append((p, str(err), False))
        except ReportSkipped as err:
            out.append((p, str(err), True))
    return out


def expand_paths(inputs: Iterable[str | Path]) -> list[Path]:
    """Files as given; a directory stands for its ``*.json`` files (not recursive), sorted.

    ConfigError when an input does not exist (nothing is analysed then).
    """
    paths: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            paths.extend(sorted(q for q in p.glob("*.json") if q.is_file()))
        elif p.exists():
            paths.append(p)
        else:
            raise ConfigError(f"{item}: no such report file or directory")
    return paths


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def read_all(
    paths: Sequence[Path], workers: int | None = None, owners: frozenset[int] | None = None
) -> tuple[list[NodeFigures], list[tuple[str, str]], list[tuple[str, str]]]:
    """(readable reports' figures, [(path, why unreadable)], [(path, why skipped)]) in the
    order of ``paths``; ``owners``: believe only files owned by these uids."""
    names = [str(p) for p in paths]
    workers = _cpu_count() if workers is None else workers
    if workers <= 1 or len(names) < PARALLEL_MIN_FILES:
        items = _read_chunk(names, owners)
    else:
        size = max(64, len(names) // (workers * 8))
        chunks = [names[i : i + size] for i in range(0, len(names), size)]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            items = [
                item
                for chunk in pool.map(_read_chunk, chunks, [owners] * len(chunks))
                for item in chunk
            ]
    good = [i for i in items if isinstance(i, NodeFigures)]
    bad = [(i[0], i[1]) for i in items if not isinstance(i, NodeFigures) and not i[2]]
    skipped = [(i[0], i[1]) for i in items if not isinstance(i, NodeFigures) and i[2]]
    return good, bad, skipped
