"""Stack samples of training processes with ``py-spy dump --json``: the ``stack`` hang signal.

A rank blocked for good shows the same main-thread stack sample after sample; a rank outside a
collective while its hung peers wait inside one is the likely origin of a job-wide hang. All
processes are sampled at once (one thread per process, each taking its samples
``interval_s`` apart), so the samples of a job's ranks describe about the same moments and
sampling eight ranks takes no longer than sampling one.

Samples are taken with ``py-spy dump --nonblocking``: py-spy reads the process's memory
without stopping it (tens of ms, ~10 ms CPU; ``bench/bench_hang.py``). Stopping it would let
any user's process keep the agent waiting: a process blocked in ``vfork()`` cannot be stopped, and a
stopping py-spy waits for it until its timeout. Only the native sample (``--native``, which
py-spy will not take without stopping) and the retry of a failed nonblocking sample stop the
process, each capped at :data:`BLOCKING_TIMEOUT_S`. Every call gets only what is left of the
run's deadline, the calls of one run are capped and shared fairly between uids
(:func:`sample_stacks`).

py-spy needs ptrace permission: root, ``CAP_SYS_PTRACE``, or ``kernel.yama.ptrace_scope=0``.
Every way it can fail (not installed, no permission, process gone, output that is not JSON,
no time or calls left) is an unavailable signal with the reason, never an exception.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.training.blocking import Blocked, classify
from node_agent.training.signals import Signal

PY_SPY_TIMEOUT_S = 10.0  # cap of one nonblocking sample (tens of ms; bench_hang.py)
BLOCKING_TIMEOUT_S = 5.0  # cap of one call that stops the process (--native, or a retry)
MIN_CALL_S = 0.5  # no call starts with less of the deadline left
MAX_CALLS = 64  # py-spy calls per run (param stack_max_calls): 8 ranks x 3 samples
# + natives fit twice over
MAX_WORKERS = 16  # py-spy calls in flight at once, shared between uids
JOIN_MARGIN_S = 2.0  # past the deadline, what a py-spy's kill may take before it is left
PY_SPY_MISSING = (
    f"py-spy is not installed, though node-agent depends on it: {sys.executable} -m pip "
    "install 'py-spy>=0.3.14' (or put py-spy on the agent's PATH)"
)
PTRACE_FIX = (
    "py-spy needs ptrace permission: run the agent as root or with CAP_SYS_PTRACE, "
    "or set kernel.yama.ptrace_scope=0"
)
MAX_FRAMES = 20
#: the most of one ``py-spy dump --json`` read: a user's process sets its own function and file
#: names (a thousand frames of 4,000-character names printed 49 MB), and 16 dumps in flight must
#: not fill the agent's memory; a bigger dump is no sample
MAX_DUMP_BYTES = 4 << 20


def find_py_spy(configured: str | None = None) -> str | None:
    """``configured``, else ``py-spy`` on PATH, else beside the running Python (a venv)."""
    if configured:
        return str(configured)
    found = proc.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def main_thread(dump: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The thread that runs the training loop: ``MainThread``, else py-spy's first thread."""
    for thread in dump:
        if thread.get("thread_name") == "MainThread":
            return thread
    return dump[0] if dump else None


def frame_text(frame: dict[str, Any]) -> str:
    where = frame.get("short_filename") or frame.get("filename") or "?"
    return f"{frame.get('name', '?')} ({where}:{frame.get('line', '?')})"


def dump_once(
    py_spy: str, pid: int, timeout_s: float, native: bool = False, nonblocking: bool = False
) -> list[dict[str, Any]] | str:
    """One sample: the main thread's frames, innermost first; or why there is none.

    ``native`` adds the C/C++ frames (``py-spy dump --native``), where ``c10d::Work::wait``
    and the CUDA synchronise calls show; py-spy must stop the process for those.
    ``nonblocking`` (``py-spy dump --nonblocking``) reads the process's memory without
    stopping it: it cannot be kept waiting by a process that cannot be stopped (one blocked in
    ``vfork()`` keeps a stopping py-spy waiting until its timeout), and it does not pause the
    job; py-spy refuses it together with ``native``."""
    argv = [py_spy, "dump", "--pid", str(pid), "--json"]
    argv += ["--native"] if native else ["--nonblocking"] if nonblocking else []
    done = proc.run(argv, timeout_s=timeout_s, max_output_bytes=MAX_DUMP_BYTES)
    if not done.ok:
        if not Path(f"/proc/{pid}").exists():
            return f"process {pid} exited during stack sampling"
        reason = done.describe_failure()
        if "permission" in (done.stderr + done.stdout).lower():
            reason += f" ({PTRACE_FIX})"
        return reason
    try:
        thread = main_thread(json.loads(done.stdout))
    except (ValueError, TypeError, AttributeError) as err:
        return f"py-spy printed no JSON stack dump ({err})"
    return list(thread.get("frames") or []) if thread else []


Dump = Callable[[str, int, float], "list[dict[str, Any]] | str"]


class _Budget:
    """The py-spy calls of one run: each uid's quota, and the calls in flight per uid.

    ``quota[uid]`` is what the uid's sampled processes reserved (``samples`` calls each) plus
    an equal share of the calls nobody reserved (for retries and native samples): one uid's
    processes cannot spend what another's were given. ``lanes[uid]`` bounds its calls in
    flight, so a uid whose processes keep py-spy waiting holds only its own lanes, never
    another uid's."""

    def __init__(
        self, quota: dict[Any, int], width: int, deadline: float, clock: Callable[[], float]
    ) -> None:
        self.quota, self.deadline, self.clock = dict(quota), deadline, clock
        self.lanes = {uid: threading.BoundedSemaphore(width) for uid in quota}
        self.lock = threading.Lock()

    def call(
        self, uid: Any, fn: Dump, py_spy: str, pid: int, cap_s: float
    ) -> list[dict[str, Any]] | str | None:
        """One py-spy call within the uid's quota and what is left of the deadline (never more
        than ``cap_s``); None when neither allows one."""
        with self.lanes[uid]:
            left = self.deadline - self.clock()
            with self.lock:
                if self.quota[uid] <= 0 or left < MIN_CALL_S:
                    return None
                self.quota[uid] -= 1
            return fn(py_spy, pid, min(cap_s, left))

    def why_not(self, uid: Any) -> str:
        if self.quota[uid] <= 0:
            return (
                f"uid {uid}'s share of this run's py-spy calls is spent "
                "(stack_max_calls, shared equally between the uids sampled)"
            )
        return "the check's sampling deadline came first"


def sample_stacks(
    py_spy: str | None,
    pids: Sequence[int],
    samples: int,
    interval_s: float,
    deadline: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    dump: Dump | None = None,
    native_dump: Dump | None = None,
    uids: Mapping[int, Any] | None = None,
    max_calls: int = MAX_CALLS,
    workers: int = MAX_WORKERS,
    clock: Callable[[], float] = time.monotonic,
) -> dict[int, Signal]:
    """The ``stack`` signal of each pid from ``samples`` samples ``interval_s`` apart.

    ``hang`` is True when every sample of the process's main thread is the same (names, files
    and lines). Figures: ``samples``, ``identical``, ``stuck_in`` (the innermost frame when
    identical), ``blocked_in`` (what the stack waits in: kind, deciding frame, rule;
    :mod:`node_agent.training.blocking`), ``in_collective`` (it waits on its peers: a
    collective or the GPU) and ``frames`` (the last sample, innermost first).

    Bounded, whatever the processes do (docs/training_hangs.md, "Sampling"):

    * ``deadline`` (monotonic seconds) is kept inside the run: each call gets what is left of
      it, never more than its cap (:data:`PY_SPY_TIMEOUT_S`, :data:`BLOCKING_TIMEOUT_S` for a
      call that stops the process), and none starts with less than :data:`MIN_CALL_S` left;
    * at most ``max_calls`` py-spy calls, shared fairly between the uids of the processes
      (``uids``: pid -> uid; by default one group): processes are taken in turn from each uid,
      in the order given, as long as their ``samples`` calls fit, and each uid has at most
      ``workers // uids`` calls in flight;
    * samples are taken with ``--nonblocking`` (a process that cannot be stopped, e.g. one
      blocked in ``vfork()``, costs tens of ms instead of the whole timeout); a nonblocking
      sample that fails on a live process is taken once more the stopping way.

    A process not sampled (its uid's share spent, or the deadline) is unavailable with the
    reason and ``not_sampled`` (``budget`` | ``deadline``) in its figures.

    A stuck process whose Python stack says only "the job's own code" gets one more sample
    with native frames (``native_dump``; by default ``py-spy dump --native`` when ``dump`` is
    the real one): ``Work.wait()`` and ``.item()`` are C++ and show only there. What the native
    frames say is used when they name a collective or a GPU wait."""
    if not pids:
        return {}
    if py_spy is None:
        return {pid: Signal.unavailable("stack", PY_SPY_MISSING) for pid in pids}
    retry: Dump | None = None
    if dump is None:
        dump, retry = functools.partial(dump_once, nonblocking=True), dump_once
        native_dump = native_dump or functools.partial(dump_once, native=True)
    per_pid = max(1, samples)
    owner = {pid: (uids or {}).get(pid) for pid in pids}
    chosen, skipped = _choose(list(pids), owner, per_pid, max_calls)
    out = _skipped_for_budget(skipped, owner, max_calls)
    if not chosen:
        return out
    quota = _quotas(chosen, owner, per_pid, max_calls)
    sampling = _Sampling(
        py_spy,
        owner,
        per_pid,
        interval_s,
        deadline,
        _Budget(quota, max(1, workers // len(quota)), deadline, clock),
        dump,
        retry,
        native_dump,
        sleep,
        clock,
        clock(),
    )
    out.update(_run_workers(sampling, chosen))
    return {pid: out[pid] for pid in pids}


def _skipped_for_budget(
    skipped: Mapping[int, int], owner: Mapping[int, Any], max_calls: int
) -> dict[int, Signal]:
    """pid -> unavailable for the processes :func:`_choose` left out (``skipped``: pid -> how
    many of its uid's processes took that uid's share)."""
    return {
        pid: Signal.unavailable(
            "stack",
            f"not sampled: uid {owner[pid]}'s share of this run's {max_calls} py-spy calls "
            f"went to {n} other process(es) of that uid (stack_max_calls, shared equally between "
            "uids)",
            not_sampled="budget",
            uid=owner[pid],
        )
        for pid, n in skipped.items()
    }


def _quotas(
    chosen: Sequence[int], owner: Mapping[int, Any], per_pid: int, max_calls: int
) -> dict[Any, int]:
    """uid -> its py-spy calls: ``per_pid`` for each of its chosen processes plus an equal
    share of the calls nobody reserved."""
    groups = list(dict.fromkeys(owner[pid] for pid in chosen))
    spare = max(0, max_calls - per_pid * len(chosen))
    return {
        uid: per_pid * sum(owner[p] == uid for p in chosen) + spare // len(groups) for uid in groups
    }


def _run_workers(sampling: _Sampling, chosen: Sequence[int]) -> dict[int, Signal]:
    """Each chosen process sampled on a :class:`_Worker` of its own, waited on until the
    sampling deadline (and its margin)."""
    threads = [_Worker(sampling.one, pid) for pid in chosen]
    for t in threads:
        t.start()
    # every call inside is bounded by the deadline; the margin covers the kill of a py-spy
    # past its timeout (node_agent.proc kills its process group)
    end = sampling.deadline + JOIN_MARGIN_S
    out = {}
    for t in threads:
        t.join(max(0.0, end - sampling.clock()))
        out[t.pid] = (
            t.result
            if t.result is not None
            else Signal.unavailable(
                "stack",
                "not sampled: py-spy did not return by the sampling deadline",
                not_sampled="deadline",
                uid=sampling.owner[t.pid],
            )
        )
    return out


@dataclass
class _Sampling:
    """One run of :func:`sample_stacks`: what each process's samples share."""

    py_spy: str
    owner: dict[int, Any]  # pid -> uid
    per_pid: int
    interval_s: float
    deadline: float
    budget: _Budget
    dump: Dump
    retry: Dump | None  # the stopping sample, for a nonblocking one that failed
    native_dump: Dump | None
    sleep: Callable[[float], None]
    clock: Callable[[], float]
    start: float

    def one(self, pid: int) -> Signal:
        """The ``stack`` signal of one process (run on its own :class:`_Worker`)."""
        uid, budget = self.owner[pid], self.budget
        taken: list[list[dict[str, Any]]] = []
        for i in range(self.per_pid):
            if i:
                self.sleep(max(0.0, min(self.interval_s, self.deadline - self.clock())))
            got = budget.call(uid, self.dump, self.py_spy, pid, PY_SPY_TIMEOUT_S)
            if isinstance(got, str) and self.retry is not None and Path(f"/proc/{pid}").exists():
                again = budget.call(uid, self.retry, self.py_spy, pid, BLOCKING_TIMEOUT_S)
                got = got if again is None else again
            if got is None:
                if not taken:
                    return Signal.unavailable(
                        "stack",
                        f"not sampled: {budget.why_not(uid)} "
                        f"({self.clock() - self.start:.1f} s into sampling)",
                        not_sampled="deadline" if budget.quota[uid] > 0 else "budget",
                        uid=uid,
                    )
                break
            if isinstance(got, str):
                return Signal.unavailable("stack", got, samples_taken=len(taken))
            taken.append(got)
        native: list[dict[str, Any]] | str | None = None
        if self.native_dump is not None and _stuck(taken) and classify(taken[-1]).kind == "other":
            native = budget.call(uid, self.native_dump, self.py_spy, pid, BLOCKING_TIMEOUT_S)
            if native is None:
                native = f"not taken: {budget.why_not(uid)}"
        return _signal(taken, native, cut=len(taken) < self.per_pid)


class _Worker(threading.Thread):
    """One process's samples on a daemon thread (one that never returns cannot keep the agent
    from exiting)."""

    def __init__(self, fn: Callable[[int], Signal], pid: int) -> None:
        super().__init__(name=f"py-spy-{pid}", daemon=True)
        self.fn, self.pid = fn, pid
        self.result: Signal | None = None

    def run(self) -> None:
        self.result = self.fn(self.pid)


def _choose(
    pids: list[int], owner: Mapping[int, Any], per_pid: int, max_calls: int
) -> tuple[list[int], dict[int, int]]:
    """The pids to sample, taken in turn from each uid (in the order given) while their
    ``per_pid`` calls fit in ``max_calls``; and the others, each with how many of its uid's
    processes were sampled."""
    queues: dict[Any, list[int]] = {}
    for pid in pids:
        queues.setdefault(owner[pid], []).append(pid)
    chosen: list[int] = []
    room = max(per_pid, max_calls)  # at least one process is always sampled
    while room >= per_pid and any(queues.values()):
        for queue in queues.values():
            if queue and room >= per_pid:
                chosen.append(queue.pop(0))
                room -= per_pid
    taken = {uid: sum(owner[p] == uid for p in chosen) for uid in queues}
    return chosen, {pid: taken[owner[pid]] for q in queues.values() for pid in q}


def _stuck(samples: list[list[dict[str, Any]]]) -> bool:
    keys = [[(f.get("name"), f.get("filename"), f.get("line")) for f in s] for s in samples]
    return len(samples) > 1 and all(k == keys[0] for k in keys) and bool(samples[-1])


def _blocked(
    last: list[dict[str, Any]],
    native: list[dict[str, Any]] | str | None,
) -> tuple[Blocked, str | None]:
    """What the last sample waits in, refined by a native sample; and a note on the latter."""
    blocked = classify(last)
    if native is None:
        return blocked, None
    if isinstance(native, str):
        return blocked, f"native frames unavailable: {native}"
    deeper = classify(native)
    if deeper.waits_on_peers:
        return Blocked(deeper.kind, deeper.frame, f"{deeper.via} (native frames)"), None
    return blocked, "native frames name no collective or GPU wait"


def _signal(
    samples: list[list[dict[str, Any]]],
    native: list[dict[str, Any]] | str | None = None,
    cut: bool = False,
) -> Signal:
    if not samples:
        return Signal.unavailable("stack", "no time left in the check's timeout to sample")
    keys = [[(f.get("name"), f.get("filename"), f.get("line")) for f in s] for s in samples]
    identical = len(samples) > 1 and all(k == keys[0] for k in keys)
    last = samples[-1]
    stuck_in = frame_text(last[0]) if identical and last else None
    blocked, native_note = _blocked(last, native)
    detail = (
        f"the same stack in {len(samples)} samples, stuck in {stuck_in}"
        if stuck_in
        else f"the stack changed between {len(samples)} samples"
        if len(samples) > 1
        else "one sample only: cannot tell whether the stack moves"
    )
    if stuck_in:
        detail += f"; blocked in {blocked.kind.replace('_', ' ')} ({blocked.via})"
    if cut:
        detail += " (sampling cut short by the check's deadline or its py-spy budget)"
    figures: dict[str, Any] = {
        "samples": len(samples),
        "identical": identical,
        "stuck_in": stuck_in,
        "in_collective": blocked.waits_on_peers,
        "blocked_in": blocked.to_dict(),
        "frames": [frame_text(f) for f in last[:MAX_FRAMES]],
    }
    if native is not None:
        figures["native_sample"] = native_note or "used"
    return Signal("stack", True, identical and bool(last), detail, figures)
