"""Real GPUs through NVML (nvidia-ml-py, import name ``pynvml``).

Every NVML call goes through :meth:`NvmlBackend._call`, the one choke point: it runs the call on
a dedicated daemon thread with a timeout (a sick driver can hang inside NVML, and a hung call
must neither hang the agent nor block its exit), falls back from a newer NVML function name to
an older one, and turns ``pynvml.NVMLError`` into the errors of :mod:`node_agent.gpu.base`.
After one call times out the backend is "wedged": every later call fails fast with
:class:`GpuTimeout` instead of queueing behind the hung one.

Only the Xid event wait runs elsewhere (its own thread), so a long wait never blocks queries.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from node_agent.gpu.base import (
    FABRIC_HEALTH_SUMMARIES,
    FABRIC_STATES,
    NVLINK_REMOTE_TYPES,
    RECOVERY_ACTIONS,
    THROTTLE_REASONS,
    VIRTUALIZATION_MODES,
    Clocks,
    DeviceLost,
    DriverInfo,
    DriverStateError,
    EccCounts,
    GpuDevice,
    GpuError,
    GpuFabric,
    GpuProcess,
    GpuTimeout,
    Identity,
    NoPermission,
    NotSupported,
    NvLink,
    PcieLink,
    Power,
    RetiredPages,
    RowRemap,
    TemperatureThresholds,
    Utilization,
    XidEvent,
    nvlink_ber,
)
from node_agent.gpu.nvml_calls import CALLS, FIELD_IDS

log = logging.getLogger(__name__)

# nvmlReturn_t codes (nvml.h; part of the C ABI, so fixed across driver versions)
_SUCCESS = 0
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_T = TypeVar("_T")
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_OPERATING_SYSTEM = 17
_LIB_RM_VERSION_MISMATCH = 18
_UNKNOWN = 999
_GPU_NOT_FOUND = 28

_UNSUPPORTED_CODES = {_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _NOT_FOUND}
_LOST_CODES = {_GPU_IS_LOST, _GPU_NOT_FOUND}
_DRIVER_STATE_CODES = {_RESET_REQUIRED, _OPERATING_SYSTEM, _LIB_RM_VERSION_MISMATCH, _UNKNOWN}

# Field ids (nvml.h NVML_FI_*; part of the C ABI). Ours, not the binding's: nvidia-ml-py
# releases older than the driver lack newer names (12.535 has no NVML_FI_DEV_GET_GPU_RECOVERY_
# ACTION), and a missing name must read "not supported", not crash the check.
_FI_DEV_MEMORY_TEMP = 82
_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
#: NvLink attribute -> its NVLink5 field (NVML_FI_DEV_NVLINK_COUNT_*; scope the link)
_NVLINK5_FIELDS = {
    "effective_errors": FIELD_IDS["NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS"],
    "effective_ber": FIELD_IDS["NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER"],
    "symbol_errors": FIELD_IDS["NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS"],
    "symbol_ber": FIELD_IDS["NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER"],
}
#: the remote-end calls by what they answer, each with every name of its table row
NVML_LINK_REMOTE = {
    what: next(c.names for c in CALLS if c.function.startswith(function))
    for what, function in (
        ("type", "nvmlDeviceGetNvLinkRemoteDeviceType"),
        ("pci", "nvmlDeviceGetNvLinkRemotePciInfo"),
    )
}
# nvmlNvLinkCapability_t (nvml.h): NVML_NVLINK_CAP_P2P_SUPPORTED "P2P over NVLink is
# supported"; NVML_NVLINK_CAP_VALID "link is supported on this device"
_NVLINK_CAP_P2P_SUPPORTED = 0
_NVLINK_CAP_VALID = 5
# NVML_STRUCT_VERSION(data, ver) (nvml.h): sizeof(the _vN_t struct) | ver << 24
_STRUCT_VERSION_SHIFT = 24

# c_nvmlValue_t member for each nvmlValueType_t (NVML_VALUE_TYPE_DOUBLE = 0 ... UNSIGNED_SHORT = 6)
_FIELD_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

# NVML_VALUE_NOT_AVAILABLE as an unsigned long long (nvml.h: -1); older bindings pass it through
_VALUE_NOT_AVAILABLE_ULL = 2**64 - 1

_HUNG_ADVICE = "the driver may be hung: check dmesg for Xids, then reset the GPU or reboot"
_MIB = 1024 * 1024


class NvmlUnavailable(Exception):
    """NVML cannot be used on this host; the message says why and what to do.

    ``broken`` is False when the host simply has no NVIDIA driver (GPU checks skip) and True
    when a driver is there but NVML does not work (hung, version mismatch): that is an error.
    """

    def __init__(self, message: str, broken: bool = True) -> None:
        super().__init__(message)
        self.broken = broken


class NvmlInvalidArgument(GpuError):
    """NVML_ERROR_INVALID_ARGUMENT: e.g. an NVLink index beyond the links this GPU has."""


class _CallTimedOut(Exception):
    pass


class _Worker:
    """One daemon thread running calls in order, so a call that hangs can be abandoned.

    Not ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a call hung in
    the driver would hang the agent's exit too.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        """``fn(*args)`` on the worker; raises _CallTimedOut when it is not back in timeout_s."""
        done = threading.Event()
        outcome: list[Any] = [None, None]  # [result, error]

        def job() -> None:
            try:
                outcome[0] = fn(*args)
            except Exception as err:  # re-raised below, in the caller's thread
                outcome[1] = err
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(timeout_s):
            raise _CallTimedOut
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0]

    def stop(self) -> None:
        self._jobs.put(None)


def _text(value: Any) -> str:
    """Older nvidia-ml-py returned ``bytes`` for strings; newer returns ``str``."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _on(gpu: int | None) -> str:
    return "" if gpu is None else f" on GPU {gpu}"


def _handle_key(handle: Any) -> Any:
    """Device handles are ctypes pointers: the same GPU gives equal addresses, not equal objects."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def _optional(read: Callable[[], _T]) -> _T | None:
    """The value, or None where this GPU does not report it."""
    try:
        return read()
    except NotSupported:
        return None


class NvmlBackend:
    """The node's GPUs through NVML. Make one with :func:`open_nvml`."""

    name = "nvml"
    simulated = False
    unavailable_reason: str | None = None
    broken = False

    def __init__(self, lib: Any, call_timeout_s: float = 10.0) -> None:
        self._lib = lib
        self._timeout_s = call_timeout_s
        self._worker = _Worker("nvml-calls")
        self._lock = threading.Lock()  # one call in flight, so its timeout is its own
        self._wedged: str | None = None
        self._closed = False
        self._devices: list[NvmlDevice] | None = None
        self._unsupported_logged: set[str] = set()
        self._error_names = {getattr(lib, n): n for n in dir(lib) if n.startswith("NVML_ERROR_")}
        self._event_worker: _Worker | None = None
        self._event_lock = threading.Lock()
        self._event_set: Any = None
        self._event_gpus: dict[Any, int] = {}

    @property
    def lib(self) -> Any:
        """The nvidia-ml-py module (or what stands in for it): its constants and structs."""
        return self._lib

    def call(self, names: str | Sequence[str], *args: Any, gpu: int | None = None) -> Any:
        """One NVML call through the choke point, its raw return value (``node-agent
        capture`` records calls this way: the call is timed, an error is translated)."""
        return self._call(names, *args, gpu=gpu)

    # -- the choke point --------------------------------------------------------------------------

    def _call(self, names: str | Sequence[str], *args: Any, gpu: int | None = None) -> Any:
        """Run NVML function ``names`` (or the first of several, newest first, this NVML has).

        Raises NotSupported, NoPermission, DeviceLost, GpuTimeout or GpuError, naming the
        function and the GPU.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        if self._closed:
            raise GpuError(f"{names[0]}{_on(gpu)}: the NVML backend is already closed")
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is None:
                continue
            try:
                return self._run(name, fn, args, gpu, self._worker, self._lock)
            except self._lib.NVMLError as err:
                if err.value == _FUNCTION_NOT_FOUND and name != names[-1]:
                    continue  # the driver predates this name: try the older one
                raise self._translate(err.value, name, gpu) from err
        raise self._translate(_FUNCTION_NOT_FOUND, names[0], gpu)

    def _run(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        gpu: int | None,
        worker: _Worker,
        lock: threading.Lock,
        timeout_s: float | None = None,
    ) -> Any:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        with lock:
            if self._wedged is not None:
                raise GpuTimeout(f"skipped {name}{_on(gpu)}: {self._wedged}")
            try:
                return worker.run(fn, args, timeout_s)
            except _CallTimedOut:
                self._wedged = (
                    f"NVML call {name}{_on(gpu)} did not return within "
                    f"{timeout_s:g} s; {_HUNG_ADVICE}"
                )
                log.error("%s", self._wedged)
                raise GpuTimeout(self._wedged) from None

    def _translate(self, code: int, name: str, gpu: int | None) -> GpuError:
        what = f"{name}{_on(gpu)}: {self._error_names.get(code, f'NVML error {code}')}"
        if code in _UNSUPPORTED_CODES:
            if name not in self._unsupported_logged:
                self._unsupported_logged.add(name)
                log.info(
                    "%s is not supported by this GPU or driver; reported as not available", name
                )
            return NotSupported(f"{what} (this GPU or driver does not report it)")
        if code == _NO_PERMISSION:
            return NoPermission(f"{what}: run the agent as root")
        if code in _LOST_CODES:
            return DeviceLost(
                f"{what}: the GPU stopped answering (fell off the bus?); "
                "check dmesg for Xid 79, then reset the GPU or reboot"
            )
        if code == _TIMEOUT:
            return GpuTimeout(f"{what}: {_HUNG_ADVICE}")
        if code == _INVALID_ARGUMENT:
            return NvmlInvalidArgument(what)
        if code in _DRIVER_STATE_CODES:
            return DriverStateError(what)
        return GpuError(what)

    def _field_value(self, field_id: int, field_name: str, handle: Any, gpu: int) -> Any:
        """One ``nvmlDeviceGetFieldValues`` value; each value carries its own nvmlReturn."""
        name = f"nvmlDeviceGetFieldValues({field_name})"
        value = self._call("nvmlDeviceGetFieldValues", handle, [field_id], gpu=gpu)[0]
        if value.nvmlReturn != _SUCCESS:
            raise self._translate(value.nvmlReturn, name, gpu)
        if not 0 <= value.valueType < len(_FIELD_VALUE_MEMBERS):
            raise GpuError(f"{name}{_on(gpu)}: unknown nvmlValueType_t {value.valueType}")
        return getattr(value.value, _FIELD_VALUE_MEMBERS[value.valueType])

    # -- GpuBackend ----------------------------------------------------------------------------

    def init(self) -> None:
        """``nvmlInit``; raises :class:`NvmlUnavailable` with the reason and what to do."""
        try:
            self._call("nvmlInit")
        except GpuError as err:
            self._closed = True  # nothing to shut down: NVML never came up
            self._worker.stop()
            if isinstance(err, GpuTimeout):
                raise NvmlUnavailable(f"NVML did not initialise: {err}") from err
            code = getattr(err.__cause__, "value", None)
            raise NvmlUnavailable(
                _init_failure(code, str(err)), broken=code != _LIBRARY_NOT_FOUND
            ) from err

    def driver(self) -> DriverInfo:
        """``nvidia-smi -q``: Driver Version, CUDA Version; and the NVML version."""
        cuda = _optional(
            lambda: self._call(
                ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")
            )
        )
        return DriverInfo(
            driver_version=_optional(lambda: _text(self._call("nvmlSystemGetDriverVersion"))),
            cuda_version=None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            nvml_version=_optional(lambda: _text(self._call("nvmlSystemGetNVMLVersion"))),
        )

    def devices(self) -> list[GpuDevice]:
        """One :class:`NvmlDevice` per GPU NVML counts (``nvidia-smi -L``), read once."""
        if self._devices is None:
            count = self._call("nvmlDeviceGetCount")
            self._devices = [NvmlDevice(self, i) for i in range(count)]
        return list(self._devices)

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        """Xid errors NVML reports within ``timeout_s`` (``nvmlEventTypeXidCriticalError``).

        Returns [] when none came. Raises NotSupported when no GPU here reports Xid events (the
        kernel log still carries them). Runs on its own thread, never blocking other queries.
        """
        if self._event_set is None:
            self._register_xid_events()
        if self._event_worker is None:
            self._event_worker = _Worker("nvml-events")
        lib = self._lib
        name = "nvmlEventSetWait_v2" if hasattr(lib, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
        events: list[XidEvent] = []
        wait_ms = max(0, int(timeout_s * 1000))
        while len(events) < 64 and not self._closed:  # drain what is queued, but not forever
            try:
                data = self._run(
                    name,
                    getattr(lib, name),
                    (self._event_set, wait_ms),
                    None,
                    self._event_worker,
                    self._event_lock,
                    timeout_s=wait_ms / 1000 + self._timeout_s,
                )
            except lib.NVMLError as err:
                if err.value == _TIMEOUT:  # no (further) event within wait_ms
                    return events
                raise self._translate(err.value, name, None) from err
            if data.eventType & lib.nvmlEventTypeXidCriticalError:
                gpu = self._event_gpus.get(_handle_key(data.device))
                events.append(
                    XidEvent(
                        gpu_index=gpu,
                        code=int(data.eventData),
                        message=f"Xid {int(data.eventData)}{_on(gpu)} (NVML event)",
                    )
                )
            wait_ms = 0
        return events

    def _register_xid_events(self) -> None:
        lib = self._lib
        event_set = self._call("nvmlEventSetCreate")
        gpus: dict[Any, int] = {}
        self.devices()
        for dev in self._devices or []:
            try:
                handle = dev.handle()
                self._call(
                    "nvmlDeviceRegisterEvents",
                    handle,
                    lib.nvmlEventTypeXidCriticalError,
                    event_set,
                    gpu=dev.index,
                )
            except (NotSupported, NoPermission, DeviceLost) as err:
                log.info("no NVML Xid events from GPU %d: %s", dev.index, err)
                continue
            gpus[_handle_key(handle)] = dev.index
        if not gpus:
            _optional(lambda: self._call("nvmlEventSetFree", event_set))
            raise NotSupported(
                "no GPU here reports Xid events through NVML "
                "(nvmlDeviceRegisterEvents); read Xids from the kernel log"
            )
        self._event_gpus, self._event_set = gpus, event_set

    def close(self) -> None:
        """``nvmlShutdown``. Safe to call twice; does not wait on a hung driver."""
        if self._closed:
            return
        try:
            if self._wedged is None:
                if self._event_set is not None and self._event_lock.acquire(blocking=False):
                    try:  # no Xid wait in flight, so the event set can go
                        self._call("nvmlEventSetFree", self._event_set)
                    finally:
                        self._event_lock.release()
                self._call("nvmlShutdown")
        except GpuError as err:
            log.warning("NVML shutdown: %s", err)
        finally:
            self._closed = True
            self._worker.stop()
            if self._event_worker is not None:
                self._event_worker.stop()


def _init_failure(code: int | None, detail: str) -> str:
    if code == _LIBRARY_NOT_FOUND:
        return (
            "no NVIDIA driver: libnvidia-ml.so.1 not found "
            "(install the NVIDIA driver, or run with --simulate)"
        )
    if code == _DRIVER_NOT_LOADED:
        return (
            "no NVIDIA driver: the nvidia kernel module is not loaded "
            "(check `lsmod | grep nvidia` and dmesg, or run with --simulate)"
        )
    if code == _LIB_RM_VERSION_MISMATCH:
        return (
            "NVML library and kernel driver versions differ (driver upgraded without a "
            "reboot?): reboot, or reload the nvidia kernel modules"
        )
    if code == _NO_PERMISSION:
        return f"NVML refused to initialise ({detail}): run the agent as root"
    return f"NVML failed to initialise: {detail}"


class NvmlDevice:
    """One GPU through NVML. Every method returns a value or raises a GpuError subclass."""

    def __init__(self, backend: NvmlBackend, index: int) -> None:
        self.index = index
        self._nvml = backend
        self._lib = backend._lib
        self._handle: Any = None
        #: each active link's far end, read once: the wiring does not change while NVML runs
        self._far_ends: dict[int, dict[str, Any]] = {}
        #: False once NVML answered Not Supported for every NVLink 5 field of every link
        self._nvlink5_answers = True

    def handle(self) -> Any:
        """The NVML device handle, fetched once (a lost GPU raises DeviceLost here)."""
        if self._handle is None:
            self._handle = self._nvml._call(
                "nvmlDeviceGetHandleByIndex", self.index, gpu=self.index
            )
        return self._handle

    def _call(self, names: str | Sequence[str], *args: Any) -> Any:
        return self._nvml._call(names, self.handle(), *args, gpu=self.index)

    def _field(self, field_id: int, field_name: str) -> Any:
        return self._nvml._field_value(field_id, field_name, self.handle(), self.index)

    def identity(self) -> Identity:
        """``nvidia-smi --query-gpu=uuid,name,pci.bus_id,serial,vbios_version,memory.total``."""
        return Identity(
            index=self.index,
            uuid=_text(self._call("nvmlDeviceGetUUID")),
            name=_text(self._call("nvmlDeviceGetName")),
            pci_bus_id=_text(self._call("nvmlDeviceGetPciInfo").busId),
            serial=_optional(lambda: _text(self._call("nvmlDeviceGetSerial"))),
            vbios=_optional(lambda: _text(self._call("nvmlDeviceGetVbiosVersion"))),
            memory_total_mib=_optional(
                lambda: int(self._call("nvmlDeviceGetMemoryInfo").total) // _MIB
            ),
        )

    def temperature_c(self) -> int:
        """``nvidia-smi --query-gpu=temperature.gpu`` (°C).

        ``nvmlDeviceGetTemperatureV`` first: nvml.h 13 deprecates ``nvmlDeviceGetTemperature``
        (nvidia-ml-py: "will be removed in CUDA 14.0"); older drivers and bindings lack the V.
        """
        return int(
            self._call(
                ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                self._lib.NVML_TEMPERATURE_GPU,
            )
        )

    def memory_temperature_c(self) -> int:
        """``nvidia-smi --query-gpu=temperature.memory`` (°C; HBM GPUs only)."""
        return int(self._field(_FI_DEV_MEMORY_TEMP, "NVML_FI_DEV_MEMORY_TEMP"))

    def temperature_thresholds(self) -> TemperatureThresholds:
        """``nvidia-smi -q -d TEMPERATURE``: shutdown, slowdown, GPU/memory max operating (°C)."""
        lib = self._lib

        def threshold(kind: int) -> int | None:
            return _optional(lambda: int(self._call("nvmlDeviceGetTemperatureThreshold", kind)))

        found = TemperatureThresholds(
            shutdown_c=threshold(lib.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            slowdown_c=threshold(lib.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            gpu_max_operating_c=threshold(lib.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
            memory_max_operating_c=threshold(lib.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
        )
        if found == TemperatureThresholds(None, None, None, None):
            raise NotSupported(
                f"nvmlDeviceGetTemperatureThreshold on GPU {self.index}: "
                "no temperature threshold is reported"
            )
        return found

    def power(self) -> Power:
        """``nvidia-smi --query-gpu=power.draw,enforced.power.limit,power.default_limit`` (W)."""

        def watts(function: str) -> float:  # NVML reports milliwatts
            return float(self._call(function)) / 1000

        return Power(
            usage_w=watts("nvmlDeviceGetPowerUsage"),
            enforced_limit_w=_optional(lambda: watts("nvmlDeviceGetEnforcedPowerLimit")),
            default_limit_w=_optional(lambda: watts("nvmlDeviceGetPowerManagementDefaultLimit")),
        )

    def clocks(self) -> Clocks:
        """``nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem`` (MHz)."""
        lib = self._lib
        return Clocks(
            sm_mhz=int(self._call("nvmlDeviceGetClockInfo", lib.NVML_CLOCK_SM)),
            sm_max_mhz=_optional(
                lambda: self._call("nvmlDeviceGetMaxClockInfo", lib.NVML_CLOCK_SM)
            ),
            memory_mhz=_optional(lambda: self._call("nvmlDeviceGetClockInfo", lib.NVML_CLOCK_MEM)),
        )

    def throttle_reasons(self) -> frozenset[str]:
        """``nvidia-smi --query-gpu=clocks_event_reasons.active`` as names.

        Bit i of the mask is ``THROTTLE_REASONS[i]`` (nvmlClocksEventReasonGpuIdle = 0x1 ...
        nvmlClocksEventReasonDisplayClockSetting = 0x100, in nvml.h order).
        """
        mask = int(
            self._call(
                (
                    "nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlDeviceGetCurrentClocksThrottleReasons",
                )
            )
        )
        return frozenset(name for bit, name in enumerate(THROTTLE_REASONS) if mask & (1 << bit))

    def pcie(self) -> PcieLink:
        """``nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.*``."""
        return PcieLink(
            gen_current=int(self._call("nvmlDeviceGetCurrPcieLinkGeneration")),
            gen_max=int(self._call("nvmlDeviceGetMaxPcieLinkGeneration")),
            width_current=int(self._call("nvmlDeviceGetCurrPcieLinkWidth")),
            width_max=int(self._call("nvmlDeviceGetMaxPcieLinkWidth")),
            replay_count=_optional(lambda: self._call("nvmlDeviceGetPcieReplayCounter")),
        )

    def ecc(self) -> EccCounts:
        """``nvidia-smi -q -d ECC``: mode, volatile/aggregate SBE/DBE, aggregate DBE by location,
        and the SRAM error status (None/{} where the GPU, driver or binding lacks it, or the
        agent is not root: the call needs root, and the other counters do not)."""
        lib = self._lib
        current, _pending = self._call("nvmlDeviceGetEccMode")
        try:
            sram = self._sram_status()
        except NotSupported:
            sram = None
        except NoPermission as err:  # said once; the other ECC counters need no root
            if "sram-permission" not in self._nvml._unsupported_logged:
                self._nvml._unsupported_logged.add("sram-permission")
                log.info("SRAM ECC status not read: %s", err)
            sram = None

        def total(error_type: int, counter: int) -> int | None:
            return _optional(
                lambda: int(self._call("nvmlDeviceGetTotalEccErrors", error_type, counter))
            )

        def aggregate_dbe_at(location: int) -> int | None:
            return _optional(
                lambda: int(
                    self._call(
                        "nvmlDeviceGetMemoryErrorCounter",
                        lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        lib.NVML_AGGREGATE_ECC,
                        location,
                    )
                )
            )

        corrected, uncorrected = (
            lib.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        )
        return EccCounts(
            enabled=current == lib.NVML_FEATURE_ENABLED,
            volatile_sbe=total(corrected, lib.NVML_VOLATILE_ECC),
            volatile_dbe=total(uncorrected, lib.NVML_VOLATILE_ECC),
            aggregate_sbe=total(corrected, lib.NVML_AGGREGATE_ECC),
            aggregate_dbe=total(uncorrected, lib.NVML_AGGREGATE_ECC),
            aggregate_dbe_sram=aggregate_dbe_at(lib.NVML_MEMORY_LOCATION_SRAM),
            aggregate_dbe_dram=aggregate_dbe_at(lib.NVML_MEMORY_LOCATION_DRAM),
            sram_uncorrectable_aggregate=None
            if sram is None
            else (int(sram.aggregateUncParity) + int(sram.aggregateUncSecDed)),
            sram_threshold_exceeded=None if sram is None else bool(sram.bThresholdExceeded),
            sram_uncorrectable_by_unit={}
            if sram is None
            else {
                "l2": int(sram.aggregateUncBucketL2),
                "sm": int(sram.aggregateUncBucketSm),
                "pcie": int(sram.aggregateUncBucketPcie),
                "mcu": int(sram.aggregateUncBucketMcu),
                "other": int(sram.aggregateUncBucketOther),
            },
        )

    def _sram_status(self) -> Any:
        """nvmlDeviceGetSramEccErrorStatus (Ampere and later, root): the filled
        nvmlEccSramErrorStatus_v1_t (nvidia-smi -q -d ECC: SRAM Uncorrectable Parity / SEC-DED,
        SRAM Threshold Exceeded, Aggregate Uncorrectable SRAM Sources)."""
        struct = getattr(self._lib, "c_nvmlEccSramErrorStatus_v1_t", None)
        if struct is None:
            raise NotSupported(
                f"nvmlDeviceGetSramEccErrorStatus on GPU {self.index}: this "
                "nvidia-ml-py is too old to have its struct "
                "(c_nvmlEccSramErrorStatus_v1_t); upgrade nvidia-ml-py"
            )
        status = struct()
        if not status.version:  # nvidia-ml-py sets nvmlEccSramErrorStatus_v1 in __init__
            status.version = ctypes.sizeof(status) | (1 << _STRUCT_VERSION_SHIFT)
        self._call("nvmlDeviceGetSramEccErrorStatus", ctypes.byref(status))
        return status

    def retired_pages(self) -> RetiredPages:
        """``nvidia-smi -q -d PAGE_RETIREMENT`` (pre-Ampere GPUs; later ones remap rows)."""
        lib = self._lib
        sbe = self._call(
            "nvmlDeviceGetRetiredPages",
            lib.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        dbe = self._call(
            "nvmlDeviceGetRetiredPages", lib.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        )
        pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus")
        return RetiredPages(sbe=len(sbe), dbe=len(dbe), pending=pending == lib.NVML_FEATURE_ENABLED)

    def row_remap(self) -> RowRemap:
        """``nvidia-smi -q -d ROW_REMAPPER`` (Ampere and later)."""
        corrected, uncorrected, pending, failed = self._call("nvmlDeviceGetRemappedRows")
        return RowRemap(
            corrected=int(corrected),
            uncorrected=int(uncorrected),
            pending=bool(pending),
            failed=bool(failed),
        )

    def persistence_mode(self) -> bool:
        """``nvidia-smi --query-gpu=persistence_mode``."""
        return bool(self._call("nvmlDeviceGetPersistenceMode") == self._lib.NVML_FEATURE_ENABLED)

    def recovery_action(self) -> str:
        """What the driver asks for to recover this GPU (``nvidia-smi -q``: GPU Recovery Action).

        A name from ``base.RECOVERY_ACTIONS`` (``nvmlGpuRecoveryAction_t`` order); a value newer
        than that list reads ``unknown_<n>``.
        """
        n = int(self._field(_FI_DEV_GET_GPU_RECOVERY_ACTION, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"))
        return RECOVERY_ACTIONS[n] if 0 <= n < len(RECOVERY_ACTIONS) else f"unknown_{n}"

    def nvlinks(self) -> list[NvLink]:
        """``nvidia-smi nvlink -s``, ``-e`` and ``-c``: each link's state, DL error counters and
        P2P capability.

        [] when the GPU has no NVLink. Link indexes this GPU lacks are skipped: those whose state
        is "not supported" or an invalid argument, and those that answer "inactive" without
        NVML_NVLINK_CAP_VALID ("link is supported on this device"; NVIDIA's own mock NVML
        answers "inactive" for indexes past the GPU's links), so only a link the GPU has can
        count as down.
        """
        lib = self._lib
        links: list[NvLink] = []
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                active = self._call("nvmlDeviceGetNvLinkState", link)
            except (NotSupported, NvmlInvalidArgument):
                continue
            if active != lib.NVML_FEATURE_ENABLED and not self._nvlink_valid(link):
                continue

            def counter(kind: int, link: int = link) -> int | None:
                return _optional(
                    lambda: int(self._call("nvmlDeviceGetNvLinkErrorCounter", link, kind))
                )

            links.append(
                NvLink(
                    link=link,
                    active=active == lib.NVML_FEATURE_ENABLED,
                    replay_errors=counter(lib.NVML_NVLINK_ERROR_DL_REPLAY),
                    recovery_errors=counter(lib.NVML_NVLINK_ERROR_DL_RECOVERY),
                    crc_errors=counter(lib.NVML_NVLINK_ERROR_DL_CRC_FLIT),
                    p2p_supported=self._nvlink_p2p(link),
                    **self._nvlink_remote(link, active == lib.NVML_FEATURE_ENABLED),
                )
            )
        return self._nvlink5(links)

    def _nvlink_remote(self, link: int, active: bool) -> dict[str, Any]:
        """What is at the link's other end (``nvidia-smi nvlink -R``): the remote device type
        and its PCI bus id, each None where NVML answers Not Supported. Read once for an active
        link (two calls a link: every 10 s on an 8-GPU HGX board they doubled the cost of
        reading the links), again each time for one that is down."""
        if link in self._far_ends:
            return self._far_ends[link]

        def ask(name: str) -> Any:
            try:
                return self._call(NVML_LINK_REMOTE[name], link)
            except (NotSupported, NvmlInvalidArgument):
                return None

        kind, pci = ask("type"), ask("pci")
        far_end = {
            "remote_type": None
            if kind is None
            else NVLINK_REMOTE_TYPES.get(int(kind), f"unknown_{int(kind)}"),
            "remote_pci_bus_id": None if pci is None else _text(pci.busId) or None,
        }
        if active:
            self._far_ends[link] = far_end
        return far_end

    def _nvlink5(self, links: list[NvLink]) -> list[NvLink]:
        """The NVLink5 error counts and BERs of ``links`` (field values, scope the link), in one
        ``nvmlDeviceGetFieldValues`` call; a field NVML answers Not Supported for (every GPU
        before Blackwell) stays None. A GPU that answered Not Supported for all of them is not
        asked again (that is its driver's answer until it reloads)."""
        if not links or not self._nvlink5_answers:
            return links
        asked = [(attr, link.link) for link in links for attr in _NVLINK5_FIELDS]
        ids = [(_NVLINK5_FIELDS[attr], link) for attr, link in asked]
        try:
            values = self._call("nvmlDeviceGetFieldValues", ids)
        except NotSupported:
            self._nvlink5_answers = False
            return links
        found: dict[int, dict[str, Any]] = {link.link: {} for link in links}
        for (attr, link_id), value in zip(asked, values, strict=False):
            if value.nvmlReturn == _SUCCESS and 0 <= value.valueType < len(_FIELD_VALUE_MEMBERS):
                raw = int(getattr(value.value, _FIELD_VALUE_MEMBERS[value.valueType]))
                found[link_id][attr] = nvlink_ber(raw) if attr.endswith("_ber") else raw
        self._nvlink5_answers = any(v.nvmlReturn != _NOT_SUPPORTED for v in values)
        return [dataclasses.replace(link, **found[link.link]) for link in links]

    def _nvlink_p2p(self, link: int) -> bool:
        """Whether link ``link`` can carry peer-to-peer traffic (NVML_NVLINK_CAP_P2P_SUPPORTED);
        False where the GPU or driver does not report the capability."""
        try:
            return bool(
                self._call("nvmlDeviceGetNvLinkCapability", link, _NVLINK_CAP_P2P_SUPPORTED)
            )
        except (NotSupported, NvmlInvalidArgument):
            return False

    def _nvlink_valid(self, link: int) -> bool:
        """Whether NVML says link index ``link`` is a link of this GPU (NVML_NVLINK_CAP_VALID)."""
        try:
            return bool(self._call("nvmlDeviceGetNvLinkCapability", link, _NVLINK_CAP_VALID))
        except (NotSupported, NvmlInvalidArgument):
            return False

    def fabric(self) -> GpuFabric:
        """``nvidia-smi -q``'s Fabric section (:func:`query_fabric`)."""
        return query_fabric(self._call, self._lib)

    def compute_processes(self) -> list[GpuProcess]:
        """``nvidia-smi --query-compute-apps=pid,used_memory``: the compute processes on this GPU.

        [] when none run. ``used_memory_bytes`` is None where NVML reports
        NVML_VALUE_NOT_AVAILABLE. Pids are in the host's PID namespace.
        """
        procs = self._call(
            (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetComputeRunningProcesses_v2",
                "nvmlDeviceGetComputeRunningProcesses",
            )
        )
        out = []
        for p in procs or []:
            used = getattr(p, "usedGpuMemory", None)
            out.append(
                GpuProcess(
                    pid=int(p.pid),
                    used_memory_bytes=(
                        None if used is None or int(used) >= _VALUE_NOT_AVAILABLE_ULL else int(used)
                    ),
                )
            )
        return out

    def utilization(self) -> Utilization:
        """``nvidia-smi --query-gpu=utilization.gpu,utilization.memory`` (percent of the last
        sample period a kernel ran / device memory was read or written)."""
        rates = self._call("nvmlDeviceGetUtilizationRates")
        return Utilization(gpu_pct=int(rates.gpu), memory_pct=int(rates.memory))

    def virtualization_mode(self) -> str:
        """``nvidia-smi -q``: GPU Virtualization Mode (``nvmlDeviceGetVirtualizationMode``).

        A name from ``base.VIRTUALIZATION_MODES`` (``nvmlGpuVirtualizationMode_t`` order); a
        value newer than that list reads ``unknown_<n>``.
        """
        n = int(self._call("nvmlDeviceGetVirtualizationMode"))
        return VIRTUALIZATION_MODES[n] if 0 <= n < len(VIRTUALIZATION_MODES) else f"unknown_{n}"


def query_fabric(call: Callable[..., Any], lib: Any) -> GpuFabric:
    """``nvmlDeviceGetGpuFabricInfoV`` with the version 3 struct (health mask and summary),
    else the older ``nvmlDeviceGetGpuFabricInfo`` (a driver or nvidia-ml-py without the
    versioned call or struct). ``call(name, *args)`` calls NVML on the GPU. Not Supported: the
    GPU has no fabric."""
    v3 = getattr(lib, "c_nvmlGpuFabricInfo_v3_t", None)
    newer: GpuError | None = None
    if v3 is not None:
        info = v3()
        if not info.version:
            info.version = ctypes.sizeof(info) | (3 << _STRUCT_VERSION_SHIFT)
        try:
            call("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info))
            return fabric_info(info, versioned=True)
        except (DeviceLost, GpuTimeout, NoPermission):
            raise
        except GpuError as err:
            newer = err  # a driver without the versioned call or struct: ask the older one
    old = lib.c_nvmlGpuFabricInfo_t()
    try:
        call("nvmlDeviceGetGpuFabricInfo", ctypes.byref(old))
    except NotSupported:
        if newer is not None and not isinstance(newer, NotSupported):
            raise newer from None
        raise
    return fabric_info(old, versioned=False)


def fabric_info(info: Any, versioned: bool) -> GpuFabric:
    """A filled ``nvmlGpuFabricInfo_t`` / ``_v3_t`` as a :class:`GpuFabric`."""
    raw = bytes(bytearray(info.clusterUuid))
    hexed = raw.hex()
    uuid = "-".join(hexed[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
    state = int(info.state) & 0xFF  # nvmlGpuFabricState_t is one byte (a binding may read 4)
    summary = int(getattr(info, "healthSummary", 0)) if versioned else None
    return GpuFabric(
        state=FABRIC_STATES[state] if state < len(FABRIC_STATES) else f"unknown_{state}",
        status=int(info.status),
        cluster_uuid=uuid,
        clique_id=int(info.cliqueId),
        health_mask=int(info.healthMask) if versioned else None,
        health_summary=None
        if summary is None
        else (
            FABRIC_HEALTH_SUMMARIES[summary]
            if summary < len(FABRIC_HEALTH_SUMMARIES)
            else f"unknown_{summary}"
        ),
    )


def open_nvml(call_timeout_s: float = 10.0, lib: Any = None) -> NvmlBackend:
    """Initialise NVML and return the backend; raise :class:`NvmlUnavailable` saying why not.

    ``lib`` is the pynvml module (tests pass a fake); ``call_timeout_s`` bounds each NVML call.
    """
    if lib is None:
        try:
            import pynvml
        except ImportError as err:
            raise NvmlUnavailable(
                "nvidia-ml-py not installed: pip install nvidia-ml-py", broken=False
            ) from err
        lib = pynvml
    backend = NvmlBackend(lib, call_timeout_s)
    backend.init()
    return backend
