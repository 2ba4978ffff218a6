"""Silent-data-corruption end to end through the real ``node-agent`` command: the ``sdc`` check
in ``accept`` and the standalone ``node-agent sdc``, on the shipped ``scenarios/sdc-*.yaml``. The
simulated ``sdc`` fault corrupts the output tiles one SM of one GPU computes (or every SM's) at
the compute boundary; the probes, grading and CLI above it are the real code. (Training jobs'
spooled verdicts: ``tests/unit/test_sdc_spool.py`` and ``tests/security``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

SDC6 = [{"kind": "sdc", "gpu": 6}]
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def config(tmp_path) -> str:
    path = tmp_path / "agent-config.yaml"  # the same file the agent fixture writes
    if not path.exists():
        path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    return str(path)


@pytest.mark.parametrize("attempt", range(2))
def test_accept_sdc_on_gpu6_grades_fault_naming_gpu6_only(agent, scenario, attempt):
    run = agent("accept", "--simulate", scenario(SDC6), "--only", "sdc", "--json")
    assert run.code == 4, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "FAULT" and report["grade"]["action"] == "replace"
    (reason,) = report["grade"]["reasons"]
    assert reason["target"] == "gpu:6" and reason["rule"] == "sdc-confirmed"
    assert "gpu:6" in reason["message"] and "elements differ" in reason["message"]
    failing = {r["target"] for r in report["results"] if r["status"] != "pass"}
    assert failing == {"gpu:6"}
    assert len([r for r in report["results"] if r["status"] == "pass"]) == 7


@pytest.mark.parametrize(
    "name", ["sdc-sm17-gpu6.yaml", "sdc-sm17-gpu6-intermittent.yaml"], ids=["rate-1.0", "rate-0.3"]
)
def test_accept_finds_one_faulty_sm_of_132_on_gpu6_and_only_there(agent, name):
    scenario = yaml.safe_load((SCENARIOS / name).read_text())
    assert scenario["faults"] == [
        {"kind": "sdc", "gpu": 6, "sm": 17, **({"rate": 0.3} if "intermittent" in name else {})}
    ]
    run = agent("accept", "--simulate", str(SCENARIOS / name), "--only", "sdc", "--json")
    assert run.code == 4, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "FAULT"
    (reason,) = report["grade"]["reasons"]
    assert (reason["target"], reason["rule"]) == ("gpu:6", "sdc-confirmed")
    assert "single SM" in reason["message"]
    assert {r["target"] for r in report["results"] if r["status"] != "pass"} == {"gpu:6"}
    assert [r["evidence"]["sm_coverage"] for r in report["results"]] == [1.0] * 8


def test_sdc_command_finds_an_intermittent_sm_in_20_seconds(agent, tmp_path):
    run = agent(
        "sdc",
        "--simulate",
        str(SCENARIOS / "sdc-sm97-gpu2-half.yaml"),
        "--duration",
        "20",
        "--json",
        "--config",
        config(tmp_path),
        timeout=300,
    )
    assert run.code == 4, run.stderr
    report = run.json()
    assert {r["target"] for r in report["results"] if r["status"] != "pass"} == {"gpu:2"}
    result = next(r for r in report["results"] if r["target"] == "gpu:2")
    assert result["metric"] == "sdc_confirmed"
    assert result["evidence"]["rounds"] >= 2 and result["evidence"]["sm_coverage"] == 1.0
    assert result["evidence"]["sm_pattern"]["runs_several_sms"] == 0


def test_healthy_node_stays_healthy_with_full_coverage_of_every_gpu(agent):
    run = agent(
        "accept", "--simulate", str(SCENARIOS / "healthy-h100.yaml"), "--only", "sdc", "--json"
    )
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "HEALTHY"
    assert {(r["metric"], r["evidence"]["sm_coverage"]) for r in report["results"]} == {
        ("sdc_probes", 1.0)
    }
    assert sorted(r["target"] for r in report["results"]) == [f"gpu:{i}" for i in range(8)]


def test_sdc_command_on_faulty_gpu_exits_4_with_sdc_report(agent, scenario, tmp_path):
    run = agent(
        "sdc",
        "--simulate",
        scenario(SDC6),
        "--gpus",
        "0,6",
        "--duration",
        "2",
        "--json",
        "--config",
        config(tmp_path),
    )
    assert run.code == 4, run.stderr
    report = run.json()
    assert report["suite"] == "sdc"
    results = {r["target"]: r for r in report["results"]}
    assert set(results) == {"gpu:0", "gpu:6"}
    assert results["gpu:6"]["metric"] == "sdc_confirmed"
    assert results["gpu:0"]["status"] == "pass"
    assert results["gpu:0"]["evidence"]["rounds"] >= 2  # repeated until the duration passed


def test_sdc_command_prints_verdict_counts_per_gpu(agent, scenario, tmp_path):
    run = agent(
        "sdc",
        "--simulate",
        scenario(),
        "--gpus",
        "1-2",
        "--duration",
        "0.5",
        "--config",
        config(tmp_path),
    )
    assert run.code == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("gpu:1") and "pass (sdc_probes)" in line for line in lines)
    assert any(line.startswith("gpu:2") for line in lines)
    assert "grade: HEALTHY" in run.stdout


@pytest.mark.parametrize(
    "gpus, message",
    [
        ("9", "GPU 9 not present; the node has 8 GPU(s)"),
        ("0,x", "'x' is not a GPU index or range"),
        ("3-1", "'3-1' is not a GPU index or range"),
    ],
)
def test_sdc_command_bad_gpu_list_is_usage_error(agent, scenario, tmp_path, gpus, message):
    run = agent("sdc", "--simulate", scenario(), "--gpus", gpus, "--config", config(tmp_path))
    assert run.code == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""


def test_periodic_suite_runs_healthy_under_simulation(agent, scenario):
    run = agent("check", "--suite", "periodic", "--simulate", scenario(), "--json", timeout=300)
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["suite"] == "periodic" and report["grade"]["level"] in ("HEALTHY", "WARN")
    assert {r["check"] for r in report["results"]} >= {
        "nvml_health",
        "xid",
        "sdc",
        "sdc_spool",
        "storage",
    }
    assert not [
        r
        for r in report["results"]
        if r["check"].startswith("sdc") and r["status"] not in ("pass",)
    ]


def test_periodic_suite_gives_each_check_a_cadence():
    from node_agent.resources import _shipped
    from node_agent.suite import load_suite

    suite = load_suite("periodic", _shipped("node_agent.suites"))
    cadence = {c.check: c.every_s for c in suite.checks}
    assert cadence == {
        "nvml_health": 10,
        "xid": 30,
        "sdc_spool": 60,
        "sdc": 600,
        "storage": 3600,
        "training_progress": 15,
        # the rest of the node (docs/host_checks.md)
        "hca_ports": 15,
        "kernel_distress": 60,
        "software_drift": 3600,
        "host_memory": 300,
        "pcie_aer": 60,
        "host_cpu": 60,
        "host_power": 300,
        "nvme_health": 3600,
        # what the cloud announced (docs/cloud.md)
        "cloud_maintenance": 60,
        # the NVLink fabric and its IMEX domain (docs/nvlink.md, docs/imex.md)
        "nvlink_fabric": 60,
        "imex": 60,
    }
    assert suite.mode == "service"
