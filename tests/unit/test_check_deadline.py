"""A check's deadline is the runner's (``CheckContext.deadline``); a stage that may block for
good runs through ``call_before``, which returns its value, raises its error, or raises
``Overdue`` naming the stage when it has not returned in time."""

from __future__ import annotations

import threading
import time

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checking.deadline import Overdue, call_before, return_margin_s


def _ctx(timeout_s: float, deadline: float) -> CheckContext:
    """A context for a check that reads no part of the node (no GPU, config or inventory)."""
    nothing = (None,) * 6
    return CheckContext("c", *nothing, timeout_s=timeout_s, deadline=deadline)


def test_stages_end_a_margin_before_the_deadline_and_what_is_left_never_goes_negative():
    ctx = _ctx(45.0, deadline=time.monotonic() + 45.0)
    assert ctx.stage_end() == ctx.deadline - 4.5
    assert ctx.stage_end(margin_s=0.0) == ctx.deadline
    assert 40.0 < ctx.remaining_s() <= 40.5
    assert _ctx(45.0, deadline=time.monotonic() - 1.0).remaining_s(margin_s=0.0) == 0.0


def test_the_margin_is_a_tenth_of_the_timeout_at_least_2_s_and_at_most_half():
    assert [return_margin_s(t) for t in (3.0, 10.0, 45.0, 600.0)] == [1.5, 2.0, 4.5, 60.0]


def test_a_context_made_by_hand_gets_its_deadline_from_its_timeout():
    before = time.monotonic()
    ctx = _ctx(7.0, deadline=0.0)
    assert before + 7.0 <= ctx.deadline <= time.monotonic() + 7.0


def test_a_stage_that_returns_in_time_gives_its_value_and_its_error():
    assert call_before(time.monotonic() + 5.0, "adding", lambda: 1 + 1) == 2

    def fails() -> int:
        raise ValueError("bad heartbeat")

    with pytest.raises(ValueError, match="bad heartbeat"):
        call_before(time.monotonic() + 5.0, "reading", fails)


def test_a_stage_that_never_returns_is_overdue_naming_it():
    release = threading.Event()
    until = time.monotonic() + 0.2
    try:
        with pytest.raises(Overdue) as raised:
            call_before(until, "reading /proc", lambda: release.wait(30))
    finally:
        release.set()
    assert (raised.value.stage, raised.value.until) == ("reading /proc", until)
    assert time.monotonic() >= until
