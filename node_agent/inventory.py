"""Host and GPU inventory, read through the GPU interface (``node-agent inventory``), and the
PCI bus the GPUs sit on (this host's sysfs; a stand-in's bus is read in :mod:`node_agent.sim.tools`)."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.gpu.base import DeviceLost, GpuBackend, GpuError, GpuFabric, GpuTimeout
from node_agent.gpu.nvlink_topology import fabric_dict, read_fabric, tray_domain
from node_agent.gpu.pci import SYSFS_PCI_DEVICES, PciBus, read_bus
from node_agent.hardware.sku import Sku, match_sku
from node_agent.model import GpuInfo, HostInfo


@dataclass
class Inventory:
    host: HostInfo
    gpus: list[GpuInfo]
    sku: Sku | None
    #: GPUs whose identity could not be read: index -> the error (DeviceLost, GpuTimeout ...)
    unreadable: dict[int, GpuError] = field(default_factory=dict)
    #: why no SKU was chosen (``sku`` is None)
    sku_problem: str | None = None
    #: a forced ``node.sku`` that does not name these GPUs: what disagrees
    sku_mismatch: str | None = None
    #: each GPU's NVLink fabric (``nvidia-smi -q``'s Fabric), by index; absent: none reported
    fabrics: dict[int, GpuFabric] = field(default_factory=dict)

    @property
    def nvlink_domain(self) -> tuple[str, int] | None:
        """The tray's multi-node NVLink domain (ClusterUUID, CliqueID), or None."""
        return tray_domain(self.fabrics)

    def unreadable_gpus(self) -> list[dict[str, Any]]:
        """The GPUs NVML enumerates but whose identity could not be read, with why."""
        return [
            {"index": index, "status": unreadable_kind(error), "error": str(error)}
            for index, error in sorted(self.unreadable.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        """The inventory as reports carry it. ``nvlink_domain`` and each GPU's ``fabric`` are
        a contract (``node-agent fleet`` groups trays by them): ``{"cluster_uuid": str,
        "clique_id": int}`` or null; ``{"state", "status", "cluster_uuid", "clique_id",
        "health"}`` or null."""
        domain = self.nvlink_domain
        return {
            "host": self.host.to_dict(),
            "gpus": [
                {**g.to_dict(), "fabric": fabric_dict(self.fabrics.get(g.index))} for g in self.gpus
            ],
            "nvlink_domain": None
            if domain is None
            else {"cluster_uuid": domain[0], "clique_id": domain[1]},
            "unreadable_gpus": self.unreadable_gpus(),
            "sku": self.sku.id if self.sku else None,
            "sku_problem": self.sku_problem,
            "sku_mismatch": self.sku_mismatch,
        }


def unreadable_kind(error: GpuError) -> str:
    """``gpu_lost`` (fell off the bus), ``driver_hang`` (a call timed out) or ``unreadable``."""
    if isinstance(error, DeviceLost):
        return "gpu_lost"
    if isinstance(error, GpuTimeout):
        return "driver_hang"
    return "unreadable"


def collect(
    backend: GpuBackend,
    skus: dict[str, Sku],
    sku_setting: str = "auto",
    hostname: str | None = None,
) -> Inventory:
    """Read identity of every GPU and pick the SKU (``auto``: by NVML name and memory)."""
    driver = backend.driver()
    host = HostInfo(
        hostname=hostname or socket.gethostname().split(".")[0],
        kernel=platform.release(),
        driver=driver.driver_version,
        cuda=driver.cuda_version,
        gpu_backend=backend.name,
    )
    gpus: list[GpuInfo] = []
    unreadable: dict[int, GpuError] = {}
    fabrics: dict[int, GpuFabric] = {}
    for device in backend.devices():
        try:
            ident = device.identity()
        except GpuError as err:
            unreadable[device.index] = err
            continue
        try:
            fabric = read_fabric(device)
        except GpuError:
            fabric = None  # the nvlink_fabric check reports why
        if fabric is not None:
            fabrics[ident.index] = fabric
        gpus.append(
            GpuInfo(
                index=ident.index,
                uuid=ident.uuid,
                name=ident.name,
                pci_bus_id=ident.pci_bus_id,
                serial=ident.serial,
                vbios=ident.vbios,
                memory_total_mib=ident.memory_total_mib,
            )
        )
    sku, problem, mismatch = _choose_sku(gpus, skus, sku_setting)
    for gpu in gpus:
        gpu.sku = sku.id if sku else None
    return Inventory(
        host=host,
        gpus=gpus,
        sku=sku,
        unreadable=unreadable,
        sku_problem=problem,
        sku_mismatch=mismatch,
        fabrics=fabrics,
    )


def _choose_sku(
    gpus: list[GpuInfo], skus: dict[str, Sku], setting: str
) -> tuple[Sku | None, str | None, str | None]:
    """(SKU, why none, why a forced one does not fit these GPUs)."""
    if setting != "auto":
        sku = skus[setting]  # validated when the config was applied
        foreign = sorted({g.name for g in gpus if not sku.names_gpu(g.name)})
        mismatch = None
        if foreign:
            mismatch = (
                f"node.sku is {sku.id}, but the GPUs report {', '.join(map(repr, foreign))}, "
                f"which is not among its names ({', '.join(map(repr, sku.match))}): "
                "counts, NVLinks and minima are graded against the wrong baseline; fix "
                "node.sku (or 'auto'), or add the name to the SKU file's match list"
            )
        return sku, None, mismatch
    found = match_sku([(g.name, g.memory_total_mib) for g in gpus], skus)
    return found.sku, found.problem, None


def read_pci_bus(root: Path = SYSFS_PCI_DEVICES) -> PciBus:
    """The NVIDIA GPUs on this node's PCI bus (sysfs under ``root``). A stand-in node's bus is
    its ports' (``ports.pci_bus``: :func:`node_agent.sim.tools.stand_in_pci_bus`)."""
    return read_bus(root)
