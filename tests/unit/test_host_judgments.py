"""Judgments that fit the host: the real H100 SXM5 passed through to a VM, finding by finding.

The oracle is ``../shared/realworld/gpu-h100-vm/PROVENANCE.md``: a healthy H100 given to a VM on
its own grades HEALTHY with ``node.expected_gpus: 1`` declared, and at most WARN (naming what
to declare) with nothing declared; never FAULT, never replace. The agent's own delivery report
from that machine (``delivery-report.json``) graded it FAULT.

No GPU runs here, so the GPU is a fake: :class:`CapturedGpu` answers every call of the GPU
interface with the value NVML gave on that machine (``nvml-readings.json``, read call by call
through nvidia-ml-py), and raises ``NotSupported`` where NVML answered Not Supported (retired
pages, every NVLink call). Its virtualization mode is the recorded ``VirtualizationMode`` (1,
NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH). The PCI bus is the one device the report's
``pci_bus`` evidence lists; the kernel log is the recorded boot lines
(``kernel-log-boot.txt``). Everything above the fake is the real code: the checks, the SKU
files and the shipped grading rules. The load-time trace (``sw_power_cap`` at 701 W of 700 W)
is the burn's own trace from the delivery report, graded by the real ``thermal_power`` code.

Bare-metal counterparts (a true 8-GPU HGX with a GPU missing or a link down still FAULT) use the
same fake with the virtualization mode set to ``none``, and the simulator.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from node_agent import resources
from node_agent.checking import host_view
from node_agent.checking.context import CheckContext
from node_agent.checks import inventory as inventory_check
from node_agent.checks import nccl_allreduce, nvml_health, thermal_power, xid
from node_agent.config import config_from_dict
from node_agent.gpu.base import (
    VIRTUALIZATION_MODES,
    Clocks,
    DriverInfo,
    EccCounts,
    GpuProcess,
    Identity,
    NotSupported,
    NvLink,
    PcieLink,
    Power,
    RetiredPages,
    RowRemap,
    TemperatureThresholds,
    Utilization,
    XidEvent,
)
from node_agent.gpu.pci import PciBus, PciGpu
from node_agent.grading.rules import load_grader
from node_agent.hardware.sku import load_skus
from node_agent.inventory import collect
from node_agent.kernel_log import LinesKernelLog
from node_agent.model import Level, Result, Status

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO.parent / "shared" / "realworld" / "gpu-h100-vm"
pytestmark = pytest.mark.skipif(
    not (CAPTURE / "nvml-readings.json").is_file(),
    reason=f"the real H100 capture is not here ({CAPTURE})",
)

CONFIG = config_from_dict({})
GRADERS = resources.graders_dir(CONFIG)
SKUS = load_skus(GRADERS)
GRADER = load_grader(GRADERS)
H100 = SKUS["h100-sxm5-80gb"]

# nvmlClocksEventReasons bits (nvml.h: nvmlClocksEventReasonGpuIdle 0x1 ... DisplayClockSetting
# 0x100), in the order base.THROTTLE_REASONS names them
_THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def _load(name: str) -> Any:
    return json.loads((CAPTURE / name).read_text())


def _answer(value: Any, call: str) -> Any:
    """A recorded value, or NotSupported where NVML answered Not Supported."""
    if isinstance(value, dict) and "error" in value:
        raise NotSupported(f"{call} on GPU 0: NVML_ERROR_NOT_SUPPORTED (recorded)")
    return value


class CapturedGpu:
    """The real H100's GPU 0 as NVML answered on its VM (see the module docstring).

    ``virtualization`` overrides the recorded mode (``none``: the same GPU judged as if on
    bare metal); ``links`` overrides the NVLinks NVML answered for (none on the VM);
    ``throttle`` overrides the recorded clock-event reasons.
    """

    def __init__(
        self,
        index: int = 0,
        *,
        virtualization: str | None = None,
        links: list[NvLink] | None = None,
        throttle: frozenset[str] | None = None,
    ):
        self.index = index
        self._g = _load("nvml-readings.json")["gpus"][0]
        self._mode = virtualization
        self._links = links
        self._throttle = throttle

    def _field(self, name: str) -> Any:
        field = self._g["field_values"][name]
        if field["ret"] != 0:
            raise NotSupported(f"{name} on GPU {self.index}: NVML_ERROR_NOT_SUPPORTED (recorded)")
        return field["value"]

    def identity(self) -> Identity:
        g = self._g
        return Identity(
            index=self.index,
            uuid=g["UUID"],
            name=g["Name"],
            pci_bus_id=f"00000000:00:{6 + self.index:02X}.0",  # recorded: 06.0, _bus()'s slots
            serial=g["Serial"],
            vbios=g["VbiosVersion"],
            memory_total_mib=g["MemoryInfo"]["total"] >> 20,
        )

    def temperature_c(self) -> int:
        return self._g["Temperature"]

    def memory_temperature_c(self) -> int:
        return self._field("NVML_FI_DEV_MEMORY_TEMP")

    def temperature_thresholds(self) -> TemperatureThresholds:
        t = self._g["TemperatureThreshold"]
        return TemperatureThresholds(
            shutdown_c=t["shutdown"],
            slowdown_c=t["slowdown"],
            gpu_max_operating_c=t["gpu_max"],
            memory_max_operating_c=t["mem_max"],
        )

    def power(self) -> Power:
        g = self._g
        return Power(
            usage_w=g["PowerUsage"] / 1000,
            enforced_limit_w=g["EnforcedPowerLimit"] / 1000,
            default_limit_w=g["PowerManagementLimit"] / 1000,
        )

    def clocks(self) -> Clocks:
        g = self._g
        return Clocks(
            sm_mhz=g["ClockInfo"]["sm"],
            sm_max_mhz=g["MaxClockInfo"]["sm"],
            memory_mhz=g["ClockInfo"]["mem"],
        )

    def throttle_reasons(self) -> frozenset[str]:
        if self._throttle is not None:
            return self._throttle
        bits = self._g["CurrentClocksEventReasons"]
        return frozenset(name for name, bit in _THROTTLE_BITS.items() if bits & bit)

    def pcie(self) -> PcieLink:
        g = self._g
        return PcieLink(
            gen_current=g["CurrPcieLinkGeneration"],
            gen_max=g["MaxPcieLinkGeneration"],
            width_current=g["CurrPcieLinkWidth"],
            width_max=g["MaxPcieLinkWidth"],
            replay_count=g["PcieReplayCounter"],
        )

    def ecc(self) -> EccCounts:
        g = self._g
        total, by_location = g["TotalEccErrors"], g["MemoryErrorCounter"]

        def at(key: str) -> int | None:
            try:
                return _answer(by_location[key], "nvmlDeviceGetMemoryErrorCounter")
            except NotSupported:
                return None  # the backend reads an unsupported location as "not reported"

        return EccCounts(
            enabled=g["EccMode"][0] == 1,
            volatile_sbe=total["corrected/volatile"],
            volatile_dbe=total["uncorrected/volatile"],
            aggregate_sbe=total["corrected/aggregate"],
            aggregate_dbe=total["uncorrected/aggregate"],
            aggregate_dbe_sram=None,  # the SRAM location was not recorded
            aggregate_dbe_dram=at("uncorrected/aggregate/dram"),
        )

    def retired_pages(self) -> RetiredPages:
        pages = self._g["RetiredPages"]
        return RetiredPages(
            sbe=len(_answer(pages["sbe"], "nvmlDeviceGetRetiredPages")),
            dbe=len(_answer(pages["dbe"], "nvmlDeviceGetRetiredPages")),
            pending=bool(
                _answer(
                    self._g["RetiredPagesPendingStatus"], "nvmlDeviceGetRetiredPagesPendingStatus"
                )
            ),
        )

    def row_remap(self) -> RowRemap:
        corrected, uncorrected, pending, failed = self._g["RemappedRows"]
        return RowRemap(
            corrected=corrected, uncorrected=uncorrected, pending=bool(pending), failed=bool(failed)
        )

    def persistence_mode(self) -> bool:
        return self._g["PersistenceMode"] == 1

    def recovery_action(self) -> str:
        return ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")[
            self._field("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        ]

    def nvlinks(self) -> list[NvLink]:
        if self._links is not None:
            return self._links
        # as the NVML backend reads them: an index whose state answers Not Supported is not a
        # link of this GPU; on the VM every one of the 18 did
        return [
            NvLink(link=int(i), active=bool(calls["state"]))
            for i, calls in self._g["nvlink"].items()
            if "error" not in calls["state"]
        ]

    def compute_processes(self) -> list[GpuProcess]:
        return []

    def utilization(self) -> Utilization:
        rates = self._g["UtilizationRates"]
        return Utilization(gpu_pct=rates["gpu"], memory_pct=rates["memory"])

    def virtualization_mode(self) -> str:
        if self._mode is not None:
            return self._mode
        return VIRTUALIZATION_MODES[self._g["VirtualizationMode"]]


class CapturedBackend:
    """The node's GPUs: the captured one, or ``gpus`` copies of it (an 8-GPU board)."""

    name, simulated, unavailable_reason, broken = "nvml", False, None, False

    def __init__(self, devices: list[CapturedGpu]):
        self._devices = devices

    def driver(self) -> DriverInfo:
        readings = _load("nvml-readings.json")
        return DriverInfo(
            driver_version=readings["driver"], cuda_version="13.0", nvml_version=readings["nvml"]
        )

    def devices(self) -> list[CapturedGpu]:
        return list(self._devices)

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        return []

    def load_hint(self, indices: list[int], active: bool) -> None:
        pass

    def close(self) -> None:
        pass


def _bus(count: int = 1) -> PciBus:
    """The VM's PCI bus as the delivery report recorded it (one H100 at 0000:00:06.0), or
    ``count`` such GPUs on consecutive slots."""
    return PciBus(
        gpus=tuple(
            PciGpu(
                bus_id=f"0000:00:{6 + i:02x}.0",
                device_id=0x2330,
                class_code=0x030200,
                driver="nvidia",
            )
            for i in range(count)
        ),
        root="recorded",
    )


def _boot_log() -> LinesKernelLog:
    return LinesKernelLog(
        (CAPTURE / "kernel-log-boot.txt").read_text().splitlines(), source="kernel-log-boot.txt"
    )


def context(
    check: str = "nvml_health",
    *,
    config: dict | None = None,
    devices: list[CapturedGpu] | None = None,
    bus: PciBus | None = None,
    kernel_log: LinesKernelLog | None = None,
) -> CheckContext:
    """The real H100's VM as the agent sees it: ``expected_gpus`` as the environment computes
    it (``node.expected_gpus``, else the SKU's 8)."""
    backend = CapturedBackend(devices or [CapturedGpu()])
    inv = collect(backend, SKUS, "auto")
    cfg = config_from_dict(config or {})
    expected = cfg.node.expected_gpus
    if expected is None and inv.sku is not None:
        expected = inv.sku.gpus_per_node
    return CheckContext(
        check=check,
        gpu=backend,
        kernel_log=kernel_log or _boot_log(),
        config=cfg,
        inventory=inv,
        sku=inv.sku,
        expected_gpus=expected,
        pci=bus or _bus(),
    )


def one(results, metric, target=None):
    [found] = [r for r in results if r.metric == metric and (target is None or r.target == target)]
    return found


def passive_results(config: dict | None = None) -> list:
    """What inventory, nvml_health and xid say of the real VM (the passive part of a suite)."""
    out = []
    for check, module in (
        ("inventory", inventory_check),
        ("nvml_health", nvml_health),
        ("xid", xid),
    ):
        out += module.run(context(check, config=config))
    return out


# -- the whole host -----------------------------------------------------------------------------


def test_the_real_h100_vm_is_an_h100_sxm5_in_pass_through():
    ctx = context()
    assert ctx.sku is not None and ctx.sku.id == "h100-sxm5-80gb"
    assert host_view.read_host_view(ctx.gpu.devices()).modes == {0: "pass_through"}


def test_the_real_h100_vm_with_one_gpu_declared_grades_healthy():
    grade = GRADER.grade(passive_results({"node": {"expected_gpus": 1}}))
    assert grade.level is Level.HEALTHY, grade.reasons


def test_the_real_h100_vm_with_nothing_declared_warns_and_never_replaces():
    grade = GRADER.grade(passive_results())
    assert grade.level is Level.WARN, grade.reasons
    assert grade.action == "none"
    assert {r.rule for r in grade.reasons} == {"gpu-count-unconfirmed"}
    assert "node.expected_gpus" in grade.reasons[0].message


# -- NVLink -------------------------------------------------------------------------------------


def test_nvlinks_not_supported_in_a_pass_through_vm_skip_with_the_reason():
    # the report said FAULT "0 of 18 NVLinks active (down: links missing)"
    state = one(nvml_health.run(context()), "nvlink_state")
    assert state.status is Status.SKIP
    assert state.detail.startswith(
        "NVLinks are not exposed to this host: NVML answers Not Supported on every link and the "
        "GPU is passed through to a VM"
    )
    assert "node.expected_nvlinks" in state.detail
    assert state.evidence["virtualization"] == "pass_through"


@pytest.mark.parametrize("mode", ["vgpu", "host_vgpu", "host_vsga"])
def test_nvlinks_not_supported_on_any_virtualized_gpu_skip(mode):
    state = one(
        nvml_health.run(context(devices=[CapturedGpu(virtualization=mode)])), "nvlink_state"
    )
    assert state.status is Status.SKIP and "not exposed to this host" in state.detail


@pytest.mark.parametrize("declared, status", [(18, Status.FAIL), (0, Status.PASS)])
def test_declared_nvlinks_are_graded_even_in_a_vm(declared, status):
    results = nvml_health.run(context(config={"node": {"expected_nvlinks": declared}}))
    state = one(results, "nvlink_state")
    assert state.status is status and state.evidence["expected"] == declared
    if status is Status.FAIL:
        assert "0 of 18 NVLinks active (node.expected_nvlinks" in state.detail
        assert GRADER.grade(results).level is Level.ERROR


def test_bare_metal_sku_with_links_where_nvml_answers_none_warns_naming_the_setting():
    # no positive evidence of a broken link: nothing answered at all
    results = nvml_health.run(
        context(devices=[CapturedGpu(virtualization="none")], config={"node": {"expected_gpus": 1}})
    )
    state = one(results, "nvlink_state")
    assert state.status is Status.WARN and "node.expected_nvlinks" in state.detail
    grade = GRADER.grade(results)
    assert grade.level is Level.WARN and {r.rule for r in grade.reasons} == {"nvlink-unverified"}


def test_a_vm_whose_links_answer_but_are_all_inactive_warns():
    links = [NvLink(link=i, active=False, p2p_supported=True) for i in range(18)]
    state = one(nvml_health.run(context(devices=[CapturedGpu(links=links)])), "nvlink_state")
    assert state.status is Status.WARN and "node.expected_nvlinks" in state.detail


def test_a_vm_with_some_links_up_and_one_down_still_fails():
    # positive evidence: the links answer, most are up, one is reported down
    links = [NvLink(link=i, active=i != 7, p2p_supported=True) for i in range(18)]
    results = nvml_health.run(
        context(devices=[CapturedGpu(links=links)], config={"node": {"expected_gpus": 1}})
    )
    state = one(results, "nvlink_state")
    assert (
        state.status is Status.FAIL
        and "17 of 18" in state.detail
        and "down: link 7)" in state.detail
    )
    assert GRADER.grade(results).level is Level.ERROR


def test_an_hgx_link_reported_inactive_on_bare_metal_is_that_gpus_error():
    links = [NvLink(link=i, active=i != 3, p2p_supported=True) for i in range(18)]
    devices = [
        CapturedGpu(
            i,
            virtualization="none",
            links=links if i == 5 else [replace(link, active=True) for link in links],
        )
        for i in range(8)
    ]
    results = nvml_health.run(context(devices=devices, bus=_bus(8)))
    failed = [r for r in results if r.metric == "nvlink_state" and r.status is Status.FAIL]
    assert [r.target for r in failed] == ["gpu:5"]
    grade = GRADER.grade(results)
    assert [(r.rule, r.level, r.target) for r in grade.reasons] == [
        ("nvlink-down", Level.ERROR, "gpu:5")
    ]


# -- GPU count ----------------------------------------------------------------------------------


def test_one_gpu_of_an_hgx_in_a_vm_with_nothing_declared_warns_naming_expected_gpus():
    # the gpu-validate run said FAULT "1 of 8 expected GPUs"
    count = one(nvml_health.run(context()), "gpu_count")
    assert count.status is Status.WARN
    assert "1 of 8 GPUs visible" in count.detail and "node.expected_gpus" in count.detail
    assert "pass_through" in count.detail
    assert "every NVIDIA GPU on the PCI bus is listed by NVML (1 on the bus)" in count.detail
    assert "no Xid 79" in count.detail
    assert count.evidence["lost_gpu_traces"] == []


def test_a_declared_gpu_count_is_compared_in_a_vm():
    assert (
        one(nvml_health.run(context(config={"node": {"expected_gpus": 1}})), "gpu_count").status
        is Status.PASS
    )
    results = nvml_health.run(context(config={"node": {"expected_gpus": 2}}))
    count = one(results, "gpu_count")
    assert count.status is Status.FAIL and "1 of 2" in count.detail
    assert GRADER.grade(results).level is Level.ERROR


def test_a_vm_with_a_gpu_on_the_bus_that_nvml_does_not_list_still_fails_its_count():
    results = nvml_health.run(context(bus=_bus(2)))
    count = one(results, "gpu_count")
    assert count.status is Status.FAIL and "0000:00:07.0" in count.detail
    assert GRADER.grade(results).level is Level.ERROR


def test_a_vm_with_xid_79_in_its_kernel_log_still_fails_its_count():
    log = LinesKernelLog(
        [
            "[ 12.5] NVRM: Xid (PCI:0000:00:07): 79, pid='<unknown>', "
            "name=<unknown>, GPU has fallen off the bus."
        ],
        source="test",
    )
    count = one(nvml_health.run(context(kernel_log=log)), "gpu_count")
    assert count.status is Status.FAIL and "Xid 79" in count.detail


def test_a_bare_metal_hgx_with_a_gpu_missing_still_fails_its_count():
    devices = [
        CapturedGpu(
            i, virtualization="none", links=[NvLink(link=n, active=True) for n in range(18)]
        )
        for i in range(7)
    ]
    results = nvml_health.run(context(devices=devices, bus=_bus(7)))
    count = one(results, "gpu_count")
    assert count.status is Status.FAIL and "7 of 8" in count.detail
    assert GRADER.grade(results).level is Level.ERROR  # a reboot first (gpu-missing)


def test_a_gpu_whose_virtualization_mode_nvml_does_not_answer_is_judged_as_bare_metal():
    class NoMode(CapturedGpu):
        def virtualization_mode(self) -> str:
            raise NotSupported("nvmlDeviceGetVirtualizationMode: NVML_ERROR_NOT_SUPPORTED")

    results = nvml_health.run(context(devices=[NoMode()]))
    assert one(results, "gpu_count").status is Status.FAIL
    assert one(results, "nvlink_state").status is Status.WARN


# -- the other findings of PROVENANCE.md --------------------------------------------------------


def test_retired_pages_not_supported_on_hopper_is_a_skip_and_row_remap_passes():
    results = nvml_health.run(context())
    pages = one(results, "retired_pages")
    assert pages.status is Status.SKIP and "NOT_SUPPORTED" in pages.detail
    remap = one(results, "row_remap")
    assert remap.status is Status.PASS and remap.value == 0


def test_ecc_locations_answering_not_supported_are_no_finding():
    results = nvml_health.run(context())
    assert one(results, "ecc_dbe_volatile").status is Status.PASS
    assert one(results, "ecc_sbe_volatile").status is Status.PASS
    assert not [
        r
        for r in results
        if r.metric.startswith(("ecc", "sram")) and r.status not in (Status.PASS, Status.SKIP)
    ]


def test_sw_power_cap_at_idle_or_load_is_normal_operation():
    dev = CapturedGpu(throttle=frozenset({"sw_power_cap"}))
    throttle = one(nvml_health.run(context(devices=[dev])), "throttle")
    assert throttle.status is Status.PASS


def test_the_burn_trace_at_701_w_of_700_w_with_sw_power_cap_grades_healthy():
    report = _load("delivery-report.json")
    [trace] = [r["evidence"] for r in report["results"] if r["metric"] == "load_trace"]
    ctx = context("thermal_power")
    results = thermal_power.gpu_findings(ctx, 0, trace, "the real burn's trace")
    assert one(results, "throttle").status is Status.PASS
    assert one(results, "throttle").evidence["reasons_seen"]["sw_power_cap"] == 231
    power = one(results, "power_reached_fraction")
    assert power.status is Status.PASS and power.value == pytest.approx(1.0009, abs=1e-3)
    assert one(results, "sm_clock_drop").status is Status.PASS  # 1425 of 1980 MHz: 28 %
    assert GRADER.grade(results).level is Level.HEALTHY


def test_the_one_gpu_allreduce_skips_instead_of_busbw_zero(monkeypatch):
    # the report said ERROR "peak all-reduce busbw 0.0 GB/s is below the SKU minimum 400"
    monkeypatch.setattr(nccl_allreduce, "torch_available", lambda: True)  # no rank is started
    [result] = nccl_allreduce.run(context("nccl_allreduce"))
    assert result.status is Status.SKIP and result.metric == "busbw_peak_gbps"
    assert "0 by definition" in result.detail and result.evidence["backend"] == "nccl"
    assert GRADER.grade([result]).level is Level.HEALTHY


def test_the_tf32_burn_shortfall_grades_error_for_a_restart_never_a_replace():
    # 81 TFLOP/s against the SKU's 300 was the burn's own defect (plain torch.matmul ran 401.8
    # on that GPU); a first shortfall is an ERROR: restart and re-test, never FAULT at once
    [tf32] = [
        Result.from_dict(r)
        for r in _load("delivery-report.json")["results"]
        if r["metric"] == "tflops_tf32"
    ]
    grade = GRADER.grade([tf32])
    assert grade.level is Level.ERROR and grade.action == "restart"
    assert {r.rule for r in grade.reasons} == {"burn-throughput-shortfall"}


def test_the_fbhub_boot_line_is_not_an_xid_and_not_a_lost_gpu():
    results = xid.run(context("xid"))
    assert one(results, "xid").status is Status.PASS
    assert host_view.lost_gpu_traces(context()).traces == []


def test_fabric_state_not_supported_is_no_finding():
    # GpuFabricInfo state 0 (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED) in a VM: no check reads the
    # fabric state, so nothing in the passive suite mentions it or grades it
    assert _load("nvml-readings.json")["gpus"][0]["GpuFabricInfo"]["state"] == 0
    assert not [r for r in passive_results() if "fabric" in r.metric]


def test_inventory_says_the_gpus_are_passed_through_and_what_to_declare():
    virt = one(inventory_check.run(context("inventory")), "virtualization")
    assert virt.status is Status.PASS and virt.value == "pass_through"
    assert "node.expected_gpus" in virt.detail and "node.expected_nvlinks" in virt.detail


def test_every_other_passive_finding_of_the_report_passes_as_it_did():
    # the delivery report's passive results that were right stay right
    report = {
        (r["check"], r["target"], r["metric"]): r["status"]
        for r in _load("delivery-report.json")["results"]
        if r["check"] in ("inventory", "nvml_health", "xid")
    }
    ours = {
        (r.check, r.target, r.metric): r.status.value
        for r in passive_results({"node": {"expected_gpus": 1}})
    }
    changed = {key: (was, ours.get(key)) for key, was in report.items() if ours.get(key) != was}
    assert changed == {
        ("nvml_health", "gpu:0", "nvlink_state"): ("fail", "skip"),
        # nvmlDeviceGetSramEccErrorStatus is not among the recorded calls: no reading, no result
        ("nvml_health", "gpu:0", "ecc_dbe_sram_aggregate"): ("pass", None),
    }
