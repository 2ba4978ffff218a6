"""The backend used when no GPU can be queried: it has no devices and says why."""

from __future__ import annotations

from .base import DriverInfo, GpuDevice, XidEvent


class AbsentGpuBackend:
    """No NVIDIA driver (or no bindings): every GPU check skips with ``unavailable_reason``."""

    name = "none"
    simulated = False

    def __init__(self, reason: str) -> None:
        self.unavailable_reason: str | None = reason

    def driver(self) -> DriverInfo:
        return DriverInfo(driver_version=None, cuda_version=None)

    def devices(self) -> list[GpuDevice]:
        return []

    def wait_xid_events(self, timeout_s: float) -> list[XidEvent]:
        return []

    def close(self) -> None:
        pass
