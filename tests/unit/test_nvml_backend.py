"""The NVML backend against a fake ``pynvml`` module.

A fake module stands in for nvidia-ml-py because no NVIDIA driver can run on CI: it answers for
two GPUs with the values, return types (``bytes`` from older bindings included) and
``NVMLError`` codes the real bindings produce, so these tests exercise the translation from
NVML to ``node_agent.gpu.base`` — values, errors, timeouts and Xid events.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from node_agent.gpu.base import (
    DeviceLost,
    DriverStateError,
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuTimeout,
    NoPermission,
    NotSupported,
    NvLink,
    Utilization,
    XidEvent,
)
from node_agent.gpu.nvml import NvmlBackend, NvmlUnavailable, open_nvml

# nvmlReturn_t codes, as in nvml.h
NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, DRIVER_NOT_LOADED = 3, 4, 6, 9
TIMEOUT, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, GPU_IS_LOST = 10, 12, 13, 15
INVALID_ARGUMENT, ARGUMENT_VERSION_MISMATCH = 2, 25


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class Handle:
    """Stands in for the ctypes device pointer pynvml returns."""

    def __init__(self, index: int) -> None:
        self.index = index


GPUS = [
    {  # an H100-like GPU with NVLink, answering in str like current nvidia-ml-py
        "uuid": "GPU-aaaa",
        "name": "NVIDIA H100 80GB HBM3",
        "bus": "00000000:1B:00.0",
        "serial": "1650123456789",
        "vbios": "96.00.74.00.0D",
        "total": 81559 * 1024 * 1024,
        "ecc": (1, 1),
        "sbe": (3, 40),
        "dbe": (0, 2),
        "dbe_sram": 1,
        "dbe_dram": 1,
        "remap": (2, 1, 0, 0),
        "pcie": (5, 5, 16, 16),
        "replay": 0,
        "mask": 0x0,
        "recovery": 0,
        "links": 2,
        "p2p_links": {0},
        # nvmlEccSramErrorStatus: unc. parity, unc. SEC-DED, by unit (l2 sm pcie mcu other), flag
        "sram": (2, 3, (1, 4, 0, 0, 0), 1),
        # two ranks; the second's memory not reported (bindings turn ULL -1 into None)
        "procs": [(4242, 61_000 * 1024 * 1024), (4243, None)],
        "util": (97, 58),
    },
    {  # an older-bindings GPU: strings come back as bytes; no NVLink; throttled, pending remap
        "uuid": b"GPU-bbbb",
        "name": b"NVIDIA A100-SXM4-40GB",
        "bus": b"00000000:3B:00.0",
        "serial": b"1320000000001",
        "vbios": b"92.00.45.00.06",
        "total": 40960 * 1024 * 1024,
        "ecc": (1, 1),
        "sbe": (0, 0),
        "dbe": (1, 1),
        "dbe_sram": None,
        "dbe_dram": 1,
        "remap": (0, 3, 1, 1),
        "pcie": (3, 4, 8, 16),
        "replay": 17,
        "mask": 0x4 | 0x40,
        "recovery": 2,
        "links": 0,
        "p2p_links": set(),
        "sram": None,
        # older bindings pass NVML_VALUE_NOT_AVAILABLE through as 2**64 - 1
        "procs": [(5150, 2**64 - 1)],
        "util": (100, 0),
    },
]


class FakeSramStatus(ctypes.Structure):
    """nvidia-ml-py's c_nvmlEccSramErrorStatus_v1_t: nvml.h's layout; __init__ sets the version."""

    _fields_ = [
        ("version", ctypes.c_uint),
        *(
            (name, ctypes.c_ulonglong)
            for name in (
                "aggregateUncParity",
                "aggregateUncSecDed",
                "aggregateCor",
                "volatileUncParity",
                "volatileUncSecDed",
                "volatileCor",
                "aggregateUncBucketL2",
                "aggregateUncBucketSm",
                "aggregateUncBucketPcie",
                "aggregateUncBucketMcu",
                "aggregateUncBucketOther",
            )
        ),
        ("bThresholdExceeded", ctypes.c_uint),
    ]

    def __init__(self) -> None:
        super().__init__(version=SRAM_STATUS_V1)


# nvml.h: nvmlEccSramErrorStatus_v1 = NVML_STRUCT_VERSION(EccSramErrorStatus, 1), 104 bytes | 1 << 24
SRAM_STATUS_V1 = 0x1000068


def make_fake_nvml(gpus: list[dict] | None = None) -> SimpleNamespace:
    """A stand-in for the ``pynvml`` module over ``gpus``; ``lib.errors`` injects failures.

    ``lib.errors[(function name, gpu index or None)] = code`` makes that call raise NVMLError.
    """
    gpus = [dict(g) for g in (gpus or GPUS)]
    handles = [Handle(i) for i in range(len(gpus))]
    lib = SimpleNamespace(
        NVMLError=FakeNVMLError,
        errors={},
        calls=[],
        events=[],
        registered=[],
        NVML_ERROR_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_ERROR_GPU_IS_LOST=GPU_IS_LOST,
        NVML_FEATURE_DISABLED=0,
        NVML_FEATURE_ENABLED=1,
        NVML_TEMPERATURE_GPU=0,
        NVML_TEMPERATURE_THRESHOLD_SHUTDOWN=0,
        NVML_TEMPERATURE_THRESHOLD_SLOWDOWN=1,
        NVML_TEMPERATURE_THRESHOLD_MEM_MAX=2,
        NVML_TEMPERATURE_THRESHOLD_GPU_MAX=3,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        NVML_VOLATILE_ECC=0,
        NVML_AGGREGATE_ECC=1,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_MEMORY_LOCATION_DRAM=2,
        NVML_MEMORY_LOCATION_SRAM=7,
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        NVML_NVLINK_MAX_LINKS=36,
        NVML_NVLINK_ERROR_DL_REPLAY=0,
        NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2,
        NVML_FI_DEV_MEMORY_TEMP=82,
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=230,
        nvmlEventTypeXidCriticalError=0x8,
        c_nvmlEccSramErrorStatus_v1_t=FakeSramStatus,
        sram_versions=[],
    )

    def fake(name, gpu_arg=True):
        def decorate(body):
            def call(*args):
                gpu = args[0].index if gpu_arg and args and isinstance(args[0], Handle) else None
                lib.calls.append((name, gpu))
                code = lib.errors.get((name, gpu), lib.errors.get((name, None)))
                if code is not None:
                    raise FakeNVMLError(code)
                return body(*args)

            setattr(lib, name, call)
            return call

        return decorate

    fake("nvmlInit")(lambda: None)
    fake("nvmlShutdown")(lambda: None)
    fake("nvmlSystemGetDriverVersion")(lambda: b"550.54.15")
    fake("nvmlSystemGetCudaDriverVersion_v2")(lambda: 12040)
    fake("nvmlSystemGetNVMLVersion")(lambda: "12.550.54.15")
    fake("nvmlDeviceGetCount")(lambda: len(gpus))
    fake("nvmlDeviceGetHandleByIndex")(lambda i: handles[i])

    g = lambda h: gpus[h.index]  # noqa: E731
    fake("nvmlDeviceGetUUID")(lambda h: g(h)["uuid"])
    fake("nvmlDeviceGetName")(lambda h: g(h)["name"])
    fake("nvmlDeviceGetPciInfo")(lambda h: SimpleNamespace(busId=g(h)["bus"]))
    fake("nvmlDeviceGetSerial")(lambda h: g(h)["serial"])
    fake("nvmlDeviceGetVbiosVersion")(lambda h: g(h)["vbios"])
    fake("nvmlDeviceGetMemoryInfo")(lambda h: SimpleNamespace(total=g(h)["total"]))
    fake("nvmlDeviceGetTemperature")(lambda h, sensor: 41 + h.index)
    fake("nvmlDeviceGetTemperatureThreshold")(
        lambda h, kind: {0: 92, 1: 89, 3: 87}.get(kind) or _raise(NOT_SUPPORTED)
    )
    fake("nvmlDeviceGetPowerUsage")(lambda h: 312_456)
    fake("nvmlDeviceGetEnforcedPowerLimit")(lambda h: 700_000)
    fake("nvmlDeviceGetPowerManagementDefaultLimit")(lambda h: 700_000)
    fake("nvmlDeviceGetClockInfo")(lambda h, clock: {1: 1980, 2: 2619}[clock])
    fake("nvmlDeviceGetMaxClockInfo")(lambda h, clock: 1980)
    fake("nvmlDeviceGetCurrentClocksEventReasons")(lambda h: g(h)["mask"])
    fake("nvmlDeviceGetCurrPcieLinkGeneration")(lambda h: g(h)["pcie"][0])
    fake("nvmlDeviceGetMaxPcieLinkGeneration")(lambda h: g(h)["pcie"][1])
    fake("nvmlDeviceGetCurrPcieLinkWidth")(lambda h: g(h)["pcie"][2])
    fake("nvmlDeviceGetMaxPcieLinkWidth")(lambda h: g(h)["pcie"][3])
    fake("nvmlDeviceGetPcieReplayCounter")(lambda h: g(h)["replay"])
    fake("nvmlDeviceGetEccMode")(lambda h: list(g(h)["ecc"]))
    fake("nvmlDeviceGetTotalEccErrors")(
        lambda h, kind, counter: g(h)["sbe" if kind == 0 else "dbe"][counter]
    )

    def memory_error_counter(h, kind, counter, location):
        value = g(h)["dbe_sram" if location == 7 else "dbe_dram"]
        return _raise(NOT_SUPPORTED) if value is None else value

    fake("nvmlDeviceGetMemoryErrorCounter")(memory_error_counter)

    def sram_status(h, status_ref):
        status = status_ref._obj  # what ctypes.byref points at, as the C library writes it
        lib.sram_versions.append(status.version)
        if status.version != SRAM_STATUS_V1:
            _raise(ARGUMENT_VERSION_MISMATCH)
        if g(h)["sram"] is None:
            _raise(NOT_SUPPORTED)
        parity, secded, units, exceeded = g(h)["sram"]
        status.aggregateUncParity, status.aggregateUncSecDed = parity, secded
        (
            status.aggregateUncBucketL2,
            status.aggregateUncBucketSm,
            status.aggregateUncBucketPcie,
            status.aggregateUncBucketMcu,
            status.aggregateUncBucketOther,
        ) = units
        status.bThresholdExceeded = exceeded
        return 0

    fake("nvmlDeviceGetSramEccErrorStatus")(sram_status)
    fake("nvmlDeviceGetRetiredPages")(lambda h, cause: [0x1000, 0x2000][: cause + 1])
    fake("nvmlDeviceGetRetiredPagesPendingStatus")(lambda h: 0)
    fake("nvmlDeviceGetRemappedRows")(lambda h: g(h)["remap"])
    fake("nvmlDeviceGetPersistenceMode")(lambda h: 1 - h.index)

    def field_values(h, field_ids):
        values = []
        for fid in field_ids:
            n = {82: 55, 230: g(h)["recovery"]}.get(fid)
            values.append(
                SimpleNamespace(
                    fieldId=fid,
                    nvmlReturn=NOT_SUPPORTED if n is None else 0,
                    valueType=1,
                    value=SimpleNamespace(uiVal=n or 0),
                )
            )
        return values

    fake("nvmlDeviceGetFieldValues")(field_values)

    def nvlink_state(h, link):
        if g(h)["links"] == 0:
            _raise(NOT_SUPPORTED)
        return 1 if link < g(h)["links"] else _raise(INVALID_ARGUMENT)

    fake("nvmlDeviceGetNvLinkState")(nvlink_state)

    def nvlink_capability(h, link, capability):
        nvlink_state(h, link)
        return int(capability == 0 and link in g(h)["p2p_links"] or capability == 5)

    fake("nvmlDeviceGetNvLinkCapability")(nvlink_capability)
    fake("nvmlDeviceGetNvLinkErrorCounter")(
        lambda h, link, counter: _raise(NOT_SUPPORTED) if counter == 1 else 10 * link + counter
    )

    fake("nvmlDeviceGetComputeRunningProcesses_v3")(
        lambda h: [
            SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in g(h)["procs"]
        ]
    )
    fake("nvmlDeviceGetUtilizationRates")(
        lambda h: SimpleNamespace(gpu=g(h)["util"][0], memory=g(h)["util"][1])
    )

    fake("nvmlEventSetCreate")(lambda: "event-set")
    fake("nvmlDeviceRegisterEvents")(lambda h, kinds, event_set: lib.registered.append(h.index))

    def event_wait(event_set, timeout_ms):
        if lib.events:
            return lib.events.pop(0)
        time.sleep(min(timeout_ms, 2000) / 1000)
        _raise(TIMEOUT)

    fake("nvmlEventSetWait_v2", gpu_arg=False)(event_wait)
    fake("nvmlEventSetFree")(lambda event_set: None)
    lib.handles = handles
    return lib


def _raise(code: int):
    raise FakeNVMLError(code)


@pytest.fixture
def lib() -> SimpleNamespace:
    return make_fake_nvml()


@pytest.fixture
def backend(lib):
    backend = open_nvml(call_timeout_s=2.0, lib=lib)
    yield backend
    backend.close()


def gpu(backend: NvmlBackend, index: int) -> GpuDevice:
    return backend.devices()[index]


# -- contract --------------------------------------------------------------------------------------


def test_backend_and_devices_satisfy_the_gpu_contract(backend):
    assert isinstance(backend, GpuBackend)
    assert (backend.name, backend.simulated, backend.unavailable_reason) == ("nvml", False, None)
    devices = backend.devices()
    assert [d.index for d in devices] == [0, 1]
    assert all(isinstance(d, GpuDevice) for d in devices)


def test_devices_are_read_once_and_handles_cached(backend, lib):
    backend.devices()[0].temperature_c()
    backend.devices()[0].temperature_c()
    assert lib.calls.count(("nvmlDeviceGetCount", None)) == 1
    assert lib.calls.count(("nvmlDeviceGetHandleByIndex", None)) == 1


# -- values ---------------------------------------------------------------------------------------


def test_driver_info_formats_cuda_version_and_decodes_bytes(backend):
    info = backend.driver()
    assert (info.driver_version, info.cuda_version, info.nvml_version) == (
        "550.54.15",
        "12.4",
        "12.550.54.15",
    )


def test_cuda_version_falls_back_to_v1_when_v2_function_not_found(lib):
    lib.errors[("nvmlSystemGetCudaDriverVersion_v2", None)] = FUNCTION_NOT_FOUND
    lib.nvmlSystemGetCudaDriverVersion = lambda: 11080
    backend = open_nvml(lib=lib)
    assert backend.driver().cuda_version == "11.8"
    backend.close()


def test_identity_reads_str_and_decodes_bytes(backend):
    first, second = (d.identity() for d in backend.devices())
    assert (first.uuid, first.name, first.pci_bus_id, first.memory_total_mib) == (
        "GPU-aaaa",
        "NVIDIA H100 80GB HBM3",
        "00000000:1B:00.0",
        81559,
    )
    assert (second.index, second.uuid, second.name, second.pci_bus_id) == (
        1,
        "GPU-bbbb",
        "NVIDIA A100-SXM4-40GB",
        "00000000:3B:00.0",
    )
    assert (second.serial, second.vbios) == ("1320000000001", "92.00.45.00.06")


def test_identity_serial_and_vbios_are_none_when_not_supported(backend, lib):
    lib.errors[("nvmlDeviceGetSerial", 0)] = NOT_SUPPORTED
    lib.errors[("nvmlDeviceGetVbiosVersion", 0)] = NOT_SUPPORTED
    identity = gpu(backend, 0).identity()
    assert (identity.serial, identity.vbios, identity.uuid) == (None, None, "GPU-aaaa")


def test_ecc_counts_by_type_counter_and_location(backend):
    ecc0, ecc1 = (d.ecc() for d in backend.devices())
    assert ecc0.enabled is True
    assert (ecc0.volatile_sbe, ecc0.aggregate_sbe, ecc0.volatile_dbe, ecc0.aggregate_dbe) == (
        3,
        40,
        0,
        2,
    )
    assert (ecc0.aggregate_dbe_sram, ecc0.aggregate_dbe_dram) == (1, 1)
    assert (ecc1.aggregate_dbe_sram, ecc1.aggregate_dbe_dram) == (None, 1)


def test_ecc_reads_the_sram_status_as_a_sum_a_flag_and_units(backend, lib):
    ecc0, ecc1 = (d.ecc() for d in backend.devices())
    # aggregateUncParity + aggregateUncSecDed; bThresholdExceeded; aggregateUncBucket*
    assert (ecc0.sram_uncorrectable_aggregate, ecc0.sram_threshold_exceeded) == (5, True)
    assert ecc0.sram_uncorrectable_by_unit == {"l2": 1, "sm": 4, "pcie": 0, "mcu": 0, "other": 0}
    # a GPU that does not report it (pre-Ampere): not reported, the other counters still read
    assert (
        ecc1.sram_uncorrectable_aggregate,
        ecc1.sram_threshold_exceeded,
        ecc1.sram_uncorrectable_by_unit,
    ) == (None, None, {})
    assert ecc1.aggregate_dbe_dram == 1
    assert lib.sram_versions == [SRAM_STATUS_V1, SRAM_STATUS_V1]


def test_ecc_without_root_reads_the_counters_but_not_the_sram_status(backend, lib, caplog):
    lib.errors[("nvmlDeviceGetSramEccErrorStatus", None)] = NO_PERMISSION
    with caplog.at_level(logging.INFO, logger="node_agent.gpu.nvml"):
        ecc0, _ = (d.ecc() for d in backend.devices())
    assert (
        ecc0.aggregate_dbe,
        ecc0.sram_uncorrectable_aggregate,
        ecc0.sram_threshold_exceeded,
    ) == (2, None, None)
    assert sum("SRAM ECC status not read" in r.getMessage() for r in caplog.records) == 1


def test_a_lost_gpu_in_the_sram_call_is_a_lost_gpu_not_a_missing_value(backend, lib):
    lib.errors[("nvmlDeviceGetSramEccErrorStatus", 0)] = GPU_IS_LOST
    with pytest.raises(DeviceLost, match="nvmlDeviceGetSramEccErrorStatus on GPU 0"):
        gpu(backend, 0).ecc()


def test_sram_status_not_reported_with_a_binding_that_lacks_its_struct(lib):
    del lib.c_nvmlEccSramErrorStatus_v1_t  # nvidia-ml-py 12.535, the minimum pyproject allows
    backend = open_nvml(lib=lib)
    ecc = gpu(backend, 0).ecc()
    assert (ecc.aggregate_dbe, ecc.sram_threshold_exceeded) == (2, None)
    assert ("nvmlDeviceGetSramEccErrorStatus", 0) not in lib.calls
    backend.close()


def test_sram_status_version_is_set_where_the_binding_struct_leaves_it_zero(lib):
    class Unversioned(FakeSramStatus):
        def __init__(self) -> None:
            ctypes.Structure.__init__(self)

    lib.c_nvmlEccSramErrorStatus_v1_t = Unversioned
    backend = open_nvml(lib=lib)
    assert gpu(backend, 0).ecc().sram_uncorrectable_aggregate == 5
    assert lib.sram_versions == [SRAM_STATUS_V1]  # nvml.h's nvmlEccSramErrorStatus_v1
    backend.close()


def test_row_remap_flags_become_bools(backend):
    remap = gpu(backend, 1).row_remap()
    assert (remap.corrected, remap.uncorrected, remap.pending, remap.failed) == (0, 3, True, True)
    assert gpu(backend, 0).row_remap().pending is False


def test_pcie_reports_degraded_link_and_replays(backend):
    link = gpu(backend, 1).pcie()
    assert (link.gen_current, link.gen_max, link.width_current, link.width_max) == (3, 4, 8, 16)
    assert link.replay_count == 17


def test_throttle_mask_becomes_reason_names(backend):
    assert gpu(backend, 0).throttle_reasons() == frozenset()
    assert gpu(backend, 1).throttle_reasons() == {"sw_power_cap", "hw_thermal_slowdown"}


def test_throttle_reasons_fall_back_to_older_function_name(lib):
    del lib.nvmlDeviceGetCurrentClocksEventReasons
    lib.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x8
    backend = open_nvml(lib=lib)
    assert gpu(backend, 0).throttle_reasons() == {"hw_slowdown"}
    backend.close()


def test_recovery_action_is_named_and_unknown_values_kept(backend, lib):
    assert gpu(backend, 0).recovery_action() == "none"
    assert gpu(backend, 1).recovery_action() == "node_reboot"
    lib.nvmlDeviceGetFieldValues = lambda h, ids: [
        SimpleNamespace(nvmlReturn=0, valueType=1, value=SimpleNamespace(uiVal=99))
    ]
    assert gpu(backend, 0).recovery_action() == "unknown_99"


def test_field_value_not_supported_in_its_return_code(backend, lib):
    lib.nvmlDeviceGetFieldValues = lambda h, ids: [
        SimpleNamespace(nvmlReturn=NOT_FOUND, valueType=1, value=SimpleNamespace(uiVal=0))
    ]
    with pytest.raises(NotSupported, match="NVML_FI_DEV_GET_GPU_RECOVERY_ACTION.*GPU 0"):
        gpu(backend, 0).recovery_action()


def test_temperatures_power_clocks_and_persistence(backend):
    dev = gpu(backend, 0)
    assert dev.temperature_c() == 41
    assert dev.memory_temperature_c() == 55
    thresholds = dev.temperature_thresholds()
    assert (
        thresholds.shutdown_c,
        thresholds.slowdown_c,
        thresholds.gpu_max_operating_c,
        thresholds.memory_max_operating_c,
    ) == (92, 89, 87, None)
    power = dev.power()
    assert (power.usage_w, power.enforced_limit_w, power.default_limit_w) == (312.456, 700, 700)
    clocks = dev.clocks()
    assert (clocks.sm_mhz, clocks.sm_max_mhz, clocks.memory_mhz) == (1980, 1980, 2619)
    assert dev.persistence_mode() is True
    assert gpu(backend, 1).persistence_mode() is False


def test_temperature_thresholds_not_supported_when_none_reported(backend, lib):
    lib.errors[("nvmlDeviceGetTemperatureThreshold", 0)] = NOT_SUPPORTED
    with pytest.raises(NotSupported, match="nvmlDeviceGetTemperatureThreshold"):
        gpu(backend, 0).temperature_thresholds()


def test_retired_pages_counts_and_pending(backend):
    pages = gpu(backend, 0).retired_pages()
    assert (pages.sbe, pages.dbe, pages.pending) == (1, 2, False)


def test_nvlinks_list_existing_links_and_none_for_unsupported_counters(backend):
    assert gpu(backend, 0).nvlinks() == [
        NvLink(
            link=0,
            active=True,
            replay_errors=0,
            recovery_errors=None,
            crc_errors=2,
            p2p_supported=True,
        ),
        NvLink(
            link=1,
            active=True,
            replay_errors=10,
            recovery_errors=None,
            crc_errors=12,
            p2p_supported=False,
        ),
    ]


def test_nvlink_p2p_reads_false_where_the_capability_is_not_reported(backend, lib):
    lib.errors[("nvmlDeviceGetNvLinkCapability", 0)] = NOT_SUPPORTED
    links = gpu(backend, 0).nvlinks()
    assert [(link.link, link.active, link.p2p_supported) for link in links] == [
        (0, True, False),
        (1, True, False),
    ]


def test_nvlinks_empty_when_gpu_has_no_nvlink(backend):
    assert gpu(backend, 1).nvlinks() == []


def test_compute_processes_list_pids_and_memory_or_none(backend):
    assert gpu(backend, 0).compute_processes() == [
        GpuProcess(pid=4242, used_memory_bytes=61_000 * 1024 * 1024),
        GpuProcess(pid=4243, used_memory_bytes=None),
    ]
    assert gpu(backend, 1).compute_processes() == [GpuProcess(pid=5150, used_memory_bytes=None)]


def test_compute_processes_empty_when_none_run(lib):
    lib.nvmlDeviceGetComputeRunningProcesses_v3 = lambda h: []
    backend = open_nvml(lib=lib)
    assert gpu(backend, 0).compute_processes() == []
    backend.close()


def test_compute_processes_fall_back_to_v2_on_an_older_driver(lib):
    lib.errors[("nvmlDeviceGetComputeRunningProcesses_v3", None)] = FUNCTION_NOT_FOUND
    lib.nvmlDeviceGetComputeRunningProcesses_v2 = lambda h: [
        SimpleNamespace(pid=7, usedGpuMemory=1024)
    ]
    backend = open_nvml(lib=lib)
    assert gpu(backend, 0).compute_processes() == [GpuProcess(pid=7, used_memory_bytes=1024)]
    backend.close()


def test_compute_processes_no_permission_and_lost_gpu_are_errors_not_empty(backend, lib):
    lib.errors[("nvmlDeviceGetComputeRunningProcesses_v3", 0)] = NO_PERMISSION
    lib.errors[("nvmlDeviceGetComputeRunningProcesses_v3", 1)] = GPU_IS_LOST
    with pytest.raises(NoPermission, match="nvmlDeviceGetComputeRunningProcesses_v3 on GPU 0"):
        gpu(backend, 0).compute_processes()
    with pytest.raises(DeviceLost, match="on GPU 1"):
        gpu(backend, 1).compute_processes()


def test_utilization_reads_gpu_and_memory_percent(backend):
    assert gpu(backend, 0).utilization() == Utilization(gpu_pct=97, memory_pct=58)
    assert gpu(backend, 1).utilization() == Utilization(gpu_pct=100, memory_pct=0)


def test_utilization_not_supported_names_the_function(backend, lib):
    lib.errors[("nvmlDeviceGetUtilizationRates", 1)] = NOT_SUPPORTED
    with pytest.raises(NotSupported, match="nvmlDeviceGetUtilizationRates on GPU 1"):
        gpu(backend, 1).utilization()


def test_new_readings_fail_fast_once_the_driver_is_wedged(lib, release):
    backend = open_nvml(call_timeout_s=0.2, lib=lib)
    lib.nvmlDeviceGetUtilizationRates = lambda h: release.wait(30)
    with pytest.raises(GpuTimeout, match="nvmlDeviceGetUtilizationRates on GPU 0 did not return"):
        gpu(backend, 0).utilization()
    started = time.monotonic()
    with pytest.raises(
        GpuTimeout,
        match="^skipped nvmlDeviceGetComputeRunningProcesses_v3 "
        "on GPU 0: NVML call nvmlDeviceGetUtilizationRates",
    ):
        gpu(backend, 0).compute_processes()
    assert time.monotonic() - started < 0.1
    backend.close()


# -- errors ---------------------------------------------------------------------------------------


def test_not_supported_names_function_and_gpu(backend, lib):
    lib.errors[("nvmlDeviceGetRemappedRows", 1)] = NOT_SUPPORTED
    with pytest.raises(NotSupported, match="nvmlDeviceGetRemappedRows on GPU 1") as caught:
        gpu(backend, 1).row_remap()
    assert isinstance(caught.value.__cause__, FakeNVMLError)


def test_unsupported_function_is_logged_once(backend, lib, caplog):
    lib.errors[("nvmlDeviceGetPersistenceMode", None)] = NOT_SUPPORTED
    with caplog.at_level(logging.INFO, logger="node_agent.gpu.nvml"):
        for dev in backend.devices() * 3:
            with pytest.raises(NotSupported):
                dev.persistence_mode()
    assert sum("nvmlDeviceGetPersistenceMode" in r.getMessage() for r in caplog.records) == 1


def test_gpu_is_lost_becomes_device_lost(backend, lib):
    lib.errors[("nvmlDeviceGetTemperature", 0)] = GPU_IS_LOST
    with pytest.raises(DeviceLost, match="nvmlDeviceGetTemperature on GPU 0"):
        gpu(backend, 0).temperature_c()
    assert gpu(backend, 1).temperature_c() == 42


def test_no_permission_becomes_no_permission(backend, lib):
    lib.errors[("nvmlDeviceGetRetiredPages", 1)] = NO_PERMISSION
    with pytest.raises(NoPermission, match="nvmlDeviceGetRetiredPages on GPU 1.*root"):
        gpu(backend, 1).retired_pages()


def test_other_nvml_errors_become_gpu_error(backend, lib):
    lib.errors[("nvmlDeviceGetPowerUsage", 0)] = 8  # insufficient power: the GPU's own
    with pytest.raises(GpuError, match="nvmlDeviceGetPowerUsage on GPU 0") as caught:
        gpu(backend, 0).power()
    assert type(caught.value) is GpuError


@pytest.mark.parametrize("code", [999, 16, 17, 18])
def test_the_drivers_or_containers_state_is_a_driver_state_error(backend, lib, code):
    """Unknown Error, reset required, blocked by the OS, a version mismatch: not the GPU's."""
    lib.errors[("nvmlDeviceGetPowerUsage", 0)] = code
    with pytest.raises(DriverStateError, match="nvmlDeviceGetPowerUsage on GPU 0"):
        gpu(backend, 0).power()


def test_missing_function_is_not_supported(backend, lib):
    del lib.nvmlDeviceGetRemappedRows
    with pytest.raises(NotSupported, match="nvmlDeviceGetRemappedRows on GPU 0"):
        gpu(backend, 0).row_remap()


# -- hung driver ----------------------------------------------------------------------------------


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # let the abandoned worker thread finish


def test_hung_call_times_out_then_later_calls_fail_fast(lib, release):
    backend = open_nvml(call_timeout_s=0.2, lib=lib)
    lib.nvmlDeviceGetTemperature = lambda h, sensor: release.wait(30)
    dev = gpu(backend, 0)
    started = time.monotonic()
    with pytest.raises(
        GpuTimeout,
        match="nvmlDeviceGetTemperature on GPU 0 did not return "
        "within 0.2 s; the driver may be hung",
    ):
        dev.temperature_c()
    assert time.monotonic() - started < 1.5

    started = time.monotonic()
    with pytest.raises(
        GpuTimeout, match="^skipped nvmlDevice.* on GPU 0: NVML call nvmlDeviceGetTemperature"
    ):
        dev.power()
    assert time.monotonic() - started < 0.1
    backend.close()  # must not wait on the hung call
    assert time.monotonic() - started < 0.5


def test_close_is_idempotent_and_shuts_nvml_down(lib):
    backend = open_nvml(lib=lib)
    backend.close()
    backend.close()
    assert lib.calls.count(("nvmlShutdown", None)) == 1
    with pytest.raises(GpuError, match="closed"):
        backend.driver()


# -- opening --------------------------------------------------------------------------------------


def test_missing_driver_library_is_unavailable_with_reason(lib):
    lib.errors[("nvmlInit", None)] = LIBRARY_NOT_FOUND
    with pytest.raises(NvmlUnavailable, match=r"^no NVIDIA driver: libnvidia-ml.so.1 not found"):
        open_nvml(lib=lib)


def test_unloaded_driver_is_unavailable_with_reason(lib):
    lib.errors[("nvmlInit", None)] = DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailable, match=r"^no NVIDIA driver: .*kernel module"):
        open_nvml(lib=lib)


def test_missing_bindings_are_unavailable_with_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py not installed"):
        open_nvml()


# -- Xid events -----------------------------------------------------------------------------------


def test_xid_event_maps_device_handle_to_gpu_index(backend, lib):
    lib.events.append(SimpleNamespace(device=lib.handles[1], eventType=0x8, eventData=79))
    assert backend.wait_xid_events(timeout_s=1.0) == [
        XidEvent(gpu_index=1, code=79, message="Xid 79 on GPU 1 (NVML event)")
    ]
    assert lib.registered == [0, 1]


def test_xid_wait_returns_empty_list_on_timeout(backend):
    started = time.monotonic()
    assert backend.wait_xid_events(timeout_s=0.05) == []
    assert time.monotonic() - started < 1.0


def test_xid_events_skip_gpus_that_do_not_support_them(backend, lib):
    lib.errors[("nvmlDeviceRegisterEvents", 0)] = NOT_SUPPORTED
    lib.events.append(SimpleNamespace(device=lib.handles[1], eventType=0x8, eventData=48))
    assert [(e.gpu_index, e.code) for e in backend.wait_xid_events(0.5)] == [(1, 48)]
    assert lib.registered == [1]


def test_xid_events_not_supported_when_no_gpu_reports_them(backend, lib):
    lib.errors[("nvmlDeviceRegisterEvents", None)] = NOT_SUPPORTED
    with pytest.raises(NotSupported, match="kernel log"):
        backend.wait_xid_events(0.05)


def test_xid_wait_does_not_block_other_queries(backend, lib):
    waiting = threading.Thread(target=backend.wait_xid_events, args=(0.5,), daemon=True)
    backend.devices()
    waiting.start()
    time.sleep(0.02)
    started = time.monotonic()
    assert gpu(backend, 0).temperature_c() == 41
    assert time.monotonic() - started < 0.2
    waiting.join(2)
