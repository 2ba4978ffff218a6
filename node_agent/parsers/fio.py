"""Parse ``fio --output-format=json`` (fio 3.x).

fio's JSON has a top-level ``jobs`` list; every job has ``read``, ``write`` and ``trim``
sections with ``bw_bytes`` (bytes/s, averaged over the job's runtime), ``iops`` and
``io_bytes``. Warnings fio prints before the JSON document (``fio: ...`` lines) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.parsers import ParseError, json_document


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

    @property
    def read_bw_mbps(self) -> float:
        """Read bandwidth in MB/s (1 MB = 1e6 bytes)."""
        return self.read_bw_bytes / 1e6

    @property
    def write_bw_mbps(self) -> float:
        """Write bandwidth in MB/s (1 MB = 1e6 bytes)."""
        return self.write_bw_bytes / 1e6


def parse_fio_json(text: str) -> dict[str, FioJob]:
    """Jobs by name from fio's JSON output.

    >>> jobs = parse_fio_json(open("tests/data/fio/seq_rand_direct.json").read())
    >>> round(jobs["seqread"].read_bw_mbps) > 0
    True

    Raises :class:`ParseError` for empty, truncated or non-JSON output.
    """
    doc = json_document(text, "fio", "--output-format=json output", preview=120)
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise ParseError("fio JSON has no 'jobs' list")
    out: dict[str, FioJob] = {}
    for job in jobs:
        try:
            read, write = job["read"], job["write"]
            out[str(job["jobname"])] = FioJob(
                name=str(job["jobname"]), error=int(job.get("error", 0)),
                read_bw_bytes=float(read["bw_bytes"]), write_bw_bytes=float(write["bw_bytes"]),
                read_iops=float(read["iops"]), write_iops=float(write["iops"]),
                read_io_bytes=int(read.get("io_bytes", 0)),
                write_io_bytes=int(write.get("io_bytes", 0)),
                runtime_ms=int(max(read.get("runtime", 0), write.get("runtime", 0))))
        except (KeyError, TypeError, ValueError) as err:
            raise ParseError(f"fio job {job.get('jobname')!r} lacks field {err}") from err
    return out
