"""GPU access: one interface, the backend chosen here and nowhere else.

``open_backend()`` returns a scenario's stand-in when a scenario is given (``open_stand_in``:
the modelled NVML, or a captured node's recorded NVML replayed), NVML when the driver loads, and otherwise a
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
    StandInBackend,
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
    "StandInBackend",
    "open_backend",
    "open_stand_in",
]


def open_backend(
    scenario: Scenario | None = None, scenario_sku: Sku | None = None, call_timeout_s: float = 10.0
) -> GpuBackend:
    """Pick the node's GPU backend: a scenario's stand-in (:func:`open_stand_in`), NVML, or
    none (with the reason)."""
    if scenario is not None:
        return open_stand_in(scenario, scenario_sku, call_timeout_s)
    from node_agent.gpu.nvml import NvmlUnavailable, open_nvml

    try:
        return open_nvml(call_timeout_s=call_timeout_s)
    except NvmlUnavailable as err:
        return AbsentGpuBackend(str(err), broken=err.broken)


def open_stand_in(
    scenario: Scenario, scenario_sku: Sku | None, call_timeout_s: float = 10.0
) -> StandInBackend:
    """A scenario's GPUs. A captured scenario (``node-agent capture``, docs/capture.md)
    replays its recorded NVML through the real NVML backend (:mod:`node_agent.gpu.replay`);
    any other scenario is the model of its SKU (:mod:`node_agent.gpu.sim`)."""
    if scenario.nvml is not None:
        from node_agent.gpu.replay import open_replay

        return open_replay(
            scenario.nvml, scenario.kernel_log, scenario.source, call_timeout_s=call_timeout_s
        )
    from node_agent.gpu.sim import SimGpuBackend

    if scenario_sku is None:
        raise ValueError("a scenario's node needs its SKU")
    return SimGpuBackend(scenario, scenario_sku)
