"""Check ``software_drift``: the node's software stack against the golden set it should run.

The golden set is declared in the config under ``node.software`` (``driver``, ``cuda``, ``nccl``,
``vbios``, ``kernel``; null = not declared). Each is compared with what the node has:

=================  =====================================================================  ===========
metric             found                                                                  target
=================  =====================================================================  ===========
``driver_version`` NVML's driver version (``nvidia-smi --query-gpu=driver_version``)      node
``cuda_version``   NVML's CUDA driver version (``nvidia-smi``'s "CUDA Version")           node
``vbios_version``  each GPU's VBIOS (``nvidia-smi --query-gpu=vbios_version``)             gpu:N
``kernel_version`` ``platform.release()`` (``uname -r``)                                  node
``nccl_version``   the system's ``libnccl.so*`` (``ldconfig -p``; the version is the      node
                   name the soname link resolves to, ``libnccl.so.2.21.5``). torch is not
                   imported (seconds of start-up in a quick check); a job's own NCCL
                   (PyTorch wheels bundle ``nvidia-nccl-cu12``) is not seen here
=================  =====================================================================  ===========

A declared version matches what is found when they are equal or when the found one continues it
after a dot (``570`` accepts ``570.86.15``; ``2.21`` accepts ``2.21.5``). A difference is a
``warn`` naming the expected and the found value; nothing declared is a ``pass`` saying what was
found (no guess).

And the pieces a node of its kind needs (``NEEDS``, per SKU, with sources; the check's
``params: {needs: {fabricmanager: bool, peermem: bool}}`` overrides):

- ``fabric_manager``: ``nvidia-fabricmanager`` running (a root process ``nv-fabricmanager``) on
  an NVSwitch board: without it the GPUs' NVLink fabric is not set up and CUDA fails to start;
- ``nvidia_peermem``: the module loaded (``/sys/module/nvidia_peermem``) on a node with RDMA
  devices (``/sys/class/infiniband``), for GPUDirect RDMA. NCCL 2.19+ on kernel 5.12+ with the
  open GPU modules can use DMA-BUF instead: declare ``needs: {peermem: false}`` there;
- ``pcie_acs``: PCIe ACS off on the bridges above the GPUs and HCAs on bare metal: with Request
  or Completion Redirect on, peer-to-peer traffic goes up to the root complex (NCCL's
  troubleshooting guide, "PCI Access Control Services"). Read from the bridges' extended config
  space in sysfs (no ``setpci``), which only root can read past 64 bytes;
- ``persistence_mode``: on for every GPU (``nvidia-smi -pm 1`` or ``nvidia-persistenced``).

Every drift is a WARN at delivery and in service (graders/rules.yaml, ``software-drift``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.gpu.base import GpuError
from node_agent.model import Result, Status

#: What a SKU's nodes need. Sources: NVIDIA Fabric Manager User Guide (docs.nvidia.com/
#: datacenter/tesla/fabric-manager-user-guide: FM is required on NVSwitch-based HGX/DGX A100,
#: H100/H200 (H20 is the same HGX baseboard) and B200/B300 systems; GB200/GB300 NVL72 compute
#: trays use NVLink switch trays managed outside the node, no FM there); NVIDIA GPUDirect RDMA
#: documentation and the network operator's guide (nvidia_peermem for InfiniBand/RoCE
#: GPUDirect on the SXM training boards). PCIe cards are deployed without RDMA as often as with.
NEEDS: dict[str, dict[str, bool]] = {
    "a100-sxm4-40gb": {"fabricmanager": True, "peermem": True},
    "a100-sxm4-80gb": {"fabricmanager": True, "peermem": True},
    "h100-sxm5-80gb": {"fabricmanager": True, "peermem": True},
    "h200-sxm-141gb": {"fabricmanager": True, "peermem": True},
    "h20-96gb": {"fabricmanager": True, "peermem": True},
    "b200-sxm-180gb": {"fabricmanager": True, "peermem": True},
    "b300-sxm-288gb": {"fabricmanager": True, "peermem": True},
    "gb200-186gb": {"fabricmanager": False, "peermem": True},
    "gb300-288gb": {"fabricmanager": False, "peermem": True},
}

_NOT_RECORDED = (
    "not recorded by this capture (node-agent capture keeps NVML, the PCI bus and "
    "the kernel log; add a software fault to say what the node had)"
)

SYS_MODULE = Path("/sys/module")
SYS_INFINIBAND = Path("/sys/class/infiniband")
SYS_PCI_DEVICES = Path("/sys/bus/pci/devices")
PROC = Path("/proc")

#: PCIe extended capability ID of ACS, and its control register's offset (PCIe base spec 6.0,
#: 7.7.11 "ACS Extended Capability"): SV bit 0, TB 1, RR 2 (Request Redirect), CR 3 (Completion
#: Redirect), UF 4, EC 5, DT 6. RR and CR send peer-to-peer TLPs up to the root complex.
ACS_CAP_ID = 0x000D
ACS_CTRL_OFFSET = 6
ACS_P2P_BREAKING = (1 << 2) | (1 << 3)


def run(ctx: CheckContext) -> list[Result]:
    declared = ctx.config.node.software.as_dict()
    # the software a stand-in declares; empty: this host's, read here
    sim: dict[str, Any] = dict(ctx.ports.software.values) if ctx.ports.software else {}
    results: list[Result] = []
    host = ctx.inventory.host
    gpus_down = ctx.gpus_unavailable()
    if gpus_down:
        results.extend(gpus_down)
    else:
        results.append(
            compare(ctx, "node", "driver_version", "driver", declared["driver"], host.driver)
        )
        results.append(compare(ctx, "node", "cuda_version", "cuda", declared["cuda"], host.cuda))
        for gpu in ctx.inventory.gpus:
            results.append(
                compare(
                    ctx, f"gpu:{gpu.index}", "vbios_version", "vbios", declared["vbios"], gpu.vbios
                )
            )
    if "kernel" in sim and sim["kernel"] is None:  # a capture: this host's kernel is not its
        results.append(ctx.skip(_NOT_RECORDED, metric="kernel_version"))
    else:
        kernel = sim.get("kernel") or host.kernel
        results.append(compare(ctx, "node", "kernel_version", "kernel", declared["kernel"], kernel))
    if "nccl" in sim and sim["nccl"] is None:
        results.append(ctx.skip(_NOT_RECORDED, metric="nccl_version"))
    elif "nccl" in sim:
        results.append(
            compare(
                ctx,
                "node",
                "nccl_version",
                "nccl",
                declared["nccl"],
                sim["nccl"],
                found_from=ctx.ports.software.source if ctx.ports.software else "",
            )
        )
    else:
        nccl, nccl_from = system_nccl(timeout_s=min(10.0, ctx.timeout_s / 3))
        results.append(
            compare(
                ctx, "node", "nccl_version", "nccl", declared["nccl"], nccl, found_from=nccl_from
            )
        )
    needs = _needs(ctx)
    results.append(_fabric_manager(ctx, needs, sim))
    results.append(_peermem(ctx, needs, sim))
    results.append(_acs(ctx, sim))
    if not gpus_down:
        results.append(_persistence(ctx))
    return results


def matches(declared: str, found: str) -> bool:
    """``570`` matches ``570.86.15``; ``2.21.5`` matches only itself.

    >>> matches("570", "570.86.15"), matches("570.86", "570.86.15"), matches("57", "570.86.15")
    (True, True, False)
    """
    declared, found = declared.strip(), found.strip()
    return found == declared or found.startswith(declared + ".")


def compare(
    ctx: CheckContext,
    target: str,
    metric: str,
    key: str,
    declared: str | None,
    found: str | None,
    found_from: str = "",
) -> Result:
    """One declared value against the found one: pass, or warn naming both."""
    setting = f"node.software.{key}"
    where = f" ({found_from})" if found_from else ""
    status = Status.PASS
    if found is None and declared is None:
        detail = f"{key}: none found{where}; nothing declared ({setting})"
    elif declared is None:
        detail = f"{key} {found}{where}; nothing declared ({setting})"
    elif found is not None and matches(declared, found):
        detail = f"{key} {found}{where} as declared ({setting}: {declared})"
    else:
        status = Status.WARN
        detail = (
            f"{key} drift on {target}: expected {declared} ({setting}), "
            f"found {'none' if found is None else found}{where}"
        )
    return ctx.result(target, metric, status, detail, value=found, expected=declared, found=found)


# --- NCCL -------------------------------------------------------------------------------------


def parse_ldconfig_nccl(text: str) -> list[str]:
    """The paths ``ldconfig -p`` lists for ``libnccl.so*`` (``\\tlibnccl.so.2 (libc6,x86-64) =>
    /usr/lib/x86_64-linux-gnu/libnccl.so.2``)."""
    paths = []
    for line in text.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libnccl.so") and path:
            paths.append(path.strip())
    return paths


def nccl_version_of(path: str) -> str | None:
    """``libnccl.so.2.21.5`` (what the soname link resolves to) -> ``2.21.5``; None when the
    name carries no full version."""
    name = os.path.basename(os.path.realpath(path))
    version = name.partition(".so.")[2]
    return version if version.count(".") >= 1 and version.replace(".", "").isdigit() else None


def system_nccl(timeout_s: float = 10.0) -> tuple[str | None, str]:
    """(the system NCCL's version or None, where it was looked for)."""
    if proc.which("ldconfig") is None and not Path("/sbin/ldconfig").exists():
        return None, "ldconfig not found: the dynamic linker's cache could not be listed"
    tool = proc.which("ldconfig") or "/sbin/ldconfig"
    done = proc.run([tool, "-p"], timeout_s=timeout_s)
    if not done.ok:
        return None, f"ldconfig -p failed: {done.describe_failure()}"
    paths = parse_ldconfig_nccl(done.stdout)
    if not paths:
        return None, "no libnccl.so* in the linker cache (ldconfig -p)"
    versions = sorted({v for p in paths if (v := nccl_version_of(p))})
    if not versions:
        return None, f"{paths[0]} names no full version"
    return ", ".join(versions), f"ldconfig -p: {paths[0]}"


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`: ``needs``
    overrides what the SKU needs (``{fabricmanager: bool, peermem: bool}``)."""

    needs: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("software_drift", raw, cls)
        needs = r.value("needs") or {}
        if not isinstance(needs, Mapping) or not all(
            k in ("fabricmanager", "peermem") and isinstance(v, bool) for k, v in needs.items()
        ):
            r.fail("needs", needs, "a mapping of fabricmanager and/or peermem to true or false")
        return cls(needs=tuple(needs.items()))


# --- what the SKU needs -----------------------------------------------------------------------


def _needs(ctx: CheckContext) -> dict[str, bool]:
    sku = ctx.sku.id if ctx.sku is not None else None
    needs = dict(NEEDS.get(sku or "", {"fabricmanager": False, "peermem": False}))
    if ctx.sku is not None:  # a SKU file's own ``needs`` section, where its schema allows one
        needs.update({k: bool(v) for k, v in ctx.sku.section("needs").items()})
    needs.update(ctx.typed_params(Params).needs)
    return needs


def _virtualized(ctx: CheckContext) -> bool:
    if ctx.ports.software is not None:
        return ctx.ports.software.virtualized
    try:
        devices = ctx.gpu.devices()
        return bool(devices) and devices[0].virtualization_mode() != "none"
    except (GpuError, AttributeError):
        return False


def fabric_manager_running(proc_root: Path = PROC) -> bool:
    """A root process named ``nv-fabricmanager`` (``comm`` is cut to 15 characters): a user's
    process of that name is not it."""
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            comm = (proc_root / pid / "comm").read_text().strip()
            if comm not in ("nv-fabricmanage", "nv-fabricmanager"):
                continue
            if os.stat(proc_root / pid).st_uid == 0:
                return True
        except OSError:
            continue
    return False


def _fabric_manager(ctx: CheckContext, needs: dict[str, bool], sim: dict[str, Any]) -> Result:
    sku = ctx.sku.id if ctx.sku else "unknown SKU"
    if not needs.get("fabricmanager"):
        return ctx.skip(
            f"nvidia-fabricmanager not needed on {sku} (no NVSwitch on the node)",
            metric="fabric_manager",
        )
    if _virtualized(ctx):
        return ctx.skip(
            "in a VM the fabric manager runs outside the guest (the host or its service VM)",
            metric="fabric_manager",
        )
    if sim and sim["fabricmanager"] is None:
        return ctx.skip(_NOT_RECORDED, metric="fabric_manager")
    running = sim["fabricmanager"] if sim else fabric_manager_running()
    if running:
        return ctx.result(
            "node",
            "fabric_manager",
            Status.PASS,
            f"nvidia-fabricmanager running ({sku} has NVSwitches)",
            value=True,
        )
    return ctx.result(
        "node",
        "fabric_manager",
        Status.WARN,
        f"nvidia-fabricmanager not running on {sku}, an NVSwitch board: expected "
        "running, found none (systemctl enable --now nvidia-fabricmanager; its "
        "version must match the driver's)",
        value=False,
        expected="running",
        found="not running",
    )


def _peermem(ctx: CheckContext, needs: dict[str, bool], sim: dict[str, Any]) -> Result:
    if sim and sim["peermem"] is None:
        return ctx.skip(_NOT_RECORDED, metric="nvidia_peermem")
    if sim:
        hcas = list(ctx.ports.software.hcas) if ctx.ports.software is not None else []
        loaded = bool(sim["peermem"])
    else:
        try:
            hcas = sorted(os.listdir(SYS_INFINIBAND))
        except OSError:
            hcas = []
        loaded = (SYS_MODULE / "nvidia_peermem").is_dir()
    if not needs.get("peermem"):
        return ctx.skip(
            "nvidia_peermem not needed on this SKU (params needs.peermem)", metric="nvidia_peermem"
        )
    if not hcas:
        return ctx.skip(
            "no RDMA devices (/sys/class/infiniband is empty): GPUDirect RDMA "
            "and nvidia_peermem do not apply",
            metric="nvidia_peermem",
        )
    if loaded:
        return ctx.result(
            "node",
            "nvidia_peermem",
            Status.PASS,
            f"nvidia_peermem loaded for GPUDirect RDMA ({len(hcas)} RDMA device(s))",
            value=True,
            hcas=hcas[:16],
        )
    return ctx.result(
        "node",
        "nvidia_peermem",
        Status.WARN,
        f"nvidia_peermem not loaded on a node with {len(hcas)} RDMA device(s): "
        "expected loaded, found not loaded; NCCL falls back to copies through "
        "host memory unless it can use DMA-BUF (modprobe nvidia_peermem; or "
        "declare needs.peermem false where DMA-BUF is used)",
        value=False,
        expected="loaded",
        found="not loaded",
        hcas=hcas[:16],
    )


# --- PCIe ACS ---------------------------------------------------------------------------------


def acs_control(config: bytes) -> int | None:
    """The ACS Control register from a function's config space (4096 bytes), or None when the
    function has no ACS capability or the extended space could not be read (under 4096 bytes:
    sysfs gives non-root readers the first 64 only)."""
    if len(config) < 4096:
        return None
    offset, seen = 0x100, 0
    while offset and 0x100 <= offset <= 0xFFC and seen < 64:
        header = int.from_bytes(config[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(
                config[offset + ACS_CTRL_OFFSET : offset + ACS_CTRL_OFFSET + 2], "little"
            )
        offset = (header >> 20) & 0xFFC
        seen += 1
    return None


def upstream_bridges(bdf: str, devices: Path = SYS_PCI_DEVICES) -> list[str]:
    """The PCI functions above ``bdf`` (``0000:18:00.0``), nearest first, from its sysfs path
    (``/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0``)."""
    try:
        real = Path(os.path.realpath(devices / bdf))
    except OSError:
        return []
    parts = [p for p in real.parts if p.count(":") == 2 and "." in p]
    return list(reversed(parts[:-1])) if parts and parts[-1] == bdf else []


def _endpoints(ctx: CheckContext) -> list[str]:
    out = []
    for gpu in ctx.inventory.gpus:
        bus = gpu.pci_bus_id.lower()
        domain, _, rest = bus.partition(":")
        try:
            out.append(f"{int(domain, 16):04x}:{rest}")
        except ValueError:
            continue
    try:
        for hca in sorted(os.listdir(SYS_INFINIBAND)):
            out.append(os.path.basename(os.path.realpath(SYS_INFINIBAND / hca / "device")))
    except OSError:
        pass
    return out


def _acs(ctx: CheckContext, sim: dict[str, Any]) -> Result:
    if _virtualized(ctx):
        return ctx.skip(
            "in a VM the PCIe topology and its ACS are the hypervisor's (ACS "
            "is needed there for device assignment)",
            metric="pcie_acs",
        )
    if sim and sim["acs"] is None:
        return ctx.skip(_NOT_RECORDED, metric="pcie_acs")
    if sim:
        on = sorted(sim.get("acs") or [])
        checked = "the stand-in node's bridges"
    else:
        endpoints = _endpoints(ctx)
        if not endpoints:
            return ctx.skip("no GPU or HCA on the PCI bus to look above", metric="pcie_acs")
        if os.geteuid() != 0:
            return ctx.skip(
                "PCIe ACS not read: only root can read a bridge's extended config "
                "space in sysfs (past 64 bytes)",
                metric="pcie_acs",
            )
        bridges = sorted({b for e in endpoints for b in upstream_bridges(e)})
        on, unreadable = [], 0
        for bridge in bridges:
            try:
                config = (SYS_PCI_DEVICES / bridge / "config").read_bytes()
            except OSError:
                unreadable += 1
                continue
            control = acs_control(config)
            if control is not None and control & ACS_P2P_BREAKING:
                on.append(bridge)
        checked = f"{len(bridges)} bridge(s) above {len(endpoints)} GPU(s)/HCA(s)"
        if bridges and unreadable == len(bridges):
            return ctx.skip(
                f"PCIe ACS not read: the config space of {checked} could not be read",
                metric="pcie_acs",
            )
    if not on:
        return ctx.result(
            "node", "pcie_acs", Status.PASS, f"PCIe ACS redirect off on {checked}", value=0
        )
    return ctx.result(
        "node",
        "pcie_acs",
        Status.WARN,
        f"PCIe ACS Request/Completion Redirect on at {', '.join(on[:8])}: expected "
        "off on bare metal, found on; GPU peer-to-peer traffic is sent up to the "
        "root complex (disable ACS in the BIOS, or setpci ECAP_ACS+6.w=0 at boot)",
        value=len(on),
        expected="off",
        found="on",
        bridges=on[:32],
    )


def _persistence(ctx: CheckContext) -> Result:
    off, unread = [], []
    for dev in ctx.gpu.devices():
        try:
            if not dev.persistence_mode():
                off.append(dev.index)
        except GpuError as err:
            unread.append(f"gpu:{dev.index}: {err}")
    if off:
        return ctx.result(
            "node",
            "persistence_mode",
            Status.WARN,
            f"persistence mode off on GPU(s) {', '.join(map(str, off))}: expected "
            "on, found off (nvidia-smi -pm 1 or nvidia-persistenced)",
            value=len(off),
            expected="on",
            found="off",
            gpus=off,
        )
    if unread and len(unread) == len(ctx.gpu.devices()):
        return ctx.skip(f"persistence mode not readable: {unread[0]}", metric="persistence_mode")
    return ctx.result(
        "node", "persistence_mode", Status.PASS, "persistence mode on for every GPU", value=0
    )
