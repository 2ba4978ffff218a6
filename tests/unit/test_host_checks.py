"""The host checks on fake sysfs/procfs trees under tmp_path, in the kernel's own layouts.

CI has no EDAC, IPMI, NVMe, AER or thermal-throttle counters, so each tree here is written by
the test as the kernel lays it out (Documentation/admin-guide/ras.rst for EDAC,
sysfs-bus-pci-devices-aer, sysfs-devices-system-cpu); ``ipmitool`` and ``nvme`` are small
stand-in scripts printing the real tools' formats (no BMC or NVMe drive can run here).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

from node_agent.checking.context import CheckContext
from node_agent.checks import host_cpu, host_memory, host_power, nvme_health, pcie_aer
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.grading.rules import load_grader
from node_agent.hardware.sku import load_skus
from node_agent.inventory import Inventory
from node_agent.model import GpuInfo, HostInfo, Level, Status
from node_agent.resources import shipped_graders_dir

GRADER = load_grader(shipped_graders_dir())


def make_ctx(
    tmp_path: Path, check: str, config: dict | None = None, gpus=(), state=True, sku=None, **params
) -> CheckContext:
    inventory = Inventory(
        host=HostInfo(hostname="h", kernel="6.8"),
        gpus=[
            GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", pci_bus_id=bus)
            for i, bus in gpus
        ],
        sku=None,
    )
    state_dir = tmp_path / "state" if state else None
    if state_dir:
        state_dir.mkdir(exist_ok=True)
    base = {
        "sys_root": str(tmp_path / "sys"),
        "proc_root": str(tmp_path / "proc"),
        "dev_root": str(tmp_path / "dev"),
    }
    return CheckContext(
        check=check,
        gpu=AbsentGpuBackend("no GPU"),
        kernel_log=None,
        config=config_from_dict(config or {}),
        inventory=inventory,
        sku=sku,
        expected_gpus=None,
        state_dir=state_dir,
        params={**base, **params},
    )


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def by(results, metric, target=None):
    hits = [r for r in results if r.metric == metric and (target is None or r.target == target)]
    assert len(hits) == 1, [(r.target, r.metric, r.status) for r in results]
    return hits[0]


def tool(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / "bin" / name
    write(path, f"#!{sys.executable}\nimport sys, json\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- host_memory ------------------------------------------------------------------------------


def edac_dimm(tmp_path, mc, n, label, ce=0, ue=0, size=65536):
    d = tmp_path / "sys/devices/system/edac/mc" / mc / f"dimm{n}"
    for name, value in (
        ("dimm_label", label),
        ("size", size),
        ("dimm_ce_count", ce),
        ("dimm_ue_count", ue),
        ("dimm_location", f"channel {n} slot 0"),
    ):
        write(d / name, f"{value}\n")


def edac_mc(tmp_path, mc, ce=0, ue=0, since_s=3600, ue_noinfo=0):
    d = tmp_path / "sys/devices/system/edac/mc" / mc
    for name, value in (
        ("ce_count", ce),
        ("ue_count", ue),
        ("ce_noinfo_count", 0),
        ("ue_noinfo_count", ue_noinfo),
        ("seconds_since_reset", since_s),
    ):
        write(d / name, f"{value}\n")


def test_edac_uncorrected_error_fails_naming_the_dimm_label(tmp_path):
    edac_mc(tmp_path, "mc0", ue=1)
    edac_dimm(tmp_path, "mc0", 0, "P0 DIMMA1")
    edac_dimm(tmp_path, "mc0", 1, "P0_DIMMB1", ue=1)
    results = host_memory.run(make_ctx(tmp_path, "host_memory"))
    ue = by(results, "edac_ue")
    assert (ue.target, ue.status, ue.value) == ("dimm:P0_DIMMB1", Status.FAIL, 1)
    assert "P0_DIMMB1" in ue.detail and ue.evidence["edac"] == "mc0/dimm1"


def test_edac_ce_over_the_daily_rate_warns_and_under_it_passes(tmp_path):
    edac_mc(tmp_path, "mc0", ce=40, since_s=3600)
    edac_dimm(tmp_path, "mc0", 0, "A1", ce=40)
    edac_dimm(tmp_path, "mc0", 1, "A2", ce=3)
    results = host_memory.run(make_ctx(tmp_path, "host_memory"))
    warn = by(results, "edac_ce_rate")
    assert (warn.target, warn.status, warn.value) == ("dimm:A1", Status.WARN, 40.0)
    assert by(results, "edac").status is Status.PASS


def test_edac_ce_long_since_reset_is_averaged_per_day(tmp_path):
    edac_mc(tmp_path, "mc0", ce=50, since_s=10 * 86400)  # 5 a day: under 10
    edac_dimm(tmp_path, "mc0", 0, "A1", ce=50)
    results = host_memory.run(make_ctx(tmp_path, "host_memory"))
    assert not [r for r in results if r.metric == "edac_ce_rate"]


def test_edac_ce_rate_from_history_kept_between_runs(tmp_path):
    edac_mc(tmp_path, "mc0", ce=50, since_s=10 * 86400)
    edac_dimm(tmp_path, "mc0", 0, "A1", ce=50)
    ctx = make_ctx(tmp_path, "host_memory")
    host_memory.run(ctx)  # 5/day since the reset: no warning; a sample is kept
    kept = json.loads((tmp_path / "state/host_memory.json").read_text())["ce_samples"]
    kept["mc0/dimm0"][-1][0] = time.time() - 2 * 3600  # that sample was two hours ago
    (tmp_path / "state/host_memory.json").write_text(json.dumps({"ce_samples": kept}))
    write(tmp_path / "sys/devices/system/edac/mc/mc0/dimm0/dimm_ce_count", "75\n")
    warn = by(host_memory.run(ctx), "edac_ce_rate")
    assert warn.value == 25.0 and "in the last 2.0 h" in warn.detail


def test_edac_csrow_layout_of_older_kernels(tmp_path):
    edac_mc(tmp_path, "mc0", ue=2)
    row = tmp_path / "sys/devices/system/edac/mc/mc0/csrow0"
    for name, value in (
        ("ce_count", 0),
        ("ue_count", 2),
        ("size_mb", 16384),
        ("ch0_ce_count", 0),
        ("ch0_dimm_label", "DIMM_A0"),
        ("ch1_ce_count", 0),
        ("ch1_dimm_label", "DIMM_B0"),
    ):
        write(row / name, f"{value}\n")
    ue = by(host_memory.run(make_ctx(tmp_path, "host_memory")), "edac_ue")
    assert ue.target == "dimm:DIMM_A0+DIMM_B0" and ue.value == 2


def test_no_edac_is_a_skip_with_the_reason(tmp_path):
    (tmp_path / "sys").mkdir()
    results = host_memory.run(make_ctx(tmp_path, "host_memory"))
    skip = by(results, "edac")
    assert skip.status is Status.SKIP and "no EDAC driver" in skip.detail
    assert by(results, "memory_installed").status is Status.SKIP


def memory_blocks(tmp_path, count, block=2 << 30):
    base = tmp_path / "sys/devices/system/memory"
    write(base / "block_size_bytes", f"{block:x}\n")
    for n in range(count):
        (base / f"memory{n}").mkdir()


def test_a_missing_dimm_fails_against_expected_memory(tmp_path):
    memory_blocks(tmp_path, 992)  # 1984 GiB of 2048: one 64 GiB DIMM gone
    edac_mc(tmp_path, "mc0")
    edac_dimm(tmp_path, "mc0", 0, "A1", size=65536)
    results = host_memory.run(
        make_ctx(tmp_path, "host_memory", {"node": {"expected_memory_gib": 2048}})
    )
    missing = by(results, "memory_missing")
    assert missing.status is Status.FAIL and missing.evidence["missing_gib"] == 64
    assert "about 1 DIMM(s) of 64 GiB" in missing.detail


def test_memory_every_dimm_of_which_edac_lists_is_a_setting_never_a_missing_dimm(tmp_path):
    """The firmware's memory mirroring halves what the kernel sees; a mem= boot argument cuts
    it: "1024 GiB missing, about 16 DIMM(s)", FAULT, a replacement. EDAC still lists every
    DIMM: no DIMM is missing, and the finding says what keeps the memory out."""
    memory_blocks(tmp_path, 512)  # 1024 GiB online of 2048: mirrored
    edac_mc(tmp_path, "mc0")
    for n in range(32):
        edac_dimm(tmp_path, "mc0", n, f"A{n}", size=65536)
    results = host_memory.run(
        make_ctx(tmp_path, "host_memory", {"node": {"expected_memory_gib": 2048}})
    )
    assert not [r for r in results if r.metric == "memory_missing"]
    offline = by(results, "memory_not_online")
    assert offline.status is Status.FAIL and offline.evidence["edac_gib"] == 2048
    assert "no DIMM is missing" in offline.detail and "mirroring" in offline.detail
    (reason,) = [r for r in GRADER.grade(results).reasons if r.rule == "memory-not-online"]
    assert (reason.level, reason.remedy) == (Level.ERROR, "software")


def test_memtotal_fallback_allows_for_the_kernels_reservations(tmp_path):
    (tmp_path / "sys").mkdir()
    write(tmp_path / "proc/meminfo", "MemTotal:       2113336744 kB\nMemFree: 1 kB\n")  # 2015 GiB
    ctx = make_ctx(tmp_path, "host_memory", {"node": {"expected_memory_gib": 2048}})
    assert by(host_memory.run(ctx), "memory_installed").status is Status.PASS
    write(tmp_path / "proc/meminfo", "MemTotal:       1912010000 kB\n")  # ~1823 GiB
    assert by(host_memory.run(ctx), "memory_missing").status is Status.FAIL


def numa_blocks(tmp_path, nodes: list[tuple[str, int]]) -> None:
    """1 GiB memory blocks in NUMA nodes given as (cpulist, GiB): "" for a node with no CPU."""
    base, numa = tmp_path / "sys/devices/system/memory", tmp_path / "sys/devices/system/node"
    write(base / "block_size_bytes", "40000000\n")
    block = 0
    for n, (cpus, gib) in enumerate(nodes):
        write(numa / f"node{n}" / "cpulist", f"{cpus}\n")
        for _ in range(gib):
            (base / f"memory{block}" / f"node{n}").mkdir(parents=True)
            block += 1


GRACE_TRAY = [("0-71", 440), ("72-143", 440)] + [("", 185)] * 4  # GPU memory onlined (CDMM off)


def test_a_grace_trays_gpu_memory_is_not_host_memory_and_a_shortfall_is_never_a_dimm(tmp_path):
    """The driver onlines each GPU's memory as a CPU-less NUMA node (CDMM off) or not (CDMM on,
    R580): an expectation taken with it read a healthy tray as 740 GiB short, "about 23
    DIMM(s)", FAULT. On a Grace SKU only CPU nodes count, and a shortfall (soldered LPDDR5X:
    no DIMM to name) is held for an operator."""
    numa_blocks(tmp_path, GRACE_TRAY)
    gb200 = load_skus(shipped_graders_dir())["gb200-186gb"]
    expected = {"node": {"expected_memory_gib": 880}}
    results = host_memory.run(make_ctx(tmp_path, "host_memory", expected, sku=gb200))
    installed = by(results, "memory_installed")
    assert installed.status is Status.PASS and installed.evidence["gpu_node_gib"] == 740
    counted_gpus = {"node": {"expected_memory_gib": 880 + 740}}
    results = host_memory.run(make_ctx(tmp_path, "host_memory", counted_gpus, sku=gb200))
    short = by(results, "memory_short")
    assert short.status is Status.FAIL and "DIMM(s)" not in short.detail
    (reason,) = [r for r in GRADER.grade(results).reasons if r.rule == "memory-short"]
    assert reason.level is Level.ERROR and reason.remedy is not None


def test_a_cpuless_numa_node_elsewhere_is_ram_and_a_missing_dimm_stays_a_fault(tmp_path):
    """A CXL expander (or HBM in flat mode) is a CPU-less node too, and RAM: counted. Off a
    Grace SKU a shortfall is a missing DIMM, as before."""
    numa_blocks(tmp_path, [("0-63", 256), ("64-127", 256), ("", 256)])
    with_cxl = {"node": {"expected_memory_gib": 768}}
    assert by(host_memory.run(make_ctx(tmp_path, "host_memory", with_cxl)), "memory_installed")
    more = {"node": {"expected_memory_gib": 832}}
    assert by(host_memory.run(make_ctx(tmp_path, "host_memory", more)), "memory_missing")


# -- host_power -------------------------------------------------------------------------------

PS_OK = (
    "PS1 Status       | C8h | ok  | 10.1 | Presence detected\n"
    "PS2 Status       | C9h | ok  | 10.2 | Presence detected\n"
)


def ipmitool(tmp_path, out, err="", code=0, unit="", sel="SEL has no entries\n"):
    """An ipmitool stand-in: ``out`` for ``sdr type "Power Supply"``, ``unit`` for ``-v sdr type
    "Power Unit"``, ``sel`` for ``sel elist``, a fixed BMC clock for ``sel time get``; ``err``
    and ``code`` for every call."""
    return tool(
        tmp_path,
        "ipmitool",
        f"""
args = sys.argv[1:]
sys.stderr.write({err!r})
if {code}:
    sys.exit({code})
if args == ["sdr", "type", "Power Supply"]:
    sys.stdout.write({out!r})
elif args == ["-v", "sdr", "type", "Power Unit"]:
    sys.stdout.write({unit!r})
elif args == ["sel", "elist"]:
    sys.stdout.write({sel!r})
elif args == ["sel", "time", "get"]:
    print("12/10/2024 09:00:00")
else:
    sys.exit("unexpected " + repr(args))
""",
    )


def test_failed_psu_fails_naming_it(tmp_path):
    write(tmp_path / "dev/ipmi0", "")
    prog = ipmitool(
        tmp_path,
        PS_OK.replace("10.2 | Presence detected", "10.2 | Presence detected, Failure detected"),
    )
    results = host_power.run(make_ctx(tmp_path, "host_power", ipmitool=prog))
    failed = by(results, "psu_status", "psu:PS2")
    assert failed.status is Status.FAIL and "Failure detected" in failed.detail
    assert by(results, "psu_status", "psu:PS1").status is Status.PASS


def psu_statuses(tmp_path, sdr: str) -> dict[str, Status]:
    write(tmp_path / "dev/ipmi0", "")
    results = host_power.run(make_ctx(tmp_path, "host_power", ipmitool=ipmitool(tmp_path, sdr)))
    return {r.target: r.status for r in results if r.metric in ("psu_status", "psu_redundancy")}


EMPTY_PS3 = PS_OK + "PS3 Status       | CAh | ok  | 10.3 |\n"


def test_an_absent_supply_the_bmc_calls_fully_redundant_is_an_empty_slot_not_a_drain(tmp_path):
    statuses = psu_statuses(
        tmp_path, EMPTY_PS3 + "PS Redundancy    | 77h | ok  |  7.1 | Fully Redundant\n"
    )
    assert statuses == {
        "psu:PS1": Status.PASS,
        "psu:PS2": Status.PASS,
        "psu:PS3": Status.PASS,
        "node": Status.PASS,
    }


def test_an_absent_supply_with_redundancy_lost_fails(tmp_path):
    statuses = psu_statuses(
        tmp_path, EMPTY_PS3 + "PS Redundancy    | 77h | ok  |  7.1 | Redundancy Lost\n"
    )
    assert statuses["psu:PS3"] is Status.FAIL and statuses["node"] is Status.FAIL


def test_an_absent_supply_no_redundancy_sensor_explains_is_a_warning_with_its_reason(tmp_path):
    write(tmp_path / "dev/ipmi0", "")
    results = host_power.run(
        make_ctx(tmp_path, "host_power", ipmitool=ipmitool(tmp_path, EMPTY_PS3))
    )
    absent = by(results, "psu_status", "psu:PS3")
    assert absent.status is Status.WARN
    assert "no redundancy sensor" in absent.detail and absent.evidence["redundancy"] is None


def test_no_bmc_device_is_a_skip(tmp_path):
    prog = ipmitool(tmp_path, PS_OK)
    (tmp_path / "dev").mkdir()
    (skip,) = host_power.run(make_ctx(tmp_path, "host_power", ipmitool=prog))
    assert skip.status is Status.SKIP and "ipmi_si" in skip.detail


def test_ipmitool_that_cannot_open_the_device_is_a_skip(tmp_path):
    write(tmp_path / "dev/ipmi0", "")
    prog = ipmitool(
        tmp_path,
        "",
        "Could not open device at /dev/ipmi0 or /dev/ipmi/0 or "
        "/dev/ipmidev/0: No such device or address\n",
        1,
    )
    (skip,) = host_power.run(make_ctx(tmp_path, "host_power", ipmitool=prog))
    assert skip.status is Status.SKIP and "Could not open device" in skip.detail


def test_missing_ipmitool_is_a_skip_naming_the_package(tmp_path):
    ctx = make_ctx(
        tmp_path, "host_power", ipmitool="ipmitool-not-on-this-host", ipmi_sensors="not-here"
    )
    (skip,) = host_power.run(ctx)
    assert skip.status is Status.SKIP and "package `ipmitool`" in skip.detail
    assert "freeipmi-tools" in skip.detail


def test_ipmitool_failing_otherwise_is_an_error(tmp_path):
    write(tmp_path / "dev/ipmi0", "")
    prog = ipmitool(tmp_path, "", "Get Device ID command failed\n", 1)
    (err,) = host_power.run(make_ctx(tmp_path, "host_power", ipmitool=prog))
    assert err.status is Status.ERROR and "Get Device ID" in err.detail


# -- pcie_aer ---------------------------------------------------------------------------------

COR = "RxErr {0}\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\nNonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {0}\n"
UNCOR = "Undefined 0\nDLP {0}\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nTOTAL_ERR_{1} {0}\n"


def pci_device(tmp_path, chain, cor=0, nonfatal=0, fatal=0, aer=True):
    """A function at the end of ``chain`` (bridges first) under /sys/devices/pci0000:00, linked
    from /sys/bus/pci/devices."""
    path = tmp_path / "sys/devices/pci0000:00" / "/".join(chain)
    path.mkdir(parents=True, exist_ok=True)
    if aer:
        write(path / "aer_dev_correctable", COR.format(cor))
        write(path / "aer_dev_nonfatal", UNCOR.format(nonfatal, "NONFATAL"))
        write(path / "aer_dev_fatal", UNCOR.format(fatal, "FATAL"))
    links = tmp_path / "sys/bus/pci/devices"
    links.mkdir(parents=True, exist_ok=True)
    if not (links / chain[-1]).exists():
        os.symlink(path, links / chain[-1])
    return path


GPU2 = ("0000:39:00.0", "0000:3a:00.0")


def test_fatal_aer_on_the_bridge_above_gpu2_names_gpu2(tmp_path):
    pci_device(tmp_path, GPU2[:1], fatal=1)
    pci_device(tmp_path, GPU2)
    results = pcie_aer.run(make_ctx(tmp_path, "pcie_aer", gpus=[(2, "00000000:3A:00.0")]))
    fatal = by(results, "aer_fatal")
    assert (fatal.target, fatal.status) == ("gpu:2", Status.FAIL)
    assert "0000:39:00.0" in fatal.detail and fatal.evidence["bits"] == {"fatal": {"DLP": 1}}


def test_nonfatal_aer_on_an_hca_warns_naming_it(tmp_path):
    fn = pci_device(tmp_path, ("0000:3f:00.0", "0000:40:00.0"), nonfatal=2)
    pci_device(tmp_path, ("0000:3f:00.0",))
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    os.symlink(fn, tmp_path / "sys/class/infiniband/mlx5_0/device")
    warn = by(pcie_aer.run(make_ctx(tmp_path, "pcie_aer")), "aer_nonfatal")
    assert (warn.target, warn.status, warn.value) == ("hca:mlx5_0", Status.WARN, 2)


def test_correctable_growth_between_runs_warns_and_a_drop_is_a_reset(tmp_path):
    pci_device(tmp_path, GPU2[:1])
    gpu = pci_device(tmp_path, GPU2, cor=5)
    ctx = make_ctx(tmp_path, "pcie_aer", gpus=[(2, "00000000:3A:00.0")])
    assert by(pcie_aer.run(ctx), "aer_correctable").value == 5  # first run: since boot
    assert by(pcie_aer.run(ctx), "aer").status is Status.PASS  # no growth
    write(gpu / "aer_dev_correctable", COR.format(9))
    assert by(pcie_aer.run(ctx), "aer_correctable").value == 4
    write(gpu / "aer_dev_correctable", COR.format(2))  # a reboot: counted from zero again
    assert by(pcie_aer.run(ctx), "aer_correctable").value == 2


def test_no_aer_counters_is_a_skip_with_the_reason(tmp_path):
    pci_device(tmp_path, ("0000:00:01.0",), aer=False)
    skip = by(pcie_aer.run(make_ctx(tmp_path, "pcie_aer")), "aer")
    assert skip.status is Status.SKIP and "CONFIG_PCIEAER" in skip.detail


# -- nvme_health ------------------------------------------------------------------------------


def nvme_tree(tmp_path, names=("nvme0",), mounts="/dev/nvme0n1p2 / ext4 rw 0 0\n"):
    for name in names:
        ctrl = tmp_path / "sys/class/nvme" / name
        (ctrl / f"{name}n1").mkdir(parents=True)
        write(ctrl / "model", "Dell Ent NVMe CM6 RI 3.84TB\n")
        write(ctrl / "serial", "Y0R0A0X1T1K8\n")
        write(ctrl / "firmware_rev", "2.1.8\n")
    write(tmp_path / "proc/self/mounts", mounts)


def nvme(tmp_path, logs: dict, err="", code=0):
    return tool(
        tmp_path,
        "nvme",
        f"""
logs = {logs!r}
name = sys.argv[2].rsplit('/', 1)[-1]
assert sys.argv[1] == 'smart-log' and sys.argv[3:] == ['-o', 'json'], sys.argv
sys.stderr.write({err!r})
if {code}:
    sys.exit({code})
print(json.dumps(logs[name], indent=2))
""",
    )


HEALTHY = {
    "critical_warning": 0,
    "temperature": 305,
    "avail_spare": 100,
    "spare_thresh": 10,
    "percent_used": 4,
    "media_errors": 0,
}


def test_critical_warning_warns_naming_the_disk(tmp_path):
    nvme_tree(tmp_path, ("nvme0", "nvme1"))
    prog = nvme(tmp_path, {"nvme0": HEALTHY, "nvme1": {**HEALTHY, "critical_warning": 2}})
    results = nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog))
    warn = by(results, "critical_warning", "disk:nvme1")
    assert warn.status is Status.WARN and "temperature" in warn.detail
    assert by(results, "critical_warning", "disk:nvme0").status is Status.PASS


def test_media_warning_on_a_disk_holding_a_storage_path_fails(tmp_path):
    nvme_tree(tmp_path, mounts="/dev/nvme0n1 /scratch xfs rw 0 0\n")
    prog = nvme(tmp_path, {"nvme0": {**HEALTHY, "critical_warning": 4, "media_errors": 7}})
    ctx = make_ctx(tmp_path, "nvme_health", {"storage": {"paths": ["/scratch/agent"]}}, nvme=prog)
    fail = by(nvme_health.run(ctx), "critical_warning")
    assert fail.status is Status.FAIL and "/scratch/agent" in fail.detail
    assert fail.evidence["storage_paths"] == ["/scratch/agent"]


def test_wear_over_ninety_percent_warns(tmp_path):
    nvme_tree(tmp_path)
    prog = nvme(tmp_path, {"nvme0": {**HEALTHY, "percent_used": 93}})
    wear = by(nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog)), "wear")
    assert (wear.status, wear.value) == (Status.WARN, 93)


def test_spare_below_threshold_in_nvme_cli_form_fails_without_the_warning_bit(tmp_path):
    nvme_tree(tmp_path)
    prog = nvme(tmp_path, {"nvme0": {**HEALTHY, "avail_spare": 4, "spare_thresh": 10}})
    spare = by(nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog)), "available_spare")
    assert (spare.status, spare.value, spare.evidence["limit"]) == (Status.FAIL, 4, 10)


def test_a_reserved_spare_threshold_is_not_compared(tmp_path):
    nvme_tree(tmp_path)
    prog = nvme(tmp_path, {"nvme0": {**HEALTHY, "avail_spare": 64, "spare_thresh": 255}})
    spare = by(nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog)), "available_spare")
    assert spare.status is Status.WARN and "reserves" in spare.detail


def test_percentage_used_at_100_warns_naming_the_rated_endurance(tmp_path):
    nvme_tree(tmp_path)
    prog = nvme(tmp_path, {"nvme0": {**HEALTHY, "percent_used": 100}})
    results = nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog))
    wear = by(results, "wear")
    assert wear.status is Status.WARN and "rated endurance reached" in wear.detail


def test_no_nvme_or_no_nvme_cli_or_no_root_is_a_skip(tmp_path):
    (tmp_path / "sys").mkdir()
    (skip,) = nvme_health.run(make_ctx(tmp_path, "nvme_health"))
    assert skip.status is Status.SKIP and "no NVMe controller" in skip.detail
    nvme_tree(tmp_path)
    (skip,) = nvme_health.run(
        make_ctx(
            tmp_path, "nvme_health", nvme="nvme-not-on-this-host", smartctl="smartctl-not-here"
        )
    )
    assert skip.status is Status.SKIP and "nvme-cli" in skip.detail
    assert "smartmontools" in skip.detail
    prog = nvme(tmp_path, {}, "open: Permission denied\n", 1)
    (skip,) = nvme_health.run(make_ctx(tmp_path, "nvme_health", nvme=prog))
    assert skip.status is Status.SKIP and "needs root" in skip.detail


# -- host_cpu ---------------------------------------------------------------------------------


def cpus(tmp_path, online, present, throttle=None):
    base = tmp_path / "sys/devices/system/cpu"
    write(base / "online", online + "\n")
    write(base / "present", present + "\n")
    for cpu, count in (throttle or {}).items():
        write(base / f"cpu{cpu}/thermal_throttle/core_throttle_count", f"{count}\n")
        write(base / f"cpu{cpu}/thermal_throttle/package_throttle_count", "0\n")


def test_fewer_cpus_online_than_expected_fails_naming_the_missing(tmp_path):
    cpus(tmp_path, "0-110,112-223", "0-223")
    ctx = make_ctx(tmp_path, "host_cpu", {"node": {"expected_cpus": 224}})
    fail = by(host_cpu.run(ctx), "cpus_online")
    assert (fail.status, fail.value, fail.evidence["missing"]) == (Status.FAIL, 223, "111")


def test_sibling_threads_offline_because_smt_is_off_are_a_setting_not_lost_cpus(tmp_path):
    """nosmt (or a hardening policy) leaves half the declared CPUs offline: an ERROR that two
    reboots could not clear, escalated to a replacement. SMT off is named as the cause, a WARN;
    more CPUs gone than SMT explains stay a finding."""
    cpus(tmp_path, "0-111", "0-223")
    write(tmp_path / "sys/devices/system/cpu/smt/control", "off\n")
    ctx = make_ctx(tmp_path, "host_cpu", {"node": {"expected_cpus": 224}})
    warn = by(host_cpu.run(ctx), "cpus_online")
    assert (warn.status, warn.evidence["smt"]) == (
        Status.WARN,
        "off",
    ) and "SMT is off" in warn.detail
    for online in ("0-99", "0-110"):  # a socket, a core, gone beside SMT off
        cpus(tmp_path, online, "0-223")
        assert by(host_cpu.run(ctx), "cpus_online").status is Status.FAIL
    # declared as the count without SMT, as the WARN says: a lost socket is a finding again
    cores = make_ctx(tmp_path, "host_cpu", {"node": {"expected_cpus": 112}})
    cpus(tmp_path, "0-55", "0-223")
    assert by(host_cpu.run(cores), "cpus_online").status is Status.FAIL


def test_throttle_growth_between_runs_warns(tmp_path):
    cpus(tmp_path, "0-1", "0-1", {0: 0, 1: 0})
    ctx = make_ctx(tmp_path, "host_cpu")
    assert by(host_cpu.run(ctx), "cpu_throttle").status is Status.PASS
    cpus(tmp_path, "0-1", "0-1", {0: 0, 1: 4})
    warn = by(host_cpu.run(ctx), "cpu_throttle")
    assert (warn.status, warn.value) == (Status.WARN, 4) and "cpu1.core +4" in warn.detail
    assert by(host_cpu.run(ctx), "cpu_throttle").status is Status.PASS


def test_no_throttle_counters_and_no_expectation_are_skips(tmp_path):
    cpus(tmp_path, "0-1", "0-1")
    results = host_cpu.run(make_ctx(tmp_path, "host_cpu"))
    assert {r.metric: r.status for r in results} == {
        "cpu_throttle": Status.SKIP,
        "cpus_online": Status.SKIP,
    }
    assert "node.expected_cpus" in by(results, "cpus_online").detail


# -- a stand-in's faults name parts it has ------------------------------------------------------


def test_a_scenario_fault_on_a_part_the_stand_in_lacks_is_refused_when_the_node_opens(tmp_path):
    """A DIMM, disk or supply the stand-in host does not have is the scenario's error, found
    once when the node opens (exit 2), never an ERROR a check reports in a run."""
    import re

    import pytest
    import yaml

    from node_agent.environment import open_environment
    from node_agent.yamlfile import ConfigError

    config = config_from_dict({"state_dir": str(tmp_path / "state")})
    wrong = {
        "edac_ue": ({"dimm": "CPU9_DIMM_Z1"}, r"fault edac_ue names DIMM 'CPU9_DIMM_Z1'"),
        "nvme_critical_warning": (
            {"disk": "nvme9", "warning": 1},
            r"fault nvme_critical_warning names disk 'nvme9'",
        ),
        "psu_failed": ({"psu": "PS9"}, r"fault psu_failed names 'PS9'.*its supplies: PS1"),
    }
    for kind, (params, message) in wrong.items():
        path = tmp_path / f"{kind}.yaml"
        fault = {"kind": kind, **params}
        path.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "faults": [fault]}))
        with pytest.raises(
            ConfigError, match=rf"{re.escape(str(path))}: {message}.*remove the fault"
        ):
            open_environment(config, str(path))
