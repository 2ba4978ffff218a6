"""The NVML calls the agent makes, written once: the table every NVML stand-in follows.

One :class:`Call` per NVML function: its arguments, the state key it answers from (the key a
capture records and the stand-in's state file holds, docs/nvml_fake.md), the C types of what it
returns, and how a missing key or an error is kept. From this table:

- the recorder (:mod:`node_agent.gpu.record`, ``node-agent capture``) asks each call for every
  recorded argument and writes the answer, or the NVML error, under its key;
- the Python replay (:class:`node_agent.gpu.replay.StateNvml`, ``--simulate`` of a capture)
  answers each call from a state file by :func:`answer`;
- the C stand-in ``libnvidia-ml.so.1`` gets one generated getter per call
  (``tests/nvml_fake/gen_calls.py``, run by ``scripts/build-nvml-fake``);
- the simulator's model renders into the same keys (:mod:`node_agent.sim.nvml_state`), through
  each call's ``reading`` (the :class:`~node_agent.gpu.base.GpuDevice` method) and ``to_state``.

A call marked ``custom`` has hand-written code in each stand-in (versioned structs, two-call
size protocols, events): the table still names its keys and its model.

Adding a simple call (one key, numbers or a string out, arguments that pick the key): one entry
here, the reading in ``gpu/base.py``, its use in ``gpu/nvml.py`` (and the simulator's model in
``sim/gpu_model.py``). Nothing else: the stand-ins follow this table.

Rules every stand-in keeps (nvml.h's codes): a key the state does not give answers
NVML_ERROR_NOT_SUPPORTED (or the call's ``missing`` value); a value ``error <code>`` answers
that code; an argument beyond its names answers the argument's ``beyond`` code; a value that is
not a number of the C type answers NVML_ERROR_UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import product
from operator import attrgetter
from typing import Any

from node_agent.gpu.base import (
    FABRIC_HEALTH_SUMMARIES,
    FABRIC_STATES,
    NVLINK_REMOTE_TYPES,
    RECOVERY_ACTIONS,
    SRAM_UNITS,
    THROTTLE_REASONS,
    VIRTUALIZATION_MODES,
    GpuFabric,
    nvlink_ber_encoded,
)

# nvmlReturn_t codes (nvml.h; part of the C ABI)
SUCCESS = 0
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
UNKNOWN = 999
#: NVML's error strings (nvmlErrorString), so a capture says "Not Supported" as nvidia-smi
#: does; the stand-in library's nvmlErrorString is generated from them
ERROR_NAMES = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    8: "Insufficient External Power",
    9: "Driver Not Loaded",
    10: "Timeout",
    11: "Interrupt request issue",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    14: "Corrupted infoROM",
    15: "GPU is lost",
    16: "GPU requires restart",
    17: "The operating system has blocked the request.",
    18: "RM has detected an NVML/RM version mismatch.",
    19: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    22: "Argument version mismatch",
    23: "Deprecated",
    24: "Not Ready",
    28: "GPU not found",
    29: "Invalid state",
    999: "Unknown Error",
}
#: NVML_NVLINK_MAX_LINKS (nvml.h)
NVLINK_MAX_LINKS = 18
#: the largest value each C out type holds (a state value beyond it is NVML_ERROR_UNKNOWN)
ULL_MAX = 2**64 - 1
_MAX = {"unsigned long long": ULL_MAX}
UINT_MAX = 2**32 - 1
_MIB = 1024 * 1024
# nvmlEventType*: SingleBitEccError, DoubleBitEccError, PState, XidCriticalError, Clock
_EVENT_TYPES = 0x1 | 0x2 | 0x4 | 0x8 | 0x10


@dataclass(frozen=True)
class Arg:
    """An argument that picks the key. ``names[value]`` is its part of the key (``None``: the
    number itself, below ``count``); a value past them answers ``beyond``. ``link``: an NVLink
    index, with the link rule (:func:`answer`). ``recorded``: the values the recorder asks
    (default: all)."""

    c_type: str
    c_name: str
    names: tuple[str, ...] | None = None
    count: int = 0
    beyond: int = INVALID_ARGUMENT
    recorded: tuple[int, ...] | None = None
    link: bool = False

    def values(self) -> tuple[int, ...]:
        if self.recorded is not None:
            return self.recorded
        return tuple(range(NVLINK_MAX_LINKS if self.link else len(self.names or ()) or self.count))

    def part(self, value: int) -> str | int | None:
        """The key part for ``value``, or None when the value is out of range."""
        if self.link:
            return value if 0 <= value < NVLINK_MAX_LINKS else None
        if self.names is None:
            return value if 0 <= value < self.count else None
        return self.names[value] if 0 <= value < len(self.names) else None


@dataclass(frozen=True)
class Out:
    """One thing the call returns: its C type (``char``: a string with its length argument,
    ``nvmlEnableState_t``: 0/1 as disabled/enabled) and parameter or struct member name."""

    c_type: str
    c_name: str


@dataclass(frozen=True)
class Call:
    """One NVML function the agent calls (see the module docstring)."""

    function: str
    key: str
    outs: tuple[Out, ...] = ()
    args: tuple[Arg, ...] = ()
    #: other exported names with the same signature and key (older names, ``_v2``), after
    #: ``function`` in the order the backend tries them
    aliases: tuple[str, ...] = ()
    #: newer names the recorder tries first, answered by hand-written code (``...V`` structs)
    newer: tuple[str, ...] = ()
    system: bool = False
    #: the outs are the members of one struct of this C type (``nvmlUtilization_t``)
    struct: str = ""
    #: recorded as a hex string (bit masks)
    hex: bool = False
    #: what the call answers where the state lacks the key (None: NVML_ERROR_NOT_SUPPORTED)
    missing: int | None = None
    #: hand-written in each stand-in (versioned structs, two-call protocols, several keys)
    custom: bool = False
    #: the recorder asks it (False: only the stand-ins answer it)
    record: bool = True
    #: the recorder leaves out an answer with these codes (an NVLink index past the GPU's links)
    omit: tuple[int, ...] = ()
    #: the simulator's reading (a GpuDevice method; "" for none) and its state values:
    #: a call without arguments gets its key's value, one with arguments a {key: value} map;
    #: None leaves the key out
    reading: str = ""
    to_state: Callable[[Any], Any] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every exported name answering this call, newest first."""
        return (self.function, *self.aliases)

    @property
    def text(self) -> bool:
        """One string out: the call's own ``char *`` and length, or with ``struct`` a
        ``char[]`` member of the struct (``nvmlPciInfo_t.busId``)."""
        return len(self.outs) == 1 and self.outs[0].c_type == "char"

    def keys(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """(argument values, key) for each key the recorder asks."""
        for values in product(*(a.values() for a in self.args)):
            yield values, self.key_for(values)

    def key_for(self, values: tuple[int, ...]) -> str:
        parts = {a.c_name: a.part(v) for a, v in zip(self.args, values, strict=True)}
        return self.key.format(**parts)

    def limit(self) -> list[int]:
        """The largest value each out holds."""
        return [_MAX.get(o.c_type, UINT_MAX) for o in self.outs]


@dataclass(frozen=True)
class Field:
    """An ``nvmlDeviceGetFieldValues`` field (``NVML_FI_*``) the simulator models: state key
    ``field.<id>``, value ``<value_type> <n>``. ``per_link``: the field is asked per NVLink
    (``scopeId`` the link): state keys ``field.<id>.<link>``, ``to_state`` gives {link: n},
    and the recorder asks it for each link the GPU answers for."""

    field_id: int
    name: str
    reading: str
    to_state: Callable[[Any], Any]
    value_type: str = "uint"
    per_link: bool = False


def _uint(name: str) -> tuple[Out, ...]:
    return (Out("unsigned int", name),)


def _ull(name: str) -> tuple[Out, ...]:
    return (Out("unsigned long long", name),)


def _string(name: str) -> tuple[Out, ...]:
    return (Out("char", name),)


def _mw(watts: float | None) -> int | None:
    return None if watts is None else round(watts * 1000)


def _each(reading: str, c_type: str, *rows: tuple[str, str, Callable[[Any], Any]]) -> list[Call]:
    """One call per row ``(function, key, its state value from the reading)``, each returning
    one ``c_type`` and modelled from the same reading."""
    return [
        Call(function, key, (Out(c_type, "value"),), reading=reading, to_state=value)
        for function, key, value in rows
    ]


_CLOCK = Arg("nvmlClockType_t", "type", ("graphics", "sm", "mem", "video"))
_ERROR_TYPE = Arg("nvmlMemoryErrorType_t", "errorType", ("corrected", "uncorrected"))
_COUNTER_TYPE = Arg("nvmlEccCounterType_t", "counterType", ("volatile", "aggregate"))
_LOCATION = Arg(
    "nvmlMemoryLocation_t",
    "locationType",
    ("l1", "l2", "dram", "register_file", "texture", "texture_shm", "cbu", "sram"),
)
_LINK = Arg("unsigned int", "link", link=True)
_THRESHOLDS = (
    "shutdown",
    "slowdown",
    "mem_max",
    "gpu_max",
    "acoustic_min",
    "acoustic_curr",
    "acoustic_max",
    "gps_curr",
)
_NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data", "ecc_data")
# nvmlNvLinkCapability_t: NVML_NVLINK_CAP_P2P_SUPPORTED, NVML_NVLINK_CAP_VALID
NVLINK_CAP_P2P_SUPPORTED = 0
NVLINK_CAP_VALID = 5


def _ecc(ecc: Any) -> dict[str, Any]:
    return {
        "ecc.corrected.volatile": ecc.volatile_sbe,
        "ecc.uncorrected.volatile": ecc.volatile_dbe,
        "ecc.corrected.aggregate": ecc.aggregate_sbe,
        "ecc.uncorrected.aggregate": ecc.aggregate_dbe,
    }


def _ecc_sram(ecc: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if ecc.sram_uncorrectable_aggregate is not None:
        # the simulator keeps one count: all SEC-DED (a real GPU splits parity/SEC-DED)
        out["ecc_sram.aggregate"] = f"0 {ecc.sram_uncorrectable_aggregate} 0"
        out["ecc_sram.volatile"] = "0 0 0"
        out["ecc_sram.aggregate_by_unit"] = " ".join(
            str(ecc.sram_uncorrectable_by_unit.get(u, 0)) for u in SRAM_UNITS
        )
    if ecc.sram_threshold_exceeded is not None:
        out["ecc_sram.threshold_exceeded"] = int(ecc.sram_threshold_exceeded)
    return out


def fabric_value(fabric: GpuFabric) -> str:
    """A fabric as the state key ``fabric`` holds it: ``<state> <status> <cluster uuid>
    <clique id> <health mask> <health summary>`` (nvmlGpuFabricInfo_v3_t's members, the state
    and summary as their nvml.h numbers)."""
    state = FABRIC_STATES.index(fabric.state) if fabric.state in FABRIC_STATES else 0
    summary = fabric.health_summary
    number = FABRIC_HEALTH_SUMMARIES.index(summary) if summary in FABRIC_HEALTH_SUMMARIES else 0
    return (
        f"{state} {fabric.status} {fabric.cluster_uuid} {fabric.clique_id} "
        f"{fabric.health_mask or 0:#x} {number}"
    )


def fabric_members(text: str) -> dict[str, Any]:
    """The state key ``fabric`` as nvmlGpuFabricInfo_v3_t's members (clusterUuid as 16
    bytes); NvmlAnswer UNKNOWN when it is not that form, or the value's error code."""
    _error(text)
    parts = text.split()
    try:
        state, status, uuid, clique, mask, summary = parts
        raw = bytes.fromhex(uuid.replace("-", ""))
        numbers = [int(state, 0), int(status, 0), int(clique, 0), int(mask, 0), int(summary, 0)]
    except ValueError:
        raise NvmlAnswer(UNKNOWN) from None
    if len(raw) != 16 or not all(0 <= n <= UINT_MAX for n in numbers) or numbers[0] > 255:
        raise NvmlAnswer(UNKNOWN)
    return {
        "clusterUuid": raw,
        "status": numbers[1],
        "cliqueId": numbers[2],
        "state": numbers[0],
        "healthMask": numbers[3],
        "healthSummary": numbers[4] & 0xFF,
    }


def _nvlink(what: Callable[[Any], Any]) -> Callable[[Any], dict[str, Any]]:
    return lambda links: {f"nvlink.{link.link}.{k}": v for link in links for k, v in what(link)}


def _remote_type(link: Any) -> list[tuple[str, Any]]:
    number = {v: k for k, v in NVLINK_REMOTE_TYPES.items()}.get(link.remote_type or "")
    return [] if number is None else [("remote_type", number)]


def _per_link(attr: str, convert: Callable[[Any], int] = int) -> Callable[[Any], dict[int, int]]:
    """A per-link field's state values from the simulator's links ({link: n})."""
    return lambda links: {
        link.link: convert(getattr(link, attr)) for link in links if getattr(link, attr) is not None
    }


#: the calls, in the order the recorder asks them
CALLS: tuple[Call, ...] = (
    Call("nvmlSystemGetDriverVersion", "driver_version", _string("version"), system=True),
    Call("nvmlSystemGetNVMLVersion", "nvml_version", _string("version"), system=True),
    Call(
        "nvmlSystemGetCudaDriverVersion_v2",
        "cuda_driver_version",
        (Out("int", "cudaDriverVersion"),),
        aliases=("nvmlSystemGetCudaDriverVersion",),
        system=True,
    ),
    *_each(
        "identity",
        "char",
        ("nvmlDeviceGetName", "name", attrgetter("name")),
        ("nvmlDeviceGetUUID", "uuid", attrgetter("uuid")),
        ("nvmlDeviceGetSerial", "serial", attrgetter("serial")),
        ("nvmlDeviceGetVbiosVersion", "vbios", attrgetter("vbios")),
    ),
    Call(
        "nvmlDeviceGetPciInfo",
        "pci.bus_id",
        custom=True,
        reading="identity",
        to_state=lambda ident: {"pci.bus_id": ident.pci_bus_id},
    ),
    Call(
        "nvmlDeviceGetMemoryInfo",
        "memory.total",
        custom=True,
        reading="identity",
        to_state=lambda ident: {
            "memory.total": None
            if ident.memory_total_mib is None
            else ident.memory_total_mib * _MIB
        },
    ),
    Call("nvmlDeviceGetMinorNumber", "minor_number", _uint("minorNumber")),
    Call("nvmlDeviceGetArchitecture", "architecture", (Out("nvmlDeviceArchitecture_t", "arch"),)),
    Call(
        "nvmlDeviceGetCudaComputeCapability",
        "cuda_compute_capability",
        (Out("int", "major"), Out("int", "minor")),
    ),
    Call(
        "nvmlDeviceGetVirtualizationMode",
        "virtualization_mode",
        (Out("nvmlGpuVirtualizationMode_t", "pVirtualMode"),),
        reading="virtualization_mode",
        to_state=lambda mode: (
            VIRTUALIZATION_MODES.index(mode) if mode in VIRTUALIZATION_MODES else None
        ),
    ),
    Call(
        "nvmlDeviceGetTemperature",
        "temperature.{sensorType}",
        _uint("temp"),
        args=(Arg("nvmlTemperatureSensors_t", "sensorType", ("gpu",), beyond=NOT_SUPPORTED),),
        newer=("nvmlDeviceGetTemperatureV",),
        reading="temperature_c",
        to_state=lambda c: {"temperature.gpu": c},
    ),
    Call(
        "nvmlDeviceGetTemperatureThreshold",
        "temperature.threshold.{thresholdType}",
        _uint("temp"),
        args=(
            Arg(
                "nvmlTemperatureThresholds_t",
                "thresholdType",
                _THRESHOLDS,
                beyond=NOT_SUPPORTED,
                recorded=(0, 1, 2, 3),
            ),
        ),
        reading="temperature_thresholds",
        to_state=lambda t: {
            "temperature.threshold.shutdown": t.shutdown_c,
            "temperature.threshold.slowdown": t.slowdown_c,
            "temperature.threshold.gpu_max": t.gpu_max_operating_c,
            "temperature.threshold.mem_max": t.memory_max_operating_c,
        },
    ),
    *_each(
        "power",
        "unsigned int",
        ("nvmlDeviceGetPowerUsage", "power.usage", lambda p: _mw(p.usage_w)),
        (
            "nvmlDeviceGetEnforcedPowerLimit",
            "power.enforced_limit",
            lambda p: _mw(p.enforced_limit_w),
        ),
        ("nvmlDeviceGetPowerManagementLimit", "power.limit", lambda p: _mw(p.enforced_limit_w)),
        (
            "nvmlDeviceGetPowerManagementDefaultLimit",
            "power.default_limit",
            lambda p: _mw(p.default_limit_w),
        ),
    ),
    *_each(
        "pcie",
        "unsigned int",
        ("nvmlDeviceGetCurrPcieLinkGeneration", "pcie.gen", attrgetter("gen_current")),
        ("nvmlDeviceGetMaxPcieLinkGeneration", "pcie.gen_max", attrgetter("gen_max")),
        ("nvmlDeviceGetCurrPcieLinkWidth", "pcie.width", attrgetter("width_current")),
        ("nvmlDeviceGetMaxPcieLinkWidth", "pcie.width_max", attrgetter("width_max")),
        ("nvmlDeviceGetPcieReplayCounter", "pcie.replay_counter", attrgetter("replay_count")),
    ),
    Call(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "retired_pages.pending",
        (Out("nvmlEnableState_t", "isPending"),),
        reading="retired_pages",
        to_state=lambda p: int(p.pending),
    ),
    Call(
        "nvmlDeviceGetPersistenceMode",
        "persistence_mode",
        (Out("nvmlEnableState_t", "mode"),),
        reading="persistence_mode",
        to_state=int,
    ),
    Call(
        "nvmlDeviceGetSupportedEventTypes",
        "event_types",
        _ull("eventTypes"),
        to_state=lambda _: f"{_EVENT_TYPES:#x}",
    ),
    Call(
        "nvmlDeviceGetClockInfo",
        "clock.{type}",
        _uint("clock"),
        args=(_CLOCK,),
        reading="clocks",
        to_state=lambda c: {
            "clock.sm": c.sm_mhz,
            "clock.graphics": c.sm_mhz,
            "clock.mem": c.memory_mhz,
        },
    ),
    Call(
        "nvmlDeviceGetMaxClockInfo",
        "clock_max.{type}",
        _uint("clock"),
        args=(_CLOCK,),
        reading="clocks",
        to_state=lambda c: {"clock_max.sm": c.sm_max_mhz, "clock_max.graphics": c.sm_max_mhz},
    ),
    Call(
        "nvmlDeviceGetCurrentClocksEventReasons",
        "clocks_event_reasons",
        _ull("clocksEventReasons"),
        aliases=("nvmlDeviceGetCurrentClocksThrottleReasons",),
        hex=True,
        reading="throttle_reasons",
        to_state=lambda reasons: f"{sum(1 << THROTTLE_REASONS.index(r) for r in reasons):#x}",
    ),
    Call(
        "nvmlDeviceGetSupportedClocksEventReasons",
        "clocks_event_reasons_supported",
        _ull("supportedClocksEventReasons"),
        aliases=("nvmlDeviceGetSupportedClocksThrottleReasons",),
        hex=True,
        reading="throttle_reasons",
        to_state=lambda _: f"{(1 << len(THROTTLE_REASONS)) - 1:#x}",
    ),
    Call(
        "nvmlDeviceGetUtilizationRates",
        "utilization",
        (Out("unsigned int", "gpu"), Out("unsigned int", "memory")),
        struct="nvmlUtilization_t",
        reading="utilization",
        to_state=lambda u: f"{u.gpu_pct} {u.memory_pct}",
    ),
    Call(
        "nvmlDeviceGetEccMode",
        "ecc.mode",
        (Out("nvmlEnableState_t", "current"), Out("nvmlEnableState_t", "pending")),
        reading="ecc",
        to_state=lambda ecc: f"{int(ecc.enabled)} {int(ecc.enabled)}",
    ),
    Call(
        "nvmlDeviceGetTotalEccErrors",
        "ecc.{errorType}.{counterType}",
        _ull("eccCounts"),
        args=(_ERROR_TYPE, _COUNTER_TYPE),
        reading="ecc",
        to_state=_ecc,
    ),
    Call(
        "nvmlDeviceGetMemoryErrorCounter",
        "ecc.{errorType}.{counterType}.{locationType}",
        _ull("count"),
        args=(_ERROR_TYPE, _COUNTER_TYPE, _LOCATION),
        reading="ecc",
        to_state=lambda ecc: {
            "ecc.uncorrected.aggregate.sram": ecc.aggregate_dbe_sram,
            "ecc.uncorrected.aggregate.dram": ecc.aggregate_dbe_dram,
        },
    ),
    Call(
        "nvmlDeviceGetSramEccErrorStatus",
        "ecc_sram.aggregate",
        custom=True,
        reading="ecc",
        to_state=_ecc_sram,
    ),
    Call(
        "nvmlDeviceGetRetiredPages",
        "retired_pages.sbe",
        custom=True,
        reading="retired_pages",
        to_state=lambda p: {"retired_pages.sbe": p.sbe, "retired_pages.dbe": p.dbe},
    ),
    Call(
        "nvmlDeviceGetRemappedRows",
        "remapped_rows",
        tuple(
            Out("unsigned int", n) for n in ("corrRows", "uncRows", "isPending", "failureOccurred")
        ),
        reading="row_remap",
        to_state=lambda r: f"{r.corrected} {r.uncorrected} {int(r.pending)} {int(r.failed)}",
    ),
    Call(
        "nvmlDeviceGetNvLinkState",
        "nvlink.{link}.state",
        (Out("nvmlEnableState_t", "isActive"),),
        args=(_LINK,),
        omit=(INVALID_ARGUMENT,),
        reading="nvlinks",
        to_state=_nvlink(lambda link: [("state", int(link.active))]),
    ),
    Call(
        "nvmlDeviceGetNvLinkCapability",
        "nvlink.{link}.cap.{capability}",
        _uint("capResult"),
        args=(
            _LINK,
            Arg(
                "nvmlNvLinkCapability_t",
                "capability",
                count=6,
                recorded=(NVLINK_CAP_P2P_SUPPORTED, NVLINK_CAP_VALID),
            ),
        ),
        missing=0,  # a capability the state does not list is not there
        reading="nvlinks",
        to_state=_nvlink(
            lambda link: [
                *(
                    []
                    if link.p2p_supported is None
                    else [(f"cap.{NVLINK_CAP_P2P_SUPPORTED}", int(link.p2p_supported))]
                ),
                (f"cap.{NVLINK_CAP_VALID}", 1),
            ]
        ),
    ),
    Call(
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvlink.{link}.error.{counter}",
        _ull("counterValue"),
        args=(
            _LINK,
            Arg("nvmlNvLinkErrorCounter_t", "counter", _NVLINK_COUNTERS, recorded=(0, 1, 2)),
        ),
        reading="nvlinks",
        to_state=_nvlink(
            lambda link: [
                ("error.replay", link.replay_errors),
                ("error.recovery", link.recovery_errors),
                ("error.crc_flit", link.crc_errors),
            ]
        ),
    ),
    Call(
        "nvmlDeviceGetNvLinkRemoteDeviceType",
        "nvlink.{link}.remote_type",
        (Out("nvmlIntNvLinkDeviceType_t", "pNvLinkDeviceType"),),
        args=(_LINK,),
        omit=(INVALID_ARGUMENT,),
        reading="nvlinks",
        to_state=_nvlink(_remote_type),
    ),
    Call(
        # nvidia-ml-py's nvmlDeviceGetNvLinkRemotePciInfo calls the _v2 symbol
        "nvmlDeviceGetNvLinkRemotePciInfo_v2",
        "nvlink.{link}.remote_pci",
        (Out("char", "busId"),),
        args=(_LINK,),
        aliases=("nvmlDeviceGetNvLinkRemotePciInfo",),
        struct="nvmlPciInfo_t",
        omit=(INVALID_ARGUMENT,),
        reading="nvlinks",
        to_state=_nvlink(
            lambda link: (
                [] if link.remote_pci_bus_id is None else [("remote_pci", link.remote_pci_bus_id)]
            )
        ),
    ),
    Call(
        "nvmlDeviceGetGpuFabricInfoV",
        "fabric",
        aliases=("nvmlDeviceGetGpuFabricInfo",),
        custom=True,
        reading="fabric",
        to_state=fabric_value,
    ),
    Call(
        "nvmlDeviceGetComputeRunningProcesses",
        "process",
        custom=True,
        reading="compute_processes",
        to_state=lambda procs: {
            "process": [
                f"{p.pid} {'na' if p.used_memory_bytes is None else p.used_memory_bytes}"
                for p in procs
            ]
        },
    ),
)

#: the fields the simulator models (NVML_FI_*, nvml.h)
FIELDS: tuple[Field, ...] = (
    Field(82, "NVML_FI_DEV_MEMORY_TEMP", "memory_temperature_c", lambda c: c),
    Field(
        230,
        "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
        "recovery_action",
        RECOVERY_ACTIONS.index,
    ),
    Field(91, "NVML_FI_DEV_NVLINK_LINK_COUNT", "nvlinks", lambda links: len(links) or None),
    # NVLink5 (Blackwell): per link; Not Supported before
    Field(
        219,
        "NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS",
        "nvlinks",
        _per_link("effective_errors"),
        "ulonglong",
        per_link=True,
    ),
    Field(
        220,
        "NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER",
        "nvlinks",
        _per_link("effective_ber", nvlink_ber_encoded),
        per_link=True,
    ),
    Field(
        221,
        "NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS",
        "nvlinks",
        _per_link("symbol_errors"),
        "ulonglong",
        per_link=True,
    ),
    Field(
        222,
        "NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER",
        "nvlinks",
        _per_link("symbol_ber", nvlink_ber_encoded),
        per_link=True,
    ),
)
#: field ids by name (the backend asks these)
FIELD_IDS = {f.name: f.field_id for f in FIELDS}
#: keys of the calls that list several items, one state line each
REPEATED_KEYS = frozenset({"process", "xid"})


def by_name(calls: tuple[Call, ...] = CALLS) -> dict[str, Call]:
    """Every exported name of a table-answered (not custom) call -> its call."""
    return {name: c for c in calls if not c.custom for name in c.names}


# -- answering from a state section (the rules every stand-in keeps) -----------------------------


class NvmlAnswer(Exception):
    """A call's nvmlReturn_t other than success."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def lookup(section: list[tuple[str, str]], key: str) -> str | None:
    """The value of ``key`` in a state section (the last line wins), or None."""
    for k, v in reversed(section):
        if k == key:
            return v
    return None


def _key(call: Call, section: list[tuple[str, str]], values: tuple[int, ...]) -> str:
    """The key for these argument values, or the argument's or NVLink rule's answer."""
    for arg, value in zip(call.args, values, strict=True):
        if arg.part(value) is None:
            raise NvmlAnswer(arg.beyond)
        if arg.link:
            # an index the state does not describe: INVALID_ARGUMENT on a GPU with NVLink keys,
            # NOT_SUPPORTED on one without; a link whose state is an error answers that error
            # for every call on it
            state = lookup(section, f"nvlink.{value}.state")
            if state is None:
                has_links = any(k.startswith("nvlink.") for k, _ in section)
                raise NvmlAnswer(INVALID_ARGUMENT if has_links else NOT_SUPPORTED)
            _error(state)
    return call.key_for(values)


def _error(text: str) -> None:
    """A value ``error <code>`` answers that code."""
    if text.startswith("error "):
        code = text[6:].strip()
        raise NvmlAnswer(int(code) if code.lstrip("-").isdigit() else UNKNOWN)


def read_text(section: list[tuple[str, str]], key: str) -> str:
    """The text of ``key`` (the table's rules)."""
    text = lookup(section, key)
    if text is None:
        raise NvmlAnswer(NOT_SUPPORTED)
    _error(text)
    return text


def read_numbers(section: list[tuple[str, str]], key: str, limits: list[int]) -> list[int]:
    """``len(limits)`` numbers from ``key``, each at most its limit (the table's rules)."""
    try:
        numbers = [int(v, 0) for v in read_text(section, key).split()]
    except ValueError:
        raise NvmlAnswer(UNKNOWN) from None
    if len(numbers) != len(limits) or not all(
        0 <= n <= m for n, m in zip(numbers, limits, strict=True)
    ):
        raise NvmlAnswer(UNKNOWN)
    return numbers


def answer(call: Call, section: list[tuple[str, str]], values: tuple[int, ...]) -> Any:
    """What ``call`` with argument ``values`` answers from a GPU's (or the system's) state
    lines: a string, a number, a tuple of numbers (several outs), or a mapping of struct
    members; raises :class:`NvmlAnswer` with the code otherwise."""
    key = _key(call, section, values)
    if call.missing is not None and lookup(section, key) is None:
        return call.missing
    if call.text:
        text = read_text(section, key)
        return {call.outs[0].c_name: text} if call.struct else text
    numbers = [
        int(bool(n)) if o.c_type == "nvmlEnableState_t" else n
        for n, o in zip(read_numbers(section, key, call.limit()), call.outs, strict=True)
    ]
    if call.struct:
        return {o.c_name: n for o, n in zip(call.outs, numbers, strict=True)}
    return numbers[0] if len(numbers) == 1 else tuple(numbers)


# -- recording and rendering --------------------------------------------------------------------


def recorded_value(call: Call, value: Any) -> Any:
    """A call's answer as a capture records it (the state file's form)."""
    if call.text:
        if call.struct:
            value = getattr(value, call.outs[0].c_name)
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if call.struct:
        return " ".join(str(int(getattr(value, o.c_name))) for o in call.outs)
    if len(call.outs) > 1:
        return " ".join(str(int(v)) for v in value)
    return f"{int(value):#x}" if call.hex else int(value)


def model_values(call: Call, reading: Any) -> Mapping[str, Any]:
    """The state values of ``call`` for the simulator's ``reading`` ({key: value}; None
    values are left out by the caller)."""
    assert call.to_state is not None
    value = call.to_state(reading)
    if isinstance(value, Mapping):
        return value
    return {call.key: value}
