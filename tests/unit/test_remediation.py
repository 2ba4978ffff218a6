"""Remediation: the plan for each grade and state, and every safety guard around it.

Planning is tested as a pure function; the guards, journal and recovery through
:class:`Remediator` with a real SQLite store, a fake scheduler adapter and a fake clock.
"""

from __future__ import annotations

import gzip
import os
import stat
import sys
import time
from pathlib import Path

import pytest
from cloud_metadata_standin import MetadataStandIn  # tests/cloud_metadata_standin.py

from node_agent import resources
from node_agent.checking.xid_fold import Folder
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.host import cloud_metadata
from node_agent.kernel_log import SxidLine, scan_lines
from node_agent.model import (
    Action,
    ActionOutcome,
    ActionRecord,
    Grade,
    Level,
    PlannedEvent,
    Reason,
    Refusal,
    Remedy,
    Result,
    Status,
)
from node_agent.remediation.evidence import BugReportCollector
from node_agent.remediation.executor import Remediator
from node_agent.remediation.gpu_reset import GpuResetError
from node_agent.remediation.guards import blast_radius, sanitise_operator_text
from node_agent.remediation.plan import (
    JOB_RULES,
    Safety,
    Step,
    fault_code,
    job_of,
    plan,
    short_message,
)
from node_agent.remediation.store import NodeRecord, open_store
from node_agent.schedulers.base import (
    REASON_PREFIX,
    AdapterError,
    AdapterOutcome,
    AdapterStatus,
    NodeState,
    check_job_id,
)

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
        self.jobs: list[str] = []  # the job of each restart_job call
        self.keys: list[str | None] = []  # the idempotency key of each call, failed ones too
        self.evidence: list[str | None] = []  # the bug report each replace request named

    def node_state(self, node: str) -> NodeState:
        return self.state

    def _do(self, action: str, node: str, reason: str, drained: bool | None) -> AdapterOutcome:
        if self.fail is not None:
            raise self.fail
        self.calls.append((action, node, reason))
        if drained is not None:
            self.state = NodeState(
                node, "DRAIN" if drained else "IDLE", drained, reason if drained else None
            )
        return AdapterOutcome.done(f"fake {action} {node}")

    def drain(self, node, reason, *, key=None):
        self.keys.append(key)
        return self._do("drain", node, reason, True)

    def resume(self, node, reason, *, key=None):
        self.keys.append(key)
        return self._do("resume", node, reason, False)

    def restart(self, node, reason, *, key=None):
        self.keys.append(key)
        return self._do("restart", node, reason, None)

    def replace(self, node, reason, *, key=None, evidence=None):
        self.keys.append(key)
        self.evidence.append(evidence)
        return self._do("replace", node, reason, True)

    def restart_job(self, node, job, reason, *, key=None):
        self.keys.append(key)
        if self.fail is not None:
            raise self.fail
        self.calls.append(("restart-job", node, reason))
        self.jobs.append(job)
        return AdapterOutcome.done(f"fake restart-job {job} on {node}")

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


def grade(
    level: Level,
    rule: str = "xid",
    target: str = "gpu:5",
    message: str = "",
    code: int | None = None,
) -> Grade:
    """A grade of one reason; an ``xid`` reason carries its catalog code as the grader gives
    it (79 unless told)."""
    if level == Level.HEALTHY:
        return Grade(Level.HEALTHY, Action.NONE)
    if rule == "xid" and code is None:
        code = 79
    msg = message or (
        f"Xid {code} on {target} [Xid {code}: fallen off the bus]"
        if rule == "xid"
        else f"{rule} on {target}"
    )
    action = {Level.WARN: Action.NONE, Level.ERROR: Action.RESTART, Level.FAULT: Action.REPLACE}[
        level
    ]
    return Grade(
        level,
        action,
        (Reason(rule, level, target, msg, catalog="xid" if code is not None else None, code=code),),
    )


HEALTHY = Grade(Level.HEALTHY, Action.NONE)
FAULT79 = grade(Level.FAULT)
ERR_REMAP = grade(Level.ERROR, "row-remap-pending", "gpu:2")
ERR_HANG = grade(Level.ERROR, "driver-hang", "gpu:3")


class FakeReport:
    """The fields of a Report the remediator reads (building a whole Report is noise here)."""

    def __init__(self, g: Grade, suite: str = "quick"):
        self.grade, self.suite, self.mode = g, suite, "service"

    def to_dict(self) -> dict:  # what evidence writes as report.json
        return {"suite": self.suite, "grade": self.grade.to_dict()}


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "state")
    yield s
    s.close()


def make(store, adapter=None, clock=None, safety=None, warnings=None, **kw):
    warnings = [] if warnings is None else warnings
    return Remediator(
        store,
        adapter or FakeAdapter(),
        NODE,
        safety or Safety(),
        state_dir=None,
        clock=clock or Clock(),
        warn=warnings.append,
        **kw,
    )


def plan_for(
    g, record=None, counts=None, now=T0, boot=T0, reset=False, tried=False, remediations=0, **safety
):
    return plan(
        g,
        record or NodeRecord(NODE),
        Safety(**safety),
        now=now,
        boot_time=boot,
        restart_counts=counts or {},
        gpu_reset_available=reset,
        gpu_reset_tried=tried,
        remediations_7d=remediations,
    )


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
    assert [(s.action, s.to_state) for s in p.steps] == [
        ("drain", "drained"),
        ("restart", "restarting"),
    ]
    assert p.steps[1].restart_kind == "reboot"


def test_pending_row_remap_plans_gpu_reset_and_quick_retest():
    p = plan_for(ERR_REMAP, reset=True)
    assert [s.action for s in p.steps] == ["drain", "gpu-reset", "retest"]
    assert p.steps[1].gpu_index == 2


def test_after_a_gpu_reset_in_this_run_the_next_restart_is_a_reboot():
    p = plan_for(
        ERR_REMAP,
        record=NodeRecord(NODE, "retest", T0),
        reset=True,
        tried=True,
        counts={"row-remap-pending": 1},
    )
    assert [s.action for s in p.steps] == ["restart"]


def test_fault_recurring_after_max_restarts_escalates_to_fault():
    p = plan_for(
        ERR_HANG,
        record=NodeRecord(NODE, "restarting", T0, restart_kind="reboot", requested_at=T0 - 10),
        counts={"driver-hang": 2},
        max_restarts=2,
    )
    assert p.escalated and [s.action for s in p.steps] == ["replace"]
    assert "FAULT driver-hang" in p.steps[0].reason and "max_restarts=2" in p.note


def test_a_codes_restarts_before_fault_on_the_reason_replaces_safety_max_restarts():
    xid109 = Grade(
        Level.ERROR,
        Action.RESTART,
        (
            Reason(
                "xid",
                Level.ERROR,
                "gpu:1",
                "Xid 109",
                catalog="xid",
                code=109,
                restarts_before_fault=4,
            ),
        ),
    )
    restarting = NodeRecord(NODE, "restarting", T0, restart_kind="reboot", requested_at=T0 - 10)
    p = plan_for(xid109, record=restarting, counts={"xid-109": 3}, max_restarts=2)
    assert [s.action for s in p.steps] == ["restart"] and "restart 4 of 4" in p.note
    p = plan_for(xid109, record=restarting, counts={"xid-109": 4}, max_restarts=2)
    assert p.escalated and "restarts_before_fault in graders/xid.yaml=4" in p.note


def test_a_node_restarted_max_remediations_7d_times_is_held_not_restarted():
    p = plan_for(ERR_HANG, remediations=5)
    assert [(s.action, s.to_state, s.fault_code) for s in p.steps] == [
        ("drain", "drained", "driver-hang"),
        ("hold", "needs-operator", "remediations-7d"),
    ]
    assert "needs-operator 5 remediations in 7 d" in p.steps[0].reason
    assert "safety.max_remediations_7d=5" in p.note
    assert [s.action for s in plan_for(ERR_HANG, remediations=4).steps] == ["drain", "restart"]
    held = NodeRecord(NODE, "needs-operator", T0, "remediations-7d", "node", "auto")
    assert plan_for(ERR_HANG, record=held).steps == ()  # held until an operator, not by time
    assert [s.action for s in plan_for(FAULT79, record=held).steps] == ["replace"]
    assert plan_for(HEALTHY, record=held).steps == ()


def test_xid_restarts_are_counted_per_xid_code():
    assert fault_code(Reason("xid", Level.ERROR, "gpu:1", "x", catalog="xid", code=31)) == "xid-31"
    assert fault_code(Reason("driver-hang", Level.ERROR, "gpu:1", "hung")) == "driver-hang"
    xid31 = grade(Level.ERROR, "xid", "gpu:1", "Xid 31 [Xid 31: MMU fault]", code=31)
    assert not plan_for(xid31, counts={"xid-43": 5}).escalated


@pytest.fixture(scope="module")
def grader():
    return load_grader(resources.graders_dir(config_from_dict({})))


def graded_kernel_lines(grader, lines: list[str]) -> Grade:
    """What the ``xid`` check and the shipped grader make of these kernel-log lines (the same
    folding as ``checks/xid/``; an Xid's bus stands for gpu:0)."""
    folder = Folder()
    for event in scan_lines(lines):
        folder.add(event, event.target if isinstance(event, SxidLine) else "gpu:0", "test")
    return grader.grade([fold.result() for fold in folder.sorted()], "service")


SXID_20034 = "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 28 LTSSM Fault Up"
SXID_22012 = (
    "nvidia-nvswitch1: SXid (PCI:0000:c4:00.0): 22012, Fatal, Link 3 Minion Link NA interrupt"
)


def test_sxid_restarts_are_counted_per_sxid_code_apart_from_xids(grader):
    g = graded_kernel_lines(grader, [SXID_20034, SXID_22012])
    assert [(r.rule, fault_code(r)) for r in g.reasons] == [
        ("sxid", "sxid-20034"),
        ("sxid", "sxid-22012"),
    ]
    assert short_message(g.reasons[0]).startswith("SXid 20034: LTSSM Fault Up")
    # an Xid with the same number (not in the XID catalog: ERROR) keeps its own count
    xid = grader.grade([Result("xid", "gpu:0", "xid", Status.FAIL, "Xid 20034", value=20034)])
    assert fault_code(xid.reasons[0]) == "xid-20034"
    sxid = Grade(Level.ERROR, Action.RESTART, g.reasons[:1])
    assert not plan_for(sxid, counts={"xid-20034": 5, "sxid-22012": 5}).escalated
    assert plan_for(sxid, counts={"sxid-20034": 2}, max_restarts=2).escalated
    p = plan_for(sxid)
    assert "ERROR sxid-20034 nvswitch:0" in p.steps[0].reason
    assert (p.fault_code, p.target) == ("sxid-20034", "nvswitch:0")


def test_the_fault_code_is_the_reasons_typed_code_never_its_message():
    r = Reason(
        "sxid",
        Level.ERROR,
        "nvswitch:0",
        "SXid 20034 on nvswitch:0: odd text [Xid 79 [SXid 20034: LTSSM Fault Up]",
        catalog="sxid",
        code=20034,
    )
    assert fault_code(r) == "sxid-20034"
    # a message that quotes a code decides nothing: a reason without a typed code is its rule
    assert fault_code(Reason("xid", Level.ERROR, "gpu:1", "x [Xid 79: fallen off]")) == "xid"


# -- software causes: restarts spent, no replacement (remedy: software in graders/rules.yaml) --
NO_DRIVER_DETAIL = (
    "8 NVIDIA GPU(s) on the PCI bus (0000:18:00.0 10de:2330, ...) but the NVIDIA kernel driver "
    "(nvidia.ko) is not loaded or holds none of them, so no GPU can be used: check `dmesg | grep "
    "-i nvrm` for why nvidia.ko did not load [NVML: NVML Shared Library Not Found]"
)


def graded(grader, *results: Result, mode: str = "service") -> Grade:
    return grader.grade(list(results), mode)


def no_driver() -> Result:
    return Result("nvml_health", "node", "driver_not_loaded", Status.ERROR, NO_DRIVER_DETAIL)


def remap_pending() -> Result:
    return Result(
        "nvml_health", "gpu:2", "row_remap_pending", Status.FAIL, "1 row remap pending on gpu:2"
    )


AFTER_REBOOTS = NodeRecord(
    NODE, "restarting", T0, "driver-not-loaded", "node", "auto", "reboot", T0 - 10
)


def test_driver_not_loaded_after_max_restarts_stays_drained_for_an_operator(grader):
    g = graded(grader, no_driver())
    assert g.level is Level.ERROR and g.reasons[0].remedy == "software"
    p = plan_for(g, record=AFTER_REBOOTS, counts={"driver-not-loaded": 2}, max_restarts=2)
    assert [(s.action, s.to_state) for s in p.steps] == [("hold", "needs-operator")]
    assert not p.escalated and "replace" not in [s.action for s in p.steps]
    assert p.note.startswith(
        "needs an operator: driver-not-loaded on node is still there after 2 restart(s)"
    )
    assert "set-healthy" in p.note and "act resume" in p.note
    assert "needs-operator" in p.steps[0].reason and "ERROR driver-not-loaded" in p.steps[0].reason
    # held: the next runs neither restart nor replace, whatever software ERROR they see
    held = NodeRecord(NODE, "needs-operator", T0, "driver-not-loaded", "node", "auto")
    check_hang = Result("gpu_burn", "gpu:0", "timeout", Status.ERROR, "timed out after 900 s")
    for again in (g, graded(grader, no_driver(), check_hang)):
        p = plan_for(again, record=held, counts={"driver-not-loaded": 5})
        assert p.steps == () and "needs an operator" in p.note
    # and a passing run does not return it: the operator does (set-healthy, act resume)
    p = plan_for(HEALTHY, record=held)
    assert p.steps == () and "set-healthy" in p.note


def test_software_cause_on_a_node_back_in_service_is_drained_again_then_held(grader):
    """An operator resumed without set-healthy: the restarts still count, so drain and hold."""
    p = plan_for(graded(grader, no_driver()), counts={"driver-not-loaded": 2}, max_restarts=2)
    assert [(s.action, s.to_state) for s in p.steps] == [
        ("drain", "drained"),
        ("hold", "needs-operator"),
    ]


@pytest.mark.parametrize(
    ("check", "target", "metric", "rule"),
    [
        ("hca_ports", "hca:mlx5_3", "link_state", "hca-port-down"),
        ("hca_ports", "hca:mlx5_3", "port_rate_gbps", "hca-port-rate"),
        ("rdma", "hca:mlx5_3", "link_state", "rdma-port-down"),
        ("rdma", "hca:mlx5_3", "port_rate_gbps", "rdma-port-rate-degraded"),
        ("host_power", "psu:PS2", "psu_status", "psu-failed"),
        ("host_power", "node", "psu_redundancy", "psu-redundancy-lost"),
        ("nvlink_fabric", "gpu:1", "fabric_health", "nvlink-fabric-unhealthy"),
        ("nvlink_fabric", "gpu:1", "fabric_clique", "nvlink-fabric-wrong-clique"),
        ("nvml_health", "node", "nvlink_down_alike", "nvlink-down-alike"),
    ],
)
def test_a_cause_outside_the_parts_a_replacement_swaps_is_held_never_replaced(
    grader, check, target, metric, rule
):
    """An IB port the subnet manager has not configured (INIT) or the switch holds down, a PSU
    whose feed is lost, a fabric manager that gave the tray no partition, a switch tray out:
    no reboot fixes them, and after two reboots the node was replaced. Held for an operator."""
    g = graded(grader, Result(check, target, metric, Status.FAIL, "down"))
    (reason,) = g.reasons
    assert (reason.rule, reason.level, reason.remedy) == (rule, Level.ERROR, "elsewhere")
    first = plan_for(g, counts={})
    record = NodeRecord(NODE, "restarting", T0, first.fault_code, target, "auto", "reboot", T0)
    p = plan_for(g, record=record, counts={first.fault_code: 2}, max_restarts=2)
    assert [(s.action, s.to_state) for s in p.steps] == [("hold", "needs-operator")]
    assert not p.escalated and "far end" in p.note


def test_a_failure_no_rule_classifies_is_restarted_and_then_held_never_replaced(grader):
    """A FAIL that no rule in graders/rules.yaml knows (a new metric, a check the rules never
    heard of) fell back to a plain ERROR, taken for hardware: after its restarts the node was
    replaced on a finding nobody had classified. It is restarted, then held for an operator."""
    g = graded(grader, Result("gpu_burn", "gpu:5", "something_new", Status.FAIL, "odd"))
    (reason,) = g.reasons
    assert (reason.rule, reason.level, reason.remedy) == (
        "unclassified-fail",
        Level.ERROR,
        "unclassified",
    )
    first = plan_for(g, counts={})
    assert [s.action for s in first.steps] == ["drain", "restart"]
    record = NodeRecord(NODE, "restarting", T0, first.fault_code, "gpu:5", "auto", "reboot", T0)
    p = plan_for(g, record=record, counts={first.fault_code: 2}, max_restarts=2)
    assert [(s.action, s.to_state) for s in p.steps] == [("hold", "needs-operator")]
    assert not p.escalated and "no rule" in p.note


def test_hardware_error_surviving_its_restarts_still_escalates_to_replace(grader):
    g = graded(grader, remap_pending())
    assert g.reasons[0].remedy is None
    record = NodeRecord(
        NODE, "restarting", T0, "row-remap-pending", "gpu:2", "auto", "reboot", T0 - 10
    )
    p = plan_for(g, record=record, counts={"row-remap-pending": 2}, max_restarts=2)
    assert p.escalated and [s.action for s in p.steps] == ["replace"]
    assert "FAULT row-remap-pending gpu:2" in p.steps[0].reason


@pytest.mark.parametrize(
    ("result", "rule"),
    [
        (Result("nvml_health", "gpu:1", "ecc_dbe_volatile", Status.FAIL, "2", value=2), None),
        (Result("dcgm_health", "gpu:1", "health_mem_uncorrectable", Status.FAIL, "4"), None),
        (None, "NVRM: Xid (PCI:0000:18:00): 48, pid=1234, name=python, An uncorrectable ECC error"),
    ],
)
def test_a_double_bit_ecc_error_restarts_first_and_is_replaced_only_when_it_comes_back(
    grader, result, rule
):
    """A first uncorrectable memory error was a replacement. NVIDIA's memory error management:
    the page is offlined and a row remap recorded that the next GPU reset applies, after which
    the memory is whole; DCGM's advice is "drain the GPU and reset it or reboot the node". So the
    node is drained and restarted; the error seen again after its restarts replaces the GPU."""
    g = graded_kernel_lines(grader, [rule]) if rule else graded(grader, result)
    (reason,) = g.reasons
    assert g.level is Level.ERROR and reason.remedy is None
    first = plan_for(g, counts={})
    assert "replace" not in [s.action for s in first.steps] and not first.escalated
    code = first.fault_code
    record = NodeRecord(NODE, "restarting", T0, code, reason.target, "auto", "reboot", T0)
    again = plan_for(g, record=record, counts={code: 2}, max_restarts=2)
    assert again.escalated and [s.action for s in again.steps] == ["replace"]


XID_79 = (
    "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)
SHORT_A_GPU = Result(
    "nvml_health", "node", "gpu_count", Status.FAIL, "7 of 8 expected GPUs visible"
)


@pytest.mark.parametrize(
    ("result", "line", "restarts"),
    [
        (None, XID_79, 1),
        (
            Result("nvml_health", "gpu:1", "gpu_lost", Status.FAIL, "NVML_ERROR_GPU_IS_LOST"),
            None,
            2,
        ),
        (SHORT_A_GPU, None, 2),
    ],
)
def test_a_gpu_that_fell_off_the_bus_is_rebooted_first_and_replaced_when_it_stays_gone(
    grader, result, line, restarts
):
    """A GPU that fell off the bus was a replacement at first sight. NVIDIA's catalog says
    RESTART_BM for Xid 79 (CONTACT_SUPPORT if it persists), and a link that failed to retrain
    comes back with the power cycle: the node is drained and rebooted; Xid 79 again after one
    reboot, or a GPU still lost or missing after the node's restarts, is the replacement."""
    g = graded_kernel_lines(grader, [line]) if line else graded(grader, result)
    (reason,) = g.reasons
    assert g.level is Level.ERROR and reason.remedy is None
    first = plan_for(g, counts={})
    assert [s.action for s in first.steps] == ["drain", "restart"]
    assert first.steps[1].restart_kind == "reboot"
    code = first.fault_code
    record = NodeRecord(NODE, "restarting", T0, code, reason.target, "auto", "reboot", T0)
    if restarts > 1:
        assert not plan_for(g, record=record, counts={code: restarts - 1}, max_restarts=2).escalated
    again = plan_for(g, record=record, counts={code: restarts}, max_restarts=2)
    assert again.escalated and [s.action for s in again.steps] == ["replace"]


def test_a_gpu_still_gone_after_the_reboot_its_xid_asked_for_spends_that_reboot(grader):
    """Xid 79, then the same GPU missing from the count once the node rebooted: one fault seen by
    two witnesses. The reboot Xid 79 asked for counts towards gpu-missing's restarts, where it
    had started gpu-missing's count from nought: three reboots before the replacement."""
    missing = graded(grader, SHORT_A_GPU)
    after_reboot = NodeRecord(NODE, "restarting", T0, "xid-79", "gpu:0", "auto", "reboot", T0)
    once = plan_for(missing, record=after_reboot, counts={"xid-79": 1}, max_restarts=2)
    assert not once.escalated and [s.action for s in once.steps] == ["restart"]
    twice = plan_for(
        missing, record=after_reboot, counts={"xid-79": 1, "gpu-missing": 1}, max_restarts=2
    )
    assert twice.escalated and [s.action for s in twice.steps] == ["replace"]
    # another code's restarts are its own
    other = plan_for(missing, record=after_reboot, counts={"xid-31": 5}, max_restarts=2)
    assert not other.escalated


def test_a_mix_of_software_and_hardware_errors_counts_and_escalates_the_hardware(grader):
    hang = Result("gpu_burn", "gpu:0", "timeout", Status.ERROR, "timed out after 900 s")
    g = graded(grader, hang, remap_pending(), no_driver())
    assert [(r.rule, r.remedy) for r in g.reasons] == [
        ("check-hang", "software"),
        ("row-remap-pending", None),
        ("driver-not-loaded", "software"),
    ]
    first = plan_for(g, counts={})
    assert first.fault_code == "row-remap-pending" and first.target == "gpu:2"
    p = plan_for(g, record=AFTER_REBOOTS, counts={"row-remap-pending": 2}, max_restarts=2)
    assert p.escalated and [s.action for s in p.steps] == ["replace"]
    assert "FAULT row-remap-pending gpu:2" in p.steps[0].reason
    assert "row-remap-pending on gpu:2 is still there" in p.note


def test_restarts_a_software_cause_spent_never_escalate_a_hardware_finding_beside_it(grader):
    """The audit's case: restarts spent on one code (here a check that hangs) had escalated
    the first hardware finding of the grade, which had had no restart of its own."""
    hang = Result("gpu_burn", "gpu:0", "timeout", Status.ERROR, "timed out after 900 s")
    g = graded(grader, hang, remap_pending())
    p = plan_for(g, record=AFTER_REBOOTS, counts={"check-hang": 2}, max_restarts=2)
    assert not p.escalated and [s.action for s in p.steps] == ["restart"]
    assert p.fault_code == "row-remap-pending"


def test_a_first_hardware_finding_beside_a_held_application_xid_is_restarted_not_replaced():
    """The audit's case: an Xid 31 (class application) on gpu:3 outlived its restarts and was
    held for an operator; a switch port then flapped once (hca-port-down). The port's code had
    had no restart, yet the Xid's spent restarts escalated it to a replacement."""
    xid31 = Reason(
        "xid", Level.ERROR, "gpu:3", "Xid 31", catalog="xid", code=31, remedy=Remedy.APPLICATION
    )
    port = Reason("hca-port-down", Level.ERROR, "hca:mlx5_0", "port mlx5_0/1 is DOWN")
    g = Grade(Level.ERROR, Action.RESTART, (xid31, port))
    held = NodeRecord(NODE, "needs-operator", T0, "xid-31", "gpu:3", "auto")
    for record in (held, AFTER_REBOOTS, NodeRecord(NODE)):
        p = plan_for(g, record=record, counts={"xid-31": 2}, max_restarts=2)
        assert not p.escalated and "replace" not in [s.action for s in p.steps], record.state


def test_an_announced_maintenance_beside_a_software_cause_is_held_never_replaced():
    """The audit's case: the planned reason (target node) sorted first and collected the
    restarts; once spent, escalation took it for the hardware finding and replaced the node."""
    event = Reason(
        "cloud-maintenance", Level.ERROR, "node", "Reboot at 12:00", remedy=Remedy.PLANNED
    )
    driver = Reason("driver-not-loaded", Level.ERROR, "node", "no driver", remedy=Remedy.SOFTWARE)
    g = Grade(Level.ERROR, Action.RESTART, (event, driver))
    for counts in ({"cloud-maintenance": 2}, {"driver-not-loaded": 2}):
        p = plan_for(g, record=AFTER_REBOOTS, counts=counts, max_restarts=2)
        assert not p.escalated and "replace" not in [s.action for s in p.steps], counts
    spent = plan_for(g, record=AFTER_REBOOTS, counts={"driver-not-loaded": 2}, max_restarts=2)
    assert [(s.action, s.to_state) for s in spent.steps] == [("hold", "needs-operator")]


XID_74 = (
    "[{t}] NVRM: Xid (PCI:{bus}): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error "
    "detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"
)  # the line of NVSentinel's NVLink workflow (realworld/xid/x25), at seconds since boot {t}


def test_an_nvlink_error_several_gpus_report_is_the_far_ends_never_a_gpu_replaced(grader):
    """Xid 74 on all eight GPUs (the GPUs at every end report it): the restarts were counted on
    gpu:0's and, seen again after the reboot, gpu:0 was replaced; the NVSwitch they share, the
    far end, was never named. Several GPUs at once: held for an operator. One GPU: its own."""

    def graded_74(seconds: list[float]) -> Grade:
        folder = Folder()
        lines = [
            XID_74.format(t=f"{t:.6f}", bus=f"0000:{18 + i:02x}:00") for i, t in enumerate(seconds)
        ]
        for i, event in enumerate(scan_lines(lines)):
            folder.add(event, f"gpu:{i}", "test")
        return grader.grade([fold.result() for fold in folder.sorted()], "service")

    g = graded_74([449410.3, 449410.4, 449410.5, 449411.0])
    assert g.level is Level.ERROR and {r.remedy for r in g.reasons} == {Remedy.ELSEWHERE}
    assert "far end" in g.reasons[0].message
    spent = plan_for(g, record=AFTER_REBOOTS, counts={"xid-74": 2}, max_restarts=2)
    assert not spent.escalated and [s.action for s in spent.steps] == ["hold"]

    # days apart, each GPU's own, whichever is older (the window is both ways)
    apart = graded_74([3600.0, 92 * 3600.0])
    assert [r.remedy for r in apart.reasons] == [None, None]
    alone = graded_kernel_lines(grader, [XID_74.format(t="449410.332316", bus="0000:18:00")])
    (reason,) = alone.reasons
    assert reason.remedy is None  # the GPU's own: escalated once its restart is spent


def test_a_power_event_the_bmc_keeps_is_held_for_an_operator_never_replaced(grader):
    """The audit's case: the SEL keeps an AC-lost event (asserted, then deasserted) for its
    24 h window through every reboot, and the supplies read ok: two restarts, then a replace."""
    sel = Result("host_power", "psu", "sel_power", Status.FAIL, "PS1 AC lost, deasserted")
    g = graded(grader, sel)
    assert [(r.rule, r.remedy) for r in g.reasons] == [("sel-power-event", Remedy.RECORD)]
    record = NodeRecord(NODE, "restarting", T0, "sel-power-event", "psu", "auto", "reboot", T0 - 9)
    p = plan_for(g, record=record, counts={"sel-power-event": 2}, max_restarts=2)
    assert not p.escalated and [(s.action, s.to_state) for s in p.steps] == [
        ("hold", "needs-operator")
    ]
    assert "ipmitool sel" in p.note


def test_a_check_that_could_not_run_at_delivery_is_a_software_cause(grader):
    broken = Result("storage", "node", "ran", Status.ERROR, "fio not found on PATH")
    g = graded(grader, broken, mode="delivery")
    assert g.level is Level.ERROR and g.reasons[0].rule == "check-error-delivery"
    p = plan_for(g, record=AFTER_REBOOTS, counts={"check-error-delivery": 2}, max_restarts=2)
    assert [s.action for s in p.steps] == ["hold"]


def test_held_node_is_journaled_said_on_stderr_and_returned_by_the_operator(store, grader):
    adapter, clock, warnings = FakeAdapter(), Clock(), []
    rem = make(store, adapter, clock, boot_time=T0 + 10_000, warnings=warnings)
    report = FakeReport(graded(grader, no_driver()))
    for _ in range(4):
        out = rem.remediate(report)
        clock.t += 600
    assert adapter.actions() == ["drain", "restart", "restart"]  # no replace, ever
    record = store.node_record(NODE)
    assert (record.state, record.fault_code) == ("needs-operator", "driver-not-loaded")
    assert adapter.state.drained
    hold = [r for r in store.journal_tail(NODE) if r.action == "hold"]
    assert [r.state for r in hold] == ["done"] and "needs an operator" in hold[0].detail
    assert any("NEEDS AN OPERATOR" in w and "set-healthy" in w for w in warnings)
    assert out.records == [] and "needs an operator" in out.notes[-1]
    store.clear_node(NODE, clock.t, "driver rebuilt for the running kernel")  # set-healthy
    assert rem.act("resume", "driver fixed").records[0].outcome == "done"
    assert not adapter.state.drained and store.node_record(NODE).state == "in-service"


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
    p = plan_for(
        grade(Level.ERROR, "driver-hang", "gpu:3"),
        record=NodeRecord(NODE, "fault", T0, "xid-79", "gpu:5", "auto"),
    )
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
    assert [(r.action, r.outcome) for r in out.records] == [("drain", "done"), ("replace", "done")]
    assert store.node_record(NODE).state == "awaiting-replacement"
    assert [r.state for r in store.journal_tail(NODE)] == ["done", "done"]


def test_error_drains_resets_retests_and_resumes_on_pass(store):
    adapter, resets = FakeAdapter(), FakeReset()
    out = make(store, adapter, gpu_resetter=resets, retest=lambda: HEALTHY).remediate(
        FakeReport(ERR_REMAP)
    )
    assert adapter.actions() == ["drain", "resume"] and resets.resets == [2]
    assert [r.action for r in out.records] == ["drain", "gpu-reset", "retest", "resume"]
    assert store.node_record(NODE).state == "in-service"


def test_error_surviving_gpu_reset_gets_a_reboot_request(store):
    adapter = FakeAdapter()
    make(store, adapter, gpu_resetter=FakeReset(), retest=lambda: ERR_REMAP).remediate(
        FakeReport(ERR_REMAP)
    )
    assert adapter.actions() == ["drain", "restart"]
    assert store.node_record(NODE).state == "restarting"


def test_failed_gpu_reset_falls_back_to_reboot_request(store):
    adapter = FakeAdapter()
    out = make(store, adapter, gpu_resetter=FakeReset(fail=True), retest=lambda: HEALTHY).remediate(
        FakeReport(ERR_REMAP)
    )
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


def test_a_gpu_off_the_bus_then_missing_is_replaced_after_two_reboots_not_three(store, grader):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, boot_time=T0 + 10_000)  # every run is "after the reboot"
    rem.remediate(FakeReport(graded_kernel_lines(grader, [XID_79])))
    for _ in range(2):
        clock.t += 600
        rem.remediate(FakeReport(graded(grader, SHORT_A_GPU)))
    assert adapter.actions() == ["drain", "restart", "restart", "replace"]
    assert store.node_record(NODE).state == "awaiting-replacement"


def test_restarts_outside_the_window_do_not_count(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(
        store,
        adapter,
        clock,
        boot_time=T0 + 10 * 86400,
        safety=Safety(max_restarts=1, restart_window_h=1),
    )
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
    store.set_node_record(
        NodeRecord(NODE, "restarting", T0 - 100, "driver-hang", "gpu:3", "auto", "reboot", T0 - 100)
    )
    adapter.state = NodeState(NODE, "DRAIN", True, "bad fan, ticket 1234 -- alice")
    out = make(store, adapter, boot_time=T0).remediate(FakeReport(HEALTHY))
    assert adapter.calls == []
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("resume", "refused")
    assert rec.refusal is Refusal.FOREIGN_DRAIN and not out.wants_retry
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
    assert (rec.action, rec.outcome, rec.refusal) == ("drain", "refused", Refusal.GUARD)
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


@pytest.mark.parametrize(
    "listed",
    [[], [NodeState("gpu-02", "IDLE", False, None)]],
    ids=["an empty answer", "a list without this node"],
)
def test_a_node_list_that_does_not_name_this_node_refuses_the_drain(store, listed):
    """An empty or cut answer cannot say how many nodes are drained: never read as none."""

    class Partial(FakeAdapter):
        def list_nodes(self):
            return listed

    adapter = Partial()
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    (rec,) = out.records
    assert adapter.calls == [] and (rec.outcome, rec.refusal) == ("refused", Refusal.GUARD)
    assert f"does not name {NODE}" in rec.detail and "not draining blind" in rec.detail


class Unseeing(FakeAdapter):
    """An adapter that cannot read the node's state (as log and webhook): ``known`` False."""

    def node_state(self, node: str) -> NodeState:
        return NodeState(node, "unknown", False, None, known=False)

    def list_nodes(self):
        return []


def test_an_adapter_that_cannot_read_the_node_is_sent_every_step_resume_included(store):
    """Its "not drained" says nothing: a resume is sent, never settled as "already" (a
    webhook's receiver kept the node drained while the agent's record said in service)."""
    adapter = Unseeing()
    rem = make(store, adapter, gpu_resetter=FakeReset(), retest=lambda: HEALTHY)
    rem.remediate(FakeReport(ERR_REMAP))  # drain, reset, retest, resume
    assert adapter.actions() == ["drain", "resume"]  # the blast radius is the receiver's
    assert store.node_record(NODE).state == "in-service"


def test_max_drained_fraction_zero_still_forbids_a_drain_through_an_unseeing_adapter(store):
    adapter = Unseeing()
    out = make(store, adapter, safety=Safety(max_drained_fraction=0.0)).remediate(
        FakeReport(FAULT79)
    )
    assert adapter.calls == [] and "max_drained_fraction=0" in out.records[0].detail


def test_a_schedulers_answer_on_stderr_is_escaped(store, capsys):
    """A failed drain quotes the scheduler's (or a webhook receiver's) answer: its control
    characters reach the operator's terminal escaped, as on stdout."""
    answer = "HTTP 403: \x1b]0;owned\x07\x1b[31mFAKE: drain DONE\x1b[0m \u202eevil"
    adapter = FakeAdapter(fail=AdapterError(answer))
    Remediator(store, adapter, NODE, Safety(), state_dir=None, clock=Clock()).remediate(
        FakeReport(FAULT79)
    )
    err = capsys.readouterr().err
    assert "drain FAILED" in err and "\\x1b[31mFAKE" in err
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err


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
        FakeReport(FAULT79)
    )
    assert adapter.actions() == ["drain", "replace"]
    assert any("dedup" in n for n in out.notes)


def test_rate_limit_refuses_a_new_drain_right_after_an_action(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, gpu_resetter=FakeReset(), retest=lambda: HEALTHY)
    rem.remediate(FakeReport(ERR_REMAP))  # drain, reset, retest, resume
    clock.t += 10
    out = rem.remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "refused" and "rate limit" in out.records[0].detail
    # the daemon hands a grade over when it changes; a refusal for being too soon is retried
    # while the grade stands, or a FAULT found 10 s after a resume would never be drained
    assert out.records[0].refusal is Refusal.RATE_LIMIT and out.wants_retry
    clock.t += 120
    rem.remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "resume", "drain", "replace"]


@pytest.mark.parametrize("how", ["store", "config"])
def test_opted_out_node_gets_no_automatic_action(store, how):
    adapter = FakeAdapter()
    if how == "store":
        store.set_opt_out(NODE, True, T0, "burn-in by vendor")
    out = make(store, adapter, safety=Safety(opt_out=how == "config")).remediate(
        FakeReport(FAULT79)
    )
    assert adapter.calls == [] and "opted out" in out.records[0].detail


def test_dry_run_records_dry_run_and_changes_nothing(store):
    adapter = FakeAdapter()
    out = make(store, adapter, dry_run=True).remediate(FakeReport(FAULT79))
    assert adapter.calls == []
    assert [(r.action, r.outcome) for r in out.records] == [
        ("drain", "dry-run"),
        ("replace", "dry-run"),
    ]
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
    # the journal shows each attempt: the failed one and its retry, under one key
    drains = [r for r in store.journal_tail(NODE) if r.action == "drain"]
    assert [(r.state, r.tries) for r in drains] == [("failed", 1), ("done", 2)]
    assert drains[0].key == drains[1].key and "retry 2 of drain" in drains[1].detail
    # and the adapter saw the same idempotency key both times
    assert adapter.keys[0] == adapter.keys[1] and len(adapter.keys[0]) == 64


def test_adapter_bug_is_a_failed_action_not_a_crash(store):
    adapter = FakeAdapter(fail=RuntimeError("boom"))
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert out.records[0].outcome == "failed" and "RuntimeError: boom" in out.records[0].detail


def interrupted(
    store,
    action: str,
    reason: str,
    fault_code: str,
    target: str,
    key: str | None = None,
    to_state: str | None = None,
) -> None:
    """A plan journaled as ``started`` 5 s ago by a run that died before it finished."""
    store.journal_plan(
        key=key or f"{NODE}|{action}|{fault_code}@{target}|0",
        node=NODE,
        action=action,
        reason=f"{REASON_PREFIX} {reason}",
        fault_code=fault_code,
        target=target,
        attempt=0,
        to_state=to_state,
        trigger="auto",
        adapter="fake",
        now=T0 - 5,
        state="started",
    )


def test_recovery_completes_a_started_drain_once(store):
    interrupted(store, "drain", "FAULT xid-79 gpu:5", "xid-79", "gpu:5", to_state="fault")
    adapter = FakeAdapter()
    out = make(store, adapter).recover()
    assert adapter.actions() == ["drain"] and out.records[0].outcome == "done"
    assert store.node_record(NODE).state == "fault"
    make(store, adapter).recover()
    assert adapter.actions() == ["drain"]


def test_recovery_does_not_repeat_a_drain_already_in_place(store):
    interrupted(store, "drain", "x", "xid-79", "gpu:5", key="k", to_state="fault")
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
    rem = Remediator(
        store,
        adapter,
        NODE,
        Safety(),
        state_dir=tmp_path,
        clock=Clock(),
        kernel_log=LinesKernelLog(["NVRM: Xid (PCI:0000:3b:00): 79, pid=1"]),
        warn=lambda _m: None,
    )
    out = rem.act("drain", "looks sick")
    (directory,) = (tmp_path / "evidence").iterdir()
    assert directory.name.endswith("-drain")
    assert "Xid" in (directory / "kernel-log.txt").read_text()
    assert (directory / "stacks.txt").read_text().startswith("skipped:")
    assert str(directory) in out.records[0].detail


def _sh_py_spy(tmp_path, slow_pid: int | None = None) -> str:
    """A py-spy stand-in (no GPU processes exist here to dump): prints a stack for any pid,
    logs its argv, and for ``slow_pid`` never answers, as py-spy does for a process it waits on."""
    path = tmp_path / "py-spy"
    path.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/argv.log\n'
        f'[ "$4" = "{slow_pid}" ] && exec sleep 60\n'
        'echo "Thread 1 (idle): MainThread"\necho "    wait (train.py:1)"\n'
    )
    path.chmod(0o755)
    return str(path)


def test_evidence_stacks_are_taken_at_once_without_stopping_anyone_and_by_one_deadline(tmp_path):
    """Issue 29, Low 13: one py-spy at a time, 10 s each, could pass the Slurm wrapper's 50 s
    before the drain. Now every stack is taken at once with --nonblocking, and one that is not
    back by the deadline is a note; the other stacks are kept."""
    from node_agent.remediation import evidence

    py_spy = _sh_py_spy(tmp_path, slow_pid=222)
    directory, notes = evidence.collect(
        tmp_path / "state",
        "drain",
        T0,
        None,
        None,
        [111, 222, 333],
        py_spy=py_spy,
        deadline=time.monotonic() + 1.5,
    )
    stacks = (directory / "stacks.txt").read_text()
    assert stacks.count("MainThread") == 2
    section = stacks.split("=== pid 222 ===")[1].split("===")[0]
    assert "did not finish" in section or "not collected" in section
    argvs = (tmp_path / "argv.log").read_text().splitlines()
    assert len(argvs) == 3 and all("--nonblocking" in a for a in argvs)
    (summary,) = [n for n in notes if n.startswith("stacks:")]
    assert summary.startswith("stacks: 2 of 3 GPU process(es)") and "222" in summary
    assert "222" in (directory / "notes.txt").read_text()


def test_evidence_takes_at_most_max_stacks_and_says_which_it_left(tmp_path):
    from node_agent.remediation import evidence

    pids = list(range(1000, 1000 + evidence.MAX_STACKS + 2))
    directory, notes = evidence.collect(
        tmp_path / "state", "drain", T0, None, None, pids, py_spy=_sh_py_spy(tmp_path)
    )
    stacks = (directory / "stacks.txt").read_text()
    assert stacks.count("MainThread") == evidence.MAX_STACKS
    assert f"=== pid {pids[-1]} ===\nnot collected: only the first" in stacks
    assert any("2 beyond the first" in n for n in notes)


# -- hung training jobs: restart the job through the scheduler, never the node ----------------
def hang(*targets: str, level: Level = Level.ERROR) -> Grade:
    """A grade with one training-hang reason per target (as graders/rules.yaml grades it)."""
    return Grade(
        level,
        Action.RESTART if level == Level.ERROR else Action.NONE,
        tuple(
            Reason(
                "training-hang",
                level,
                t,
                f"{t.rsplit('/', 1)[-1]} made no step for 412 s; stuck in all_reduce",
            )
            for t in targets
        ),
    )


def with_reasons(g: Grade, *more: Reason) -> Grade:
    reasons = (*g.reasons, *more)
    level = max(r.level for r in reasons)
    return Grade(level, {Level.ERROR: Action.RESTART, Level.FAULT: Action.REPLACE}[level], reasons)


XID48 = Reason(
    "xid",
    Level.ERROR,
    "gpu:1",
    "Xid 48 on gpu:1 [Xid 48: double bit ECC error]",
    catalog="xid",
    code=48,
)


@pytest.mark.parametrize(
    ("target", "job"),
    [
        ("job:slurm:1234/rank:3", "slurm:1234"),
        ("job:slurm:1234_7/pid:4242", "slurm:1234_7"),
        ("job:pod:ml/trainer-0/rank:0", "pod:ml/trainer-0"),
        ("job:torchelastic:run:a/b/rank:12", "torchelastic:run:a/b"),
        ("job:ppid:777/pid:778", "ppid:777"),
        ("rank:3", None),
        ("job:slurm:1/rank:x", None),
        ("job:slurm:1\n/rank:0", None),
    ],
)
def test_job_of_reads_the_job_anchored_at_the_end_of_the_target(target, job):
    assert job_of(target) == job


def test_training_hang_alone_restarts_the_job_and_never_drains_the_node(store):
    assert "training-hang" in JOB_RULES
    p = plan_for(hang("job:slurm:1234/rank:3"))
    (step,) = p.steps
    assert (step.action, step.to_state, step.job) == ("restart-job", None, "slurm:1234")
    assert step.reason.startswith("node-agent: ERROR training-hang job slurm:1234 rank:3")
    assert "not drained" in p.note
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(hang("job:slurm:1234/rank:3")))
    assert adapter.actions() == ["restart-job"] and adapter.jobs == ["slurm:1234"]
    assert [(r.action, r.outcome) for r in out.records] == [("restart-job", "done")]
    assert store.node_record(NODE).state == "in-service"
    (row,) = store.journal_tail(NODE)
    assert (row.action, row.state, row.target, row.to_state) == (
        "restart-job",
        "done",
        "job:slurm:1234",
        None,
    )


@pytest.mark.parametrize("state", ["fault", "awaiting-replacement"])
def test_hung_job_on_a_node_out_of_service_is_restarted_and_the_state_kept(store, state):
    store.set_node_record(NodeRecord(NODE, state, T0 - 100, "xid-79", "gpu:5", "auto"))
    adapter = FakeAdapter()
    make(store, adapter).remediate(FakeReport(hang("job:slurm:9/rank:0")))
    assert adapter.actions() == ["restart-job"]
    assert store.node_record(NODE).state == state


def test_an_operators_drain_is_kept_while_a_hung_job_is_restarted(store):
    store.set_node_record(NodeRecord(NODE, "drained", T0 - 100, "operator", "node", "operator"))
    adapter = FakeAdapter()
    make(store, adapter).remediate(FakeReport(hang("job:slurm:9/rank:0")))
    assert adapter.actions() == ["restart-job"]
    assert store.node_record(NODE).state == "drained"


@pytest.mark.parametrize("state", ["drained", "retest", "restarting"])
def test_a_hung_job_never_keeps_a_node_the_agent_drained_from_its_resume(store, state):
    # issue 29, Low 9: after a clean re-test, a hang on the node (a user's idle process with
    # a stale heartbeat, or a real job's) kept the node drained; the node's own findings are
    # clean, so it resumes, and then the job is restarted
    store.set_node_record(
        NodeRecord(NODE, state, T0 - 100, "xid-31", "gpu:0", "auto", restart_kind="gpu-reset")
    )
    adapter = FakeAdapter()
    adapter.state = NodeState(NODE, "DRAIN", True, "node-agent: ERROR xid-31 gpu:0")
    out = make(store, adapter).remediate(FakeReport(hang("job:slurm:9/rank:0")))
    assert [(r.action, r.outcome) for r in out.records] == [
        ("resume", "done"),
        ("restart-job", "done"),
    ]
    assert adapter.actions() == ["resume", "restart-job"]
    assert store.node_record(NODE).state == "in-service"


def test_hang_beside_a_hardware_error_takes_the_node_path(store):
    # the hang reason first, as the grader's sort order can put it
    g = with_reasons(hang("job:slurm:1234/rank:3"), XID48)
    g = Grade(g.level, g.action, g.reasons)
    p = plan_for(g)
    assert [(s.action, s.fault_code, s.target) for s in p.steps] == [
        ("drain", "xid-48", "gpu:1"),
        ("restart", "xid-48", "gpu:1"),
    ]
    adapter = FakeAdapter()
    make(store, adapter).remediate(FakeReport(g))
    assert adapter.actions() == ["drain", "restart"] and adapter.jobs == []


def test_hang_beside_a_fault_replaces_the_node():
    fault = Reason(
        "xid",
        Level.FAULT,
        "gpu:5",
        "Xid 79 on gpu:5 [Xid 79: fallen off the bus]",
        catalog="xid",
        code=79,
    )
    p = plan_for(with_reasons(hang("job:slurm:1/rank:0"), fault))
    assert [s.action for s in p.steps] == ["drain", "replace"]
    assert "xid-79" in p.steps[0].reason


def test_straggler_warn_never_acts(store):
    g = Grade(
        Level.WARN,
        Action.NONE,
        (Reason("training-straggler", Level.WARN, "job:slurm:1/rank:2", "2.4x slower"),),
    )
    assert plan_for(g).steps == ()
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(g))
    assert adapter.calls == [] and out.records == []


def test_two_hung_jobs_get_one_restart_each_and_ranks_of_one_job_one(store):
    g = hang("job:slurm:11/rank:0", "job:slurm:11/rank:5", "job:pod:ml/trainer-0/pid:77")
    p = plan_for(g)
    assert [s.job for s in p.steps] == ["slurm:11", "pod:ml/trainer-0"]
    assert len({s.key(NODE) for s in p.steps}) == 2 and "slurm:11" in p.steps[0].key(NODE)
    adapter = FakeAdapter()
    out = make(store, adapter).remediate(FakeReport(g))
    assert adapter.jobs == ["slurm:11", "pod:ml/trainer-0"]
    assert [r.outcome for r in out.records] == ["done", "done"]


def test_same_hung_job_is_restarted_once_and_a_different_one_gets_its_own(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock)
    rem.remediate(FakeReport(hang("job:slurm:11/rank:0")))
    clock.t += 30  # Slurm is still killing it; the check reports it again, another rank first
    out = rem.remediate(FakeReport(hang("job:slurm:11/rank:3")))
    assert adapter.jobs == ["slurm:11"]
    assert out.records == []  # quietly deduplicated, not a refusal
    assert any("dedup" in n and "restart-job" in n for n in out.notes)
    clock.t += 90
    rem.remediate(FakeReport(hang("job:slurm:12/rank:0")))
    assert adapter.jobs == ["slurm:11", "slurm:12"]


@pytest.mark.parametrize(
    "target",
    [
        "job:slurm:1;rm -rf /",  # not .../rank:N: names no job
        "job:slurm:1;rm -rf //rank:0",  # a job id with shell metacharacters
        "job:slurm:$(reboot)/rank:1",
        "job:../../etc/passwd/rank:1",  # not a known job kind
        "job:slurm:1 State=RESUME/pid:9",  # an argument of its own for scontrol
        "job:pod:ml/x\x1b[2J/rank:0",  # terminal escapes
        "rank:3",
    ],
)
def test_malformed_or_hostile_job_target_is_refused_without_an_adapter_call(store, target):
    adapter, warnings = FakeAdapter(), []
    out = make(store, adapter, warnings=warnings).remediate(FakeReport(hang(target)))
    assert adapter.calls == []
    (rec,) = out.records
    assert (rec.action, rec.outcome) == ("restart-job", "refused")
    assert "refusing job id" in rec.detail or "names no job" in rec.detail, rec.detail
    assert "the node is not drained" in rec.detail
    assert all(32 <= ord(c) < 127 for c in rec.detail), rec.detail  # escaped, not echoed raw
    assert any("restart-job REFUSED" in w for w in warnings)
    assert store.node_record(NODE).state == "in-service"
    assert store.journal_tail(NODE)[-1].state == "refused"


def test_job_restarts_do_not_count_towards_the_nodes_restarts(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock, safety=Safety(max_restarts=1))
    for job in range(3):
        rem.remediate(FakeReport(hang(f"job:slurm:{job}/rank:0")))
        clock.t += 120
    out = rem.remediate(FakeReport(ERR_HANG))  # driver-hang on gpu:3: a node ERROR
    assert adapter.actions() == ["restart-job"] * 3 + ["drain", "restart"]
    assert not any("escalated" in n for n in out.notes)


def test_rate_limit_between_job_restarts_of_different_runs(store):
    adapter, clock, warnings = FakeAdapter(), Clock(), []
    rem = make(store, adapter, clock, warnings=warnings)
    rem.remediate(FakeReport(hang("job:slurm:1/rank:0")))
    clock.t += 10
    out = rem.remediate(FakeReport(hang("job:slurm:2/rank:0")))
    assert out.records[0].outcome == "refused" and "rate limit" in out.records[0].detail
    assert "safety.min_action_interval_s=60" in out.records[0].detail
    clock.t += 60
    rem.remediate(FakeReport(hang("job:slurm:2/rank:0")))
    assert adapter.jobs == ["slurm:1", "slurm:2"]


def test_a_hung_job_does_not_rate_limit_a_drain_after_it(store):
    adapter, clock = FakeAdapter(), Clock()
    rem = make(store, adapter, clock)
    rem.remediate(FakeReport(hang("job:slurm:1/rank:0")))
    clock.t += 5
    rem.remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["restart-job", "drain", "replace"]


def test_open_breaker_does_not_stop_a_job_restart_but_opt_out_does(store):
    store.open_breaker(T0, "test")
    adapter = FakeAdapter()
    make(store, adapter).remediate(FakeReport(hang("job:slurm:1/rank:0")))
    assert adapter.jobs == ["slurm:1"]
    store.set_opt_out(NODE, True, T0, "burn-in by vendor")
    out = make(store, adapter, Clock(T0 + 3600)).remediate(FakeReport(hang("job:slurm:2/rank:0")))
    assert adapter.jobs == ["slurm:1"] and "opted out" in out.records[0].detail


def test_dry_run_job_restart_records_and_calls_nothing(store):
    adapter = FakeAdapter()
    out = make(store, adapter, dry_run=True).remediate(FakeReport(hang("job:slurm:1/rank:0")))
    assert adapter.calls == []
    (rec,) = out.records
    assert rec.outcome == "dry-run" and "slurm:1" in rec.detail


def test_failed_job_restart_is_kept_and_retried(store):
    adapter = FakeAdapter(
        fail=AdapterError(
            "the Slurm adapter restarts only Slurm jobs "
            "running on gpu-01; job slurm:1 runs on gpu-02"
        )
    )
    clock = Clock()
    out = make(store, adapter, clock).remediate(FakeReport(hang("job:slurm:1/rank:0")))
    assert out.records[0].outcome == "failed" and "runs on gpu-02" in out.records[0].detail
    adapter.fail = None
    clock.t += 120
    make(store, adapter, clock).remediate(FakeReport(hang("job:slurm:1/rank:0")))
    rows = store.journal_tail(NODE)
    assert adapter.jobs == ["slurm:1"]
    assert [(r.state, r.tries) for r in rows] == [("failed", 1), ("done", 2)]


def test_recovery_sends_an_interrupted_job_restart_again(store):
    interrupted(
        store, "restart-job", "ERROR training-hang job slurm:42", "training-hang", "job:slurm:42"
    )
    adapter = FakeAdapter()
    out = make(store, adapter).recover()
    assert adapter.jobs == ["slurm:42"] and out.records[0].outcome == "done"
    assert store.open_journal(NODE) == [] and store.node_record(NODE).state == "in-service"


def test_evidence_is_collected_before_a_job_restart(store, tmp_path):
    adapter = FakeAdapter()
    rem = Remediator(
        store, adapter, NODE, Safety(), state_dir=tmp_path, clock=Clock(), warn=lambda _m: None
    )
    out = rem.remediate(FakeReport(hang("job:slurm:1/rank:0")))
    (directory,) = (tmp_path / "evidence").iterdir()
    assert directory.name.endswith("-restart-job")
    assert "training-hang" in (directory / "report.json").read_text()
    assert str(directory) in out.records[0].detail


@pytest.mark.parametrize(
    "job", ["slurm:1234", "torchelastic:2f9c-11", "pod:ml/trainer-0", "ppid:4242"]
)
def test_check_job_id_accepts_the_kinds_the_heartbeat_writes(job):
    assert check_job_id(job) == tuple(job.split(":", 1))


@pytest.mark.parametrize(
    "job",
    [
        "slurm:1;rm -rf /",
        "slurm:",
        "cron:1",
        "slurm:1 x=y",
        "pod:$(id)",
        "slurm:-h",
        "x" * 300,
        "",
        None,
    ],
)
def test_check_job_id_refuses_with_what_a_job_id_must_be(job):
    with pytest.raises(AdapterError, match="a job id must be <kind>:<id>"):
        check_job_id(job)


def test_a_job_the_agent_could_not_verify_is_never_restarted():
    with pytest.raises(AdapterError, match="could not verify which job"):
        check_job_id("unverified:slurm:4242")


def test_log_adapter_records_a_job_restart_and_refuses_a_hostile_job(tmp_path):
    from node_agent.schedulers.log import LogAdapter

    adapter = LogAdapter(tmp_path / "actions.log", clock=lambda: "T")
    outcome = adapter.restart_job(NODE, "slurm:7", "ERROR training-hang job slurm:7")
    assert outcome.status is AdapterStatus.DONE
    assert "would restart-job slurm:7 on gpu-01" in outcome.detail
    with pytest.raises(AdapterError, match="refusing job id"):
        adapter.restart_job(NODE, "slurm:7;reboot", "x")
    assert adapter.records() == [
        {
            "action": "restart-job",
            "adapter": "log",
            "at": "T",
            "job": "slurm:7",
            "node": NODE,
            "reason": "node-agent: ERROR training-hang job slurm:7",
        }
    ]


def test_every_adapter_and_the_fake_implement_restart_job_of_the_protocol(tmp_path):
    from node_agent.config import WebhookConfig
    from node_agent.schedulers import SchedulerAdapter
    from node_agent.schedulers.log import LogAdapter
    from node_agent.schedulers.slurm import SlurmAdapter
    from node_agent.schedulers.webhook import WebhookAdapter

    adapters = [
        FakeAdapter(),
        LogAdapter(tmp_path / "a.log"),
        SlurmAdapter(),
        WebhookAdapter(WebhookConfig(url="http://127.0.0.1:9/x"), b"s"),
    ]
    for adapter in adapters:
        assert isinstance(adapter, SchedulerAdapter), type(adapter).__name__
        assert callable(adapter.restart_job)


# -- without its own state, the remediator does nothing -----------------------------------------
def test_an_unavailable_store_refuses_every_step_and_calls_no_adapter(tmp_path):
    import sqlite3

    from node_agent.remediation.store import DB_NAME

    first = open_store(tmp_path)
    first.close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("UPDATE schema_version SET version = 99")  # a newer agent's database
    conn.commit()
    conn.close()
    store = open_store(tmp_path)
    adapter, warnings = FakeAdapter(), []
    try:
        assert store.unavailable is not None
        out = make(store, adapter, warnings=warnings).remediate(FakeReport(FAULT79))
        assert [(r.action, r.outcome) for r in out.records] == [
            ("drain", "refused"),
            ("replace", "refused"),
        ]
        assert all("state unavailable" in r.detail for r in out.records)
        # the daemon retries these (the disk may be freed): decided on the typed refusal
        assert {r.refusal for r in out.records} == {Refusal.STATE_UNAVAILABLE}
        assert out.wants_retry
        assert adapter.calls == [] and len(warnings) == 2
        op = make(store, adapter).act("drain", "by hand")
        assert [(r.action, r.outcome) for r in op.records] == [("drain", "refused")]
        assert adapter.calls == []
    finally:
        store.close()


def test_a_write_that_fails_mid_run_refuses_the_step_before_the_adapter(store, monkeypatch):
    import sqlite3

    adapter = FakeAdapter()
    real = store.journal_plan

    def full_disk(**kw):
        if kw.get("state", "planned") == "planned":
            raise store._fail("writing", sqlite3.OperationalError("database or disk is full"))
        return real(**kw)

    monkeypatch.setattr(store, "journal_plan", full_disk)
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert [(r.action, r.outcome) for r in out.records] == [("drain", "refused")]
    assert "disk is full" in out.records[0].detail and adapter.calls == []
    assert "disk is full" in store.unavailable


def test_opt_out_that_cannot_be_read_is_never_taken_for_no_opt_out(store, monkeypatch):
    import sqlite3

    adapter = FakeAdapter()

    def unreadable(node):
        raise store._fail("reading", sqlite3.OperationalError("disk I/O error"))

    monkeypatch.setattr(store, "opted_out", unreadable)
    out = make(store, adapter).remediate(FakeReport(FAULT79))
    assert {r.outcome for r in out.records} == {"refused"} and adapter.calls == []
    assert "disk I/O error" in out.records[0].detail


def test_the_same_fault_after_a_repair_gets_a_new_idempotency_key(store):
    adapter, clock = FakeAdapter(), Clock()
    make(store, adapter, clock).remediate(FakeReport(FAULT79))
    first = adapter.keys[0]
    clock.t += 7 * 86400  # a week later, after the repair
    store.clear_node(NODE, clock.t, "GPU replaced")
    adapter.state = NodeState(NODE, "IDLE", False, None)
    clock.t += 60
    make(store, adapter, clock).remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "replace", "drain", "replace"]
    assert adapter.keys[2] != first and adapter.keys[0] != adapter.keys[1]


# -- an announced maintenance: drain, no restart, resume after ------------------------------------
MAINTENANCE = PlannedEvent(
    "azure", "Redeploy", "602d9444", "2023-11-14T22:43:20Z", None, acknowledge=True
)
PLANNED = Grade(
    Level.ERROR,
    Action.DRAIN,
    (
        Reason(
            "cloud-maintenance",
            Level.ERROR,
            "node",
            "azure maintenance Redeploy inside the lead time",
            remedy="planned",
            planned=MAINTENANCE,
        ),
    ),
)


def test_a_planned_maintenance_drains_acknowledges_waits_and_resumes_after(store):
    """The Azure acknowledgement goes to the Scheduled Events stand-in on loopback (no cloud
    here: tests/cloud_metadata_standin.py serves the documented API)."""
    adapter = FakeAdapter()
    with MetadataStandIn() as cloud:
        rem = make(
            store,
            adapter,
            acknowledge_event=lambda e: cloud_metadata.acknowledge(e.event_id, base_url=cloud.url),
        )
        out = rem.remediate(FakeReport(PLANNED))
        assert cloud.acks == [{"StartRequests": [{"EventId": "602d9444"}]}]
    assert adapter.actions() == ["drain"]
    assert adapter.calls[0][2] == (
        "node-agent: ERROR cloud-maintenance node planned azure Redeploy from 2023-11-14T22:43:20Z"
    )
    assert store.node_record(NODE).state == "planned"
    assert "acknowledged Azure scheduled event 602d9444" in out.records[0].detail
    # the event stands: the node waits, drained, with no restart and no replacement
    waiting = rem.remediate(FakeReport(PLANNED))
    assert adapter.actions() == ["drain"] and waiting.records == []
    assert any("resumes when a re-test after the event passes" in n for n in waiting.notes)
    rem.remediate(FakeReport(HEALTHY))
    assert adapter.actions() == ["drain", "resume"]
    assert store.node_record(NODE).state == "in-service"


def test_an_event_is_acknowledged_only_once_the_scheduler_says_the_node_is_drained(store):
    """The acknowledgement may start the maintenance at once: a drain the adapter cannot
    confirm (log, webhook) acknowledges nothing; the event starts at its own time."""
    acked: list[str] = []
    out = make(store, Unseeing(), acknowledge_event=lambda e: acked.append(e.event_id) or "ok")
    record = out.remediate(FakeReport(PLANNED)).records[0]
    assert record.outcome == "done" and acked == []
    assert "not acknowledged: the fake adapter cannot tell that" in record.detail


def test_a_failed_acknowledgement_leaves_the_drain_done(store):
    warnings: list[str] = []

    def refuse(event):
        raise cloud_metadata.MetadataUnreachable("no metadata service answered")

    out = make(store, warnings=warnings, acknowledge_event=refuse).remediate(FakeReport(PLANNED))
    (record,) = out.records
    assert record.outcome == "done" and "not acknowledged" in record.detail
    assert any("not acknowledged" in w for w in warnings)


# -- the driver's bug report before a replacement -------------------------------------------------
# Stand-ins for nvidia-bug-report.sh: no NVIDIA driver (and so no script) on this machine. Each
# takes the real script's arguments; the real one writes <output-file>.gz when gzip is there.
WRITES = """
import gzip, sys
assert "--safe-mode" in sys.argv
out = sys.argv[sys.argv.index("--output-file") + 1]
with gzip.open(out + ".gz", "wt") as f:
    f.write("nvidia-bug-report.sh stand-in: the fault is present\\n" * 200)
print("Complete.")
"""
HANGS = "import time; time.sleep(120)"


def bug_script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-bug-report.sh"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(0o755)
    return str(path)


def with_bug_report(store, tmp_path, collector, adapter=None, warnings=None, **kw):
    return Remediator(
        store,
        adapter or FakeAdapter(),
        NODE,
        Safety(),
        state_dir=tmp_path / "state",
        clock=Clock(),
        warn=(warnings if warnings is not None else []).append,
        bug_report=collector,
        **kw,
    )


REPLACE_KEY = f"{NODE}|replace|xid-79@gpu:5|0"


def test_a_replace_request_names_the_bug_report_taken_before_it(store, tmp_path):
    adapter = FakeAdapter()
    collector = BugReportCollector(bug_script(tmp_path, WRITES))
    out = with_bug_report(store, tmp_path, collector, adapter).remediate(FakeReport(FAULT79))
    assert adapter.actions() == ["drain", "replace"]
    row = store.journal_by_key(REPLACE_KEY)
    expected = tmp_path / "state" / "bug-reports" / f"nvidia-bug-report-{row.id}.log.gz"
    assert adapter.evidence == [str(expected)]
    with gzip.open(expected, "rt") as f:
        assert "the fault is present" in f.read()
    assert stat.S_IMODE(expected.stat().st_mode) == 0o600
    assert f"driver bug report in {expected}" in out.records[-1].detail
    assert str(expected) in row.detail


def test_a_bug_report_that_hangs_is_cut_off_and_the_replace_goes_on(store, tmp_path):
    adapter = FakeAdapter()
    collector = BugReportCollector(bug_script(tmp_path, HANGS), timeout_s=1)
    start = time.monotonic()
    out = with_bug_report(store, tmp_path, collector, adapter).remediate(FakeReport(FAULT79))
    assert time.monotonic() - start < 15
    assert adapter.actions() == ["drain", "replace"] and adapter.evidence == [None]
    assert "did not finish within 1 s and was killed" in out.records[-1].detail


def test_a_missing_bug_report_script_is_said_and_the_replace_goes_on(store, tmp_path):
    adapter, warnings = FakeAdapter(), []
    collector = BugReportCollector(str(tmp_path / "absent" / "nvidia-bug-report.sh"))
    out = with_bug_report(store, tmp_path, collector, adapter, warnings).remediate(
        FakeReport(FAULT79)
    )
    assert adapter.actions() == ["drain", "replace"] and adapter.evidence == [None]
    assert "is not installed" in out.records[-1].detail
    assert any("ships with the NVIDIA driver" in w for w in warnings)


def test_a_dry_run_says_which_bug_report_it_would_collect(store, tmp_path):
    script = bug_script(tmp_path, WRITES)
    out = with_bug_report(store, tmp_path, BugReportCollector(script), dry_run=True).remediate(
        FakeReport(FAULT79)
    )
    replace = [r for r in out.records if r.action == "replace"][0]
    assert replace.outcome == "dry-run"
    assert f"would first collect {script} --safe-mode into" in replace.detail
    assert not (tmp_path / "state" / "bug-reports").exists()


def test_only_the_newest_bug_reports_are_kept_and_each_is_capped(tmp_path):
    state = tmp_path / "state"
    collector = BugReportCollector(bug_script(tmp_path, WRITES), keep=2)
    for row_id in (1, 2, 3, 4):
        report = collector.collect(state, row_id)
        assert report.path is not None
        os.utime(report.path, (T0 + row_id, T0 + row_id))
    kept = sorted(p.name for p in (state / "bug-reports").iterdir())
    assert kept == ["nvidia-bug-report-3.log.gz", "nvidia-bug-report-4.log.gz"]
    capped = BugReportCollector(bug_script(tmp_path, WRITES), max_bytes=64).collect(state, 5)
    assert capped.path is not None and capped.path.stat().st_size <= 64


def test_an_adapter_that_answers_a_bare_string_is_a_failed_action_not_assumed_done(store):
    """An adapter written for an older agent returned a detail line; the executor decides on
    the typed AdapterOutcome only, so a bare string is a failure kept for retry."""

    class OldAdapter(FakeAdapter):
        def drain(self, node, reason, *, key=None):
            super().drain(node, reason, key=key)
            return "old-style: drained"

    out = make(store, OldAdapter()).act("drain", "by hand")
    (rec,) = out.records
    assert rec.outcome is ActionOutcome.FAILED and rec.retryable
    assert "not an AdapterOutcome" in rec.detail
    assert store.journal_tail(NODE)[-1].state == "failed"


def test_an_action_record_round_trips_through_a_saved_report_with_its_enums():
    record = ActionRecord("drain", "slurm", "refused", "left as is", "T", "foreign-drain")
    again = ActionRecord(**record.to_dict())
    assert again == record and again.refusal is Refusal.FOREIGN_DRAIN
    assert again.outcome is ActionOutcome.REFUSED and not again.retryable
    assert "refusal" not in ActionRecord("drain", "log", "done", "ok", "T").to_dict()
    with pytest.raises(ValueError):
        ActionRecord("drain", "log", "maybe", "?", "T")
