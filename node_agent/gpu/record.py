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
from node_agent.gpu.nvml import NvmlBackend, NvmlUnavailable, open_nvml, query_fabric
from node_agent.gpu.nvml_calls import CALLS, FIELDS, Call, fabric_value, recorded_value
from node_agent.gpu.replay import recorded_error

_UNKNOWN = 999
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


def _record_table(
    r: _Recorder, call: Callable[..., Any], calls: Sequence[Call], system: bool
) -> None:
    """Every table call of this scope, in the table's order, for each recorded argument;
    a custom call through its hand-written recorder (``_CUSTOM``)."""
    link_calls = [c for c in calls if any(a.link for a in c.args) and c.record]
    first_link = link_calls[0] if link_calls else None
    for c in calls:
        if c.system != system or not c.record:
            continue
        if c.custom:
            custom = _CUSTOM.get(c.function)
            if custom is not None:
                custom(r, call)
        elif c is first_link:
            _record_nvlinks(r, call, link_calls)
        elif c not in link_calls:
            for values, key in c.keys():
                r.put(
                    key,
                    lambda c=c, values=values: recorded_value(c, call(c.newer + c.names, *values)),
                )


def record_system(backend: NvmlBackend, calls: Sequence[Call] = CALLS) -> dict[str, Any]:
    """The global keys: driver, NVML and CUDA versions."""
    r = _Recorder()
    _record_table(r, backend.call, calls, system=True)
    return r.keys


def record_gpu(backend: NvmlBackend, index: int, calls: Sequence[Call] = CALLS) -> dict[str, Any]:
    """GPU ``index``'s keys, call by call, as the NVML call table (gpu/nvml_calls.py) names
    them."""
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

    _record_table(r, call, calls, system=False)
    _record_fields(r, call, lib, int(getattr(lib, "NVML_FI_MAX", _FIELD_MAX_FALLBACK)))
    return r.keys


def _record_pci(r: _Recorder, call: Callable[..., Any]) -> None:
    def pci() -> list[Any]:
        info = call("nvmlDeviceGetPciInfo")
        return [_text(info.busId), int(info.pciDeviceId), int(info.pciSubSystemId)]

    r.put_many(("pci.bus_id", "pci.device_id", "pci.subsystem_id"), pci)


def _record_memory(r: _Recorder, call: Callable[..., Any]) -> None:
    def memory() -> list[Any]:
        info = call("nvmlDeviceGetMemoryInfo")
        return [int(info.total), int(info.used)]

    r.put_many(("memory.total", "memory.used"), memory)


def _record_retired_pages(r: _Recorder, call: Callable[..., Any]) -> None:
    for cause, name in enumerate(("sbe", "dbe")):
        r.put(
            f"retired_pages.{name}",
            lambda cause=cause: len(call("nvmlDeviceGetRetiredPages", cause)),
        )


def _record_sram(r: _Recorder, call: Callable[..., Any]) -> None:
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


def _record_fabric(r: _Recorder, call: Callable[..., Any]) -> None:
    import pynvml

    r.put("fabric", lambda: fabric_value(query_fabric(call, pynvml)))


def _record_nvlinks(r: _Recorder, call: Callable[..., Any], link_calls: Sequence[Call]) -> None:
    """Each link index's state (the first NVLink call of the table); where it answers, the
    other NVLink calls on it. An index NVML calls an invalid argument (past the GPU's links) is
    left out, as the stand-in answers for an index it does not describe."""
    state, *others = link_calls
    for (link,), key in state.keys():
        r.put(key, lambda link=link: recorded_value(state, call(state.names, link)))
        value = r.keys[key]
        if isinstance(value, dict):
            if value.get("code") in state.omit:
                del r.keys[key]
            continue
        for c in others:
            for values, other in c.keys():
                if values[0] == link:
                    r.put(other, lambda c=c, v=values: recorded_value(c, call(c.names, *v)))


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


_CUSTOM: dict[str, Callable[[_Recorder, Callable[..., Any]], None]] = {
    "nvmlDeviceGetPciInfo": _record_pci,
    "nvmlDeviceGetMemoryInfo": _record_memory,
    "nvmlDeviceGetSramEccErrorStatus": _record_sram,
    "nvmlDeviceGetRetiredPages": _record_retired_pages,
    "nvmlDeviceGetComputeRunningProcesses": _record_processes,
    "nvmlDeviceGetGpuFabricInfoV": _record_fabric,
}


def _record_fields(r: _Recorder, call: Callable[..., Any], lib: Any, field_max: int) -> None:
    """Every field id below NVML_FI_MAX is asked, each with its own value or nvmlReturn. Ids
    answering Not Supported are left out (most of the ~300, on any GPU): in a scan of every
    id, an absent one answered Not Supported, which is what the replay answers for it. The
    table's per-link fields are asked again for each link that answers (``field.ID.LINK``),
    Not Supported kept: an absent scoped key would read the unscoped one."""
    _record_field_values(r, call, list(range(1, field_max)), keep_unsupported=False)
    links = sorted(
        int(key.split(".")[1])
        for key, value in r.keys.items()
        if key.startswith("nvlink.") and key.endswith(".state") and not isinstance(value, dict)
    )
    scoped = [(f.field_id, link) for link in links for f in FIELDS if f.per_link]
    _record_field_values(r, call, scoped, keep_unsupported=True)


def _record_field_values(
    r: _Recorder,
    call: Callable[..., Any],
    asked: Sequence[int | tuple[int, int]],
    keep_unsupported: bool,
) -> None:
    """``asked`` (field ids, or (id, scope)) in batches, under ``field.ID[.SCOPE]``."""
    for start in range(0, len(asked), _FIELD_BATCH):
        batch = list(asked[start : start + _FIELD_BATCH])
        keys = [f"field.{f[0]}.{f[1]}" if isinstance(f, tuple) else f"field.{f}" for f in batch]
        try:
            values = call("nvmlDeviceGetFieldValues", batch)
        except Exception as err:  # noqa: BLE001 - the whole call failed: each field says so
            failure = _failure(err)
            for key in keys:
                r.keys[key] = failure
            continue
        for key, value in zip(keys, values, strict=False):
            if value.nvmlReturn == _NOT_SUPPORTED and not keep_unsupported:
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


def record_nvml(
    call_timeout_s: float = 10.0, lib: Any = None, calls: Sequence[Call] = CALLS
) -> dict[str, Any]:
    """This node's NVML as a capture's ``nvml`` section: ``system`` and one mapping per GPU
    NVML enumerates. NVML that does not load is recorded as ``nvmlInit``'s error."""
    try:
        backend = open_nvml(call_timeout_s=call_timeout_s, lib=lib)
    except NvmlUnavailable as err:
        cause = err.__cause__
        code = _code(cause) if isinstance(cause, GpuError) else 12
        return {"system": {"nvmlInit": recorded_error(code)}, "gpus": []}
    try:
        system = record_system(backend, calls)
        try:
            count = int(backend.call("nvmlDeviceGetCount"))
        except GpuError as err:
            system["nvmlDeviceGetCount"] = _failure(err)
            count = 0
        return {"system": system, "gpus": [record_gpu(backend, i, calls) for i in range(count)]}
    finally:
        backend.close()
