"""Progress heartbeats from inside a training loop: what the ``training_progress`` check reads.

Two lines in the training script::

    from node_agent.heartbeat import Heartbeat
    hb = Heartbeat()                # once, after torch.distributed is set up (or anywhere)
    ...
    hb.beat(step)                   # once per training step

Each process writes one small JSON file, ``<spool>/heartbeat/<uid>/<pid>.json`` (its own
uid's directory: in a spool others may write to, no other user can take its file's name; in a
directory only its owner may write, ``<dir>/<pid>.json``), atomically (temp file in the same
directory, then ``os.replace``), at most every ``min_interval_s``
(default 1 s), so a call costs a clock read and a comparison on almost every step (measured in
``bench/bench_hang.py``). The file holds the process's identity (pid, rank, local rank, world
size, job), the last step number, the wall time of that step, and the recent step time (the
mean over the steps since the previous write). ``beat()`` never raises into the training loop:
a failure is logged once and the loop goes on.

Stdlib only and torch-free on purpose: it is imported inside training processes, and the
daemon reads the files without importing anything heavy.

This module also holds the agent's one reader of spool files (:func:`read_spool_json`), used
for heartbeats and SDC verdicts alike: every spool file was written by a training user, so it
is opened without following links and without blocking, must be a regular file with one link,
is size- and depth-capped, holds no lone surrogate or NUL in any string, and carries its
owner's uid to the caller, who believes it only about that uid's own processes (DESIGN.md,
"Trust boundary"; docs/security.md). Heartbeats are read from each uid's own directory, which
counts only when its owner is that uid and nobody else may write to it, each with its own
caps, so a flood in one user's directory cannot hide another's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("node_agent.heartbeat")

SCHEMA = "node-agent.heartbeat/1"

#: Where training jobs write (``$NODE_AGENT_SPOOL_DIR`` overrides it): one sticky, world-writable
#: directory per kind under it (``heartbeat/``, ``sdc/``), apart from the agent's private state
#: directory (docs/security.md).
DEFAULT_SPOOL_ROOT = "/var/spool/node-agent"

# Limits on what the agent reads from a spool. A heartbeat is about 600 bytes and a verdict
# 1-3 KiB (measured on files the writers in this package produce), so 64 KiB is 20x the
# largest honest file; a heartbeat nests 2 deep (its pause) and a verdict 4 (evidence lists of
# mismatches), so 16 levels leave room and stop a 32,000-deep file from reaching the parser.
SPOOL_MAX_BYTES = 64 * 1024
SPOOL_MAX_DEPTH = 16
#: files opened per read of one spool (taken fairly across owners); the rest wait for the next run
SPOOL_MAX_FILES = 1024
#: directory entries looked at per read, so a spool flooded with names costs bounded time
SPOOL_MAX_LISTED = 65536
_TEXT_MAX = 4096  # a string field longer than this is not a heartbeat's
# What no name, id or path in a spool file may hold: C0 controls and DEL, C1 controls,
# zero-width and bidi controls, line/paragraph separators, the BOM (terminal escapes, log
# lines that forge others, text that reads differently than it is).
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def spool_root() -> Path:
    """``$NODE_AGENT_SPOOL_DIR``, else ``/var/spool/node-agent``."""
    return Path(os.environ.get("NODE_AGENT_SPOOL_DIR") or DEFAULT_SPOOL_ROOT)


def default_spool_dir() -> Path:
    """``$NODE_AGENT_SPOOL_DIR/heartbeat`` (default ``/var/spool/node-agent/heartbeat``)."""
    return spool_root() / "heartbeat"


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def identity_from_env(
    env: Mapping[str, str] | None = None, ppid: int | None = None
) -> dict[str, Any]:
    """Rank and job identity of this process, from the launcher's environment.

    ``job`` is the first of ``slurm:$SLURM_JOB_ID``, ``torchelastic:$TORCHELASTIC_RUN_ID``,
    ``pod:$KUBERNETES_POD_NAME`` (or ``$HOSTNAME`` inside a Kubernetes pod, where it is the pod
    name), else ``ppid:<parent pid>`` — the ranks that one launcher (torchrun, mp.spawn) started
    share a parent, which is the best grouping left when nothing names the job.
    """
    env = os.environ if env is None else env
    job, source = None, None
    pod = env.get("KUBERNETES_POD_NAME") or (
        env.get("HOSTNAME") if env.get("KUBERNETES_SERVICE_HOST") else None
    )
    for prefix, value in (
        ("slurm", env.get("SLURM_JOB_ID")),
        ("torchelastic", env.get("TORCHELASTIC_RUN_ID")),
        ("pod", pod),
    ):
        if value:
            job, source = f"{prefix}:{value}", prefix
            break
    if job is None:
        job, source = f"ppid:{os.getppid() if ppid is None else ppid}", "ppid"
    return {
        "rank": _int_or_none(env.get("RANK")),
        "local_rank": _int_or_none(env.get("LOCAL_RANK")),
        "world_size": _int_or_none(env.get("WORLD_SIZE")),
        "job": job,
        "job_source": source,
        "slurm_job_id": env.get("SLURM_JOB_ID") or None,
        "torchelastic_run_id": env.get("TORCHELASTIC_RUN_ID") or None,
        "pod": pod or None,
    }


def process_start_ticks(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """The process's start time in clock ticks since boot (``<proc_root>/<pid>/stat`` field 22),
    or None where it cannot be read. With the pid it identifies a process across pid reuse."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as f:
            data = f.read()
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """Record a training process's progress for the node agent; see the module docstring.

    ``spool_dir``: where to write (default ``default_spool_dir()``). ``rank``/``job`` override
    what the environment says. ``min_interval_s``: the least time between two writes.
    ``log_file``: the job's log, whose silence is one more hang signal (default
    ``$NODE_AGENT_TRAIN_LOG``).
    ``clock`` (monotonic seconds) and ``wall`` (Unix seconds) are injectable for tests.
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        job: str | None = None,
        *,
        min_interval_s: float = 1.0,
        log_file: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.spool_dir = Path(spool_dir) if spool_dir is not None else default_spool_dir()
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._wall = wall
        self._identity = identity_from_env()
        if rank is not None:
            self._identity["rank"] = int(rank)
        if job is not None:
            self._identity["job"], self._identity["job_source"] = str(job), "argument"
        self._pid = os.getpid()
        self._start_ticks = process_start_ticks(self._pid)
        self._started_at = wall()
        self._step = -1  # the last step seen by beat()
        self._step_mono = 0.0  # monotonic time of that step
        self._written_step: int | None = None
        self._written_mono: float | None = None
        self._step_time_s: float | None = None
        self._compute_sum, self._compute_n = 0.0, 0  # compute_s given since the last write
        self._compute_time_s: float | None = None
        self._warned = False
        self._log_file = str(log_file) if log_file else os.environ.get("NODE_AGENT_TRAIN_LOG")
        self._pause: dict[str, Any] | None = None
        self._written_path: Path | None = None
        self._fallback: tuple[int, str] | None = None  # (pid, name) when its uid dir is taken
        self.writes = 0  # files written (for tests and the benchmark)
        self.failures = 0  # writes that failed (logged once)

    @property
    def path(self) -> Path:
        """This process's heartbeat file: the one last written, else where it will go."""
        if self._written_path is not None:
            return self._written_path
        d = self.spool_dir
        with contextlib.suppress(OSError):
            if os.stat(d).st_mode & 0o022:
                d = d / str(os.geteuid())
        return d / f"{os.getpid()}.json"

    def _target(self, pid: int) -> Path:
        """Where to write now (see :func:`writer_dir`); makes the directories it needs."""
        d, own = writer_dir(self.spool_dir)
        if own:
            return d / f"{pid}.json"
        # Its uid's directory is another user's (squatted): a name of its own in the shared
        # directory that nobody can guess and take first; the agent fixes the directory.
        if self._fallback is None or self._fallback[0] != pid:
            self._fallback = (pid, f"{pid}.{secrets.token_hex(8)}.json")
        return d / self._fallback[1]

    def beat(self, step: int | None = None, compute_s: float | None = None) -> None:
        """Record that the loop reached ``step`` (default: the previous step + 1).

        ``compute_s``: optional, this rank's own work in the step (seconds before it entered
        the step's gradient collective). In a synchronous job every rank's *step* time is the
        slowest rank's, because all wait in the all-reduce; only the time before the collective
        shows which rank is slow, so the straggler comparison uses it when every rank gives it.

        Writes the heartbeat file when ``min_interval_s`` passed since the last write; never
        raises (a failure is logged once, counted in ``failures``, and retried at the next
        interval)."""
        try:
            now = self._clock()
            self._step = self._step + 1 if step is None else int(step)
            self._step_mono = now
            if compute_s is not None:
                self._compute_sum += float(compute_s)
                self._compute_n += 1
            if self._written_mono is not None and now - self._written_mono < self.min_interval_s:
                return
            self._write(now)
        except Exception as err:  # noqa: BLE001 - never break the training loop
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "node_agent heartbeat: cannot write %s (%s: %s); training goes on "
                    "without progress heartbeats (make %s writable for this user, or "
                    "pass Heartbeat(spool_dir=...))",
                    self.path,
                    type(err).__name__,
                    err,
                    self.spool_dir,
                )

    def _write(self, now: float) -> None:
        if self._written_mono is not None and self._written_step is not None:
            steps = self._step - self._written_step
            if steps > 0:  # mean step time over the steps since the previous write
                self._step_time_s = (now - self._written_mono) / steps
        if self._compute_n:
            self._compute_time_s = self._compute_sum / self._compute_n
            self._compute_sum, self._compute_n = 0.0, 0
        # the timestamp written is that of the last step, in wall time (another process reads it)
        record = {
            "schema": SCHEMA,
            "pid": os.getpid(),
            "start_ticks": self._start_ticks,
            "hostname": socket.gethostname(),
            **self._identity,
            "step": self._step,
            "step_at": self._wall() - (now - self._step_mono),
            "step_time_s": self._step_time_s,
            "compute_time_s": self._compute_time_s,
            "started_at": self._started_at,
            "min_interval_s": self.min_interval_s,
            "log_file": self._log_file,
            "pause": self._pause,
        }
        if os.getpid() != self._pid:  # a forked child beating on its own: its own identity
            self._pid = os.getpid()
            self._start_ticks = record["start_ticks"] = process_start_ticks(self._pid)
        target = self._target(self._pid)
        if self._written_path is not None and self._written_path != target:
            with contextlib.suppress(OSError):  # moved (its directory became usable): one file
                self._written_path.unlink()
        # No fsync: a heartbeat is worth nothing after a crash of the node, and an fsync per
        # second on a busy node's disk is a cost the training loop should not pay.
        fd, tmp = tempfile.mkstemp(prefix=f".{self._pid}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, sort_keys=True)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._written_path = target
        self._written_mono = now
        self._written_step = self._step
        self.writes += 1

    @contextlib.contextmanager
    def pause(self, reason: str, max_s: float = 1800.0) -> Iterator[None]:
        """Declare a phase without steps (checkpoint save, evaluation) of at most ``max_s``::

            with hb.pause("checkpoint", max_s=900):
                save_checkpoint(...)      # rank 0 writes, the others wait in a barrier
                dist.barrier()

        Until ``max_s`` passes, the agent does not count the missing steps as a hang; past it,
        the pause itself is the hang. Wrap the barrier on *every* rank: ranks that wait in a
        collective while a peer saves look exactly like a hung job from this node. The file is
        written on entry and on exit (never raises, like ``beat``)."""
        self._pause = {"reason": str(reason)[:200], "since": self._wall(), "max_s": float(max_s)}
        self._write_now()
        try:
            yield
        finally:
            self._pause = None
            self._step_mono = self._clock()  # the pause is not a slow step
            self._write_now()

    def _write_now(self) -> None:
        try:
            self._write(self._clock())
        except Exception as err:  # noqa: BLE001 - never break the training loop
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "node_agent heartbeat: cannot write %s (%s: %s)",
                    self.path,
                    type(err).__name__,
                    err,
                )

    def close(self) -> None:
        """Remove this process's heartbeat file (a clean exit); never raises."""
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._written_path = None


def writer_dir(spool_dir: str | os.PathLike[str]) -> tuple[Path, bool]:
    """The directory this process writes its heartbeat in, and whether it is its own.

    In a directory only its owner may write to (a job's private spool), that directory. In a
    shared one (group- or other-writable: the node's sticky spool), ``<spool_dir>/<euid>``,
    made 0700 on first use: no other user can make, squat or flood names in it. When that name
    is already taken by something else (another user's directory, a link: a squat), returns
    ``(spool_dir, False)`` and the caller picks a name nobody can guess; the agent, as root,
    replaces the squatted entry (``atomic_file.ensure_user_spool``). Makes missing directories.
    """
    d = Path(spool_dir)
    d.mkdir(parents=True, exist_ok=True)
    if not os.stat(d).st_mode & 0o022:
        return d, True
    uid = os.geteuid()
    own = d / str(uid)
    with contextlib.suppress(FileExistsError):
        os.mkdir(own, 0o700)
    st = os.lstat(own)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
        return own, True
    return d, False


def heartbeat_file(spool_dir: str | os.PathLike[str], pid: int, uid: int | None = None) -> Path:
    """Where the writer of ``pid`` (running as ``uid``, default this process's euid) puts its
    heartbeat in ``spool_dir``, when its uid's directory is its own (see :func:`writer_dir`)."""
    d = Path(spool_dir)
    with contextlib.suppress(OSError):
        if os.stat(d).st_mode & 0o022:
            d = d / str(os.geteuid() if uid is None else uid)
    return d / f"{pid}.json"


# -- reading spools (the agent's side) -------------------------------------------------------


class SpoolFileError(ValueError):
    """A spool file the agent will not use; the message says why (one line)."""


@dataclass(frozen=True)
class SpoolFile:
    """One spool file as read: its parsed JSON and what ``fstat`` said of the open file.

    ``uid`` is the file's owner: the only user whose processes it may speak for."""

    path: Path
    data: Any
    uid: int
    mtime: float
    size: int


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep JSON ``text`` nests (``{"a": [1]}`` is 2), strings aside; text that is not
    JSON gives some number, and the parser then rejects it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _unclean(value: Any) -> str | None:
    """Why a parsed JSON value may not be used (a lone surrogate or a NUL in any string, keys
    included: text that cannot be encoded again, or that ends a C string early), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            if "\0" in item:
                return f"a string holds a NUL byte ({item[:40]!r})"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                return (
                    f"a string holds a lone surrogate (U+{ord(item[err.start]):04X} in "
                    f"{item[:40]!r}), which is no Unicode text"
                )
    return None


def parse_spool_json(raw: bytes, max_depth: int = SPOOL_MAX_DEPTH) -> Any:
    """Bytes of a spool file -> JSON value; SpoolFileError for text that is not UTF-8, nests
    deeper than ``max_depth``, holds NaN/Infinity, is not JSON, or holds a string with a lone
    surrogate (``"\\ud800"`` is valid JSON but no text: encoding it again raises) or a NUL."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpoolFileError(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise SpoolFileError(f"JSON nests {depth} levels deep, more than {max_depth}")
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as err:
        raise SpoolFileError(f"not valid JSON ({err})"[:300]) from None
    why = _unclean(value)
    if why is not None:
        raise SpoolFileError(why)
    return value


def _read_at(dir_fd: int, name: str, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """Open ``name`` in the directory ``dir_fd`` the safe way and read it whole.

    O_NOFOLLOW: a symlink (to ``/dev/zero``, to another user's file) is refused by the kernel.
    O_NONBLOCK: a FIFO opens at once and a file under a lease does not stall the reader.
    Then fstat of the open file: a regular file with one link, at most ``max_bytes``. A refusal
    after the fstat names the file's owner (the writer)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SpoolFileError("is a symbolic link; spool files are never followed") from None
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SpoolFileError(
                "cannot be opened without waiting (a lease or a lock on it); skipped"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        by = f" (written by uid {st.st_uid})"
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a device"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a socket"
                if stat.S_ISSOCK(st.st_mode)
                else "not a regular file"
            )
            raise SpoolFileError(f"is {kind}, not a regular file{by}")
        if st.st_nlink != 1:
            raise SpoolFileError(f"has {st.st_nlink} hard links (a spool file has one){by}")
        if st.st_size > max_bytes:
            raise SpoolFileError(
                f"is {st.st_size} bytes, more than the {max_bytes} a spool file may have{by}"
            )
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise SpoolFileError(f"grew past {max_bytes} bytes while being read{by}")
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _pick_fairly(entries: list[tuple[str, int]], limit: int) -> list[str]:
    """At most ``limit`` names, taken in turn from each owner (oldest name first within one),
    so one user flooding the spool cannot push another user's files out of the read."""
    by_owner: dict[int, list[str]] = {}
    for name, uid in sorted(entries):
        by_owner.setdefault(uid, []).append(name)
    queues = [iter(names) for _, names in sorted(by_owner.items())]
    picked: list[str] = []
    while queues and len(picked) < limit:
        alive = []
        for q in queues:
            taken = next(q, None)
            if taken is not None and len(picked) < limit:
                picked.append(taken)
                alive.append(q)
        queues = alive
    return sorted(picked)


def _open_dir(
    d: Path, errs: list[tuple[Path, str]], *, dir_fd: int | None = None, name: str | None = None
) -> int | None:
    """An fd of the directory ``d`` (or ``name`` in ``dir_fd``), never through a symlink; None
    when it is missing, or unusable (then said in ``errs``)."""
    try:
        return os.open(
            d if name is None else name,
            os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=dir_fd,
        )
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            errs.append(
                (
                    d,
                    "the spool directory is a symbolic link or not a directory; "
                    "nothing in it was read (make it a real directory, "
                    "docs/security.md)",
                )
            )
        else:
            errs.append((d, f"cannot open the spool directory: {err.strerror or err}"))
        return None


def _read_dir(
    dir_fd: int,
    d: Path,
    errs: list[tuple[Path, str]],
    *,
    skip: Collection[str] = (),
    max_files: int = SPOOL_MAX_FILES,
    max_bytes: int = SPOOL_MAX_BYTES,
    max_depth: int = SPOOL_MAX_DEPTH,
    subdirs: set[int] | None = None,
    owner: int | None = None,
) -> list[SpoolFile]:
    """The ``*.json`` files of the open directory ``dir_fd`` (named ``d``): see
    :func:`read_spool_json`. The uids of subdirectories named by their owner's uid go to
    ``subdirs``. ``owner``: the directory is that uid's alone, so its names are taken in order
    without a stat each (the owner each file really has is still read from ``fstat``)."""
    entries = _list_dir(dir_fd, d, errs, set(skip), subdirs, owner)
    names = _pick_fairly(entries, max_files)
    if len(entries) > len(names):
        errs.append(
            (
                d,
                f"{len(entries) - len(names)} file(s) not read in this run (at "
                f"most {max_files} per run, taken in turn from each owner); the "
                "next run reads them",
            )
        )
    return _read_files(dir_fd, d, names, errs, max_bytes, max_depth)


def _list_dir(
    dir_fd: int,
    d: Path,
    errs: list[tuple[Path, str]],
    done: set[str],
    subdirs: set[int] | None,
    owner: int | None,
) -> list[tuple[str, int]]:
    """(name, owner uid) of the ``*.json`` files of ``dir_fd`` not in ``done``, at most
    :data:`SPOOL_MAX_LISTED` entries looked at; the uids of its uid-named subdirectories go to
    ``subdirs`` (see :func:`_read_dir`)."""
    entries: list[tuple[str, int]] = []
    listed = 0
    with os.scandir(dir_fd) as it:
        for entry in it:
            listed += 1
            if listed > SPOOL_MAX_LISTED:
                errs.append(
                    (
                        d,
                        f"holds more than {SPOOL_MAX_LISTED} entries; only the "
                        "first were looked at: clean up the spool",
                    )
                )
                break
            name = entry.name
            if subdirs is not None and name.isdigit() and name.isascii():
                # a uid's own directory; another's under that name is looked at only for a
                # uid that runs a process (so junk names cost no opens and no reports)
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode) and str(st.st_uid) == name:
                        subdirs.add(st.st_uid)
                continue
            if name.startswith(".") or not name.endswith(".json") or name in done:
                continue
            if owner is not None:
                entries.append((name, owner))
                continue
            try:
                entries.append((name, entry.stat(follow_symlinks=False).st_uid))
            except OSError:
                continue  # removed since it was listed
    return entries


def _read_files(
    dir_fd: int,
    d: Path,
    names: list[str],
    errs: list[tuple[Path, str]],
    max_bytes: int,
    max_depth: int,
) -> list[SpoolFile]:
    """The files ``names`` of ``dir_fd`` read and parsed; what cannot be goes to ``errs``."""
    out = []
    for name in names:
        path = d / name
        try:
            raw, st = _read_at(dir_fd, name, max_bytes)
        except FileNotFoundError:
            continue  # removed between listing and reading (its writer exited cleanly)
        except SpoolFileError as err:
            errs.append((path, str(err)))
            continue
        except OSError as err:
            errs.append((path, f"cannot read: {err.strerror or err}"))
            continue
        try:
            out.append(
                SpoolFile(
                    path, parse_spool_json(raw, max_depth), st.st_uid, st.st_mtime, st.st_size
                )
            )
        except SpoolFileError as err:
            errs.append((path, f"{err} (written by uid {st.st_uid})"))
    return out


def read_spool_json(
    spool_dir: str | os.PathLike[str],
    errors: list[tuple[Path, str]] | None = None,
    *,
    skip: Collection[str] = (),
    max_files: int = SPOOL_MAX_FILES,
    max_bytes: int = SPOOL_MAX_BYTES,
    max_depth: int = SPOOL_MAX_DEPTH,
) -> list[SpoolFile]:
    """Every ``*.json`` in ``spool_dir`` (names starting with ``.`` are a writer's temp files
    and never opened; names in ``skip`` are not opened either), read the safe way, oldest name
    first. Never blocks and never raises for a file: a file that is a link, a FIFO, a device,
    too big, too deep, not UTF-8 JSON, or holding a lone surrogate or a NUL is appended to
    ``errors`` as ``(path, reason)``. A spool holding more than ``max_files`` readable names
    gives one more entry for the directory itself; the rest are read by a later call. A
    missing directory is empty; the directory itself must not be a symlink."""
    d = Path(spool_dir)
    errs: list[tuple[Path, str]] = errors if errors is not None else []
    dir_fd = _open_dir(d, errs)
    if dir_fd is None:
        return []
    try:
        return _read_dir(
            dir_fd,
            d,
            errs,
            skip=skip,
            max_files=max_files,
            max_bytes=max_bytes,
            max_depth=max_depth,
        )
    finally:
        os.close(dir_fd)


def live_uids(proc_root: str | os.PathLike[str] = "/proc") -> set[int]:
    """The uids that run a process now: the owners of ``<proc_root>/<pid>`` (a process's
    effective uid). Listing ``/proc`` costs the same whatever anyone put in a spool."""
    out = set()
    with contextlib.suppress(OSError), os.scandir(proc_root) as it:
        for entry in it:
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    out.add(entry.stat(follow_symlinks=False).st_uid)
    return out


def _user_dir(top_fd: int, d: Path, uid: int, errs: list[tuple[Path, str]]) -> int | None:
    """An fd of ``<d>/<uid>`` when it is uid's own heartbeat directory: a real directory (not
    a link) owned by ``uid`` that no group or other user may write to; else None, with why
    in ``errs`` (a squatter is named by its uid)."""
    path = d / str(uid)
    fd = _open_dir(path, [], dir_fd=top_fd, name=str(uid))
    if fd is None:
        try:
            st = os.stat(str(uid), dir_fd=top_fd, follow_symlinks=False)
        except OSError:
            return None  # no such directory: that uid writes no heartbeat here
        errs.append(
            (
                path,
                f"is not a directory but {_kind(st.st_mode)} of uid {st.st_uid}: "
                f"not uid {uid}'s heartbeat directory; ignored (the agent replaces "
                "it, or remove it)",
            )
        )
        return None
    st = os.fstat(fd)
    if st.st_uid != uid:
        why = f"is owned by uid {st.st_uid}, not by uid {uid}"
    elif st.st_mode & 0o022:
        why = f"may be written by others than uid {uid} (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return fd
    os.close(fd)
    errs.append(
        (
            path,
            f"{why}: not uid {uid}'s own heartbeat directory, so nothing in it is "
            "read (a uid's directory is its own, mode 0700; the agent replaces a "
            "squatted one)",
        )
    )
    return None


def _kind(mode: int) -> str:
    return (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a file"
        if stat.S_ISREG(mode)
        else "a special file"
    )


def _check(
    record: dict[str, Any],
    key: str,
    kinds: tuple[type, ...],
    *,
    optional: bool = True,
    minimum: float | None = None,
) -> None:
    value = record.get(key)
    if value is None:
        if optional:
            return
        raise ValueError(f"field {key!r} is missing")
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and isinstance(value, str) and len(value) > _TEXT_MAX:
        raise ValueError(f"field {key!r} is {len(value)} characters long")
    if ok and minimum is not None and value < minimum:
        raise ValueError(f"field {key!r} is {value!r}, below {minimum:g}")
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise ValueError(
            f"field {key!r} is {type(value).__name__} {str(value)[:40]!r}, expected {want}"
        )


_NUMBER = (int, float)


def _check_text(record: dict[str, Any], key: str) -> None:
    """A name or id: a string without control characters (C0, DEL, C1, zero-width, bidi)."""
    _check(record, key, (str,))
    value = record.get(key)
    if isinstance(value, str) and (bad := CONTROL_CHARACTERS.search(value)):
        raise ValueError(
            f"field {key!r} holds the control character U+{ord(bad.group()):04X} "
            f"({value[:40]!r}); a name or id never does"
        )


def check_log_file(value: Any, what: str = "field 'log_file'") -> str:
    """``value`` if it is a usable log path: an absolute path (a relative one would be read
    from the agent's working directory) with no control character; else ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{what} is {type(value).__name__} {str(value)[:40]!r}, expected an absolute path"
        )
    if len(value) > _TEXT_MAX:
        raise ValueError(f"{what} is {len(value)} characters long")
    if bad := CONTROL_CHARACTERS.search(value):
        raise ValueError(
            f"{what} holds the control character U+{ord(bad.group()):04X} ({value[:40]!r})"
        )
    if not value.startswith("/"):
        raise ValueError(f"{what} is {value[:40]!r}, not an absolute path")
    return value


def check_heartbeat(record: Any) -> dict[str, Any]:
    """``record`` if it is a heartbeat this module writes, every value of the type it should
    have (numbers finite, names and ids without control characters, ``log_file`` an absolute
    path), else ValueError naming the first bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    if record.get("schema") != SCHEMA:
        raise ValueError(f"schema is {str(record.get('schema'))[:60]!r}, expected {SCHEMA!r}")
    _check(record, "pid", (int,), optional=False, minimum=1)
    _check(record, "step", (int,), optional=False)
    _check(record, "step_at", _NUMBER, optional=False)
    for key in ("start_ticks", "rank", "local_rank", "world_size"):
        _check(record, key, (int,), minimum=0)
    for key in ("step_time_s", "compute_time_s", "min_interval_s"):
        _check(record, key, _NUMBER, minimum=0)
    _check(record, "started_at", _NUMBER)
    for key in (
        "job",
        "job_source",
        "slurm_job_id",
        "torchelastic_run_id",
        "pod",
        "pod_namespace",
        "hostname",
    ):
        _check_text(record, key)
    if record.get("log_file") is not None:
        check_log_file(record["log_file"])
    pause = record.get("pause")
    if pause is not None:
        if not isinstance(pause, dict):
            raise ValueError(f"field 'pause' is {type(pause).__name__}, expected an object")
        _check(pause, "reason", (str,))
        _check(pause, "since", _NUMBER, optional=False)
        _check(pause, "max_s", _NUMBER, optional=False, minimum=0)
    return record


def read_heartbeat_files(
    spool_dir: str | os.PathLike[str],
    errors: list[tuple[Path, str]] | None = None,
    *,
    uids: Collection[int] | None = None,
    proc_root: str | os.PathLike[str] = "/proc",
) -> list[SpoolFile]:
    """Every heartbeat in ``spool_dir`` as :class:`SpoolFile` (its owner's uid included),
    read with :func:`read_spool_json` and checked with :func:`check_heartbeat`; any other
    file is appended to ``errors`` as ``(path, reason)``, naming its writer's uid.

    Read: the ``*.json`` directly in ``spool_dir`` (older writers; a writer whose own
    directory was squatted), then each uid's own directory ``<spool_dir>/<uid>/`` (see
    :func:`writer_dir`) with caps of its own. A uid's directory counts only when it is a
    directory owned by that uid that no one else may write to. The uids looked for: those
    listed in ``spool_dir``, and ``uids`` (default: every uid running a process, from
    ``proc_root``), so names flooding the shared directory cannot hide a user's directory."""
    d = Path(spool_dir)
    errs: list[tuple[Path, str]] = []
    found: list[SpoolFile] = []
    top_fd = _open_dir(d, errs)
    if top_fd is not None:
        try:
            listed: set[int] = set()
            found += _read_dir(top_fd, d, errs, subdirs=listed)
            wanted = listed | set(live_uids(proc_root) if uids is None else uids)
            for uid in sorted(wanted):
                fd = _user_dir(top_fd, d, uid, errs)
                if fd is None:
                    continue
                try:
                    found += _read_dir(fd, d / str(uid), errs, owner=uid)
                finally:
                    os.close(fd)
        finally:
            os.close(top_fd)
    out = []
    for f in found:
        try:
            check_heartbeat(f.data)
        except ValueError as err:
            errs.append((f.path, f"ValueError: {err} (written by uid {f.uid})"))
            continue
        out.append(f)
    if errors is not None:
        errors.extend(errs)
    return out


def remove_stale(
    spool_dir: str | os.PathLike[str], paths: Collection[Path], now: float, older_than_s: float
) -> list[Path]:
    """Remove those of ``paths`` (files :func:`read_heartbeat_files` found in ``spool_dir``:
    directly in it, or in a uid's directory in it) last written more than ``older_than_s``
    before ``now`` (Unix seconds); returns the removed ones. Never raises.

    A uid's directory is its owner's to rename, so between the read and the removal it may
    have become a symlink to, say, ``/etc``: every step goes through directory fds opened
    without following links (and the uid's directory must still be that uid's), so root
    never removes a file outside the spool."""
    top = Path(spool_dir)
    removed: list[Path] = []
    errs: list[tuple[Path, str]] = []
    top_fd = _open_dir(top, errs)
    if top_fd is None:
        return removed
    try:
        for path in paths:
            rel = path.relative_to(top).parts if path.is_relative_to(top) else ()
            if not (len(rel) == 1 or (len(rel) == 2 and rel[0].isdigit() and rel[0].isascii())):
                continue  # not a spool file's place
            fd = top_fd if len(rel) == 1 else _user_dir(top_fd, top, int(rel[0]), errs)
            if fd is None:
                continue
            try:
                st = os.stat(rel[-1], dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                    os.unlink(rel[-1], dir_fd=fd)
                    removed.append(path)
            except OSError:
                pass  # gone already, or not ours to remove
            finally:
                if fd != top_fd:
                    os.close(fd)
    finally:
        os.close(top_fd)
    return removed


def read_heartbeats(
    spool_dir: str | os.PathLike[str], errors: list[tuple[Path, str]] | None = None
) -> list[tuple[Path, dict[str, Any]]]:
    """Every heartbeat in ``spool_dir`` as ``(path, record)``; temp files are never opened.

    A file that is not a heartbeat is skipped and appended to ``errors`` as ``(path, reason)``.
    A missing directory holds no heartbeats. (:func:`read_heartbeat_files` also gives each
    file's owner, which the agent needs to decide whom a heartbeat may speak for.)"""
    return [(f.path, f.data) for f in read_heartbeat_files(spool_dir, errors)]
