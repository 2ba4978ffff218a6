"""GPU access: one interface, the backend chosen here and nowhere else.

``open_backend()`` returns NVML when the driver loads, and otherwise a backend with no GPUs that
says why (so checks ``skip`` with that reason). A stand-in node's GPUs are opened with the rest
of that node (:mod:`node_agent.sim.node`), never here.
"""

from __future__ import annotations

from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.gpu.base import (
    DeviceLost,
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuTimeout,
    NoPermission,
    NotSupported,
    StandInBackend,
)

__all__ = [
    "DeviceLost",
    "GpuBackend",
    "GpuDevice",
    "GpuError",
    "GpuTimeout",
    "NoPermission",
    "NotSupported",
    "StandInBackend",
    "open_backend",
]


def open_backend(call_timeout_s: float = 10.0) -> GpuBackend:
    """This host's GPU backend: NVML, or none (with the reason)."""
    from node_agent.gpu.nvml import NvmlUnavailable, open_nvml

    try:
        return open_nvml(call_timeout_s=call_timeout_s)
    except NvmlUnavailable as err:
        return AbsentGpuBackend(str(err), broken=err.broken)
