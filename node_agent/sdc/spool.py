"""SDC verdicts and their spool: what a training job's probe hands to the daemon.

Torch-free on purpose: the daemon and ``sdc_spool`` read verdicts without importing torch (it
would cost the daemon hundreds of MB); ``node_agent.sdc.probes`` re-exports everything here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("node_agent.sdc.probes")

SPOOL_SCHEMA = "node-agent.sdc-verdict/1"


@dataclasses.dataclass
class Verdict:
    """The outcome of one probe on one device.

    ``status``: ``pass``; ``transient`` (one mismatch that the re-run did not repeat: WARN,
    kept as evidence); ``confirmed`` (the re-run repeated it: FAULT); ``error`` (the probe
    itself failed to run, with the reason in ``detail``).  ``shape`` is (M, K, N);
    ``duration_s`` is the probe's own time in seconds (GPU time from CUDA events on CUDA);
    ``timestamp`` is Unix time in seconds.  ``evidence`` holds the first mismatches as
    ``[index, got, expected]``, digests, and the like.
    """

    probe: str
    device: str
    shape: tuple[int, ...]
    dtype: str
    status: str
    mismatched_elements: int
    detail: str
    duration_s: float
    timestamp: float
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)

    STATUSES = ("pass", "transient", "confirmed", "error")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return {"schema": SPOOL_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Inverse of ``to_dict``; raises ``ValueError`` naming the first bad field."""
        if d.get("schema") != SPOOL_SCHEMA:
            raise ValueError(f"schema is {d.get('schema')!r}, expected {SPOOL_SCHEMA!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n != "evidence" and n not in d]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        if d["status"] not in cls.STATUSES:
            raise ValueError(f"status is {d['status']!r}, expected one of {cls.STATUSES}")
        kw = {n: d[n] for n in names if n in d}
        kw["shape"] = tuple(int(x) for x in d["shape"])
        kw["mismatched_elements"] = int(d["mismatched_elements"])
        kw["duration_s"] = float(d["duration_s"])
        kw["timestamp"] = float(d["timestamp"])
        return cls(**kw)


def default_spool_dir() -> Path:
    """``$NODE_AGENT_STATE_DIR/spool/sdc`` (default state dir ``/var/lib/node-agent``)."""
    return Path(os.environ.get("NODE_AGENT_STATE_DIR") or "/var/lib/node-agent") / "spool" / "sdc"


_spool_seq = itertools.count()


def write_verdict(spool_dir: str | os.PathLike[str], verdict: Verdict) -> Path:
    """Write one verdict atomically: temp file in the same dir, fsync, ``os.replace``.

    The temp name starts with ``.`` and ends in ``.tmp``; readers take only ``*.json``, so a
    half-written file is never read.  Returns the final path.
    """
    d = Path(spool_dir)
    d.mkdir(parents=True, exist_ok=True)
    name = f"sdc-{time.time_ns()}-{os.getpid()}-{next(_spool_seq)}-{verdict.status}.json"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(verdict.to_dict(), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable; not all fs allow it
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return d / name


def read_spool(
    spool_dir: str | os.PathLike[str], errors: list[tuple[Path, str]] | None = None,
) -> list[Verdict]:
    """Every verdict in ``spool_dir`` (only ``*.json`` files), oldest name first.

    A file that is not a valid verdict (truncated, corrupt, wrong schema) is skipped, logged
    as a warning, and appended to ``errors`` as ``(path, reason)`` when a list is given.
    A missing directory is an empty spool.
    """
    return [v for _, v in read_spool_files(spool_dir, errors)]


def read_spool_files(
    spool_dir: str | os.PathLike[str], errors: list[tuple[Path, str]] | None = None,
    skip: Iterable[str] = (),
) -> list[tuple[Path, Verdict]]:
    """Like ``read_spool`` but with each verdict's file, for a reader that keeps a cursor;
    files whose name is in ``skip`` (already ingested) are not opened."""
    d = Path(spool_dir)
    if not d.is_dir():
        return []
    done = set(skip)
    out: list[tuple[Path, Verdict]] = []
    for p in sorted(d.glob("*.json")):
        if p.name.startswith(".") or p.name in done:
            continue
        try:
            out.append((p, Verdict.from_dict(json.loads(p.read_text(encoding="utf-8")))))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            reason = f"{type(err).__name__}: {err}"
            log.warning("sdc spool: skipping %s, not a valid verdict (%s)", p, reason)
            if errors is not None:
                errors.append((p, reason))
    return out
