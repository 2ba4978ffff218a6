"""The kernel's distress and software drift through the real ``node-agent`` command on simulated
nodes: raw kernel-log lines (``{kind: kernel_log, line: ...}``, in the forms Linux prints, see
tests/unit/test_kernel_distress.py for each form's source), ``mce`` and ``pstore_panic`` faults,
and the ``software`` fault against a config's ``node.software``. Reading, folding, grading and
the exit code are the real code; only the hardware is simulated.
"""

from __future__ import annotations

import yaml

HUNG = "[  363.201] INFO: task python3:4242 blocked for more than 122 seconds."
SOFT_LOCKUP = "[  400.118] watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python3:1234]"
NVME = "[ {t}.5] nvme nvme0: I/O {tag} QID 4 timeout, reset controller"


def distress(report):
    return [
        r
        for r in report["results"]
        if r["check"] == "kernel_distress" and r["status"] in ("warn", "fail")
    ]


def suite_file(tmp_path, mode="service"):
    path = tmp_path / "host-suite.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "host",
                "mode": mode,
                "checks": [
                    {"check": "inventory", "timeout_s": 30},
                    {"check": "nvml_health", "timeout_s": 30},
                    {"check": "xid", "timeout_s": 15},
                    {"check": "kernel_distress", "timeout_s": 15, "params": {"since": "last_run"}},
                    {"check": "software_drift", "timeout_s": 30},
                ],
            }
        )
    )
    return str(path)


def test_hung_task_grades_warn_and_exits_0(agent, scenario):
    run = agent("check", "--simulate", scenario([{"kind": "kernel_log", "line": HUNG}]), "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert (report["grade"]["level"], report["grade"]["action"]) == ("WARN", "none")
    (found,) = distress(report)
    assert found["metric"] == "hung_task" and "python3:4242" in found["detail"]


def test_soft_lockup_grades_error_and_exits_3(agent, scenario):
    run = agent(
        "check", "--simulate", scenario([{"kind": "kernel_log", "line": SOFT_LOCKUP}]), "--json"
    )
    assert run.code == 3, run.stderr
    reasons = run.json()["grade"]["reasons"]
    assert [(r["rule"], r["level"]) for r in reasons] == [("kernel-soft-lockup", "ERROR")]


def test_corrected_mces_grade_warn_and_a_fatal_one_error(agent, scenario):
    run = agent("check", "--simulate", scenario([{"kind": "mce", "count": 3}]), "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "WARN"
    (found,) = distress(report)
    assert (found["metric"], found["value"]) == ("mce_corrected", 4)  # 3 records + the notice
    fatal = agent(
        "check", "--simulate", scenario([{"kind": "mce", "count": 1, "fatal": True}]), "--json"
    )
    assert fatal.code == 3
    assert {r["rule"] for r in fatal.json()["grade"]["reasons"]} == {"kernel-mce-uncorrected"}


def test_repeated_nvme_timeouts_grade_error_naming_the_disk(agent, scenario):
    faults = [{"kind": "kernel_log", "line": NVME.format(t=500 + i, tag=100 + i)} for i in range(3)]
    run = agent("check", "--simulate", scenario(faults), "--json")
    assert run.code == 3, run.stderr
    (reason,) = run.json()["grade"]["reasons"]
    assert (reason["rule"], reason["target"]) == ("kernel-nvme-timeouts-repeated", "disk:nvme0")


def test_a_panic_kept_in_pstore_warns_and_a_recurring_one_grades_error(agent, scenario):
    once = agent("check", "--simulate", scenario([{"kind": "pstore_panic"}]), "--json")
    assert (once.code, once.json()["grade"]["level"]) == (0, "WARN")
    again = agent("check", "--simulate", scenario([{"kind": "pstore_panic", "count": 2}]), "--json")
    assert again.code == 3
    assert [r["rule"] for r in again.json()["grade"]["reasons"]] == ["pstore-panic-recurring"]


def test_nccl_drift_grades_warn_naming_expected_and_found(agent, scenario, tmp_path):
    config = tmp_path / "drift-config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "node": {"software": {"nccl": "2.21.5", "driver": "570.86.15"}},
            }
        )
    )
    run = agent(
        "accept",
        "--only",
        "software_drift",
        "--config",
        str(config),
        "--simulate",
        scenario([{"kind": "software", "nccl": "2.18.1"}]),
        "--json",
    )
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "WARN"
    (reason,) = report["grade"]["reasons"]
    assert reason["rule"] == "software-drift"
    assert "expected 2.21.5" in reason["message"] and "found 2.18.1" in reason["message"]


def test_healthy_simulated_node_stays_healthy_three_runs_in_a_row(agent, scenario, tmp_path):
    """The quick suite's checks and the two new ones, three runs (the cursor of since: last_run
    kept in between), on a node with RDMA devices (so peermem is looked at)."""
    node, suite = scenario(hcas=["mlx5_0", "mlx5_1"]), suite_file(tmp_path)
    for _ in range(3):
        run = agent("check", "--suite", suite, "--simulate", node, "--json")
        assert run.code == 0, run.stderr
        report = run.json()
        assert report["grade"]["level"] == "HEALTHY", report["grade"]
        passed = {r["check"] for r in report["results"] if r["status"] == "pass"}
        assert {"kernel_distress", "software_drift"} <= passed
