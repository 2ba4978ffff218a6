"""Check ``pcie_aer``: PCIe Advanced Error Reporting counters, per device, named by what sits
behind them.

Reads every function's ``aer_dev_fatal``, ``aer_dev_nonfatal`` and ``aer_dev_correctable``
(:mod:`node_agent.host.aer`; totals since boot) and attributes each to the GPU (its bus id in
NVML: ``gpu:N``) or the HCA (``/sys/class/infiniband/<hca>/device``: ``hca:NAME``) it is, or
that sits directly below it (the bridge upstream of a GPU or an HCA carries that link's
errors); anything else is ``pci:<bdf>``.

* ``aer_fatal`` — ``fail`` for fatal uncorrectable errors: the link or device was unusable and
  needed a reset (graded ERROR: drain, reboot, re-test; counters clear at boot).
* ``aer_nonfatal`` — ``warn``: a transaction was lost (completion timeout, poisoned TLP) while
  the link stayed up.
* ``aer_correctable`` — ``warn`` when correctable errors grew since the last run by more than
  ``graders/host.yaml`` ``pcie_aer.correctable_growth_max`` (the last counts are kept in
  ``state_dir``/``pcie_aer.json``; a first run counts from boot; a drop is a reset).
No device with AER counters (a kernel without ``CONFIG_PCIEAER``, firmware-first AER, a VM):
one ``skip`` saying so, and the kernel log's AER messages are read instead
(:mod:`node_agent.checks.pcie_aer.log`); where the counters exist they already count every error
the log prints, so the log is not read twice. Params: ``sys_root``.
"""

from __future__ import annotations

from pathlib import Path

from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import (
    Counters,
    HostParams,
    host_paths,
    not_recorded,
    thresholds,
)
from node_agent.checks.pcie_aer.log import log_results
from node_agent.gpu.pci import normalise_bus_id
from node_agent.host.aer import PciFunction, read_functions, read_hca_functions
from node_agent.host.nvme import read_nvme_functions
from node_agent.model import GpuInfo, Result, Status

_SEVERITY = {
    "fatal": ("aer_fatal", Status.FAIL, "fatal uncorrectable"),
    "nonfatal": ("aer_nonfatal", Status.WARN, "non-fatal uncorrectable"),
}


def _gpus(ctx: CheckContext) -> list[GpuInfo]:
    """The GPUs NVML enumerated (none when the inventory could not be taken)."""
    return list(ctx.inventory.gpus) if ctx.inventory is not None else []


def _gpu_targets(ctx: CheckContext) -> dict[str, str]:
    """bdf -> ``gpu:N`` for the GPUs NVML enumerated."""
    out = {}
    for gpu in _gpus(ctx):
        try:
            out[normalise_bus_id(gpu.pci_bus_id)] = f"gpu:{gpu.index}"
        except ValueError:
            continue
    return out


def _named(hcas: dict[str, str], nvmes: dict[str, str]) -> dict[str, str]:
    return {
        **{b: f"hca:{n}" for b, n in hcas.items()},
        **{b: f"disk:{n}" for b, n in nvmes.items()},
    }


def _gpu_bus_ids(ctx: CheckContext) -> set[str]:
    return set(_gpu_targets(ctx))


def _function_results(
    ctx: CheckContext,
    fn: PciFunction,
    named: list[str],
    via: str,
    counters: Counters,
    limit: float,
) -> list[Result]:
    """One function's counters: its uncorrectable totals, its correctable growth."""
    assert fn.aer is not None
    target = named[0] if named else f"pci:{fn.bdf}"
    evidence = {
        "bdf": fn.bdf,
        "upstream": fn.upstream,
        "behind": named,
        "bits": fn.aer.bits,
        "fatal": fn.aer.fatal,
        "nonfatal": fn.aer.nonfatal,
        "correctable": fn.aer.correctable,
    }
    who = f"{target}{via}" if named else f"PCI device {fn.bdf}"
    results: list[Result] = []
    for severity, (metric, status, words) in _SEVERITY.items():
        count = fn.aer.get(severity)
        if count:
            bits = ", ".join(f"{k} {v}" for k, v in fn.aer.bits.get(severity, {}).items())
            results.append(
                ctx.result(
                    target,
                    metric,
                    status,
                    f"{who}: {count} {words} PCIe error(s) since boot"
                    + (f" ({bits})" if bits else "")
                    + (
                        "; the link needed a reset: drain, reboot and re-test, reseat or replace "
                        "if it recurs"
                        if severity == "fatal"
                        else ""
                    ),
                    value=count,
                    unit="errors",
                    **evidence,
                )
            )
    if fn.aer.correctable is not None:
        grew = counters.growth(fn.bdf, fn.aer.correctable)
        if grew > limit:
            results.append(
                ctx.result(
                    target,
                    "aer_correctable",
                    Status.WARN,
                    f"{who}: correctable PCIe errors grew by {grew} since the last run "
                    f"({fn.aer.correctable} since boot; graders/host.yaml "
                    f"pcie_aer.correctable_growth_max {limit:g}): a marginal link (riser, "
                    "slot, retimer)",
                    value=grew,
                    unit="errors",
                    limit=limit,
                    **evidence,
                )
            )
    return results


def _owners(
    ctx: CheckContext, functions: list[PciFunction], hcas: dict[str, str]
) -> dict[str, list[str]]:
    """bdf -> the GPU/HCA targets it is or sits directly above."""
    own: dict[str, list[str]] = {}
    for gpu in _gpus(ctx):
        try:
            own.setdefault(normalise_bus_id(gpu.pci_bus_id), []).append(f"gpu:{gpu.index}")
        except ValueError:
            continue
    for bdf, name in hcas.items():
        own.setdefault(bdf, []).append(f"hca:{name}")
    for fn in functions:
        if fn.upstream and fn.bdf in own and fn.upstream not in own:
            own.setdefault(f"bridge:{fn.upstream}", []).extend(own[fn.bdf])
    for key in [k for k in own if k.startswith("bridge:")]:
        own[key[7:]] = own.pop(key)
    return own


#: the roots and tools it reads (checking/host_checks.py)
Params = HostParams.of("pcie_aer")


def run(ctx: CheckContext) -> list[Result]:
    if skip := not_recorded(ctx, "aer"):
        return skip
    unread: Result | None = None
    functions: list[PciFunction] = []
    with host_paths(ctx, ("pci",)) as paths:
        try:
            functions = read_functions(paths.sys)
        except PermissionError as err:
            unread = ctx.skip(
                f"the AER counters can be read only by root ({err.filename}: "
                f"{err.strerror}); run the agent as root",
                metric="aer",
            )
        except OSError as err:
            unread = ctx.skip(
                f"the PCI bus cannot be listed ({paths.sys / 'bus/pci/devices'}: "
                f"{err.strerror or err})",
                metric="aer",
            )
        hcas = read_hca_functions(paths.sys)
        nvmes = read_nvme_functions(paths.sys)
    results = [unread] if unread is not None else _counters(ctx, functions, hcas, paths.sys)
    if any(f.aer is not None for f in functions):
        return results  # the counters hold every error the log prints: read once, not twice
    return results + log_results(ctx, functions, {**_gpu_targets(ctx), **_named(hcas, nvmes)})


def _counters(
    ctx: CheckContext, functions: list[PciFunction], hcas: dict[str, str], sys_root: Path
) -> list[Result]:
    """The sysfs AER counters' results (see the module's docstring)."""
    limit = thresholds(ctx, "pcie_aer")["correctable_growth_max"]
    with_aer = [f for f in functions if f.aer is not None]
    if not with_aer:
        return [
            ctx.skip(
                f"no PCI device exposes AER counters ({len(functions)} device(s) under "
                f"{sys_root / 'bus/pci/devices'}, none with aer_dev_*): the kernel "
                "lacks CONFIG_PCIEAER, the firmware keeps AER to itself "
                "(firmware-first), or this is a VM; the kernel log's AER lines are read instead",
                metric="aer",
            )
        ]
    owners = _owners(ctx, functions, hcas)
    gpu_bdfs = {
        t
        for t, names in owners.items()
        if any(n.startswith("gpu:") for n in names) and t in _gpu_bus_ids(ctx)
    }
    counters = Counters.load(ctx, "pcie_aer")
    results: list[Result] = []
    for fn in with_aer:
        named = owners.get(fn.bdf, [])
        via = ""
        if named and fn.bdf not in gpu_bdfs and fn.bdf not in hcas:
            via = f" (on the bridge {fn.bdf} directly upstream of {', '.join(named)})"
        results.extend(_function_results(ctx, fn, named, via, counters, limit))
    counters.save()
    if not results:
        results.append(
            ctx.result(
                "node",
                "aer",
                Status.PASS,
                f"no uncorrectable PCIe error on {len(with_aer)} device(s) with AER counters, "
                "no correctable growth",
                value=len(with_aer),
                unit="devices",
                named={bdf: t for bdf, t in owners.items()},
            )
        )
    return results
