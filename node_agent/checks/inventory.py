"""Check ``inventory``: host, driver, CUDA, each GPU's identity, and the SKU it matches."""

from __future__ import annotations

from node_agent.checks import CheckContext
from node_agent.gpu.base import DeviceLost, GpuTimeout
from node_agent.model import Result, Status


def run(ctx: CheckContext) -> list[Result]:
    inv = ctx.inventory  # collected once per run, before the suite starts
    results = [ctx.result("node", "host", Status.PASS,
                          f"{inv.host.hostname}: kernel {inv.host.kernel}, driver "
                          f"{inv.host.driver or 'n/a'}, CUDA {inv.host.cuda or 'n/a'}",
                          **inv.host.to_dict())]
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return results + unavailable
    for gpu in inv.gpus:
        results.append(ctx.result(
            f"gpu:{gpu.index}", "identity", Status.PASS,
            f"{gpu.name} {gpu.pci_bus_id} serial {gpu.serial or 'n/a'} VBIOS {gpu.vbios or 'n/a'}",
            value=gpu.uuid, **gpu.to_dict()))
    for index, error in sorted(inv.unreadable.items()):
        if isinstance(error, GpuTimeout):
            metric, status = "driver_hang", Status.ERROR
        elif isinstance(error, DeviceLost):
            metric, status = "gpu_lost", Status.FAIL
        else:
            metric, status = "identity", Status.FAIL
        results.append(ctx.result(f"gpu:{index}", metric, status,
                                  f"GPU {index} identity unreadable: {error}", error=str(error)))
    if inv.sku is not None:
        results.append(ctx.result("node", "sku", Status.PASS,
                                  f"SKU {inv.sku.id} ({inv.sku.display_name})",
                                  value=inv.sku.id, sku_file=inv.sku.source))
    elif inv.sku_problem:
        results.append(ctx.result("node", "sku", Status.WARN, inv.sku_problem))
    return results

