"""A captured node's NVML, replayed call by call through the real NVML backend (``--simulate``).

``node-agent capture`` records a node's NVML as the stand-in library's state keys
(docs/nvml_fake.md, docs/capture.md): one key per NVML call and argument, each with the value
NVML gave or ``{error: <name>, code: <nvmlReturn_t>}``. This module turns that record into a
state file's text (:func:`capture_state_lines`: the same text the stand-in
``libnvidia-ml.so.1`` replays, ``NVML_FAKE_SCENARIO``) and answers NVML calls from such a text
in Python (:class:`StateNvml`, the stand-in's rules for the calls the backend makes: a key the
state does not give is NVML_ERROR_NOT_SUPPORTED, ``error <code>`` returns that code). The NVML
backend (:class:`node_agent.gpu.nvml.NvmlBackend`) runs unchanged on top, so a capture is
graded through the same code as the node it came from, Not Supported staying Not Supported.

Plain data in, no scenario objects: ``node_agent.sim`` sits above this wing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.gpu.base import (
    Clocks,
    GpuDevice,
    NotSupported,
    Power,
    Utilization,
)
from node_agent.gpu.nvml import NvmlBackend, NvmlDevice, NvmlUnavailable
from node_agent.gpu.nvml_calls import (
    CALLS,
    ERROR_NAMES,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    REPEATED_KEYS,
    UINT_MAX,
    ULL_MAX,
    UNKNOWN,
    Call,
    NvmlAnswer,
    answer,
    by_name,
    fabric_members,
    lookup,
    read_numbers,
    read_text,
)

STATE_FORMAT = "nvml-fake-state 1"
#: the stand-in's limits (tests/nvml_fake/nvml_fake.h: FAKE_KEY_MAX, FAKE_VALUE_MAX less the NUL)
KEY_MAX = 63
VALUE_MAX = 255
#: nvmlReturn_t codes used here (nvml.h)
_SUCCESS = 0
_TIMEOUT = 10
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_ARGUMENT_VERSION_MISMATCH = 22
#: state keys that are the stand-in's switches or injected events, not an NVML answer: a
#: capture records what NVML answered, so a capture holding one is refused (scenario schema)
RESERVED_KEYS = ("hang", "unsupported", "absent", "error", "xid")
#: a recorded error on a repeated key cannot be a value: it becomes a switch on its function
_REPEATED_KEY_FUNCTION = {c.key: c.function for c in CALLS if c.key in REPEATED_KEYS}


class CaptureFormatError(ValueError):
    """A recorded NVML value the state file cannot carry; the message names the key."""


def error_code(value: Any) -> int | None:
    """The nvmlReturn_t of a recorded ``{error: ..., code: N}``, or None for a value."""
    if isinstance(value, Mapping) and "error" in value:
        code = value.get("code")
        return int(code) if isinstance(code, int) else UNKNOWN
    return None


def recorded_error(code: int) -> dict[str, Any]:
    """What a capture writes for a call NVML answered with ``code``."""
    return {"error": ERROR_NAMES.get(code, f"NVML error {code}"), "code": code}


def _text(key: str, value: Any, strict: bool = True) -> str:
    code = error_code(value)
    if code is not None:
        return f"error {code}"
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, (list, tuple)):
        text = " ".join(str(int(v) if isinstance(v, bool) else v) for v in value)
    else:
        text = str(value)
    if strict and (any(ord(c) < 0x20 or ord(c) == 0x7F for c in text) or len(text) > VALUE_MAX):
        raise CaptureFormatError(
            f"NVML value of {key!r} ({text[:40]!r}...) holds a control character or is longer "
            f"than {VALUE_MAX} characters: the stand-in library's state file cannot carry it "
            "(replay it with --simulate instead)"
        )
    return text


def _key_lines(section: Mapping[str, Any], strict: bool) -> list[str]:
    lines = []
    for key, value in section.items():
        if not key or len(key) > KEY_MAX or not all(c.isalnum() or c in "._" for c in key):
            raise CaptureFormatError(
                f"NVML key {key!r}: expected letters, digits, '.' and '_', "
                f"at most {KEY_MAX} characters"
            )
        if key in REPEATED_KEYS and isinstance(value, list):
            lines += [f"{key} {_text(key, item, strict)}" for item in value]
        elif key in _REPEATED_KEY_FUNCTION and error_code(value) is not None:
            lines.append(f"error {_REPEATED_KEY_FUNCTION[key]} {error_code(value)}")
        elif key[:4] == "nvml" and key[4:5].isupper():  # a whole call failed (nvmlInit)
            if error_code(value) is not None:
                lines.append(f"error {key} {error_code(value)}")
        else:
            lines.append(f"{key} {_text(key, value, strict)}")
    return lines


def capture_state_lines(
    nvml: Mapping[str, Any], source: str = "a capture", strict: bool = True
) -> list[str]:
    """The stand-in state file for a capture's ``nvml`` section (``system``: the global keys,
    ``gpus``: one mapping per GPU NVML enumerated, in NVML's order). ``nvmlInit`` recorded as
    an error makes NVML fail to load, as it did on the captured node.

    ``strict``: refuse (CaptureFormatError) a value the stand-in's line-based file cannot carry
    (a control character, more than 255 characters). Without it the lines are for
    :class:`StateNvml`, which takes each item of the list as one line whatever it holds."""
    comment = "".join(c if c.isprintable() else "?" for c in f"# replayed from {source}")
    lines = [STATE_FORMAT, comment[:200]]
    lines += _key_lines(nvml.get("system") or {}, strict)
    for index, gpu in enumerate(nvml.get("gpus") or []):
        lines += ["", f"[gpu {index}]", *_key_lines(gpu, strict)]
    return lines


# -- NVML answered from a state file's text (the stand-in's rules, in Python) --------------------


class _State:
    def __init__(self, lines: Iterable[str]) -> None:
        self.system: list[tuple[str, str]] = []
        self.gpus: list[list[tuple[str, str]]] = []
        section = self.system
        header = False
        for raw in lines:
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            if not header:
                if text != STATE_FORMAT:
                    raise CaptureFormatError(
                        f"expected the header {STATE_FORMAT!r}, found {text[:60]!r}"
                    )
                header = True
                continue
            if text.startswith("[gpu "):
                section = []
                self.gpus.append(section)
                continue
            key, _, value = text.partition(" ")
            section.append((key, value.strip()))


def _switch(section: list[tuple[str, str]], fn: str) -> int:
    """The stand-in's per-function switches: unsupported, absent, error <fn> <code>."""

    def names(pattern: str) -> bool:
        if pattern in ("*", fn):
            return True
        rest = fn[len(pattern) :]
        return fn.startswith(pattern) and rest.startswith("_v") and rest[2:].isdigit()

    for key, value in section:
        if key == "unsupported" and names(value):
            return NOT_SUPPORTED
        if key == "absent" and names(value):
            return _FUNCTION_NOT_FOUND
        if key == "error":
            name, _, code = value.partition(" ")
            if names(name) and code.strip().lstrip("-").isdigit():
                return int(code)
    return _SUCCESS


@dataclass(frozen=True)
class _Handle:
    """A device handle: hashable and equal per GPU, as NVML's handles (pointers) are, so the
    backend can key its Xid event registrations by handle."""

    index: int


class StateNvml:
    """The part of nvidia-ml-py's ``pynvml`` the NVML backend calls, answered from a state
    file's text by the stand-in library's rules. The calls of the NVML call table
    (:mod:`node_agent.gpu.nvml_calls`, ``calls``) are answered by the table's rules; the
    methods below are the table's ``custom`` calls. Constants, structs and ``NVMLError`` are
    nvidia-ml-py's own; a function in neither is absent (NVML_ERROR_FUNCTION_NOT_FOUND), as on
    an older driver."""

    def __init__(self, lines: Iterable[str], calls: tuple[Call, ...] = CALLS) -> None:
        import pynvml

        self._calls = by_name(calls)
        self._pynvml = pynvml
        self._state = _State(lines)
        self.NVMLError = pynvml.NVMLError
        self._initialised = 0
        self._closed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        call = self.__dict__.get("_calls", {}).get(name)
        if call is not None:
            return functools.partial(self._answer, call, name)
        # constants and structs only: an NVML function this class does not answer is absent
        if name.startswith(("NVML_", "nvmlEventType", "c_nvml", "NVMLError")):
            return getattr(self._pynvml, name)
        raise AttributeError(name)

    def __dir__(self) -> list[str]:
        return sorted(
            set(super().__dir__())
            | set(self._calls)
            | {n for n in dir(self._pynvml) if n.startswith("NVML_")}
        )

    # -- the rules ------------------------------------------------------------------------------

    def _answer(self, call: Call, name: str, *args: Any) -> Any:
        """A table call: ``(handle, *args)`` for a device call, ``(*args)`` for a system one."""
        if call.system:
            section = self._system(name)
        else:
            handle, *args = args  # type: ignore[assignment]
            section = self._gpu(name, handle)
        with self._rules():
            value = answer(call, section, tuple(int(a) for a in args))
        return SimpleNamespace(**value) if isinstance(value, dict) else value

    def _fail(self, code: int) -> None:
        if code != _SUCCESS:
            raise self._pynvml.NVMLError(code)

    def _system(self, fn: str) -> list[tuple[str, str]]:
        self._fail(_switch(self._state.system, fn))
        return self._state.system

    def _gpu(self, fn: str, handle: Any) -> list[tuple[str, str]]:
        self._fail(_switch(self._state.system, fn))
        index = getattr(handle, "index", None)
        if not isinstance(index, int) or not 0 <= index < len(self._state.gpus):
            raise self._pynvml.NVMLError(INVALID_ARGUMENT)
        section = self._state.gpus[index]
        lost = lookup(section, "lost")
        if lost is not None and lost != "0":
            self._fail(_GPU_IS_LOST)
        self._fail(_switch(section, fn))
        return section

    @contextlib.contextmanager
    def _rules(self) -> Iterator[None]:
        """The table's answers (NvmlAnswer) as nvidia-ml-py's NVMLError."""
        try:
            yield
        except NvmlAnswer as err:
            raise self._pynvml.NVMLError(err.code) from None

    def _ints(self, section: list[tuple[str, str]], key: str, n: int = 1) -> list[int]:
        with self._rules():
            return read_numbers(section, key, [UINT_MAX] * n)

    # -- the custom calls: init, enumeration ------------------------------------------------------

    def nvmlInit(self) -> None:
        self._system("nvmlInit")
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        self._initialised = max(0, self._initialised - 1)
        self._closed.set()

    def nvmlDeviceGetCount(self) -> int:
        self._system("nvmlDeviceGetCount")
        return len(self._state.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._system("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._state.gpus):
            self._fail(INVALID_ARGUMENT)
        handle = _Handle(index)
        self._gpu("nvmlDeviceGetHandleByIndex", handle)
        return handle

    # -- structs and several keys -------------------------------------------------------------------

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        section = self._gpu("nvmlDeviceGetPciInfo", handle)
        with self._rules():
            bus_id = read_text(section, "pci.bus_id")
        info = SimpleNamespace(
            busId=bus_id, busIdLegacy=bus_id[-12:], pciDeviceId=0, pciSubSystemId=0
        )
        for attr, key in (("pciDeviceId", "pci.device_id"), ("pciSubSystemId", "pci.subsystem_id")):
            if lookup(section, key) is not None:
                setattr(info, attr, self._ints(section, key)[0])
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        section = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        with self._rules():
            (total,) = read_numbers(section, "memory.total", [ULL_MAX])
            used = sum(
                read_numbers(section, k, [ULL_MAX])[0]
                for k in ("memory.reserved", "memory.used")
                if lookup(section, k) is not None
            )
        if used > total:
            self._fail(UNKNOWN)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetSramEccErrorStatus(self, handle: Any, status: Any) -> int:
        section = self._gpu("nvmlDeviceGetSramEccErrorStatus", handle)
        if not any(k.startswith("ecc_sram.") for k, _ in section):
            self._fail(NOT_SUPPORTED)

        def numbers(key: str, n: int) -> list[int]:
            return [0] * n if lookup(section, key) is None else self._ints(section, key, n)

        aggregate = numbers("ecc_sram.aggregate", 3)
        volatile = numbers("ecc_sram.volatile", 3)
        unit = numbers("ecc_sram.aggregate_by_unit", 5)
        (exceeded,) = numbers("ecc_sram.threshold_exceeded", 1)
        target = status._obj if hasattr(status, "_obj") else status
        (target.aggregateUncParity, target.aggregateUncSecDed, target.aggregateCor) = aggregate
        (target.volatileUncParity, target.volatileUncSecDed, target.volatileCor) = volatile
        (
            target.aggregateUncBucketL2,
            target.aggregateUncBucketSm,
            target.aggregateUncBucketPcie,
            target.aggregateUncBucketMcu,
            target.aggregateUncBucketOther,
        ) = unit
        target.bThresholdExceeded = int(exceeded != 0)
        return _SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, info: Any) -> int:
        """The versioned struct: nvmlGpuFabricInfo_v3 (or _v2, without the summary)."""
        target = info._obj if hasattr(info, "_obj") else info
        version = int(target.version) >> 24
        if version not in (2, 3):
            self._fail(_ARGUMENT_VERSION_MISMATCH)
        members = self._fabric("nvmlDeviceGetGpuFabricInfoV", handle)
        if version == 2:
            del members["healthSummary"]
        return self._fill(target, members)

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, info: Any) -> int:
        """The older struct: no version, health mask or summary."""
        members = self._fabric("nvmlDeviceGetGpuFabricInfo", handle)
        del members["healthMask"], members["healthSummary"]
        return self._fill(info._obj if hasattr(info, "_obj") else info, members)

    def _fabric(self, fn: str, handle: Any) -> dict[str, Any]:
        section = self._gpu(fn, handle)
        with self._rules():
            return fabric_members(read_text(section, "fabric"))

    @staticmethod
    def _fill(target: Any, members: dict[str, Any]) -> int:
        for name, value in members.items():
            if name == "clusterUuid":
                target.clusterUuid[:] = list(value)
            else:
                setattr(target, name, value)
        return _SUCCESS

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> range:
        section = self._gpu("nvmlDeviceGetRetiredPages", handle)
        key = {0: "retired_pages.sbe", 1: "retired_pages.dbe"}.get(cause)
        if key is None:
            self._fail(INVALID_ARGUMENT)
        (n,) = self._ints(section, str(key))
        base = 0x100000 * (cause + 1)  # made-up addresses, as the stand-in's; never listed
        return range(base, base + 0x1000 * n, 0x1000)

    # -- processes and events ---------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        section = self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)
        procs = []
        for key, value in section:
            if key != "process":
                continue
            pid, _, used = value.partition(" ")
            try:
                memory = ctypes.c_ulonglong(-1).value if used.strip() == "na" else int(used, 0)
                procs.append(SimpleNamespace(pid=int(pid), usedGpuMemory=memory))
            except ValueError:
                self._fail(UNKNOWN)
        return procs

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> Any:
        types = ("double", "uint", "ulong", "ulonglong", "slonglong", "sint", "ushort")
        members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
        section = self._gpu("nvmlDeviceGetFieldValues", handle)
        values = (self._pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for out, field_id in zip(values, field_ids, strict=True):
            field_id, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            out.fieldId, out.scopeId = field_id, scope
            out.valueType = 1
            text = lookup(section, f"field.{field_id}.{scope}") or lookup(
                section, f"field.{field_id}"
            )
            if text is None:
                out.nvmlReturn = NOT_SUPPORTED
                continue
            if text.startswith("error "):
                code = text[6:].strip()
                out.nvmlReturn = int(code) if code.lstrip("-").isdigit() else UNKNOWN
                continue
            kind, _, number = text.partition(" ")
            try:
                t = types.index(kind)
                value = float(number) if t == 0 else int(number, 0)
                setattr(out.value, members[t], value)
            except (ValueError, TypeError, OverflowError):
                out.nvmlReturn = UNKNOWN
                continue
            out.valueType = t
            out.nvmlReturn = _SUCCESS
        return values

    def nvmlEventSetCreate(self) -> Any:
        self._system("nvmlEventSetCreate")
        return SimpleNamespace(registered=set())

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._system("nvmlEventSetFree")

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        section = self._gpu("nvmlDeviceRegisterEvents", handle)
        with self._rules():
            (supported,) = read_numbers(section, "event_types", [ULL_MAX])
        if event_types & ~supported:
            self._fail(NOT_SUPPORTED)
        event_set.registered.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        """A capture holds no pending events (its Xids are in its kernel log): every wait
        times out, as NVML's does when nothing happens."""
        self._system("nvmlEventSetWait")
        self._closed.wait(timeout_ms / 1000)
        self._fail(_TIMEOUT)


# -- the backends ---------------------------------------------------------------------------------


class ReplayDevice(NvmlDevice):
    """A captured GPU. Its readings are one moment's: while the agent puts load on it
    (``load_hint``), what a GPU reports under load (temperatures, power, clocks, clock-event
    reasons, utilization) is not in the capture, and those readings answer NotSupported saying
    so, rather than the recorded moment's standing in for a load it never saw."""

    def __init__(self, backend: ReplayBackend, index: int) -> None:
        super().__init__(backend, index)
        self._replay = backend

    def _at_rest(self, what: str) -> None:
        if self._replay.loaded(self.index):
            raise NotSupported(
                f"GPU {self.index}: {what} under load is not in the capture "
                "(it holds one moment's readings, not how the GPU behaves "
                "under load)"
            )

    def temperature_c(self) -> int:
        self._at_rest("temperature")
        return super().temperature_c()

    def memory_temperature_c(self) -> int:
        self._at_rest("memory temperature")
        return super().memory_temperature_c()

    def power(self) -> Power:
        self._at_rest("power draw")
        return super().power()

    def clocks(self) -> Clocks:
        self._at_rest("the clocks")
        return super().clocks()

    def throttle_reasons(self) -> frozenset[str]:
        self._at_rest("clock-event reasons")
        return super().throttle_reasons()

    def utilization(self) -> Utilization:
        self._at_rest("utilization")
        return super().utilization()


class ReplayBackend(NvmlBackend):
    """A captured node through the real NVML backend code over :class:`StateNvml`; simulated
    (``--simulate``), with the capture's kernel-log records as its kernel log."""

    name = "replay"
    simulated = True

    def __init__(
        self, lib: StateNvml, kernel_log: Iterable[str] = (), call_timeout_s: float = 10.0
    ) -> None:
        super().__init__(lib, call_timeout_s)
        self._kernel_log = list(kernel_log)
        self._load_lock = threading.Lock()
        self._loaded: set[int] = set()

    def devices(self) -> list[GpuDevice]:
        """One :class:`ReplayDevice` per GPU the capture recorded."""
        if self._devices is None:
            count = self._call("nvmlDeviceGetCount")
            self._devices = [ReplayDevice(self, i) for i in range(count)]
        return list(self._devices)

    def load_hint(self, indices: list[int], active: bool) -> None:
        """Which GPUs carry the agent's load: their load readings are not replayed."""
        with self._load_lock:
            if active:
                self._loaded.update(indices)
            else:
                self._loaded.difference_update(indices)

    def loaded(self, index: int) -> bool:
        with self._load_lock:
            return index in self._loaded

    def kernel_log_lines(self) -> list[str]:
        """The captured kernel-log records, as recorded (kmsg's ``prio,seq,usec,flags;``
        header kept where the capture read /dev/kmsg)."""
        return list(self._kernel_log)


class ReplayAbsentBackend(AbsentGpuBackend):
    """A captured node whose NVML did not load (``nvmlInit`` recorded as an error)."""

    simulated = True

    def __init__(self, reason: str, broken: bool, kernel_log: Iterable[str] = ()) -> None:
        super().__init__(reason, broken)
        self._kernel_log = list(kernel_log)

    def kernel_log_lines(self) -> list[str]:
        return list(self._kernel_log)

    def load_hint(self, indices: list[int], active: bool) -> None:
        """Nothing to model: NVML did not load on the captured node."""


def open_replay(
    nvml: Mapping[str, Any],
    kernel_log: Iterable[str] = (),
    source: str = "a capture",
    call_timeout_s: float = 10.0,
) -> ReplayBackend | ReplayAbsentBackend:
    """The captured node's GPU backend: NVML replayed, or NVML failing as it failed there."""
    lib = StateNvml(capture_state_lines(nvml, source, strict=False))
    backend = ReplayBackend(lib, kernel_log, call_timeout_s)
    try:
        backend.init()
    except NvmlUnavailable as err:
        return ReplayAbsentBackend(str(err), err.broken, kernel_log)
    return backend
