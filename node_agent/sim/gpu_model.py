"""A simulated node built from a scenario: healthy GPUs of its SKU, with faults injected.

Only NVML-level state lives here; kernel-log lines (injected XIDs and raw ``kernel_log``
lines) come from ``kernel_log_lines()``, the PCI bus from :mod:`node_agent.sim.tools`, and
compute faults (``slow``, ``sdc``) are applied by the compute layer.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from node_agent.gpu.base import (
    SRAM_UNITS,
    Clocks,
    DeviceLost,
    DriverInfo,
    EccCounts,
    GpuDevice,
    GpuFabric,
    GpuProcess,
    GpuTimeout,
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
    fabric_mask,
    nvlink_ber,
    nvlink_ber_encoded,
)

if TYPE_CHECKING:  # annotations only
    from node_agent.hardware.sku import Sku
    from node_agent.sim.scenario import Fault, Scenario

# PCI bus numbers of the eight GPUs on an HGX baseboard, as NVML prints them.
_HGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
_IDLE_TEMP_C = 38
_IDLE_POWER_FRACTION = 0.12
# Under a full GEMM load (``load_hint``) a healthy simulated GPU behaves like an air- or
# liquid-cooled HGX board in a burn: it warms towards ~65 °C with a short time constant, draws
# ~90 % of its power limit held there by the SW power cap, and keeps its boost clock. A ``slow``
# GPU draws proportionally less power (it does less work); ``temperature`` and ``throttle``
# faults still say what they say, and a HW throttle halves the SM clock (NVML: HW slowdown
# "reduces the clocks by a factor of 2 or more").
_LOAD_TEMP_C = 65
_LOAD_TEMP_TAU_S = 1.0
_LOAD_MEM_TEMP_C = 58
_LOAD_POWER_FRACTION = 0.9
_SM_MAX_MHZ = 1980
# Utilization (percent of the sample period a kernel ran / memory was busy): a GEMM burn keeps
# a kernel resident all the time (~98 %, the gaps are launches) and streams its tiles from HBM
# at about 60 % of the period; a ``slow`` GPU moves proportionally less. A ``spin`` GPU runs a
# kernel that polls a flag for a peer that never comes (a hung NCCL collective): 100 % busy,
# ~0 % memory, and power just above idle, as only the few SMs of the collective's channels spin.
# These are the model's figures, not measurements.
_LOAD_GPU_PCT = 98
_LOAD_MEMORY_PCT = 60
_SPIN_POWER_FRACTION = 0.15
_MIB = 1024 * 1024
_HW_THROTTLE = frozenset({"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


def nvlink_domain(scenario: Scenario) -> tuple[str, int]:
    """The ClusterUUID and CliqueID of the scenario's multi-node NVLink domain: its
    ``nvlink_domain``, else a UUID from the hostname and clique 1."""
    domain = scenario.nvlink_domain
    cluster = domain.get("cluster_uuid") or str(
        uuid.uuid5(uuid.NAMESPACE_DNS, f"nvlink-domain.{scenario.hostname}")
    )
    return cluster, int(domain.get("clique_id", 1))


def pci_bus_id(index: int) -> str:
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else f"{0xE0 + index:02x}"
    return f"00000000:{bus.upper()}:00.0"


def kernel_bus_id(index: int) -> str:
    """GPU ``index``'s bus id as the driver prints it in the kernel log: ``0000:9a:00``."""
    return pci_bus_id(index)[4:-2].lower()


def xid_kernel_line(index: int, code: int) -> str:
    """The NVRM line the driver prints for an XID (format of driver 535+)."""
    return (
        f"NVRM: Xid (PCI:{kernel_bus_id(index)}): {code}, pid='<unknown>', name=<unknown>, "
        f"simulated Xid {code}"
    )


#: what NVML says when it cannot load, as the NVML backend words it (node_agent.gpu.nvml)
DRIVER_DOWN_REASONS = {
    "not_loaded": (
        "no NVIDIA driver: the nvidia kernel module is not loaded (check `lsmod | "
        "grep nvidia` and dmesg, or run with --simulate)",
        True,
    ),
    "not_installed": (
        "no NVIDIA driver: libnvidia-ml.so.1 not found (install the NVIDIA "
        "driver, or run with --simulate)",
        False,
    ),
}


class _LoadState:
    """Which simulated GPUs carry a compute load, and since when (monotonic seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}

    def set(self, indices: list[int], active: bool) -> None:
        now = time.monotonic()
        with self._lock:
            for index in indices:
                if active:
                    self._since.setdefault(index, now)
                else:
                    self._since.pop(index, None)

    def seconds(self, index: int) -> float | None:
        """Seconds under load, or None when idle."""
        with self._lock:
            since = self._since.get(index)
        return None if since is None else time.monotonic() - since


class _CounterSeries:
    """The scenario's ``counter_series`` faults: each (GPU, counter, link) answers its values one
    read at a time, the last value staying (the caller's clock decides what a read's time is)."""

    def __init__(self, scenario: Scenario) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[int, str, int], tuple[int, ...]] = {}
        self._reads: dict[tuple[int, str, int], int] = {}
        for f in scenario.faults:
            if f.kind == "counter_series" and f.gpu is not None:
                key = (f.gpu, f.params["counter"], int(f.params.get("link", 0)))
                self._values[key] = tuple(int(v) for v in f.params["values"])

    def read(self, gpu: int, counter: str, link: int = 0) -> int | None:
        """The counter's next value, or None when the scenario gives it no series."""
        key = (gpu, counter, link)
        with self._lock:
            values = self._values.get(key)
            if values is None:
                return None
            i = self._reads.get(key, 0)
            self._reads[key] = i + 1
        return values[min(i, len(values) - 1)]


class SimGpuDevice:
    """One simulated GPU; readings are the SKU's healthy values unless a fault says otherwise."""

    def __init__(
        self,
        index: int,
        scenario: Scenario,
        sku: Sku,
        wedged: threading.Event,
        call_timeout_s: float,
        load: _LoadState | None = None,
        series: _CounterSeries | None = None,
    ) -> None:
        self.index = index
        self._scenario = scenario
        self._sku = sku
        self._wedged = wedged
        self._call_timeout_s = call_timeout_s
        self._load = load or _LoadState()
        self._series = series or _CounterSeries(scenario)

    def _counter(self, counter: str, otherwise: int, link: int = 0) -> int:
        """A ``counter_series`` value when the scenario gives one, else ``otherwise``."""
        value = self._series.read(self.index, counter, link)
        return otherwise if value is None else value

    def _hw_throttled(self) -> bool:
        fault = self._fault("throttle")
        return bool(fault and _HW_THROTTLE & set(fault.params["reasons"]))

    def _fault(self, kind: str) -> Fault | None:
        faults = self._scenario.faults_on(self.index, kind)
        return faults[-1] if faults else None

    def _answer(self) -> None:
        if self._scenario.has(self.index, "gpu_lost"):
            raise DeviceLost(f"GPU {self.index}: NVML reports GPU is lost (simulated)")
        # As the NVML backend does: a call that hangs is abandoned after the call timeout,
        # and from then on every call fails fast because the driver is wedged.
        if self._wedged.is_set():
            raise GpuTimeout(
                f"GPU {self.index}: an earlier NVML call hung; the driver may be hung (simulated)"
            )
        if self._scenario.has(self.index, "driver_hang"):
            time.sleep(self._call_timeout_s)
            self._wedged.set()
            raise GpuTimeout(
                f"GPU {self.index}: NVML call did not return within "
                f"{self._call_timeout_s:g} s; the driver may be hung (simulated)"
            )

    def identity(self) -> Identity:
        self._answer()
        name = self._sku.match[0]
        low, high = self._sku.memory_range
        memory = None if low is None else int(low * 1.02)  # inside the SKU's range, as NVML's
        if memory is not None and high is not None:
            memory = min(memory, high)
        fault = self._fault("memory_total")
        if fault:
            memory = int(fault.params["mib"])
        return Identity(
            index=self.index,
            uuid="GPU-"
            + str(uuid.uuid5(uuid.NAMESPACE_OID, f"{self._scenario.hostname}/{self.index}")),
            name=name,
            pci_bus_id=pci_bus_id(self.index),
            serial=f"165082300{self.index:04d}",
            vbios="96.00.99.00.01",
            memory_total_mib=memory,
        )

    def temperature_c(self) -> int:
        self._answer()
        fault = self._fault("temperature")
        if fault:
            return int(fault.params["celsius"])
        loaded = self._load.seconds(self.index)
        if loaded is None:
            return _IDLE_TEMP_C
        warmed = 1.0 - math.exp(-loaded / _LOAD_TEMP_TAU_S)
        return round(_IDLE_TEMP_C + (_LOAD_TEMP_C - _IDLE_TEMP_C) * warmed)

    def memory_temperature_c(self) -> int:
        self._answer()
        return _LOAD_MEM_TEMP_C if self._load.seconds(self.index) is not None else _IDLE_TEMP_C + 6

    def temperature_thresholds(self) -> TemperatureThresholds:
        self._answer()
        thermal = self._sku.section("thermal")
        return TemperatureThresholds(
            shutdown_c=thermal.get("shutdown_c"),
            slowdown_c=thermal.get("slowdown_c"),
            gpu_max_operating_c=(thermal.get("slowdown_c") or 90) - 3,
            memory_max_operating_c=95,
        )

    def power(self) -> Power:
        self._answer()
        tdp = float(self._sku.section("power").get("tdp_w", 400))
        fraction = _IDLE_POWER_FRACTION
        if self._scenario.has(self.index, "spin"):
            fraction = _SPIN_POWER_FRACTION
        elif self._load.seconds(self.index) is not None:
            slow = self._fault("slow")
            fraction = _LOAD_POWER_FRACTION * (float(slow.params["factor"]) if slow else 1.0)
        return Power(usage_w=round(tdp * fraction, 1), enforced_limit_w=tdp, default_limit_w=tdp)

    def clocks(self) -> Clocks:
        self._answer()
        loaded = self._load.seconds(self.index) is not None
        sm = _SM_MAX_MHZ // 2 if loaded and self._hw_throttled() else _SM_MAX_MHZ
        return Clocks(sm_mhz=sm, sm_max_mhz=_SM_MAX_MHZ, memory_mhz=2619)

    def throttle_reasons(self) -> frozenset[str]:
        self._answer()
        fault = self._fault("throttle")
        reasons = frozenset(fault.params["reasons"]) if fault else frozenset()
        if self._scenario.has(self.index, "spin"):
            return reasons  # a kernel runs, so not idle; too little power for the power cap
        if self._load.seconds(self.index) is not None:
            return reasons | {"sw_power_cap"}
        return reasons or frozenset({"gpu_idle"})

    def pcie(self) -> PcieLink:
        self._answer()
        pcie = self._sku.section("pcie")
        gen, width = int(pcie.get("gen", 4)), int(pcie.get("width", 16))
        fault = self._fault("pcie_width")
        return PcieLink(
            gen_current=gen,
            gen_max=gen,
            width_current=int(fault.params["lanes"]) if fault else width,
            width_max=width,
            replay_count=self._counter("pcie_replay", 0),
        )

    def ecc(self) -> EccCounts:
        self._answer()
        dbe = sum(
            f.params.get("count", 1)
            for f in self._scenario.faults_on(self.index, "ecc_dbe_volatile")
        )
        sbe = self._counter(
            "ecc_sbe_volatile",
            sum(
                f.params.get("count", 1)
                for f in self._scenario.faults_on(self.index, "ecc_sbe_volatile")
            ),
        )
        # The SRAM status (nvmlDeviceGetSramEccErrorStatus) is reported always, as an Ampere or
        # later GPU does to a root agent: 0 errors and no threshold flag unless a fault says so.
        flagged = self._scenario.has(self.index, "sram_threshold_exceeded")
        by_unit = dict.fromkeys(SRAM_UNITS, 0)
        for fault in self._scenario.faults_on(self.index, "ecc_sram_uncorrectable"):
            by_unit[fault.params.get("unit", "l2")] += int(fault.params.get("count", 1))
        sram = self._counter("ecc_sram_uncorrectable", sum(by_unit.values()))
        if sram != sum(by_unit.values()):  # a series: its errors are the L2's
            by_unit = {**dict.fromkeys(SRAM_UNITS, 0), "l2": sram}
        return EccCounts(
            enabled=True,
            volatile_sbe=sbe,
            volatile_dbe=dbe,
            aggregate_sbe=sbe,
            aggregate_dbe=dbe + sram,
            aggregate_dbe_sram=sram,
            aggregate_dbe_dram=dbe,
            sram_uncorrectable_aggregate=sram,
            sram_threshold_exceeded=flagged,
            sram_uncorrectable_by_unit=by_unit,
        )

    def retired_pages(self) -> RetiredPages:
        self._answer()
        # Ampere and later replace page retirement with row remapping (NVML: not supported).
        raise NotSupported(
            f"GPU {self.index}: page retirement is not supported on "
            f"{self._sku.display_name} (row remapping replaces it)"
        )

    def row_remap(self) -> RowRemap:
        self._answer()
        pending = self._scenario.has(self.index, "row_remap_pending")
        failed = self._scenario.has(self.index, "row_remap_failure")
        return RowRemap(
            corrected=self._counter("remapped_rows_correctable", 0),
            uncorrected=self._counter("remapped_rows_uncorrectable", int(pending or failed)),
            pending=pending,
            failed=failed,
        )

    def persistence_mode(self) -> bool:
        self._answer()
        return not self._scenario.has(self.index, "persistence_off")

    def recovery_action(self) -> str:
        self._answer()
        fault = self._fault("recovery_action")
        return fault.params["action"] if fault else "none"

    def nvlinks(self) -> list[NvLink]:
        """The SKU's ``nvlink.indices`` link indices (default ``links``); the first ``links``
        active unless ``nvlink_down``, the rest inactive (a PCIe card without a bridge: the
        case that made PCIe cards read as NVLink failures). Every index reports P2P
        capability (NVML_NVLINK_CAP_P2P_SUPPORTED); whether a real PCIe card without a bridge
        reports it on its idle indices is not modelled."""
        self._answer()
        down = {f.params["link"] for f in self._scenario.faults_on(self.index, "nvlink_down")}
        nvlink = self._sku.section("nvlink")
        wired = int(nvlink.get("links", 0))
        count = int(nvlink.get("indices", wired))
        return [
            NvLink(
                link=i,
                active=i < wired and i not in down,
                replay_errors=self._counter("nvlink_replay", 0, i),
                recovery_errors=self._counter("nvlink_recovery", 0, i),
                crc_errors=self._counter("nvlink_crc", 0, i),
                p2p_supported=True,
                **(self._nvlink_far_end(i, wired) if i < wired else {}),
            )
            for i in range(count)
        ]

    def _nvlink_far_end(self, link: int, wired: int) -> dict[str, Any]:
        """A wired link's other end and, on NVLink 5, its error counts and BERs (the model's
        figures: a BER of one error in 10^15 bits per error counted).

        Where a link goes: on a multi-node tray (GB200/GB300) to one NVSwitch chip of the
        rack's 9 switch trays (2 chips each; the simulator addresses chip c of tray t as
        ``0000000t:0c:00.0``, made up: the switch trays are not on the tray's PCI bus); on a
        board of 12 or more links (HGX) to its NVSwitches (Blackwell's 2, Hopper's 4, Ampere's
        6: the links split evenly, in order); with fewer, to the GPU it is bridged to (its
        neighbour). NVLink 5 (a SKU that declares its ``nvlink.fabric``) answers the
        effective and symbol error counters (``counter_series`` ``nvlink_effective``,
        ``nvlink_symbol``); earlier NVLink answers Not Supported."""
        fabric = self._sku.section("nvlink").get("fabric")
        if fabric == "multi_node":
            tray, chip = divmod(link, 2)
            peer = {"remote_type": "switch", "remote_pci_bus_id": f"{tray + 1:08X}:{chip:02X}:00.0"}
        elif wired >= 12:
            switches = 2 if fabric else 4 if wired >= 18 else 6
            switch = link * switches // wired
            peer = {"remote_type": "switch", "remote_pci_bus_id": f"00000000:{5 + switch:02X}:00.0"}
        else:
            peer = {"remote_type": "gpu", "remote_pci_bus_id": pci_bus_id(self.index ^ 1)}
        if not fabric:
            return peer
        effective = self._counter("nvlink_effective", 0, link)
        symbol = self._counter("nvlink_symbol", 0, link)
        return {
            **peer,
            "effective_errors": effective,
            "symbol_errors": symbol,
            # as NVML can say it: a mantissa of 0-15 and a power of ten
            "effective_ber": nvlink_ber(nvlink_ber_encoded(effective * 1e-15)),
            "symbol_ber": nvlink_ber(nvlink_ber_encoded(symbol * 1e-15)),
        }

    def fabric(self) -> GpuFabric:
        """What the SKU's ``nvlink.fabric`` says the hardware reports: ``multi_node`` (a
        GB200/GB300 tray: the scenario's ``nvlink_domain``), ``nvswitch`` (an HGX board: a
        zero ClusterUUID); anything else Not Supported. Faults: ``fabric_degraded``,
        ``fabric_incomplete``, ``wrong_clique``."""
        self._answer()
        kind = self._sku.section("nvlink").get("fabric")
        if kind not in ("multi_node", "nvswitch"):
            raise NotSupported(
                f"nvmlDeviceGetGpuFabricInfoV on GPU {self.index}: Not Supported (simulated: "
                f"SKU {self._sku.id} has no NVLink fabric)"
            )
        cluster, clique = _ZERO_UUID, 0
        if kind == "multi_node":
            cluster, clique = nvlink_domain(self._scenario)
        wrong = self._fault("wrong_clique")
        if wrong:
            clique = int(wrong.params.get("clique", clique + 1))
        incomplete = self._fault("fabric_incomplete")
        state = incomplete.params.get("state", "in_progress") if incomplete else "completed"
        if state != "completed":
            cluster, clique = _ZERO_UUID, 0  # assigned when the registration completes
        degraded = self._fault("fabric_degraded")
        flags = list(degraded.params.get("mask", ["degraded_bandwidth"])) if degraded else []
        summary = "healthy"
        if flags:
            summary = "limited_capacity" if flags == ["degraded_bandwidth"] else "unhealthy"
        return GpuFabric(
            state=state,
            status=int(incomplete.params.get("status", 0)) if incomplete else 0,
            cluster_uuid=cluster,
            clique_id=clique,
            health_mask=fabric_mask(*flags),
            health_summary=summary,
        )

    def compute_processes(self) -> list[GpuProcess]:
        """The scenario's ``compute_processes`` on this GPU (none unless listed there)."""
        self._answer()
        return [
            GpuProcess(
                pid=p.pid,
                used_memory_bytes=None if p.used_memory_mib is None else p.used_memory_mib * _MIB,
            )
            for p in self._scenario.processes_on(self.index)
        ]

    def utilization(self) -> Utilization:
        """Idle 0/0; under load ~98/60 (memory scaled by ``slow``); ``spin`` 100/0 (%)."""
        self._answer()
        if self._scenario.has(self.index, "spin"):
            return Utilization(gpu_pct=100, memory_pct=0)
        if self._load.seconds(self.index) is None:
            return Utilization(gpu_pct=0, memory_pct=0)
        slow = self._fault("slow")
        factor = float(slow.params["factor"]) if slow else 1.0
        return Utilization(gpu_pct=_LOAD_GPU_PCT, memory_pct=round(_LOAD_MEMORY_PCT * factor))

    def virtualization_mode(self) -> str:
        """The scenario's ``virtualization`` (default ``none``: bare metal)."""
        self._answer()
        return self._scenario.virtualization


class SimGpuBackend:
    """The simulated node's GPUs. A ``missing_gpu`` or ``pci_only`` GPU is absent from
    enumeration, as on real hardware when a GPU has fallen off the bus before the driver
    loaded or the driver failed to initialise it. With ``driver: not_loaded`` or
    ``not_installed`` NVML does not load at all: no devices, and the reason the NVML backend
    would give (the GPUs stay on the simulated PCI bus)."""

    name = "sim"
    simulated = True

    def __init__(self, scenario: Scenario, sku: Sku, call_timeout_s: float = 0.5) -> None:
        self.scenario = scenario
        self.sku = sku
        self.unavailable_reason: str | None = None
        self.broken = False
        if scenario.driver_down:
            self.unavailable_reason, self.broken = DRIVER_DOWN_REASONS[scenario.driver_down]
        self._wedged = threading.Event()
        self._xids_delivered = False
        self._closed = threading.Event()
        self._load = _LoadState()
        series = _CounterSeries(scenario)
        self._devices: list[GpuDevice] = (
            []
            if scenario.driver_down
            else [
                SimGpuDevice(i, scenario, sku, self._wedged, call_timeout_s, self._load, series)
                for i in range(scenario.gpus)
                if not scenario.has(i, "missing_gpu") and not scenario.has(i, "pci_only")
            ]
        )

    def driver(self) -> DriverInfo:
        if self.scenario.driver_down:
            return DriverInfo(driver_version=None, cuda_version=None)
        return DriverInfo(
            driver_version=self.scenario.driver,
            cuda_version=self.scenario.cuda,
            nvml_version="12." + self.scenario.driver,
        )

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        if self._xids_delivered or self.scenario.driver_down:
            # like nvmlEventSetWait: nothing new, so wait out the timeout
            self._closed.wait(timeout_s)
            return []
        self._xids_delivered = True
        return [
            XidEvent(gpu_index=f.gpu, code=f.params["code"], message="simulated")
            for f in self.scenario.faults
            if f.kind == "xid"
        ]

    def load_hint(self, indices: list[int], active: bool) -> None:
        """Start or stop modelling compute load on these GPUs (see ``_LOAD_*`` above)."""
        self._load.set(indices, active)

    def kernel_log_lines(self) -> list[str]:
        """Kernel-log lines printed since boot: the scenario's ``kernel_log`` records first,
        then in scenario order an NVRM line per ``xid`` fault and each ``kernel_log`` fault's
        line with ``{bus}`` replaced by its GPU's bus id."""
        lines = list(self.scenario.kernel_log)
        for fault in self.scenario.faults:
            if fault.kind == "xid" and fault.gpu is not None:  # the schema requires its gpu
                lines.append(xid_kernel_line(fault.gpu, fault.params["code"]))
            elif fault.kind == "kernel_log":
                line = fault.params["line"]
                if fault.gpu is not None:
                    line = line.replace("{bus}", kernel_bus_id(fault.gpu))
                lines.append(line)
        return lines

    def close(self) -> None:
        self._closed.set()
