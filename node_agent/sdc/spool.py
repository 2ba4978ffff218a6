"""SDC verdicts and their spool: what a training job's probe hands to the daemon.

Torch-free on purpose: the daemon and ``sdc_spool`` read verdicts without importing torch (it
would cost the daemon hundreds of MB); ``node_agent.sdc.probes`` re-exports everything here.

A verdict in the spool is a training user's *report*, not the agent's verdict: the reader
(:func:`read_verdicts`) reads it the safe way (``node_agent.heartbeat.read_spool_json``: no
links followed, never blocking, size- and depth-capped) and hands over its owner's uid, and
``checks/sdc_spool.py`` believes it only when that uid runs a compute process on the GPU it
names, and then only as a reason to run the agent's own probe (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from node_agent import atomic_file
from node_agent.heartbeat import (
    CONTROL_CHARACTERS,
    SPOOL_MAX_FILES,
    SPOOL_MAX_LISTED,
    read_spool_json,
    spool_root,
)

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
    #: longest text field a spooled verdict may carry (the writer's details are < 300)
    TEXT_MAX = 4096

    def headline(self) -> dict[str, Any]:
        """What a result that names this verdict as its headline carries of it: the probe,
        its shape and dtype, and how many elements were wrong."""
        return {
            "probe": self.probe,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "mismatched_elements": self.mismatched_elements,
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return {"schema": SPOOL_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Inverse of ``to_dict``; raises ``ValueError`` naming the first bad field.

        Strict, because the dict may come from a file another user wrote: every field must
        have its type (a string where a number belongs is refused, not converted; numbers
        must be finite), text is bounded, names (probe, device, dtype) hold no control
        character, ``shape`` holds 1 to 4 non-negative integers. (A file's lone surrogates and
        NULs are refused before, by ``heartbeat.parse_spool_json``.)"""
        if not isinstance(d, Mapping):
            raise ValueError(f"not a JSON object but {type(d).__name__}")
        if d.get("schema") != SPOOL_SCHEMA:
            raise ValueError(f"schema is {str(d.get('schema'))[:60]!r}, expected {SPOOL_SCHEMA!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n != "evidence" and n not in d]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        if d["status"] not in cls.STATUSES:
            raise ValueError(f"status is {str(d['status'])[:40]!r}, expected one of {cls.STATUSES}")
        for key in ("probe", "device", "dtype", "detail"):
            if not isinstance(d[key], str) or len(d[key]) > cls.TEXT_MAX:
                raise ValueError(
                    f"field {key!r} is not a string of at most {cls.TEXT_MAX} characters"
                )
        for key in ("probe", "device", "dtype"):  # names: no control characters (detail is
            bad = CONTROL_CHARACTERS.search(d[key])  # prose, escaped wherever it is shown)
            if bad:
                raise ValueError(
                    f"field {key!r} holds the control character "
                    f"U+{ord(bad.group()):04X} ({d[key][:40]!r}); a name never does"
                )
        shape = d["shape"]
        if not (
            isinstance(shape, (list, tuple))
            and 1 <= len(shape) <= 4
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
        ):
            raise ValueError(
                f"field 'shape' is {str(shape)[:60]}, expected 1 to 4 non-negative integers"
            )
        count = d["mismatched_elements"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(
                f"field 'mismatched_elements' is {str(count)[:40]!r}, expected a "
                "non-negative integer"
            )
        for key in ("duration_s", "timestamp"):
            x = d[key]
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(f"field {key!r} is {str(x)[:40]!r}, expected a finite number")
        evidence = d.get("evidence", {})
        if not isinstance(evidence, dict):
            raise ValueError(f"field 'evidence' is {type(evidence).__name__}, expected an object")
        kw = {n: d[n] for n in names if n in d}
        kw["shape"] = tuple(shape)
        kw["duration_s"] = float(d["duration_s"])
        kw["timestamp"] = float(d["timestamp"])
        kw["evidence"] = dict(evidence)
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class SpooledVerdict:
    """A verdict as found in the spool: the file, the verdict, and who wrote it (the file's
    owner, from ``fstat`` of the open file) and when (its mtime, Unix seconds)."""

    path: Path
    verdict: Verdict
    uid: int
    mtime: float


def default_spool_dir() -> Path:
    """``$NODE_AGENT_SPOOL_DIR/sdc`` (default ``/var/spool/node-agent/sdc``)."""
    return spool_root() / "sdc"


_spool_seq = itertools.count()


def write_verdict(spool_dir: str | os.PathLike[str], verdict: Verdict) -> Path:
    """Write one verdict atomically (:func:`node_agent.atomic_file.write_text`, the directory
    synced too).

    The temp name starts with ``.`` and ends in ``.tmp``; readers take only ``*.json``, so a
    half-written file is never read.  Returns the final path.
    """
    d = Path(spool_dir)
    d.mkdir(parents=True, exist_ok=True)
    name = f"sdc-{time.time_ns()}-{os.getpid()}-{next(_spool_seq)}-{verdict.status}.json"
    atomic_file.write_text(d / name, json.dumps(verdict.to_dict(), sort_keys=True), sync_dir=True)
    return d / name


def spool_names(spool_dir: str | os.PathLike[str], limit: int = SPOOL_MAX_LISTED) -> set[str]:
    """The ``*.json`` names in ``spool_dir`` (at most ``limit``; temp files left out), without
    opening any file or following a symlinked directory; a missing directory has none."""
    try:
        dir_fd = os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return set()
    try:
        with os.scandir(dir_fd) as it:
            return set(
                itertools.islice(
                    (e.name for e in it if e.name.endswith(".json") and not e.name.startswith(".")),
                    limit,
                )
            )
    finally:
        os.close(dir_fd)


def read_spool(
    spool_dir: str | os.PathLike[str],
    errors: list[tuple[Path, str]] | None = None,
) -> list[Verdict]:
    """Every verdict in ``spool_dir`` (only ``*.json`` files), oldest name first.

    A file that is not a valid verdict (truncated, corrupt, wrong schema, a link, a FIFO, too
    big) is skipped, logged as a warning, and appended to ``errors`` as ``(path, reason)``
    when a list is given. A missing directory is an empty spool.
    """
    return [v for _, v in read_spool_files(spool_dir, errors)]


def read_spool_files(
    spool_dir: str | os.PathLike[str],
    errors: list[tuple[Path, str]] | None = None,
    skip: Iterable[str] = (),
) -> list[tuple[Path, Verdict]]:
    """Like ``read_spool`` but with each verdict's file, for a reader that keeps a cursor;
    files whose name is in ``skip`` (already ingested) are not opened."""
    return [(v.path, v.verdict) for v in read_verdicts(spool_dir, errors, skip)]


def read_verdicts(
    spool_dir: str | os.PathLike[str],
    errors: list[tuple[Path, str]] | None = None,
    skip: Iterable[str] = (),
    max_files: int = SPOOL_MAX_FILES,
) -> list[SpooledVerdict]:
    """The verdicts in ``spool_dir`` with their writers' uids (see :class:`SpooledVerdict`),
    oldest name first; at most ``max_files`` files are opened (the rest: a later call).
    Bad files go to ``errors`` as in :func:`read_spool`; nothing here blocks or raises for
    a file."""
    errs: list[tuple[Path, str]] = []
    out: list[SpooledVerdict] = []
    for f in read_spool_json(spool_dir, errs, skip=frozenset(skip), max_files=max_files):
        try:
            out.append(SpooledVerdict(f.path, Verdict.from_dict(f.data), f.uid, f.mtime))
        except (ValueError, TypeError) as err:
            errs.append((f.path, f"{type(err).__name__}: {err} (written by uid {f.uid})"))
    for path, reason in errs:
        log.warning("sdc spool: skipping %r, not a valid verdict (%s)", str(path), reason)
    if errors is not None:
        errors.extend(errs)
    return out
