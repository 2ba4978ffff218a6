"""Host and GPU inventory, read through the GPU interface (``node-agent inventory``)."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass, field

from node_agent.gpu.base import GpuBackend, GpuError
from node_agent.grading.sku import Sku, match_sku
from node_agent.model import GpuInfo, HostInfo


@dataclass
class Inventory:
    host: HostInfo
    gpus: list[GpuInfo]
    sku: Sku | None
    #: GPUs whose identity could not be read: index -> the error (DeviceLost, GpuTimeout ...)
    unreadable: dict[int, GpuError] = field(default_factory=dict)
    sku_problem: str | None = None

    def to_dict(self) -> dict:
        return {"host": self.host.to_dict(), "gpus": [g.to_dict() for g in self.gpus],
                "sku": self.sku.id if self.sku else None}


def collect(backend: GpuBackend, skus: dict[str, Sku], sku_setting: str = "auto",
            hostname: str | None = None) -> Inventory:
    """Read identity of every GPU and pick the SKU (``auto``: by NVML product name)."""
    driver = backend.driver()
    host = HostInfo(hostname=hostname or socket.gethostname().split(".")[0],
                    kernel=platform.release(), driver=driver.driver_version,
                    cuda=driver.cuda_version, gpu_backend=backend.name)
    gpus: list[GpuInfo] = []
    unreadable: dict[int, GpuError] = {}
    for device in backend.devices():
        try:
            ident = device.identity()
        except GpuError as err:
            unreadable[device.index] = err
            continue
        gpus.append(GpuInfo(index=ident.index, uuid=ident.uuid, name=ident.name,
                            pci_bus_id=ident.pci_bus_id, serial=ident.serial, vbios=ident.vbios,
                            memory_total_mib=ident.memory_total_mib))
    sku, problem = _choose_sku(gpus, skus, sku_setting)
    for gpu in gpus:
        gpu.sku = sku.id if sku else None
    return Inventory(host=host, gpus=gpus, sku=sku, unreadable=unreadable, sku_problem=problem)


def _choose_sku(gpus: list[GpuInfo], skus: dict[str, Sku],
                setting: str) -> tuple[Sku | None, str | None]:
    if setting != "auto":
        return skus[setting], None  # validated when the config was applied
    if not gpus:
        return None, None
    sku = match_sku([g.name for g in gpus], skus)
    if sku is None:
        names = sorted({g.name for g in gpus})
        return None, (f"no SKU file under graders/skus/ matches GPU name(s) {', '.join(names)}: "
                      "limits come from NVML alone; add a SKU file or set node.sku")
    return sku, None
