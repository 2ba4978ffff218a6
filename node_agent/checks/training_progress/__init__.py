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

Per process: ``training_hang`` when ``agree`` signals agree or the heartbeat alone is silent for
``hang_after_s``: ``fail`` (ERROR: the scheduler restarts the job) when the kernel vouches for
its job (``TrainingProcess.job_verified``), else ``warn`` naming its uid (nothing is
restarted: a user's own idle process with a stale heartbeat looks the same); ``training_straggler``
``warn`` when its step time stays at least ``straggler_ratio`` x its peers' median for
``straggler_for_s``; else ``training_progress`` ``pass``. Target ``job:<job>/rank:<rank>``
(``/pid:<pid>`` when the rank is unknown or not unique in the job). The first report of a hang
writes the job's full evidence to ``<state_dir>/hang/evidence/`` (a verified job's only).

Everything read here is the training users' to shape, so the check must return before the
runner's deadline (``ctx.deadline``; past it the check is ``check-hang``): each stage that reads
what users control runs through :func:`~node_agent.checking.deadline.call_before` and ends by
``ctx.stage_end()``; stack sampling ends by ``SAMPLING_SHARE`` of the timeout with at most
``stack_max_calls`` py-spy calls shared fairly between uids
(:func:`~node_agent.training.stacks.sample_stacks`), log files are stat'ed within
``LOG_STAT_S``, and what was not sampled is a ``training_discovery`` WARN saying why.

What it says of each process is :mod:`.report`'s; its Prometheus series are :mod:`.metrics`'s.

Thresholds (how to judge: ``stall_after_s``, ``hang_after_s``, ``hang_step_multiple``,
``agree``, ``confirm_s``, ``straggler_ratio``, ``straggler_for_s``, ``log_silence_s``) are
``graders/training.yaml``'s, their one home (:func:`thresholds`); a suite that carries one is
refused when it loads, naming the file.

Params (:class:`Params`, how to run, parsed when the suite loads: a bad value is a
configuration error naming the key): ``stack_samples`` (3), ``stack_interval_s`` (1),
``log_file`` (for processes that name none), ``stale_file_s`` (86400), ``spool_dir``,
``py_spy``, ``sysfs_root`` (RDMA), ``pids``, ``sample_all`` (false: sample stacks of every
process, as ``hang-check`` does), ``stack_max_calls`` (64: py-spy calls per run), ``one_shot``
(false; true: a run with no earlier one to compare with, so ``confirm_s`` is not applied).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.deadline import Overdue, call_before
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import load_topic, refuse_thresholds
from node_agent.checks.training_progress import report
from node_agent.checks.training_progress.metrics import TrainingMetrics
from node_agent.gpu.base import GpuDevice, GpuError
from node_agent.heartbeat import remove_stale
from node_agent.host.infiniband import SYSFS_ROOT
from node_agent.model import Result, Status
from node_agent.training import activity
from node_agent.training.processes import Discovery, TrainingProcess, discover
from node_agent.training.signals import Signal
from node_agent.training.stacks import MAX_CALLS, find_py_spy, sample_stacks
from node_agent.training.state import HangState, process_key
from node_agent.training.verdict import (
    Straggler,
    Thresholds,
    Verdict,
    heartbeat_signal,
    likely_origin,
    stragglers,
    verdict,
)

NO_PROCESSES = (
    "no training process found: none writes heartbeats (node_agent.heartbeat) and "
    "NVML lists no GPU compute process"
)
NOT_SAMPLED = "not sampled: no other signal of its job suggests a hang"
SAMPLING_SHARE = 0.6  # stack sampling ends by this share of the check's timeout

#: the topic file of the verdicts' thresholds (checking/thresholds.py): each with its reason
TOPIC = "training"
_SECONDS = {"type": "number", "minimum": 0}
_POSITIVE = {"type": "number", "exclusiveMinimum": 0}
TRAINING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stall_after_s": _POSITIVE,
        "hang_after_s": _POSITIVE,
        "hang_step_multiple": _SECONDS,
        "agree": {"type": "integer", "minimum": 1},
        "confirm_s": _SECONDS,
        "straggler_ratio": {"type": "number", "exclusiveMinimum": 1},
        "straggler_for_s": _SECONDS,
        "log_silence_s": _POSITIVE,
    },
}
#: the thresholds a suite may not carry (docs/thresholds.md)
REFUSED = tuple(TRAINING_SCHEMA["properties"])


def thresholds(ctx: CheckContext) -> Thresholds:
    """``graders/training.yaml`` (the operator's keys over the shipped file's); a one-shot run
    (``one_shot``: ``hang-check``'s) applies no ``confirm_s``."""
    data = load_topic(ctx.config, TOPIC, TRAINING_SCHEMA, "training grading file")
    th = Thresholds(
        stall_after_s=float(data["stall_after_s"]),
        hang_after_s=float(data["hang_after_s"]),
        hang_step_multiple=float(data["hang_step_multiple"]),
        agree=int(data["agree"]),
        confirm_s=float(data["confirm_s"]),
        straggler_ratio=float(data["straggler_ratio"]),
        straggler_for_s=float(data["straggler_for_s"]),
        log_silence_s=float(data["log_silence_s"]),
    )
    params = ctx.typed_params(Params)
    return replace(th, confirm_s=0.0) if params.one_shot else th


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``: how it runs), validated by :meth:`parse`;
    the thresholds are ``graders/training.yaml``'s (:func:`thresholds`)."""

    stack_samples: int = 3
    stack_interval_s: float = 1.0
    stack_max_calls: int = MAX_CALLS  # py-spy calls per run, shared equally between uids
    log_file: str | None = None  # for processes that name none
    stale_file_s: float = 86400.0  # a dead process's heartbeat file is removed after this
    spool_dir: str | None = None  # None: ``<config spool_dir>/heartbeat``
    py_spy: str | None = None  # None: ``py-spy`` on PATH, else beside the running Python
    sysfs_root: str | None = None  # None: the RDMA ports of this host's sysfs
    pids: tuple[int, ...] = ()  # empty: heartbeat writers and NVML's compute processes
    sample_all: bool = False  # sample every process's stack, suspect or not
    one_shot: bool = False  # no earlier run to hold agreement across: confirm_s not applied

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected (for a threshold: its home)."""
        refuse_thresholds("training_progress", raw, REFUSED, f"graders/{TOPIC}.yaml")
        r = Reader("training_progress", raw, cls)
        pids = r.integers("pids", 1, "a list of process ids (positive whole numbers)")
        return cls(
            stack_samples=r.integer("stack_samples", 1),
            stack_interval_s=r.number("stack_interval_s", at_least=0),
            stack_max_calls=r.integer("stack_max_calls", 1),
            log_file=r.optional_string("log_file"),
            stale_file_s=r.positive("stale_file_s"),
            spool_dir=r.optional_string("spool_dir"),
            py_spy=r.optional_string("py_spy"),
            sysfs_root=r.optional_string("sysfs_root"),
            pids=pids,
            sample_all=r.flag("sample_all"),
            one_shot=r.flag("one_shot"),
        )


def spool_dir(ctx: CheckContext) -> Path:
    """``params.spool_dir``, else ``<config spool_dir>/heartbeat`` (default
    ``/var/spool/node-agent/heartbeat``), where ``node_agent.heartbeat`` writes by default."""
    given = ctx.typed_params(Params).spool_dir
    return Path(given) if given else ctx.config.spool_dir / "heartbeat"


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


def sampling_end(ctx: CheckContext) -> float:
    """The monotonic time by which stack sampling ends: ``SAMPLING_SHARE`` of the timeout."""
    return ctx.deadline - (1.0 - SAMPLING_SHARE) * ctx.timeout_s


def run(ctx: CheckContext) -> list[Result]:
    """The check, within the runner's deadline.

    Everything this check reads is the training users' to shape (their processes, heartbeats,
    log files), so it must never be abandoned by the runner: each stage that reads them ends by
    ``ctx.stage_end()`` (stack sampling sooner, by its deadline and budget; log files by
    :data:`LOG_STAT_S`), and should one still block (``/proc`` of a process stuck in the
    kernel), this returns a WARN naming the stage, having saved no state and written no
    evidence."""
    try:
        return _run(ctx)
    except Overdue as late:
        waited_s = late.until - (ctx.deadline - ctx.timeout_s)
        return [
            ctx.result(
                "node",
                "training_discovery",
                Status.WARN,
                f"training_progress stopped waiting after {waited_s:.0f} s of its "
                f"{ctx.timeout_s:g} s timeout while {late.stage}: something a training process "
                "controls (its /proc entries, its log file's file system) did not answer; no "
                "hang is reported this run and the next run tries again",
                subject="node",
                cause="deadline",
                stage=late.stage,
                deadline_s=round(waited_s, 1),
            )
        ]


def _run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    th = thresholds(ctx)
    now = time.time()
    until = ctx.stage_end()
    spool = spool_dir(ctx)

    def find() -> tuple[list[GpuDevice] | None, Discovery]:
        devices = _devices(ctx)
        found = _discover(ctx, spool, devices, params.pids)
        # through directory fds that follow no link: a uid's directory is its owner's to swap
        remove_stale(spool, found.dead_heartbeats, now, params.stale_file_s)
        return devices, found

    devices, found = call_before(until, "finding the training processes", find)
    state = HangState.load(_state_base(ctx) / "hang", now)
    out = _discovery_results(ctx, found, state)
    me = os.getpid()  # the agent's own GPU workers (burn, SDC probes) are not training
    procs = [pr for pr in found.processes if pr.pid != me and me not in pr.parents]
    if not procs:
        state.keep_only(set())
        _save(ctx, state)
        dead = (
            f"; {len(found.dead_heartbeats)} heartbeat file(s) in {spool} are of exited processes"
            if found.dead_heartbeats
            else ""
        )
        return out or [ctx.skip(NO_PROCESSES + dead, metric="training_progress")]
    signals = call_before(
        until,
        "reading heartbeats, GPU activity and log files",
        lambda: _cheap_signals(procs, devices, now, th, params),
    )
    suspect_jobs = {pr.job for pr in procs if any(s.hang for s in signals[pr.pid].values())}
    suspects = [pr for pr in procs if params.sample_all or pr.job in suspect_jobs]
    call_before(until, "sampling stacks", lambda: _sample(ctx, params, suspects, signals))
    out += _not_sampled(ctx, suspects, signals, params.stack_max_calls)

    keys = {pr.pid: process_key(pr.pid, pr.start_ticks) for pr in procs}
    state.keep_only(set(keys.values()))
    verdicts = _verdicts(procs, signals, state, keys, now, th)
    jobs: dict[str | None, list[TrainingProcess]] = {}
    for pr in procs:
        jobs.setdefault(pr.job, []).append(pr)
    origin: dict[int, bool] = {}
    for members in jobs.values():
        origin.update(
            likely_origin(
                [(pr.pid, verdicts[pr.pid].hung, signals[pr.pid]["stack"]) for pr in members]
            )
        )
    slow = _stragglers(jobs, verdicts, state, keys, now, th)
    targets = report.targets(jobs)

    if time.monotonic() >= ctx.deadline:  # the runner gave up on this run: its results go nowhere
        return out
    evidence_files = report.write_evidence(ctx, state, jobs, verdicts, signals, origin, keys, now)
    for pr in procs:
        evidence_file = evidence_files.get(pr.pid) or state.processes[keys[pr.pid]].get("reported")
        out.append(
            report.process_result(
                ctx,
                pr,
                targets[pr.pid],
                verdicts[pr.pid],
                signals[pr.pid],
                origin.get(pr.pid),
                evidence_file,
                slow.get(pr.pid),
                th,
            )
        )
    _save(ctx, state)
    return out


def _save(ctx: CheckContext, state: HangState) -> None:
    """The hang state, unless the runner gave up on this run (an abandoned run saves nothing)."""
    if time.monotonic() < ctx.deadline:
        with contextlib.suppress(OSError):
            state.save()


def _discover(
    ctx: CheckContext, spool: Path, devices: list[GpuDevice] | None, pids: tuple[int, ...]
) -> Discovery:
    """The training processes: ``params.pids``, else heartbeat writers and NVML's list."""
    roots = ctx.config.training.slurm_cgroup_roots if ctx.config is not None else None
    return discover(spool, devices, list(pids) or None, slurm_cgroup_roots=roots)


def _discovery_results(ctx: CheckContext, found: Discovery, state: HangState) -> list[Result]:
    """WARNs for what discovery and the stored state could not use."""
    out = [
        ctx.result("node", "training_discovery", Status.WARN, message, subject=subject)
        for subject, message in found.problems
    ]
    if state.problem:
        out.append(ctx.result("node", "training_state", Status.WARN, state.problem))
    # a spool file that is not a heartbeat is reported once (the spool is every training
    # user's to write: one bad file must neither crash the check nor repeat a WARN forever)
    out += [
        ctx.result(
            "node",
            "training_discovery",
            Status.WARN,
            f"heartbeat spool file {path} is not a heartbeat ({reason}); skipped: it "
            "was not written by node_agent.heartbeat, inspect and remove it "
            "(reported once)",
            subject="node",
            file=str(path),
        )
        for path, reason in state.new_bad_files(found.bad_files)
    ]
    return out


def _verdicts(
    procs: list[TrainingProcess],
    signals: dict[int, dict[str, Signal]],
    state: HangState,
    keys: dict[int, str],
    now: float,
    th: Thresholds,
) -> dict[int, Verdict]:
    """pid -> verdict, each process's signals judged with how long they have agreed (kept in
    the state from run to run)."""
    verdicts = {}
    for pr in procs:
        mem = state.processes.setdefault(keys[pr.pid], {})
        # would the signals make a hang if they had held long enough? (the veto included)
        holding = verdict(
            list(signals[pr.pid].values()),
            th,
            agreeing_since_s=float("inf"),
            has_heartbeat=pr.heartbeat is not None,
        )
        if holding.hung:
            mem.setdefault("agree_since", now)
        else:
            mem.pop("agree_since", None)
        since = now - mem["agree_since"] if "agree_since" in mem else None
        verdicts[pr.pid] = verdict(
            list(signals[pr.pid].values()),
            th,
            agreeing_since_s=since,
            has_heartbeat=pr.heartbeat is not None,
        )
        if not verdicts[pr.pid].hung:
            mem.pop("reported", None)
    return verdicts


def _cheap_signals(
    procs: list[TrainingProcess],
    devices: list[GpuDevice] | None,
    now: float,
    th: Thresholds,
    params: Params,
) -> dict[int, dict[str, Signal]]:
    """heartbeat, gpu_activity and log_silence of every process (no waiting, no ptrace)."""
    readings: dict[int, activity.GpuActivity] = {}
    by_index = {d.index: d for d in devices or []}
    logs = bounded_log_signals(
        [pr.log_file or params.log_file for pr in procs],
        now=now,
        silence_s=th.log_silence_s,
    )
    out = {}
    for pr, log_signal in zip(procs, logs, strict=True):
        if not pr.gpus:
            gpu = Signal.unavailable(
                "gpu_activity",
                "NVML lists no GPU for this process" if devices else "no GPU readings on this node",
            )
        else:
            for i in pr.gpus:
                if i not in readings and i in by_index:
                    readings[i] = activity.read_gpu_activity(by_index[i])
            gpu = activity.gpu_activity_signal([readings[i] for i in pr.gpus if i in readings])
        out[pr.pid] = {
            "heartbeat": heartbeat_signal(pr.heartbeat, now, th),
            "stack": Signal.unavailable("stack", NOT_SAMPLED),
            "gpu_activity": gpu,
            "rdma_traffic": Signal.unavailable(
                "rdma_traffic", "read only while a process is suspected"
            ),
            "log_silence": log_signal,
        }
    return out


#: how long the log files' stats may take in one run, together (a log file on a network or
#: FUSE file system its user controls can keep stat() waiting for good)
LOG_STAT_S = 2.0
_STAT_LOCK = threading.Lock()
_STATS_IN_FLIGHT: set[str] = set()  # paths whose stat() from an earlier run never returned


def bounded_log_signals(
    paths: Sequence[str | None], *, now: float, silence_s: float, limit_s: float = LOG_STAT_S
) -> list[Signal]:
    """:func:`~node_agent.training.activity.log_silence_signal` of each path, each distinct
    path stat'ed once on a daemon thread of its own, all within ``limit_s``. A path whose stat
    has not returned is unavailable (and not stat'ed again while an earlier stat of it is
    still waiting: a stuck file system costs one thread, not one per run)."""
    found: dict[str, Signal] = {}
    threads = []
    for path in dict.fromkeys(p for p in paths if p is not None):
        with _STAT_LOCK:
            if path in _STATS_IN_FLIGHT:
                found[path] = Signal.unavailable(
                    "log_silence",
                    f"a stat of the job's log file {path} from an earlier run "
                    "has not returned (a hung network or FUSE file system?)",
                    path=path,
                )
                continue
            _STATS_IN_FLIGHT.add(path)

        def stat_one(path: str = path) -> None:
            try:
                found[path] = activity.log_silence_signal(path, now=now, silence_s=silence_s)
            except Exception as err:  # noqa: BLE001 - the path is a user's text
                found[path] = Signal.unavailable(
                    "log_silence", f"cannot read the job's log file {path!a}: {type(err).__name__}"
                )
            finally:
                with _STAT_LOCK:
                    _STATS_IN_FLIGHT.discard(path)

        thread = threading.Thread(target=stat_one, name="log-stat", daemon=True)
        thread.start()
        threads.append(thread)
    end = time.monotonic() + limit_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return [
        activity.log_silence_signal(None, now=now, silence_s=silence_s)
        if p is None
        else found.get(p)
        or Signal.unavailable(
            "log_silence",
            f"stat of the job's log file {p} did not return within "
            f"{limit_s:g} s (a hung network or FUSE file system?)",
            path=p,
        )
        for p in paths
    ]


def _sample(
    ctx: CheckContext,
    p: Params,
    suspects: list[TrainingProcess],
    signals: dict[int, dict[str, Signal]],
) -> None:
    """Stacks of every process in a suspect job, with the RDMA counters before and after."""
    if not suspects:
        return
    root = Path(p.sysfs_root or SYSFS_ROOT)
    before, t0 = activity.read_port_counters(root), time.monotonic()
    # a verified job first, then the processes more signals accuse; sample_stacks takes them
    # in turn from each uid, so one user's many processes cannot crowd out another's hang
    order = sorted(
        suspects,
        key=lambda pr: (
            not pr.job_verified,
            -sum(s.hang for s in signals[pr.pid].values()),
            pr.pid,
        ),
    )
    stacks = sample_stacks(
        find_py_spy(p.py_spy),
        [pr.pid for pr in order],
        p.stack_samples,
        p.stack_interval_s,
        sampling_end(ctx),
        uids={pr.pid: pr.uid for pr in order},
        max_calls=p.stack_max_calls,
    )
    window = time.monotonic() - t0
    rdma_signal = activity.rdma_traffic_signal(before, activity.read_port_counters(root), window)
    for pr in suspects:
        signals[pr.pid]["stack"] = stacks[pr.pid]
        signals[pr.pid]["rdma_traffic"] = rdma_signal


def _not_sampled(
    ctx: CheckContext,
    suspects: list[TrainingProcess],
    signals: dict[int, dict[str, Signal]],
    max_calls: int,
) -> list[Result]:
    """One WARN naming, per uid, the suspects whose stacks were not sampled and why."""
    missed: dict[tuple[Any, str], list[int]] = {}
    for pr in suspects:
        why = signals[pr.pid]["stack"].figures.get("not_sampled")
        if why:
            missed.setdefault((pr.uid, why), []).append(pr.pid)
    if not missed:
        return []
    per_uid = {uid: sum(1 for pr in suspects if pr.uid == uid) for uid, _ in missed}
    parts = [
        f"uid {uid}: {len(pids)} of {per_uid[uid]} ("
        + (
            "its share of stack_max_calls spent"
            if why == "budget"
            else "the sampling deadline came first"
        )
        + ")"
        for (uid, why), pids in sorted(missed.items(), key=lambda kv: -len(kv[1]))
    ]
    count = sum(len(p) for p in missed.values())
    return [
        ctx.result(
            "node",
            "training_discovery",
            Status.WARN,
            f"stacks of {count} suspect process(es) were not sampled this run: "
            + "; ".join(parts[:10])
            + (f"; +{len(parts) - 10} more" if len(parts) > 10 else "")
            + f". py-spy calls are capped per run (stack_max_calls="
            f"{max_calls}) and shared equally "
            "between uids, within the check's deadline; their other signals were still read",
            subject="node",
            cause="stack-sampling",
            not_sampled={
                f"uid:{uid}/{why}": sorted(pids)[:50] for (uid, why), pids in missed.items()
            },
        )
    ]


def _stragglers(
    jobs: dict[str | None, list[TrainingProcess]],
    verdicts: dict[int, Verdict],
    state: HangState,
    keys: dict[int, str],
    now: float,
    th: Thresholds,
) -> dict[int, Straggler]:
    """pid -> Straggler for ranks slow for at least ``straggler_for_s`` (kept in the state)."""
    out = {}
    for members in jobs.values():
        stepping = {
            pr.pid: pr.heartbeat
            for pr in members
            if not verdicts[pr.pid].hung
            and pr.heartbeat
            and pr.heartbeat.get("step_time_s")
            and not pr.heartbeat.get("pause")
        }
        basis = (
            "compute_time_s"
            if stepping and all(hb.get("compute_time_s") for hb in stepping.values())
            else "step_time_s"
        )
        times = {pid: float(hb[basis]) for pid, hb in stepping.items()}
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


SERVICE = ServiceBehaviour(metrics=TrainingMetrics)
