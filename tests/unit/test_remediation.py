"""Remediation: the plan for each grade and state, and every safety guard around it.

Planning is tested as a pure function; the guards, journal and recovery through
:class:`Remediator` with a real SQLite store, a fake scheduler adapter and a fake clock.
"""

from __future__ import annotations

import pytest

from node_agent.guards import blast_radius, sanitise_operator_text
from node_agent.model import Action, Grade, Level, Reason
from node_agent.remediation import Safety, Step, fault_code, plan
from node_agent.remediator import GpuResetError, Remediator
from node_agent.schedulers.base import REASON_PREFIX, AdapterError, NodeState
from node_agent.store import NodeRecord, open_store

T0 = 1_700_000_000.0
NODE = "gpu-01"


class FakeAdapter:
    """Stands in for a scheduler (Slurm, Kubernetes): unit tests need to set the cluster's
    drain state freely (drained by hand, many nodes drained) and count every call, which a
    real scheduler cannot do here. The real adapters are tested against real Slurm and local
    API stand-ins elsewhere; this one satisfies the same ``SchedulerAdapter`` protocol."""

    name = "fake"

    def __init__(self, others: list[NodeState] | None = None, fail: Exception | None = None):
        self.calls: list[tuple[str, str, str]] = []
        self.state = NodeState(NODE, "IDLE", False, None)
        self.others = others or []
        self.fail = fail

    def node_state(self, node: str) -> NodeState:
        return self.state

    def _do(self, action: str, node: str, reason: str, drained: bool | None) -> str:
        if self.fail is not None:
            raise self.fail
        self.calls.append((action, node, reason))
        if drained is not None:
            self.state = NodeState(node, "DRAIN" if drained else "IDLE", drained,
                                   reason if drained else None)
        return f"fake {action} {node}"

    def drain(self, node, reason):
        return self._do("drain", node, reason, True)

    def resume(self, node, reason):
        return self._do("resume", node, reason, False)

    def restart(self, node, reason):
        return self._do("restart", node, reason, None)

    def replace(self, node, reason):
        return self._do("replace", node, reason, True)

    def list_nodes(self):
        return [self.state, *self.others]

    def actions(self) -> list[str]:
        return [c[0] for c in self.calls]


class Clock:
    """A clock the test moves by hand, so no test sleeps."""

    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeReset:
    """Records GPU resets instead of calling nvidia-smi (no GPU in unit tests)."""

    def __init__(self, fail: bool = False):
        self.resets: list[int] = []
        self.fail = fail

    def reset(self, index: int) -> str:
        if self.fail:
            raise GpuResetError(f"GPU reset of gpu:{index} failed: in use by 1 process")
        self.resets.append(index)
        return f"reset gpu:{index}"


def grade(level: Level, rule: str = "xid", target: str = "gpu:5", message: str = "") -> Grade:
    if level == Level.HEALTHY:
        return Grade(Level.HEALTHY, Action.NONE)
    msg = message or (f"Xid 79 on {target} [Xid 79: fallen off the bus]" if rule == "xid"
                      else f"{rule} on {target}")
    action = {Level.WARN: Action.NONE, Level.ERROR: Action.RESTART,
              Level.FAULT: Action.REPLACE}[level]
    return Grade(level, action, (Reason(rule, level, target, msg),))


HEALTHY = Grade(Level.HEALTHY, Action.NONE)
FAULT79 = grade(Level.FAULT)
ERR_REMAP = grade(Level.ERROR, "row-remap-pending", "gpu:2")
ERR_HANG = grade(Level.ERROR, "driver-hang", "gpu:3")


class FakeReport:
    """The fields of a Report the remediator reads (building a whole Report is noise here)."""

    def __init__(self, g: Grade, suite: str = "quick"):
        self.grade, self.suite, self.mode = g, suite, "service"


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "state")
    yield s
    s.close()


def make(store, adapter=None, clock=None, safety=None, warnings=None, **kw):
    warnings = [] if warnings is None else warnings
    return Remediator(store, adapter or FakeAdapter(), NODE, safety or Safety(),
                      state_dir=None, clock=clock or Clock(), warn=warnings.append, **kw)


def plan_for(g, record=None, counts=None, now=T0, boot=T0, reset=False, tried=False, **safety):
    return plan(g, record or NodeRecord(NODE), Safety(**safety), now=now, boot_time=boot,
                restart_counts=counts or {}, gpu_reset_available=reset, gpu_reset_tried=tried)


# -- planning ---------------------------------------------------------------------------------
def test_warn_never_drains(store):
    assert plan_for(grade(Level.WARN, "throttle-hardware", "gpu:0")).steps == ()
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(grade(Level.WARN, "throttle-hardware")))
    assert adapter.calls == [] and out.records == []


def test_healthy_node_in_service_takes_no_action():
    p = plan_for(HEALTHY)
    assert p.steps == () and "no action" in p.note


def test_fault_plans_drain_then_replace_with_reason_naming_the_fault():
    p = plan_for(FAULT79)
    assert [s.action for s in p.steps] == ["drain", "replace"]
    assert p.steps[0].reason.startswith(REASON_PREFIX)
    assert "FAULT xid-79 gpu:5" in p.steps[0].reason
    assert p.steps[-1].to_state == "awaiting-replacement"


def test_error_without_gpu_reset_plans_drain_and_reboot_request():
    p = plan_for(ERR_HANG, reset=True)
    assert [(s.action, s.to_state) for s in p.steps] == [("drain", "drained"),
                                                         ("restart", "restarting")]
    assert p.steps[1].restart_kind == "reboot"


def test_pending_row_remap_plans_gpu_reset_and_quick_retest():
    p = plan_for(ERR_REMAP, reset=True)
    assert [s.action for s in p.steps] == ["drain", "gpu-reset", "retest"]
    assert p.steps[1].gpu_index == 2


def test_after_a_gpu_reset_in_this_run_the_next_restart_is_a_reboot():
    p = plan_for(ERR_REMAP, record=NodeRecord(NODE, "retest", T0), reset=True, tried=True,
                 counts={"row-remap-pending": 1})
    assert [s.action for s in p.steps] == ["restart"]


def test_fault_recurring_after_max_restarts_escalates_to_fault():
    p = plan_for(ERR_HANG, record=NodeRecord(NODE, "restarting", T0, restart_kind="reboot",
                                             requested_at=T0 - 10),
                 counts={"driver-hang": 2}, max_restarts=2)
    assert p.escalated and [s.action for s in p.steps] == ["replace"]
    assert "FAULT driver-hang" in p.steps[0].reason and "max_restarts=2" in p.note


def test_xid_restarts_are_counted_per_xid_code():
    assert fault_code(Reason("xid", Level.ERROR, "gpu:1", "x [Xid 31: MMU]")) == "xid-31"
    assert fault_code(Reason("driver-hang", Level.ERROR, "gpu:1", "hung")) == "driver-hang"
    xid31 = grade(Level.ERROR, "xid", "gpu:1", "Xid 31 [Xid 31: MMU fault]")
    assert not plan_for(xid31, counts={"xid-43": 5}).escalated


def test_no_action_while_the_requested_reboot_has_not_happened():
    record = NodeRecord(NODE, "restarting", T0, "driver-hang", "gpu:3", "auto", "reboot", T0)
    p = plan_for(ERR_HANG, record=record, boot=T0 - 3600, now=T0 + 60)
    assert p.steps == () and "waiting for the reboot" in p.note


def test_passing_retest_after_reboot_resumes_the_node():
    record = NodeRecord(NODE, "restarting", T0, "driver-hang", "gpu:3", "auto", "reboot", T0)
    p = plan_for(HEALTHY, record=record, boot=T0 + 120)
    assert [(s.action, s.to_state) for s in p.steps] == [("resume", "in-service")]


def test_passing_run_does_not_return_a_node_awaiting_replacement():
    p = plan_for(HEALTHY, record=NodeRecord(NODE, "awaiting-replacement", T0, "xid-79"))
    assert p.steps == () and "set-healthy" in p.note


def test_drained_for_fault_with_replace_pending_finishes_the_replace():
    p = plan_for(grade(Level.ERROR, "driver-hang", "gpu:3"),
                 record=NodeRecord(NODE, "fault", T0, "xid-79", "gpu:5", "auto"))
    assert [(s.action, s.fault_code) for s in p.steps] == [("replace", "xid-79")]


def test_passing_run_does_not_resume_an_operator_drain():
    p = plan_for(HEALTHY, record=NodeRecord(NODE, "drained", T0, trigger="operator"))
    assert p.steps == ()


def test_idempotency_key_has_node_action_fault_and_attempt():
    a = Step("restart", "r", "restarting", "xid-31", "gpu:1", attempt=0)
    b = Step("restart", "r", "restarting", "xid-31", "gpu:1", attempt=1)
    assert a.key(NODE) != b.key(NODE)
    assert a.key(NODE) == Step("restart", "other words", None, "xid-31", "gpu:1", 0).key(NODE)
    assert NODE in a.key(NODE)


# -- execution and guards ---------------------------------------------------------------------
def test_fault_drains_and_replaces_through_the_adapter(store):
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "replace"]
    assert [(r.action, r.outcome) for r in out.records] == [("drain", "done"),
                                                           ("replace", "done")]
    assert store.node_record(NODE).state == "awaiting-replacement"
    assert [r.state for r in store.journal_tail(NODE)] == ["done", "done"]


def test_error_drains_resets_retests_and_resumes_on_pass(store):
    adapter, resets = FakeAdapter(), FakeReset()
    out = make(store, adapter, gpu_resetter=resets, retest=lambda: HEALTHY).remediate(
        FakeReport(ERR_REMAP))
    assert adapter.actions() == ["drain", "resume"] and resets.resets == [2]
    assert [r.action for r in out.records] == ["drain", "gpu-reset", "retest", "resume"]
    assert store.node_record(NODE).state == "in-service"


def test_error_surviving_gpu_reset_gets_a_reboot_request(store):
    adapter = FakeAdapter()
    make(store, adapter, gpu_resetter=FakeReset(), retest=lambda: ERR_REMAP).remediate(
        FakeReport(ERR_REMAP))
    assert adapter.actions() == ["drain", "restart"]
    assert store.node_record(NODE).state == "restarting"


def test_failed_gpu_reset_falls_back_to_reboot_request(store):
    adapter = FakeAdapter()
    out = make(store, adapter, gpu_resetter=FakeReset(fail=True),
               retest=lambda: HEALTHY).remediate(FakeReport(ERR_REMAP))
    assert adapter.actions() == ["drain", "restart"]
    assert ("gpu-reset", "failed") in [(r.action, r.outcome) for r in out.records]


def test_error_after_reboot_counts_restarts_then_escalates(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, boot_time=T0 + 10_000)  # every run is "after the reboot"
    for _ in range(3):
        rem.remediate(FakeReport(ERR_HANG))
        clock.t += 600
    assert adapter.actions() == ["drain", "restart", "restart", "replace"]
    assert store.node_record(NODE).state == "awaiting-replacement"


def test_restarts_outside_the_window_do_not_count(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, boot_time=T0 + 10 * 86400,
               safety=Safety(max_restarts=1, restart_window_h=1))
    rem.remediate(FakeReport(ERR_HANG))
    clock.t += 2 * 3600
    rem.remediate(FakeReport(ERR_HANG))
    assert adapter.actions() == ["drain", "restart", "restart"]


def test_set_healthy_clears_restart_counts(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, boot_time=T0 + 10_000, safety=Safety(max_restarts=1))
    rem.remediate(FakeReport(ERR_HANG))
    clock.t += 600
    store.clear_node(NODE, clock.t, "DIMM reseated")
    adapter.state = NodeState(NODE, "IDLE", False, None)
    clock.t += 600
    rem.remediate(FakeReport(ERR_HANG))
    assert adapter.actions() == ["drain", "restart", "drain", "restart"]


def test_node_drained_by_hand_is_never_resumed(store):
    adapter = FakeAdapter()
    store.set_node_record(NodeRecord(NODE, "restarting", T0 - 100, "driver-hang", "gpu:3",
                                     "auto", "reboot", T0 - 100))
    adapter.state = NodeState(NODE, "DRAIN", True, "bad fan, ticket 1234 -- alice")
    out = make(store, adapter, boot_time=T0).remediate(FakeReport(HEALTHY))
    assert adapter.calls == []
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("resume", "refused")
    assert "drained by someone else" in rec.detail and "ticket 1234" in rec.detail


def test_operator_resume_of_a_hand_drain_is_refused_too(store):
    adapter = FakeAdapter()
    adapter.state = NodeState(NODE, "DRAIN", True, "maintenance")
    out = make(store, adapter).act("resume", "")
    assert adapter.calls == [] and out.records[0].outcome == "refused"


def test_a_drain_by_hand_is_not_overwritten_by_the_agent(store):
    adapter = FakeAdapter()
    adapter.state = NodeState(NODE, "DRAIN", True, "maintenance")
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert adapter.calls == []
    assert out.records[0].outcome == "refused" and "maintenance" in out.records[0].detail


def test_blast_radius_refuses_and_records(store):
    others = [NodeState(f"gpu-{i:02d}", "IDLE", False, None) for i in range(2, 11)]
    others[0] = NodeState("gpu-02", "DRAIN", True, f"{REASON_PREFIX} FAULT xid-79 gpu:1")
    adapter, warnings = FakeAdapter(others), []
    out = make(store, adapter, warnings=warnings).remediate(FakeReport(FAULT79))
    assert adapter.calls == []
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("drain", "refused")
    assert "blast radius" in rec.detail and "2 of 10" in rec.detail and "gpu-02" in rec.detail
    assert any("REFUSED" in w for w in warnings)
    assert store.journal_tail(NODE)[-1].state == "refused"
    assert store.node_record(NODE).state == "in-service"


def test_blast_radius_ignores_drains_by_people():
    nodes = [NodeState(f"n{i}", "DRAIN", True, "maintenance") for i in range(5)]
    nodes += [NodeState(f"m{i}", "IDLE", False, None) for i in range(5)]
    assert blast_radius(nodes, "m0", 0.1) is None


def test_blast_radius_lets_a_small_partition_isolate_one_node_but_zero_forbids():
    assert blast_radius([NodeState("a", "IDLE", False, None)], "a", 0.1) is None
    assert "blast radius" in blast_radius([NodeState("a", "IDLE", False, None)], "a", 0.0)


def test_unreadable_cluster_state_refuses_the_drain(store):
    class Blind(FakeAdapter):
        """A scheduler that answers node state but not the node list."""

        def list_nodes(self):
            raise AdapterError("sinfo: error: slurm_load_node: Unable to contact controller")

    adapter = Blind()
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert adapter.calls == [] and "Unable to contact" in out.records[0].detail


def test_breaker_stays_open_until_reset(store):
    adapter, clock = FakeAdapter(), Clock()
    safety = Safety(breaker_max_drains=2, breaker_window_h=1, min_action_interval_s=0)
    rem = make(store, adapter, clock, safety=safety)
    for _ in range(2):  # two drains, each followed by a repair
        rem.remediate(FakeReport(FAULT79))
        store.clear_node(NODE, clock.t, "repaired")
        adapter.state = NodeState(NODE, "IDLE", False, None)
        clock.t += 60
    out = rem.remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "refused" and "tripped" in out.records[0].detail
    assert store.breaker().open
    clock.t += 10 * 3600  # the window has long passed: still open
    out = rem.remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "refused" and "breaker reset" in out.records[0].detail
    assert adapter.actions().count("drain") == 2
    store.reset_breaker(clock.t)
    rem.remediate(FakeReport(FAULT79))
    assert adapter.actions().count("drain") == 3


def test_breaker_open_stops_every_automatic_action_but_not_operators(store):
    store.open_breaker(T0, "test")
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert adapter.calls == [] and out.records[0].outcome == "refused"
    make(store, adapter).act("drain", "manual")
    assert adapter.actions() == ["drain"]


def test_same_fault_in_the_dedup_window_does_not_act_twice(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock)
    rem.remediate(FakeReport(FAULT79))
    # a second agent run that read the state before the first one finished:
    store.set_node_record(NodeRecord(NODE))
    adapter.state = NodeState(NODE, "IDLE", False, None)
    clock.t += 30
    out = make(store, adapter, clock, safety=Safety(min_action_interval_s=0)).remediate(
        FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "replace"]
    assert any("dedup" in n for n in out.notes)


def test_rate_limit_refuses_a_new_drain_right_after_an_action(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, gpu_resetter=FakeReset(), retest=lambda: HEALTHY)
    rem.remediate(FakeReport(ERR_REMAP))  # drain, reset, retest, resume
    clock.t += 10
    out = rem.remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "refused" and "rate limit" in out.records[0].detail
    clock.t += 120
    rem.remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "resume", "drain", "replace"]


@pytest.mark.parametrize("how", ["store", "config"])
def test_opted_out_node_gets_no_automatic_action(store, how):
    adapter = FakeAdapter()
    if how == "store":
        store.set_opt_out(NODE, True, T0, "burn-in by vendor")
    out = make(store, adapter, safety=Safety(opt_out=how == "config")).remediate(
        FakeReport(FAULT79))
    assert adapter.calls == [] and "opted out" in out.records[0].detail


def test_dry_run_records_dry_run_and_changes_nothing(store):
    adapter = FakeAdapter()
    out = make(store, adapter, dry_run=True).remediate(FakeReport(FAULT79))
    assert adapter.calls == []
    assert [(r.action, r.outcome) for r in out.records] == [("drain", "dry-run"),
                                                           ("replace", "dry-run")]
    assert store.node_record(NODE).state == "in-service"
    assert [r.state for r in store.journal_tail(NODE)] == ["dry-run", "dry-run"]


def test_adapter_error_is_a_failed_action_kept_for_retry(store):
    adapter, clock = FakeAdapter(fail=AdapterError("scontrol: error: Invalid node name")), Clock()
    out = make(store, adapter, clock).remediate(FakeReport(FAULT79))
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("drain", "failed") and "Invalid node name" in rec.detail
    assert store.node_record(NODE).state == "in-service"
    adapter.fail = None
    clock.t += 120
    make(store, adapter, clock).remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "replace"]
    drains = [r for r in store.journal_tail(NODE) if r.action == "drain"]
    assert len(drains) == 1 and drains[0].state == "done" and drains[0].tries == 2


def test_adapter_bug_is_a_failed_action_not_a_crash(store):
    adapter = FakeAdapter(fail=RuntimeError("boom"))
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "failed" and "RuntimeError: boom" in out.records[0].detail


def test_recovery_completes_a_started_drain_once(store):
    store.journal_plan(key=f"{NODE}|drain|xid-79@gpu:5|0", node=NODE, action="drain",
                       reason=f"{REASON_PREFIX} FAULT xid-79 gpu:5", fault_code="xid-79",
                       target="gpu:5", attempt=0, to_state="fault", trigger="auto",
                       adapter="fake", now=T0 - 5, state="started")
    adapter = FakeAdapter()
    out = make(store, adapter).recover()
    assert adapter.actions() == ["drain"] and out.records[0].outcome == "done"
    assert store.node_record(NODE).state == "fault"
    make(store, adapter).recover()
    assert adapter.actions() == ["drain"]


def test_recovery_does_not_repeat_a_drain_already_in_place(store):
    store.journal_plan(key="k", node=NODE, action="drain", reason=f"{REASON_PREFIX} x",
                       fault_code="xid-79", target="gpu:5", attempt=0, to_state="fault",
                       trigger="auto", adapter="fake", now=T0 - 5, state="started")
    adapter = FakeAdapter()
    adapter.state = NodeState(NODE, "DRAIN", True, f"{REASON_PREFIX} x")
    out = make(store, adapter).recover()
    assert adapter.calls == [] and "already drained" in out.records[0].detail
    assert store.open_journal(NODE) == []


def test_operator_reason_is_sanitised_before_the_adapter(store):
    adapter = FakeAdapter()
    text = sanitise_operator_text("GPU 3 fan\n; scontrol delete\x07\x1b[2J " + "x" * 500)
    make(store, adapter).act("drain", text)
    ((_, _, reason),) = adapter.calls
    assert reason.startswith(REASON_PREFIX) and "\n" not in reason and "\x1b" not in reason
    assert all(32 <= ord(c) < 127 for c in reason) and len(reason) <= 200


def test_sanitise_operator_text_caps_and_flattens():
    assert sanitise_operator_text("a\r\nb\tc") == "a b c"
    assert len(sanitise_operator_text("y" * 1000)) == 160
    assert sanitise_operator_text(None) == ""


def test_evidence_is_collected_before_a_disruptive_action(store, tmp_path):
    from node_agent.kernel_log import LinesKernelLog

    adapter = FakeAdapter()
    rem = Remediator(store, adapter, NODE, Safety(), state_dir=tmp_path, clock=Clock(),
                     kernel_log=LinesKernelLog(["NVRM: Xid (PCI:0000:3b:00): 79, pid=1"]),
                     warn=lambda _m: None)
    out = rem.act("drain", "looks sick")
    (directory,) = (tmp_path / "evidence").iterdir()
    assert directory.name.endswith("-drain")
    assert "Xid" in (directory / "kernel-log.txt").read_text()
    assert (directory / "stacks.txt").read_text().startswith("skipped:")
    assert str(directory) in out.records[0].detail
