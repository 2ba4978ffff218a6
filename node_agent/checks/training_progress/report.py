"""What ``training_progress`` says of each training process: its result (a verified hang, an
unverified one naming its uid, a straggler or its progress), its target
(``job:<job>/rank:<rank>``), the evidence the result carries, and the evidence file written
for a verified job's newly reported hang."""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from typing import Any

from node_agent.checking.context import CheckContext
from node_agent.model import Result, Status
from node_agent.training.processes import TrainingProcess
from node_agent.training.signals import NAMES, Signal
from node_agent.training.state import HangState
from node_agent.training.verdict import Straggler, Thresholds, Verdict

_UNSAFE_TARGET = re.compile(r"[^A-Za-z0-9_.:/@+=-]+")


def process_result(
    ctx: CheckContext,
    pr: TrainingProcess,
    target: str,
    v: Verdict,
    sig: dict[str, Signal],
    origin: bool | None,
    evidence_file: str | None,
    slow: Straggler | None,
    th: Thresholds,
) -> Result:
    """The one result of a process: an unverified hang (WARN naming its uid, never a
    restart), a verified hang (FAIL), a straggler (WARN) or its progress (PASS)."""
    ev = _evidence(pr, sig, v.agreeing, origin)
    age = sig["heartbeat"].figures.get("age_s") if sig["heartbeat"].available else None
    if v.hung and not pr.job_verified:
        # nothing but the user's word says which job this is (a user's own idle process
        # with a stale heartbeat looks the same): a WARN naming the uid, never a restart
        return ctx.result(
            target,
            "training_hang",
            Status.WARN,
            _unverified_detail(pr, v.why, sig),
            value=age,
            unit="s",
            verified=False,
            uid=pr.uid,
            **ev,
        )
    if v.hung:
        ev["evidence_file"] = evidence_file
        return ctx.result(
            target,
            "training_hang",
            Status.FAIL,
            _hang_detail(pr, v.why, sig, origin),
            value=age,
            unit="s",
            verified=True,
            uid=pr.uid,
            **ev,
        )
    if slow is not None:
        return ctx.result(
            target,
            "training_straggler",
            Status.WARN,
            f"{_who(pr)}: recent {slow.what} {slow.step_time_s:.3f} s is {slow.ratio:.1f}x the "
            f"median of its {slow.peers} peer(s) on this node ({slow.peers_median_s:.3f} s; "
            f"threshold {th.straggler_ratio:g}x, held for {th.straggler_for_s:g} s); it sets "
            "the pace of the whole job",
            value=round(slow.ratio, 2),
            unit="x",
            peers_median_s=slow.peers_median_s,
            compared=slow.basis,
            **ev,
        )
    return ctx.result(
        target,
        "training_progress",
        Status.PASS,
        f"{_who(pr)}: {sig['heartbeat'].detail if age is not None else v.why}",
        value=age,
        unit="s",
        **ev,
    )


def _clean(text: Any) -> str:
    return _UNSAFE_TARGET.sub("_", str(text))[:128]


def targets(jobs: dict[str | None, list[TrainingProcess]]) -> dict[int, str]:
    out = {}
    for job, members in jobs.items():
        ranks = [pr.rank for pr in members]
        for pr in members:
            who = (
                f"rank:{pr.rank}"
                if pr.rank is not None and ranks.count(pr.rank) == 1
                else f"pid:{pr.pid}"
            )
            # a job the kernel does not vouch for is named so that no adapter restarts it; a
            # pod's carries its UID from the cgroup, which the Kubernetes adapter checks
            name = pr.restart_job_id if pr.job_verified else f"unverified:{job or 'unknown'}"
            out[pr.pid] = f"job:{_clean(name)}/{who}"
    return out


def _who(pr: TrainingProcess) -> str:
    rank = "rank ?" if pr.rank is None else f"rank {pr.rank}"
    return f"{rank} (pid {pr.pid}, job {_clean(pr.job)})"


def _stack_note(stack: Signal) -> str:
    """Where the stack is stuck, or why it is unavailable (empty for a readable stack that
    names no place)."""
    if stack.figures.get("stuck_in"):
        return f"; stuck in {stack.figures['stuck_in']}"
    return "" if stack.available else f"; stack unavailable ({stack.detail})"


def _unverified_detail(pr: TrainingProcess, why: str, sig: dict[str, Signal]) -> str:
    stack_note = _stack_note(sig["stack"])
    return (
        f"uid {pr.uid}'s {_who(pr)}: no progress ({why}){stack_note}; its job is not one "
        "the kernel vouches for (no slurmd or kubepods cgroup of that job holds it), so "
        "nothing is restarted and the node is not drained: WARN for the job's owner to "
        "look at"
    )


def _hang_detail(pr: TrainingProcess, why: str, sig: dict[str, Signal], origin: bool | None) -> str:
    stack_note = _stack_note(sig["stack"])
    origin_note = (
        {
            True: "; likely origin: its stack is outside a collective while its hung "
            "peers' are inside one",
            False: "; waiting in a collective on a peer",
        }.get(origin, "")
        if origin is not None
        else ""
    )
    return (
        f"{_who(pr)}: training hang suspected ({why}){stack_note}{origin_note}; the job "
        f"needs a restart (evidence in the state dir; py-spy dump --pid {pr.pid})"
    )


def _evidence(
    pr: TrainingProcess, sig: dict[str, Signal], agreeing: Sequence[str], origin: bool | None
) -> dict[str, Any]:
    hb = pr.heartbeat or {}
    beat = sig["heartbeat"]
    return {
        "pid": pr.pid,
        "rank": pr.rank,
        "local_rank": pr.local_rank,
        "world_size": pr.world_size,
        "job": pr.job,
        "step": hb.get("step"),
        "step_time_s": hb.get("step_time_s"),
        "compute_time_s": hb.get("compute_time_s"),
        "heartbeat_age_s": beat.figures.get("age_s") if beat.available else None,
        "gpus": list(pr.gpus),
        "agreeing": list(agreeing),
        "likely_origin": origin,
        "signals": {name: sig[name].to_dict() for name in NAMES},
        "process": pr.to_evidence(),
    }


def write_evidence(
    ctx: CheckContext,
    state: HangState,
    jobs: dict[str | None, list[TrainingProcess]],
    verdicts: dict[int, Verdict],
    signals: dict[int, dict[str, Signal]],
    origin: dict[int, bool],
    keys: dict[int, str],
    now: float,
) -> dict[int, str]:
    """One evidence file per job with a newly reported hang; pid -> its path."""
    written: dict[int, str] = {}
    for job, members in jobs.items():
        # only a verified job's hang: anyone can make unverified ones, and the newest 200
        # files are kept, so theirs could push a real hang's evidence out
        new = [
            pr
            for pr in members
            if verdicts[pr.pid].hung
            and pr.job_verified
            and not state.processes[keys[pr.pid]].get("reported")
        ]
        if not new:
            continue
        evidence = {
            "job": job,
            "host": ctx.inventory.host.hostname if ctx.inventory else socket.gethostname(),
            "reported_at": now,
            "processes": [
                {
                    **_evidence(pr, signals[pr.pid], verdicts[pr.pid].agreeing, origin.get(pr.pid)),
                    "hung": verdicts[pr.pid].hung,
                    "why": verdicts[pr.pid].why,
                }
                for pr in members
            ],
        }
        try:
            path = str(state.write_evidence(job, now, evidence))
        except OSError:
            continue  # no writable state dir: the result itself still carries the evidence
        for pr in new:
            state.processes[keys[pr.pid]]["reported"] = path
            written[pr.pid] = path
    return written
