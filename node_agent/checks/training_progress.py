"""Check ``training_progress``: hung and straggling training processes on this node.

Finds the node's training processes (:mod:`node_agent.training.processes`: heartbeat writers,
the GPU compute processes NVML lists, or ``params.pids``), looks at each in up to five ways
(:mod:`node_agent.training.signals`) and decides (:mod:`node_agent.training.verdict`):

- ``heartbeat``: no step for ``stall_after_s`` (raised to ``hang_step_multiple`` x its own step
  time, so a slow loop is never called hung), unless a declared pause covers it;
- ``stack``: the same main-thread stack over ``stack_samples`` py-spy samples
  (:mod:`node_agent.training.stacks`), taken only for the jobs in which another signal fired;
- ``gpu_activity``: its GPUs busy while drawing idle power and moving no memory (a spinning
  collective kernel); ``rdma_traffic``: no RDMA port moved data while its stacks were sampled;
- ``log_silence``: its log (``NODE_AGENT_TRAIN_LOG``) unwritten for ``log_silence_s``.

Per process: ``training_hang`` ``fail`` (ERROR: the scheduler restarts the job) when ``agree``
signals agree or the heartbeat alone is silent for ``hang_after_s``; ``training_straggler``
``warn`` when its step time stays at least ``straggler_ratio`` x its peers' median for
``straggler_for_s``; else ``training_progress`` ``pass``. Target ``job:<job>/rank:<rank>``
(``/pid:<pid>`` when the rank is unknown or not unique in the job). The first report of a hang
writes the job's full evidence to ``<state_dir>/hang/evidence/``.

Params: the :class:`~node_agent.training.verdict.Thresholds` fields, ``stack_samples`` (3),
``stack_interval_s`` (1), ``log_silence_s`` (60), ``log_file`` (for processes that name
none), ``stale_file_s`` (86400), ``spool_dir``, ``py_spy``, ``sysfs_root`` (RDMA), ``pids``,
``sample_all`` (false: sample stacks of every process, as ``hang-check`` does).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node_agent.checks import CheckContext
from node_agent.checks.rdma import SYSFS_ROOT
from node_agent.gpu.base import GpuDevice, GpuError
from node_agent.model import Result, Status
from node_agent.training import activity
from node_agent.training.processes import TrainingProcess, discover
from node_agent.training.signals import NAMES, Signal
from node_agent.training.stacks import find_py_spy, sample_stacks
from node_agent.training.state import HangState, process_key
from node_agent.training.verdict import (
    Thresholds,
    heartbeat_signal,
    likely_origin,
    stragglers,
    verdict,
)

NO_PROCESSES = ("no training process found: none writes heartbeats (node_agent.heartbeat) and "
                "NVML lists no GPU compute process")
NOT_SAMPLED = "not sampled: no other signal of its job suggests a hang"
_UNSAFE_TARGET = re.compile(r"[^A-Za-z0-9_.:/@+=-]+")


def spool_dir(ctx: CheckContext) -> Path:
    """``params.spool_dir``, else ``<config spool_dir>/heartbeat`` (default
    ``/var/spool/node-agent/heartbeat``), where ``node_agent.heartbeat`` writes by default."""
    if ctx.params.get("spool_dir"):
        return Path(ctx.params["spool_dir"])
    return ctx.config.spool_dir / "heartbeat"


def _state_base(ctx: CheckContext) -> Path:
    return Path(ctx.state_dir if ctx.state_dir is not None else ctx.config.state_dir)


def _devices(ctx: CheckContext) -> list[GpuDevice] | None:
    """The GPUs to read, or None on a node without usable GPU access (the GPU signals then say
    unavailable; the other signals still work)."""
    if ctx.gpu is None or ctx.gpu.unavailable_reason:
        return None
    try:
        return list(ctx.gpu.devices())
    except GpuError:
        return None


def run(ctx: CheckContext) -> list[Result]:
    p, th = ctx.params, Thresholds.from_params(ctx.params)
    start, now = time.monotonic(), time.time()
    devices = _devices(ctx)
    pids = [int(x) for x in p["pids"]] if p.get("pids") else None
    spool = spool_dir(ctx)
    found = discover(spool, devices, pids)
    out = [ctx.result("node", "training_discovery", Status.WARN, message, subject=subject)
           for subject, message in found.problems]
    state = HangState.load(_state_base(ctx) / "hang", now)
    if state.problem:
        out.append(ctx.result("node", "training_state", Status.WARN, state.problem))
    # a spool file that is not a heartbeat is reported once (the spool is every training
    # user's to write: one bad file must neither crash the check nor repeat a WARN forever)
    out += [ctx.result("node", "training_discovery", Status.WARN,
                       f"heartbeat spool file {path} is not a heartbeat ({reason}); skipped: it "
                       "was not written by node_agent.heartbeat, inspect and remove it "
                       "(reported once)", subject="node", file=str(path))
            for path, reason in state.new_bad_files(found.bad_files)]
    _remove_stale(found.dead_heartbeats, now, float(p.get("stale_file_s", 86400)))
    me = os.getpid()  # the agent's own GPU workers (burn, SDC probes) are not training
    procs = [pr for pr in found.processes if pr.pid != me and me not in pr.parents]
    if not procs:
        state.keep_only(set())
        with contextlib.suppress(OSError):
            state.save()
        dead = (f"; {len(found.dead_heartbeats)} heartbeat file(s) in {spool} are of exited "
                "processes" if found.dead_heartbeats else "")
        return out or [ctx.skip(NO_PROCESSES + dead, metric="training_progress")]
    signals = _cheap_signals(ctx, procs, devices, now, th)
    suspect_jobs = {pr.job for pr in procs if any(s.hang for s in signals[pr.pid].values())}
    sample_all = bool(p.get("sample_all"))
    _sample(ctx, [pr for pr in procs if sample_all or pr.job in suspect_jobs], signals, start)

    keys = {pr.pid: process_key(pr.pid, pr.start_ticks) for pr in procs}
    state.keep_only(set(keys.values()))
    verdicts = {}
    for pr in procs:
        mem = state.processes.setdefault(keys[pr.pid], {})
        # would the signals make a hang if they had held long enough? (the veto included)
        holding = verdict(list(signals[pr.pid].values()), th, agreeing_since_s=float("inf"),
                          has_heartbeat=pr.heartbeat is not None)
        if holding.hung:
            mem.setdefault("agree_since", now)
        else:
            mem.pop("agree_since", None)
        since = now - mem["agree_since"] if "agree_since" in mem else None
        verdicts[pr.pid] = verdict(list(signals[pr.pid].values()), th, agreeing_since_s=since,
                                   has_heartbeat=pr.heartbeat is not None)
        if not verdicts[pr.pid].hung:
            mem.pop("reported", None)

    jobs: dict[str | None, list[TrainingProcess]] = {}
    for pr in procs:
        jobs.setdefault(pr.job, []).append(pr)
    origin: dict[int, bool] = {}
    for members in jobs.values():
        origin.update(likely_origin([(pr.pid, verdicts[pr.pid].hung, signals[pr.pid]["stack"])
                                     for pr in members]))
    slow = _stragglers(jobs, verdicts, state, keys, now, th)
    targets = _targets(jobs)

    evidence_files = _write_evidence(ctx, state, jobs, verdicts, signals, origin, keys, now)
    for pr in procs:
        v, sig = verdicts[pr.pid], signals[pr.pid]
        ev = _evidence(pr, sig, v.agreeing, origin.get(pr.pid))
        age = sig["heartbeat"].figures.get("age_s") if sig["heartbeat"].available else None
        if v.hung:
            ev["evidence_file"] = evidence_files.get(pr.pid) or state.processes[
                keys[pr.pid]].get("reported")
            out.append(ctx.result(targets[pr.pid], "training_hang", Status.FAIL,
                                  _hang_detail(pr, v.why, sig, origin.get(pr.pid)),
                                  value=age, unit="s", **ev))
        elif pr.pid in slow:
            s = slow[pr.pid]
            out.append(ctx.result(
                targets[pr.pid], "training_straggler", Status.WARN,
                f"{_who(pr)}: recent {s.what} {s.step_time_s:.3f} s is {s.ratio:.1f}x the "
                f"median of its {s.peers} peer(s) on this node ({s.peers_median_s:.3f} s; "
                f"threshold {th.straggler_ratio:g}x, held for {th.straggler_for_s:g} s); it sets "
                "the pace of the whole job", value=round(s.ratio, 2), unit="x",
                peers_median_s=s.peers_median_s, compared=s.basis, **ev))
        else:
            out.append(ctx.result(targets[pr.pid], "training_progress", Status.PASS,
                                  f"{_who(pr)}: {sig['heartbeat'].detail if age is not None else v.why}",
                                  value=age, unit="s", **ev))
    with contextlib.suppress(OSError):
        state.save()
    return out


def _remove_stale(paths: Sequence[Path], now: float, stale_s: float) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > stale_s:
                path.unlink()


def _cheap_signals(ctx: CheckContext, procs: list[TrainingProcess],
                   devices: list[GpuDevice] | None,
                   now: float, th: Thresholds) -> dict[int, dict[str, Signal]]:
    """heartbeat, gpu_activity and log_silence of every process (no waiting, no ptrace)."""
    readings: dict[int, activity.GpuActivity] = {}
    by_index = {d.index: d for d in devices or []}
    silence_s = float(ctx.params.get("log_silence_s", 60))
    out = {}
    for pr in procs:
        if not pr.gpus:
            gpu = Signal.unavailable("gpu_activity", "NVML lists no GPU for this process"
                                     if devices else "no GPU readings on this node")
        else:
            for i in pr.gpus:
                if i not in readings and i in by_index:
                    readings[i] = activity.read_gpu_activity(by_index[i])
            gpu = activity.gpu_activity_signal([readings[i] for i in pr.gpus if i in readings])
        out[pr.pid] = {
            "heartbeat": heartbeat_signal(pr.heartbeat, now, th),
            "stack": Signal.unavailable("stack", NOT_SAMPLED),
            "gpu_activity": gpu,
            "rdma_traffic": Signal.unavailable("rdma_traffic", "read only while a process is "
                                                               "suspected"),
            "log_silence": activity.log_silence_signal(pr.log_file or ctx.params.get("log_file"),
                                                       now=now, silence_s=silence_s),
        }
    return out


def _sample(ctx: CheckContext, suspects: list[TrainingProcess],
            signals: dict[int, dict[str, Signal]], start: float) -> None:
    """Stacks of every process in a suspect job, with the RDMA counters before and after."""
    if not suspects:
        return
    p = ctx.params
    root = Path(p.get("sysfs_root") or SYSFS_ROOT)
    before, t0 = activity.read_port_counters(root), time.monotonic()
    stacks = sample_stacks(find_py_spy(p.get("py_spy")), [pr.pid for pr in suspects],
                           int(p.get("stack_samples", 3)), float(p.get("stack_interval_s", 1.0)),
                           start + 0.6 * ctx.timeout_s)
    window = time.monotonic() - t0
    rdma_signal = activity.rdma_traffic_signal(before, activity.read_port_counters(root), window)
    for pr in suspects:
        signals[pr.pid]["stack"] = stacks[pr.pid]
        signals[pr.pid]["rdma_traffic"] = rdma_signal


def _stragglers(jobs, verdicts, state: HangState, keys, now: float, th: Thresholds):
    """pid -> Straggler for ranks slow for at least ``straggler_for_s`` (kept in the state)."""
    out = {}
    for members in jobs.values():
        stepping = [pr for pr in members if not verdicts[pr.pid].hung and pr.heartbeat
                    and pr.heartbeat.get("step_time_s") and not pr.heartbeat.get("pause")]
        basis = ("compute_time_s" if stepping and all(pr.heartbeat.get("compute_time_s")
                                                      for pr in stepping) else "step_time_s")
        times = {pr.pid: float(pr.heartbeat[basis]) for pr in stepping}
        slow = {s.pid: s for s in stragglers(times, th.straggler_ratio, basis)}
        for pr in members:
            mem = state.processes[keys[pr.pid]]
            if pr.pid not in slow:
                mem.pop("straggle_since", None)
                continue
            since = mem.setdefault("straggle_since", now)
            if now - since >= th.straggler_for_s:
                out[pr.pid] = slow[pr.pid]
    return out


def _clean(text: Any) -> str:
    return _UNSAFE_TARGET.sub("_", str(text))[:128]


def _targets(jobs: dict[str | None, list[TrainingProcess]]) -> dict[int, str]:
    out = {}
    for job, members in jobs.items():
        ranks = [pr.rank for pr in members]
        for pr in members:
            who = (f"rank:{pr.rank}" if pr.rank is not None and ranks.count(pr.rank) == 1
                   else f"pid:{pr.pid}")
            # a job the kernel does not vouch for is named so that no adapter restarts it; a
            # pod's carries its UID from the cgroup, which the Kubernetes adapter checks
            name = pr.restart_job_id if pr.job_verified else f"unverified:{job or 'unknown'}"
            out[pr.pid] = f"job:{_clean(name)}/{who}"
    return out


def _who(pr: TrainingProcess) -> str:
    rank = "rank ?" if pr.rank is None else f"rank {pr.rank}"
    return f"{rank} (pid {pr.pid}, job {_clean(pr.job)})"


def _hang_detail(pr: TrainingProcess, why: str, sig: dict[str, Signal],
                 origin: bool | None) -> str:
    stack = sig["stack"]
    stack_note = (f"; stuck in {stack.figures['stuck_in']}" if stack.figures.get("stuck_in")
                  else "" if stack.available else f"; stack unavailable ({stack.detail})")
    origin_note = {True: "; likely origin: its stack is outside a collective while its hung "
                         "peers' are inside one",
                   False: "; waiting in a collective on a peer"}.get(origin, "")
    return (f"{_who(pr)}: training hang suspected ({why}){stack_note}{origin_note}; the job "
            f"needs a restart (evidence in the state dir; py-spy dump --pid {pr.pid})")


def _evidence(pr: TrainingProcess, sig: dict[str, Signal], agreeing: Sequence[str],
              origin: bool | None) -> dict[str, Any]:
    hb = pr.heartbeat or {}
    beat = sig["heartbeat"]
    return {"pid": pr.pid, "rank": pr.rank, "local_rank": pr.local_rank,
            "world_size": pr.world_size, "job": pr.job, "step": hb.get("step"),
            "step_time_s": hb.get("step_time_s"), "compute_time_s": hb.get("compute_time_s"),
            "heartbeat_age_s": beat.figures.get("age_s") if beat.available else None,
            "gpus": list(pr.gpus), "agreeing": list(agreeing), "likely_origin": origin,
            "signals": {name: sig[name].to_dict() for name in NAMES},
            "process": pr.to_evidence()}


def _write_evidence(ctx, state: HangState, jobs, verdicts, signals, origin, keys,
                    now: float) -> dict[int, str]:
    """One evidence file per job with a newly reported hang; pid -> its path."""
    written: dict[int, str] = {}
    for job, members in jobs.items():
        new = [pr for pr in members if verdicts[pr.pid].hung
               and not state.processes[keys[pr.pid]].get("reported")]
        if not new:
            continue
        evidence = {"job": job, "host": ctx.inventory.host.hostname if ctx.inventory else socket.gethostname(),
                    "reported_at": now, "processes": [
                        {**_evidence(pr, signals[pr.pid], verdicts[pr.pid].agreeing,
                                     origin.get(pr.pid)),
                         "hung": verdicts[pr.pid].hung, "why": verdicts[pr.pid].why}
                        for pr in members]}
        try:
            path = str(state.write_evidence(job, now, evidence))
        except OSError:
            continue  # no writable state dir: the result itself still carries the evidence
        for pr in new:
            state.processes[keys[pr.pid]]["reported"] = path
            written[pr.pid] = path
    return written
