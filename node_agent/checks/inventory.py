"""Check ``inventory``: host, driver, CUDA, each GPU's identity, and the SKU it matches."""

from __future__ import annotations

from ..model import Result, Status
from . import CheckContext


def run(ctx: CheckContext) -> list[Result]:
    inv = ctx.inventory  # collected once per run, before the suite starts
    results = [ctx.result("node", "host", Status.PASS,
                          f"{inv.host.hostname}: kernel {inv.host.kernel}, driver "
                          f"{inv.host.driver or 'n/a'}, CUDA {inv.host.cuda or 'n/a'}",
                          **inv.host.to_dict())]
    if ctx.gpu.unavailable_reason:
        results.append(ctx.skip(ctx.gpu.unavailable_reason, metric="gpus"))
        return results
    for gpu in inv.gpus:
        results.append(ctx.result(
            f"gpu:{gpu.index}", "identity", Status.PASS,
            f"{gpu.name} {gpu.pci_bus_id} serial {gpu.serial or 'n/a'} VBIOS {gpu.vbios or 'n/a'}",
            value=gpu.uuid, **gpu.to_dict()))
    for index, error in sorted(inv.unreadable.items()):
        results.append(ctx.result(f"gpu:{index}", "identity", Status.FAIL,
                                  f"GPU {index} identity unreadable: {error}", error=error))
    if inv.sku is not None:
        results.append(ctx.result("node", "sku", Status.PASS,
                                  f"SKU {inv.sku.id} ({inv.sku.display_name})",
                                  value=inv.sku.id, sku_file=inv.sku.source))
    elif inv.sku_problem:
        results.append(ctx.result("node", "sku", Status.WARN, inv.sku_problem))
    return results

