"""The remediation plan decides from typed facts only: a finding's messages are for people.

The proof: grade a set of findings with the shipped grader, plan each one in several node
states, then rename every detail and message (reversed, with a misleading "reboot" and a wrong
"[Xid 13: ...]" bracket put in) and plan again: every step, fault code, restart kind, GPU index
and job is the same. Also: the transition table is total, the node grade's ``model.Action``
expands to the documented steps, typed fields survive JSON, and ``open_remediator`` chooses the
simulator's or the host's ports from the environment once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from node_agent import resources
from node_agent.checking.xid_fold import Folder
from node_agent.config import config_from_dict
from node_agent.environment import load_data, open_node
from node_agent.grading.rules import Grader, load_grader
from node_agent.kernel_log import SxidLine, scan_lines
from node_agent.model import (
    ACTION_FOR_LEVEL,
    Action,
    Grade,
    Level,
    PlannedEvent,
    Reason,
    Recovery,
    Remedy,
    Result,
    Status,
    Target,
)
from node_agent.remediation.host import open_remediator
from node_agent.remediation.plan import (
    STEPS_FOR_ACTION,
    TRANSITIONS,
    NodeState,
    Phase,
    Plan,
    RestartKind,
    Safety,
    Step,
    StepAction,
    Verdict,
    fault_code,
    plan,
)
from node_agent.remediation.store import NodeRecord, open_store
from node_agent.schedulers.log import LogAdapter

T0 = 1_700_000_000.0
NODE = "gpu-01"

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


@pytest.fixture(scope="module")
def grader() -> Grader:
    return load_grader(resources.graders_dir(config_from_dict({})))


def kernel_findings(lines: list[str]) -> list[Result]:
    """What the ``xid`` check makes of kernel-log lines (an Xid's bus stands for gpu:5)."""
    folder = Folder()
    for event in scan_lines(lines):
        folder.add(event, event.target if isinstance(event, SxidLine) else "gpu:5", "test")
    return [fold.result() for fold in folder.sorted()]


XID64 = "NVRM: Xid (PCI:0000:3b:00): 64, pid='<unknown>', name=<unknown>, Row remapper failure"
XID94 = "NVRM: Xid (PCI:0000:3b:00): 94, pid=1, Contained ECC error."
SXID_20034 = "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 28 LTSSM Fault Up"
NO_DRIVER = Result(
    "nvml_health",
    "node",
    "driver_not_loaded",
    Status.ERROR,
    "8 NVIDIA GPU(s) on the PCI bus but the NVIDIA kernel driver is not loaded",
)


def recovery(action: str) -> Result:
    return Result(
        "nvml_health",
        "gpu:1",
        "recovery_action",
        Status.FAIL,
        f"the driver asks for recovery action {action}",
        value=action,
    )


#: what the cloud_maintenance check reports inside its lead time (docs/cloud.md)
MAINTENANCE = PlannedEvent(
    "gcp", "TERMINATE_ON_HOST_MAINTENANCE", None, "2026-11-21T12:00:00Z", "2026-11-21T13:00:00Z"
)


def maintenance(event: PlannedEvent = MAINTENANCE) -> Result:
    return Result(
        "cloud_maintenance",
        "node",
        "maintenance_event",
        Status.FAIL,
        f"gcp maintenance {event.kind} inside the lead time",
        planned=event,
    )


def hung(target: str) -> Result:
    return Result("training_progress", target, "training_hang", Status.FAIL, "no step for 412 s")


#: one set of findings per case the plan must decide from typed facts
FINDINGS: dict[str, list[Result]] = {
    "xid-fault": kernel_findings([XID64]),
    "xid-error": kernel_findings([XID94]),
    "sxid-error": kernel_findings([SXID_20034]),
    "recovery-reset": [recovery("gpu_reset")],
    "recovery-drain-and-reset": [recovery("drain_and_reset")],
    "recovery-reboot": [recovery("node_reboot")],
    "recovery-system-reboot": [recovery("system_reboot")],
    "hung-jobs": [hung("job:slurm:77/rank:3"), hung("job:pod:ml/trainer-0/pid:42")],
    "software": [NO_DRIVER],
    "software-beside-hardware": [NO_DRIVER, recovery("gpu_reset")],
    "hang-beside-fault": [hung("job:slurm:77/rank:3"), *kernel_findings([XID64])],
    "cloud-maintenance": [maintenance()],
    "maintenance-beside-error": [maintenance(), recovery("node_reboot")],
}

#: node states and histories each set of findings is planned in
CONTEXTS: dict[str, dict] = {
    "in-service": {},
    "in-service, no GPU reset": {"gpu_reset_available": False},
    "after a GPU reset this run": {
        "record": NodeRecord(NODE, "retest", T0, trigger="auto"),
        "gpu_reset_tried": True,
    },
    "restarts spent": {
        "record": NodeRecord(NODE, "restarting", T0, "x", "node", "auto", "reboot", T0 - 10),
        "spent": True,
    },
    "remediations-7d reached": {"remediations_7d": 5},
    "needs an operator": {"record": NodeRecord(NODE, "needs-operator", T0, "driver-not-loaded")},
    "drained for a fault": {"record": NodeRecord(NODE, "fault", T0, "xid-64", "gpu:5", "auto")},
    "drained for maintenance": {
        "record": NodeRecord(NODE, "planned", T0, "cloud-maintenance", "node", "auto")
    },
}


def plan_in(grade: Grade, context: dict) -> Plan:
    spent = context.get("spent", False)
    counts = {fault_code(r): 9 for r in grade.reasons} if spent else {}
    return plan(
        grade,
        context.get("record", NodeRecord(NODE)),
        Safety(),
        now=T0,
        boot_time=T0,
        restart_counts=counts,
        gpu_reset_available=context.get("gpu_reset_available", True),
        gpu_reset_tried=context.get("gpu_reset_tried", False),
        remediations_7d=context.get("remediations_7d", 0),
    )


def decisions(p: Plan) -> tuple:
    """Everything a plan decides; its reason texts and note are for people."""
    steps = tuple(
        (
            s.action,
            s.to_state,
            s.fault_code,
            s.target,
            s.attempt,
            s.restart_kind,
            s.gpu_index,
            s.job,
        )
        for s in p.steps
    )
    return steps, p.escalated, p.fault_code, p.target


def misleading(text: str) -> str:
    """A renamed text that would fool a plan reading prose: it asks for a reboot and names
    another Xid, and the original words are reversed out of recognition."""
    return f"reboot [Xid 13: Graphics Engine Exception] {text[::-1]}"


def renamed_results(results: list[Result]) -> list[Result]:
    return [dataclasses.replace(r, detail=misleading(r.detail)) for r in results]


def renamed_grade(grade: Grade) -> Grade:
    reasons = tuple(dataclasses.replace(r, message=misleading(r.message)) for r in grade.reasons)
    return dataclasses.replace(grade, reasons=reasons)


@pytest.mark.parametrize("context", CONTEXTS, ids=list(CONTEXTS))
@pytest.mark.parametrize("case", FINDINGS, ids=list(FINDINGS))
def test_renaming_every_message_and_detail_changes_no_plan(grader, case, context):
    graded = grader.grade(FINDINGS[case], "service")
    regraded = grader.grade(renamed_results(FINDINGS[case]), "service")
    assert all(
        r.message != o.message for r, o in zip(regraded.reasons, graded.reasons, strict=True)
    )
    before = decisions(plan_in(graded, CONTEXTS[context]))
    assert decisions(plan_in(regraded, CONTEXTS[context])) == before
    assert decisions(plan_in(renamed_grade(graded), CONTEXTS[context])) == before
    assert decisions(plan_in(renamed_grade(regraded), CONTEXTS[context])) == before


def steps_of(grader, case: str, **context) -> list[tuple]:
    p = plan_in(renamed_grade(grader.grade(renamed_results(FINDINGS[case]), "service")), context)
    return [(s.action, s.restart_kind, s.gpu_index, s.job, s.fault_code) for s in p.steps]


def test_what_the_renamed_findings_still_decide(grader):
    """The identity above is about the right plans: each case, renamed, does what it should."""
    reset = [
        ("drain", None, None, None, "recovery-action"),
        ("gpu-reset", "gpu-reset", 1, None, "recovery-action"),
        ("retest", "gpu-reset", None, None, "recovery-action"),
    ]
    reboot = [
        ("drain", None, None, None, "recovery-action"),
        ("restart", "reboot", None, None, "recovery-action"),
    ]
    assert steps_of(grader, "recovery-reset") == reset
    assert steps_of(grader, "recovery-drain-and-reset") == reset
    assert steps_of(grader, "recovery-reboot") == reboot
    assert steps_of(grader, "recovery-system-reboot") == reboot
    assert steps_of(grader, "xid-fault") == [
        ("drain", None, None, None, "xid-64"),
        ("replace", None, None, None, "xid-64"),
    ]
    assert [s[0] for s in steps_of(grader, "xid-error")] == ["drain", "restart"]
    assert steps_of(grader, "sxid-error")[0][4] == "sxid-20034"
    assert steps_of(grader, "hung-jobs") == [
        ("restart-job", None, None, "pod:ml/trainer-0", "training-hang"),
        ("restart-job", None, None, "slurm:77", "training-hang"),
    ]
    assert [s[0] for s in steps_of(grader, "hang-beside-fault")] == ["drain", "replace"]
    spent = {"record": CONTEXTS["restarts spent"]["record"], "spent": True}
    assert [s[0] for s in steps_of(grader, "software", **spent)] == ["hold"]
    assert [(s[0], s[4]) for s in steps_of(grader, "software-beside-hardware", **spent)] == [
        ("replace", "recovery-action")
    ]


def test_the_grader_fills_the_typed_fields_the_plan_reads(grader):
    (xid,) = grader.grade(FINDINGS["xid-fault"], "service").reasons
    assert (xid.catalog, xid.code, xid.name) == ("xid", 64, "GPU memory remapping failure")
    assert (xid.entity.kind, xid.gpu_index, xid.job) == ("gpu", 5, None)
    (sxid,) = grader.grade(FINDINGS["sxid-error"], "service").reasons
    assert (sxid.catalog, sxid.code, sxid.entity) == ("sxid", 20034, Target("nvswitch", "0"))
    (reboot,) = grader.grade(FINDINGS["recovery-reboot"], "service").reasons
    assert reboot.recovery is Recovery.NODE_REBOOT
    (software,) = grader.grade(FINDINGS["software"], "service").reasons
    assert software.remedy is Remedy.SOFTWARE and software.to_dict()["remedy"] == "software"
    # a check that sets Result.recovery itself is read as it is (piece of nvml_health)
    typed = dataclasses.replace(recovery("gpu_reset"), value=None, recovery=Recovery.SYSTEM_REBOOT)
    assert grader.grade([typed], "service").reasons[0].recovery is Recovery.SYSTEM_REBOOT


def test_typed_fields_survive_json_and_an_older_report_still_reads():
    full = Reason(
        "xid",
        Level.ERROR,
        "gpu:2",
        "m",
        remedy=Remedy.HARDWARE,
        catalog="xid",
        code=94,
        restarts_before_fault=1000,
        name="Contained memory error",
        recovery=Recovery.DRAIN_AND_RESET,
    )
    data = full.to_dict()
    assert data["remedy"] == "hardware" and data["recovery"] == "drain_and_reset"
    assert Reason.from_dict(data) == full
    older = {"rule": "xid", "level": "ERROR", "target": "gpu:2", "message": "m"}
    assert Reason.from_dict(older) == Reason("xid", Level.ERROR, "gpu:2", "m")
    assert Reason.from_dict({**older, "recovery": "unknown_42"}).recovery is Recovery.UNKNOWN


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("node", Target("node", "")),
        ("gpu:3", Target("gpu", "3", gpu_index=3)),
        ("hca:mlx5_0", Target("hca", "mlx5_0")),
        ("disk:/scratch/a:b", Target("disk", "/scratch/a:b")),
        ("nvswitch:0", Target("nvswitch", "0")),
        (
            "job:torchelastic:run:a/b/rank:12",
            Target("job", "torchelastic:run:a/b", job="torchelastic:run:a/b", rank=12),
        ),
        ("job:slurm:1234_7/pid:4242", Target("job", "slurm:1234_7", job="slurm:1234_7", pid=4242)),
        ("job:slurm:1/rank:x", Target("job", "slurm:1/rank:x")),
        ("job:slurm:1\n/rank:0", Target("job", "slurm:1\n/rank:0")),
        ("gpu:3\n", Target("gpu", "3\n")),
    ],
)
def test_a_target_is_parsed_in_one_place(text, target):
    assert Target.parse(text) == target


def test_the_transition_table_is_total_and_the_store_keeps_its_strings():
    assert set(TRANSITIONS) == {(p, v) for p in Phase for v in Verdict}
    assert [s.value for s in NodeState] == [
        "in-service",
        "drained",
        "restarting",
        "retest",
        "fault",
        "awaiting-replacement",
        "needs-operator",
        "planned",
    ]
    assert NodeRecord(NODE, "drained").state is NodeState.DRAINED
    assert (
        NodeRecord(NODE, "restarting", restart_kind="reboot").to_dict()["restart_kind"] == "reboot"
    )


@pytest.mark.parametrize("level", list(Level))
def test_a_node_grades_action_expands_to_its_documented_steps(level):
    reason = Reason("row-remap-pending", level, "gpu:2", "m")
    grade = Grade(level, ACTION_FOR_LEVEL[level], (reason,) if level > Level.HEALTHY else ())
    for reset in (True, False):
        p = plan_in(grade, {"gpu_reset_available": reset})
        assert tuple(s.action for s in p.steps) in STEPS_FOR_ACTION[ACTION_FOR_LEVEL[level]]
    assert STEPS_FOR_ACTION[Action.DRAIN] == ((StepAction.DRAIN,),)


def test_open_remediator_chooses_the_simulators_ports_from_the_environment(tmp_path):
    config = config_from_dict({"state_dir": str(tmp_path / "state")})
    store = open_store(config.state_dir)
    try:
        config0 = config_from_dict({})
        stand_in = open_node(config0, load_data(config0)[1], str(SCENARIOS / "healthy-h100.yaml"))
        env = SimpleNamespace(simulated=True, kernel_log=None, inventory=None, node=stand_in)
        remediator = open_remediator(env, config, store, LogAdapter(tmp_path / "a.log"), NODE)
        assert remediator.gpu_resetter is stand_in.gpu_reset is not None
        assert remediator.gpu_pids is None and remediator.boot_time > T0
        assert remediator.safety == config.safety and not remediator.dry_run
        operator = open_remediator(
            None, config, store, LogAdapter(tmp_path / "a.log"), NODE, simulated=True, dry_run=True
        )
        assert operator.gpu_resetter is None and operator.kernel_log is None and operator.dry_run
    finally:
        store.close()


def test_a_plan_step_prints_as_its_stored_word():
    step = Step("restart", "r", "restarting", restart_kind="reboot")
    assert (step.action, step.to_state, step.restart_kind) == (
        StepAction.RESTART,
        NodeState.RESTARTING,
        RestartKind.REBOOT,
    )
    assert step.key("n") == "n|restart|-@-|0"
    assert f"{StepAction.GPU_RESET} {RestartKind.REBOOT} {NodeState.NEEDS_OPERATOR}" == (
        "gpu-reset reboot needs-operator"
    )


def test_a_planned_maintenance_drains_naming_the_event_and_never_restarts(grader):
    grade = grader.grade([maintenance()], "service")
    assert (grade.level, grade.action) == (Level.ERROR, Action.DRAIN)
    assert grade.reasons[0].remedy is Remedy.PLANNED and grade.reasons[0].planned == MAINTENANCE
    # nothing about restarts counts: a maintenance is not the node's fault
    for context in ("in-service", "remediations-7d reached"):
        p = plan_in(renamed_grade(grade), CONTEXTS[context])
        (step,) = p.steps
        assert (step.action, step.to_state, step.fault_code) == (
            StepAction.DRAIN,
            NodeState.PLANNED,
            "cloud-maintenance",
        )
        assert step.planned == MAINTENANCE
        assert step.reason.startswith("node-agent: ERROR cloud-maintenance node planned gcp")
        assert "TERMINATE_ON_HOST_MAINTENANCE from 2026-11-21T12:00:00Z" in step.reason


def test_a_node_drained_for_maintenance_waits_while_it_stands_and_resumes_after(grader):
    drained = CONTEXTS["drained for maintenance"]
    waiting = plan_in(grader.grade([maintenance()], "service"), drained)
    assert waiting.steps == () and "resumes when a re-test after the event passes" in waiting.note
    after = plan_in(grader.grade([], "service"), drained)
    assert [(s.action, s.to_state) for s in after.steps] == [
        (StepAction.RESUME, NodeState.IN_SERVICE)
    ]
    announced = dataclasses.replace(maintenance(), status=Status.WARN)
    assert [s.action for s in plan_in(grader.grade([announced], "service"), drained).steps] == [
        StepAction.RESUME
    ]


def test_a_broken_node_after_the_maintenance_takes_the_fault_path(grader):
    drained = CONTEXTS["drained for maintenance"]
    fault = plan_in(grader.grade(kernel_findings([XID64]), "service"), drained)
    assert [s.action for s in fault.steps] == [StepAction.REPLACE]
    error = plan_in(grader.grade([recovery("node_reboot")], "service"), drained)
    assert [s.action for s in error.steps] == [StepAction.RESTART]


def test_a_hardware_error_beside_a_maintenance_is_restarted_as_before(grader):
    grade = grader.grade([maintenance(), recovery("node_reboot")], "service")
    assert grade.action is Action.RESTART
    assert [s.action for s in plan_in(grade, {}).steps] == [StepAction.DRAIN, StepAction.RESTART]


def test_a_planned_event_survives_json():
    result = maintenance()
    assert Result.from_dict(result.to_dict()).planned == MAINTENANCE
    reason = Reason("cloud-maintenance", Level.ERROR, "node", "m", "planned", planned=MAINTENANCE)
    assert Reason.from_dict(reason.to_dict()) == reason
    with pytest.raises(ValueError, match="planned event"):
        Reason.from_dict({**reason.to_dict(), "planned": {"starts_at": "x"}})
