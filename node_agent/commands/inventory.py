"""``node-agent inventory``: host, driver and GPU inventory, and the GPUs on the PCI bus."""

from __future__ import annotations

import argparse
import json

from node_agent.commands.reporting import EXIT_OK
from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.inventory import unreadable_kind


def cmd_inventory(args: argparse.Namespace) -> int:
    env = open_environment(load_config(args.config), args.simulate)
    try:
        inv = env.inventory
        bus = env.ports.pci_bus()
        if args.json:
            data = inv.to_dict()
            data["unavailable_reason"] = env.gpu.unavailable_reason
            data["pci"] = bus.to_dict()
            print(json.dumps(data, indent=2))
            return EXIT_OK
        host = inv.host
        print(
            f"host {host.hostname}  kernel {host.kernel}  driver {host.driver or 'n/a'}  "
            f"CUDA {host.cuda or 'n/a'}  backend {host.gpu_backend}"
            f"{'  (SIMULATED)' if env.simulated else ''}"
        )
        if env.gpu.unavailable_reason:
            print(f"no GPUs: {env.gpu.unavailable_reason}")
        print(f"SKU: {inv.sku.id if inv.sku else inv.sku_problem or 'none'}")
        if inv.sku_mismatch:
            print(f"SKU MISMATCH: {inv.sku_mismatch}")
        for g in inv.gpus:
            print(
                f"  gpu:{g.index}  {g.name}  {g.pci_bus_id}  {g.uuid}  serial {g.serial or 'n/a'}"
                f"  VBIOS {g.vbios or 'n/a'}"
            )
        for index, error in sorted(inv.unreadable.items()):
            print(f"  gpu:{index}  UNREADABLE ({unreadable_kind(error)}): {error}")
        if bus.unreadable:
            print(f"PCI bus: unreadable: {bus.unreadable}")
        else:
            print(
                f"PCI bus: {len(bus.gpus)} NVIDIA GPU(s)"
                + "".join(f"\n  pci:{g.describe()}" for g in bus.gpus)
            )
        return EXIT_OK
    finally:
        env.close()
