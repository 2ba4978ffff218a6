"""Remediation through the real ``node-agent`` command: ``--act`` on ``accept``/``check``,
``act``, ``status``, ``set-healthy``, ``breaker reset``, ``optout``, crash recovery and a
corrupt state database. The ``log`` adapter (the default) records each action as one JSON
line in ``<state_dir>/actions.log``, which is how these tests count what the agent did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

NODE = "gpu-07"


@pytest.fixture
def config(tmp_path):
    """Write the agent config (state dir under tmp, a fixed node name); returns its path."""

    def make(**safety) -> str:
        path = tmp_path / "remediation-config.yaml"
        data = {"state_dir": str(tmp_path / "state"), "node": {"name": NODE}}
        if safety:
            data["safety"] = safety
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return make


@pytest.fixture
def logged(tmp_path):
    """The actions the log adapter recorded, as (action, reason) pairs."""

    def read() -> list[tuple[str, str]]:
        path = tmp_path / "state" / "actions.log"
        if not path.exists():
            return []
        return [(r["action"], r["reason"]) for r in map(json.loads, path.read_text().splitlines())]

    return read


XID64 = [{"kind": "xid", "gpu": 5, "code": 64}]
REMAP = [{"kind": "row_remap_pending", "gpu": 2}]
HANG = [{"kind": "driver_hang", "gpu": 3}]


def outcomes(report) -> list[tuple[str, str]]:
    return [(a["action"], a["outcome"]) for a in report["actions"]]


def test_xid64_accept_with_act_drains_and_replaces_naming_the_fault(
    agent, scenario, config, logged
):
    run = agent(
        "accept",
        "--only",
        "xid",
        "--simulate",
        scenario(XID64),
        "--act",
        "--json",
        "--config",
        config(),
    )
    assert run.code == 4, run.stderr
    report = run.json()
    assert outcomes(report) == [("drain", "done"), ("replace", "done")]
    assert all(a["adapter"] == "log" for a in report["actions"])
    assert [a for a, _ in logged()] == ["drain", "replace"]
    assert logged()[0][1] == "node-agent: FAULT xid-64 gpu:5 Xid 64: GPU memory remapping failure"


def test_report_written_to_disk_carries_the_actions(agent, scenario, config, tmp_path):
    out = tmp_path / "reports"
    run = agent(
        "check", "--simulate", scenario(XID64), "--act", "--out", str(out), "--config", config()
    )
    assert run.code == 4
    (saved,) = out.glob("report-*.json")
    assert [a["action"] for a in json.loads(saved.read_text())["actions"]] == ["drain", "replace"]


def test_warn_with_act_takes_no_action(agent, scenario, config, logged):
    run = agent(
        "check",
        "--simulate",
        scenario([{"kind": "temperature", "gpu": 0, "celsius": 91}]),
        "--act",
        "--json",
        "--config",
        config(),
    )
    assert run.code == 0, run.stderr
    assert run.json()["actions"] == [] and logged() == []


def test_dry_run_records_dry_run_and_the_adapter_is_not_called(agent, scenario, config, logged):
    run = agent(
        "check", "--simulate", scenario(XID64), "--act", "--dry-run", "--json", "--config", config()
    )
    assert run.code == 4
    assert outcomes(run.json()) == [("drain", "dry-run"), ("replace", "dry-run")]
    assert logged() == []
    # a simulated node's bug report would be this host's: the dry run says none is taken
    replace = run.json()["actions"][1]["detail"]
    assert "would first collect no driver bug report (simulated node" in replace


def test_dry_run_without_act_is_a_usage_error(agent, scenario, config):
    run = agent("check", "--simulate", scenario(), "--dry-run", "--config", config())
    assert run.code == 2 and "--act" in run.stderr


def test_error_goes_drain_reset_retest_reboot_then_resumes_after_reboot(
    agent, scenario, config, logged
):
    cfg = config()
    first = agent("check", "--simulate", scenario(REMAP), "--act", "--json", "--config", cfg)
    assert first.code == 3, first.stderr
    # under simulation the GPU reset is a stand-in and the injected fault persists, so the
    # quick re-test fails and the agent asks the scheduler for a reboot
    assert outcomes(first.json()) == [
        ("drain", "done"),
        ("gpu-reset", "done"),
        ("retest", "done"),
        ("restart", "done"),
    ]
    status = agent("status", "--json", "--config", cfg).json()
    assert status["remediation"]["state"] == "restarting"
    # each simulated run is a fresh boot (the documented stand-in for the reboot): the fault
    # is gone, the re-test passes and the agent resumes the node it drained
    second = agent("check", "--simulate", scenario(), "--act", "--json", "--config", cfg)
    assert second.code == 0
    assert outcomes(second.json()) == [("resume", "done")]
    # the log adapter records every action, the resume too (it cannot read the node's state)
    assert [a for a, _ in logged()] == ["drain", "restart", "resume"]
    assert agent("status", "--json", "--config", cfg).json()["remediation"]["state"] == "in-service"


def test_error_recurring_after_max_restarts_escalates_to_replace(agent, scenario, config, logged):
    cfg = config(max_restarts=1, min_action_interval_s=0)
    assert agent("check", "--simulate", scenario(HANG), "--act", "--config", cfg).code == 3
    again = agent("check", "--simulate", scenario(HANG), "--act", "--json", "--config", cfg)
    assert outcomes(again.json()) == [("replace", "done")]
    assert [a for a, _ in logged()] == ["drain", "restart", "replace"]
    assert "escalated" in logged()[-1][1]


def test_node_restarted_too_often_in_7_days_is_held_and_status_says_so(
    agent, scenario, config, logged
):
    """safety.max_remediations_7d: 2. The first run resets the GPU and asks for a reboot (two
    restarts of the node); the second finds the fault again and holds the node for an operator
    instead of restarting it a third time: loud on stderr, a hold row, and in ``status``."""
    cfg = config(max_remediations_7d=2, max_restarts=5)
    first = agent("check", "--simulate", scenario(REMAP), "--act", "--json", "--config", cfg)
    assert outcomes(first.json())[-1] == ("restart", "done")
    second = agent("check", "--simulate", scenario(REMAP), "--act", "--json", "--config", cfg)
    assert second.code == 3
    assert outcomes(second.json()) == [("hold", "done")]
    assert "NEEDS AN OPERATOR" in second.stderr and "2 time(s) in 7 days" in second.stderr
    assert [a for a, _ in logged()] == ["drain", "restart"]  # a hold calls no adapter
    data = agent("status", "--json", "--config", cfg).json()
    assert data["remediation"]["state"] == "needs-operator"
    assert data["remediation"]["fault_code"] == "remediations-7d"
    hist = data["history"]
    assert (hist["remediations_7d"], hist["max_remediations_7d"], hist["held"]) == (2, 2, True)
    assert hist["restarts_per_code"] == {"row-remap-pending": 2}
    human = agent("status", "--config", cfg).stdout
    assert "remediations in 7 days: 2 of safety.max_remediations_7d=2 (HELD" in human
    assert "restarts per fault code in 24 h: row-remap-pending 2 of 5" in human
    # held: the next run restarts nothing
    third = agent("check", "--simulate", scenario(REMAP), "--act", "--json", "--config", cfg)
    assert outcomes(third.json()) == [] and "held for an operator" in third.stderr


def test_status_shows_state_last_grade_journal_and_breaker(agent, scenario, config):
    cfg = config()
    agent("check", "--simulate", scenario(XID64), "--act", "--config", cfg)
    data = agent("status", "--json", "--config", cfg).json()
    assert data["node"] == NODE
    assert data["remediation"]["state"] == "awaiting-replacement"
    assert data["last_run"]["level"] == "FAULT"
    assert [r["action"] for r in data["journal"]] == ["drain", "replace"]
    assert data["breaker"]["open"] is False
    human = agent("status", "--config", cfg)
    assert human.code == 0 and "awaiting-replacement" in human.stdout
    assert "breaker: closed" in human.stdout


def test_set_healthy_then_act_resume_returns_the_node(agent, scenario, config, logged):
    cfg = config()
    agent("check", "--simulate", scenario(XID64), "--act", "--config", cfg)
    run = agent("set-healthy", "--reason", "GPU 5 replaced, RMA 77", "--config", cfg)
    assert run.code == 0 and "act resume" in run.stdout
    assert agent("status", "--json", "--config", cfg).json()["remediation"]["state"] == "in-service"
    resume = agent("act", "resume", "--config", cfg)
    assert resume.code == 0, resume.stderr


def test_breaker_trips_refuses_loudly_and_reset_reopens_actions(agent, scenario, config, logged):
    cfg = config(breaker_max_drains=1, min_action_interval_s=0)
    assert agent("check", "--simulate", scenario(XID64), "--act", "--config", cfg).code == 4
    agent("set-healthy", "--config", cfg)
    tripped = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg)
    assert outcomes(tripped.json()) == [("drain", "refused")]
    assert "REFUSED" in tripped.stderr and "breaker reset" in tripped.stderr
    assert agent("status", "--json", "--config", cfg).json()["breaker"]["open"] is True
    reset = agent("breaker", "reset", "--config", cfg)
    assert reset.code == 0 and "was open" in reset.stdout
    after = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg)
    assert outcomes(after.json()) == [("drain", "done"), ("replace", "done")]
    assert [a for a, _ in logged()].count("drain") == 2


def test_blast_radius_zero_refuses_and_records(agent, scenario, config, logged):
    cfg = config(max_drained_fraction=0.0)
    run = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg)
    assert outcomes(run.json()) == [("drain", "refused")]
    assert "blast radius" in run.json()["actions"][0]["detail"] and logged() == []
    journal = agent("status", "--json", "--config", cfg).json()["journal"]
    assert journal[-1]["state"] == "refused"


def test_optout_stops_automatic_actions_until_turned_off(agent, scenario, config, logged):
    cfg = config(min_action_interval_s=0)
    assert agent("optout", "on", "--reason", "vendor burn-in", "--config", cfg).code == 0
    run = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg)
    assert outcomes(run.json()) == [("drain", "refused")] and logged() == []
    agent("optout", "off", "--config", cfg)
    run = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg)
    assert outcomes(run.json()) == [("drain", "done"), ("replace", "done")]


def test_act_reason_is_sanitised_before_it_reaches_the_adapter(agent, config, logged):
    run = agent(
        "act", "drain", "--reason", 'fan\nState=RESUME "x"\x07' + "z" * 400, "--config", config()
    )
    assert run.code == 0, run.stderr
    ((action, reason),) = logged()
    assert action == "drain" and reason.startswith("node-agent: operator drain: fan State=RESUME")
    assert "\n" not in reason and '"' not in reason and len(reason) <= 200
    assert all(32 <= ord(c) < 127 for c in reason)


def test_act_dry_run_prints_and_records_nothing(agent, config, logged):
    run = agent("act", "replace", "--dry-run", "--config", config())
    assert run.code == 0 and "dry-run" in run.stdout and logged() == []
    # what it would collect first: the driver's bug report, or why there is none here
    assert "would first collect" in run.stdout and "nvidia-bug-report.sh" in run.stdout


def _python_process(code, args, tmp_path, **env):
    """``python -c code args...`` in ``tmp_path``, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **env},
    )


def _agent_process(args, tmp_path, **env):
    run_main = "import sys; from node_agent.commands.main import main; sys.exit(main())"
    return _python_process(run_main, args, tmp_path, **env)


# The agent's command line in a child Python whose remediators SIGKILL the process once the step
# named by argv[1] is journaled, before the adapter is called (the executor's ``after_journal``).
_CRASHING_AGENT = """
import os, signal, sys
from node_agent.commands.main import main
from node_agent.remediation.executor import Remediator

crash_at = sys.argv.pop(1)
init = Remediator.__init__

def crash(step):
    if step.action == crash_at:
        os.kill(os.getpid(), signal.SIGKILL)

def crashing_init(self, *args, **kwargs):
    init(self, *args, **{**kwargs, "after_journal": crash})

Remediator.__init__ = crashing_init
sys.exit(main())
"""


def test_kill_9_between_journal_and_act_completes_the_action_exactly_once(
    scenario, config, logged, tmp_path
):
    cfg = config()
    args = ["check", "--simulate", scenario(XID64), "--act", "--json", "--config", cfg]
    crashed = _python_process(_CRASHING_AGENT, ["drain", *args], tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert logged() == []
    again = _agent_process(args, tmp_path)
    assert again.returncode == 4, again.stderr
    assert "completing journal" in again.stderr
    assert [a for a, _ in logged()] == ["drain", "replace"]
    actions = json.loads(again.stdout)["actions"]
    assert actions[0]["action"] == "drain" and "recovered journal" in actions[0]["detail"]
    third = _agent_process(args, tmp_path)
    assert [a for a, _ in logged()] == ["drain", "replace"], third.stderr


def test_corrupt_state_database_is_moved_aside_and_the_run_goes_on(
    agent, scenario, config, tmp_path
):
    state = tmp_path / "state"
    state.mkdir()
    (state / "node-agent.db").write_bytes(os.urandom(4096))
    run = agent("check", "--simulate", scenario(XID64), "--act", "--json", "--config", config())
    assert run.code == 4
    assert "moved it aside" in run.stderr
    assert list(state.glob("node-agent.db.corrupt-*"))
    assert outcomes(run.json()) == [("drain", "done"), ("replace", "done")]


def test_invalid_safety_key_is_a_configuration_error_naming_the_key(agent, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "safety": {"breaker_max_drains": 0}})
    )
    run = agent("status", "--config", str(path))
    assert run.code == 2 and "breaker_max_drains" in run.stderr


# A hung training job: the check side reports it as ERROR rule training-hang on
# job:<job>/rank:<n>; the remediation restarts the job through the adapter and leaves the node.
_HUNG_JOB_RUN = """
import os, signal, sys
from node_agent.config import load_config
from node_agent.model import Action, Grade, Level, Reason
from node_agent.remediation.executor import Remediator
from node_agent.schedulers.log import LogAdapter
from node_agent.remediation.store import open_store

class Report:
    suite, mode = "periodic", "service"
    grade = Grade(Level.ERROR, Action.RESTART, (Reason(
        "training-hang", Level.ERROR, "job:slurm:77/rank:3", "rank 3 made no step for 412 s"),))

    def to_dict(self):
        return {"grade": self.grade.to_dict()}

config = load_config(sys.argv[1])
store = open_store(config.state_dir)

def crash(step):  # a kill -9 once the job restart is journaled, before the adapter is called
    if step.action == "restart-job":
        os.kill(os.getpid(), signal.SIGKILL)

Remediator(store, LogAdapter.from_config(config), sys.argv[2], config.safety,
           state_dir=config.state_dir, after_journal=crash).remediate(Report())
"""


def test_kill_9_before_a_job_restart_sends_it_once_and_status_shows_it(
    agent, scenario, config, logged, tmp_path
):
    cfg = config()
    crashed = _python_process(_HUNG_JOB_RUN, [cfg, NODE], tmp_path)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert logged() == []
    journal = agent("status", "--json", "--config", cfg).json()["journal"]
    assert [(r["action"], r["state"]) for r in journal] == [("restart-job", "planned")]
    # the next run (here a healthy check) completes the journaled job restart first
    again = agent("check", "--simulate", scenario(), "--act", "--json", "--config", cfg)
    assert again.code == 0, again.stderr
    assert "completing journal" in again.stderr
    assert logged() == [
        (
            "restart-job",
            "node-agent: ERROR training-hang job slurm:77 rank:3 rank 3 made no step for 412 s",
        )
    ]
    status = agent("status", "--json", "--config", cfg).json()
    (row,) = status["journal"]
    assert (row["action"], row["state"], row["target"]) == ("restart-job", "done", "job:slurm:77")
    assert "recovered journal" in row["detail"] and "slurm:77" in row["detail"]
    assert status["remediation"]["state"] == "in-service"  # the node was never drained
    human = agent("status", "--config", cfg).stdout
    assert "restart-job" in human and "job:slurm:77" in human
