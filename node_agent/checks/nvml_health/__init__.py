"""Check ``nvml_health``: passive health of every GPU as NVML reports it (no load applied).

GPU count vs expected; the PCI bus vs what NVML enumerates; ECC (volatile and aggregate, SRAM
vs DRAM, the driver's SRAM threshold flag); retired pages; row remapping; PCIe link; clock-event
(throttle) reasons; temperature and power; persistence mode; the driver's recovery action;
NVLink state and error counters. Thresholds come from NVML itself where it reports them
(temperatures) and from the SKU file otherwise.

NVLink expectations come from ``node.expected_nvlinks``, else the SKU file (``nvlink.links``;
0 for PCIe cards, whose bridge is optional), else from the links the GPU says it can use (an
index whose state answers and that does not deny P2P capability). A PCIe card answers for its
die's link indices whether or not a bridge is fitted, so without a SKU file an inactive link is
a WARN (a down link cannot be told from an unwired one), never a FAULT.

Judgments fit the host (``checking/host_view.py``, docs/hosts.md): inside a VM the SKU's GPU
count and NVLinks are the board's, not the VM's. Fewer GPUs than the SKU's count in a VM, with
nothing declared and no trace of a lost GPU, is a WARN naming ``node.expected_gpus``; NVLinks
NVML does not answer for on a virtualized GPU are a skip with the reason. A FAULT needs
positive evidence of a broken part: a link NVML reports down, a GPU the bus or the kernel log
shows lost.

In the daemon the readings are exported by the check's collector,
:class:`node_agent.checks.nvml_health.metrics.NvmlReadings`.

Params (:class:`Params`): ``under_load`` (false: an idle GPU lowers its PCIe generation to save
power, so the generation is judged only where a suite runs this check during a load).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from node_agent import model
from node_agent.checking import host_view
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checks.nvml_health.links import fabric_wide_loss, nvlink
from node_agent.checks.nvml_health.metrics import NvmlReadings
from node_agent.gpu.base import (
    DeviceLost,
    EccCounts,
    GpuDevice,
    GpuError,
    GpuTimeout,
    NoPermission,
    NotSupported,
)
from node_agent.gpu.pci import PciBus, PciGpu, compare
from node_agent.gpu.throttle import ABNORMAL_THROTTLE
from node_agent.model import Result, Status

# Recovery actions that ask for a reset or reboot (nvmlGpuRecoveryAction_t).
_RESET_ACTIONS = {
    "gpu_reset",
    "node_reboot",
    "drain_and_reset",
    "bus_reset",
    "system_reboot",
    "drain_p2p",
    "recover_imex_domain",
}


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    under_load: bool = False  # the check runs while the GPUs are loaded: judge the PCIe gen

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        return cls(under_load=Reader("nvml_health", raw, cls).flag("under_load"))


#: a reading at the shutdown threshold is read this many more times, this far apart, and is a
#: failure only if most readings are: one sample at a spike or a sensor's glitch had asked for
#: the node's replacement
SHUTDOWN_REREADS = 2
SHUTDOWN_REREAD_S = 0.5

#: ``reading(metric, query)``: the query's value, or None after recording why there is none
_Reading = Callable[[str, Callable[[], Any]], Any]


class _Abort(Exception):
    """The GPU stopped answering; the remaining readings of it are pointless."""

    def __init__(self, result: Result) -> None:
        self.result = result


def run(ctx: CheckContext) -> list[Result]:
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return unavailable
    results = [_gpu_count(ctx), *_pci_bus(ctx)]
    for device in ctx.gpu.devices():
        results.extend(_check_gpu(ctx, device))
    return fabric_wide_loss(ctx, results)


def _expected_gpus(ctx: CheckContext) -> tuple[int | None, str]:
    """The GPU count to expect and where it comes from. An add-in card SKU
    (``gpus_per_node_fixed: false``) fixes no count: servers carry 1 to 8 of them, so its
    ``gpus_per_node`` (the common full build) is not held against a smaller server; the PCI
    bus comparison still names a GPU the driver lost."""
    expected = ctx.expected_gpus
    sku = ctx.sku
    if (
        sku is not None
        and not sku.fixed_gpu_count
        and ctx.ports.gpu_count_from is None
        and ctx.config.node.expected_gpus is None
    ):
        return None, (
            f"SKU {sku.id} is an add-in card whose count is the server's build; set "
            "node.expected_gpus to check it"
        )
    if expected is None:
        return None, "no SKU file or node.expected_gpus"
    return expected, ""


def _gpu_count(ctx: CheckContext) -> Result:
    seen = len(ctx.gpu.devices())
    expected, why_none = _expected_gpus(ctx)
    visible = [d.index for d in ctx.gpu.devices()]
    bus = ctx.pci_bus()
    on_bus = None if bus.unreadable else len(bus.host_gpus)
    if expected is None:
        return _count_result(
            ctx,
            Status.PASS,
            f"{seen} GPUs visible (no expected count: {why_none}; "
            f"{on_bus if on_bus is not None else '?'} on the PCI bus)",
            seen,
            {"visible": visible, "pci_gpus": on_bus},
        )
    # a GPU handed to a VM (vfio-pci) is the VM's, not a GPU the host lost
    handed = 0 if bus.unreadable else len(bus.gpus) - len(bus.host_gpus)
    note = f" ({handed} more handed to a VM)" if handed else ""
    expected = max(expected - handed, 0)
    declared = ctx.config.node.expected_gpus is not None
    # a modelled scenario's count is the node's own, as a declared one is; a captured node's is
    # only what the recorded host showed, so it is judged as that host would be
    modelled = ctx.ports.gpu_count_from == "scenario"
    evidence: dict[str, Any] = {
        "expected": expected,
        "visible": visible,
        "pci_gpus": on_bus,
        "passthrough": handed,
        "expected_from": (
            "node.expected_gpus"
            if declared
            else "scenario"
            if modelled
            else f"SKU {ctx.sku.id}"
            if ctx.sku
            else None
        ),
    }
    if seen < expected:
        elsewhere = [] if bus.unreadable else [g for g in bus.host_gpus if g.bound_elsewhere]
        stuck = _on_the_bus_not_initialised(ctx, bus)
        if (elsewhere or stuck) and seen + len(elsewhere) + len(stuck) >= expected:
            kinds = []
            if elsewhere:
                held = ", ".join(g.describe() for g in elsewhere)
                kinds.append(f"held by another driver ({held}; gpu_bound_elsewhere)")
            if stuck:
                ids = ", ".join(g.bus_id for g in stuck)
                kinds.append(f"not initialised by the driver ({ids}; gpu_not_enumerated)")
            return _count_result(
                ctx,
                Status.WARN,
                f"{seen} of {expected} expected GPUs visible{note}; the rest are on the PCI bus, "
                f"{' and '.join(kinds)}: not lost, graded there",
                seen,
                evidence,
            )
        if not declared and not modelled:
            in_vm = _count_in_a_vm(ctx, seen, expected, evidence)
            if in_vm is not None:
                return in_vm
        return _count_result(
            ctx,
            Status.FAIL,
            f"{seen} of {expected} expected GPUs visible{note} (visible indices "
            f"{visible}); a missing GPU has fallen off the bus or is not powered",
            seen,
            evidence,
        )
    if seen > expected:
        return _count_result(
            ctx,
            Status.WARN,
            f"{seen} GPUs visible, {expected} expected{note}: check node.expected_gpus",
            seen,
            evidence,
        )
    return _count_result(
        ctx, Status.PASS, f"{seen} of {expected} GPUs visible{note}", seen, evidence
    )


def _on_the_bus_not_initialised(ctx: CheckContext, bus: PciBus) -> list[PciGpu]:
    """The NVIDIA GPUs on the PCI bus, bound to no other driver, that NVML does not list."""
    if bus.unreadable or ctx.inventory is None:
        return []
    ids = [g.pci_bus_id for g in ctx.inventory.gpus]
    found = compare(bus, ids, unidentified=len(ctx.inventory.unreadable))
    return [g for g in found.not_enumerated if not g.bound_elsewhere]


def _count_result(
    ctx: CheckContext, status: Status, detail: str, seen: int, evidence: dict[str, Any]
) -> Result:
    return ctx.result("node", "gpu_count", status, detail, value=seen, unit="GPUs", **evidence)


def _count_in_a_vm(
    ctx: CheckContext, seen: int, expected: int, evidence: dict[str, Any]
) -> Result | None:
    """Fewer GPUs than the SKU's count, nothing declared: inside a VM
    (NVML virtualization mode pass-through or vGPU) the count is the VM's slice of the board,
    not a lost GPU, unless something shows one was lost. A WARN naming node.expected_gpus then;
    None (the count is a FAIL as on bare metal) on bare metal or with a trace of a lost GPU."""
    view = host_view.read_host_view(ctx.gpu.devices())
    if not view.guest:
        return None
    lost = host_view.lost_gpu_traces(ctx)
    evidence = {**evidence, "virtualization": view.modes, "lost_gpu_traces": lost.traces}
    modes = ", ".join(view.guest_modes)
    if lost.traces:
        return _count_result(
            ctx,
            Status.FAIL,
            f"{seen} of {expected} expected GPUs visible in this VM (NVML "
            f"virtualization mode {modes}), and a GPU was lost: " + "; ".join(lost.traces),
            seen,
            evidence,
        )
    looked = "; ".join(lost.looked_at) or "neither the PCI bus nor the kernel log could be read"
    return _count_result(
        ctx,
        Status.WARN,
        f"{seen} of {expected} GPUs visible, {expected} being the count per node of "
        f"{evidence['expected_from']}, and this host is a virtual machine (NVML "
        f"virtualization mode {modes}): that count is the whole board's, not this VM's "
        "share of it. Nothing shows a lost GPU "
        f"({looked}). Set node.expected_gpus to the number of GPUs this VM should have to "
        "check its count",
        seen,
        evidence,
    )


def _pci_bus(ctx: CheckContext) -> list[Result]:
    """Every NVIDIA GPU on the PCI bus (not handed to a VM) must be one NVML enumerates."""
    bus = ctx.pci_bus()
    if bus.unreadable:
        return [
            ctx.result(
                "node",
                "gpu_not_enumerated",
                Status.SKIP,
                f"PCI bus not compared with NVML: {bus.unreadable}",
            )
        ]
    inv = ctx.inventory
    found = compare(bus, [g.pci_bus_id for g in inv.gpus], unidentified=len(inv.unreadable))
    evidence: dict[str, Any] = {
        "pci_gpus": len(bus.gpus),
        "nvml_gpus": len(ctx.gpu.devices()),
        "passthrough": [g.bus_id for g in found.passthrough],
    }
    if not found.not_enumerated:
        return [
            ctx.result(
                "node",
                "gpu_not_enumerated",
                Status.PASS,
                f"all {len(bus.host_gpus)} NVIDIA GPU(s) on the PCI bus are enumerated by NVML",
                value=0,
                unit="GPUs",
                **evidence,
            )
        ]
    out = []
    none_listed = not ctx.gpu.devices()
    for gpu in found.not_enumerated:
        metric = "gpu_not_enumerated"
        if gpu.bound_elsewhere:
            metric, status = "gpu_bound_elsewhere", Status.FAIL
            detail = (
                f"NVIDIA GPU {gpu.describe()}: another driver holds it, so the NVIDIA "
                "driver cannot, and training cannot use it. A configuration matter, not "
                "the GPU's: blacklist that driver (e.g. `modprobe.blacklist=nouveau`), "
                "rebuild the initramfs and reboot"
            )
        elif none_listed:
            status = Status.ERROR
            detail = (
                f"NVIDIA GPU {gpu.describe()} is on the PCI bus, but the driver "
                f"initialised none of the {len(bus.host_gpus)} GPU(s) there: a driver or "
                "firmware problem (GSP firmware, driver/VBIOS mismatch) is likelier than "
                "that many failed GPUs; check `dmesg | grep -i nvrm` (RmInitAdapter), "
                "reinstall the driver for the running kernel, reboot and re-test"
            )
        else:
            status = Status.FAIL
            detail = (
                f"NVIDIA GPU {gpu.describe()} is on the PCI bus but NVML does not "
                "enumerate it: the driver could not initialise it (see `dmesg | grep -i "
                f"nvrm` for {gpu.bus_id[:-2]}: RmInitAdapter failed, fallen off the bus); "
                "a power cycle re-initialises it; reseat or replace the GPU if it stays"
                + (
                    f" ({found.unidentified} enumerated GPU(s) could not be identified "
                    "and may be among these)"
                    if found.unidentified
                    else ""
                )
            )
        out.append(
            ctx.result(
                f"pci:{gpu.bus_id}",
                metric,
                status,
                detail,
                value=gpu.bus_id,
                driver=gpu.driver,
                **evidence,
            )
        )
    return out


def _check_gpu(ctx: CheckContext, dev: GpuDevice) -> list[Result]:
    target = f"gpu:{dev.index}"
    out: list[Result] = []

    def reading(metric: str, query: Callable[[], Any]) -> Any | None:
        """The value, or None after recording a skip (unsupported) / error (query failed)."""
        try:
            return query()
        except NotSupported as err:
            out.append(ctx.result(target, metric, Status.SKIP, f"not available: {err}"))
        except NoPermission as err:
            out.append(ctx.result(target, metric, Status.SKIP, f"no permission: {err}"))
        except DeviceLost as err:
            raise _Abort(
                ctx.result(
                    target,
                    "gpu_lost",
                    Status.FAIL,
                    f"GPU {dev.index} stopped answering: {err}",
                    error=str(err),
                )
            ) from err
        except GpuTimeout as err:
            raise _Abort(
                ctx.result(
                    target, "driver_hang", Status.ERROR, f"GPU {dev.index}: {err}", error=str(err)
                )
            ) from err
        except GpuError as err:
            out.append(
                ctx.result(target, metric, Status.ERROR, f"query failed: {err}", error=str(err))
            )
        return None

    try:
        for step in (
            _ecc,
            _retired_pages,
            _row_remap,
            _pcie,
            _throttle,
            _temperature,
            _power,
            _persistence,
            _recovery,
            nvlink,
        ):
            step(ctx, dev, target, reading, out)
    except _Abort as abort:
        out.append(abort.result)
    return out


def _ecc(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    ecc = reading("ecc", dev.ecc)
    if ecc is None:
        return
    if not ecc.enabled:
        out.append(
            ctx.result(
                target,
                "ecc_mode",
                Status.WARN,
                "ECC is disabled: memory errors go undetected (enable with "
                "nvidia-smi -e 1 and reset the GPU)",
                value=False,
            )
        )
        return
    dbe = ecc.volatile_dbe or 0
    out.append(
        ctx.result(
            target,
            "ecc_dbe_volatile",
            Status.FAIL if dbe else Status.PASS,
            f"{dbe} uncorrectable (double-bit) ECC errors since the driver loaded"
            + (
                ": drain and reset the GPU (the reset applies a row remap the driver recorded); "
                "errors that come back after that mean failing memory"
                if dbe
                else ""
            ),
            value=dbe,
            unit="errors",
            aggregate_dbe=ecc.aggregate_dbe,
            aggregate_dbe_sram=ecc.aggregate_dbe_sram,
            aggregate_dbe_dram=ecc.aggregate_dbe_dram,
        )
    )
    sbe = ecc.volatile_sbe or 0
    sbe_max = ctx.sku.limit("ecc_sbe_volatile_max") if ctx.sku else None
    over = sbe_max is not None and sbe > sbe_max
    out.append(
        ctx.result(
            target,
            "ecc_sbe_volatile",
            Status.WARN if over else Status.PASS,
            f"{sbe} corrected ECC errors since the driver loaded"
            + (f", above the SKU limit {sbe_max:g}" if over else ""),
            value=sbe,
            unit="errors",
            limit=sbe_max,
        )
    )
    _sram(ctx, ecc, target, out)


def _sram(ctx: CheckContext, ecc: EccCounts, target: str, out: list[Result]) -> None:
    """SRAM (L2, SM register files and caches, on-chip buffers) uncorrectable errors over the
    GPU's life, and the driver's flag that they meet NVIDIA's RMA criteria."""
    sram = (
        ecc.sram_uncorrectable_aggregate
        if ecc.sram_uncorrectable_aggregate is not None
        else ecc.aggregate_dbe_sram
    )
    units = {k: v for k, v in ecc.sram_uncorrectable_by_unit.items() if v}
    where = f" ({', '.join(f'{k} {v}' for k, v in units.items())})" if units else ""
    evidence: dict[str, Any] = {"threshold_exceeded": ecc.sram_threshold_exceeded, "by_unit": units}
    if ecc.sram_threshold_exceeded:
        out.append(
            ctx.result(
                target,
                "sram_threshold_exceeded",
                Status.FAIL,
                f"the driver flags SRAM Threshold Exceeded ({sram if sram is not None else '?'} "
                f"uncorrectable SRAM errors{where}): NVIDIA's RMA criteria for on-chip memory are "
                "met; run the field diagnostic and replace the GPU",
                value=True,
                **evidence,
            )
        )
    if sram is None or (sram and ecc.sram_threshold_exceeded):
        return
    out.append(
        ctx.result(
            target,
            "ecc_dbe_sram_aggregate",
            Status.WARN if sram else Status.PASS,
            f"{sram} uncorrectable SRAM ECC errors over the GPU's life{where}, below the "
            "driver's RMA threshold (SRAM Threshold Exceeded: "
            f"{'no' if ecc.sram_threshold_exceeded is False else 'not reported'}); more "
            "in the same bank will trip it"
            if sram
            else "no uncorrectable SRAM ECC errors over the GPU's life",
            value=sram,
            unit="errors",
            **evidence,
        )
    )


def _retired_pages(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    pages = reading("retired_pages", dev.retired_pages)
    if pages is None:
        return
    total = pages.sbe + pages.dbe
    limit = ctx.sku.limit("retired_pages_max") if ctx.sku else None
    over = limit is not None and total > limit
    out.append(
        ctx.result(
            target,
            "retired_pages",
            Status.FAIL if over else Status.PASS,
            f"{total} retired pages ({pages.sbe} single-bit, {pages.dbe} "
            f"double-bit)" + (f", above the limit {limit:g}" if over else ""),
            value=total,
            unit="pages",
            sbe=pages.sbe,
            dbe=pages.dbe,
            limit=limit,
        )
    )
    if pages.pending:
        out.append(
            ctx.result(
                target,
                "retired_pages_pending",
                Status.FAIL,
                "a page retirement is pending: reset the GPU to apply it",
                value=True,
            )
        )


def _row_remap(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    rows = reading("row_remap", dev.row_remap)
    if rows is None:
        return
    evidence = {"corrected_rows": rows.corrected, "uncorrected_rows": rows.uncorrected}
    for flagged, metric, detail in (
        (
            rows.failed,
            "row_remap_failure",
            "row remapping failed: no spare row for an uncorrectable memory "
            "error (NVIDIA: replace the GPU)",
        ),
        (rows.pending, "row_remap_pending", "a row remap is pending: reset the GPU to apply it"),
    ):
        if flagged:
            out.append(ctx.result(target, metric, Status.FAIL, detail, value=True, **evidence))
    if not rows.failed and not rows.pending:
        out.append(
            ctx.result(
                target,
                "row_remap",
                Status.PASS,
                f"{rows.corrected} rows remapped for corrected and "
                f"{rows.uncorrected} for uncorrected errors; none pending",
                value=rows.uncorrected,
                unit="rows",
                **evidence,
            )
        )


def _pcie(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    link = reading("pcie", dev.pcie)
    if link is None:
        return
    expected_width = (ctx.sku.section("pcie").get("width") if ctx.sku else None) or link.width_max
    evidence: dict[str, Any] = {
        "gen_current": link.gen_current,
        "gen_max": link.gen_max,
        "width_current": link.width_current,
        "width_max": link.width_max,
        "width_expected": expected_width,
    }
    degraded, platform = link.shortfall(None, expected_width)
    if degraded:
        status, detail = (
            Status.FAIL,
            f"PCIe link trained at {degraded[0]}: a degraded link (reboot to retrain it; if "
            "it stays, reseat or replace the GPU or riser)",
        )
    elif platform:
        status, detail = (
            Status.WARN,
            f"PCIe x{link.width_current}, all the system gives this GPU ({platform[0]}; "
            "NVML's maximum for this device and system): the slot or platform, not the GPU",
        )
    else:
        status, detail = Status.PASS, f"PCIe x{link.width_current}"
    out.append(
        ctx.result(
            target, "pcie_width", status, detail, value=link.width_current, unit="lanes", **evidence
        )
    )
    # An idle GPU lowers its link generation to save power, so the generation is only a
    # finding when the check runs under load (a suite sets under_load: true).
    slow = link.gen_current < link.gen_max and ctx.typed_params(Params).under_load
    out.append(
        ctx.result(
            target,
            "pcie_gen",
            Status.FAIL if slow else Status.PASS,
            f"PCIe Gen{link.gen_current} under load, Gen{link.gen_max} possible"
            if slow
            else f"PCIe Gen{link.gen_current} (max Gen{link.gen_max}; an idle GPU "
            "may run below max)",
            value=link.gen_current,
            **evidence,
        )
    )
    if link.replay_count is not None:
        limit = ctx.sku.limit("pcie_replay_max") if ctx.sku else None
        over = limit is not None and link.replay_count > limit
        out.append(
            ctx.result(
                target,
                "pcie_replay",
                Status.WARN if over else Status.PASS,
                f"{link.replay_count} PCIe replays"
                + (f", above {limit:g}: a marginal link" if over else ""),
                value=link.replay_count,
                unit="replays",
                limit=limit,
            )
        )


def _throttle(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    reasons = reading("throttle", dev.throttle_reasons)
    if reasons is None:
        return
    abnormal = sorted(r for r in reasons if r in ABNORMAL_THROTTLE)
    status = Status.WARN if abnormal else Status.PASS
    detail = (
        f"clocks held down by {', '.join(abnormal)}"
        if abnormal
        else f"no hardware throttling ({', '.join(sorted(reasons)) or 'no reasons'})"
    )
    out.append(
        ctx.result(
            target, "throttle", status, detail, value=",".join(abnormal), reasons=sorted(reasons)
        )
    )


def _read_again(dev: GpuDevice) -> list[int]:
    """The GPU's temperature read :data:`SHUTDOWN_REREADS` more times, :data:`SHUTDOWN_REREAD_S`
    apart (a reading that fails is left out)."""
    again = []
    for _ in range(SHUTDOWN_REREADS):
        time.sleep(SHUTDOWN_REREAD_S)
        try:
            again.append(dev.temperature_c())
        except GpuError:
            continue
    return again


def _temperature(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    temp = reading("temperature", dev.temperature_c)
    if temp is None:
        return
    limits = reading("temperature_thresholds", dev.temperature_thresholds)
    sku_thermal = ctx.sku.section("thermal") if ctx.sku else {}
    slowdown = (limits.slowdown_c if limits else None) or sku_thermal.get("slowdown_c")
    shutdown = (limits.shutdown_c if limits else None) or sku_thermal.get("shutdown_c")
    evidence: dict[str, Any] = {
        "slowdown_c": slowdown,
        "shutdown_c": shutdown,
        "threshold_source": "nvml" if limits and limits.slowdown_c else "sku",
    }
    if shutdown is not None and temp >= shutdown:
        readings = [temp, *_read_again(dev)]
        evidence["readings_c"] = readings
        if sum(t >= shutdown for t in readings) * 2 > len(readings):
            status, detail = (
                Status.FAIL,
                (
                    f"{temp} °C at or above the shutdown threshold {shutdown} °C "
                    f"(read {len(readings)} times: {readings}): cooling has failed"
                ),
            )
        else:
            status, detail = (
                Status.WARN,
                (
                    f"{temp} °C at the shutdown threshold {shutdown} °C once, then "
                    f"{readings[1:]} °C: a spike or a sensor's glitch, not failed cooling; "
                    "watch the GPU's temperature"
                ),
            )
    elif slowdown is not None and temp >= slowdown:
        status, detail = (
            Status.WARN,
            (f"{temp} °C at or above the slowdown threshold {slowdown} °C: the GPU throttles"),
        )
    else:
        status, detail = (
            Status.PASS,
            (
                f"{temp} °C (slowdown at {slowdown} °C)"
                if slowdown
                else f"{temp} °C (no threshold reported)"
            ),
        )
    out.append(ctx.result(target, "temperature", status, detail, value=temp, unit="°C", **evidence))
    mem_temp = reading("memory_temperature", dev.memory_temperature_c)
    if mem_temp is not None:
        mem_max = limits.memory_max_operating_c if limits else None
        hot = mem_max is not None and mem_temp >= mem_max
        out.append(
            ctx.result(
                target,
                "memory_temperature",
                Status.WARN if hot else Status.PASS,
                f"HBM {mem_temp} °C" + (f", at or above its max {mem_max} °C" if hot else ""),
                value=mem_temp,
                unit="°C",
                max_c=mem_max,
            )
        )


def _power(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    power = reading("power", dev.power)
    if power is None:
        return
    evidence: dict[str, Any] = {
        "enforced_limit_w": power.enforced_limit_w,
        "default_limit_w": power.default_limit_w,
    }
    capped = (
        power.enforced_limit_w is not None
        and power.default_limit_w
        and power.enforced_limit_w < 0.95 * power.default_limit_w
    )
    if capped:
        out.append(
            ctx.result(
                target,
                "power_limit",
                Status.WARN,
                f"power limit {power.enforced_limit_w:.0f} W is below the default "
                f"{power.default_limit_w:.0f} W: the GPU cannot reach full speed",
                value=power.enforced_limit_w,
                unit="W",
                **evidence,
            )
        )
    out.append(
        ctx.result(
            target,
            "power",
            Status.PASS,
            f"{power.usage_w:.0f} W of {power.enforced_limit_w or 0:.0f} W limit",
            value=power.usage_w,
            unit="W",
            **evidence,
        )
    )


def _persistence(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    enabled = reading("persistence_mode", dev.persistence_mode)
    if enabled is None:
        return
    out.append(
        ctx.result(
            target,
            "persistence_mode",
            Status.PASS if enabled else Status.WARN,
            "persistence mode on"
            if enabled
            else "persistence mode off: the driver unloads between jobs, adding start-up latency and "
            "losing volatile error counters (nvidia-smi -pm 1 or nvidia-persistenced)",
            value=enabled,
        )
    )


def _recovery(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: _Reading, out: list[Result]
) -> None:
    action = reading("recovery_action", dev.recovery_action)
    if action is None:
        return
    needs = action in _RESET_ACTIONS or action.startswith("unknown")
    result = ctx.result(
        target,
        "recovery_action",
        Status.FAIL if needs else Status.PASS,
        f"the driver asks for recovery action {action}"
        if needs
        else "the driver asks for no recovery action",
        value=action,
    )
    result.recovery = model.Recovery.parse(action)
    out.append(result)


SERVICE = ServiceBehaviour(metrics=NvmlReadings)
