"""``pcie_aer``'s reading of the kernel log: the PCI core's AER messages, attributed through the
PCI tree to the GPU, HCA or NVMe drive they are about.

Firmware-first hosts and VMs have no ``aer_dev_*`` counters, but where the OS owns AER the kernel
prints every error it handles (:mod:`node_agent.host.aer_lines`). A message names the device that
reported it: an endpoint (``nvidia 0000:03:00.0``), or the root or downstream port above it
(``pcieport 0000:00:03.0``), which reports for its link. The tree in sysfs (each function's parent
directory is the bridge above it) says which GPUs (NVML's bus ids), HCAs
(``/sys/class/infiniband/*/device``) and NVMe drives (``/sys/class/nvme/*/device``) sit at or below
that device; where sysfs has no tree (a VM, a saved log) a device is named by its own address, and
by its driver (``nvidia``, ``mlx5_core``, ``nvme``) when it is one of those.

* ``aer_log_uncorrectable`` (target: the device, ``gpu:N``, ``hca:NAME``, ``disk:nvmeN``, else
  ``pci:<bdf>``) — ``fail`` (graded ERROR: drain, reboot, re-test) for an uncorrected fatal error
  at or above it, or an error the kernel could not recover (``can't recover (no error_detected
  callback)``, ``device recovery failed`` on the port above it): the device is off its link until
  a reset. ``warn`` for a non-fatal uncorrected error the kernel recovered, and for a fatal or
  unrecovered one on a device training does not use (a USB or SATA controller: kept visible, no
  drain).
* ``aer_log_correctable_rate`` (same targets) — ``warn`` when corrected errors (bad TLPs and
  DLLPs, receiver errors: replayed by the link layer) exceed ``pcie_aer.correctable_per_hour_max``
  (default 10) per hour over the log's span (an hour at least). Errors in the first minute after
  boot are left out: links that retrain at boot log a burst of receiver errors and settle.
* ``aer_log`` (``node``) — ``pass`` when the log holds no AER message; a ``skip`` where the log
  cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import thresholds
from node_agent.checking.host_log import KernelMessage, kernel_messages
from node_agent.host.aer import PciFunction
from node_agent.host.aer_lines import AER_WORDS, AerLine, parse_aer_message
from node_agent.model import Result, Status

#: the drivers of the devices training uses, for a device sysfs cannot place
DRIVER_KINDS = {"nvidia": "GPU", "mlx5_core": "HCA", "nvme": "NVMe drive"}
#: corrected errors this soon after boot are link training's
BOOT_SETTLE_S = 60.0
HOUR_S = 3600.0


@dataclass
class _Finding:
    """What the log says of one target."""

    fatal: int = 0
    nonfatal: int = 0
    corrected: list[float | None] = field(default_factory=list)  # boot seconds, where known
    unrecovered: list[str] = field(default_factory=list)  # the kernel's words
    via: set[str] = field(default_factory=set)  # the devices whose lines named it
    lines: list[str] = field(default_factory=list)


def _below(functions: list[PciFunction]) -> dict[str, set[str]]:
    """bdf -> every function below it in the tree."""
    parent = {f.bdf: f.upstream for f in functions}
    out: dict[str, set[str]] = {}
    for bdf in parent:
        up = parent.get(bdf)
        seen: set[str] = set()
        while up is not None and up not in seen:
            seen.add(up)
            out.setdefault(up, set()).add(bdf)
            up = parent.get(up)
    return out


def _targets(line: AerLine, named: dict[str, str], below: dict[str, set[str]]) -> list[str]:
    """The targets a line is about: the named device it is, else those below it, else itself."""
    if line.bdf in named:
        return [named[line.bdf]]
    under = sorted(named[b] for b in below.get(line.bdf, ()) if b in named)
    return under or [f"pci:{line.bdf}"]


def _collect(
    messages: list[tuple[KernelMessage, AerLine]],
    named: dict[str, str],
    below: dict[str, set[str]],
) -> dict[str, _Finding]:
    found: dict[str, _Finding] = {}
    for message, line in messages:
        for target in _targets(line, named, below):
            f = found.setdefault(target, _Finding())
            f.via.add(f"{line.driver} {line.bdf}")
            if len(f.lines) < 8:
                f.lines.append(message.text[:200])
            if line.kind == "bus_error" and line.severity == "fatal":
                f.fatal += 1
            elif line.kind == "bus_error" and line.severity == "nonfatal":
                f.nonfatal += 1
            elif line.kind == "bus_error":
                stamp = message.stamp
                f.corrected.append(stamp.seconds if stamp and stamp.clock == "boot" else None)
            elif line.kind in ("cant_recover", "recovery_failed"):
                f.unrecovered.append(f"{line.driver} {line.bdf}: {message.text.split(': ', 1)[-1]}")
    return found


def log_results(
    ctx: CheckContext, functions: list[PciFunction], named: dict[str, str]
) -> list[Result]:
    """The kernel log's AER findings (see the module docstring). ``named``: bdf -> target of
    the GPUs, HCAs and NVMe drives the node has."""
    read = kernel_messages(ctx, AER_WORDS)
    if read.unreadable:
        return [
            ctx.skip(f"the kernel log's AER lines not read: {read.unreadable}", metric="aer_log")
        ]
    lines = [(m, a) for m in read.messages if (a := parse_aer_message(m.text)) is not None]
    if not lines:
        return [
            ctx.result(
                "node",
                "aer_log",
                Status.PASS,
                f"no PCIe AER message in the kernel log ({read.source})",
                value=0,
                unit="lines",
            )
        ]
    limit = thresholds(ctx, "pcie_aer")["correctable_per_hour_max"]
    kinds = {bdf: line.driver for _m, line in lines for bdf in [line.bdf]}
    results: list[Result] = []
    for target, f in sorted(_collect(lines, named, _below(functions)).items()):
        results.extend(_judge(ctx, target, f, kinds, limit))
    if not results:
        results.append(
            ctx.result(
                "node",
                "aer_log",
                Status.PASS,
                f"{len(lines)} PCIe AER message(s) in the kernel log ({read.source}), none an "
                "uncorrected error and corrected ones under the rate",
                value=len(lines),
                unit="lines",
            )
        )
    return results


def _used(target: str, kinds: dict[str, str]) -> bool:
    """Whether a target is a device training uses: a GPU, an HCA, an NVMe drive, or a device
    sysfs could not place whose driver is one of theirs."""
    if not target.startswith("pci:"):
        return True
    return kinds.get(target[4:]) in DRIVER_KINDS


def _judge(
    ctx: CheckContext, target: str, f: _Finding, kinds: dict[str, str], limit: float
) -> list[Result]:
    used = _used(target, kinds)
    what = (
        target
        if used or not target.startswith("pci:")
        else f"{target} ({kinds.get(target[4:], 'no driver named')})"
    )
    evidence: dict[str, Any] = {
        "reported_by": sorted(f.via),
        "fatal": f.fatal,
        "nonfatal": f.nonfatal,
        "corrected": len(f.corrected),
        "unrecovered": f.unrecovered[:4],
        "lines": f.lines,
        "source": "kernel log",
    }
    results: list[Result] = []
    if f.fatal or f.unrecovered:
        why = (
            f"the kernel could not recover it ({f.unrecovered[0]})"
            if f.unrecovered
            else f"{f.fatal} fatal uncorrected error(s)"
        )
        results.append(
            ctx.result(
                target,
                "aer_log_uncorrectable",
                Status.FAIL if used else Status.WARN,
                f"PCIe AER in the kernel log on {what} (reported by {', '.join(sorted(f.via))}): "
                f"{why}"
                + (
                    "; it is off its link until a reset: drain, reboot and re-test, reseat or "
                    "replace if it recurs"
                    if used
                    else "; not a device training uses, so no drain: have it looked at"
                ),
                value=f.fatal + len(f.unrecovered),
                unit="errors",
                **evidence,
            )
        )
    elif f.nonfatal:
        results.append(
            ctx.result(
                target,
                "aer_log_uncorrectable",
                Status.WARN,
                f"PCIe AER in the kernel log on {what}: {f.nonfatal} non-fatal uncorrected "
                "error(s) the kernel recovered (a transaction was lost while the link stayed up)",
                value=f.nonfatal,
                unit="errors",
                **evidence,
            )
        )
    rate, basis = _rate(f.corrected)
    if rate > limit:
        results.append(
            ctx.result(
                target,
                "aer_log_correctable_rate",
                Status.WARN,
                f"PCIe AER in the kernel log on {what}: {rate:.0f} corrected errors per hour "
                f"({basis}), over {limit:g} (graders/host.yaml pcie_aer.correctable_per_hour_max):"
                " a link that keeps replaying (riser, slot, retimer, cable)",
                value=round(rate, 1),
                unit="errors/h",
                limit=limit,
                **evidence,
            )
        )
    return results


def _rate(times: list[float | None]) -> tuple[float, str]:
    """Corrected errors per hour, leaving out the first minute after boot: over their span
    where their boot times are known and span an hour or more, else their count."""
    kept = [t for t in times if t is None or t >= BOOT_SETTLE_S]
    known = [t for t in kept if t is not None]
    if len(known) == len(kept) and len(known) > 1 and max(known) - min(known) > HOUR_S:
        span = max(known) - min(known)
        return len(kept) * HOUR_S / span, f"{len(kept)} in {span / HOUR_S:.1f} h"
    skipped = len(times) - len(kept)
    return float(len(kept)), f"{len(kept)} in the log" + (
        f", {skipped} in the first minute after boot left out" if skipped else ""
    )
