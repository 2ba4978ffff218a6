"""When signals make a hang: agreement, the heartbeat alone, declared pauses, slow steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from node_agent.training.signals import Signal
from node_agent.training.verdict import Thresholds, heartbeat_signal, stragglers, verdict

NOW = 1_000_000.0
#: the shipped thresholds (graders/training.yaml, their one home)
TH = Thresholds(
    **yaml.safe_load((Path(__file__).parents[2] / "graders" / "training.yaml").read_text())
)


def test_the_shipped_training_thresholds_are_the_checks_old_defaults():
    """Moving them from code defaults to graders/training.yaml judged nothing differently."""
    assert dataclasses.astuple(TH) == (30, 300, 5, 2, 20, 2.0, 30, 60)


def _beat(age_s: float, step_time_s: float | None = 0.1, pause=None) -> dict:
    return {"step": 10, "step_at": NOW - age_s, "step_time_s": step_time_s, "pause": pause}


def _stack(hang: bool) -> Signal:
    return Signal("stack", True, hang, "")


def test_a_fresh_heartbeat_is_progress():
    s = heartbeat_signal(_beat(2), NOW, TH)
    assert s.available and not s.hang and s.figures["age_s"] == 2


def test_a_stalled_heartbeat_plus_a_still_stack_is_a_hang_within_the_stall_time():
    beat = heartbeat_signal(_beat(31), NOW, TH)
    assert beat.hang and not beat.figures["alone"]
    v = verdict([beat, _stack(True)], TH, agreeing_since_s=None, has_heartbeat=True)
    assert v.hung and v.agreeing == ("heartbeat", "stack")


def test_a_moving_stack_vetoes_other_signals_until_the_heartbeat_alone_is_enough():
    # a checkpoint being written: no step, a silent log, but the stack moves
    moving = Signal("stack", True, False, "changed", {"samples": 3})
    log = Signal("log_silence", True, True, "")
    v = verdict(
        [heartbeat_signal(_beat(120), NOW, TH), moving, log],
        TH,
        agreeing_since_s=None,
        has_heartbeat=True,
    )
    assert not v.hung and "the process runs" in v.why
    assert verdict(
        [heartbeat_signal(_beat(301), NOW, TH), moving],
        TH,
        agreeing_since_s=None,
        has_heartbeat=True,
    ).hung


def test_the_heartbeat_alone_is_a_hang_after_hang_after_s():
    beat = heartbeat_signal(_beat(301), NOW, TH)
    v = verdict(
        [beat, Signal.unavailable("stack", "no py-spy")],
        TH,
        agreeing_since_s=None,
        has_heartbeat=True,
    )
    assert v.hung and v.why.startswith("heartbeat alone")


@pytest.mark.parametrize("step_time_s", [10.0, 60.0])
def test_a_slow_loop_is_never_stalled_before_five_of_its_own_steps(step_time_s):
    age = 4.9 * step_time_s
    assert not heartbeat_signal(_beat(age, step_time_s), NOW, TH).hang
    assert heartbeat_signal(_beat(5.1 * step_time_s, step_time_s), NOW, TH).hang


def test_a_declared_pause_is_not_a_stall_until_it_overruns():
    pause = {"reason": "checkpoint", "since": NOW - 600, "max_s": 900}
    s = heartbeat_signal(_beat(600, pause=pause), NOW, TH)
    assert s.available and not s.hang and "paused for checkpoint" in s.detail
    pause["since"] = NOW - 901
    s = heartbeat_signal(_beat(901, pause=pause), NOW, TH)
    assert s.hang and s.figures["alone"] and "overran" in s.detail


def test_a_process_without_heartbeats_must_hold_agreement_for_confirm_s():
    gpu = Signal("gpu_activity", True, True, "")
    signals = [Signal.unavailable("heartbeat", "none"), _stack(True), gpu]
    assert not verdict(signals, TH, agreeing_since_s=None, has_heartbeat=False).hung
    assert not verdict(signals, TH, agreeing_since_s=10, has_heartbeat=False).hung
    assert verdict(signals, TH, agreeing_since_s=20, has_heartbeat=False).hung


def test_unavailable_signals_neither_accuse_nor_clear():
    signals = [
        heartbeat_signal(_beat(40), NOW, TH),
        Signal.unavailable("stack", "no py-spy"),
        Signal.unavailable("rdma_traffic", "no HCA"),
    ]
    v = verdict(signals, TH, agreeing_since_s=None, has_heartbeat=True)
    assert not v.hung and v.agreeing == ("heartbeat",) and "1 of 1" in v.why


def test_agree_is_configurable():
    th = dataclasses.replace(TH, agree=1, stall_after_s=10)
    assert th.agree == 1 and th.stall_after_s == 10
    assert verdict(
        [heartbeat_signal(_beat(11), NOW, th)], th, agreeing_since_s=None, has_heartbeat=True
    ).hung


def test_a_rank_twice_as_slow_as_its_peers_is_a_straggler_and_they_are_not():
    slow = stragglers({1: 0.1, 2: 0.1, 3: 0.11, 4: 0.2}, 2.0)
    assert [s.pid for s in slow] == [4] and slow[0].ratio == pytest.approx(2.0)
    assert stragglers({1: 0.1, 2: 0.15}, 2.0) == []
    assert stragglers({1: 0.1}, 2.0) == []  # no peer to compare with
