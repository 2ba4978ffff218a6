"""Stack samples of training processes with ``py-spy dump --json``: the ``stack`` hang signal.

A rank blocked for good shows the same main-thread stack sample after sample; a rank outside a
collective while its hung peers wait inside one is the likely origin of a job-wide hang. All
processes of a job are sampled in the same rounds (one ``py-spy`` per process per round, run
concurrently), so their samples describe the same moments and sampling eight ranks takes no
longer than sampling one.

``py-spy dump`` briefly stops the process while it reads its memory (tens of ms; measured in
``bench/bench_hang.py``). It needs ptrace permission: root, ``CAP_SYS_PTRACE``, or
``kernel.yama.ptrace_scope=0``. Every way it can fail (not installed, no permission, process
gone, output that is not JSON) is an unavailable signal with the reason, never an exception.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.training.blocking import Blocked, classify
from node_agent.training.signals import Signal

PY_SPY_TIMEOUT_S = 10.0
PY_SPY_MISSING = (f"py-spy is not installed, though node-agent depends on it: {sys.executable} -m pip "
                  "install 'py-spy>=0.3.14' (or put py-spy on the agent's PATH)")
PTRACE_FIX = ("py-spy needs ptrace permission: run the agent as root or with CAP_SYS_PTRACE, "
              "or set kernel.yama.ptrace_scope=0")
MAX_FRAMES = 20


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


def in_collective(frames: list[dict[str, Any]]) -> bool:
    """Whether a stack waits on its peers: blocked in a collective, or on the GPU
    (:func:`node_agent.training.blocking.classify`)."""
    return classify(frames).waits_on_peers


def dump_once(py_spy: str, pid: int, timeout_s: float,
              native: bool = False) -> list[dict[str, Any]] | str:
    """One sample: the main thread's frames, innermost first; or why there is none.
    ``native`` adds the C/C++ frames (``py-spy dump --native``), where ``c10d::Work::wait``
    and the CUDA synchronise calls show."""
    argv = [py_spy, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])
    done = proc.run(argv, timeout_s=timeout_s)
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


def sample_stacks(py_spy: str | None, pids: Sequence[int], samples: int, interval_s: float,
                  deadline: float, *, sleep: Callable[[float], None] = time.sleep,
                  dump: Callable[[str, int, float], list[dict[str, Any]] | str] = dump_once,
                  native_dump: Callable[[str, int, float], list[dict[str, Any]] | str] | None
                  = None) -> dict[int, Signal]:
    """The ``stack`` signal of each pid from ``samples`` rounds ``interval_s`` apart.

    ``hang`` is True when every sample of the process's main thread is the same (names, files
    and lines). Figures: ``samples``, ``identical``, ``stuck_in`` (the innermost frame when
    identical), ``blocked_in`` (what the stack waits in: kind, deciding frame, rule;
    :mod:`node_agent.training.blocking`), ``in_collective`` (it waits on its peers: a
    collective or the GPU) and ``frames`` (the last sample, innermost first). Sampling stops at
    ``deadline`` (monotonic seconds).

    A stuck process whose Python stack says only "the job's own code" gets one more sample
    with native frames (``native_dump``; by default ``py-spy dump --native`` when ``dump`` is
    the real one): ``Work.wait()`` and ``.item()`` are C++ and show only there. What the native
    frames say is used when they name a collective or a GPU wait."""
    if not pids:
        return {}
    if py_spy is None:
        return {pid: Signal.unavailable("stack", PY_SPY_MISSING) for pid in pids}
    if native_dump is None and dump is dump_once:
        native_dump = functools.partial(dump_once, native=True)
    stacks: dict[int, list[list[dict[str, Any]]]] = {pid: [] for pid in pids}
    failed: dict[int, str] = {}
    natives: dict[int, list[dict[str, Any]] | str] = {}
    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        for i in range(max(1, samples)):
            if i:
                sleep(interval_s)
            left = deadline - time.monotonic()
            todo = [pid for pid in pids if pid not in failed]
            if left <= 1 or not todo:
                break
            timeout = [min(PY_SPY_TIMEOUT_S, left)] * len(todo)
            for pid, got in zip(todo, pool.map(dump, [py_spy] * len(todo), todo, timeout),
                                strict=True):
                if isinstance(got, str):
                    failed[pid] = got
                else:
                    stacks[pid].append(got)
        ambiguous = [pid for pid in pids if pid not in failed and _stuck(stacks[pid])
                     and classify(stacks[pid][-1]).kind == "other"]
        left = deadline - time.monotonic()
        if native_dump is not None and ambiguous and left > 1:
            timeout = [min(PY_SPY_TIMEOUT_S, left)] * len(ambiguous)
            natives = dict(zip(ambiguous, pool.map(native_dump, [py_spy] * len(ambiguous),
                                                   ambiguous, timeout), strict=True))
    return {pid: (Signal.unavailable("stack", failed[pid], samples_taken=len(stacks[pid]))
                  if pid in failed else _signal(stacks[pid], natives.get(pid)))
            for pid in pids}


def _stuck(samples: list[list[dict[str, Any]]]) -> bool:
    keys = [[(f.get("name"), f.get("filename"), f.get("line")) for f in s] for s in samples]
    return len(samples) > 1 and all(k == keys[0] for k in keys) and bool(samples[-1])


def _blocked(last: list[dict[str, Any]], native: list[dict[str, Any]] | str | None,
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


def _signal(samples: list[list[dict[str, Any]]],
            native: list[dict[str, Any]] | str | None = None) -> Signal:
    if not samples:
        return Signal.unavailable("stack", "no time left in the check's timeout to sample")
    keys = [[(f.get("name"), f.get("filename"), f.get("line")) for f in s] for s in samples]
    identical = len(samples) > 1 and all(k == keys[0] for k in keys)
    last = samples[-1]
    stuck_in = frame_text(last[0]) if identical and last else None
    blocked, native_note = _blocked(last, native)
    detail = (f"the same stack in {len(samples)} samples, stuck in {stuck_in}" if stuck_in
              else f"the stack changed between {len(samples)} samples" if len(samples) > 1
              else "one sample only: cannot tell whether the stack moves")
    if stuck_in:
        detail += f"; blocked in {blocked.kind.replace('_', ' ')} ({blocked.via})"
    figures: dict[str, Any] = {
        "samples": len(samples), "identical": identical, "stuck_in": stuck_in,
        "in_collective": blocked.waits_on_peers, "blocked_in": blocked.to_dict(),
        "frames": [frame_text(f) for f in last[:MAX_FRAMES]]}
    if native is not None:
        figures["native_sample"] = native_note or "used"
    return Signal("stack", True, identical and bool(last), detail, figures)
