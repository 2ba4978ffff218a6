"""What a check is handed: ``CheckContext`` (the node's hardware behind its interfaces, its
ports, its parameters) and the results it makes with it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.checking.deadline import return_margin_s
from node_agent.checking.params import P
from node_agent.checking.ports import Ports
from node_agent.config import Config
from node_agent.gpu.base import GpuBackend
from node_agent.gpu.pci import PciBus
from node_agent.hardware.sku import Sku
from node_agent.inventory import Inventory
from node_agent.kernel_log import KernelLog
from node_agent.model import Result, Status

#: this host's ports: the default of a CheckContext given none
HOST_PORTS = Ports()


@dataclass
class CheckContext:
    """What a check may use: the node's hardware behind its interfaces, and its parameters."""

    check: str
    gpu: GpuBackend
    kernel_log: KernelLog
    config: Config
    inventory: Inventory
    sku: Sku | None
    expected_gpus: int | None
    mode: str = "delivery"  # delivery | service
    params: dict[str, Any] = field(default_factory=dict)
    state_dir: Path | None = None  # writable directory for cursors, or None
    timeout_s: float = 60.0  # the spec's; the runner abandons the check at ``deadline``
    #: the monotonic time by which the check must have returned: the runner's (``run_check``,
    #: its start plus ``timeout_s``), which abandons the check there; a context made by hand (as
    #: unit tests do) gets its creation plus ``timeout_s``. Bound waits by ``stage_end()``
    deadline: float = 0.0
    #: where the check reads the node (trees, tools, compute, clock), chosen once with the node
    #: (``open_environment``); this host's unless given
    ports: Ports = field(default=HOST_PORTS, repr=False)
    #: the values this check's declared inputs (``INPUTS``) receive from earlier checks of the
    #: run, and where its declared outputs (``OUTPUTS``) go; read and written only through
    #: ``behaviour.get_input`` / ``put_output``
    handover: dict[str, Any] = field(default_factory=dict)
    #: the NVIDIA GPUs on the PCI bus; read on first use (``pci_bus()``) unless given
    pci: PciBus | None = field(default=None, repr=False)
    #: ``params`` parsed through the check's ``Params`` at the suite's load (checking/params.py)
    typed: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.deadline:
            self.deadline = time.monotonic() + self.timeout_s

    def stage_end(self, margin_s: float | None = None) -> float:
        """The monotonic time by which a stage of the check (a subprocess, a wait) must end for
        the check to report and return before its ``deadline``: ``margin_s`` before it, by
        default :func:`~node_agent.checking.deadline.return_margin_s` of the timeout."""
        return self.deadline - (return_margin_s(self.timeout_s) if margin_s is None else margin_s)

    def remaining_s(self, margin_s: float | None = None) -> float:
        """Seconds left until :meth:`stage_end` (``margin_s=0``: until the deadline), never
        below 0: the timeout to give a subprocess that must end before the check does."""
        return max(0.0, self.stage_end(margin_s) - time.monotonic())

    def typed_params(self, cls: type[P]) -> P:
        """This check's typed parameters: those the suite's load parsed, or (a context made by
        hand, as unit tests do) ``params`` parsed now; ValueError names a bad key."""
        if isinstance(self.typed, cls):
            return self.typed
        return cls.parse(self.params)

    def result(
        self,
        target: str,
        metric: str,
        status: Status,
        detail: str,
        value: Any = None,
        unit: str = "",
        **evidence: Any,
    ) -> Result:
        return Result(
            check=self.check,
            target=target,
            metric=metric,
            status=status,
            detail=detail,
            value=value,
            unit=unit,
            evidence=evidence,
        )

    def skip(self, reason: str, target: str = "node", metric: str = "ran") -> Result:
        return self.result(target, metric, Status.SKIP, reason)

    def pci_bus(self) -> PciBus:
        """The NVIDIA GPUs on the node's PCI bus (``ports.pci_bus``: this host's sysfs, or a
        stand-in's tree), read once per check."""
        if self.pci is None:
            self.pci = self.ports.pci_bus()
        return self.pci

    def gpus_unavailable(self) -> list[Result] | None:
        """For GPU checks: None when GPUs can be queried; otherwise the one result that says
        why, judged with the PCI bus: ``skip`` on a host with no NVIDIA GPU on it;
        ``driver_not_loaded`` (error) when GPUs are on the bus but no NVIDIA driver holds
        them; ``gpu_backend`` (error) when the driver is there but NVML is broken. A node
        whose GPUs are on the bus but unusable never reads as a pass or a skip."""
        reason = self.gpu.unavailable_reason
        if not reason:
            return None
        bus = self.pci_bus()
        gpus = bus.host_gpus
        evidence: dict[str, Any] = {"pci_gpus": [g.to_dict() for g in bus.gpus], "nvml": reason}
        if gpus and not any(g.driver == "nvidia" for g in gpus):
            # the two checks every suite starts with explain it; the others say it briefly
            detail = (
                driver_not_loaded_detail(reason, gpus)
                if self.check in ("inventory", "nvml_health")
                else f"cannot run {self.check}: {len(gpus)} NVIDIA GPU(s) on the PCI bus but "
                "the NVIDIA kernel driver is not loaded (`dmesg | grep -i nvrm`; build it "
                "for the running kernel, `modprobe nvidia`)"
            )
            return [
                self.result(
                    "node",
                    "driver_not_loaded",
                    Status.ERROR,
                    detail,
                    value=len(gpus),
                    unit="GPUs",
                    **evidence,
                )
            ]
        if gpus:
            return [
                self.result(
                    "node",
                    "gpu_backend",
                    Status.ERROR,
                    f"{len(gpus)} NVIDIA GPU(s) on the PCI bus are bound to the nvidia "
                    f"driver, but NVML cannot be used: {reason}",
                    **evidence,
                )
            ]
        if self.gpu.broken:
            return [self.result("node", "gpu_backend", Status.ERROR, reason, **evidence)]
        where = (
            "no NVIDIA GPU on the PCI bus"
            if bus.unreadable is None
            else f"the PCI bus could not be read: {bus.unreadable}"
        )
        return [self.skip(f"{reason}; {where}")]

    def compute_unavailable(self, reason: str) -> list[Result]:
        """For compute checks on a node whose GPUs are there but cannot be computed on (no
        torch, a CPU-only torch, CUDA not seeing the GPUs): at delivery an ``error`` — a node
        is not accepted without its load tests — and in service a ``skip`` with the reason."""
        if self.mode == "delivery":
            return [
                self.result(
                    "node",
                    "compute",
                    Status.ERROR,
                    f"cannot run {self.check} on this node's GPUs: {reason}",
                )
            ]
        return [self.skip(reason, metric="compute")]


def driver_not_loaded_detail(reason: str, gpus: tuple[Any, ...]) -> str:
    """What the operator reads when GPUs are on the PCI bus but no NVIDIA driver holds them."""
    shown = ", ".join(g.describe() for g in gpus[:4]) + (", ..." if len(gpus) > 4 else "")
    nouveau = any(g.driver == "nouveau" for g in gpus)
    advice = (
        "the open-source nouveau driver holds them: blacklist it "
        "(modprobe.d: blacklist nouveau), rebuild the initramfs and reboot"
        if nouveau
        else "check `dmesg | grep -i nvrm` for why nvidia.ko did not load; after a kernel "
        "update, build the driver for the running kernel (`dkms status`, `uname -r`, "
        "`dkms autoinstall`); then `modprobe nvidia` (or reboot) and re-test"
    )
    return (
        f"{len(gpus)} NVIDIA GPU(s) on the PCI bus ({shown}) but the NVIDIA kernel driver "
        f"(nvidia.ko) is not loaded or holds none of them, so no GPU can be used: "
        f"{advice} [NVML: {reason}]"
    )
