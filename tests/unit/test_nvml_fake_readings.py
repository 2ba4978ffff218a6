"""The real NVML backend reads what libnvidia-ml reports, one test per function family.

The library is the stand-in built from NVIDIA's nvml.h (tests/nvml_fake); the binding is the
real nvidia-ml-py, through ctypes. Each test writes NVML's raw answers (mW, bytes, bit masks,
return codes) into the state file and asserts the backend's reading in the agent's units.
"""

from __future__ import annotations

import ctypes
import inspect
import re
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest
import yaml

from node_agent.gpu import base
from node_agent.gpu import nvml as nvml_module
from node_agent.gpu.nvml import NvmlUnavailable, open_nvml
from node_agent.sim.nvml_state import write_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

MIB = 1024 * 1024
GPU0 = [
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-0e1c0e5c-95a4-4a7a-8c0c-000000000000",
    "pci.bus_id 00000000:3B:00.0",
    "event_types 0x8",
]
GPU1 = [
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-0e1c0e5c-95a4-4a7a-8c0c-000000000001",
    "pci.bus_id 00000000:5D:00.0",
    "event_types 0x8",
]
HEAD = ["driver_version 550.54.15", "nvml_version 12.550.54.15", "cuda_driver_version 12040"]


def state_text(*gpus: list[str], head: list[str] = HEAD) -> str:
    lines = ["nvml-fake-state 1", *head]
    for index, gpu in enumerate(gpus):
        lines += [f"[gpu {index}]", *gpu]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def nvml_fake_lib(pytestconfig):
    path = harness.build()
    harness.preload(pytestconfig)
    return path


@pytest.fixture
def nvml(nvml_fake_lib, tmp_path, monkeypatch):
    """``nvml(*gpu_sections, head=..., lib=None, call_timeout_s=2)``: write the state, open the
    real backend on it. ``nvml.state`` is the file, ``nvml.write(...)`` rewrites it."""
    state = tmp_path / "nvml.state"
    monkeypatch.delenv("NVML_FAKE_SCENARIO", raising=False)
    monkeypatch.setenv("NVML_FAKE_STATE", str(state))
    opened = []

    def write(*gpus, head=HEAD):
        write_state(state, state_text(*gpus, head=head))

    def open_(*gpus, head=HEAD, lib=None, call_timeout_s=2.0):
        write(*gpus, head=head)
        backend = open_nvml(call_timeout_s=call_timeout_s, lib=lib)
        opened.append(backend)
        return backend

    open_.state, open_.write = state, write
    yield open_
    harness.close_backends(state, opened)


def only_gpu(backend):
    (dev,) = backend.devices()
    return dev


# -- coverage -------------------------------------------------------------------------------------


def _symbols(function, seen: set[str]) -> set[str]:
    """The C symbols a pynvml function reaches, following its calls of other pynvml functions."""
    source = inspect.getsource(function)
    found = set(re.findall(r'_nvmlGetFunctionPointer\("(nvml\w+)"\)', source))
    for called in set(re.findall(r"\b(nvml\w+)\(", source)) - seen:
        seen.add(called)
        if callable(inner := getattr(pynvml, called, None)) and called != function.__name__:
            found |= _symbols(inner, seen)
    return found


def test_the_stand_in_exports_every_symbol_the_nvml_backend_reaches(nvml_fake_lib):
    backend_source = Path(nvml_module.__file__).read_text()
    functions = {
        name
        for name in re.findall(r'"(nvml\w+)"', backend_source)
        if callable(getattr(pynvml, name, None))
    }
    assert {"nvmlInit", "nvmlDeviceGetFieldValues", "nvmlEventSetWait_v2"} <= functions
    symbols = set().union(*(_symbols(getattr(pynvml, f), {f}) for f in functions))
    symbols |= {"nvmlErrorString"}  # NVMLError.__str__
    lib = ctypes.CDLL(str(nvml_fake_lib))
    assert sorted(s for s in symbols if not hasattr(lib, s)) == []
    assert {
        "nvmlInitWithFlags",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    } <= symbols


# -- identity and driver ------------------------------------------------------------------------


def test_identity_reads_name_uuid_bus_id_serial_vbios_and_memory_bytes_as_mib(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + [
                "serial 1652023001234",
                "vbios 96.00.74.00.0B",
                f"memory.total {81559 * MIB + 4096}",
                "memory.reserved 536870912",
                "memory.used 1048576",
            ]
        )
    )
    assert dev.identity() == base.Identity(
        index=0,
        uuid="GPU-0e1c0e5c-95a4-4a7a-8c0c-000000000000",
        name="NVIDIA H100 80GB HBM3",
        pci_bus_id="00000000:3B:00.0",
        serial="1652023001234",
        vbios="96.00.74.00.0B",
        memory_total_mib=81559,
    )


def test_identity_leaves_unreported_serial_vbios_and_memory_empty(nvml):
    ident = only_gpu(nvml(GPU0)).identity()
    assert (ident.serial, ident.vbios, ident.memory_total_mib) == (None, None, None)


def test_pci_info_v3_struct_carries_both_bus_id_forms(nvml):
    dev = only_gpu(nvml(GPU0 + ["pci.device_id 0x233010DE", "pci.subsystem_id 0x16C110DE"]))
    info = pynvml.nvmlDeviceGetPciInfo(dev.handle())  # what identity() reads, field by field
    text = [v.decode() if isinstance(v, bytes) else v for v in (info.busId, info.busIdLegacy)]
    assert text == ["00000000:3B:00.0", "0000:3B:00.0"]
    assert (info.domain, info.bus, info.device) == (0, 0x3B, 0)
    assert (info.pciDeviceId, info.pciSubSystemId) == (0x233010DE, 0x16C110DE)


def test_driver_reads_versions_and_cuda_as_major_minor(nvml):
    assert nvml(GPU0).driver() == base.DriverInfo("550.54.15", "12.4", "12.550.54.15")


def test_driver_falls_back_to_the_v1_cuda_version_on_an_older_driver(nvml):
    backend = nvml(
        GPU0,
        head=[
            *HEAD,
            "absent nvmlSystemGetCudaDriverVersion_v2",
            "unsupported nvmlSystemGetNVMLVersion",
        ],
    )
    assert backend.driver() == base.DriverInfo("550.54.15", "12.4", None)


# -- temperatures, power, clocks ------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["current", "older", "without the deprecated call"])
def test_temperatures_read_degrees_c_from_the_sensor_and_the_memory_temp_field(nvml, driver):
    switch = {
        "current": [],
        "older": ["absent nvmlDeviceGetTemperatureV"],
        "without the deprecated call": ["absent nvmlDeviceGetTemperature"],
    }[driver]
    dev = only_gpu(nvml(GPU0 + ["temperature.gpu 71", "field.82 uint 65", *switch]))
    assert (dev.temperature_c(), dev.memory_temperature_c()) == (71, 65)


def test_temperature_thresholds_read_each_threshold_and_none_where_unreported(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + [
                "temperature.threshold.shutdown 92",
                "temperature.threshold.slowdown 89",
                "temperature.threshold.mem_max 95",
            ]
        )
    )
    assert dev.temperature_thresholds() == base.TemperatureThresholds(
        shutdown_c=92, slowdown_c=89, gpu_max_operating_c=None, memory_max_operating_c=95
    )


def test_temperature_thresholds_not_supported_when_none_is_reported(nvml):
    with pytest.raises(base.NotSupported, match="no temperature threshold"):
        only_gpu(nvml(GPU0)).temperature_thresholds()


def test_power_reads_milliwatts_as_watts(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + ["power.usage 123456", "power.enforced_limit 700000", "power.default_limit 650000"]
        )
    )
    assert dev.power() == base.Power(usage_w=123.456, enforced_limit_w=700.0, default_limit_w=650.0)


def test_clocks_read_mhz(nvml):
    dev = only_gpu(nvml(GPU0 + ["clock.sm 1755", "clock_max.sm 1980", "clock.mem 2619"]))
    assert dev.clocks() == base.Clocks(sm_mhz=1755, sm_max_mhz=1980, memory_mhz=2619)


@pytest.mark.parametrize("older_driver", [False, True])
def test_clock_event_reasons_read_the_bit_mask_as_names(nvml, older_driver):
    switch = ["absent nvmlDeviceGetCurrentClocksEventReasons"] if older_driver else []
    dev = only_gpu(nvml(GPU0 + ["clocks_event_reasons 0x14c", *switch]))
    # 0x4 SwPowerCap, 0x8 HwSlowdown, 0x40 HwThermalSlowdown, 0x100 DisplayClockSetting
    assert dev.throttle_reasons() == {
        "sw_power_cap",
        "hw_slowdown",
        "hw_thermal_slowdown",
        "display_clock_setting",
    }


def test_utilization_reads_percentages(nvml):
    assert only_gpu(nvml(GPU0 + ["utilization 97 58"])).utilization() == base.Utilization(97, 58)


# -- PCIe, ECC, pages, rows, persistence, recovery ------------------------------------------------


def test_pcie_reads_generation_width_and_replays(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + [
                "pcie.gen 4",
                "pcie.gen_max 5",
                "pcie.width 8",
                "pcie.width_max 16",
                "pcie.replay_counter 3",
            ]
        )
    )
    assert dev.pcie() == base.PcieLink(
        gen_current=4, gen_max=5, width_current=8, width_max=16, replay_count=3
    )


def test_ecc_reads_volatile_aggregate_and_location_counters(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + [
                "ecc.mode 1 1",
                "ecc.corrected.volatile 12",
                "ecc.uncorrected.volatile 2",
                "ecc.corrected.aggregate 40",
                "ecc.uncorrected.aggregate 3",
                "ecc.uncorrected.aggregate.sram 1",
                "ecc.uncorrected.aggregate.dram 2",
            ]
        )
    )
    assert dev.ecc() == base.EccCounts(
        enabled=True,
        volatile_sbe=12,
        volatile_dbe=2,
        aggregate_sbe=40,
        aggregate_dbe=3,
        aggregate_dbe_sram=1,
        aggregate_dbe_dram=2,
    )


def test_ecc_reads_the_sram_status_parity_plus_sec_ded_the_flag_and_the_units(nvml):
    dev = only_gpu(
        nvml(
            GPU0
            + [
                "ecc.mode 1 1",
                "ecc.uncorrected.aggregate 7",
                # unc. parity, unc. SEC-DED, corrected; by unit: l2 sm pcie mcu other
                "ecc_sram.aggregate 2 5 11",
                "ecc_sram.volatile 1 0 3",
                "ecc_sram.aggregate_by_unit 3 0 1 2 1",
                "ecc_sram.threshold_exceeded 1",
            ]
        )
    )
    ecc = dev.ecc()
    assert (ecc.sram_uncorrectable_aggregate, ecc.sram_threshold_exceeded) == (7, True)
    assert ecc.sram_uncorrectable_by_unit == {"l2": 3, "sm": 0, "pcie": 1, "mcu": 2, "other": 1}
    assert ecc.aggregate_dbe == 7


def test_sram_status_reads_zero_and_no_flag_on_a_healthy_gpu(nvml):
    ecc = only_gpu(nvml(GPU0 + ["ecc.mode 1 1", "ecc_sram.threshold_exceeded 0"])).ecc()
    assert (ecc.sram_uncorrectable_aggregate, ecc.sram_threshold_exceeded) == (0, False)
    assert ecc.sram_uncorrectable_by_unit == dict.fromkeys(base.SRAM_UNITS, 0)


@pytest.mark.parametrize("why", ["pre-Ampere", "not root", "older driver"])
def test_sram_status_is_not_reported_where_nvml_does_not_answer_it(nvml, why):
    lines = {
        "pre-Ampere": [],  # no ecc_sram.* key: NVML_ERROR_NOT_SUPPORTED
        "not root": ["ecc_sram.threshold_exceeded 1", "error nvmlDeviceGetSramEccErrorStatus 4"],
        "older driver": ["ecc_sram.threshold_exceeded 1", "absent nvmlDeviceGetSramEccErrorStatus"],
    }[why]
    ecc = only_gpu(nvml(GPU0 + ["ecc.mode 1 1", "ecc.uncorrected.volatile 2", *lines])).ecc()
    assert (
        ecc.sram_uncorrectable_aggregate,
        ecc.sram_threshold_exceeded,
        ecc.sram_uncorrectable_by_unit,
    ) == (None, None, {})
    assert ecc.volatile_dbe == 2  # the other counters still read


def test_sram_status_struct_of_the_wrong_version_is_refused_like_the_real_library(nvml):
    dev = only_gpu(nvml(GPU0 + ["ecc_sram.aggregate 0 4 0", "ecc_sram.threshold_exceeded 1"]))
    status = pynvml.c_nvmlEccSramErrorStatus_v1_t()
    assert status.version == pynvml.nvmlEccSramErrorStatus_v1 == 0x1000068  # nvml.h
    pynvml.nvmlDeviceGetSramEccErrorStatus(dev.handle(), ctypes.byref(status))
    assert (status.aggregateUncSecDed, status.bThresholdExceeded) == (4, 1)
    status = pynvml.c_nvmlEccSramErrorStatus_v1_t()
    status.version = 0x2000068
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetSramEccErrorStatus(dev.handle(), ctypes.byref(status))


def test_a_binding_too_old_for_the_sram_status_reads_it_as_not_reported(nvml):
    older = _OlderBinding({"c_nvmlEccSramErrorStatus_v1_t", "nvmlDeviceGetSramEccErrorStatus"})
    ecc = only_gpu(nvml(GPU0 + ["ecc.mode 1 1", "ecc_sram.threshold_exceeded 1"], lib=older)).ecc()
    assert (ecc.enabled, ecc.sram_threshold_exceeded) == (True, None)


def test_ecc_disabled_reads_as_disabled(nvml):
    ecc = only_gpu(nvml(GPU0 + ["ecc.mode 0 1"])).ecc()
    assert not ecc.enabled and ecc.volatile_dbe is None


def test_retired_pages_count_each_cause_through_the_two_call_protocol(nvml):
    dev = only_gpu(
        nvml(GPU0 + ["retired_pages.sbe 3", "retired_pages.dbe 1", "retired_pages.pending 1"])
    )
    assert dev.retired_pages() == base.RetiredPages(sbe=3, dbe=1, pending=True)


def test_row_remap_reads_counts_and_flags(nvml):
    dev = only_gpu(nvml(GPU0 + ["remapped_rows 5 2 1 0"]))
    assert dev.row_remap() == base.RowRemap(corrected=5, uncorrected=2, pending=True, failed=False)


def test_persistence_mode_reads_the_enable_state(nvml):
    assert only_gpu(nvml(GPU0 + ["persistence_mode 0"])).persistence_mode() is False


@pytest.mark.parametrize(
    ("value", "action"),
    [("uint 0", "none"), ("uint 4", "drain_and_reset"), ("uint 12", "unknown_12")],
)
def test_recovery_action_reads_field_230(nvml, value, action):
    assert only_gpu(nvml(GPU0 + [f"field.230 {value}"])).recovery_action() == action


def test_recovery_action_not_supported_where_the_driver_lacks_field_230(nvml):
    with pytest.raises(base.NotSupported, match="NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):
        only_gpu(nvml(GPU0 + ["field.230 error 3"])).recovery_action()


class _OlderBinding:
    """pynvml as an older nvidia-ml-py release shows it: without the names given."""

    def __init__(self, hidden: set[str]) -> None:
        self._hidden = hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(pynvml, name)

    def __dir__(self):
        return [n for n in dir(pynvml) if n not in self._hidden]


def test_field_readings_work_with_a_binding_that_predates_the_field_names(nvml):
    # nvidia-ml-py 12.535 (pyproject's minimum) has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: the
    # backend used the binding's name and crashed with AttributeError instead of reading 230
    older = _OlderBinding({"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", "NVML_FI_DEV_MEMORY_TEMP"})
    dev = only_gpu(nvml(GPU0 + ["field.230 uint 1", "field.82 uint 50"], lib=older))
    assert (dev.recovery_action(), dev.memory_temperature_c()) == ("gpu_reset", 50)


# -- NVLink ---------------------------------------------------------------------------------------


def _link(
    i: int,
    state: int,
    valid: bool = True,
    errors: tuple[int, int, int] = (0, 0, 0),
    p2p: bool | None = None,
):
    lines = [f"nvlink.{i}.state {state}"]
    if valid:
        lines += [f"nvlink.{i}.cap.0 1", f"nvlink.{i}.cap.5 1"]
    if p2p is not None:  # NVML_NVLINK_CAP_P2P_SUPPORTED (0); the last line wins
        lines.append(f"nvlink.{i}.cap.0 {int(p2p)}")
    for name, count in zip(("replay", "recovery", "crc_flit"), errors, strict=True):
        lines.append(f"nvlink.{i}.error.{name} {count}")
    return lines


def test_nvlinks_read_state_and_dl_error_counters(nvml):
    dev = only_gpu(nvml(GPU0 + _link(0, 1, errors=(7, 1, 2)) + _link(1, 0)))
    assert dev.nvlinks() == [
        base.NvLink(
            link=0,
            active=True,
            replay_errors=7,
            recovery_errors=1,
            crc_errors=2,
            p2p_supported=True,
        ),
        base.NvLink(
            link=1,
            active=False,
            replay_errors=0,
            recovery_errors=0,
            crc_errors=0,
            p2p_supported=True,
        ),
    ]


def test_nvlink_p2p_capability_reads_the_p2p_supported_capability(nvml):
    # link 1 is valid but says it cannot carry P2P traffic; link 2 leaves the capability out
    lines = _link(0, 1) + _link(1, 0, p2p=False) + ["nvlink.2.state 1", "nvlink.2.cap.5 1"]
    links = only_gpu(nvml(GPU0 + lines)).nvlinks()
    assert [(link.link, link.active, link.p2p_supported) for link in links] == [
        (0, True, True),
        (1, False, False),
        (2, True, False),
    ]


def test_nvlink_p2p_reads_false_where_capabilities_are_not_supported(nvml):
    dev = only_gpu(nvml(GPU0 + _link(0, 1) + ["unsupported nvmlDeviceGetNvLinkCapability"]))
    assert [(link.active, link.p2p_supported) for link in dev.nvlinks()] == [(True, False)]


def test_nvlink_indexes_answering_inactive_without_the_valid_capability_are_not_links(nvml):
    # links 0-1 are the GPU's (1 is down); 2-3 answer "inactive" but NVML_NVLINK_CAP_VALID
    # says they are not links here; 4 answers "not supported"; indexes past 4 are invalid
    lines = (
        _link(0, 1)
        + _link(1, 0)
        + _link(2, 0, valid=False)
        + _link(3, 0, valid=False)
        + ["nvlink.4.state error 3"]
    )
    links = only_gpu(nvml(GPU0 + lines)).nvlinks()
    assert [(link.link, link.active) for link in links] == [(0, True), (1, False)]


def test_nvlinks_empty_on_a_gpu_without_nvlink(nvml):
    assert only_gpu(nvml(GPU0)).nvlinks() == []


def test_nvlinks_empty_when_every_link_answers_not_supported_as_in_a_pass_through_vm(nvml):
    # a captured H100 in a VM: every link's state (and so every call on the link) answers
    # NVML_ERROR_NOT_SUPPORTED (../shared/realworld/gpu-h100-vm/nvml-readings.json)
    lines = [f"nvlink.{i}.state error 3" for i in range(18)]
    assert only_gpu(nvml(GPU0 + lines)).nvlinks() == []


# -- virtualization -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, name", list(enumerate(base.VIRTUALIZATION_MODES)))
def test_virtualization_mode_reads_nvml_gpu_virtualization_mode_as_its_name(nvml, mode, name):
    assert only_gpu(nvml(GPU0 + [f"virtualization_mode {mode}"])).virtualization_mode() == name


def test_virtualization_mode_not_supported_where_nvml_does_not_answer(nvml):
    with pytest.raises(base.NotSupported, match="nvmlDeviceGetVirtualizationMode"):
        only_gpu(nvml(GPU0)).virtualization_mode()


def test_a_virtualization_mode_newer_than_the_agent_reads_unknown(nvml):
    assert only_gpu(nvml(GPU0 + ["virtualization_mode 9"])).virtualization_mode() == "unknown_9"


# -- processes and events -------------------------------------------------------------------------


@pytest.mark.parametrize("older_driver", [False, True])
def test_compute_processes_read_pids_and_used_bytes(nvml, older_driver):
    switch = ["absent nvmlDeviceGetComputeRunningProcesses_v3"] if older_driver else []
    dev = only_gpu(nvml(GPU0 + ["process 4242 1073741824", "process 4243 na", *switch]))
    assert dev.compute_processes() == [
        base.GpuProcess(4242, 1073741824),
        base.GpuProcess(4243, None),
    ]


def test_compute_processes_empty_when_none_run(nvml):
    assert only_gpu(nvml(GPU0)).compute_processes() == []


def test_xid_events_come_once_each_with_their_gpu(nvml):
    backend = nvml(GPU0, GPU1 + ["xid first 48", "xid second 79"])
    assert [(e.gpu_index, e.code) for e in backend.wait_xid_events(0.5)] == [(1, 48), (1, 79)]
    assert backend.wait_xid_events(0.05) == []


def test_an_xid_and_a_lost_gpu_injected_while_running_are_seen(nvml):
    backend = nvml(GPU0, GPU1)
    gpu0, gpu1 = backend.devices()
    assert backend.wait_xid_events(0.05) == []
    assert gpu0.temperature_c is not None and gpu0.identity().index == 0
    results = []
    waiter = threading.Thread(target=lambda: results.extend(backend.wait_xid_events(3.0)))
    waiter.start()
    time.sleep(0.2)
    nvml.write(GPU0 + ["lost 1"], GPU1 + ["xid 1 79"])
    waiter.join(5)
    assert [(e.gpu_index, e.code) for e in results] == [(1, 79)]
    with pytest.raises(base.DeviceLost, match="GPU 0.*stopped answering"):
        gpu0.identity()
    assert gpu1.identity().index == 1


def test_xid_events_not_supported_when_no_gpu_registers_them(nvml):
    backend = nvml(GPU0 + ["unsupported nvmlDeviceRegisterEvents"])
    with pytest.raises(base.NotSupported, match="Xid events"):
        backend.wait_xid_events(0.05)


# -- errors, hangs, init --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (3, base.NotSupported),
        (4, base.NoPermission),
        (15, base.DeviceLost),
        (10, base.GpuTimeout),
        (999, base.GpuError),
    ],
)
def test_nvml_return_codes_become_the_backend_errors(nvml, code, error):
    dev = only_gpu(nvml(GPU0 + ["temperature.gpu 40", f"error nvmlDeviceGetTemperatureV {code}"]))
    with pytest.raises(error, match="nvmlDeviceGetTemperatureV on GPU 0"):
        dev.temperature_c()


def test_a_hung_call_times_out_and_later_calls_fail_fast(nvml):
    dev = only_gpu(
        nvml(
            GPU0 + ["temperature.gpu 40", "power.usage 1000", "hang nvmlDeviceGetPowerUsage"],
            call_timeout_s=0.3,
        )
    )
    started = time.monotonic()
    with pytest.raises(base.GpuTimeout, match="nvmlDeviceGetPowerUsage on GPU 0 did not return"):
        dev.power()
    assert 0.25 < time.monotonic() - started < 2
    started = time.monotonic()
    with pytest.raises(base.GpuTimeout, match="skipped nvmlDeviceGetTemperatureV"):
        dev.temperature_c()
    assert time.monotonic() - started < 0.1


def test_nvml_init_that_hangs_makes_the_backend_unavailable_and_broken(nvml):
    with pytest.raises(NvmlUnavailable, match="NVML did not initialise") as caught:
        nvml(GPU0, head=[*HEAD, "hang nvmlInit"], call_timeout_s=0.3)
    assert caught.value.broken


def test_nvml_init_version_mismatch_says_to_reboot(nvml):
    with pytest.raises(NvmlUnavailable, match="versions differ.*reboot"):
        nvml(GPU0, head=[*HEAD, "error nvmlInit 18"])


def test_the_unconfigured_library_answers_like_a_host_without_a_driver(nvml_fake_lib, monkeypatch):
    monkeypatch.delenv("NVML_FAKE_STATE", raising=False)
    monkeypatch.delenv("NVML_FAKE_SCENARIO", raising=False)
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver") as caught:
        open_nvml()
    assert not caught.value.broken


def test_a_malformed_state_file_fails_init_with_an_error(nvml, capfd):
    write_state(nvml.state, "nvml-fake-state 1\n[gpu 1]\n")
    with pytest.raises(NvmlUnavailable, match="NVML failed to initialise") as caught:
        open_nvml()
    assert caught.value.broken
    assert "section [gpu 1] out of order" in capfd.readouterr().err


# -- scenario files: NVML_FAKE_SCENARIO ----------------------------------------------------------


def test_a_scenario_named_by_nvml_fake_scenario_is_rendered_and_rerendered_on_change(
    nvml_fake_lib, tmp_path, monkeypatch
):
    scenario = tmp_path / "node.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2}))
    monkeypatch.delenv("NVML_FAKE_STATE", raising=False)
    monkeypatch.setenv("NVML_FAKE_SCENARIO", str(scenario))
    monkeypatch.setenv("NVML_FAKE_PYTHON", sys.executable)
    backend = open_nvml(call_timeout_s=30)
    try:
        gpu0, gpu1 = backend.devices()
        assert gpu1.identity().pci_bus_id == "00000000:2A:00.0"
        assert gpu0.temperature_c() == 38
        scenario.write_text(
            yaml.safe_dump(
                {
                    "sku": "h100-sxm5-80gb",
                    "gpus": 2,
                    "faults": [{"kind": "temperature", "gpu": 0, "celsius": 93}],
                }
            )
        )
        assert gpu0.temperature_c() == 93
    finally:
        backend.close()
