"""Progress heartbeats from inside a training loop: what the ``training_progress`` check reads.

Two lines in the training script::

    from node_agent.heartbeat import Heartbeat
    hb = Heartbeat()                # once, after torch.distributed is set up (or anywhere)
    ...
    hb.beat(step)                   # once per training step

Each process writes one small JSON file, ``<state_dir>/spool/heartbeat/<pid>.json``, atomically
(temp file in the same directory, then ``os.replace``), at most every ``min_interval_s``
(default 1 s), so a call costs a clock read and a comparison on almost every step (measured in
``bench/bench_hang.py``). The file holds the process's identity (pid, rank, local rank, world
size, job), the last step number, the wall time of that step, and the recent step time (the
mean over the steps since the previous write). ``beat()`` never raises into the training loop:
a failure is logged once and the loop goes on.

Stdlib only and torch-free on purpose: it is imported inside training processes, and the
daemon reads the files without importing anything heavy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("node_agent.heartbeat")

SCHEMA = "node-agent.heartbeat/1"


def default_spool_dir() -> Path:
    """``$NODE_AGENT_STATE_DIR/spool/heartbeat`` (default state dir ``/var/lib/node-agent``)."""
    base = os.environ.get("NODE_AGENT_STATE_DIR") or "/var/lib/node-agent"
    return Path(base) / "spool" / "heartbeat"


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def identity_from_env(env: Mapping[str, str] | None = None, ppid: int | None = None) -> dict[str, Any]:
    """Rank and job identity of this process, from the launcher's environment.

    ``job`` is the first of ``slurm:$SLURM_JOB_ID``, ``torchelastic:$TORCHELASTIC_RUN_ID``,
    ``pod:$KUBERNETES_POD_NAME`` (or ``$HOSTNAME`` inside a Kubernetes pod, where it is the pod
    name), else ``ppid:<parent pid>`` — the ranks that one launcher (torchrun, mp.spawn) started
    share a parent, which is the best grouping left when nothing names the job.
    """
    env = os.environ if env is None else env
    job, source = None, None
    pod = env.get("KUBERNETES_POD_NAME") or (
        env.get("HOSTNAME") if env.get("KUBERNETES_SERVICE_HOST") else None)
    for prefix, value in (("slurm", env.get("SLURM_JOB_ID")),
                          ("torchelastic", env.get("TORCHELASTIC_RUN_ID")),
                          ("pod", pod)):
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
        return int(data[data.rindex(b")") + 2:].split()[19])
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

    def __init__(self, spool_dir: str | os.PathLike[str] | None = None, rank: int | None = None,
                 job: str | None = None, *, min_interval_s: float = 1.0,
                 log_file: str | os.PathLike[str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
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
        self._step = -1          # the last step seen by beat()
        self._step_mono = 0.0    # monotonic time of that step
        self._written_step: int | None = None
        self._written_mono: float | None = None
        self._step_time_s: float | None = None
        self._compute_sum, self._compute_n = 0.0, 0   # compute_s given since the last write
        self._compute_time_s: float | None = None
        self._warned = False
        self._log_file = str(log_file) if log_file else os.environ.get("NODE_AGENT_TRAIN_LOG")
        self._pause: dict[str, Any] | None = None
        self.writes = 0          # files written (for tests and the benchmark)
        self.failures = 0        # writes that failed (logged once)

    @property
    def path(self) -> Path:
        return self.spool_dir / f"{os.getpid()}.json"

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
                log.warning("node_agent heartbeat: cannot write %s (%s: %s); training goes on "
                            "without progress heartbeats (make %s writable for this user, or "
                            "pass Heartbeat(spool_dir=...))", self.path, type(err).__name__,
                            err, self.spool_dir)

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
            "schema": SCHEMA, "pid": os.getpid(), "start_ticks": self._start_ticks,
            "hostname": socket.gethostname(), **self._identity,
            "step": self._step, "step_at": self._wall() - (now - self._step_mono),
            "step_time_s": self._step_time_s, "compute_time_s": self._compute_time_s,
            "started_at": self._started_at,
            "min_interval_s": self.min_interval_s, "log_file": self._log_file,
            "pause": self._pause,
        }
        if os.getpid() != self._pid:  # a forked child beating on its own: its own identity
            self._pid = os.getpid()
            self._start_ticks = record["start_ticks"] = process_start_ticks(self._pid)
        d = self.spool_dir
        d.mkdir(parents=True, exist_ok=True)
        # No fsync: a heartbeat is worth nothing after a crash of the node, and an fsync per
        # second on a busy node's disk is a cost the training loop should not pay.
        fd, tmp = tempfile.mkstemp(prefix=f".{self._pid}.", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, sort_keys=True)
            os.replace(tmp, d / f"{self._pid}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
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
        self._pause = {"reason": str(reason)[:200], "since": self._wall(),
                       "max_s": float(max_s)}
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
                log.warning("node_agent heartbeat: cannot write %s (%s: %s)", self.path,
                            type(err).__name__, err)

    def close(self) -> None:
        """Remove this process's heartbeat file (a clean exit); never raises."""
        with contextlib.suppress(OSError):
            self.path.unlink()


def read_heartbeats(spool_dir: str | os.PathLike[str],
                    errors: list[tuple[Path, str]] | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every heartbeat in ``spool_dir`` as ``(path, record)``; temp files are never opened.

    A file that is not a heartbeat is skipped and appended to ``errors`` as ``(path, reason)``.
    A missing directory holds no heartbeats."""
    d = Path(spool_dir)
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.glob("*.json")):
        if p.name.startswith("."):
            continue
        try:
            record = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(record, dict) or record.get("schema") != SCHEMA:
                raise ValueError(f"schema is {record.get('schema') if isinstance(record, dict) else None!r}, "
                                 f"expected {SCHEMA!r}")
            for key in ("pid", "step", "step_at"):
                if not isinstance(record.get(key), (int, float)):
                    raise ValueError(f"field {key!r} missing or not a number")
            out.append((p, record))
        except FileNotFoundError:
            continue  # removed between listing and reading (its process exited cleanly)
        except (OSError, ValueError) as err:
            if errors is not None:
                errors.append((p, f"{type(err).__name__}: {err}"))
    return out
