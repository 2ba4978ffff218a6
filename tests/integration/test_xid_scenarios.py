"""Raw kernel-log lines through the real entry point: ``node-agent check --simulate``.

Each scenario writes real-format driver lines into the simulated node's kernel log
(``{kind: kernel_log, gpu: N, line: ...}``, ``{bus}`` = GPU N's bus as the kernel prints it);
parsing, folding, the XID/SXid catalogs, grading and the exit code are the real code. The lines
are copied from real logs (../shared/realworld/xid/x05, x04, x19) with only the bus replaced.
"""

from __future__ import annotations

import pytest

NONFATAL_149 = ("[171167.620236] NVRM: Xid (PCI:{bus}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
                "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)")
FATAL_149 = ("[171167.969026] NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
             "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")


def gb200(scenario, faults, **extra):
    return scenario(faults, gpus=4, sku="gb200-186gb", **extra)


def xid_reasons(report):
    return [r for r in report["grade"]["reasons"] if r["rule"] in ("xid", "sxid")]


def test_nonfatal_nvlink5_xid149_line_warns_and_exits_0(agent, scenario):
    faults = [{"kind": "kernel_log", "gpu": 1, "line": NONFATAL_149}] * 3
    run = agent("check", "--simulate", gb200(scenario, faults), "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "WARN" and report["grade"]["action"] == "none"
    (reason,) = xid_reasons(report)
    assert reason["target"] == "gpu:1" and reason["level"] == "WARN"
    assert "3 time(s)" in reason["message"]
    assert "NETIR_BER_EVENT Nonfatal -> IGNORE" in reason["message"]


def test_fatal_nvlink5_xid149_line_grades_error_and_exits_3(agent, scenario):
    faults = [{"kind": "kernel_log", "gpu": 2, "line": NONFATAL_149},
              {"kind": "kernel_log", "gpu": 2, "line": FATAL_149}]
    run = agent("check", "--simulate", gb200(scenario, faults), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert (report["grade"]["level"], report["grade"]["action"]) == ("ERROR", "restart")
    (reason,) = xid_reasons(report)
    assert reason["target"] == "gpu:2" and "NETIR_LINK_EVT Fatal -> RESET_GPU" in reason["message"]


def test_xid79_fallen_off_bus_without_xid_line_grades_fault_when_the_driver_did_not_load(
        agent, scenario):
    """realworld/xid/x19: the GPU fell off the bus during the driver's probe; NVML never loads."""
    lines = ["[ 1843.308145] NVRM: The NVIDIA GPU {bus}.0",
             "               NVRM: (PCI ID: 10de:2901) installed in this system has",
             "               NVRM: fallen off the bus and is not responding to commands.",
             "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s)."]
    faults = [{"kind": "kernel_log", "gpu": 5, "line": line} for line in lines]
    run = agent("check", "--simulate", scenario(faults, driver="not_loaded"), "--json")
    assert run.code == 4, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "FAULT"
    (reason,) = [r for r in xid_reasons(report) if r["level"] == "FAULT"]
    assert "[Xid 79: GPU has fallen off the bus]" in reason["message"]
    assert "without an Xid line" in reason["message"]


@pytest.mark.parametrize("line, level, code", [
    ("[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
     "ERROR", 3),
    ("[73309.599396] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20001, Non-fatal, Link 04 TX Replay Error",
     "WARN", 0),
])
def test_sxid_line_grades_its_nvswitch_per_the_catalog(agent, scenario, line, level, code):
    run = agent("check", "--simulate", scenario([{"kind": "kernel_log", "line": line}]), "--json")
    assert run.code == code, run.stderr
    report = run.json()
    (reason,) = xid_reasons(report)
    assert (reason["target"], reason["level"], report["grade"]["level"]) == ("nvswitch:1", level, level)
