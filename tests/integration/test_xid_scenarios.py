"""Raw kernel-log lines through the real entry point: ``node-agent check --simulate``.

Each scenario writes real-format driver lines into the simulated node's kernel log
(``{kind: kernel_log, gpu: N, line: ...}``, ``{bus}`` = GPU N's bus as the kernel prints it);
parsing, folding, the XID/SXid catalogs, grading and the exit code are the real code. The lines
are copied from real logs (../shared/realworld/xid/x05, x04, x19) with only the bus replaced.
"""

from __future__ import annotations

import os

import pytest

NONFATAL_149 = (
    "[171167.620236] NVRM: Xid (PCI:{bus}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
    "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)"
)
FATAL_149 = (
    "[171167.969026] NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
    "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
)


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
    faults = [
        {"kind": "kernel_log", "gpu": 2, "line": NONFATAL_149},
        {"kind": "kernel_log", "gpu": 2, "line": FATAL_149},
    ]
    run = agent("check", "--simulate", gb200(scenario, faults), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert (report["grade"]["level"], report["grade"]["action"]) == ("ERROR", "restart")
    (reason,) = xid_reasons(report)
    assert reason["target"] == "gpu:2" and "NETIR_LINK_EVT Fatal -> RESET_GPU" in reason["message"]


def test_xid79_fallen_off_bus_without_xid_line_is_read_when_the_driver_did_not_load(
    agent, scenario
):
    """realworld/xid/x19: the GPU fell off the bus during the driver's probe; NVML never loads.
    The line is still read and graded: an ERROR (RESTART_BM), drained and rebooted first."""
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU {bus}.0",
        "               NVRM: (PCI ID: 10de:2901) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
    ]
    faults = [{"kind": "kernel_log", "gpu": 5, "line": line} for line in lines]
    run = agent("check", "--simulate", scenario(faults, driver="not_loaded"), "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "ERROR"
    (reason,) = [r for r in xid_reasons(report) if r["level"] == "ERROR"]
    assert "[Xid 79: GPU has fallen off the bus]" in reason["message"]
    assert "without an Xid line" in reason["message"]


@pytest.mark.parametrize(
    "line, level, code",
    [
        (
            "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
            "ERROR",
            3,
        ),
        (
            "[73309.599396] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20001, Non-fatal, Link 04 TX Replay Error",
            "WARN",
            0,
        ),
    ],
)
def test_sxid_line_grades_its_nvswitch_per_the_catalog(agent, scenario, line, level, code):
    run = agent("check", "--simulate", scenario([{"kind": "kernel_log", "line": line}]), "--json")
    assert run.code == code, run.stderr
    report = run.json()
    (reason,) = xid_reasons(report)
    assert (reason["target"], reason["level"], report["grade"]["level"]) == (
        "nvswitch:1",
        level,
        level,
    )


# -- the driver's lines without an Xid, and PCIe AER (graders/driver_lines.yaml) --------------
# Forms from NVIDIA's open kernel module (open-gpu-kernel-modules: nvstatuscodes.h for the
# NV_ERR_* names and strings, NV_ASSERT_OK/NV_CHECK_OK's "Assertion failed: <string> [<name>]
# (0x%08x)", osinit.c's "RmInitAdapter failed! (0x%x:0x%x:%d)" under "NVRM: GPU <bdf>:") as
# realworld/xid/x11 and x18 show them, and Linux's drivers/pci/pcie/aer.c ("PCIe Bus Error:
# severity=Uncorrected (Fatal)") and err.c ("AER: device recovery failed").
RESET_REQUIRED = (
    "[ 921.622] NVRM: GPU {bus}.0: nvAssertOkFailedNoLog: Assertion failed: Reset "
    "required [NV_ERR_RESET_REQUIRED] (0x00000062) returned from status @ "
    "kernel_channel.c:2874"
)
INIT_FAILED = "[  218.250408] NVRM: GPU {bus}.0: RmInitAdapter failed! (0x24:0x72:1568)"
GPU_LOST = (
    "[ 4123.3] NVRM: GPU {bus}.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the "
    "bus [NV_ERR_GPU_IS_LOST] (0x0000000F) returned from pRmApi->Control"
)
AER_ERROR = (
    "[ 3182.43] nvidia {bus}.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
    "type=Transaction Layer, (Receiver ID)"
)
AER_FAILED = "[ 3182.67] pcieport 0000:17:00.0: AER: device recovery failed"


@pytest.mark.parametrize(
    "lines, metric, level, code",
    [
        ([RESET_REQUIRED], "recovery_action", "ERROR", 3),
        ([INIT_FAILED, INIT_FAILED], "driver_init_failed", "ERROR", 3),
        ([GPU_LOST], "gpu_lost", "ERROR", 3),
        ([AER_ERROR, AER_FAILED], "pcie_aer_recovery_failed", "ERROR", 3),
        ([AER_ERROR], "pcie_aer_uncorrectable", "WARN", 0),
    ],
    ids=["reset-required", "init-failed", "gpu-lost", "aer-recovery-failed", "aer-recovered"],
)
def test_driver_line_without_an_xid_grades_the_gpu_it_names(
    agent, scenario, lines, metric, level, code
):
    faults = [{"kind": "kernel_log", "gpu": 3, "line": line} for line in lines]
    run = agent("check", "--simulate", scenario(faults), "--json")
    assert run.code == code, run.stderr
    report = run.json()
    assert report["grade"]["level"] == level
    assert [r["target"] for r in report["grade"]["reasons"] if r["level"] == level] == ["gpu:3"]
    (finding,) = [r for r in report["results"] if r["check"] == "xid" and r["metric"] == metric]
    assert (finding["target"], finding["value"]) == (
        "gpu:3",
        len(lines) if metric != "pcie_aer_recovery_failed" else 1,
    )
    assert finding["evidence"]["pci_bus"] and "stand-in node" in finding["evidence"]["bus_ids"]


# -- no test reads the host's kernel log -------------------------------------------------------


def test_cli_agent_reads_the_kernel_log_its_test_owns(agent, owned_kernel_log):
    """The ``agent`` subprocess (its own --config, no kernel_log.path) reads the test's file,
    not this host's /dev/kmsg: a line written there is what the xid check reports."""
    owned_kernel_log.write_text(
        "[ 4123.331842] NVRM: Xid (PCI:0000:3b:00): 13, pid=7, "
        "name=python3, Graphics SM Warp Exception\n"
    )
    run = agent("accept", "--json", "--only", "xid")
    report = run.json()
    (xid,) = [r for r in report["results"] if r["metric"] == "xid" and r["status"] == "fail"]
    assert (xid["target"], xid["value"]) == ("pci:0000:3b:00", 13)
    assert xid["evidence"]["sources"] == [str(owned_kernel_log)]


def test_config_kernel_log_path_wins_over_the_test_default(agent, tmp_path):
    own = tmp_path / "kern.log"
    own.write_text("NVRM: Xid (PCI:0000:5d:00): 13, pid=7, name=x, Graphics Exception\n")
    config = tmp_path / "own-config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\nkernel_log:\n  path: {own}\n")
    report = agent("accept", "--json", "--only", "xid", "--config", str(config)).json()
    (xid,) = [r for r in report["results"] if r["metric"] == "xid" and r["status"] == "fail"]
    assert xid["evidence"]["sources"] == [str(own)] and xid["target"] == "pci:0000:5d:00"


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership rule applies to an agent run as root")
def test_a_kernel_log_file_others_can_write_is_refused(agent, tmp_path):
    own = tmp_path / "kern.log"
    # a FAULT were the line believed
    own.write_text("NVRM: Xid (PCI:0000:5d:00): 64, pid=7, Row remapper failure\n")
    own.chmod(0o666)
    config = tmp_path / "own-config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\nkernel_log:\n  path: {own}\n")
    report = agent("accept", "--json", "--only", "xid", "--config", str(config)).json()
    assert report["grade"]["level"] != "FAULT"
    (error,) = [r for r in report["results"] if r["metric"] == "kernel_log"]
    assert error["status"] == "error" and "writable by others" in error["detail"]


def test_in_process_reader_of_the_host_kernel_log_fails_the_test():
    from node_agent.kernel_log import KmsgKernelLog

    with pytest.raises(pytest.fail.Exception, match="host's kernel log"):
        KmsgKernelLog("/dev/kmsg").read()
