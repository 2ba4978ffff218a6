"""History-aware grading and remediation (issue 28, item 2).

* The same Xid returning after its restarts escalates to FAULT, per code: the catalog's
  ``restarts_before_fault`` in ``graders/xid.yaml``, else ``safety.max_restarts``.
* A node the agent restarted ``safety.max_remediations_7d`` times in 7 days is held for an
  operator, not restarted again.
* An application-class Xid (13, 31, ...) spread across GPUs is the job's (WARN, no action);
  repeated on one GPU while the others are clean it is that GPU's (ERROR).

The node is simulated (an 8-GPU H100 scenario: the simulated NVML backend); the kernel log is a
list of lines in the driver's real format. The ``xid`` check, the folding, the grader, the
remediator, its SQLite store and the ``log`` adapter are the real code; the clock is a
parameter so that no test sleeps.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from node_agent import resources
from node_agent.checking.context import HOST_PORTS
from node_agent.checks import xid as xid_check
from node_agent.commands.act import status_data
from node_agent.config import config_from_dict, load_config
from node_agent.environment import Environment, open_environment
from node_agent.grading.rules import Grader, load_grader
from node_agent.kernel_log import LinesKernelLog, normalise_bus
from node_agent.model import ActionRecord, Grade, HostInfo, Level, Reason, Report, Result
from node_agent.remediation.executor import Remediator
from node_agent.remediation.plan import REMEDIATIONS_CODE, Safety
from node_agent.remediation.store import Store, open_store
from node_agent.schedulers.log import LogAdapter
from node_agent.yamlfile import ConfigError

T0 = 1_700_000_000.0
NODE = "gpu-01"
DAY_S = 86400.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Environment]:
    """A simulated 8-GPU H100 node (no faults of its own: the kernel log is the test's)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": []}))
    environment = open_environment(load_config(config), str(scenario))
    yield environment
    environment.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "state")
    yield s
    s.close()


def shipped() -> Path:
    return resources.graders_dir(config_from_dict({}))


def graders_with(tmp_path: Path, code: int, name: str, extra: str) -> Grader:
    """The shipped graders with ``extra`` added to one XID entry (an operator's override)."""
    target = tmp_path / "graders"
    shutil.copytree(shipped(), target)
    xid = target / "xid.yaml"
    anchor = f'  {code}:\n    name: "{name}"\n'
    text = xid.read_text()
    assert anchor in text
    xid.write_text(text.replace(anchor, anchor + extra, 1))
    return load_grader(target)


def line(env: Environment, gpu: int, code: int, at_s: float | None = None) -> str:
    """A driver 535+ Xid line for ``gpu`` (as the kernel prints its bus), with a dmesg time."""
    bus = normalise_bus(env.inventory.gpus[gpu].pci_bus_id)
    text = {
        31: f"NVRM: Xid (PCI:{bus}): 31, pid=2512125, name=python3.10, Ch 00000008, "
        "intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_8 faulted @ "
        "0x73ac_1c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
        13: f"NVRM: Xid (PCI:{bus}): 13, pid=4242, name=python3, Graphics SM Warp "
        "Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
    }.get(code, f"NVRM: Xid (PCI:{bus}): {code}, pid='<unknown>', name=<unknown>, Ch 00000001")
    return text if at_s is None else f"[{at_s:12.6f}] {text}"


def xid_results(env: Environment, lines: list[str]) -> list[Result]:
    ctx = env.check_context(
        "xid",
        "service",
        {},
        kernel_log=LinesKernelLog(lines),
        ports=HOST_PORTS,
    )
    return xid_check.run(ctx)


def report_of(results: list[Result], grade: Grade) -> Report:
    return Report(
        host=HostInfo(hostname=NODE, kernel="test"),
        gpus=[],
        suite="quick",
        mode="service",
        started_at="",
        finished_at="",
        results=results,
        grade=grade,
    )


def remediator(
    store: Store,
    tmp_path: Path,
    clock: Clock,
    safety: Safety | None = None,
    warn: Callable[[str], None] | None = None,
) -> Remediator:
    """The real remediator with the real ``log`` adapter; every run comes after the reboot the
    previous one requested (boot time far ahead of the clock), as a reboot hook would see it."""
    return Remediator(
        store,
        LogAdapter(tmp_path / "actions.log"),
        NODE,
        safety or Safety(),
        state_dir=None,
        clock=clock,
        boot_time=T0 + 365 * DAY_S,
        warn=warn if warn is not None else (lambda _msg: None),
    )


def run_once(
    env: Environment, grader: Grader, rem: Remediator, lines: list[str]
) -> tuple[Grade, list[ActionRecord]]:
    results = xid_results(env, lines)
    grade = grader.grade(results, "service")
    return grade, rem.remediate(report_of(results, grade)).records


def acted(store: Store) -> list[tuple[str, str]]:
    return [(r.action, r.state) for r in store.journal_tail(NODE, 100)]


def restarts_until_replaced(
    env: Environment, grader: Grader, store: Store, tmp_path: Path, code: int, runs: int
) -> list[str]:
    """Grade the same Xid on gpu:3 run after run (10 minutes apart) and remediate each time;
    the actions done, in order."""
    clock = Clock()
    rem = remediator(store, tmp_path, clock, Safety(max_remediations_7d=100))
    for _ in range(runs):
        run_once(env, grader, rem, [line(env, 3, code)])
        clock.t += 600
    return [a for a, state in acted(store) if state == "done"]


# -- the same Xid after its restarts: FAULT, per code -------------------------------------------
def test_same_xid_after_its_third_restart_grades_fault(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    """An operator's catalog gives Xid 95 three restarts (safety.max_restarts stays 2): the
    fourth sighting, after the third restart, is replaced."""
    grader = graders_with(
        tmp_path, 95, "Uncontained memory error", "    restarts_before_fault: 3\n"
    )
    clock = Clock()
    rem = remediator(store, tmp_path, clock)
    notes = []
    for _ in range(4):
        grade, _records = run_once(env, grader, rem, [line(env, 3, 95)])
        (reason,) = grade.reasons
        assert (reason.catalog, reason.code, reason.restarts_before_fault) == ("xid", 95, 3)
        notes.append(store.node_record(NODE).state)
        clock.t += 600
    done = [a for a, state in acted(store) if state == "done"]
    assert done == ["drain", "restart", "restart", "restart", "replace"]
    assert notes == ["restarting", "restarting", "restarting", "awaiting-replacement"]
    replace = store.journal_tail(NODE, 1)[0]
    assert replace.reason.startswith("node-agent: FAULT xid-95 gpu:3 escalated")
    logged = (tmp_path / "actions.log").read_text()
    assert logged.count('"action": "restart"') == 3 and '"action": "replace"' in logged


def test_without_a_catalog_value_the_same_xid_gets_safety_max_restarts(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    grader = load_grader(shipped())
    assert grader.xid.codes[95].restarts_before_fault is None
    assert restarts_until_replaced(env, grader, store, tmp_path, 95, 4) == [
        "drain",
        "restart",
        "restart",
        "replace",
    ]


@pytest.mark.parametrize(
    "code, restarts",
    [
        (74, 1),  # WORKFLOW_NVLINK_ERR: the vendor once a reset or reboot fails to clear it
        (109, 4),  # RESET_GPU, CONTACT_SUPPORT "if it persists": NVSentinel's 5 in 24 h
        (119, 2),  # GPU reset, then a power cycle
    ],
)
def test_shipped_restarts_before_fault_decide_when_the_same_xid_is_replaced(
    env: Environment, store: Store, tmp_path: Path, code: int, restarts: int
) -> None:
    grader = load_grader(shipped())
    assert grader.xid.codes[code].restarts_before_fault == restarts
    done = restarts_until_replaced(env, grader, store, tmp_path, code, restarts + 2)
    assert done == ["drain", *["restart"] * restarts, "replace"]


# -- a node remediated too often in 7 days: held for an operator --------------------------------
ERROR_CODES = (95, 46, 109, 119, 120, 143)  # each ERROR, each with restarts of its own left


def test_node_remediated_five_times_in_7_days_is_held_not_restarted(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    """Five different Xids, one restart each (no code spends its own restarts); the sixth
    ERROR is held for an operator: no restart, a hold row in the journal, loud on stderr."""
    grader, clock = load_grader(shipped()), Clock()
    said: list[str] = []
    rem = remediator(store, tmp_path, clock, warn=said.append)
    for code in ERROR_CODES:
        run_once(env, grader, rem, [line(env, 3, code)])
        clock.t += 6 * 3600
    done = [a for a, state in acted(store) if state == "done"]
    assert done == ["drain", "restart", "restart", "restart", "restart", "restart", "hold"]
    record = store.node_record(NODE)
    assert (record.state, record.fault_code, record.target) == (
        "needs-operator",
        REMEDIATIONS_CODE,
        "node",
    )
    hold = store.journal_tail(NODE, 1)[0]
    assert hold.action == "hold" and hold.fault_code == REMEDIATIONS_CODE and hold.attempt == 5
    assert "safety.max_remediations_7d=5" in hold.detail
    assert any("NEEDS AN OPERATOR" in s and "7 days" in s for s in said)

    # held: a further ERROR plans nothing; a FAULT is still replaced
    rows = len(store.journal_tail(NODE, 100))
    clock.t += 3600
    run_once(env, grader, rem, [line(env, 3, 95)])
    assert len(store.journal_tail(NODE, 100)) == rows
    run_once(env, grader, rem, [line(env, 5, 64)])
    assert [a for a, _ in acted(store)][-1] == "replace"


def test_held_node_stays_held_after_its_remediations_leave_the_7_day_window(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    grader, clock = load_grader(shipped()), Clock()
    rem = remediator(store, tmp_path, clock, Safety(max_remediations_7d=2))
    for code in (95, 46, 109):
        run_once(env, grader, rem, [line(env, 3, code)])
        clock.t += 3600
    assert store.node_record(NODE).state == "needs-operator"
    clock.t += 8 * DAY_S
    run_once(env, grader, rem, [line(env, 3, 143)])
    assert [a for a, _ in acted(store)][-1] == "hold"  # an operator releases it, not time


def test_remediations_older_than_7_days_or_before_set_healthy_do_not_count(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    grader, clock = load_grader(shipped()), Clock()
    rem = remediator(store, tmp_path, clock, Safety(max_remediations_7d=2))
    run_once(env, grader, rem, [line(env, 3, 95)])
    clock.t += 8 * DAY_S  # the first restart is older than 7 days
    run_once(env, grader, rem, [line(env, 3, 46)])
    assert [a for a, _ in acted(store)][-1] == "restart"
    clock.t += 3600
    store.clear_node(NODE, clock.t, "GPU 3 reseated")  # set-healthy: a repaired node
    clock.t += 3600
    run_once(env, grader, rem, [line(env, 3, 109)])
    run_once(env, grader, rem, [line(env, 3, 143)])
    assert [a for a, _ in acted(store)][-3:] == ["drain", "restart", "restart"]
    assert store.node_record(NODE).state == "restarting"


def test_xid94_never_escalates_by_restarts_and_the_7_day_limit_holds_it(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    """gpud never escalates a contained memory error (94) by reboots; the node's own limit
    stops the restart loop."""
    grader, clock = load_grader(shipped()), Clock()
    assert grader.xid.codes[94].restarts_before_fault == 1000
    rem = remediator(store, tmp_path, clock)
    for _ in range(7):
        run_once(env, grader, rem, [line(env, 3, 94)])
        clock.t += 3600
    done = [a for a, state in acted(store) if state == "done"]
    assert done == ["drain", *["restart"] * 5, "hold"]
    assert "replace" not in done


def test_status_shows_restarts_per_code_the_7_day_count_and_the_hold(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    grader, clock = load_grader(shipped()), Clock()
    rem = remediator(store, tmp_path, clock, Safety(max_remediations_7d=3))
    for code in (109, 109, 95, 46):
        run_once(env, grader, rem, [line(env, 3, code)])
        clock.t += 600
    config = config_from_dict(
        {"state_dir": str(tmp_path / "state"), "safety": {"max_remediations_7d": 3}}
    )
    hist = status_data(store, NODE, config, now=clock.t)["history"]
    assert hist["remediations_7d"] == 3 and hist["max_remediations_7d"] == 3
    assert hist["restarts_per_code"] == {"xid-109": 2, "xid-95": 1}
    assert hist["restart_limits"]["xid-109"] == 4  # the catalog's; others safety.max_restarts
    assert hist["held"] is True and "restarted too often in 7 days" in hist["hold"]


# -- application-class Xids: the job's when spread, the GPU's when repeated on one ---------------
def test_xid31_on_gpus_0_to_7_is_a_warn_for_the_job_and_takes_no_action(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    """The same MMU fault on every GPU, three times each: the application's (WORKFLOW_XID_31),
    never a drain, although each GPU alone would pass the recurrence threshold."""
    lines = [line(env, gpu, 31, t) for t in (100.0, 2000.0, 4000.0) for gpu in range(8)]
    grader, clock = load_grader(shipped()), Clock()
    grade, records = run_once(env, grader, remediator(store, tmp_path, clock), lines)
    assert grade.level is Level.WARN and len(grade.reasons) == 8
    for reason in grade.reasons:
        assert reason.level is Level.WARN and reason.code == 31
        assert "spread across GPUs is the job's" in reason.message
    assert records == [] and acted(store) == []
    assert not (tmp_path / "actions.log").exists()


def test_xid31_repeated_on_gpu3_with_the_others_clean_is_an_error_for_gpu3(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    lines = [line(env, 3, 31, t) for t in (100.0, 2000.0, 4000.0)]
    grader, clock = load_grader(shipped()), Clock()
    grade, _records = run_once(env, grader, remediator(store, tmp_path, clock), lines)
    (reason,) = grade.reasons
    assert (grade.level, reason.level, reason.target) == (Level.ERROR, Level.ERROR, "gpu:3")
    assert "recurred: 3 bursts" in reason.message and "this GPU's" in reason.message
    assert [a for a, _ in acted(store)][:2] == ["drain", "restart"]


def test_xid31_that_outlives_its_restarts_is_held_for_an_operator_never_replaced(
    env: Environment, store: Store, tmp_path: Path
) -> None:
    """A user's own code can make the driver print a real Xid 31 on the GPU its job holds, and
    land on the node again after each reboot. Run after run with two bursts on gpu:3 (an
    ERROR), the node is restarted until safety.max_restarts is spent, then held for an operator
    who runs the field diagnostics: an error a user can cause never proves the GPU bad, so it
    is never escalated to a replacement."""
    grader, clock = load_grader(shipped()), Clock()
    said: list[str] = []
    rem = remediator(store, tmp_path, clock, warn=said.append)
    lines = [line(env, 3, 31, t) for t in (100.0, 2000.0)]
    for _ in range(4):
        grade, _records = run_once(env, grader, rem, lines)
        (reason,) = grade.reasons
        assert (reason.level, reason.target, reason.remedy) == (Level.ERROR, "gpu:3", "application")
        clock.t += 6 * 3600
    done = [a for a, state in acted(store) if state == "done"]
    assert done == ["drain", "restart", "restart", "hold"]
    record = store.node_record(NODE)
    assert (record.state, record.fault_code, record.target) == ("needs-operator", "xid-31", "gpu:3")
    hold = store.journal_tail(NODE, 1)[0]
    assert "class application" in hold.detail and "field diagnostics" in hold.detail
    # a hardware Xid on the held node is still replaced
    run_once(env, grader, rem, [line(env, 5, 64)])
    assert [a for a, _ in acted(store)][-1] == "replace"


def test_xid13_spread_across_gpus_stays_warn_and_repeated_on_one_gpu_is_error(
    env: Environment,
) -> None:
    grader = load_grader(shipped())
    times = [100.0 + 1000.0 * i for i in range(5)]  # 5 bursts: 13's recurrence threshold
    spread = grader.grade(
        xid_results(env, [line(env, g, 13, t) for t in times for g in (0, 4)]), "service"
    )
    assert spread.level is Level.WARN
    one = grader.grade(xid_results(env, [line(env, 4, 13, t) for t in times]), "service")
    assert (one.level, one.reasons[0].target) == (Level.ERROR, "gpu:4")


def test_the_same_code_on_another_gpu_outside_the_window_does_not_make_it_the_jobs(
    env: Environment,
) -> None:
    grader = load_grader(shipped())
    old = [line(env, 0, 31, 100.0)]  # two days before gpu:3's faults: another job's crash
    recent = [line(env, 3, 31, 2 * DAY_S + t) for t in (0.0, 2000.0, 4000.0)]
    grade = grader.grade(xid_results(env, old + recent), "service")
    by_target = {r.target: r.level for r in grade.reasons}
    assert by_target == {"gpu:0": Level.WARN, "gpu:3": Level.ERROR}


def test_a_hardware_xid_on_every_gpu_is_not_the_jobs(env: Environment) -> None:
    """Only the application class is judged by spread: Xid 95 on every GPU is still ERROR."""
    grade = load_grader(shipped()).grade(
        xid_results(env, [line(env, g, 95, 100.0) for g in range(8)]), "service"
    )
    assert {r.level for r in grade.reasons} == {Level.ERROR}


# -- the catalog fields and the typed reason ----------------------------------------------------
def test_reason_carries_catalog_code_and_restarts_through_a_saved_report(env: Environment) -> None:
    grade = load_grader(shipped()).grade(xid_results(env, [line(env, 2, 109)]), "service")
    (reason,) = grade.reasons
    assert (reason.catalog, reason.code, reason.restarts_before_fault) == ("xid", 109, 4)
    assert Reason.from_dict(reason.to_dict()) == reason
    with pytest.raises(ValueError, match="code must be an integer"):
        Reason.from_dict({**reason.to_dict(), "code": "109; rm -rf /"})
    with pytest.raises(ValueError, match="unknown catalog"):
        Reason.from_dict({**reason.to_dict(), "catalog": "bogus"})


@pytest.mark.parametrize(
    "extra, key",
    [
        ("    restarts_before_fault: -1\n", "restarts_before_fault"),
        ("    restarts_before_fault: two\n", "restarts_before_fault"),
        ("    class: firmware\n", "class"),
    ],
)
def test_a_broken_restarts_before_fault_or_class_is_a_config_error(
    tmp_path: Path, extra: str, key: str
) -> None:
    with pytest.raises(ConfigError, match=rf"xid.yaml.*{key}"):
        graders_with(tmp_path, 95, "Uncontained memory error", extra)


def test_the_application_class_is_marked_where_nvidia_leaves_the_code_to_the_application() -> None:
    codes = load_grader(shipped()).xid.codes
    assert {c for c, e in codes.items() if e.cls == "application"} >= {13, 31, 43, 45}
    assert all(codes[c].level <= Level.WARN for c in codes if codes[c].cls == "application")
    assert codes[79].cls is None and codes[95].cls is None
