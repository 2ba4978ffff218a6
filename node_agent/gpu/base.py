"""The contract every GPU backend satisfies (NVML, the simulator, test fakes).

A reading is a value, or one of the errors below; never a silent default. A backend that cannot
answer a question raises :class:`NotSupported`; a GPU that stopped answering raises
:class:`DeviceLost`; a call that did not return in time raises :class:`GpuTimeout`. Checks import
this module, never pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# -- errors -------------------------------------------------------------------------------------


class GpuError(Exception):
    """A GPU query failed; the message says which query, on which GPU, and what to do."""


class NotSupported(GpuError):
    """This GPU, driver or backend does not report that value (not a failure of the GPU)."""


class NoPermission(GpuError):
    """The query needs privileges the agent lacks (run as root or grant the capability)."""


class DeviceLost(GpuError):
    """The GPU stopped answering (fell off the bus, NVML_ERROR_GPU_IS_LOST): a fault of its own."""


class GpuTimeout(GpuError):
    """A driver call did not return in time; the driver may be hung. Further calls fail fast."""


class DriverStateError(GpuError):
    """The driver's or the container's state refused the query (NVML's Unknown Error, reset
    required, blocked by the operating system, a library and driver version mismatch), not
    proof of a bad GPU: a reset, a reboot or a new container clears it."""


# -- readings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """``nvidia-smi -q``: Product Name, GPU UUID, Bus Id, Serial Number, VBIOS Version, FB Memory."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # NVML form, e.g. 00000000:3B:00.0
    serial: str | None
    vbios: str | None
    memory_total_mib: int | None


@dataclass(frozen=True)
class TemperatureThresholds:
    """``nvidia-smi -q -d TEMPERATURE``: GPU Shutdown/Slowdown/Max Operating Temp (°C)."""

    shutdown_c: int | None
    slowdown_c: int | None
    gpu_max_operating_c: int | None = None
    memory_max_operating_c: int | None = None


@dataclass(frozen=True)
class Power:
    """``nvidia-smi -q -d POWER``: Power Draw, Enforced and Default Power Limit (W)."""

    usage_w: float
    enforced_limit_w: float | None
    default_limit_w: float | None


@dataclass(frozen=True)
class Clocks:
    """``nvidia-smi -q -d CLOCK``: current and max SM clock, current memory clock (MHz)."""

    sm_mhz: int
    sm_max_mhz: int | None
    memory_mhz: int | None


@dataclass(frozen=True)
class PcieLink:
    """``nvidia-smi -q -d PCIE``: link generation and width, current and max; replay counter."""

    gen_current: int
    gen_max: int
    width_current: int
    width_max: int
    replay_count: int | None

    def shortfall(self, gen: int | None, width: int | None) -> tuple[list[str], list[str]]:
        """Against the wanted ``gen`` and ``width`` (a SKU's; None: not judged): what the link
        trained below what it and the system can do (a degraded link), and what the system
        cannot give at all. NVML's maxima are "possible with this device and system" (an x16
        GPU in an x8 slot reads 8, a Gen5 GPU in a Gen4 server 4): short of the SKU there is
        the platform's, not the GPU's."""
        degraded, platform = [], []
        for name, current, most, wanted in (
            ("Gen", self.gen_current, self.gen_max, gen),
            ("x", self.width_current, self.width_max, width),
        ):
            if wanted is None:
                continue
            if current < min(wanted, most):
                degraded.append(f"{name}{current} of {name}{min(wanted, most)}")
            if most < wanted:
                platform.append(f"{name}{most} of the SKU's {name}{wanted}")
        return degraded, platform


@dataclass(frozen=True)
class EccCounts:
    """``nvidia-smi -q -d ECC``: corrected (SBE) and uncorrected (DBE) errors.

    ``volatile_*`` count since the last driver load; ``aggregate_*`` over the GPU's life.
    ``*_sram``/``*_dram`` split aggregate uncorrected errors by location where NVML reports it.

    The ``sram_*`` fields are ``nvmlDeviceGetSramEccErrorStatus`` (Ampere and later, root;
    ``nvidia-smi -q -d ECC``: "SRAM Uncorrectable Parity/SEC-DED", "SRAM Threshold Exceeded",
    "Aggregate Uncorrectable SRAM Sources"), None where the GPU or driver does not report them:
    ``sram_uncorrectable_aggregate`` is ``aggregateUncParity + aggregateUncSecDed``;
    ``sram_threshold_exceeded`` is ``bThresholdExceeded``, the driver's flag that the SRAM
    errors meet NVIDIA's RMA criteria (NVIDIA "GPU Memory Error Management", RMA policy:
    more than 4 unique uncorrectable events in one address bank of a parity-protected SRAM,
    or more than 2 of a SEC-DED one); ``sram_uncorrectable_by_unit`` is the aggregate by unit
    (``l2``, ``sm``, ``pcie``, ``mcu``, ``other``: the ``aggregateUncBucket*`` fields).
    """

    enabled: bool
    volatile_sbe: int | None
    volatile_dbe: int | None
    aggregate_sbe: int | None
    aggregate_dbe: int | None
    aggregate_dbe_sram: int | None = None
    aggregate_dbe_dram: int | None = None
    sram_uncorrectable_aggregate: int | None = None
    sram_threshold_exceeded: bool | None = None
    sram_uncorrectable_by_unit: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RetiredPages:
    """``nvidia-smi -q -d PAGE_RETIREMENT`` (pre-Ampere; Ampere and later remap rows instead)."""

    sbe: int
    dbe: int
    pending: bool


@dataclass(frozen=True)
class RowRemap:
    """``nvidia-smi -q -d ROW_REMAPPER``: remapped rows and the pending/failure flags."""

    corrected: int
    uncorrected: int
    pending: bool
    failed: bool


@dataclass(frozen=True)
class NvLink:
    """``nvidia-smi nvlink -s`` / ``-e`` / ``-c``: one link index NVML answers for (its state
    answers), its DL error counters, and whether it can carry peer traffic.

    ``p2p_supported`` is ``nvmlDeviceGetNvLinkCapability(NVML_NVLINK_CAP_P2P_SUPPORTED)``:
    False when the GPU says the link cannot carry peer-to-peer traffic or does not report the
    capability (then it is not a link the GPU can use); None where the backend did not ask.
    A PCIe card answers for the link indices of its die whether or not a bridge is fitted, so
    an inactive index is not by itself a down link (the SKU file says how many to expect).
    """

    link: int
    active: bool
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_errors: int | None = None
    p2p_supported: bool | None = None
    #: the other end (``nvmlDeviceGetNvLinkRemoteDeviceType``: a name of
    #: :data:`NVLINK_REMOTE_TYPES`, and ``nvmlDeviceGetNvLinkRemotePciInfo_v2``'s bus id);
    #: None where NVML answers Not Supported
    remote_type: str | None = None
    remote_pci_bus_id: str | None = None
    #: NVLink5 field values (NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_ERRORS, _SYMBOL_ERRORS,
    #: _EFFECTIVE_BER, _SYMBOL_BER, scope the link): None where NVML answers Not Supported
    #: (every GPU before Blackwell)
    effective_errors: int | None = None
    symbol_errors: int | None = None
    effective_ber: float | None = None
    symbol_ber: float | None = None

    @property
    def peer(self) -> str | None:
        """What the link goes to, as a person names it (``NVSwitch 0000:05:00.0``), or None
        where NVML says neither what nor where."""
        if self.remote_type is None and self.remote_pci_bus_id is None:
            return None
        what = _REMOTE_NAMES.get(self.remote_type or "", "peer")
        return f"{what} {self.remote_pci_bus_id}" if self.remote_pci_bus_id else what


#: ``nvmlIntNvLinkDeviceType_t`` (NVML_NVLINK_DEVICE_TYPE_GPU 0, IBMNPU 1, SWITCH 2; 0xFF unknown)
NVLINK_REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}
_REMOTE_NAMES = {"gpu": "GPU", "ibmnpu": "IBM NPU", "switch": "NVSwitch"}


def nvlink_ber(encoded: int) -> float:
    """An NVLink5 BER field's value (nvml.h NVML_NVLINK_ERROR_COUNTER_BER_GET: the mantissa in
    bits 8-11, the exponent in bits 0-7) as a number: mantissa x 10^-exponent."""
    mantissa = (encoded >> 8) & 0xF
    exponent = encoded & 0xFF
    return mantissa * 10.0**-exponent


def nvlink_ber_encoded(ber: float) -> int:
    """The inverse of :func:`nvlink_ber` (the simulator's answers): the nearest mantissa 1-15."""
    if ber <= 0:
        return 0
    exponent = 0
    while ber * 10.0**exponent < 1 and exponent < 0xFF:
        exponent += 1
    return (min(15, round(ber * 10.0**exponent)) << 8) | exponent


#: ``nvmlGpuFabricState_t`` as names (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0 ... COMPLETED = 3)
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")
#: NVML_GPU_FABRIC_HEALTH_SUMMARY_* as names (nvmlGpuFabricInfo_v3_t.healthSummary)
FABRIC_HEALTH_SUMMARIES = ("not_supported", "healthy", "unhealthy", "limited_capacity")
#: the two-bit fields of the fabric health mask that say TRUE (1) when something is wrong, with
#: their NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_* (nvml.h; 2 is FALSE, 0 not supported)
FABRIC_HEALTH_FLAGS = (
    ("degraded_bandwidth", 0),
    ("route_recovery", 2),
    ("route_unhealthy", 4),
    ("access_timeout_recovery", 6),
)
#: NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_* (shift 8, width 0xf): 0 not supported,
#: 1 none (correct), then the reason the fabric refused the GPU's configuration
FABRIC_INCORRECT_CONFIGURATION = (
    None,
    None,
    "incorrect_sysguid",
    "incorrect_chassis_serial",
    "no_partition",
    "insufficient_nvlinks",
    "incompatible_gpu_firmware",
    "invalid_location",
    "gpu_state_invalid",
)
#: NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE: 2 is the Global Fabric Manager disconnected
_GFM_SHIFT = 14


@dataclass(frozen=True)
class GpuFabric:
    """``nvidia-smi -q``'s Fabric section (``nvmlDeviceGetGpuFabricInfoV``, version 3 struct;
    the older ``nvmlDeviceGetGpuFabricInfo`` has no health mask or summary): the GPU's
    registration with the NVLink fabric manager.

    ``state`` is a name from :data:`FABRIC_STATES`; ``status`` the probe's ``nvmlReturn_t``
    (0: success; NVML says to read it only once the state is ``completed``);
    ``cluster_uuid`` the NVLink domain's UUID (8-4-4-4-12 hex; all zeros where the GPU is in no
    multi-node domain, as on an HGX board whose NVSwitches are its own); ``clique_id`` the
    fabric clique inside that domain; ``health_mask`` the raw mask (None from the older call),
    ``health_summary`` a name from :data:`FABRIC_HEALTH_SUMMARIES` (None from older calls).
    """

    state: str
    status: int
    cluster_uuid: str
    clique_id: int
    health_mask: int | None = None
    health_summary: str | None = None

    @property
    def in_domain(self) -> bool:
        """The GPU belongs to a multi-node NVLink domain: its ClusterUUID is not zero."""
        return self.cluster_uuid.replace("-", "").strip("0") != ""

    @property
    def health(self) -> list[str]:
        """What the health mask says is wrong, by name ([] when nothing is, or no mask)."""
        mask = self.health_mask or 0
        out = [name for name, shift in FABRIC_HEALTH_FLAGS if (mask >> shift) & 0x3 == 1]
        config = (mask >> 8) & 0xF
        if config < len(FABRIC_INCORRECT_CONFIGURATION) and FABRIC_INCORRECT_CONFIGURATION[config]:
            out.append(f"incorrect_configuration:{FABRIC_INCORRECT_CONFIGURATION[config]}")
        if (mask >> _GFM_SHIFT) & 0x3 == 2:
            out.append("fabric_manager_disconnected")
        return out


def fabric_mask(*flags: str) -> int:
    """A health mask with ``flags`` (names of :data:`FABRIC_HEALTH_FLAGS`) TRUE and the other
    flags FALSE, as a GPU that reports every field answers."""
    mask = 0
    for name, shift in FABRIC_HEALTH_FLAGS:
        mask |= (1 if name in flags else 2) << shift
    unknown = set(flags) - {name for name, _ in FABRIC_HEALTH_FLAGS}
    if unknown:
        raise ValueError(f"unknown fabric health flags {sorted(unknown)}")
    return mask | (1 << 8)  # configuration correct


@dataclass(frozen=True)
class XidEvent:
    """An XID seen as an NVML event (the kernel log carries the same codes as text)."""

    gpu_index: int | None
    code: int
    message: str = ""


@dataclass(frozen=True)
class GpuProcess:
    """``nvidia-smi --query-compute-apps=pid,used_memory``: one compute process on a GPU.

    ``pid`` is as the driver sees it (the host's PID namespace); ``used_memory_bytes`` is None
    where the driver does not report it (NVML_VALUE_NOT_AVAILABLE).
    """

    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class Utilization:
    """``nvidia-smi --query-gpu=utilization.gpu,utilization.memory`` (percent, 0-100).

    ``gpu_pct``: share of the last sample period (1/6 s to 1 s, by product) in which a kernel
    ran, however few SMs it used; ``memory_pct``: share in which device memory was read or
    written. A kernel spinning on a peer reads 100 / ~0.
    """

    gpu_pct: int
    memory_pct: int


#: names of NVML clock-event (throttle) reasons, as returned by ``throttle_reasons()``
THROTTLE_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)

#: units of ``EccCounts.sram_uncorrectable_by_unit``: nvmlEccSramErrorStatus_t's
#: aggregateUncBucketL2, ...Sm, ...Pcie, ...Mcu (microcontroller), ...Other
SRAM_UNITS = ("l2", "sm", "pcie", "mcu", "other")

#: ``nvmlGpuVirtualizationMode_t`` as names, in its order (NVML_GPU_VIRTUALIZATION_MODE_NONE = 0:
#: bare metal; PASSTHROUGH: the whole GPU handed to this VM; VGPU: a vGPU inside a VM;
#: HOST_VGPU / HOST_VSGA: the hypervisor's view of a GPU it shares out)
VIRTUALIZATION_MODES = ("none", "pass_through", "vgpu", "host_vgpu", "host_vsga")

#: ``nvmlGpuRecoveryAction_t`` as names; "none" means the driver asks for nothing
RECOVERY_ACTIONS = (
    "none",
    "gpu_reset",
    "node_reboot",
    "drain_p2p",
    "drain_and_reset",
    "recover_imex_domain",
    "bus_reset",
    "system_reboot",
)


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str | None
    cuda_version: str | None  # the CUDA version the driver supports, e.g. "12.4"
    nvml_version: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


# -- the contract ---------------------------------------------------------------------------------


@runtime_checkable
class GpuDevice(Protocol):
    """One GPU. Every method returns a value or raises a :class:`GpuError` subclass."""

    index: int

    def identity(self) -> Identity: ...
    def temperature_c(self) -> int: ...
    def memory_temperature_c(self) -> int: ...
    def temperature_thresholds(self) -> TemperatureThresholds: ...
    def power(self) -> Power: ...
    def clocks(self) -> Clocks: ...
    def throttle_reasons(self) -> frozenset[str]: ...
    def pcie(self) -> PcieLink: ...
    def ecc(self) -> EccCounts: ...
    def retired_pages(self) -> RetiredPages: ...
    def row_remap(self) -> RowRemap: ...
    def persistence_mode(self) -> bool: ...
    def recovery_action(self) -> str: ...
    def nvlinks(self) -> list[NvLink]: ...
    def compute_processes(self) -> list[GpuProcess]: ...
    def utilization(self) -> Utilization: ...

    def fabric(self) -> GpuFabric:
        """``nvidia-smi -q``'s Fabric section: the GPU's place in the NVLink fabric. Raises
        :class:`NotSupported` where the GPU has no fabric to report (before Hopper, PCIe cards,
        a driver without the call)."""
        ...

    def virtualization_mode(self) -> str:
        """``nvidia-smi -q``: GPU Virtualization Mode, as a name from ``VIRTUALIZATION_MODES``
        (``nvmlDeviceGetVirtualizationMode``). ``"pass_through"``: the GPU is this VM's alone,
        and what sits behind the hypervisor (its NVLinks, the board's other GPUs) is not this
        host's to see. Raises :class:`NotSupported` where NVML does not answer."""
        ...


@runtime_checkable
class GpuBackend(Protocol):
    """The node's GPUs through one source (NVML, simulator). Chosen once in ``node_agent.gpu``."""

    name: str
    simulated: bool
    #: None when GPUs can be queried; otherwise why not (e.g. "no NVIDIA driver: ...")
    unavailable_reason: str | None
    #: True when a driver is present but unusable (hung, mismatched): an error, not a skip
    broken: bool

    def driver(self) -> DriverInfo: ...
    def devices(self) -> list[GpuDevice]: ...
    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]: ...

    def close(self) -> None: ...


@runtime_checkable
class StandInBackend(GpuBackend, Protocol):
    """A scenario's GPUs (the modelled NVML, or a captured node's replay): a backend that also
    prints the stand-in node's kernel log and is told when compute load starts and stops, so
    that it can model what a GPU reports under load. Real backends have neither: the hardware
    writes its own log and reports its own state. Reached through the environment's ports
    (``Ports.load_hint``), never through :class:`GpuBackend`."""

    def kernel_log_lines(self) -> list[str]: ...
    def load_hint(self, indices: list[int], active: bool) -> None: ...
