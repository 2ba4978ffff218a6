"""The daemon never answers, or acts on, a node as fitter than what it knows: a check that cannot
read a fault again keeps it, a partial grade that passes does not resume a drained node, and a
stored FAULT standing in for a partial grade is what /metrics and a reload keep.

The daemon runs on a simulated node (no GPU here) and is driven through ``_record``, the way
its checks thread hands over each run, so each step of the timeline is exact."""

from __future__ import annotations

import time

import pytest
import yaml

from node_agent.model import Action, Grade, Level, Reason, Result, Status
from node_agent.service.daemon import Daemon

SUITE = {
    "name": "fail-closed",
    "mode": "service",
    "checks": [
        {"check": "nvml_health", "timeout_s": 10, "every_s": 30},
        {"check": "host_power", "timeout_s": 10, "every_s": 30},
        {"check": "xid", "timeout_s": 10, "every_s": 30},
    ],
}
REMAP_FAILED = Result("nvml_health", "gpu:2", "row_remap_failure", Status.FAIL, "no spare row")


@pytest.fixture
def daemon(tmp_path):
    scenario, config, suite = tmp_path / "s.yaml", tmp_path / "c.yaml", tmp_path / "p.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 4, "faults": []}))
    suite.write_text(yaml.safe_dump(SUITE))
    config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "sp")})
    )
    handed: list[Grade] = []
    now = [1000.0]
    d = Daemon(
        str(config),
        str(scenario),
        suite=str(suite),
        on_grade=lambda g, r, e: handed.append(g),
        clock=lambda: now[0],
    )
    d.handed = handed  # type: ignore[attr-defined]
    d.now = now  # type: ignore[attr-defined]
    yield d
    d.env.close()


def passing(check: str) -> list[Result]:
    return [Result(check, "node", "ran", Status.PASS, "fine")]


def test_a_fault_the_check_can_no_longer_read_stays_a_fault_dated_until_read_again(daemon):
    """The audit's case: a row-remap failure graded FAULT, then NVML's call for it failed (an
    error); the error had replaced the finding and the node answered WARN, fit for NVRx."""
    daemon._record("nvml_health", [REMAP_FAILED], time.time(), 0.1)
    assert daemon.grade.level is Level.FAULT
    unreadable = Result("nvml_health", "gpu:2", "row_remap", Status.ERROR, "NVML error 999")
    daemon._record("nvml_health", [unreadable], time.time(), 0.1)
    assert daemon.grade.level is Level.FAULT
    (kept,) = [r for r in daemon.current_results() if r.metric == "row_remap_failure"]
    assert "could not read it since" in kept.detail and "unread_since" in kept.evidence
    timed_out = Result("nvml_health", "node", "timeout", Status.ERROR, "no answer in 10 s")
    daemon._record("nvml_health", [timed_out], time.time(), 10.0)
    assert daemon.grade.level is Level.FAULT  # the whole check failed: every finding stays
    read_again = Result("nvml_health", "gpu:2", "row_remap_failure", Status.PASS, "none failed")
    daemon._record("nvml_health", [read_again], time.time(), 0.1)
    assert daemon.grade.level is Level.HEALTHY


def test_a_partial_grade_that_passes_is_not_acted_on_and_an_error_is_at_once(daemon):
    """The audit's case: after a reboot the first check's WARN, graded before the check that
    had found the ERROR ran again, resumed the node the agent had drained for it."""
    off = Result("nvml_health", "gpu:0", "persistence_mode", Status.WARN, "persistence mode off")
    daemon._record("nvml_health", [off], time.time(), 0.1)
    assert daemon.grade.level is Level.WARN
    assert not daemon.view.complete and daemon.handed == []
    psu = Result("host_power", "psu:1", "psu_status", Status.FAIL, "PSU 1: failure detected")
    daemon._record("host_power", [psu], time.time(), 0.1)
    assert [g.level for g in daemon.handed] == [Level.ERROR]
    daemon._record("xid", passing("xid"), time.time(), 0.1)
    assert daemon.view.complete and [g.level for g in daemon.handed] == [Level.ERROR]
    daemon._record("host_power", passing("host_power"), time.time(), 0.1)
    assert [g.level for g in daemon.handed] == [Level.ERROR, Level.WARN]


def test_a_stored_fault_standing_in_is_what_metrics_say_and_what_a_reload_keeps(daemon):
    stored = Grade(
        Level.FAULT,
        Action.REPLACE,
        (Reason("row-remap-failure", Level.FAULT, "gpu:2", "no spare row"),),
    )
    daemon._stored_grade = stored
    daemon._record("nvml_health", passing("nvml_health"), time.time(), 0.1)
    assert daemon.view.level == "FAULT" and daemon.view.stored_grade
    assert daemon.snapshot().level is Level.FAULT  # was the partial grade's HEALTHY
    assert daemon.reload_config()
    assert daemon._stored_grade is stored and daemon.view.level == "FAULT"


def test_a_result_older_than_any_rotation_of_the_schedule_is_not_the_nodes_state_now(daemon):
    """A checks loop stalled behind a wedged check: its last HEALTHY had been answered for as
    long as the stall lasted. Past twice its interval and a whole rotation of timeouts, a
    result no longer counts: the node is UNKNOWN (unfit to NVRx) until the check runs again."""
    long_ago = time.time() - 3600
    for check in ("nvml_health", "host_power", "xid"):
        daemon._record(check, passing(check), long_ago if check == "xid" else time.time(), 0.1)
    assert daemon.view.unknown and daemon.view.missing == ("xid",)
    assert "none recent" in daemon.view.why_unknown()
    daemon._record("xid", passing("xid"), time.time(), 0.1)
    assert daemon.view.complete and daemon.view.level == "HEALTHY"


def test_a_check_running_past_its_timeout_makes_the_checks_behind_it_not_current(daemon):
    """The audit's case: the sdc check's child wedged in the driver, and nvml_health, queued
    behind it, ran again only after the child's timeout and its 60 s kill grace; the node was
    answered HEALTHY all that while, as GPU 2's rows failed. A check still running past its
    own timeout (checks keep to theirs) now makes itself and every check due behind it not
    current: UNKNOWN, unfit to NVRx, until it ends; what is known to be wrong stays answered.
    Within its timeout a run may take long (a stack sample of a stalled job): not judged."""
    for check in ("nvml_health", "host_power", "xid"):
        daemon._record(check, passing(check), time.time(), 0.2)
    assert daemon.view.complete and daemon.view.level == "HEALTHY"
    due = {item.spec.check: item for item in daemon._schedule}
    due["host_power"].next_due = daemon.now[0] + 10
    due["nvml_health"].next_due = daemon.now[0] + 30
    daemon._in_flight = ("xid", daemon.now[0], 30.0)

    daemon.now[0] += 29  # 145 times its last run, within its timeout
    daemon._regrade("tick")
    assert daemon.view.complete and daemon.view.level == "HEALTHY"

    daemon.now[0] += 2
    daemon._regrade("tick")
    assert daemon.view.unknown and set(daemon.view.missing) == {"xid", "host_power", "nvml_health"}

    daemon._record("nvml_health", [REMAP_FAILED], time.time(), 2.0)
    assert daemon.view.level == "FAULT"  # what is found meanwhile is answered at once

    daemon._in_flight = None
    daemon._record("xid", passing("xid"), time.time(), 31.0)
    assert daemon.view.complete and daemon.view.level == "FAULT"
    daemon._record("nvml_health", passing("nvml_health"), time.time(), 2.0)
    assert daemon.view.complete and daemon.view.level == "HEALTHY"
