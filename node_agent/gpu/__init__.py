"""GPU access: one interface, the backend chosen here and nowhere else.

``open_backend()`` returns the simulator when a scenario is given (a captured node's recorded
NVML, replayed, when the scenario is a capture), NVML when the driver loads, and otherwise a
backend with no GPUs that says why (so checks ``skip`` with that reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.gpu.base import (
    DeviceLost,
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuTimeout,
    NoPermission,
    NotSupported,
)

if TYPE_CHECKING:
    from node_agent.hardware.sku import Sku
    from node_agent.sim.scenario import Scenario

__all__ = [
    "DeviceLost",
    "GpuBackend",
    "GpuDevice",
    "GpuError",
    "GpuTimeout",
    "NoPermission",
    "NotSupported",
    "open_backend",
]


def open_backend(
    scenario: Scenario | None = None, scenario_sku: Sku | None = None, call_timeout_s: float = 10.0
) -> GpuBackend:
    """Pick the node's GPU backend: simulator, NVML, or none (with the reason).

    A captured scenario (``node-agent capture``, docs/capture.md) replays its recorded NVML
    through the real NVML backend (:mod:`node_agent.gpu.replay`); any other scenario is the
    simulator's model of its SKU."""
    if scenario is not None and scenario.nvml is not None:
        from node_agent.gpu.replay import open_replay

        return open_replay(
            scenario.nvml, scenario.kernel_log, scenario.source, call_timeout_s=call_timeout_s
        )
    if scenario is not None:
        from node_agent.gpu.sim import SimGpuBackend

        if scenario_sku is None:
            raise ValueError("a simulated node needs its SKU")
        return SimGpuBackend(scenario, scenario_sku)
    from node_agent.gpu.nvml import NvmlUnavailable, open_nvml

    try:
        return open_nvml(call_timeout_s=call_timeout_s)
    except NvmlUnavailable as err:
        return AbsentGpuBackend(str(err), broken=err.broken)
