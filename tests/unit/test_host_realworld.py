"""The host checks on real output other people published (tests/data/realworld/<class>/).

Each sample is run through the agent's own path (the check on a tree and a tool stand-in that
prints the sample, or the parser) and graded by the shipped rules; the level asserted is the
oracle in the folder's PROVENANCE.md, which says where each sample comes from. No NVMe drive,
BMC or firmware error source can run here, so the tools are stand-in scripts that print the
published output, and the kernel log is the published lines.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from node_agent import resources
from node_agent.checks import host_cpu, host_memory, host_power, nvme_health, pcie_aer
from node_agent.checks.host_power.sel import sel_results
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.kernel_log import LinesKernelLog
from node_agent.model import Level, Status
from node_agent.parsers.ipmitool import judge_psus, parse_sdr
from node_agent.parsers.sel import parse_sel
from tests.unit.test_host_checks import PS_OK, ipmitool, make_ctx, nvme_tree, pci_device, tool

DATA = Path(__file__).resolve().parents[1] / "data" / "realworld"
GRADER = load_grader(resources.graders_dir(config_from_dict({})))


def level(results) -> Level:
    return GRADER.grade(results).level


def names(folder: str) -> list[str]:
    return sorted(p.name for p in (DATA / folder).iterdir() if p.name != "PROVENANCE.md")


# -- NVMe health through smartctl -x -j, where nvme-cli is absent --------------------------------

#: sample -> the oracle's level (PROVENANCE.md)
NVME = {
    "s01_scrutiny_intel660p_healthy.json": Level.HEALTHY,
    "s02_scrutiny_mp510_healthy_err-log-entries.json": Level.HEALTHY,
    "s03_scrutiny_970evo_media-errors-7.json": Level.WARN,
    "s04_nasty_kingston-snv3s_healthy_null-sensor.json": Level.HEALTHY,
    "s05_smartmontools-537_pm9a1_used-100_cw-0x04.json": Level.WARN,
}


def smartctl(tmp_path: Path, text: str, code: int = 0) -> str:
    return tool(
        tmp_path,
        "smartctl",
        f"assert sys.argv[1:3] == ['-x', '-j'], sys.argv\nprint({text!r}, end='')\n"
        f"sys.exit({code})\n",
    )


def smartctl_results(tmp_path: Path, text: str, code: int = 0, config: dict | None = None):
    nvme_tree(tmp_path)
    prog = smartctl(tmp_path, text, code)
    ctx = make_ctx(tmp_path, "nvme_health", config, nvme="nvme-not-on-this-host", smartctl=prog)
    return nvme_health.run(ctx)


def test_every_nvme_sample_has_an_oracle():
    assert names("nvme_smartctl") == sorted(NVME)


@pytest.mark.parametrize("name", sorted(NVME))
def test_nvme_sample_read_through_smartctl_grades_as_its_oracle(tmp_path, name):
    results = smartctl_results(tmp_path, (DATA / "nvme_smartctl" / name).read_text())
    assert all(r.evidence.get("read_with") == "smartctl" for r in results), results
    assert not [r for r in results if r.status in (Status.ERROR, Status.SKIP)], results
    assert level(results) is NVME[name]


def test_percentage_used_100_warns_naming_the_rated_endurance(tmp_path):
    text = (DATA / "nvme_smartctl" / NVME_537).read_text()
    (wear,) = [r for r in smartctl_results(tmp_path, text) if r.metric == "wear"]
    assert wear.status is Status.WARN and "rated endurance reached" in wear.detail


NVME_537 = "s05_smartmontools-537_pm9a1_used-100_cw-0x04.json"


def test_spare_below_threshold_in_smartctl_form_grades_error(tmp_path):
    """s01 with its spare run down to 3 % of a 10 % threshold (no public capture of such a drive
    was found): the figure alone is judged, with critical-warning bit 0 left clear."""
    text = (DATA / "nvme_smartctl" / "s01_scrutiny_intel660p_healthy.json").read_text()
    results = smartctl_results(
        tmp_path, text.replace('"available_spare": 100', '"available_spare": 3')
    )
    (spare,) = [r for r in results if r.metric == "available_spare"]
    assert (
        spare.status is Status.FAIL
        and "3 % spare left, below its threshold of 10 %" in spare.detail
    )
    assert level(results) is Level.ERROR


def test_smartctl_exit_status_of_the_disk_state_still_reads_the_log(tmp_path):
    """smartctl exits with bit 3 (DISK FAILING) or bit 6 (error log) set and its JSON whole."""
    text = (DATA / "nvme_smartctl" / NVME_537).read_text()
    results = smartctl_results(tmp_path, text, code=0x08 | 0x40)
    assert level(results) is Level.WARN


def test_smartctl_that_could_not_open_the_device_is_an_error_with_its_words(tmp_path):
    text = (
        '{"smartctl": {"exit_status": 2, "messages": [{"string": "Smartctl open device: '
        '/dev/nvme0 failed: No such device", "severity": "error"}]}}\n'
    )
    (err,) = smartctl_results(tmp_path, text, code=2)
    assert err.status is Status.ERROR and err.metric == "smart_log"
    assert "/dev/nvme0 failed: No such device" in err.detail


# -- PCIe AER from the kernel log, attributed through the PCI tree -----------------------------

#: dmesg -H's relative times ("[  +0.000844]"), which the kernel-log reader's framing does not
#: know yet: taken off here so the messages are read as published
RELATIVE_TIME = re.compile(r"^\[\s*\+\d+\.\d+\] ")


def log_ctx(tmp_path: Path, check: str, lines: list[str], **kwargs):
    ctx = make_ctx(tmp_path, check, **kwargs)
    ctx.kernel_log = LinesKernelLog(lines, source="a published log")
    return ctx


def sample_lines(folder: str, name: str) -> list[str]:
    text = (DATA / folder / name).read_text()
    return [RELATIVE_TIME.sub("", line) for line in text.splitlines()]


#: sample -> (the PCI tree: chains of bdfs, root port first; GPUs (index, NVML bus id);
#:            the oracle's level; the target it names, None for none)
AER = {
    "a01_returnn-1500_gpu-below-root-port_fatal_recovery-failed.log": (
        [("0000:00:03.0", "0000:03:00.0"), ("0000:00:03.0", "0000:03:00.1")],
        [(0, "00000000:03:00.0")],
        Level.ERROR,
        "gpu:0",
    ),
    "a02_minisforum-ms02-ultra-10_xhci-thunderbolt_recovery-failed_syslog.log": (
        [("0000:80:1b.4", "0000:84:00.0"), ("0000:80:1b.4", "0000:97:00.0")],
        [],
        Level.WARN,
        "pci:0000:97:00.0",
    ),
    "a03_geerlingguy-rpi-pcie-600_ahci-below-root_nonfatal_recovery-failed.log": (
        [("0000:00:00.0", "0000:01:00.0")],
        [],
        Level.WARN,
        "pci:0000:01:00.0",
    ),
    "a04_pop-os-751_nvme-corrected-rxerr.log": (
        [("0000:00:1d.0", "0000:03:00.0")],
        [],
        Level.HEALTHY,
        None,
    ),
    "a05_geerlingguy-rpi-pcie-64_jmb585-corrected-at-boot_id-form.log": (
        [("0000:00:1d.0", "0000:02:00.0")],
        [],
        Level.HEALTHY,
        None,
    ),
}


def test_every_aer_sample_has_an_oracle():
    assert names("pcie_aer") == sorted(AER)


@pytest.mark.parametrize("name", sorted(AER))
def test_aer_sample_grades_as_its_oracle_on_a_host_without_aer_counters(tmp_path, name):
    chains, gpus, oracle, target = AER[name]
    for chain in chains:
        pci_device(tmp_path, chain, aer=False)  # firmware-first: no aer_dev_* in sysfs
    ctx = log_ctx(tmp_path, "pcie_aer", sample_lines("pcie_aer", name), gpus=gpus)
    results = pcie_aer.run(ctx)
    assert level(results) is oracle, [(r.target, r.metric, r.status, r.detail) for r in results]
    if target is not None:
        assert target in {r.target for r in results if r.metric == "aer_log_uncorrectable"}


def test_a_gpu_below_a_port_that_failed_recovery_is_named_with_the_port(tmp_path):
    name = "a01_returnn-1500_gpu-below-root-port_fatal_recovery-failed.log"
    chains, gpus, _level, _target = AER[name]
    for chain in chains:
        pci_device(tmp_path, chain, aer=False)
    ctx = log_ctx(tmp_path, "pcie_aer", sample_lines("pcie_aer", name), gpus=gpus)
    (gpu,) = [r for r in pcie_aer.run(ctx) if r.target == "gpu:0"]
    assert gpu.status is Status.FAIL and "pcieport 0000:00:03.0" in gpu.evidence["reported_by"]
    assert gpu.evidence["fatal"] == 1 and "can't recover" in gpu.detail


def test_without_a_pci_tree_the_gpu_is_named_by_its_nvml_bus_id(tmp_path):
    (tmp_path / "sys").mkdir()
    name = "a01_returnn-1500_gpu-below-root-port_fatal_recovery-failed.log"
    ctx = log_ctx(
        tmp_path, "pcie_aer", sample_lines("pcie_aer", name), gpus=[(0, "00000000:03:00.0")]
    )
    results = pcie_aer.run(ctx)
    assert "gpu:0" in {r.target for r in results if r.status is Status.FAIL}
    assert level(results) is Level.ERROR


def test_a_user_line_that_looks_like_aer_is_not_read(tmp_path):
    """A user's program's syslog line, and a segfault report whose process name is AER text:
    the message does not start with the PCI core's own text, so nothing is read."""
    pci_device(tmp_path, ("0000:00:03.0", "0000:03:00.0"), aer=False)
    lines = [
        "Sep 22 09:59:09 pve python3[77]: nvidia 0000:03:00.0: AER: can't recover (no "
        "error_detected callback)",
        "[ 9.1] nvidia 0000:03[4242]: segfault at 0 ip 0 sp 0 error 4 in "
        "pcieport 0000:00:03.0: AER: device recovery failed",
        "[ 9.2] hello pcieport 0000:00:03.0: AER: device recovery failed",
    ]
    ctx = log_ctx(tmp_path, "pcie_aer", lines, gpus=[(0, "00000000:03:00.0")])
    results = pcie_aer.run(ctx)
    assert level(results) is Level.HEALTHY
    assert [r.metric for r in results if r.status is Status.PASS] == ["aer_log"]


def test_corrected_errors_sustained_over_the_rate_warn_on_the_drive(tmp_path):
    pci_device(tmp_path, ("0000:00:1d.0", "0000:03:00.0"), aer=False)
    write_nvme_link(tmp_path, "nvme0", "0000:03:00.0")
    line = (
        "[{t:>11.6f}] nvme 0000:03:00.0: AER: PCIe Bus Error: severity=Corrected, "
        "type=Physical Layer, (Receiver ID)"
    )
    lines = [line.format(t=120.0 + 90.0 * i) for i in range(60)]  # 60 in 1.5 h: 40 an hour
    results = pcie_aer.run(log_ctx(tmp_path, "pcie_aer", lines))
    (rate,) = [r for r in results if r.metric == "aer_log_correctable_rate"]
    assert (rate.target, rate.status) == ("disk:nvme0", Status.WARN)
    assert rate.value == pytest.approx(40.5, abs=0.5)


def write_nvme_link(tmp_path: Path, name: str, bdf: str) -> None:
    ctrl = tmp_path / "sys/class/nvme" / name
    ctrl.mkdir(parents=True)
    (ctrl / "device").symlink_to(tmp_path / "sys/bus/pci/devices" / bdf)


# -- memory errors the firmware reports (APEI GHES), CPU thermal throttling -----------------------

#: sample -> (the oracle's level, the target it names)
GHES = {
    "g01_node-problem-detector-846_corrected_cpu2-dimm30.log": (Level.HEALTHY, None),
    "g02_node-problem-detector-846_recoverable_fru-b1.log": (Level.ERROR, "dimm:B1"),
    "g03_node-exporter-3511_proxmox_corrected_fru-d2.log": (Level.HEALTHY, None),
    "g04_custom-kernel-6_bert-fatal-firmware-record-not-memory.log": (Level.HEALTHY, None),
}
THROTTLE = {
    "t01_throttled-186_x1c6_mce-prefix_dmesg.log": 2675 * 2 + 3654 * 8,
    "t02_multibootusb-164_core-throttle_no-prefix_dmesg.log": 58678 * 2,
}


def test_every_ghes_and_throttle_sample_has_an_oracle():
    assert names("ghes_thermal") == sorted(set(GHES) | set(THROTTLE))


def memory_results(tmp_path: Path, lines: list[str]):
    (tmp_path / "sys").mkdir(exist_ok=True)  # no EDAC: firmware-first
    return host_memory.run(log_ctx(tmp_path, "host_memory", lines))


@pytest.mark.parametrize("name", sorted(GHES))
def test_ghes_sample_grades_as_its_oracle_where_edac_is_absent(tmp_path, name):
    oracle, target = GHES[name]
    results = memory_results(tmp_path, sample_lines("ghes_thermal", name))
    memory = [r for r in results if r.metric not in ("memory_installed", "memory_missing")]
    assert level(memory) is oracle, [(r.target, r.metric, r.status, r.detail) for r in memory]
    if target is not None:
        (ue,) = [r for r in memory if r.metric == "ghes_ue"]
        assert ue.target == target and "recoverable" in ue.detail


def test_the_corrected_record_names_its_dimm_and_stays_under_the_rate(tmp_path):
    lines = sample_lines("ghes_thermal", "g01_node-problem-detector-846_corrected_cpu2-dimm30.log")
    results = memory_results(tmp_path, lines * 11)  # 11 records: over 10 a day
    (rate,) = [r for r in results if r.metric == "ghes_ce_rate"]
    assert (rate.target, rate.status, rate.value) == ("dimm:CPU_2_DIMM_30", Status.WARN, 11)


def test_a_fatal_memory_record_without_a_dimm_is_an_error_on_unplaced_memory(tmp_path):
    lines = [
        "[ 5.1] {9}[Hardware Error]: event severity: fatal",
        "[ 5.1] {9}[Hardware Error]:  Error 0, type: fatal",
        "[ 5.1] {9}[Hardware Error]:  fru_text: CorrectedErr",
        "[ 5.1] {9}[Hardware Error]:   section_type: memory error",
        "[ 5.1] {9}[Hardware Error]:   DIMM location: not present. DMI handle: 0x0021",
    ]
    (ue,) = [r for r in memory_results(tmp_path, lines) if r.metric == "ghes_ue"]
    assert (ue.target, ue.status) == ("memory:ghes", Status.FAIL)


def test_a_user_line_that_looks_like_a_ghes_record_is_not_read(tmp_path):
    lines = [
        "Dec 29 05:24:23 proxmox logger[9]: {3}[Hardware Error]: event severity: fatal",
        "[ 9.1] evil[4242]: segfault at 0 ip 0 in {3}[Hardware Error]:  Error 0, type: fatal",
        "[ 9.2] x {3}[Hardware Error]:   section_type: memory error",
    ]
    results = memory_results(tmp_path, lines)
    assert not [r for r in results if r.metric.startswith("ghes_")]


@pytest.mark.parametrize("name", sorted(THROTTLE))
def test_throttle_lines_warn_where_the_sysfs_counters_are_absent(tmp_path, name):
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    ctx = log_ctx(tmp_path, "host_cpu", sample_lines("ghes_thermal", name))
    results = host_cpu.run(ctx)
    (throttle,) = [r for r in results if r.metric == "cpu_throttle"]
    assert throttle.status is Status.WARN and throttle.value == THROTTLE[name]
    assert throttle.evidence["source"].startswith("kernel log")
    assert level([throttle]) is Level.WARN


def test_no_throttle_line_and_no_counters_is_a_skip_naming_both(tmp_path):
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    lines = sample_lines("ghes_thermal", "g01_node-problem-detector-846_corrected_cpu2-dimm30.log")
    results = host_cpu.run(log_ctx(tmp_path, "host_cpu", lines))
    (throttle,) = [r for r in results if r.metric == "cpu_throttle"]
    assert throttle.status is Status.SKIP and "no therm_throt line" in throttle.detail


def test_no_ghes_record_passes_only_where_the_firmware_has_error_sources(tmp_path):
    lines = sample_lines("ghes_thermal", "t02_multibootusb-164_core-throttle_no-prefix_dmesg.log")
    assert not [r for r in memory_results(tmp_path, lines) if r.metric == "ghes"]
    (tmp_path / "sys/bus/platform/devices/GHES.0").mkdir(parents=True)
    (ghes,) = [r for r in memory_results(tmp_path, lines) if r.metric == "ghes"]
    assert ghes.status is Status.PASS and "1 error source" in ghes.detail


# -- the BMC: power supplies, the Power Unit's redundancy sensor, the event log --------------------


def power_sample(name: str) -> str:
    return (DATA / "ipmi_power" / name).read_text()


def freeipmi(tmp_path: Path, sensors: str, sel: str) -> dict[str, str]:
    """ipmi-sensors and ipmi-sel stand-ins printing published output (no BMC runs here)."""
    sensors_prog = tool(
        tmp_path,
        "ipmi-sensors",
        "assert sys.argv[1:] == ['--sensor-types=Power_Supply,Power_Unit'], sys.argv\n"
        f"sys.stdout.write({sensors!r})\n",
    )
    sel_prog = tool(tmp_path, "ipmi-sel", f"sys.stdout.write({sel!r})\n")
    return {"ipmitool": "ipmitool-not-here", "ipmi_sensors": sensors_prog, "ipmi_sel": sel_prog}


def power_results(tmp_path: Path, **tools: str):
    (tmp_path / "dev").mkdir(exist_ok=True)
    (tmp_path / "dev/ipmi0").write_text("")
    return host_power.run(make_ctx(tmp_path, "host_power", **tools))


EMPTY_FREEIPMI_SEL = "ID | Date | Time | Name | Type | State | Event\n"


def test_redundancy_lost_the_list_view_calls_ok_is_read_from_the_power_unit(tmp_path):
    """ipmitool issue 176: `sdr` says "Pwr Unit Redund | 0x00 | ok"; -v asserts Redundancy Lost."""
    listed = power_sample("p01a_ipmitool-176_sdr-list-view_all-ok.txt")
    rows = parse_sdr(listed)
    assert judge_psus(rows) == ([], [])  # the list view tells nothing either way
    prog = ipmitool(
        tmp_path,
        listed,
        unit=power_sample("p01b_ipmitool-176_verbose_pwr-unit-redundancy-lost.txt"),
    )
    results = power_results(tmp_path, ipmitool=prog)
    (lost,) = [r for r in results if r.metric == "psu_redundancy"]
    assert lost.status is Status.FAIL and lost.evidence["sensor"] == "Pwr Unit Redund"
    assert level(results) is Level.ERROR


def test_a_psu_failure_in_freeipmis_sel_is_an_error_the_day_it_happened(tmp_path):
    events = parse_sel(power_sample("p02_check-ipmi-sensor-66_ipmi-sel_psu2-failure.txt"))
    ctx = make_ctx(tmp_path, "host_power")
    that_night = datetime(2024, 12, 9, 22, 0, tzinfo=timezone.utc)
    (failed,) = sel_results(ctx, events, that_night, "the BMC's clock", 24)
    assert (failed.target, failed.status) == ("psu:PS2", Status.FAIL)
    a_week_on = that_night + timedelta(days=7)
    (old,) = sel_results(ctx, events, a_week_on, "the BMC's clock", 24)
    assert old.status is Status.WARN and "older than 24 h" in old.detail


def test_the_psu_failure_read_through_freeipmi_on_a_later_day_is_history(tmp_path):
    tools = freeipmi(
        tmp_path, "", power_sample("p02_check-ipmi-sensor-66_ipmi-sel_psu2-failure.txt")
    )
    results = power_results(tmp_path, **tools)
    (sel,) = [r for r in results if r.metric == "sel_power"]
    assert sel.status is Status.WARN and sel.evidence["last"].startswith("2024-12-09T21:12:29")
    assert level(results) is Level.WARN


def test_a_sel_of_firmware_progress_only_is_healthy(tmp_path):
    prog = ipmitool(
        tmp_path,
        PS_OK,
        sel=power_sample("p03_op-build-594_ipmitool-sel-list_firmware-progress-only.txt"),
    )
    results = power_results(tmp_path, ipmitool=prog)
    (sel,) = [r for r in results if r.metric == "sel"]
    assert sel.status is Status.PASS and "12 entries" in sel.detail
    assert level(results) is Level.HEALTHY


def test_freeipmi_sensors_of_a_present_supply_and_full_redundancy_are_healthy(tmp_path):
    tools = freeipmi(
        tmp_path,
        power_sample("p04_check-ipmi-sensor-67_ipmi-sensors_psu2-present_fully-redundant.txt"),
        EMPTY_FREEIPMI_SEL,
    )
    results = power_results(tmp_path, **tools)
    assert {(r.target, r.metric, r.status) for r in results} == {
        ("psu:PSU2", "psu_status", Status.PASS),
        ("node", "psu_redundancy", Status.PASS),
        ("node", "sel", Status.PASS),
    }
    assert level(results) is Level.HEALTHY


def test_freeipmi_supplies_without_a_reading_warn(tmp_path):
    """freeipmi-mirror issue 45: HPE's BMC gives no reading for its supplies (one was failing,
    per iLO): the agent cannot tell, so it warns and names them, and never drains on it."""
    tools = freeipmi(
        tmp_path,
        power_sample("p05_freeipmi-mirror-45_hpe-dl360g10_ipmi-sensors-W-discretereading_grep.txt"),
        EMPTY_FREEIPMI_SEL,
    )
    results = power_results(tmp_path, **tools)
    warned = {r.target for r in results if r.status is Status.WARN}
    assert warned == {"psu:Power_Supply_1", "psu:Power_Supply_2"}
    assert level(results) is Level.WARN


def test_every_power_sample_has_a_test():
    assert names("ipmi_power") == sorted(
        [
            "p01a_ipmitool-176_sdr-list-view_all-ok.txt",
            "p01b_ipmitool-176_verbose_pwr-unit-redundancy-lost.txt",
            "p02_check-ipmi-sensor-66_ipmi-sel_psu2-failure.txt",
            "p03_op-build-594_ipmitool-sel-list_firmware-progress-only.txt",
            "p04_check-ipmi-sensor-67_ipmi-sensors_psu2-present_fully-redundant.txt",
            "p05_freeipmi-mirror-45_hpe-dl360g10_ipmi-sensors-W-discretereading_grep.txt",
        ]
    )


def test_the_csv_form_reads_as_the_table_form():
    """``ipmitool -c sel elist`` prints the same fields with commas (no public capture found:
    p03 rewritten as ipmitool's CSV printer writes it)."""
    table = power_sample("p03_op-build-594_ipmitool-sel-list_firmware-progress-only.txt")
    csv = "\n".join(",".join(f.strip() for f in line.split("|")) for line in table.splitlines())
    assert parse_sel(csv) == parse_sel(table)
    failed = "1,12/10/2024,08:30:00,Power Supply PS1 Status,Power Supply AC lost,Asserted\n"
    (event,) = parse_sel(failed)
    assert (event.kind, event.sensor) == ("failure", "PS1 Status")


def test_where_the_aer_counters_exist_the_log_is_not_read_twice(tmp_path):
    name = "a01_returnn-1500_gpu-below-root-port_fatal_recovery-failed.log"
    pci_device(tmp_path, ("0000:00:03.0",), fatal=1)
    pci_device(tmp_path, ("0000:00:03.0", "0000:03:00.0"))
    ctx = log_ctx(tmp_path, "pcie_aer", sample_lines("pcie_aer", name), gpus=[(0, "0:3:0.0")])
    results = pcie_aer.run(ctx)
    assert not [r for r in results if r.metric.startswith("aer_log")]
    assert [(r.target, r.metric) for r in results if r.status is Status.FAIL] == [
        ("gpu:0", "aer_fatal")
    ]
