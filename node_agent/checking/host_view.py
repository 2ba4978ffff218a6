"""What this host can see of its GPUs: whether it is a virtual machine, and what a lost GPU
leaves behind.

Judgments fit the host they run on (DESIGN.md, "Real nodes as test material"). A GPU passed
through to a virtual machine is the same chip as on bare metal, but the VM sees one slice of
the board: the SKU file's GPU count (the whole HGX baseboard) and its NVLinks (wired to
NVSwitches the VM does not see) are not this host's. NVML says so itself:
``nvmlDeviceGetVirtualizationMode`` answers ``NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH``
inside such a VM (``nvidia-smi -q``: "Virtualization Mode: Pass-Through"), and every NVLink
call answers ``NVML_ERROR_NOT_SUPPORTED`` there (both read on a real H100 SXM5 passed through
to a VM: ``../shared/realworld/gpu-h100-vm/``).

What is missing from such a host is a skip with the reason, or a WARN naming the setting to
declare; a FAULT needs positive evidence of a broken part. For a missing GPU that evidence is
:func:`lost_gpu_traces`: a GPU on the PCI bus that NVML does not list, a GPU NVML lists but can
no longer read, or an Xid 79 ("GPU has fallen off the bus") in the kernel log.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.checking.context import CheckContext
from node_agent.gpu.base import GpuDevice, GpuError, NoPermission, NotSupported
from node_agent.gpu.pci import compare
from node_agent.kernel_log import XidLine, scan

#: ``nvmlGpuVirtualizationMode_t`` as ``GpuDevice.virtualization_mode()`` names it.
#: The GPU is seen from inside a VM: pass-through (the whole GPU) or a vGPU slice of one.
GUEST_MODES = frozenset({"pass_through", "vgpu"})

_MODE_WORDS = {
    "none": "on bare metal",
    "pass_through": "passed through to a VM",
    "vgpu": "a virtual GPU (vGPU) in a VM",
    "host_vgpu": "shared out as vGPUs by this host",
    "host_vsga": "shared out by this host (vSGA)",
}

#: Xid 79: "GPU has fallen off the bus" (NVIDIA Xid catalog); the kernel-log reader also
#: reads the driver's three-line "fallen off the bus" message without an Xid as 79
XID_FALLEN_OFF_BUS = 79


def virtualization_mode(dev: GpuDevice) -> str:
    """``dev``'s NVML virtualization mode; ``"none"`` where NVML does not answer (a driver or
    GPU that predates the call, or no permission): such a GPU is judged as on bare metal.
    A GPU that stopped answering (``DeviceLost``, ``GpuTimeout``) raises, as every reading
    does, so the caller records it."""
    try:
        return dev.virtualization_mode()
    except (NotSupported, NoPermission):
        return "none"


def describe_mode(mode: str) -> str:
    """``"passed through to a VM"`` for ``"pass_through"``; an unknown mode by its name."""
    return _MODE_WORDS.get(mode, f"in NVML virtualization mode {mode}")


@dataclass(frozen=True)
class HostView:
    """The virtualization mode of each GPU NVML lists (index -> mode)."""

    modes: dict[int, str]

    @property
    def guest(self) -> bool:
        """True when any GPU is seen from inside a VM (pass-through or vGPU)."""
        return any(mode in GUEST_MODES for mode in self.modes.values())

    @property
    def guest_modes(self) -> list[str]:
        return sorted({m for m in self.modes.values() if m in GUEST_MODES})


def read_host_view(devices: list[GpuDevice]) -> HostView:
    """Each device's virtualization mode; a GPU whose mode cannot be read counts as bare
    metal (``"none"``), so an unreadable mode never relaxes a judgment."""
    modes = {}
    for dev in devices:
        try:
            modes[dev.index] = virtualization_mode(dev)
        except GpuError:
            modes[dev.index] = "none"
    return HostView(modes)


@dataclass(frozen=True)
class LostGpuTraces:
    """What on this host shows a GPU was lost (``traces``, one sentence each; empty when
    nothing does), and what could be looked at (``looked_at``, for the operator's sentence)."""

    traces: list[str]
    looked_at: list[str]


def lost_gpu_traces(ctx: CheckContext) -> LostGpuTraces:
    """Look for a lost GPU: every NVIDIA GPU on the PCI bus (not handed on to a VM of its own)
    is listed by NVML; no GPU NVML lists is unreadable; no Xid 79 in the kernel log. A PCI bus
    or kernel log that cannot be read shows no trace, and is left out of ``looked_at``."""
    traces: list[str] = []
    seen: list[str] = []
    bus = ctx.pci_bus()
    inv = ctx.inventory
    if bus.unreadable is None:
        found = compare(bus, [g.pci_bus_id for g in inv.gpus], unidentified=len(inv.unreadable))
        traces += [
            f"NVIDIA GPU {g.describe()} is on the PCI bus but not listed by NVML"
            for g in found.not_enumerated
        ]
        if not found.not_enumerated:
            seen.append(
                f"every NVIDIA GPU on the PCI bus is listed by NVML "
                f"({len(bus.host_gpus)} on the bus)"
            )
    traces += [
        f"GPU {index} is listed by NVML but unreadable: {error}"
        for index, error in sorted(inv.unreadable.items())
    ]
    log = ctx.kernel_log
    if not log.unavailable_reason:
        try:
            events = scan(log.read())
        except OSError:
            events = []
        else:
            fallen = [e for e in events if isinstance(e, XidLine) and e.code == XID_FALLEN_OFF_BUS]
            traces += [
                f"Xid 79 (fallen off the bus) on PCI {e.pci_bus} in the kernel log" for e in fallen
            ]
            if not fallen:
                seen.append(f"no Xid 79 in the kernel log ({log.source})")
    return LostGpuTraces(traces, seen)
