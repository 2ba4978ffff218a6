"""Check ``training_progress``: hung and straggling training processes on this node.

Training processes instrumented with ``node_agent.heartbeat.Heartbeat`` write their last step
to ``<state_dir>/spool/heartbeat/<pid>.json`` (see ``docs/training_hangs.md``). This check reads
those files and, for each process that is still alive (same pid *and* same start time, so a
reused pid is not mistaken for the writer):

- no new step for ``hang_after_s`` (and for ``hang_step_multiple`` times its own recent step
  time, so a slow but progressing loop is never called hung) -> ``training_hang`` ``fail``
  (grade ERROR) on ``rank:<rank>`` (``pid:<pid>`` when the rank is unknown or not unique);
- among the live, progressing ranks of one job, a recent step time of at least
  ``straggler_ratio`` times the median of its peers' -> ``training_straggler`` ``warn`` (WARN);
- otherwise ``training_progress`` ``pass`` with the seconds since the last step.

A hung process is sampled with ``py-spy dump --json`` (``stack_samples`` times,
``stack_interval_s`` apart): identical stacks are a second hang signal ("stuck in <frame>"),
and a hung rank whose stack is outside a collective while its hung peers' stacks are inside one
is marked ``likely_origin``. No py-spy, no ptrace permission or a process that exits mid-sample
leave the stack signal ``available: false`` with the reason; never a crash.

Heartbeat files of exited processes are ignored, and removed once older than
``stale_file_s``.

Params (defaults): ``hang_after_s`` 300, ``hang_step_multiple`` 5, ``straggler_ratio`` 2.0,
``stack_samples`` 3, ``stack_interval_s`` 1, ``stale_file_s`` 86400, ``spool_dir``
(``<state_dir>/spool/heartbeat``), ``py_spy`` (path; default py-spy on PATH or next to the
running Python).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .. import proc
from ..heartbeat import process_start_ticks, read_heartbeats
from ..model import Result, Status
from . import CheckContext

#: frame-name fragments of a rank blocked in a collective or a barrier (torch.distributed,
#: NCCL/gloo work objects); a hung rank *not* in one while its peers are is the likely origin
COLLECTIVE_WORDS = ("all_reduce", "allreduce", "barrier", "broadcast", "all_gather",
                    "allgather", "reduce_scatter", "wait")
PY_SPY_TIMEOUT_S = 10.0
NO_HEARTBEATS = "no training process writes heartbeats (node_agent.heartbeat)"


def spool_dir(ctx: CheckContext) -> Path:
    if ctx.params.get("spool_dir"):
        return Path(ctx.params["spool_dir"])
    base = ctx.state_dir if ctx.state_dir is not None else ctx.config.state_dir
    return Path(base) / "spool" / "heartbeat"


def alive(record: dict[str, Any]) -> bool:
    """The heartbeat's writer still runs: its pid exists, is not a zombie, and (where both are
    known) started at the same tick as the writer did."""
    import psutil

    pid = int(record["pid"])
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        pass  # it exists; we may not read its state
    written, now = record.get("start_ticks"), process_start_ticks(pid)
    return written is None or now is None or written == now


def find_py_spy(ctx: CheckContext) -> str | None:
    if ctx.params.get("py_spy"):
        return str(ctx.params["py_spy"])
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
    return any(w in str(f.get("name", "")).lower() for f in frames for w in COLLECTIVE_WORDS)


def sample_stacks(py_spy: str | None, pid: int, samples: int, interval_s: float,
                  deadline: float, sleep=time.sleep) -> dict[str, Any]:
    """Sample ``pid``'s stack with ``py-spy dump --json``; the stack signal as evidence.

    ``{"available": False, "reason": ...}`` when it cannot be read; otherwise ``identical``
    (every sample the same innermost-first frames of the main thread), ``stuck_in`` (the
    innermost frame when identical), ``in_collective`` and ``frames`` (the last sample)."""
    if py_spy is None:
        return {"available": False, "reason": "py-spy is not installed (pip install py-spy, "
                                                "or put it on the agent's PATH)"}
    stacks: list[list[dict[str, Any]]] = []
    for i in range(max(1, samples)):
        if i:
            sleep(interval_s)
        left = deadline - time.monotonic()
        if left <= 1:
            break
        done = proc.run([py_spy, "dump", "--pid", str(pid), "--json"],
                        timeout_s=min(PY_SPY_TIMEOUT_S, left))
        if not done.ok:
            gone = not Path(f"/proc/{pid}").exists()
            reason = (f"process {pid} exited during stack sampling" if gone
                      else done.describe_failure())
            if not gone and "permission" in (done.stderr + done.stdout).lower():
                reason += (" (py-spy needs ptrace permission: run the agent as root or with "
                           "CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope=0)")
            return {"available": False, "reason": reason, "samples_taken": len(stacks)}
        try:
            thread = main_thread(json.loads(done.stdout))
        except (ValueError, TypeError, AttributeError) as err:
            return {"available": False, "reason": f"py-spy printed no JSON stack dump ({err})",
                    "samples_taken": len(stacks)}
        stacks.append(list(thread.get("frames") or []) if thread else [])
    if not stacks:
        return {"available": False, "reason": "no time left in the check's timeout to sample"}
    keys = [[(f.get("name"), f.get("filename"), f.get("line")) for f in s] for s in stacks]
    identical = len(stacks) > 1 and all(k == keys[0] for k in keys)
    last = stacks[-1]
    return {"available": True, "samples": len(stacks), "identical": identical,
            "stuck_in": frame_text(last[0]) if identical and last else None,
            "in_collective": in_collective(last),
            "frames": [frame_text(f) for f in last[:20]]}


def _target(record: dict[str, Any], ranks: list[Any]) -> str:
    rank = record.get("rank")
    if rank is not None and ranks.count(rank) == 1:
        return f"rank:{rank}"
    return f"pid:{record['pid']}"


def _who(r: dict[str, Any]) -> str:
    rank = "rank ?" if r.get("rank") is None else f"rank {r['rank']}"
    return f"{rank} (pid {r['pid']}, job {r.get('job')})"


def run(ctx: CheckContext) -> list[Result]:
    p = ctx.params
    hang_after_s = float(p.get("hang_after_s", 300))
    multiple = float(p.get("hang_step_multiple", 5))
    ratio = float(p.get("straggler_ratio", 2.0))
    stale_s = float(p.get("stale_file_s", 86400))
    spool = spool_dir(ctx)
    start = time.monotonic()
    now = time.time()
    errors: list[tuple[Path, str]] = []
    beats = read_heartbeats(spool, errors)
    out: list[Result] = []
    for path, reason in errors:
        out.append(ctx.result("node", "heartbeat_unreadable", Status.WARN,
                              f"heartbeat file {path} is not a heartbeat ({reason}); it was not "
                              "written by node_agent.heartbeat: inspect and remove it",
                              file=str(path)))
    live, dead = [], 0
    for path, record in beats:
        if alive(record):
            live.append(record)
            continue
        dead += 1
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > stale_s:
                path.unlink()
    if not live:
        if not beats and not errors:
            return [ctx.skip(NO_HEARTBEATS, metric="training_progress")]
        if not errors:
            return [ctx.skip(f"{NO_HEARTBEATS}: {dead} heartbeat file(s) in {spool} are of "
                             "exited processes", metric="training_progress")]
        return out
    ranks = [r.get("rank") for r in live]
    hung, progressing = [], []
    for r in live:
        r["age_s"] = max(0.0, now - float(r["step_at"]))
        step_time = r.get("step_time_s")
        r["hang_threshold_s"] = max(hang_after_s, multiple * float(step_time or 0.0))
        (hung if r["age_s"] > r["hang_threshold_s"] else progressing).append(r)

    # stack signal for the hung ones, all sampled within ~60% of the check's timeout
    stacks: dict[int, dict[str, Any]] = {}
    if hung:
        py_spy = find_py_spy(ctx)
        deadline = start + 0.6 * ctx.timeout_s
        for r in hung:
            stacks[r["pid"]] = sample_stacks(
                py_spy, int(r["pid"]), int(p.get("stack_samples", 3)),
                float(p.get("stack_interval_s", 1.0)), deadline)
    origin = _likely_origin(hung, stacks)
    for r in hung:
        s = stacks[r["pid"]]
        stack_note = (f"; stack: stuck in {s['stuck_in']}" if s.get("stuck_in")
                      else "; stack: " + ("changing between samples" if s["available"]
                                          else f"unavailable ({s['reason']})"))
        origin_note = {True: "; likely origin: its stack is outside a collective while its hung "
                             "peers' are inside one",
                       False: "; waiting in a collective on a peer"}.get(origin.get(r["pid"]), "")
        out.append(ctx.result(
            _target(r, ranks), "training_hang", Status.FAIL,
            f"{_who(r)}: no training step for {r['age_s']:.1f} s (last step {r['step']}, "
            f"threshold {r['hang_threshold_s']:.1f} s) while the process is alive"
            f"{stack_note}{origin_note}; dump its stacks (py-spy dump --pid {r['pid']}) and "
            "restart the job",
            value=round(r["age_s"], 1), unit="s", **_evidence(r), stack=s,
            likely_origin=origin.get(r["pid"])))
    out.extend(_stragglers(ctx, progressing, ranks, ratio))
    for r in progressing:
        out.append(ctx.result(
            _target(r, ranks), "training_progress", Status.PASS,
            f"{_who(r)}: step {r['step']}, {r['age_s']:.1f} s since the last step",
            value=round(r["age_s"], 1), unit="s", **_evidence(r)))
    return out


def _evidence(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("pid", "rank", "local_rank", "world_size", "job", "step",
                                  "step_time_s", "hang_threshold_s")}


def _likely_origin(hung: list[dict[str, Any]], stacks: dict[int, dict[str, Any]]) -> dict[int, bool]:
    """pid -> likely origin, per job with at least two hung ranks whose stacks were read: the
    ranks outside a collective while some of their peers are inside one."""
    out: dict[int, bool] = {}
    jobs: dict[Any, list[dict[str, Any]]] = {}
    for r in hung:
        if stacks[r["pid"]].get("available"):
            jobs.setdefault(r.get("job"), []).append(r)
    for members in jobs.values():
        inside = [stacks[r["pid"]]["in_collective"] for r in members]
        if len(members) < 2 or all(inside) or not any(inside):
            continue  # nothing stands out
        for r, is_inside in zip(members, inside, strict=True):
            out[r["pid"]] = not is_inside
    return out


def _stragglers(ctx: CheckContext, progressing: list[dict[str, Any]], ranks: list[Any],
                ratio: float) -> list[Result]:
    out = []
    jobs: dict[Any, list[dict[str, Any]]] = {}
    for r in progressing:
        if r.get("step_time_s"):
            jobs.setdefault(r.get("job"), []).append(r)
    for members in jobs.values():
        for r in members:
            peers = [float(o["step_time_s"]) for o in members if o is not r]
            if not peers:
                continue
            median = statistics.median(peers)
            mine = float(r["step_time_s"])
            if median > 0 and mine >= ratio * median:
                out.append(ctx.result(
                    _target(r, ranks), "training_straggler", Status.WARN,
                    f"{_who(r)}: recent step time {mine:.3f} s is {mine / median:.1f}x the "
                    f"median of its {len(peers)} peer(s) on this node ({median:.3f} s; "
                    f"threshold {ratio:g}x); it sets the pace of the whole job",
                    value=round(mine / median, 2), unit="x", peers_median_step_time_s=median,
                    **_evidence(r)))
    return out
