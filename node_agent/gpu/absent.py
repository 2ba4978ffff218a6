"""The backend used when no GPU can be queried: it has no devices and says why."""

from __future__ import annotations

from node_agent.gpu.base import DriverInfo, GpuDevice, XidEvent


class AbsentGpuBackend:
    """No usable GPU access. ``broken=False``: the host has no NVIDIA driver, GPU checks skip
    with ``unavailable_reason``. ``broken=True``: a driver is there but NVML fails (hung,
    version mismatch); GPU checks report an error, never a pass or a skip. Either way, NVIDIA
    GPUs on the PCI bus (:mod:`node_agent.gpu.pci`) make it an error: the checks compare the
    bus with this backend (``CheckContext.gpus_unavailable``), since the bus does not depend
    on NVML loading."""

    name = "none"
    simulated = False

    def __init__(self, reason: str, broken: bool = False) -> None:
        self.unavailable_reason: str | None = reason
        self.broken = broken

    def driver(self) -> DriverInfo:
        return DriverInfo(driver_version=None, cuda_version=None)

    def devices(self) -> list[GpuDevice]:
        return []

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        return []

    def close(self) -> None:
        pass
