"""Host faults of simulated nodes through the real `node-agent` command line.

`--simulate` writes the simulated host (node_agent.sim.host_tools: EDAC, memory blocks, CPUs, a
PCI tree with AER counters, NVMe controllers with an `nvme` stand-in, a BMC with an `ipmitool`
stand-in); the host checks, parsers and grading rules are the real ones. The last test runs the
same checks on this host itself, which (on CI) has no EDAC, BMC or NVMe: each is a skip with its
reason, never a pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HOST_CHECKS = "host_memory,host_power,pcie_aer,nvme_health,host_cpu"
HCAS = ["mlx5_0", "mlx5_1"]


def accept(agent, path, checks=HOST_CHECKS):
    return agent("accept", "--simulate", path, "--only", checks, "--json")


def test_healthy_node_stays_healthy_three_runs_in_a_row(agent, scenario):
    path = scenario(hcas=HCAS)
    for _ in range(3):  # the same state dir: counters compared with the run before
        run = accept(agent, path)
        assert run.code == 0, run.stderr
        report = run.json()
        assert report["grade"]["level"] == "HEALTHY", report["grade"]
        mine = [r for r in report["results"] if r["check"] in HOST_CHECKS.split(",")]
        assert {r["check"] for r in mine} == set(HOST_CHECKS.split(","))
        assert all(r["status"] == "pass" for r in mine), [
            (r["check"], r["metric"], r["status"], r["detail"])
            for r in mine
            if r["status"] != "pass"
        ]


@pytest.mark.parametrize(
    "fault, check, code, level, rule, target",
    [
        (
            {"kind": "edac_ue", "dimm": "CPU1_DIMM_C2"},
            "host_memory",
            4,
            "FAULT",
            "edac-uncorrectable",
            "dimm:CPU1_DIMM_C2",
        ),
        ({"kind": "psu_failed", "psu": "PS3"}, "host_power", 3, "ERROR", "psu-failed", "psu:PS3"),
        (
            {"kind": "aer", "gpu": 2, "severity": "fatal"},
            "pcie_aer",
            3,
            "ERROR",
            "pcie-aer-fatal",
            "gpu:2",
        ),
        (
            {"kind": "nvme_critical_warning", "disk": "nvme1"},
            "nvme_health",
            0,
            "WARN",
            "nvme-critical-warning",
            "disk:nvme1",
        ),
    ],
)
def test_host_fault_grades_and_names_the_device(
    agent, scenario, fault, check, code, level, rule, target
):
    run = accept(agent, scenario([fault], hcas=HCAS), check)
    assert run.code == code, run.stderr
    grade = run.json()["grade"]
    assert grade["level"] == level
    worst = [(r["rule"], r["target"]) for r in grade["reasons"] if r["level"] == level]
    assert worst == [(rule, target)], grade["reasons"]


def test_missing_memory_ce_rate_throttling_and_hca_aer_each_named(agent, scenario):
    faults = [
        {"kind": "memory_missing", "gib": 64},
        {"kind": "edac_ce", "dimm": "CPU0_DIMM_A1", "count": 40},
        {"kind": "cpu_throttle", "count": 3},
        {"kind": "aer", "hca": "mlx5_1", "severity": "nonfatal", "bridge": True},
    ]
    run = accept(agent, scenario(faults, hcas=HCAS), "host_memory,pcie_aer,host_cpu")
    assert run.code == 4, run.stderr
    grade = run.json()["grade"]
    assert grade["level"] == "FAULT"
    assert {(r["rule"], r["level"], r["target"]) for r in grade["reasons"]} == {
        ("memory-missing", "FAULT", "node"),
        ("edac-correctable-rate", "WARN", "dimm:CPU0_DIMM_A1"),
        ("cpu-thermal-throttle", "WARN", "node"),
        ("pcie-aer-nonfatal", "WARN", "hca:mlx5_1"),
    }


def test_psu_failure_also_degrades_redundancy(agent, scenario):
    run = accept(agent, scenario([{"kind": "psu_failed", "psu": "PS3"}]), "host_power")
    reasons = {(r["rule"], r["target"]) for r in run.json()["grade"]["reasons"]}
    assert reasons == {("psu-failed", "psu:PS3"), ("psu-redundancy-degraded", "node")}


def test_fault_naming_a_dimm_the_node_lacks_is_refused_naming_its_dimms(agent, scenario):
    """The scenario is wrong, not the node: exit 2 before anything runs, naming the DIMMs the
    stand-in has (no check catches the simulator's exception)."""
    run = accept(agent, scenario([{"kind": "edac_ue", "dimm": "DIMM_Z9"}]), "host_memory")
    assert run.code == 2, (run.code, run.stderr)
    assert "DIMM_Z9" in run.stderr and "CPU0_DIMM_A1" in run.stderr, run.stderr


def test_aer_fault_needs_a_gpu_or_an_hca(agent, scenario):
    run = accept(agent, scenario([{"kind": "aer", "severity": "fatal"}]))
    assert run.code == 2 and "faults[0]" in run.stderr


def test_captured_node_skips_host_checks_its_capture_did_not_record(agent):
    real = Path(__file__).resolve().parents[2] / "scenarios" / "real" / "h100-sxm5-vm.yaml"
    run = accept(agent, str(real))
    mine = [r for r in run.json()["results"] if r["check"] in HOST_CHECKS.split(",")]
    assert len(mine) == 5 and all(
        r["status"] == "skip" and "not recorded" in r["detail"] for r in mine
    )


def _host_has(path: str) -> bool:
    try:
        return bool(os.listdir(path))
    except OSError:
        return False


@pytest.mark.skipif(
    _host_has("/sys/devices/system/edac/mc")
    or _host_has("/sys/class/nvme")
    or any(Path(p).exists() for p in ("/dev/ipmi0", "/dev/ipmi/0", "/dev/ipmidev/0")),
    reason="this host has EDAC, NVMe or a BMC: its checks read real hardware",
)
def test_host_without_edac_ipmi_or_nvme_skips_each_with_its_reason(agent):
    run = agent("accept", "--only", "host_memory,host_power,nvme_health", "--json")
    assert run.code == 0, run.stderr
    results = {(r["check"], r["metric"]): r for r in run.json()["results"]}
    edac = results[("host_memory", "edac")]
    assert edac["status"] == "skip" and "EDAC" in edac["detail"]
    psu = results[("host_power", "psu")]
    assert psu["status"] == "skip" and ("ipmitool" in psu["detail"] or "BMC" in psu["detail"])
    disk = results[("nvme_health", "nvme")]
    assert disk["status"] == "skip" and "no NVMe controller" in disk["detail"]
    assert not [
        r
        for r in run.json()["results"]
        if r["check"] in ("host_memory", "host_power", "nvme_health") and r["status"] == "pass"
    ]


def test_a_firmware_reported_uncorrected_memory_error_names_its_dimm(agent, scenario):
    """The kernel log of a firmware-first host (APEI GHES, a recoverable memory error on slot B1,
    as kubernetes/node-problem-detector PR 846 shows the kernel printing it): ERROR naming the
    DIMM, read beside EDAC (which the simulated host has, with no error counted)."""
    lines = (
        "[ 812.1] {3}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 4",
        "[ 812.1] {3}[Hardware Error]: event severity: recoverable",
        "[ 812.1] {3}[Hardware Error]:  Error 0, type: recoverable",
        "[ 812.1] {3}[Hardware Error]:  fru_text: B1",
        "[ 812.1] {3}[Hardware Error]:   section_type: memory error",
    )
    faults = [{"kind": "kernel_log", "line": line} for line in lines]
    run = accept(agent, scenario(faults, hcas=HCAS), "host_memory")
    assert run.code == 3, run.stderr
    grade = run.json()["grade"]
    assert grade["level"] == "ERROR"
    assert [r["target"] for r in grade["reasons"] if r["level"] == "ERROR"] == ["dimm:B1"]
