"""From hang signals to a verdict: hung, straggling or progressing (pure functions).

A hang is suspected when the signals agree (``Thresholds.agree`` of them say "no progress"),
or when the heartbeat alone has been silent for ``hang_after_s``. Agreement is what lets the
agent answer within a minute without restarting a job for a checkpoint pause: a rank saving a
checkpoint writes no step, but its stack moves (a moving stack vetoes the other signals); a rank that waits in a barrier for a peer's
checkpoint has a still stack too, which is why jobs declare such pauses
(``Heartbeat.pause``) and why a process without heartbeats must keep its signals agreeing for
``confirm_s`` across two runs before it is called hung.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.training.blocking import OWN_REASON, WAITING_ON_PEERS
from node_agent.training.signals import Signal


@dataclass(frozen=True)
class Thresholds:
    """What the verdicts judge by: ``graders/training.yaml``, their one home, where each has
    its reason (read by the ``training_progress`` check; no defaults here)."""

    stall_after_s: float  # no step this long: the heartbeat signal says hang
    hang_after_s: float  # no step this long: a hang on the heartbeat alone
    hang_step_multiple: float  # ... and never before this many of the process's own steps
    agree: int  # signals that must agree to suspect a hang sooner
    confirm_s: float  # processes without heartbeats: agreement held this long
    straggler_ratio: float  # a rank this many times its peers' median step time ...
    straggler_for_s: float  # ... persistently: for this long
    log_silence_s: float  # the job's log unwritten this long: the log_silence signal


def heartbeat_signal(record: Mapping[str, Any] | None, now: float, th: Thresholds) -> Signal:
    """The ``heartbeat`` signal of one process's heartbeat record at wall time ``now``.

    Figures: ``age_s`` (since the last step), ``stall_after_s`` and ``hang_after_s`` (both
    raised to ``hang_step_multiple`` x the process's own step time), ``pause`` when declared."""
    if record is None:
        return Signal.unavailable(
            "heartbeat", "the process writes no heartbeats (node_agent.heartbeat)"
        )
    age = max(0.0, now - float(record["step_at"]))
    own = th.hang_step_multiple * float(record.get("step_time_s") or 0.0)
    stall, alone = max(th.stall_after_s, own), max(th.hang_after_s, own)
    figures = {
        "age_s": round(age, 1),
        "step": record.get("step"),
        "step_time_s": record.get("step_time_s"),
        "stall_after_s": round(stall, 1),
        "hang_after_s": round(alone, 1),
    }
    pause = record.get("pause")
    if isinstance(pause, dict) and pause.get("since") is not None:
        paused_s = max(0.0, now - float(pause["since"]))
        max_s = float(pause.get("max_s") or 0.0)
        figures["pause"] = {**pause, "paused_s": round(paused_s, 1)}
        if paused_s <= max_s:
            return Signal(
                "heartbeat",
                True,
                False,
                f"paused for {pause.get('reason')!s:.60} ({paused_s:.0f} s of at most "
                f"{max_s:.0f} s)",
                figures,
            )
        return Signal(
            "heartbeat",
            True,
            True,
            f"the declared pause ({pause.get('reason')!s:.60}) overran: {paused_s:.0f} "
            f"s, declared at most {max_s:.0f} s",
            {**figures, "alone": True},
        )
    if age > stall:
        return Signal(
            "heartbeat",
            True,
            True,
            f"no training step for {age:.1f} s (last step {record.get('step')}; "
            f"stall threshold {stall:.1f} s)",
            {**figures, "alone": age > alone},
        )
    return Signal("heartbeat", True, False, f"step {record.get('step')}, {age:.1f} s ago", figures)


@dataclass(frozen=True)
class Verdict:
    hung: bool
    agreeing: tuple[str, ...]  # the signals that say "no progress"
    why: str  # one line: what made (or did not make) the verdict


def verdict(
    signals: Sequence[Signal],
    th: Thresholds,
    *,
    agreeing_since_s: float | None,
    has_heartbeat: bool,
) -> Verdict:
    """Hung or not, from one process's signals.

    ``agreeing_since_s``: how long (seconds) the signals have agreed across runs, None when
    they agree for the first time now; only processes without heartbeats wait for it."""
    agreeing = tuple(s.name for s in signals if s.available and s.hang)
    available = [s.name for s in signals if s.available]
    beat = next((s for s in signals if s.name == "heartbeat"), None)
    if beat is not None and beat.hang and beat.figures.get("alone"):
        return Verdict(True, agreeing, f"heartbeat alone: {beat.detail}")
    stack = next((s for s in signals if s.name == "stack"), None)
    if (
        stack is not None
        and stack.available
        and not stack.hang
        and stack.figures.get("samples", 0) > 1
    ):
        # a stack that moves between samples is direct evidence that the process runs (a
        # checkpoint write, an evaluation); only the heartbeat alone can still call it hung
        return Verdict(
            False, agreeing, f"the stack moves between samples ({stack.detail}); the process runs"
        )
    if len(agreeing) < th.agree:
        return Verdict(
            False,
            agreeing,
            f"{len(agreeing)} of {len(available)} available "
            f"signal(s) say no progress; {th.agree} must agree",
        )
    if not has_heartbeat and (agreeing_since_s or 0.0) < th.confirm_s:
        return Verdict(
            False,
            agreeing,
            f"{', '.join(agreeing)} agree, for "
            f"{agreeing_since_s or 0:.0f} s of the {th.confirm_s:g} "
            "s a process without heartbeats must hold",
        )
    return Verdict(True, agreeing, f"{len(agreeing)} signals agree: {', '.join(agreeing)}")


def likely_origin(members: Sequence[tuple[int, bool, Signal | None]]) -> dict[int, bool]:
    """pid -> likely origin, for one job's processes as ``(pid, hung, stack signal)``.

    Among the hung processes whose stacks were read, those stopped for a reason of their own
    (a data loader, a checkpoint write, their own code: ``blocking.OWN_REASON``) while some
    hung peer waits on the others (in a collective, or on the GPU after launching one:
    ``blocking.WAITING_ON_PEERS``). What a stack waits in is decided by what its frames are
    (:mod:`node_agent.training.blocking`), not by a word in their names. Empty when fewer than
    two stacks were read or nobody stands out; a process whose stack shows neither (the
    torchrun agent, no frames) is never named."""
    read: list[tuple[int, str]] = []
    for pid, hung, s in members:
        if not hung or s is None or not s.available:
            continue
        kind = (s.figures.get("blocked_in") or {}).get("kind")
        if kind is None:  # a signal from before blocked_in was recorded
            kind = "collective" if s.figures.get("in_collective") else "other"
        read.append((pid, kind))
    waiting = [pid for pid, kind in read if kind in WAITING_ON_PEERS]
    own = {pid for pid, kind in read if kind in OWN_REASON}
    if len(read) < 2 or not waiting or not own:
        return {}
    return {pid: pid in own for pid, _ in read}


@dataclass(frozen=True)
class Straggler:
    pid: int
    step_time_s: float
    peers_median_s: float
    peers: int
    basis: str = "step_time_s"  # or compute_time_s: the time before the step's collective

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.peers_median_s

    @property
    def what(self) -> str:
        return "compute time per step" if self.basis == "compute_time_s" else "step time"


def stragglers(
    step_times: Mapping[int, float], ratio: float, basis: str = "step_time_s"
) -> list[Straggler]:
    """The pids of one job whose recent step time is at least ``ratio`` x their peers' median
    (each compared with the others, so one slow rank cannot raise its own bar)."""
    out = []
    for pid, mine in step_times.items():
        peers = [t for p, t in step_times.items() if p != pid]
        if not peers:
            continue
        median = statistics.median(peers)
        if median > 0 and mine >= ratio * median:
            out.append(Straggler(pid, mine, median, len(peers), basis))
    return out
