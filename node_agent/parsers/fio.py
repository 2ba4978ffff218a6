"""Parse ``fio --output-format=json`` (fio 3.x), as fio prints it or as it was saved.

fio's JSON has a top-level ``jobs`` list; every job has ``read``, ``write`` and ``trim``
sections with ``bw_bytes`` (bytes/s, averaged over the job's runtime), ``iops`` and
``io_bytes``. Warnings and errors fio prints before the JSON document (``fio: pid=..., err=...``
lines) are skipped and kept with the jobs that report an error; a report in another format
after the document (``--output-format=json,normal``) is ignored.

fio derives its rates from its counts (``stat.c`` ``add_ddir_status_json``)::

    bw_bytes = 1000 * io_bytes / runtime_ms        (integer division)
    bw       = bw_bytes / 1024                     (KiB/s)

so a direction whose ``bw_bytes`` does not follow from its ``io_bytes`` and ``runtime`` was
edited or damaged and is refused, as is a read-only job (``rw=read``/``randread``) that reports
bytes written, or a write-only job without ``verify`` that reports bytes read: fio does neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from node_agent.parsers import ParseError, json_document

_ERROR_LINE = re.compile(r"^fio: |verify failed")
READ_ONLY = frozenset({"read", "randread"})
WRITE_ONLY = frozenset({"write", "randwrite"})


@dataclass(frozen=True)
class FioJob:
    """One fio job's figures. Bandwidth in bytes/s as fio reports it (``bw_bytes``)."""

    name: str
    error: int
    read_bw_bytes: float
    write_bw_bytes: float
    read_iops: float
    write_iops: float
    read_io_bytes: int
    write_io_bytes: int
    runtime_ms: int
    #: the ``fio: ... err=`` lines printed around the JSON, for a job whose ``error`` is set
    error_lines: tuple[str, ...] = ()

    @property
    def read_bw_mbps(self) -> float:
        """Read bandwidth in MB/s (1 MB = 1e6 bytes)."""
        return self.read_bw_bytes / 1e6

    @property
    def write_bw_mbps(self) -> float:
        """Write bandwidth in MB/s (1 MB = 1e6 bytes)."""
        return self.write_bw_bytes / 1e6


def error_lines(text: str) -> list[str]:
    """fio's own error lines (``fio: pid=..., err=84/...``, ``verify failed at ...``)."""
    return [line.strip() for line in text.splitlines() if _ERROR_LINE.search(line)]


def parse_fio_json(text: str) -> dict[str, FioJob]:
    """Jobs by name from fio's JSON output.

    >>> jobs = parse_fio_json(open("tests/data/fio/seq_rand_direct.json").read())
    >>> round(jobs["seqread"].read_bw_mbps) > 0
    True

    Raises :class:`ParseError` for empty, truncated or non-JSON output (naming fio's own error
    lines when that is all it printed), and for figures fio cannot have printed.
    """
    errors = error_lines(text)
    if "{" not in text and errors:
        shown = "; ".join(errors[:3]) + (
            f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        )
        raise ParseError(f"fio printed errors and no JSON report: {shown}")
    doc = json_document(text, "fio", "--output-format=json output", preview=120)
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise ParseError("fio JSON has no 'jobs' list")
    global_options = (
        doc.get("global options") if isinstance(doc.get("global options"), dict) else {}
    )
    out: dict[str, FioJob] = {}
    for job in jobs:
        if not isinstance(job, dict):
            raise ParseError(f"fio JSON: a job is a {type(job).__name__}, expected an object")
        name = str(job.get("jobname"))
        if "mixed" in job and "read" not in job:
            raise ParseError(
                f"fio job {name!r} was run with unified_rw_reporting: it reports "
                "one 'mixed' figure, not read and write apart"
            )
        try:
            read, write = job["read"], job["write"]
            for direction, section in (("read", read), ("write", write)):
                _check_rates(name, direction, section)
            _check_directions(name, job, global_options, read, write)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ParseError):
                raise
            raise ParseError(f"fio job {name!r} lacks or mistypes field {err}") from err
        try:
            error = int(job.get("error", 0))
            out[name] = FioJob(
                name=name,
                error=error,
                read_bw_bytes=float(read["bw_bytes"]),
                write_bw_bytes=float(write["bw_bytes"]),
                read_iops=float(read["iops"]),
                write_iops=float(write["iops"]),
                read_io_bytes=int(read.get("io_bytes", 0)),
                write_io_bytes=int(write.get("io_bytes", 0)),
                runtime_ms=int(max(read.get("runtime", 0), write.get("runtime", 0))),
                error_lines=tuple(errors) if error else (),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ParseError(f"fio job {name!r} lacks or mistypes field {err}") from err
    return out


def _check_rates(job: str, direction: str, section: dict[str, Any]) -> None:
    """bw_bytes must follow from io_bytes and runtime as fio computes it."""
    io_bytes, runtime = int(section.get("io_bytes", 0)), int(section.get("runtime", 0))
    bw_bytes = int(section["bw_bytes"])
    expected = (1000 * io_bytes) // runtime if runtime > 0 else 0
    if abs(bw_bytes - expected) > 1:
        raise ParseError(
            f"fio job {job!r} {direction}: bw_bytes {bw_bytes} B/s, but io_bytes {io_bytes} "
            f"over runtime {runtime} ms is {expected} B/s (fio prints one computed from the "
            "other): the report was edited or damaged"
        )
    kib = section.get("bw")
    if kib is not None and abs(int(kib) - bw_bytes // 1024) > 1:
        raise ParseError(
            f"fio job {job!r} {direction}: bw {kib} KiB/s disagrees with bw_bytes "
            f"{bw_bytes} B/s: the report was edited or damaged"
        )


def _check_directions(
    job: str,
    doc: dict[str, Any],
    global_options: dict[str, Any],
    read: dict[str, Any],
    write: dict[str, Any],
) -> None:
    options = dict(global_options)
    if isinstance(doc.get("job options"), dict):
        options.update(doc["job options"])
    rw = str(options.get("rw", options.get("readwrite", ""))).split(":")[0]
    if rw in READ_ONLY and int(write.get("io_bytes", 0)) > 0:
        raise ParseError(
            f"fio job {job!r} is rw={rw} but reports {write['io_bytes']} bytes "
            "written; a read job writes nothing: the report was edited"
        )
    verifies = any(k.startswith("verify") or k == "do_verify" for k in options)
    if rw in WRITE_ONLY and not verifies and int(read.get("io_bytes", 0)) > 0:
        raise ParseError(
            f"fio job {job!r} is rw={rw} without verify but reports "
            f"{read['io_bytes']} bytes read: the report was edited"
        )
