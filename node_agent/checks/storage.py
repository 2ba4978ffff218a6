"""Check ``storage``: fio bandwidth and IOPS on each configured path (``storage.paths``).

Three fio jobs run in sequence (``stonewall``) on one file per path, inside a private directory
the check makes there (``mkdtemp``, 0700) and removes afterwards: sequential write and read
with 1 MiB blocks, then random 4 KiB reads. ``--direct=1`` bypasses the page cache where the
filesystem supports O_DIRECT (tested by opening a file with it); elsewhere (tmpfs on older
kernels, some FUSE/overlay mounts) fio runs buffered and the evidence says so, since buffered
figures measure memory as much as the disk. Paths default to a temporary directory.

Params (suite, how to run): ``size`` (fio size, default ``64M``), ``runtime_s`` (per job,
default 3), ``ioengine`` (default ``libaio``), ``iodepth`` (default 16). Minima (how to judge)
are ``graders/storage.yaml``'s ``read_bw_mbps_min``, ``write_bw_mbps_min`` (MB/s = 10^6 B/s)
and ``randread_iops_min`` (none shipped); a figure below its minimum fails. A suite that still
carries a minimum is refused when it loads, naming the file. Results per path, target
``disk:<path>``: ``read_bw_mbps``, ``write_bw_mbps``, ``randread_iops``, computed from fio's
``bw_bytes`` and ``iops``.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import load_topic, refuse_thresholds
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.fio import FioJob, parse_fio_json

FIO_MISSING = "fio not installed (Debian package `fio`: apt-get install fio)"

#: metric -> (fio job, unit, the key of graders/storage.yaml holding its minimum, words)
METRICS = {
    "write_bw_mbps": ("seqwrite", "MB/s", "write_bw_mbps_min", "sequential 1 MiB write"),
    "read_bw_mbps": ("seqread", "MB/s", "read_bw_mbps_min", "sequential 1 MiB read"),
    "randread_iops": ("randread", "IOPS", "randread_iops_min", "random 4 KiB read"),
}
#: the topic file of the minima (checking/thresholds.py), and its keys
TOPIC = "storage"
MINIMA = tuple(key for _, _, key, _ in METRICS.values())
_MINIMUM = {"type": ["number", "null"], "minimum": 0}
STORAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {key: _MINIMUM for key in MINIMA},
}


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``: how fio runs), validated by :meth:`parse`;
    the minima are ``graders/storage.yaml``'s (``METRICS``)."""

    size: str = "64M"  # fio's --size: bytes, or with a K/M/G suffix
    runtime_s: float = 3.0
    ioengine: str = "libaio"
    iodepth: int = 16
    fio_timeout_s: float | None = None  # None: three timed jobs, 3 * runtime_s + 60

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected (for a minimum: its home)."""
        refuse_thresholds("storage", raw, MINIMA, f"graders/{TOPIC}.yaml")
        r = Reader("storage", raw, cls)
        size = r.value("size")
        whole = isinstance(size, int) and not isinstance(size, bool) and size > 0
        return cls(
            size=str(size) if whole else r.string("size"),
            runtime_s=r.positive("runtime_s"),
            ioengine=r.string("ioengine"),
            iodepth=r.integer("iodepth", 1),
            fio_timeout_s=r.optional_number("fio_timeout_s", above=0),
        )


def supports_o_direct(directory: Path) -> bool:
    """Whether a file in ``directory`` can be opened with O_DIRECT (EINVAL means no)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd, probe = tempfile.mkstemp(prefix=".node-agent-odirect-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDONLY | flag)
        os.close(fd)
        return True
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.unlink(probe)


def fio_argv(
    fio: str,
    filename: Path,
    size: str,
    runtime_s: float,
    direct: bool,
    ioengine: str = "libaio",
    iodepth: int = 16,
) -> list[str]:
    """fio's command line: global options, then the jobs seqwrite, seqread, randread.

    Writing first lays the file out, so the reads read real data.
    """
    return [
        fio,
        "--output-format=json",
        f"--filename={filename}",
        f"--size={size}",
        f"--runtime={runtime_s:g}",
        "--time_based",
        f"--direct={int(direct)}",
        f"--ioengine={ioengine}",
        f"--iodepth={iodepth}",
        "--name=seqwrite",
        "--rw=write",
        "--bs=1M",
        "--end_fsync=1",
        "--name=seqread",
        "--stonewall",
        "--rw=read",
        "--bs=1M",
        "--name=randread",
        "--stonewall",
        "--rw=randread",
        "--bs=4k",
    ]


def figures(jobs: dict[str, FioJob]) -> dict[str, float]:
    """MB/s (10^6 B/s) and IOPS from the three jobs, by metric name."""
    return {
        "write_bw_mbps": jobs["seqwrite"].write_bw_mbps,
        "read_bw_mbps": jobs["seqread"].read_bw_mbps,
        "randread_iops": jobs["randread"].read_iops,
    }


def run(ctx: CheckContext) -> list[Result]:
    fio = proc.which("fio")
    if fio is None:
        return [ctx.skip(FIO_MISSING)]
    paths = list(ctx.config.storage.paths)
    if paths:
        return [r for path in paths for r in _run_path(ctx, fio, Path(path))]
    with tempfile.TemporaryDirectory(prefix="node-agent-storage-") as tmp:
        return _run_path(ctx, fio, Path(tmp), label="(temporary directory)")


def _run_path(ctx: CheckContext, fio: str, path: Path, label: str = "") -> list[Result]:
    target = f"disk:{path}"
    if not path.is_dir():
        return [
            ctx.result(
                target,
                "fio",
                Status.ERROR,
                f"storage path {path} is not a directory (config storage.paths)",
            )
        ]
    # scratch paths are often writable by every user: fio's file goes into a directory of
    # our own (mkdtemp: a fresh random name, mode 0700), never at a name a user could guess
    # and plant a symlink on (with fs.protected_symlinks=0 or a non-sticky directory, root's
    # fio would follow it and fill whatever file it points to)
    try:
        made = tempfile.mkdtemp(prefix=".node-agent-fio-", dir=path)
        fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        return _path_error(ctx, target, "make a directory", path, err)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return [
                ctx.result(
                    target,
                    "fio",
                    Status.ERROR,
                    f"the directory made for fio in {path} was replaced before it "
                    "was opened (someone renamed it): not used",
                )
            ]
        # fio reaches the directory through our open descriptor, never by its name: in a
        # directory others may write to, the name can be renamed away and replaced
        held = Path(f"/proc/{os.getpid()}/fd/{fd}")
        return _run_fio(
            ctx, fio, path, held if held.is_dir() else Path(made), target, label, scratch_dir=made
        )
    finally:
        _remove_private(made, fd)


def _path_error(
    ctx: CheckContext, target: str, doing: str, path: Path, err: OSError
) -> list[Result]:
    """The error when the storage path itself fails us: fix it in the config."""
    return [
        ctx.result(
            target, "fio", Status.ERROR, f"cannot {doing} in {path}: {err} (config storage.paths)"
        )
    ]


def _remove_tree_at(name: str, dir_fd: int) -> None:
    """Remove the directory ``name`` under ``dir_fd`` and all it holds, never following a
    link (``shutil.rmtree``'s ``dir_fd`` needs Python 3.11; this runs on 3.10 too)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return
    try:
        _empty_dir(fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass


def _empty_dir(fd: int) -> None:
    """Remove everything in the directory open as ``fd``, by name relative to it (a
    subdirectory through :func:`_remove_tree_at`); what cannot be removed stays."""
    for name in os.listdir(fd):
        try:
            os.unlink(name, dir_fd=fd)
        except IsADirectoryError:
            _remove_tree_at(name, fd)
        except OSError:
            pass


def _remove_private(made: str, fd: int) -> None:
    """Empty the directory we made (through its descriptor), then remove it by name only if
    the name is still that directory."""
    try:
        _empty_dir(fd)
        st, named = os.fstat(fd), os.lstat(made)
        if (st.st_dev, st.st_ino) == (named.st_dev, named.st_ino):
            os.rmdir(made)
    except OSError:
        pass
    finally:
        os.close(fd)


def _run_fio(
    ctx: CheckContext,
    fio: str,
    path: Path,
    private: Path,
    target: str,
    label: str,
    scratch_dir: str,
) -> list[Result]:
    """fio in ``private`` (our own 0700 directory inside the storage path ``path``, reached
    through its descriptor; ``scratch_dir`` is its name, for the evidence)."""
    p = ctx.typed_params(Params)
    try:
        direct = supports_o_direct(private)
    except OSError as err:
        return _path_error(ctx, target, "write a file", path, err)
    argv = fio_argv(fio, private / "fio.dat", p.size, p.runtime_s, direct, p.ioengine, p.iodepth)
    evidence = _fio_evidence(argv, direct, label, scratch_dir)
    # three timed jobs plus layout and fsync; the runner's timeout still bounds the check
    timeout_s = p.fio_timeout_s or 3 * p.runtime_s + 60
    res = proc.run(argv, timeout_s, cwd=proc.CHILD_CWD)
    if not res.ok:
        return [
            ctx.result(
                target,
                "fio",
                Status.ERROR,
                f"fio failed on {path}: {res.describe_failure()}",
                returncode=res.returncode,
                stderr_tail=_tail(res.stderr),
                **evidence,
            )
        ]
    try:
        jobs = parse_fio_json(res.stdout)
        values = figures(jobs)
    except (ParseError, KeyError) as err:
        return [
            ctx.result(
                target,
                "fio",
                Status.ERROR,
                f"cannot read fio's JSON for {path}: {err}",
                stderr_tail=_tail(res.stderr),
                stdout_tail=res.stdout[-500:],
                **evidence,
            )
        ]
    failed_jobs = {name: job.error for name, job in jobs.items() if job.error}
    if failed_jobs:
        return [
            ctx.result(
                target,
                "fio",
                Status.ERROR,
                f"fio jobs reported errors on {path}: {failed_jobs} (errno values)",
                stderr_tail=_tail(res.stderr),
                **evidence,
            )
        ]
    out = _figure_results(ctx, path, target, jobs, values, direct, evidence)
    for r in out:
        r.duration_s = res.duration_s
    return out


def _fio_evidence(argv: list[str], direct: bool, label: str, scratch_dir: str) -> dict[str, Any]:
    """What every fio result carries: how fio ran, and where."""
    return {
        "direct": direct,
        "argv": argv,
        "path_note": label,
        "scratch_dir": scratch_dir,
        "io_mode": "O_DIRECT"
        if direct
        else "buffered: the filesystem refuses O_DIRECT, figures include the page cache",
    }


def _figure_results(
    ctx: CheckContext,
    path: Path,
    target: str,
    jobs: dict[str, FioJob],
    values: dict[str, float],
    direct: bool,
    evidence: dict[str, Any],
) -> list[Result]:
    """One result per fio figure, held to its minimum (graders/storage.yaml) where one is set."""
    minima = load_topic(ctx.config, TOPIC, STORAGE_SCHEMA, "storage grading file")
    out = []
    for metric, (job, unit, min_key, words) in METRICS.items():
        value = values[metric]
        minimum: float | None = minima[min_key]
        low = minimum is not None and value < minimum
        detail = (
            f"{path}: {words} {value:.1f} {unit}"
            + (f", below the minimum {minimum:g} {unit} ({TOPIC}.yaml {min_key})" if low else "")
            + ("" if direct else " (buffered I/O)")
        )
        out.append(
            ctx.result(
                target,
                metric,
                Status.FAIL if low else Status.PASS,
                detail,
                value=round(value, 2),
                unit=unit,
                minimum=minimum,
                job=job,
                runtime_ms=jobs[job].runtime_ms,
                **evidence,
            )
        )
    return out


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
