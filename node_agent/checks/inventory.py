"""Check ``inventory``: host, driver, CUDA, each GPU's identity, the PCI bus, and the SKU.

The SKU is matched by NVML name and memory (``graders/skus/*.yaml``); each GPU's memory is
checked against the SKU's range, and a forced ``node.sku`` against the GPUs' names. What the
PCI bus shows is reported here as inventory; ``nvml_health`` (which runs in every suite) grades
a GPU that is on the bus but missing from NVML. The GPUs' virtualization mode is reported too:
inside a VM the SKU's GPU count and NVLinks are not this host's (docs/hosts.md).
"""

from __future__ import annotations

from node_agent.checking import host_view
from node_agent.checking.context import CheckContext
from node_agent.gpu.base import (
    DeviceLost,
    DriverStateError,
    GpuTimeout,
    NoPermission,
    NotSupported,
)
from node_agent.model import Result, Status


def run(ctx: CheckContext) -> list[Result]:
    inv = ctx.inventory  # collected once per run, before the suite starts
    results = [
        ctx.result(
            "node",
            "host",
            Status.PASS,
            f"{inv.host.hostname}: kernel {inv.host.kernel}, driver "
            f"{inv.host.driver or 'n/a'}, CUDA {inv.host.cuda or 'n/a'}",
            **inv.host.to_dict(),
        )
    ]
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return results + [_no_gpus(ctx, r) if r.status is Status.SKIP else r for r in unavailable]
    results.append(_pci(ctx))
    results.append(_virtualization(ctx))
    for gpu in inv.gpus:
        results.append(
            ctx.result(
                f"gpu:{gpu.index}",
                "identity",
                Status.PASS,
                f"{gpu.name} {gpu.pci_bus_id} serial {gpu.serial or 'n/a'} VBIOS {gpu.vbios or 'n/a'}",
                value=gpu.uuid,
                **gpu.to_dict(),
            )
        )
    for index, error in sorted(inv.unreadable.items()):
        detail = f"GPU {index} identity unreadable: {error}"
        if isinstance(error, GpuTimeout):
            metric, status = "driver_hang", Status.ERROR
        elif isinstance(error, DeviceLost):
            metric, status = "gpu_lost", Status.FAIL
        elif isinstance(error, (NoPermission, NotSupported)):
            # the agent's own access (a container without the GPU's device files, a user
            # without the capability), not the GPU's failure: the check could not run
            metric, status = "identity", Status.ERROR
            detail += (
                ": the agent may not read this GPU, which says nothing of the GPU; run it as "
                "root, or give its container the GPUs' device files (NVIDIA container toolkit)"
            )
        elif isinstance(error, DriverStateError):
            # NVML's Unknown Error, reset required, blocked by the OS or cgroups, a library
            # and driver version mismatch: the driver's or the container's state, which a
            # reset, a reboot or a new container clears
            metric, status = "identity_error", Status.FAIL
        else:
            # any other code (insufficient power, an IRQ issue, a corrupted InfoROM, a
            # memory error): the GPU's own, as before
            metric, status = "identity", Status.FAIL
        results.append(ctx.result(f"gpu:{index}", metric, status, detail, error=str(error)))
    results.extend(_sku(ctx))
    return results


def _no_gpus(ctx: CheckContext, skip: Result) -> Result:
    """On a host whose PCI bus shows no NVIDIA GPU, "no GPUs" is the inventory's answer, not
    a check that could not run; where the bus could not be read it stays a skip."""
    if ctx.pci_bus().unreadable is not None:
        return skip
    return ctx.result(
        "node",
        "gpus",
        Status.PASS,
        f"no GPUs: {skip.detail}",
        value=0,
        unit="GPUs",
        pci_root=ctx.pci_bus().root,
    )


def _pci(ctx: CheckContext) -> Result:
    bus = ctx.pci_bus()
    if bus.unreadable:
        return ctx.result(
            "node", "pci_bus", Status.SKIP, f"PCI bus not compared with NVML: {bus.unreadable}"
        )
    listed = len(ctx.gpu.devices())
    passthrough = [g.bus_id for g in bus.gpus if g.passthrough]
    return ctx.result(
        "node",
        "pci_bus",
        Status.PASS,
        f"{len(bus.gpus)} NVIDIA GPU(s) on the PCI bus, {listed} enumerated by NVML"
        + (
            f"; {len(passthrough)} handed to a VM ({', '.join(passthrough)})" if passthrough else ""
        ),
        value=len(bus.gpus),
        unit="GPUs",
        gpus=[g.to_dict() for g in bus.gpus],
        root=bus.root,
    )


def _virtualization(ctx: CheckContext) -> Result:
    """Whether the GPUs are on bare metal or seen through a hypervisor (NVML virtualization
    mode, ``nvidia-smi -q``: GPU Virtualization Mode). Inside a VM the SKU's GPU count and
    NVLinks are the board's, not this host's: the detail names the settings that declare
    this host's own (docs/hosts.md)."""
    view = host_view.read_host_view(ctx.gpu.devices())
    modes = sorted(set(view.modes.values())) or ["none"]
    value = modes[0] if len(modes) == 1 else ",".join(modes)
    if view.guest:
        detail = (
            f"the GPUs are {host_view.describe_mode(view.guest_modes[0])} (NVML "
            f"virtualization mode {value}): the SKU's GPU count and NVLinks are the "
            "board's, not this VM's; declare this VM's with node.expected_gpus and "
            "node.expected_nvlinks"
        )
    elif modes == ["none"]:
        detail = "bare metal (NVML virtualization mode none, or not reported)"
    else:
        detail = (
            f"the GPUs are {host_view.describe_mode(modes[-1])} (NVML virtualization mode {value})"
        )
    return ctx.result(
        "node",
        "virtualization",
        Status.PASS,
        detail,
        value=value,
        by_gpu={str(k): v for k, v in sorted(view.modes.items())},
    )


def _sku(ctx: CheckContext) -> list[Result]:
    inv = ctx.inventory
    out = []
    if inv.sku is None:
        if inv.sku_problem:
            out.append(ctx.result("node", "sku", Status.WARN, inv.sku_problem))
        return out
    out.append(
        ctx.result(
            "node",
            "sku",
            Status.PASS,
            f"SKU {inv.sku.id} ({inv.sku.display_name})",
            value=inv.sku.id,
            sku_file=inv.sku.source,
        )
    )
    if inv.sku_mismatch:
        out.append(
            ctx.result(
                "node",
                "sku_mismatch",
                Status.WARN,
                inv.sku_mismatch,
                value=inv.sku.id,
                names=sorted({g.name for g in inv.gpus}),
            )
        )
    low, high = inv.sku.memory_range
    for gpu in inv.gpus:
        if gpu.memory_total_mib is None or (low is None and high is None):
            continue
        problem = inv.sku.memory_problem(gpu.memory_total_mib)
        out.append(
            ctx.result(
                f"gpu:{gpu.index}",
                "memory_total",
                Status.WARN if problem else Status.PASS,
                (
                    f"memory.total {problem}: a GPU of another variant or a board that does not "
                    "expose all its memory; check the model and VBIOS"
                )
                if problem
                else f"memory.total {gpu.memory_total_mib} MiB (SKU {inv.sku.id}: {low}-{high} MiB)",
                value=gpu.memory_total_mib,
                unit="MiB",
                min_mib=low,
                max_mib=high,
            )
        )
    return out
