"""Silent-data-corruption end to end through the real ``node-agent`` command: the ``sdc`` check
in ``accept``, the standalone ``node-agent sdc``, and training-job verdicts spooled for
``sdc_spool``. The simulated ``sdc`` fault corrupts one GPU's matmul at the compute boundary;
the probes, grading and CLI above it are the real code."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("torch")

from node_agent import sdc as sdc_lib  # noqa: E402

SDC6 = [{"kind": "sdc", "gpu": 6}]


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


def test_accept_sdc_on_healthy_node_grades_healthy(agent, scenario):
    run = agent("accept", "--simulate", scenario(), "--only", "sdc", "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "HEALTHY"
    assert {r["metric"] for r in report["results"]} == {"sdc_probes"}
    assert len(report["results"]) == 8


def test_sdc_command_on_faulty_gpu_exits_4_with_sdc_report(agent, scenario, tmp_path):
    run = agent("sdc", "--simulate", scenario(SDC6), "--gpus", "0,6", "--duration", "2",
                "--json", "--config", config(tmp_path))
    assert run.code == 4, run.stderr
    report = run.json()
    assert report["suite"] == "sdc"
    results = {r["target"]: r for r in report["results"]}
    assert set(results) == {"gpu:0", "gpu:6"}
    assert results["gpu:6"]["metric"] == "sdc_confirmed"
    assert results["gpu:0"]["status"] == "pass"
    assert results["gpu:0"]["evidence"]["rounds"] >= 2  # repeated until the duration passed


def test_sdc_command_prints_verdict_counts_per_gpu(agent, scenario, tmp_path):
    run = agent("sdc", "--simulate", scenario(), "--gpus", "1-2", "--duration", "0.5",
                "--config", config(tmp_path))
    assert run.code == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("gpu:1") and "pass (sdc_probes)" in line for line in lines)
    assert any(line.startswith("gpu:2") for line in lines)
    assert "grade: HEALTHY" in run.stdout


@pytest.mark.parametrize("gpus, message", [
    ("9", "GPU 9 not present; the node has 8 GPU(s)"),
    ("0,x", "'x' is not a GPU index or range"),
    ("3-1", "'3-1' is not a GPU index or range"),
])
def test_sdc_command_bad_gpu_list_is_usage_error(agent, scenario, tmp_path, gpus, message):
    run = agent("sdc", "--simulate", scenario(), "--gpus", gpus, "--config", config(tmp_path))
    assert run.code == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""


def _spool_suite(tmp_path) -> str:
    path = tmp_path / "spool-suite.yaml"
    path.write_text(yaml.safe_dump({"name": "spool", "mode": "service",
                                    "checks": [{"check": "sdc_spool", "timeout_s": 30}]}))
    return str(path)


def test_training_job_confirmed_verdict_grades_fault_and_stays_until_gpu_replaced(
        agent, scenario, tmp_path):
    config(tmp_path)
    verdict = sdc_lib.Verdict(
        probe="exact_gemm", device="cuda:3", shape=(128, 128, 128), dtype="bf16",
        status="confirmed", mismatched_elements=1,
        detail="exact_gemm bf16 128x128x128: 1 of 16384 elements differ; re-run repeated it",
        duration_s=0.003, timestamp=1763726400.0)
    sdc_lib.write_verdict(tmp_path / "state" / "spool" / "sdc", verdict)
    node = scenario()
    first = agent("check", "--suite", _spool_suite(tmp_path), "--simulate", node, "--json")
    assert first.code == 4, first.stderr
    (reason,) = first.json()["grade"]["reasons"]
    assert reason["target"] == "gpu:3" and reason["rule"] == "sdc-confirmed"
    assert "1 new verdict(s)" in reason["message"]
    # Decision (docs/sdc.md): the file is graded once, but a confirmed SDC stays standing, so a
    # later run still grades FAULT (saying it is standing) until the GPU is replaced.
    second = agent("check", "--suite", _spool_suite(tmp_path), "--simulate", node, "--json")
    assert second.code == 4, second.stderr
    (result,) = second.json()["results"]
    assert result["evidence"]["source"] == "spool (standing)" and result["value"] == 1
    # the GPUs swapped (other UUIDs): nothing stands any more
    swapped = scenario(hostname="sim-node-repaired")
    third = agent("check", "--suite", _spool_suite(tmp_path), "--simulate", swapped, "--json")
    assert third.code == 0, third.stderr
    assert third.json()["grade"]["level"] == "HEALTHY"


def test_periodic_suite_runs_healthy_under_simulation(agent, scenario):
    run = agent("check", "--suite", "periodic", "--simulate", scenario(), "--json", timeout=300)
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["suite"] == "periodic" and report["grade"]["level"] in ("HEALTHY", "WARN")
    assert {r["check"] for r in report["results"]} >= {"nvml_health", "xid", "sdc", "sdc_spool",
                                                        "storage"}
    assert not [r for r in report["results"] if r["check"].startswith("sdc")
                and r["status"] not in ("pass",)]


def test_periodic_suite_gives_each_check_a_cadence():
    from node_agent.resources import _shipped
    from node_agent.suite import load_suite

    suite = load_suite("periodic", _shipped("node_agent.suites"))
    cadence = {c.check: c.every_s for c in suite.checks}
    assert cadence == {"nvml_health": 10, "xid": 30, "sdc_spool": 60, "sdc": 600,
                       "storage": 3600, "training_progress": 15}
    assert suite.mode == "service"
