"""The whole path from (simulated) hardware to verdict, through the real `node-agent` command.

Each fault kind of a scenario is injected at the hardware boundary (what NVML and the kernel
log report); checks, grading and the CLI above it are the real code.

A healthy node runs the shipped delivery suite as it ships, but for the stand-in burns' longer
bounds on a hang (``tests/delivery_suite.py``: other tests run at once): one run that other
modules' tests read too (``healthy_delivery``, tests/conftest.py). A faulty node's
delivery runs, which are about grading, run it with a shorter stand-in burn
(``short_burn_suite``); the tests that read the same faulty node's report share one run
(``several_faults``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from delivery_suite import (  # tests/delivery_suite.py
    HEALTHY_DELIVERY,
    PATIENT_AGENT_TIMEOUT_S,
    delivery_suite,
)

REPO = Path(__file__).resolve().parents[2]


def reasons(report, level=None):
    return [r for r in report["grade"]["reasons"] if level is None or r["level"] == level]


def short_burn_suite(directory: Path) -> str:
    """The delivery suite with a 1 s stand-in burn instead of 6 s: for delivery runs that test
    something other than the burn (docs/load_tests.md has the burn's own tests)."""
    return delivery_suite(directory, burn_s=1)


@HEALTHY_DELIVERY
def test_healthy_h100_node_grades_healthy_at_delivery(healthy_delivery):
    run = healthy_delivery
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"] == {"level": "HEALTHY", "action": "none", "reasons": []}
    assert report["simulated"] is True
    assert len(report["gpus"]) == 8
    assert not [r for r in report["results"] if r["status"] in ("fail", "error", "warn")]
    shipped = yaml.safe_load((REPO / "suites" / "delivery.yaml").read_text())
    assert {r["check"] for r in report["results"]} == {c["check"] for c in shipped["checks"]}


def test_quick_check_on_healthy_node_exits_0(agent, scenario):
    run = agent("check", "--simulate", scenario(), "--json")
    assert run.code == 0, run.stderr
    assert run.json()["suite"] == "quick"


def test_xid79_grades_error_for_a_reboot_naming_gpu_and_code(agent, scenario):
    """The quick suite: an Xid 79 alone is the one reason, an ERROR (the catalog's RESTART_BM:
    drained and rebooted, replaced only if it falls off again). (The several-faults delivery
    run below has it too, among others: the delivery suite grades it the same.)"""
    run = agent("check", "--simulate", scenario([{"kind": "xid", "gpu": 5, "code": 79}]), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "ERROR"
    assert report["grade"]["action"] == "restart"
    (reason,) = reasons(report)
    assert reason["target"] == "gpu:5"
    assert "Xid 79" in reason["message"]


@pytest.mark.parametrize(
    "fault, rule, graded",
    [
        ({"kind": "row_remap_failure", "gpu": 2}, "row-remap-failure", (4, "FAULT", "replace")),
        # off the bus: rebooted first (Xid 79's RESTART_BM), replaced if it stays gone
        ({"kind": "missing_gpu", "gpu": 7}, "gpu-missing", (3, "ERROR", "restart")),
        ({"kind": "gpu_lost", "gpu": 3}, "gpu-lost", (3, "ERROR", "restart")),
    ],
)
def test_hardware_faults_grade_with_their_action(agent, scenario, fault, rule, graded):
    run = agent("check", "--simulate", scenario([fault]), "--json")
    code, level, action = graded
    assert run.code == code, run.stderr
    report = run.json()
    assert (report["grade"]["level"], report["grade"]["action"]) == (level, action)
    fired = {r["rule"]: r for r in reasons(report, level)}
    assert rule in fired, fired
    expected_target = "node" if fault["kind"] == "missing_gpu" else f"gpu:{fault['gpu']}"
    assert fired[rule]["target"] == expected_target


def test_missing_gpu_reason_says_how_many_are_visible(agent, scenario):
    report = agent(
        "check", "--simulate", scenario([{"kind": "missing_gpu", "gpu": 7}]), "--json"
    ).json()
    (reason,) = reasons(report, "ERROR")
    assert "7 of 8" in reason["message"]


@pytest.mark.parametrize(
    "fault, rule",
    [
        ({"kind": "row_remap_pending", "gpu": 2}, "row-remap-pending"),
        ({"kind": "recovery_action", "gpu": 1, "action": "gpu_reset"}, "recovery-action"),
    ],
)
def test_recoverable_states_grade_error_with_restart(agent, scenario, fault, rule):
    run = agent("check", "--simulate", scenario([fault]), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "ERROR"
    assert report["grade"]["action"] == "restart"
    assert [r["rule"] for r in reasons(report)] == [rule]
    assert reasons(report)[0]["target"] == f"gpu:{fault['gpu']}"


def test_temperature_above_slowdown_warns_with_the_threshold(agent, scenario):
    run = agent(
        "check",
        "--simulate",
        scenario([{"kind": "temperature", "gpu": 0, "celsius": 91}]),
        "--json",
    )
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "WARN"
    (reason,) = reasons(report)
    assert reason["target"] == "gpu:0"
    assert "90 °C" in reason["message"] and "91 °C" in reason["message"]


def test_temperature_at_shutdown_threshold_is_fault(agent, scenario):
    run = agent("check", "--simulate", scenario([{"kind": "temperature", "gpu": 0, "celsius": 93}]))
    assert run.code == 4


def test_hw_slowdown_throttle_warns_naming_the_reason(agent, scenario):
    report = agent(
        "check",
        "--simulate",
        scenario([{"kind": "throttle", "gpu": 2, "reasons": ["hw_slowdown"]}]),
        "--json",
    ).json()
    assert report["grade"]["level"] == "WARN"
    (reason,) = reasons(report)
    assert reason["target"] == "gpu:2" and "hw_slowdown" in reason["message"]


@pytest.fixture(scope="module")
def several_faults(module_agent):
    """One delivery run of a node with four faults, its report saved under ``--out``: (the run,
    the reports directory)."""
    faults = [
        {"kind": "xid", "gpu": 5, "code": 64},
        {"kind": "row_remap_pending", "gpu": 2},
        {"kind": "temperature", "gpu": 0, "celsius": 91},
        {"kind": "ecc_dbe_volatile", "gpu": 1, "count": 1},
    ]
    node = module_agent.home / "several-faults.yaml"
    node.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults}))
    out = module_agent.home / "reports"
    run = module_agent(
        "accept",
        "--simulate",
        str(node),
        "--suite",
        short_burn_suite(module_agent.home),
        "--out",
        str(out),
        "--json",
        timeout=PATIENT_AGENT_TIMEOUT_S,
    )
    return run, out


# the readers of the module's one ``several_faults`` run: on one xdist worker, so it runs once
SEVERAL_FAULTS = pytest.mark.xdist_group("cli_simulated_several_faults")


@SEVERAL_FAULTS
def test_several_faults_worst_decides_and_every_fault_is_a_reason(several_faults):
    run, _ = several_faults
    assert run.code == 4, run.stderr
    report = run.json()
    found = {(r["target"], r["level"]) for r in reasons(report)}
    assert found == {("gpu:5", "FAULT"), ("gpu:1", "ERROR"), ("gpu:2", "ERROR"), ("gpu:0", "WARN")}
    assert any("Xid 64" in r["message"] for r in reasons(report) if r["target"] == "gpu:5")
    levels = [r["level"] for r in reasons(report)]
    assert levels == sorted(levels, key=["FAULT", "ERROR", "WARN"].index), "worst first"


def test_application_xid_13_warns_and_does_not_drain(agent, scenario):
    run = agent("check", "--simulate", scenario([{"kind": "xid", "gpu": 0, "code": 13}]), "--json")
    assert run.code == 0
    assert run.json()["grade"] == {**run.json()["grade"], "level": "WARN", "action": "none"}


def test_a_hung_driver_grades_error_and_the_run_goes_on(agent, scenario):
    run = agent(
        "check", "--json", "--simulate", scenario([{"kind": "driver_hang", "gpu": 3}]), timeout=60
    )
    assert run.code == 3, run.stderr
    report = run.json()
    hung = [r for r in report["results"] if r["metric"] == "driver_hang"]
    assert hung and all(r["status"] == "error" for r in hung)
    quick = yaml.safe_load((REPO / "suites" / "quick.yaml").read_text())
    assert {r["check"] for r in report["results"]} == {c["check"] for c in quick["checks"]}
    assert report["grade"]["level"] == "ERROR"
    assert {r["rule"] for r in report["grade"]["reasons"]} == {"driver-hang"}


def test_human_summary_lists_findings_and_verdict(agent, scenario):
    run = agent("check", "--simulate", scenario([{"kind": "pcie_width", "gpu": 4, "lanes": 8}]))
    assert run.code == 3
    assert "grade: ERROR" in run.stdout and "x8 of x16" in run.stdout
    assert "report: " in run.stderr


def test_only_runs_the_named_checks(agent, scenario):
    report = agent("accept", "--only", "xid", "--simulate", scenario(), "--json").json()
    assert {r["check"] for r in report["results"]} == {"xid"}


@SEVERAL_FAULTS
def test_report_is_written_to_out_and_regrades_identically(module_agent, several_faults):
    run, out = several_faults
    assert run.code == 4, run.stderr
    (saved,) = out.glob("report-*.json")
    assert json.loads(saved.read_text()) == run.json()
    regrade = module_agent("grade", str(saved), "--json")
    assert regrade.code == 4, regrade.stderr
    assert regrade.json()["grade"] == run.json()["grade"]


def test_grade_refuses_a_report_of_another_schema(agent, tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": "node-agent.report/0", "results": []}))
    run = agent("grade", str(path))
    assert run.code == 2
    assert "node-agent.report/0" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_grade_of_a_truncated_report_is_a_clear_error(agent, tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('{"schema": "node-agent.report/1", "resu')
    run = agent("grade", str(path))
    assert run.code == 2 and "truncated" in run.stderr


def test_inventory_of_simulated_node_lists_gpus(agent, scenario):
    run = agent("inventory", "--json", "--simulate", scenario(gpus=4))
    assert run.code == 0
    data = run.json()
    assert [g["index"] for g in data["gpus"]] == [0, 1, 2, 3]
    assert data["sku"] == "h100-sxm5-80gb"
    assert all(g["uuid"].startswith("GPU-") for g in data["gpus"])


# -- the PCI bus against NVML (driver not loaded, a GPU the driver lost) ------------------------

LIGHT = ("--only", "inventory,nvml_health,xid")


@pytest.mark.parametrize("state", ["not_loaded", "not_installed"])
def test_gpus_on_the_bus_without_a_driver_grade_error_at_delivery_naming_what_to_do(
    agent, scenario, state
):
    run = agent("accept", "--simulate", scenario(sku="l40s-48gb", driver=state), *LIGHT, "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "ERROR"
    assert {r["rule"] for r in reasons(report)} == {"driver-not-loaded"}
    detail = next(
        r["detail"]
        for r in report["results"]
        if r["check"] == "nvml_health" and r["metric"] == "driver_not_loaded"
    )
    assert "8 NVIDIA GPU(s) on the PCI bus" in detail and "0000:18:00.0" in detail
    for advice in ("nvidia.ko", "dmesg | grep -i nvrm", "dkms", "modprobe nvidia"):
        assert advice in detail
    assert not [r for r in report["results"] if r["status"] == "skip"]


def test_gpus_on_the_bus_without_a_driver_grade_error_in_service_too(agent, scenario):
    run = agent("check", "--simulate", scenario(driver="not_loaded"), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["mode"] == "service" and report["grade"]["level"] == "ERROR"
    assert "driver-not-loaded" in {r["rule"] for r in reasons(report)}


def test_inventory_without_a_driver_lists_the_gpus_on_the_bus(agent, scenario):
    run = agent("inventory", "--json", "--simulate", scenario(gpus=4, driver="not_loaded"))
    assert run.code == 0, run.stderr
    data = run.json()
    assert data["gpus"] == [] and "not loaded" in data["unavailable_reason"]
    assert [(g["bus_id"], g["driver"]) for g in data["pci"]["gpus"]] == [
        ("0000:18:00.0", None),
        ("0000:2a:00.0", None),
        ("0000:3a:00.0", None),
        ("0000:5d:00.0", None),
    ]


def test_a_gpu_on_the_bus_but_not_in_nvml_is_an_error_naming_its_bus_id(agent, scenario):
    """Never HEALTHY; drained and restarted first ("RmInitAdapter failed" after a warm reboot
    comes back after a power cycle), replaced only if it stays after its restarts."""
    run = agent(
        "accept", "--simulate", scenario(faults=[{"kind": "pci_only", "gpu": 3}]), *LIGHT, "--json"
    )
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["action"] == "restart"
    [finding] = [r for r in reasons(report) if r["rule"] == "gpu-not-enumerated"]
    assert finding["level"] == "ERROR" and finding["target"] == "pci:0000:5d:00.0"
    assert "0000:5d:00.0" in finding["message"]


@pytest.mark.parametrize("driver", ["vfio-pci", "nvgrace_gpu_vfio_pci"])
def test_a_gpu_handed_to_a_vm_is_neither_missing_nor_lost(agent, scenario, driver):
    """vfio-pci, or a VFIO variant driver (Grace's): the VM's GPU, not a GPU the host lost."""
    run = agent(
        "accept",
        "--simulate",
        scenario(faults=[{"kind": "pci_only", "gpu": 7, "driver": driver}]),
        *LIGHT,
        "--json",
    )
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "HEALTHY", reasons(report)
    count = next(r for r in report["results"] if r["metric"] == "gpu_count")
    assert "7 of 7" in count["detail"] and "handed to a VM" in count["detail"]


def test_a_gpu_another_driver_holds_is_a_software_error_never_a_replacement(agent, scenario):
    run = agent(
        "accept",
        "--simulate",
        scenario(faults=[{"kind": "pci_only", "gpu": 3, "driver": "nouveau"}]),
        *LIGHT,
        "--json",
    )
    assert run.code == 3, run.stderr
    report = run.json()
    [finding] = [r for r in reasons(report) if r["target"] == "pci:0000:5d:00.0"]
    assert (finding["rule"], finding["level"], finding["remedy"]) == (
        "gpu-bound-to-another-driver",
        "ERROR",
        "software",
    )
    assert "nouveau" in finding["message"] and report["grade"]["action"] != "replace"
    count = next(r for r in report["results"] if r["metric"] == "gpu_count")
    assert count["status"] == "warn" and "held by another driver" in count["detail"]


# -- raw kernel-log lines ------------------------------------------------------------------------


def test_a_raw_kernel_log_line_reaches_the_xid_check_with_the_gpus_bus_id(agent, scenario):
    line = "NVRM: Xid (PCI:{bus}): 79, pid=1234, GPU has fallen off the bus."
    run = agent(
        "accept",
        "--simulate",
        scenario(faults=[{"kind": "kernel_log", "gpu": 2, "line": line}]),
        *LIGHT,
        "--json",
    )
    assert run.code == 3, run.stderr
    xid = [r for r in reasons(run.json(), "ERROR") if r["rule"] == "xid"]
    assert [r["target"] for r in xid] == ["gpu:2"]


def test_a_kernel_log_line_with_bus_but_no_gpu_is_a_clear_config_error(agent, scenario):
    path = scenario(faults=[{"kind": "kernel_log", "line": "NVRM: Xid (PCI:{bus}): 79"}])
    run = agent("accept", "--simulate", path)
    assert run.code == 2
    assert "faults[0]" in run.stderr and "{bus}" in run.stderr and "gpu" in run.stderr


# -- SRAM ------------------------------------------------------------------------------------


def test_sram_threshold_exceeded_is_a_fault_and_sram_errors_below_it_warn(agent, scenario):
    run = agent(
        "accept",
        "--simulate",
        scenario(
            faults=[
                {"kind": "ecc_sram_uncorrectable", "gpu": 1, "count": 2, "unit": "sm"},
                {"kind": "ecc_sram_uncorrectable", "gpu": 4, "count": 5},
                {"kind": "sram_threshold_exceeded", "gpu": 4},
            ]
        ),
        *LIGHT,
        "--json",
    )
    assert run.code == 4, run.stderr
    found = {(r["rule"], r["target"], r["level"]) for r in reasons(run.json())}
    assert found == {
        ("sram-threshold-exceeded", "gpu:4", "FAULT"),
        ("ecc-sram-uncorrectable", "gpu:1", "WARN"),
    }


def test_inventory_json_keeps_a_lost_gpu(agent, scenario):
    run = agent(
        "inventory",
        "--json",
        "--simulate",
        scenario(gpus=4, faults=[{"kind": "gpu_lost", "gpu": 2}]),
    )
    assert run.code == 0, run.stderr
    data = run.json()
    assert [g["index"] for g in data["gpus"]] == [0, 1, 3]
    assert [(g["index"], g["status"]) for g in data["unreadable_gpus"]] == [(2, "gpu_lost")]
    text = agent(
        "inventory", "--simulate", scenario(gpus=4, faults=[{"kind": "gpu_lost", "gpu": 2}])
    )
    assert "gpu:2  UNREADABLE (gpu_lost)" in text.stdout
