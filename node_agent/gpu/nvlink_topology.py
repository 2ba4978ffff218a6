"""Which NVLink judgments apply to this host, decided once from NVML's own answers.

Every NVLink, fabric and IMEX judgment asks here first; one that does not apply is a skip that
says why (:attr:`Applicability.why`), never a finding. The kinds, from NVML's answers alone:

- ``multi_node``: the fabric answers and its ClusterUUID is not zero (GB200/GB300 NVL72 trays:
  the NVLink domain spans trays through NVSwitch trays; IMEX shares memory across them);
- ``nvswitch``: the fabric answers with a zero ClusterUUID (an HGX board whose NVSwitches are its
  own: the fabric manager registers its GPUs, but no multi-node domain exists);
- ``nvlink``: links answer and are usable, no fabric (direct NVLink pairs, bridges, and
  NVSwitch boards older than Hopper, which report no fabric);
- ``hidden``: NVML answers for no link index at all on a virtualized GPU (a pass-through or
  vGPU guest that does not see what sits behind the hypervisor);
- ``pcie``: NVML answers for no usable link on bare metal (PCIe only).

The virtualization mode only names *why* links are missing; it never decides by itself: the
real GB200 tray on AWS p6e is a pass-through VM whose fabric answers Completed, clique 2.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node_agent.gpu.base import (
    GpuBackend,
    GpuDevice,
    GpuError,
    GpuFabric,
    NotSupported,
    NvLink,
)
from node_agent.gpu.nvml_calls import ERROR_NAMES

MULTI_NODE = "multi_node"
NVSWITCH = "nvswitch"
NVLINK = "nvlink"
HIDDEN = "hidden"
PCIE = "pcie"
#: the node could not be asked (no GPU, no driver, a broken driver)
UNKNOWN = "unknown"
#: most NVLink first: a node is the most NVLink any of its GPUs shows
KINDS = (MULTI_NODE, NVSWITCH, NVLINK, HIDDEN, PCIE, UNKNOWN)


@dataclass(frozen=True)
class Applicability:
    """What NVLink a GPU (or the node) has, and why that was decided."""

    kind: str
    why: str
    cluster_uuid: str | None = None
    clique_id: int | None = None

    @property
    def multi_node(self) -> bool:
        """Multi-node NVLink (fabric, IMEX and the domain's judgments apply)."""
        return self.kind == MULTI_NODE

    @property
    def fabric(self) -> bool:
        """The GPUs report an NVLink fabric (multi-node or an HGX board's own NVSwitches)."""
        return self.kind in (MULTI_NODE, NVSWITCH)

    @property
    def nvlink(self) -> bool:
        """NVLink is there to judge (any kind with links the host sees)."""
        return self.kind in (MULTI_NODE, NVSWITCH, NVLINK)


def classify(
    links: list[NvLink] | None, fabric: GpuFabric | None, mode: str = "none"
) -> Applicability:
    """One GPU's NVLink from its answers: ``links`` as ``nvlinks()`` answered (None: not
    asked or failed), ``fabric`` as ``fabric()`` answered (None: Not Supported or not asked),
    ``mode`` its virtualization mode (``"none"``: bare metal or not answered)."""
    if fabric is not None and fabric.state != "not_supported":
        if fabric.in_domain:
            return Applicability(
                MULTI_NODE,
                f"multi-node NVLink: the fabric reports ClusterUUID {fabric.cluster_uuid}, "
                f"clique {fabric.clique_id}",
                fabric.cluster_uuid,
                fabric.clique_id,
            )
        return Applicability(
            NVSWITCH,
            "single-node NVSwitch: the fabric answers with a zero ClusterUUID (no multi-node "
            "NVLink domain: IMEX and the domain's judgments do not apply)",
        )
    usable = [link for link in links or [] if link.p2p_supported is not False]
    if usable:
        active = sum(link.active for link in usable)
        return Applicability(
            NVLINK,
            f"NVLink without a fabric: {len(usable)} links answer ({active} active) and no "
            "fabric is reported (direct NVLink, a bridge, or NVSwitches before Hopper): no "
            "multi-node NVLink domain",
        )
    if links is None:
        return Applicability(UNKNOWN, "NVML did not answer for the GPU's NVLinks")
    if not links and mode != "none":
        return Applicability(
            HIDDEN,
            "NVLinks are not exposed to this host: NVML answers for none of them and reports "
            f"no fabric, and the GPU is virtualized ({mode}): what sits behind the hypervisor "
            "is not this host's to see",
        )
    return Applicability(
        PCIE,
        "PCIe only: NVML answers for no NVLink this GPU can use and reports no fabric",
    )


def node(per_gpu: list[Applicability]) -> Applicability:
    """The node's kind: the most NVLink any GPU shows (a GPU of a tray that lost its fabric
    is still on a multi-node tray); UNKNOWN where there is no GPU."""
    if not per_gpu:
        return Applicability(UNKNOWN, "no GPU to ask about NVLink")
    return min(per_gpu, key=lambda a: KINDS.index(a.kind))


def read_fabric(dev: GpuDevice) -> GpuFabric | None:
    """The GPU's fabric, or None where NVML reports none (Not Supported), or where the device
    predates the reading (a GpuDevice written before ``fabric()``: it reports no fabric)."""
    query = getattr(dev, "fabric", None)
    if query is None:
        return None
    try:
        fabric: GpuFabric = query()
    except NotSupported:
        return None
    return fabric


def gpu_applicability(dev: GpuDevice) -> Applicability:
    """One GPU's NVLink, asked of the backend (its fabric, links and virtualization mode)."""
    try:
        fabric = read_fabric(dev)
    except GpuError as err:
        fabric = None
        failed = f"the fabric query failed: {err}"
    else:
        failed = ""
    if fabric is not None:
        return classify(None, fabric)
    try:
        links: list[NvLink] | None = dev.nvlinks()
    except NotSupported:
        links = []
    except GpuError as err:
        return Applicability(UNKNOWN, f"NVML did not answer for the NVLinks: {err}; {failed}")
    mode = "none"
    if not links:
        try:
            mode = dev.virtualization_mode()
        except GpuError:
            mode = "none"
    return classify(links, None, mode)


def nvlink_applicability(backend: GpuBackend) -> Applicability:
    """The node's NVLink, from every GPU's answers (see the module docstring). ``.multi_node``
    says whether multi-node NVLink judgments (fabric, IMEX, the domain) apply; ``.why`` says
    why, for the skip of a judgment that does not."""
    if backend.unavailable_reason:
        return Applicability(UNKNOWN, f"no GPU to ask: {backend.unavailable_reason}")
    try:
        devices = backend.devices()
    except GpuError as err:
        return Applicability(UNKNOWN, f"the GPUs could not be listed: {err}")
    return node([gpu_applicability(dev) for dev in devices])


def tray_domain(fabrics: Mapping[int, GpuFabric]) -> tuple[str, int] | None:
    """The tray's NVLink domain (ClusterUUID, CliqueID): the one most of its GPUs in a domain
    report (the lowest GPU's on a tie), so a GPU in another clique stands out; None where no
    GPU is in a multi-node domain."""
    members = [
        (i, (f.cluster_uuid, f.clique_id)) for i, f in sorted(fabrics.items()) if f.in_domain
    ]
    if not members:
        return None
    counts = Counter(domain for _, domain in members)
    best = max(counts.values())
    return next(domain for _, domain in members if counts[domain] == best)


def status_name(status: int) -> str:
    """The fabric probe's ``nvmlReturn_t`` as NVML (and nvidia-smi) word it: ``Success``."""
    return "Success" if status == 0 else ERROR_NAMES.get(status, f"NVML error {status}")


def fabric_dict(fabric: GpuFabric | None) -> dict[str, Any] | None:
    """A GPU's fabric in the report's inventory (``gpus[i].fabric``; fleet/domains.py reads
    these keys): state, status, cluster_uuid, clique_id, health; None where there is none."""
    if fabric is None:
        return None
    return {
        "state": fabric.state,
        "status": status_name(fabric.status),
        "cluster_uuid": fabric.cluster_uuid,
        "clique_id": fabric.clique_id,
        "health": fabric.health,
    }
