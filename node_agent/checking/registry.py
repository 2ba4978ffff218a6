"""The checks, registered here and only here: a check's name -> the module that implements
``run(ctx) -> list[Result]`` (node_agent/checks/), imported lazily (compute checks pull in
torch). Registering a check is one line."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from node_agent.checking.context import CheckContext
from node_agent.model import Result

#: check name -> module implementing ``run(ctx)``; imported lazily (compute checks pull in torch)
REGISTRY: dict[str, str] = {
    "inventory": "node_agent.checks.inventory",
    "nvml_health": "node_agent.checks.nvml_health",
    "xid": "node_agent.checks.xid",
    "storage": "node_agent.checks.storage",
    "nccl_allreduce": "node_agent.checks.nccl_allreduce",
    "rdma": "node_agent.checks.rdma",
    "gpu_burn": "node_agent.checks.gpu_burn",
    "thermal_power": "node_agent.checks.thermal_power",
    "dcgm_diag": "node_agent.checks.dcgm_diag",
    "dcgm_health": "node_agent.checks.dcgm_health",
    "hbm_bandwidth": "node_agent.checks.hbm_bandwidth",
    "pcie_bandwidth": "node_agent.checks.pcie_bandwidth",
    "sdc": "node_agent.checks.sdc",
    "sdc_spool": "node_agent.checks.sdc_spool",
    "training_progress": "node_agent.checks.training_progress",
    # the rest of the node (docs/host_checks.md)
    "host_memory": "node_agent.checks.host_memory",
    "host_power": "node_agent.checks.host_power",
    "pcie_aer": "node_agent.checks.pcie_aer",
    "nvme_health": "node_agent.checks.nvme_health",
    "host_cpu": "node_agent.checks.host_cpu",
    "hca_ports": "node_agent.checks.hca_ports",
    "kernel_distress": "node_agent.checks.kernel_distress",
    "software_drift": "node_agent.checks.software_drift",
    "cloud_maintenance": "node_agent.checks.cloud_maintenance",
    # the NVLink fabric of multi-node NVLink systems (GB200/GB300 NVL72) and its IMEX domain
    "nvlink_fabric": "node_agent.checks.nvlink_fabric",
    "imex": "node_agent.checks.imex",
}


def parse_params(name: str, raw: dict[str, Any]) -> object | None:
    """``raw`` parsed through the check's ``Params`` (checking/params.py); None when the check
    has none or is not registered (the runner reports an unknown check). ValueError names a bad
    key. Importing a check module imports no compute library (those load inside the check)."""
    if name not in REGISTRY:
        return None
    params = getattr(importlib.import_module(REGISTRY[name]), "Params", None)
    return None if params is None else params.parse(raw)


def resolve(name: str) -> Callable[[CheckContext], list[Result]]:
    """The ``run`` function of a registered check; KeyError names the known checks."""
    try:
        module_name = REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown check {name!r}; known checks: {', '.join(sorted(REGISTRY))}"
        ) from None
    run: Callable[[CheckContext], list[Result]] = importlib.import_module(module_name).run
    return run
