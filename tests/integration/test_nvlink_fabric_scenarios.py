"""The NVLink fabric scenarios graded as stated, both ways: ``--simulate`` (the simulator's
model, or a capture replayed through the real NVML backend in Python) and the stand-in
``libnvidia-ml.so.1`` (``NVML_FAKE_SCENARIO``: the real nvidia-ml-py and its ctypes structs
read ``nvmlDeviceGetGpuFabricInfoV``). NVML is the one thing not real: no GPU runs here.

The real captures: the GB200 tray (scenarios/real/gb200-p6e-nvidia-smi.yaml, converted from
NVIDIA/k8s-test-infra's qx-gb200.xml: a pass-through VM whose fabric answers Completed,
Success, clique 2, Healthy) grades HEALTHY with nothing declared; the H100 and H200
pass-through VMs (../shared/realworld/) show every fabric judgment as a skip with its reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

SCENARIOS = harness.REPO / "scenarios"
#: scenario -> (grade, {(rule, target)} of its reasons)
GRADED = {
    "healthy-gb200-186gb.yaml": ("HEALTHY", set()),
    "healthy-gb300-288gb.yaml": ("HEALTHY", set()),
    "gb200-fabric-degraded.yaml": ("WARN", {("nvlink-fabric-degraded", "gpu:2")}),
    "gb200-fabric-unhealthy.yaml": (
        "ERROR",
        {("nvlink-fabric-unhealthy", "gpu:1"), ("nvlink-fabric-incomplete", "gpu:3")},
    ),
    "gb200-wrong-clique.yaml": ("ERROR", {("nvlink-fabric-wrong-clique", "gpu:0")}),
    "hgx-b200-single-node.yaml": ("HEALTHY", set()),
    "real/gb200-p6e-nvidia-smi.yaml": ("HEALTHY", set()),
}
#: the pass-through VMs that see no NVLink (tests/integration/test_real_h100_replay.py)
VMS = {
    "h100": SCENARIOS / "real" / "h100-sxm5-vm.yaml",
    "h200": harness.REPO.parent / "shared" / "realworld" / "gpu-h200-vm" / "capture.yaml",
}
SUITE = {
    "name": "nvlink-fabric",
    "description": "the NVLink judgments",
    "mode": "delivery",
    "checks": [
        {"check": "inventory", "timeout_s": 30},
        {"check": "nvml_health", "timeout_s": 30},
        {"check": "nvlink_fabric", "timeout_s": 15},
    ],
}
WAYS = ("simulate", "stand-in")


@pytest.fixture(scope="module")
def nvml_fake_lib() -> Path:
    return harness.build()


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "kernel.log"  # the host's kernel log is not the scenario's node
    log.write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "kernel_log": {"path": str(log)},
                "nvml": {"call_timeout_s": 5},
            }
        )
    )
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump(SUITE))
    return config, suite


def _run(tmp_path: Path, argv: list[str], scenario: Path, way: str) -> dict[str, Any]:
    proc = harness.run_agent(argv, scenario, simulate=way == "simulate", cwd=tmp_path)
    assert proc.stdout.strip(), proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def _check(tmp_path: Path, setup: tuple[Path, Path], scenario: Path, way: str) -> dict[str, Any]:
    config, suite = setup
    argv = ["check", "--json", "--config", str(config), "--suite", str(suite)]
    return _run(tmp_path, [*argv, "--out", str(tmp_path / "out")], scenario, way)


def _fabric(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["check"] == "nvlink_fabric"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", sorted(GRADED))
def test_each_nvlink_fabric_scenario_grades_as_stated_both_ways(
    nvml_fake_lib, tmp_path, setup, name, way
):
    report = _check(tmp_path, setup, SCENARIOS / name, way)
    level, rules = GRADED[name]
    reasons = report["grade"]["reasons"]
    assert report["grade"]["level"] == level, reasons
    assert {(r["rule"], r["target"]) for r in reasons} == rules
    if way == "stand-in":  # the real backend read the stand-in's structs
        assert report["host"]["gpu_backend"] == "nvml" and report["simulated"] is False
    assert not [r for r in _fabric(report) if r["status"] == "error"], _fabric(report)


@pytest.mark.parametrize("way", WAYS)
def test_a_gb200_tray_names_its_domain_and_every_gpu_passes_both_ways(
    nvml_fake_lib, tmp_path, setup, way
):
    report = _check(tmp_path, setup, SCENARIOS / "real" / "gb200-p6e-nvidia-smi.yaml", way)
    results = {(r["target"], r["metric"]): r for r in _fabric(report)}
    domain = results[("node", "nvlink_domain")]
    assert domain["status"] == "pass" and domain["value"] == 2
    assert domain["evidence"]["cluster_uuid"] == "00000001-0000-0000-0000-000000000001"
    for gpu in range(4):
        for metric in ("fabric_state", "fabric_health", "fabric_clique"):
            assert results[(f"gpu:{gpu}", metric)]["status"] == "pass"


@pytest.mark.parametrize("way", WAYS)
def test_a_wrong_clique_names_the_gpu_and_both_cliques(nvml_fake_lib, tmp_path, setup, way):
    report = _check(tmp_path, setup, SCENARIOS / "gb200-wrong-clique.yaml", way)
    (wrong,) = [r for r in _fabric(report) if r["status"] == "fail"]
    assert wrong["target"] == "gpu:0" and wrong["metric"] == "fabric_clique"
    assert "in clique 5" in wrong["detail"] and "in clique 2" in wrong["detail"]


@pytest.mark.parametrize("way", WAYS)
def test_a_single_node_hgx_skips_the_domain_saying_why(nvml_fake_lib, tmp_path, setup, way):
    report = _check(tmp_path, setup, SCENARIOS / "hgx-b200-single-node.yaml", way)
    domain = [r for r in _fabric(report) if r["target"] == "node"]
    assert [(r["metric"], r["status"]) for r in domain] == [("nvlink_domain", "skip")]
    assert "single-node NVSwitch" in domain[0]["detail"]
    assert "zero ClusterUUID" in domain[0]["detail"]
    assert not [r for r in _fabric(report) if r["metric"] == "fabric_clique"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("vm", sorted(VMS))
def test_a_pass_through_vm_without_nvlink_shows_every_fabric_judgment_as_a_skip(
    nvml_fake_lib, tmp_path, setup, vm, way
):
    scenario = VMS[vm]
    if not scenario.is_file():
        pytest.skip(f"the real capture is not here: {scenario}")
    report = _check(tmp_path, setup, scenario, way)
    fabric = _fabric(report)
    assert fabric and all(r["status"] == "skip" for r in fabric), fabric
    assert "NVLinks are not exposed to this host" in fabric[0]["detail"]
    assert "pass_through" in fabric[0]["detail"]
    states = [r for r in report["results"] if r["metric"] == "nvlink_state"]
    assert states and all(r["evidence"]["nvlink"] == "hidden" for r in states)


@pytest.mark.parametrize("way", WAYS)
def test_the_inventory_carries_the_domain_and_each_gpus_fabric(nvml_fake_lib, tmp_path, setup, way):
    config, _suite = setup
    scenario = SCENARIOS / "gb200-wrong-clique.yaml"
    inventory = _run(tmp_path, ["inventory", "--json", "--config", str(config)], scenario, way)
    assert inventory["nvlink_domain"] == {
        "cluster_uuid": "6a1c2e8f-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
        "clique_id": 2,
    }
    fabrics = [gpu["fabric"] for gpu in inventory["gpus"]]
    assert [f["clique_id"] for f in fabrics] == [5, 2, 2, 2]
    assert fabrics[1] == {
        "state": "completed",
        "status": "Success",
        "cluster_uuid": "6a1c2e8f-3b4d-4e5f-8a9b-0c1d2e3f4a5b",
        "clique_id": 2,
        "health": [],
    }


def test_a_gpu_without_a_fabric_has_a_null_domain_and_fabric(nvml_fake_lib, tmp_path, setup):
    config, _suite = setup
    inventory = _run(
        tmp_path,
        ["inventory", "--json", "--config", str(config)],
        SCENARIOS / "healthy-h100.yaml",
        "stand-in",
    )
    assert inventory["nvlink_domain"] is None
    assert all(gpu["fabric"] is None for gpu in inventory["gpus"])


def test_a_domain_the_operator_declares_is_the_one_each_gpu_is_held_to(tmp_path, setup):
    config, _suite = setup
    declared = {"cluster_uuid": "6a1c2e8f-3b4d-4e5f-8a9b-0c1d2e3f4a5b", "clique_id": 3}
    suite = tmp_path / "declared.yaml"
    checks = [
        {**c, "params": declared} if c["check"] == "nvlink_fabric" else c for c in SUITE["checks"]
    ]
    suite.write_text(yaml.safe_dump({**SUITE, "checks": checks}))
    argv = ["check", "--json", "--config", str(config), "--suite", str(suite)]
    argv += ["--out", str(tmp_path / "out")]
    report = _run(tmp_path, argv, SCENARIOS / "healthy-gb200-186gb.yaml", "simulate")
    assert report["grade"]["level"] == "ERROR"
    wrong = [r for r in _fabric(report) if r["status"] == "fail"]
    assert {r["target"] for r in wrong} == {f"gpu:{i}" for i in range(4)}
    assert all("suite's params" in r["detail"] and "clique 3" in r["detail"] for r in wrong)


def test_the_stand_in_answers_the_older_call_for_a_driver_without_the_versioned_one(
    nvml_fake_lib, tmp_path, setup
):
    """nvidia-ml-py's c_nvmlGpuFabricInfo_t through the stand-in's nvmlDeviceGetGpuFabricInfo:
    the domain is read, the health (the versioned struct's) is a skip saying why."""
    from node_agent.hardware.sku import load_skus
    from node_agent.sim.nvml_state import Switch, render
    from node_agent.sim.scenario import load_scenario

    skus = load_skus(harness.REPO / "graders")
    scenario = load_scenario(SCENARIOS / "healthy-gb200-186gb.yaml", skus)
    state = tmp_path / "state.txt"
    state.write_text(
        render(scenario, skus[scenario.sku], [Switch("absent", "nvmlDeviceGetGpuFabricInfoV")])
    )
    config, suite = setup
    argv = [sys.executable, "-m", "node_agent.commands.main", "check", "--json"]
    argv += ["--config", str(config), "--suite", str(suite), "--out", str(tmp_path / "out")]
    env = harness.agent_env(state=state)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    report = json.loads(proc.stdout)
    assert report["grade"]["level"] == "HEALTHY", report["grade"]
    by = {(r["target"], r["metric"]): r for r in _fabric(report)}
    assert by[("node", "nvlink_domain")]["value"] == 2
    health = by[("gpu:0", "fabric_health")]
    assert health["status"] == "skip" and "no fabric health" in health["detail"]
