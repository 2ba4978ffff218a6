"""The ports a check reads the node through, chosen once per invocation.

``open_environment`` opens the node (this host, or a stand-in) and hands every check
the same :class:`Ports`: where the host checks read sysfs, procfs and their tools, where the
RDMA checks find the HCAs and ``ib_write_bw``, whether DCGM can be asked, where compute runs and
whether its figures are measured (SKU minima apply) or modelled, what a stand-in host declares
about itself, extra kernel-log records and pstore dumps, the software a stand-in declares, the
PCI bus, the clock. A check asks its port and never whether the node is a stand-in: the same
code reads a stand-in's tree and the host's.

``Ports()`` is this host's; a stand-in node builds its own (``node_agent.sim.node``). Ports that cost
something to build (a temporary sysfs tree, a perftest stand-in) are context managers built on
use and removed when the check leaves them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from node_agent.checking.child import HOST, NodeSpec
from node_agent.compute.devices import ComputeSource
from node_agent.gpu.pci import PciBus
from node_agent.host.paths import HostPaths
from node_agent.inventory import read_pci_bus
from node_agent.kernel_log import LogRecord

__all__ = [
    "DeclaredHost",
    "Ports",
    "PstoreView",
    "RdmaView",
    "StandInSoftware",
]

#: the skip reason of a check whose part of the node a capture did not record
CAPTURE_HOST_UNRECORDED = (
    "the captured node's host hardware (EDAC, PSUs, AER, NVMe, CPUs) was "
    "not recorded; only its GPUs and PCI bus replay"
)
CAPTURE_PSTORE_UNRECORDED = (
    "pstore was not recorded by this capture (node-agent capture keeps "
    "NVML, the PCI bus and the kernel log)"
)
#: why a stand-in node has no DCGM to ask
STAND_IN_NO_DCGM = "stand-in node: DCGM is not modelled (the NVML checks see the injected faults)"


@dataclass(frozen=True)
class RdmaView:
    """Where the RDMA checks read: the ``/sys/class/infiniband`` tree, the ``ib_write_bw`` to
    run (None: the one on PATH), and the node's uptime in seconds (None: read ``/proc/uptime``).
    ``absent`` says why the node has no HCA to read at all (the checks skip with it)."""

    sysfs_root: Path
    ib_write_bw: str | None = None
    uptime_s: float | None = None
    absent: str | None = None


@dataclass(frozen=True)
class PstoreView:
    """The pstore directories to read and, where they are not the host's, what to call them."""

    roots: tuple[Path, ...]
    label: str | None = None


@dataclass(frozen=True)
class DeclaredHost:
    """What a stand-in host declares about itself where the config declares nothing (the
    host checks' expected memory and CPUs), and who declares it (for the detail)."""

    memory_gib: float
    cpus: int
    declared_by: str = "the stand-in host"


@dataclass(frozen=True)
class StandInSoftware:
    """The host software a stand-in declares (``software_drift``). ``values`` holds
    ``kernel``, ``nccl``, ``peermem``, ``fabricmanager`` and ``acs`` where declared: a key
    absent means "read this host's", a key set to None means "not recorded" (a skip)."""

    values: Mapping[str, Any]
    hcas: tuple[str, ...] = ()
    virtualized: bool = False
    source: str = "the stand-in node"


def _no_load_hint(indices: list[int], active: bool) -> None:
    """Real GPUs report their own state under load: nothing to tell them."""


def _no_records(start_seq: int) -> list[LogRecord]:
    """This host's kernel log is all there is."""
    return []


@dataclass(frozen=True)
class Ports:
    """What a check reads the node through. ``Ports()`` is this host's: every tree None (the
    host's own roots, or a test's ``params``), compute measured on the node's GPUs."""

    #: builds the host tree of ``parts`` (edac, memory, cpu, pci, nvme, ipmi) for one check;
    #: None: the host's own ``/sys``, ``/proc``, ``/dev`` and the configured tools
    host_tree: Callable[[tuple[str, ...]], contextlib.AbstractContextManager[HostPaths]] | None = (
        None
    )
    #: why the host checks cannot judge this node's host hardware (a capture did not record
    #: it): they skip with it. None: they read it
    host_unrecorded: str | None = None
    #: builds the RDMA view at a Unix time; None: the host's ``/sys/class/infiniband``
    rdma_tree: Callable[[float], contextlib.AbstractContextManager[RdmaView]] | None = None
    #: why there is no DCGM to ask (the DCGM checks skip with it); None: ask this host's
    dcgm_absent: str | None = None
    #: where compute runs, and whether its figures are measured or modelled
    compute: ComputeSource = field(default_factory=ComputeSource)
    #: a stand-in host's own memory and CPUs (None: only the config declares them)
    declared_host: DeclaredHost | None = None
    #: kernel-log records beyond the log's own (a stand-in's machine checks), numbered from
    #: the given sequence number
    extra_kernel_records: Callable[[int], list[LogRecord]] = _no_records
    #: where machine checks are read besides the kernel log: True for rasdaemon's records
    rasdaemon: bool = True
    #: builds the pstore view; None: the host's pstore (and systemd-pstore's archive)
    pstore_tree: Callable[[], contextlib.AbstractContextManager[PstoreView]] | None = None
    #: why pstore cannot be judged (not recorded); None: it is read
    pstore_unrecorded: str | None = None
    #: the host software a stand-in declares; None: this host's, read by the check
    software: StandInSoftware | None = None
    #: who declares the node's GPU count besides the config: "scenario" (a modelled stand-in's
    #: count is its own), "capture" (what a recorded host showed), None (the SKU's)
    gpu_count_from: Literal["scenario", "capture"] | None = None
    #: the NVIDIA GPUs on the PCI bus (read on use)
    pci_bus: Callable[[], PciBus] = read_pci_bus
    #: why a kernel log's PCI bus ids cannot be checked against this host's sysfs (None: they
    #: can be, where the log is this host's live one)
    bus_ids_as_printed: str | None = None
    #: how a check child opens this same node (checking/child.py); ``open_environment``
    #: sets it from ``Node.spec``
    node: NodeSpec = HOST
    #: tells the GPUs' model that compute load started or stopped (a no-op on real GPUs)
    load_hint: Callable[[list[int], bool], None] = _no_load_hint
    #: the wall clock, Unix seconds
    clock: Callable[[], float] = time.time
