"""The node one invocation works against: its GPUs, kernel log and ports, opened together.

:func:`node_agent.environment.open_environment` opens it once, either this host's or a stand-in
(``--simulate``: :mod:`node_agent.sim.node`). Everything below the environment (checks, GPU
backends, compute, remediation, the stop check's phases, the service) reads what the node
hands it and never asks which kind it is: a stand-in differs only in the values of its parts
(a modelled figure where a real GPU's is measured, a written tree where the host has ``/sys``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from node_agent.checking.child import HOST, NodeSpec
from node_agent.checking.ports import Ports
from node_agent.gpu.base import GpuBackend
from node_agent.hardware.sku import Sku
from node_agent.kernel_log import KernelLog


class GpuReset(Protocol):
    """Resets one GPU: a detail line, or an exception saying why it did not happen (the
    remediation's ``GpuResetter``)."""

    def reset(self, index: int) -> str: ...


def _host_ports(sku: Sku | None) -> Ports:
    """This host's ports: its own trees and tools, compute measured on its GPUs."""
    return Ports()


@dataclass(frozen=True)
class Node:
    """The node's parts. ``ports_for`` builds its ports once its SKU is matched (the stand-in's
    modelled figures follow the SKU); the rest is what the node declares about itself."""

    gpu: GpuBackend
    kernel_log: KernelLog
    ports_for: Callable[[Sku | None], Ports] = _host_ports
    #: the node's own host name (a stand-in's); None: this host's (``node.name``, else hostname)
    hostname: str | None = None
    #: which SKU the node is matched to; None: the config's ``node.sku``
    sku_setting: str | None = None
    #: the GPU count the node declares for itself (a modelled stand-in's); None: the SKU's
    declared_gpus: int | None = None
    #: a stand-in (its parts written from a description); False: this host
    stand_in: bool = False
    #: when the node booted, Unix seconds; None: this host's (``psutil.boot_time``)
    boot_time: float | None = None
    #: how the node's GPUs are reset (a stand-in's answers for itself); None: this host's
    #: (``nvidia-smi --gpu-reset``, where the remediation finds it)
    gpu_reset: GpuReset | None = None
    #: the key of a suite entry's params applied over its others on this node (None: none)
    param_overlay: str | None = None
    #: speed of the node's transfers to other nodes, as a factor (1.0: as measured)
    inter_node_speed: float = 1.0
    #: how a child process opens this same node (checking/child.py): this host, or the
    #: scenario file's absolute path; set where the node is opened (``open_environment``)
    spec: NodeSpec = HOST
