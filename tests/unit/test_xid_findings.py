"""The ``xid`` check and its watcher in the daemon (the XID watch): kernel-log lines become one
finding per (GPU or NVSwitch, code), however many the driver printed; a GPU that fell off the bus
is found even when the driver cannot load; NVML events never pre-empt the line that decides their
grade.

Nodes are simulated (``--simulate`` scenarios: the simulated NVML backend); the kernel log is a
list of real-format lines (``LinesKernelLog``, as the simulator provides it) or, where named, the
real samples in ``../shared/realworld/xid/``. The check, the folding, the watch and the grader
are the real code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_agent.checking.context import HOST_PORTS
from node_agent.checks import xid as xid_check
from node_agent.checks.xid import buses as xid_buses
from node_agent.checks.xid.watch import XidWatch
from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.kernel_log import KernelLogScanner, LinesKernelLog, LogRecord, normalise_bus
from node_agent.model import Level, Status

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "realworld" / "xid"
needs_samples = pytest.mark.skipif(
    not SAMPLES.is_dir(), reason=f"real kernel-log samples not found at {SAMPLES}"
)


@pytest.fixture
def env(tmp_path):
    """A simulated 8-GPU H100 node (no faults)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": []}))
    environment = open_environment(load_config(config), str(scenario))
    yield environment
    environment.close()


def bus(env, index: int) -> str:
    """GPU ``index``'s bus as the kernel prints it (``0000:9a:00``)."""
    return normalise_bus(env.inventory.gpus[index].pci_bus_id)


def run_xid(env, lines, gpu=None, **params):
    ctx = env.check_context(
        "xid",
        "service",
        params,
        gpu=gpu or env.gpu,
        kernel_log=LinesKernelLog(lines),
        ports=HOST_PORTS,
    )
    return xid_check.run(ctx)


def findings(results, metric="xid"):
    return [r for r in results if r.metric == metric and r.status is Status.FAIL]


def test_flood_of_10000_lines_of_one_code_is_one_finding_with_count_and_rate(env):
    line = f"NVRM: Xid (PCI:{bus(env, 3)}): 92, pid=1, High single-bit ECC error rate"
    lines = [f"[{1000.0 + 0.1 * i:12.6f}] {line}" for i in range(10_000)]
    results = run_xid(env, lines)
    (finding,) = findings(results)
    assert (finding.target, finding.value) == ("gpu:3", 92)
    evidence = finding.evidence
    assert evidence["count"] == 10_000 and evidence["bursts"] == 1
    assert evidence["rate_per_hour"] == pytest.approx(10_000 / 999.9 * 3600, rel=1e-3)
    assert (evidence["first_seen"], evidence["last_seen"]) == (
        "1000.000 s after boot",
        "1999.900 s after boot",
    )
    assert len(evidence["lines"]) == 2 and len(evidence["variants"]) == 1
    grade = env.grader.grade(results, "service")
    assert len(grade.reasons) == 1 and grade.level is Level.WARN
    assert "10000 time(s)" in grade.reasons[0].message and "/h" in grade.reasons[0].message


def test_flood_of_sxid_lines_is_one_finding_per_nvswitch(env):
    lines = [
        f"[{10.0 + i:10.6f}] nvidia-nvswitch{i % 2}: SXid (PCI:0000:0{5 + i % 2}:00.0): 20009, "
        f"Non-fatal, Link {i % 60} RX Short Error Rate"
        for i in range(2000)
    ]
    sxids = findings(run_xid(env, lines), "sxid")
    assert [(f.target, f.evidence["count"]) for f in sxids] == [
        ("nvswitch:0", 1000),
        ("nvswitch:1", 1000),
    ]
    assert len(sxids[0].evidence["links"]) == 30


@needs_samples
def test_xid79_fallen_off_bus_without_xid_line_grades_error_for_a_reboot(env):
    """x19: the GPU fell off the bus during the driver's probe, so NVML cannot load: the log is
    still read and the node grades ERROR (RESTART_BM: drained and rebooted first), with the reason NVML was not queried kept."""
    (path,) = SAMPLES.glob("x19_*.log")
    no_driver = AbsentGpuBackend("NVIDIA driver not loaded (NVML: driver not loaded)")
    results = run_xid(env, path.read_text().splitlines(), gpu=no_driver)
    assert [r.status for r in results if r.metric == "ran"] == [Status.SKIP]
    (finding,) = findings(results)
    assert (finding.target, finding.value) == ("pci:0000:b3:00", 79)
    grade = env.grader.grade(results, "service")
    assert (
        grade.level is Level.ERROR
        and "[Xid 79: GPU has fallen off the bus]" in grade.reasons[0].message
    )


def test_fallen_off_bus_message_names_the_gpu_it_came_from(env):
    lines = [
        f"[ 1843.308145] NVRM: The NVIDIA GPU {bus(env, 6)}.0",
        "               NVRM: (PCI ID: 10de:2330) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
    ]
    (finding,) = findings(run_xid(env, lines))
    assert (finding.target, finding.value) == ("gpu:6", 79)
    assert env.grader.grade([finding]).level is Level.ERROR


def test_without_a_driver_a_clean_log_is_a_skip_not_a_pass(env):
    no_driver = AbsentGpuBackend("no NVIDIA driver on this host")
    results = run_xid(
        env, ["[ 1.0] Linux version 6.1.0", "[ 2.0] usb 1-1: new device"], gpu=no_driver
    )
    (only,) = results
    assert only.status is Status.SKIP and only.detail.startswith("no NVIDIA driver on this host")


@needs_samples
def test_redacted_xid_lines_are_a_warn_that_says_why(env):
    (path,) = SAMPLES.glob("x26_*.log")
    results = run_xid(env, path.read_text().splitlines())
    (unreadable,) = [r for r in results if r.metric == "xid_unreadable"]
    assert unreadable.status is Status.WARN and unreadable.value == 2
    assert "not readable ('PCI:...')" in unreadable.detail and unreadable.evidence["codes"] == [
        137,
        145,
    ]
    assert env.grader.grade(results, "service").level is Level.WARN


def test_mig_instances_fold_into_their_gpu_with_the_instances_listed(env):
    lines = [
        f"NVRM: Xid (PCI:{bus(env, 1)} GPU-I:0{n}): 43, pid={n}, name=x, Ch 00000008"
        for n in (1, 2, 1)
    ]
    (finding,) = findings(run_xid(env, lines))
    assert finding.target == "gpu:1" and finding.evidence["gpu_instances"] == [1, 2]


# -- the daemon's watch ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_for(env, **kw):
    reports = []
    clock = FakeClock()
    watch = XidWatch(lambda: env.gpu, lambda: env.kernel_log, reports.append, clock=clock, **kw)
    return watch, reports, clock


def records(lines):
    return [LogRecord(i + 1, line, boot_s=1000.0 + 0.01 * i) for i, line in enumerate(lines)]


def test_watch_folds_a_flood_into_a_few_reports(env):
    watch, reports, clock = watch_for(env)
    line = f"NVRM: Xid (PCI:{bus(env, 2)}): 95, pid=5171, Uncontained: FBHUB. RST: Yes, D-RST: No"
    scanner = KernelLogScanner()
    for _ in range(10):  # 10,000 lines read in ten polls
        watch.kernel_records(records([line] * 1000), scanner, "/dev/kmsg")
    assert [(r.gpu_index, r.code, r.count, r.why) for r in reports] == [(2, 95, 1, "first")]
    clock.now += 61.0  # the update interval
    watch._flush()
    assert [(r.count, r.why) for r in reports[1:]] == [(10_000, "update")]
    finding = reports[-1].result("gpu:2")
    grade = env.grader.grade([finding], "service")
    assert grade.level is Level.ERROR and len(grade.reasons) == 1


def test_watch_reports_a_fatal_line_among_a_nonfatal_flood_at_once(env):
    watch, reports, _ = watch_for(env)
    gpu = bus(env, 0)
    ber = (
        f"NVRM: Xid (PCI:{gpu}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
        "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    fatal = (
        f"NVRM: Xid (PCI:{gpu}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
        "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    scanner = KernelLogScanner()
    watch.kernel_records(records([ber] * 500), scanner, "/dev/kmsg")
    assert env.grader.grade([reports[-1].result("gpu:0")]).level is Level.WARN
    watch.kernel_records(records([ber] * 500 + [fatal]), scanner, "/dev/kmsg")
    assert len(reports) == 2 and reports[-1].why == "new variant or burst"
    assert reports[-1].line == fatal  # the line that decides, for a handler that keeps only one
    assert env.grader.grade([reports[-1].result("gpu:0")]).level is Level.ERROR


def test_watch_nvml_event_waits_for_its_kernel_line_before_it_is_graded(env):
    watch, reports, clock = watch_for(env)
    watch.kernel_log_watched = True
    watch.nvml_event(0, 149, "")
    assert reports == []  # an NVML 149 alone would grade by its code (ERROR)
    line = (
        f"NVRM: Xid (PCI:{bus(env, 0)}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
        "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    watch.kernel_records(records([line]), KernelLogScanner(), "/dev/kmsg")
    (report,) = reports
    assert (report.gpu_index, report.count, report.evidence["nvml_events"]) == (0, 1, 1)
    assert env.grader.grade([report.result("gpu:0")]).level is Level.WARN
    clock.now += 10
    watch._flush()
    assert len(reports) == 1  # nothing new, and the NVML event was not reported on its own


def test_watch_nvml_event_without_a_kernel_line_is_graded_by_its_code_after_the_grace(env):
    watch, reports, clock = watch_for(env, nvml_grace_s=2.0)
    watch.kernel_log_watched = True
    watch.nvml_event(4, 79, "simulated")
    watch._flush()
    assert reports == []
    clock.now += 2.5
    watch._flush()
    (report,) = reports
    assert (report.gpu_index, report.code, report.why) == (
        4,
        79,
        "nvml event without a kernel-log line",
    )
    assert env.grader.grade([report.result("gpu:4")]).level is Level.ERROR


def test_watch_leaves_sxids_to_the_check_unless_the_handler_names_nvswitches(env):
    line = "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
    watch, reports, _ = watch_for(env)
    watch.kernel_records(records([line]), KernelLogScanner(), "/dev/kmsg")
    assert reports == []
    watch, reports, _ = watch_for(env, report_sxid=True)
    watch.kernel_records(records([line]), KernelLogScanner(), "/dev/kmsg")
    (report,) = reports
    assert (report.kind, report.target, report.code) == ("sxid", "nvswitch:1", 20034)
    assert env.grader.grade([report.result(report.target)]).level is Level.ERROR


def test_the_xid_checks_watcher_hands_the_daemon_its_named_finding_as_the_checks_result(env):
    """What the daemon gets from the check's SERVICE.watcher: the node's GPUs named from the
    inventory, SXids reported, each finding the xid check's own sticky result."""
    from node_agent.checking.behaviour import NodeLabels, WatchContext, behaviour

    service = behaviour("xid")
    assert service.watcher is not None
    handed = []
    watch = service.watcher(WatchContext(lambda: env, lambda: NodeLabels("n", {}), handed.append))
    xid = f"NVRM: Xid (PCI:{bus(env, 5)}): 79, pid=1, GPU has fallen off the bus."
    sxid = "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
    watch.kernel_records(records([xid, sxid]), KernelLogScanner(), "/dev/kmsg")
    assert [(s.result.check, s.result.target, s.result.value, s.why) for s in handed] == [
        ("xid", "gpu:5", 79, "first"),
        ("xid", "nvswitch:1", 20034, "first"),
    ]
    assert handed[0].headline == "Xid 79 on gpu:5 from /dev/kmsg"
    assert [service.sticky_key(s.result) for s in handed] == [("gpu:5", 79), ("nvswitch:1", 20034)]


def test_a_watcher_whose_findings_would_not_be_kept_is_refused():
    from node_agent.checking.behaviour import ServiceBehaviour

    with pytest.raises(TypeError, match="declares sticky"):
        ServiceBehaviour(watcher=lambda ctx: None)


# -- rules of belief: the host's PCI bus, NVML's corroboration ----------------------------------


def run_live(env, lines, **params):
    """The check on lines read as *this host's own* log (kmsg/the journal), whose bus ids the
    host's sysfs can confirm."""
    ctx = env.check_context(
        "xid",
        "service",
        params,
        kernel_log=LinesKernelLog(lines, live=True),
        ports=HOST_PORTS,
    )
    return xid_check.run(ctx)


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """A /sys/bus/pci/devices tree of our own: ``add(bdf, vendor)`` makes a device."""
    root = tmp_path / "sys-bus-pci-devices"
    root.mkdir()
    monkeypatch.setattr(xid_buses, "SYSFS_PCI_DEVICES", root)

    def add(bdf: str, vendor: str) -> None:
        (root / bdf).mkdir()
        (root / bdf / "vendor").write_text(vendor + "\n")

    return add


def test_xid_on_a_bus_that_is_no_nvidia_device_is_a_warn_never_a_gpu_fault(env, sysfs):
    """The injected line names a bus where this host has an Intel NIC (or nothing at all)."""
    sysfs("0000:e9:00.0", "0x8086")
    lines = [
        "NVRM: Xid (PCI:0000:e9:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
        "off the bus.",
        "NVRM: Xid (PCI:0000:77:00): 48, pid=1, DBE",
    ]
    results = run_live(env, lines)
    assert findings(results) == []
    (unreadable,) = [r for r in results if r.metric == "xid_unreadable"]
    assert unreadable.value == 2 and "no NVIDIA device" in unreadable.detail
    assert env.grader.grade(results, "service").level is Level.WARN


def test_xid_on_an_nvidia_bus_nvml_does_not_list_is_still_graded(env, sysfs):
    sysfs("0000:c1:00.0", "0x10de")
    (finding,) = findings(
        run_live(env, ["NVRM: Xid (PCI:0000:c1:00): 79, pid=1, GPU has fallen off the bus."])
    )
    assert (finding.target, finding.value) == ("pci:0000:c1:00", 79)


def test_a_saved_log_takes_bus_ids_as_printed_and_says_so(env, sysfs):
    sysfs("0000:e9:00.0", "0x8086")
    (finding,) = findings(
        run_xid(env, ["NVRM: Xid (PCI:0000:e9:00): 79, pid=1, GPU has fallen off the bus."])
    )
    assert finding.target == "pci:0000:e9:00"
    (passed,) = [r for r in run_xid(env, []) if r.status is Status.PASS]
    assert "bus ids taken as printed (a saved log" in passed.detail


class EventsFrom:
    """The simulated backend, with NVML's event API reporting ``events`` (a GPU with an event
    set is what the simulator has only for scenario faults)."""

    def __init__(self, backend, events):
        self._backend, self._events = backend, events

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def wait_xid_events(self, timeout_s):
        return self._events


def test_xid_nvml_also_reported_is_corroborated_in_the_evidence(env):
    from node_agent.gpu.base import XidEvent

    gpu = EventsFrom(env.gpu, [XidEvent(gpu_index=3, code=79, message="event")])
    lines = [
        f"NVRM: Xid (PCI:{bus(env, 3)}): 79, pid=1, GPU has fallen off the bus.",
        f"NVRM: Xid (PCI:{bus(env, 4)}): 79, pid=1, GPU has fallen off the bus.",
    ]
    by_target = {f.target: f for f in findings(run_xid(env, lines, gpu=gpu, watch_s=0.01))}
    assert by_target["gpu:3"].evidence["corroborated_by_nvml"] is True
    assert "corroborated by 1 NVML event" in by_target["gpu:3"].detail
    assert by_target["gpu:4"].evidence["corroborated_by_nvml"] is False


def test_watch_reports_corroboration_when_nvml_and_the_line_agree(env):
    watch, reports, _ = watch_for(env, nvml_grace_s=0)
    watch.nvml_event(2, 79, "event")
    line = f"[ 1.0] NVRM: Xid (PCI:{bus(env, 2)}): 79, pid=1, GPU has fallen off the bus."
    watch.kernel_records(records([line]), KernelLogScanner(), "/dev/kmsg")
    assert reports[-1].evidence["corroborated_by_nvml"] is True


def test_watch_drops_a_line_whose_bus_sysfs_shows_is_no_nvidia_device(env, sysfs):
    sysfs("0000:e9:00.0", "0x8086")
    live = LinesKernelLog([], source="/dev/kmsg", live=True)
    reports = []
    watch = XidWatch(lambda: env.gpu, lambda: live, reports.append, clock=FakeClock())
    line = "[ 1.0] NVRM: Xid (PCI:0000:e9:00): 79, pid=1, GPU has fallen off the bus."
    watch.kernel_records(records([line]), KernelLogScanner(), "/dev/kmsg")
    assert reports == []


# -- the driver's lines without an Xid: graded as graders/driver_lines.yaml says -------------


def test_every_driver_line_kind_grades_at_its_catalog_level_through_the_shipped_rules(env):
    from node_agent.checking.xid_fold import DriverFold
    from node_agent.kernel_log import DriverLine

    kinds = xid_check.driver_line_kinds(
        env.check_context(
            "xid",
            "delivery",
            {},
            kernel_log=LinesKernelLog([]),
            expected_gpus=8,
            ports=HOST_PORTS,
        )
    )
    assert set(kinds) == {
        "gpu-lost",
        "reset-required",
        "init-failed",
        "aer-uncorrectable",
        "aer-recovery-failed",
        "va-space-exhausted",  # built in where the graders directory leaves it out
    }
    for kind in kinds.values():
        fold = DriverFold(kind=kind.kind, target="gpu:0")
        fold.add(DriverLine(kind=kind.kind, pci_bus="0000:e9:00", message="m", raw="r"), "log")
        result = fold.result(kind.metric, Status(kind.status), kind.name)
        assert env.grader.grade([result], "service").level is kind.level, kind.kind
        assert env.grader.grade([result], "delivery").level is kind.level, kind.kind


@pytest.mark.parametrize(
    "line, metric, level",
    [
        (
            "NVRM: GPU {bus}.0: RmInitAdapter failed! (0x24:0x72:1568)",
            "driver_init_failed",
            Level.ERROR,
        ),
        (
            "NVRM: GPU {bus}.0: nvAssertOkFailedNoLog: Assertion failed: Reset required "
            "[NV_ERR_RESET_REQUIRED] (0x00000062)",
            "recovery_action",
            Level.ERROR,
        ),
        (
            "NVRM: GPU {bus}.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
            "[NV_ERR_GPU_IS_LOST] (0x0000000F)",
            "gpu_lost",
            Level.ERROR,
        ),
    ],
)
def test_driver_line_names_the_gpu_by_its_bus(env, line, metric, level):
    results = run_xid(env, [line.format(bus=bus(env, 5))] * 2)
    (finding,) = [r for r in results if r.metric == metric]
    assert (finding.target, finding.value, finding.evidence["pci_bus"]) == ("gpu:5", 2, bus(env, 5))
    assert env.grader.grade(results, "service").level is level


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
        "[NV_ERR_GPU_IS_LOST] (0x0000000F)",
        "NVRM: GPU5 nvAssertOkFailedNoLog: Assertion failed: Reset required "
        "[NV_ERR_RESET_REQUIRED] (0x00000062) returned from status @ kernel_channel.c:2874",
    ],
)
def test_driver_line_naming_only_the_drivers_gpu_number_is_the_nodes_and_warn_at_most(env, line):
    """The driver's own GPU number is not NVML's index and names no bus: which GPU it is cannot
    be known, so the line is the node's and grades WARN, never a drain (issue 34)."""
    results = run_xid(env, [line])
    (finding,) = [r for r in results if r.metric == "driver_line_no_gpu"]
    assert finding.target == "node" and finding.evidence["driver_gpus"] == [5]
    assert finding.status is Status.WARN and "the driver's GPU 5" in finding.detail
    assert env.grader.grade(results, "service").level is Level.WARN


def test_aer_on_a_device_that_is_not_a_gpu_is_not_this_checks(env):
    lines = [
        "nvme 0000:5e:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction "
        "Layer, (Receiver ID)",
        "pcieport 0000:5d:00.0: AER: device recovery failed",
    ]
    results = run_xid(env, lines)
    assert [r.status for r in results] == [Status.PASS]


def test_aer_on_a_gpu_with_failed_recovery_grades_error(env):
    lines = [
        f"nvidia {bus(env, 2)}.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
        "type=Transaction Layer, (Receiver ID)",
        "pcieport 0000:17:00.0: AER: device recovery failed",
    ]
    results = run_xid(env, lines)
    assert {(r.metric, r.target) for r in results if r.status is not Status.PASS} == {
        ("pcie_aer_uncorrectable", "gpu:2"),
        ("pcie_aer_recovery_failed", "gpu:2"),
    }
    assert env.grader.grade(results, "service").level is Level.ERROR


def test_watch_findings_of_xid31_on_every_gpu_grade_as_the_jobs_warn(env):
    """The daemon grades the findings its watch keeps all together, as the check's are: Xid 31
    on every GPU, in three bursts each, is the application's (WARN, no drain); on one GPU
    alone, the same three bursts are that GPU's ERROR."""
    watch, reports, _ = watch_for(env)
    scanner = KernelLogScanner()
    mmu = "NVRM: Xid (PCI:{}): 31, pid=77, name=python3, Ch 00000008, intr 0. MMU Fault"
    seq = iter(range(1, 100))
    for burst_s in (1000.0, 3000.0, 5000.0):
        watch.kernel_records(
            [LogRecord(next(seq), mmu.format(bus(env, g)), boot_s=burst_s + g) for g in range(8)],
            scanner,
            "/dev/kmsg",
        )
    latest = {r.gpu_index: r for r in reports}  # the daemon keeps the latest per finding
    kept = [latest[g].result(f"gpu:{g}") for g in range(8)]
    assert all(r.evidence["bursts"] == 3 for r in kept)
    spread = env.grader.grade(kept, "service")
    assert spread.level is Level.WARN and len(spread.reasons) == 8
    assert all("the job's" in r.message for r in spread.reasons)
    alone = env.grader.grade(kept[3:4], "service")
    assert (alone.level, alone.reasons[0].target) == (Level.ERROR, "gpu:3")
