"""A simulated node built from a scenario: healthy GPUs of its SKU, with faults injected.

Only NVML-level state lives here; kernel-log lines for injected XIDs come from
``kernel_log_lines()``, and compute faults (``slow``, ``sdc``) are applied by the compute layer.
"""

from __future__ import annotations

import threading
import time
import uuid

from ..scenario import Scenario
from ..sku import Sku
from .base import (
    Clocks,
    DeviceLost,
    DriverInfo,
    EccCounts,
    GpuDevice,
    GpuTimeout,
    Identity,
    NotSupported,
    NvLink,
    PcieLink,
    Power,
    RetiredPages,
    RowRemap,
    TemperatureThresholds,
    XidEvent,
)

# PCI bus numbers of the eight GPUs on an HGX baseboard, as NVML prints them.
_HGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
_IDLE_TEMP_C = 38
_IDLE_POWER_FRACTION = 0.12


def pci_bus_id(index: int) -> str:
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else f"{0xe0 + index:02x}"
    return f"00000000:{bus.upper()}:00.0"


def xid_kernel_line(index: int, code: int) -> str:
    """The NVRM line the driver prints for an XID (format of driver 535+)."""
    bus = pci_bus_id(index)[4:-2].lower()  # "0000:9a:00"
    return f"NVRM: Xid (PCI:{bus}): {code}, pid='<unknown>', name=<unknown>, simulated Xid {code}"


class SimGpuDevice:
    """One simulated GPU; readings are the SKU's healthy values unless a fault says otherwise."""

    def __init__(self, index: int, scenario: Scenario, sku: Sku, wedged: threading.Event,
                 call_timeout_s: float) -> None:
        self.index = index
        self._scenario = scenario
        self._sku = sku
        self._wedged = wedged
        self._call_timeout_s = call_timeout_s

    def _fault(self, kind: str):
        faults = self._scenario.faults_on(self.index, kind)
        return faults[-1] if faults else None

    def _answer(self) -> None:
        if self._scenario.has(self.index, "gpu_lost"):
            raise DeviceLost(f"GPU {self.index}: NVML reports GPU is lost (simulated)")
        # As the NVML backend does: a call that hangs is abandoned after the call timeout,
        # and from then on every call fails fast because the driver is wedged.
        if self._wedged.is_set():
            raise GpuTimeout(f"GPU {self.index}: an earlier NVML call hung; the driver may be "
                             "hung (simulated)")
        if self._scenario.has(self.index, "driver_hang"):
            time.sleep(self._call_timeout_s)
            self._wedged.set()
            raise GpuTimeout(f"GPU {self.index}: NVML call did not return within "
                             f"{self._call_timeout_s:g} s; the driver may be hung (simulated)")

    def identity(self) -> Identity:
        self._answer()
        name = self._sku.match[0]
        mem = self._sku.data.get("memory_total_mib_min")
        return Identity(
            index=self.index,
            uuid="GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"{self._scenario.hostname}/{self.index}")),
            name=name, pci_bus_id=pci_bus_id(self.index), serial=f"165082300{self.index:04d}",
            vbios="96.00.99.00.01", memory_total_mib=int(mem * 1.02) if mem else None)

    def temperature_c(self) -> int:
        self._answer()
        fault = self._fault("temperature")
        return int(fault.params["celsius"]) if fault else _IDLE_TEMP_C

    def memory_temperature_c(self) -> int:
        self._answer()
        return _IDLE_TEMP_C + 6

    def temperature_thresholds(self) -> TemperatureThresholds:
        self._answer()
        thermal = self._sku.section("thermal")
        return TemperatureThresholds(shutdown_c=thermal.get("shutdown_c"),
                                     slowdown_c=thermal.get("slowdown_c"),
                                     gpu_max_operating_c=(thermal.get("slowdown_c") or 90) - 3,
                                     memory_max_operating_c=95)

    def power(self) -> Power:
        self._answer()
        tdp = float(self._sku.section("power").get("tdp_w", 400))
        return Power(usage_w=round(tdp * _IDLE_POWER_FRACTION, 1), enforced_limit_w=tdp,
                     default_limit_w=tdp)

    def clocks(self) -> Clocks:
        self._answer()
        return Clocks(sm_mhz=1980, sm_max_mhz=1980, memory_mhz=2619)

    def throttle_reasons(self) -> frozenset[str]:
        self._answer()
        fault = self._fault("throttle")
        return frozenset(fault.params["reasons"]) if fault else frozenset({"gpu_idle"})

    def pcie(self) -> PcieLink:
        self._answer()
        pcie = self._sku.section("pcie")
        gen, width = int(pcie.get("gen", 4)), int(pcie.get("width", 16))
        fault = self._fault("pcie_width")
        return PcieLink(gen_current=gen, gen_max=gen,
                        width_current=int(fault.params["lanes"]) if fault else width,
                        width_max=width, replay_count=0)

    def ecc(self) -> EccCounts:
        self._answer()
        dbe = sum(f.params.get("count", 1) for f in self._scenario.faults_on(self.index, "ecc_dbe_volatile"))
        sbe = sum(f.params.get("count", 1) for f in self._scenario.faults_on(self.index, "ecc_sbe_volatile"))
        return EccCounts(enabled=True, volatile_sbe=sbe, volatile_dbe=dbe, aggregate_sbe=sbe,
                         aggregate_dbe=dbe, aggregate_dbe_sram=0, aggregate_dbe_dram=dbe)

    def retired_pages(self) -> RetiredPages:
        self._answer()
        # Ampere and later replace page retirement with row remapping (NVML: not supported).
        raise NotSupported(f"GPU {self.index}: page retirement is not supported on "
                           f"{self._sku.display_name} (row remapping replaces it)")

    def row_remap(self) -> RowRemap:
        self._answer()
        pending = self._scenario.has(self.index, "row_remap_pending")
        failed = self._scenario.has(self.index, "row_remap_failure")
        return RowRemap(corrected=0, uncorrected=int(pending or failed), pending=pending,
                        failed=failed)

    def persistence_mode(self) -> bool:
        self._answer()
        return not self._scenario.has(self.index, "persistence_off")

    def recovery_action(self) -> str:
        self._answer()
        fault = self._fault("recovery_action")
        return fault.params["action"] if fault else "none"

    def nvlinks(self) -> list[NvLink]:
        self._answer()
        down = {f.params["link"] for f in self._scenario.faults_on(self.index, "nvlink_down")}
        count = int(self._sku.section("nvlink").get("links", 0))
        return [NvLink(link=i, active=i not in down, replay_errors=0, recovery_errors=0,
                       crc_errors=0) for i in range(count)]


class SimGpuBackend:
    """The simulated node's GPUs. A ``missing_gpu`` is absent from enumeration, as on real
    hardware when a GPU has fallen off the bus before the driver loaded."""

    name = "sim"
    simulated = True
    unavailable_reason: str | None = None
    broken = False

    def __init__(self, scenario: Scenario, sku: Sku, call_timeout_s: float = 0.5) -> None:
        self.scenario = scenario
        self.sku = sku
        self._wedged = threading.Event()
        self._xids_delivered = False
        self._devices: list[GpuDevice] = [
            SimGpuDevice(i, scenario, sku, self._wedged, call_timeout_s)
            for i in range(scenario.gpus) if not scenario.has(i, "missing_gpu")
        ]

    def driver(self) -> DriverInfo:
        return DriverInfo(driver_version=self.scenario.driver, cuda_version=self.scenario.cuda,
                          nvml_version="12." + self.scenario.driver)

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        if self._xids_delivered:
            return []
        self._xids_delivered = True
        return [XidEvent(gpu_index=f.gpu, code=f.params["code"], message="simulated")
                for f in self.scenario.faults if f.kind == "xid"]

    def kernel_log_lines(self) -> list[str]:
        """Kernel-log lines the simulated driver printed since boot."""
        return [xid_kernel_line(f.gpu, f.params["code"]) for f in self.scenario.faults
                if f.kind == "xid"]

    def close(self) -> None:
        pass
