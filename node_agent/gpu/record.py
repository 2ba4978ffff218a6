"""This node's NVML, read call by call and written down in the stand-in's state keys.

``node-agent capture`` (docs/capture.md) calls NVML through the NVML backend's one choke point
(each call on its own timed thread; a hung driver cannot hang the capture) and records, for
every call and argument, the value NVML returned or the NVML error it answered
(``{error: "Not Supported", code: 3}``): Not Supported stays Not Supported when the capture is
replayed (:mod:`node_agent.gpu.replay`). Keys are the stand-in library's state keys
(docs/nvml_fake.md), so the same record drives ``--simulate`` and ``NVML_FAKE_SCENARIO``.

Whatever NVML returns is data: an odd string, a value out of range, a binding that raises
something other than ``NVMLError`` are recorded (the last as ``code: 999`` with what it said),
never a crash.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from node_agent.gpu.base import DeviceLost, GpuError, GpuTimeout, NoPermission, NotSupported
from node_agent.gpu.nvml import NvmlBackend, NvmlUnavailable, open_nvml
from node_agent.gpu.replay import recorded_error

_UNKNOWN = 999
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_GPU_IS_LOST = 15
_FIELD_BATCH = 64
_FIELD_MAX_FALLBACK = 256  # nvidia-ml-py releases without NVML_FI_MAX
_VALUE_NOT_AVAILABLE_ULL = 2**64 - 1
#: nvmlFieldValue_t's value member per nvmlValueType_t, and the stand-in's name for the type
_FIELD_TYPES = (
    ("double", "dVal"),
    ("uint", "uiVal"),
    ("ulong", "ulVal"),
    ("ulonglong", "ullVal"),
    ("slonglong", "sllVal"),
    ("sint", "siVal"),
    ("ushort", "usVal"),
)
_ECC_LOCATIONS = ("l1", "l2", "dram", "register_file", "texture", "texture_shm", "cbu", "sram")
_THRESHOLDS = ("shutdown", "slowdown", "mem_max", "gpu_max")
_CLOCKS = ("graphics", "sm", "mem", "video")
_NVLINK_COUNTERS = ("replay", "recovery", "crc_flit")
_NVLINK_CAPS = (0, 5)  # NVML_NVLINK_CAP_P2P_SUPPORTED, NVML_NVLINK_CAP_VALID


def _code(err: BaseException) -> int:
    """The nvmlReturn_t behind a backend error (the NVMLError it was translated from)."""
    value = getattr(err.__cause__, "value", None)
    if isinstance(value, int):
        return value
    if isinstance(err, GpuTimeout):
        return 10
    if isinstance(err, NotSupported):
        return 13  # the only NotSupported without an NVMLError: no such function here
    if isinstance(err, DeviceLost):
        return _GPU_IS_LOST
    if isinstance(err, NoPermission):
        return 4
    return _UNKNOWN


def _failure(err: BaseException) -> dict[str, Any]:
    if isinstance(err, GpuError):
        return recorded_error(_code(err))
    return {"error": f"{type(err).__name__}: {err}"[:200], "code": _UNKNOWN}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Recorder:
    """One section's keys: ``put(key, read)`` stores ``read()``'s value or the error."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}

    def put(self, key: str, read: Callable[..., Any]) -> Any:
        try:
            value = read()
        except Exception as err:  # noqa: BLE001 - every answer is data, a crash is none
            self.keys[key] = _failure(err)
            return None
        self.keys[key] = value
        return value

    def put_many(self, keys: Sequence[str], read: Callable[[], Sequence[Any]]) -> None:
        """One call answering several keys; its error goes on the first (the stand-in's
        rule: the call's primary key decides)."""
        try:
            values = read()
        except Exception as err:  # noqa: BLE001
            self.keys[keys[0]] = _failure(err)
            return
        for key, value in zip(keys, values, strict=False):
            if value is not None:
                self.keys[key] = value


def record_system(backend: NvmlBackend) -> dict[str, Any]:
    """The global keys: driver, NVML and CUDA versions."""
    r = _Recorder()
    call = backend.call
    r.put("driver_version", lambda: _text(call("nvmlSystemGetDriverVersion")))
    r.put("nvml_version", lambda: _text(call("nvmlSystemGetNVMLVersion")))
    r.put(
        "cuda_driver_version",
        lambda: int(call(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"))),
    )
    return r.keys


def record_gpu(backend: NvmlBackend, index: int) -> dict[str, Any]:
    """GPU ``index``'s keys, call by call (docs/nvml_fake.md names each key's NVML call)."""
    lib = backend.lib
    try:
        handle = backend.call("nvmlDeviceGetHandleByIndex", index, gpu=index)
    except GpuError as err:
        if _code(err) == _GPU_IS_LOST:
            return {"lost": 1}
        failure = _failure(err)
        return {key: failure for key in ("name", "uuid", "pci.bus_id")}
    r = _Recorder()

    def call(names: str | Sequence[str], *args: Any) -> Any:
        return backend.call(names, handle, *args, gpu=index)

    def const(name: str, default: int) -> int:
        return int(getattr(lib, name, default))

    for key, fn in (
        ("name", "nvmlDeviceGetName"),
        ("uuid", "nvmlDeviceGetUUID"),
        ("serial", "nvmlDeviceGetSerial"),
        ("vbios", "nvmlDeviceGetVbiosVersion"),
    ):
        r.put(key, lambda fn=fn: _text(call(fn)))

    def pci() -> list[Any]:
        info = call("nvmlDeviceGetPciInfo")
        return [_text(info.busId), int(info.pciDeviceId), int(info.pciSubSystemId)]

    r.put_many(("pci.bus_id", "pci.device_id", "pci.subsystem_id"), pci)

    def memory() -> list[Any]:
        info = call("nvmlDeviceGetMemoryInfo")
        return [int(info.total), int(info.used)]

    r.put_many(("memory.total", "memory.used"), memory)
    r.put("minor_number", lambda: int(call("nvmlDeviceGetMinorNumber")))
    r.put("architecture", lambda: int(call("nvmlDeviceGetArchitecture")))
    r.put(
        "cuda_compute_capability",
        lambda: " ".join(str(int(v)) for v in call("nvmlDeviceGetCudaComputeCapability")),
    )
    r.put("virtualization_mode", lambda: int(call("nvmlDeviceGetVirtualizationMode")))
    r.put(
        "temperature.gpu",
        lambda: int(
            call(
                ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                const("NVML_TEMPERATURE_GPU", 0),
            )
        ),
    )
    for kind, name in enumerate(_THRESHOLDS):
        r.put(
            f"temperature.threshold.{name}",
            lambda kind=kind: int(call("nvmlDeviceGetTemperatureThreshold", kind)),
        )
    for key, fn in (
        ("power.usage", "nvmlDeviceGetPowerUsage"),
        ("power.enforced_limit", "nvmlDeviceGetEnforcedPowerLimit"),
        ("power.limit", "nvmlDeviceGetPowerManagementLimit"),
        ("power.default_limit", "nvmlDeviceGetPowerManagementDefaultLimit"),
        ("pcie.gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie.gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ("pcie.width", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie.width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
        ("pcie.replay_counter", "nvmlDeviceGetPcieReplayCounter"),
        ("retired_pages.pending", "nvmlDeviceGetRetiredPagesPendingStatus"),
        ("persistence_mode", "nvmlDeviceGetPersistenceMode"),
        ("event_types", "nvmlDeviceGetSupportedEventTypes"),
    ):
        r.put(key, lambda fn=fn: int(call(fn)))
    for kind, name in enumerate(_CLOCKS):
        r.put(f"clock.{name}", lambda kind=kind: int(call("nvmlDeviceGetClockInfo", kind)))
        r.put(f"clock_max.{name}", lambda kind=kind: int(call("nvmlDeviceGetMaxClockInfo", kind)))
    r.put(
        "clocks_event_reasons",
        lambda: (
            f"{int(call(('nvmlDeviceGetCurrentClocksEventReasons', 'nvmlDeviceGetCurrentClocksThrottleReasons'))):#x}"
        ),
    )
    r.put(
        "clocks_event_reasons_supported",
        lambda: (
            f"{int(call(('nvmlDeviceGetSupportedClocksEventReasons', 'nvmlDeviceGetSupportedClocksThrottleReasons'))):#x}"
        ),
    )
    r.put("utilization", lambda: "{0.gpu} {0.memory}".format(call("nvmlDeviceGetUtilizationRates")))
    _record_ecc(r, call)
    for cause, name in enumerate(("sbe", "dbe")):
        r.put(
            f"retired_pages.{name}",
            lambda cause=cause: len(call("nvmlDeviceGetRetiredPages", cause)),
        )
    r.put("remapped_rows", lambda: " ".join(str(int(v)) for v in call("nvmlDeviceGetRemappedRows")))
    _record_nvlinks(r, call, const("NVML_NVLINK_MAX_LINKS", 18))
    _record_processes(r, call)
    _record_fields(r, call, lib, const("NVML_FI_MAX", _FIELD_MAX_FALLBACK))
    return r.keys


def _record_ecc(r: _Recorder, call: Callable[..., Any]) -> None:
    r.put("ecc.mode", lambda: " ".join(str(int(v)) for v in call("nvmlDeviceGetEccMode")))
    for error_type, kind in enumerate(("corrected", "uncorrected")):
        for counter, which in enumerate(("volatile", "aggregate")):
            r.put(
                f"ecc.{kind}.{which}",
                lambda t=error_type, c=counter: int(call("nvmlDeviceGetTotalEccErrors", t, c)),
            )
            for location, where in enumerate(_ECC_LOCATIONS):
                r.put(
                    f"ecc.{kind}.{which}.{where}",
                    lambda t=error_type, c=counter, loc=location: int(
                        call("nvmlDeviceGetMemoryErrorCounter", t, c, loc)
                    ),
                )

    def sram() -> list[Any]:
        import pynvml

        struct = getattr(pynvml, "c_nvmlEccSramErrorStatus_v1_t", None)
        if struct is None:
            raise NotSupported("this nvidia-ml-py has no c_nvmlEccSramErrorStatus_v1_t")
        status = struct()
        if not status.version:
            status.version = ctypes.sizeof(status) | (1 << 24)
        call("nvmlDeviceGetSramEccErrorStatus", ctypes.byref(status))
        return [
            f"{status.aggregateUncParity} {status.aggregateUncSecDed} {status.aggregateCor}",
            f"{status.volatileUncParity} {status.volatileUncSecDed} {status.volatileCor}",
            f"{status.aggregateUncBucketL2} {status.aggregateUncBucketSm} "
            f"{status.aggregateUncBucketPcie} {status.aggregateUncBucketMcu} "
            f"{status.aggregateUncBucketOther}",
            int(bool(status.bThresholdExceeded)),
        ]

    r.put_many(
        (
            "ecc_sram.aggregate",
            "ecc_sram.volatile",
            "ecc_sram.aggregate_by_unit",
            "ecc_sram.threshold_exceeded",
        ),
        sram,
    )


def _record_nvlinks(r: _Recorder, call: Callable[..., Any], max_links: int) -> None:
    """Each link index's state; where it answers, its capabilities and error counters. An
    index NVML calls an invalid argument (past the GPU's links) is left out, as the stand-in
    answers for an index it does not describe."""
    for link in range(max_links):
        key = f"nvlink.{link}.state"
        r.put(key, lambda link=link: int(call("nvmlDeviceGetNvLinkState", link)))
        state = r.keys[key]
        if isinstance(state, dict):
            if state.get("code") == _INVALID_ARGUMENT:
                del r.keys[key]
            continue
        for cap in _NVLINK_CAPS:
            r.put(
                f"nvlink.{link}.cap.{cap}",
                lambda link=link, cap=cap: int(call("nvmlDeviceGetNvLinkCapability", link, cap)),
            )
        for counter, name in enumerate(_NVLINK_COUNTERS):
            r.put(
                f"nvlink.{link}.error.{name}",
                lambda link=link, counter=counter: int(
                    call("nvmlDeviceGetNvLinkErrorCounter", link, counter)
                ),
            )


def _record_processes(r: _Recorder, call: Callable[..., Any]) -> None:
    def processes() -> list[str]:
        out = []
        for p in (
            call(
                (
                    "nvmlDeviceGetComputeRunningProcesses_v3",
                    "nvmlDeviceGetComputeRunningProcesses_v2",
                    "nvmlDeviceGetComputeRunningProcesses",
                )
            )
            or []
        ):
            used = getattr(p, "usedGpuMemory", None)
            out.append(
                f"{int(p.pid)} "
                f"{'na' if used is None or int(used) >= _VALUE_NOT_AVAILABLE_ULL else int(used)}"
            )
        return out

    r.put("process", processes)
    if r.keys["process"] == []:
        del r.keys["process"]  # none running: the stand-in lists none without the key


def _record_fields(r: _Recorder, call: Callable[..., Any], lib: Any, field_max: int) -> None:
    """Every field id below NVML_FI_MAX is asked, each with its own value or nvmlReturn. Ids
    answering Not Supported are left out (most of the ~300, on any GPU): in a scan of every
    id, an absent one answered Not Supported, which is what the replay answers for it."""
    ids = list(range(1, field_max))
    for start in range(0, len(ids), _FIELD_BATCH):
        batch = ids[start : start + _FIELD_BATCH]
        try:
            values = call("nvmlDeviceGetFieldValues", batch)
        except Exception as err:  # noqa: BLE001 - the whole call failed: each field says so
            failure = _failure(err)
            for field_id in batch:
                r.keys[f"field.{field_id}"] = failure
            continue
        for field_id, value in zip(batch, values, strict=False):
            key = f"field.{field_id}"
            if value.nvmlReturn == _NOT_SUPPORTED:
                continue
            if value.nvmlReturn != 0:
                r.keys[key] = recorded_error(int(value.nvmlReturn))
            elif 0 <= value.valueType < len(_FIELD_TYPES):
                kind, member = _FIELD_TYPES[value.valueType]
                r.keys[key] = f"{kind} {getattr(value.value, member)}"
            else:
                r.keys[key] = {
                    "error": f"unknown nvmlValueType_t {value.valueType}",
                    "code": _UNKNOWN,
                }


def record_nvml(call_timeout_s: float = 10.0, lib: Any = None) -> dict[str, Any]:
    """This node's NVML as a capture's ``nvml`` section: ``system`` and one mapping per GPU
    NVML enumerates. NVML that does not load is recorded as ``nvmlInit``'s error."""
    try:
        backend = open_nvml(call_timeout_s=call_timeout_s, lib=lib)
    except NvmlUnavailable as err:
        cause = err.__cause__
        code = _code(cause) if isinstance(cause, GpuError) else 12
        return {"system": {"nvmlInit": recorded_error(code)}, "gpus": []}
    try:
        system = record_system(backend)
        try:
            count = int(backend.call("nvmlDeviceGetCount"))
        except GpuError as err:
            system["nvmlDeviceGetCount"] = _failure(err)
            count = 0
        return {"system": system, "gpus": [record_gpu(backend, i) for i in range(count)]}
    finally:
        backend.close()
