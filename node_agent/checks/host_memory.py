"""Check ``host_memory``: EDAC memory errors per DIMM, and installed memory against expected.

Reads the EDAC tree (:mod:`node_agent.host.edac`) and the memory blocks or MemTotal
(:mod:`node_agent.host.memory`):

* ``edac_ue`` (target ``dimm:<label>``) — ``fail`` for a DIMM with uncorrected errors: the
  memory returned data ECC could not repair (graded FAULT: the DIMM is replaced). Errors EDAC
  could not place on a DIMM (``ue_noinfo_count``) are named by controller (``memory:mc0``).
* ``edac_ce_rate`` (``dimm:<label>``) — ``warn`` when a DIMM's corrected errors exceed
  ``graders/host.yaml`` ``memory.ce_per_24h_max`` per 24 h. The rate is the growth since the
  sample kept about 24 h ago in ``state_dir`` (``host_memory.json``); with no history it is the
  count since the controller's ``seconds_since_reset``, per 24 h (all of it when the reset was
  less than a day ago).
* ``memory_installed`` (``node``) — installed memory against ``node.expected_memory_gib``
  (without it, what the node's ports declare: a stand-in host's own): ``fail`` (``memory_missing``)
  when more than ``missing_dimm_fraction`` of a DIMM is missing; a ``skip`` saying so when
  nothing declares what to expect.
* ``ghes_ue`` (``dimm:<label>``, else ``memory:ghes``) — ``fail`` (graded ERROR: drain, reboot,
  memory test) for memory errors the firmware reported uncorrected (APEI GHES records in the
  kernel log, severity ``recoverable`` or ``fatal``: :mod:`node_agent.host.ghes`), naming the
  DIMM the record names. ERROR rather than EDAC's FAULT: the firmware's label is its own guess
  (often a slot name, a node/card/module, or none), and a ``recoverable`` error was contained
  (the page taken offline); a DIMM that errs again after its restarts escalates to FAULT.
* ``ghes_ce_rate`` (same targets) — ``warn`` when the firmware's corrected memory errors on one
  DIMM exceed ``memory.ce_per_24h_max`` per 24 h (over the records' span where it is a day or
  more, else their count); ``ghes`` (``node``) passes when the log holds no such record on a
  host whose firmware has error sources (``/sys/bus/platform/devices/GHES.*``); without them,
  nothing is said.
No EDAC (a VM, no platform driver): the EDAC results are one ``skip`` with the reason.
Params: ``sys_root``, ``proc_root`` (trees of a test's own).
"""

from __future__ import annotations

import json
import time
from typing import Any

from node_agent import atomic_file
from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import HostParams, host_paths, not_recorded, thresholds
from node_agent.checking.host_log import kernel_messages
from node_agent.host.edac import EdacAbsent, MemoryController, read_edac
from node_agent.host.ghes import GHES_WORDS, GhesMemoryError, ghes_sources, parse_ghes
from node_agent.host.memory import InstalledMemory, read_installed
from node_agent.host.paths import HostPaths, entity_name
from node_agent.kernel_log import Stamp
from node_agent.model import Result, Status

DAY_S = 86400.0


def _controllers(paths: HostPaths) -> tuple[list[MemoryController] | None, str | None]:
    """The EDAC memory controllers, or None and why they cannot be read."""
    try:
        return read_edac(paths.sys), None
    except EdacAbsent as why:
        return None, str(why)
    except PermissionError as err:
        return None, (
            f"the EDAC tree cannot be read as this user "
            f"({err.strerror}: {err.filename}); run as root"
        )


#: the roots and tools it reads (checking/host_checks.py)
Params = HostParams.of("host_memory")


def run(ctx: CheckContext) -> list[Result]:
    if skip := not_recorded(ctx, "edac"):
        return skip
    limits = thresholds(ctx, "memory")
    with host_paths(ctx, ("edac", "memory")) as paths:
        controllers, absent = _controllers(paths)
        installed = read_installed(paths.sys, paths.proc, gpu_nodes=_grace(ctx))
        sources = ghes_sources(paths.sys)
    results: list[Result] = []
    if controllers is None:
        results.append(ctx.skip(f"no EDAC memory error counters: {absent}", metric="edac"))
    else:
        results.extend(_edac(ctx, controllers, limits))
    results.extend(_ghes(ctx, limits, sources))
    results.append(_installed(ctx, installed, controllers, limits))
    return results


def _ghes(ctx: CheckContext, limits: dict[str, float], sources: int) -> list[Result]:
    """The memory errors the firmware reported through APEI GHES, from the kernel log; a pass
    only where the firmware has error sources (``sources``), else nothing: no record from a
    host without them is no evidence."""
    found = kernel_messages(ctx, GHES_WORDS)
    if found.unreadable:
        if not sources:
            return []
        return [
            ctx.skip(f"firmware memory-error records not read: {found.unreadable}", metric="ghes")
        ]
    errors = parse_ghes(m.text for m in found.messages)
    if not errors and not sources:
        return []
    if not errors:
        return [
            ctx.result(
                "node",
                "ghes",
                Status.PASS,
                f"no memory-error record from the firmware's {sources} error source(s) (APEI "
                f"GHES) in the kernel log ({found.source})",
                value=0,
                unit="records",
            )
        ]
    stamps = [m.stamp for m in found.messages]
    by_target: dict[str, list[GhesMemoryError]] = {}
    for err in errors:
        label = err.label or err.place
        by_target.setdefault(f"dimm:{entity_name(label)}" if label else "memory:ghes", []).append(
            err
        )
    results: list[Result] = []
    for target, errs in by_target.items():
        results.extend(_ghes_target(ctx, target, errs, stamps, limits["ce_per_24h_max"]))
    return results


def _ghes_target(
    ctx: CheckContext,
    target: str,
    errs: list[GhesMemoryError],
    stamps: list[Stamp | None],
    ce_max: float,
) -> list[Result]:
    first = errs[0]
    where = (
        f"DIMM {first.label}"
        if first.label
        else f"memory at {first.place}"
        if first.place
        else "memory the firmware did not place on a DIMM"
    )
    evidence = {
        "label": first.label,
        "place": first.place,
        "records": [
            {"severity": e.severity, "error_type": e.error_type, "seq": e.seq} for e in errs
        ][:20],
        "source": "APEI GHES (kernel log)",
    }
    results: list[Result] = []
    uncorrected = [e for e in errs if e.uncorrected]
    if uncorrected:
        kinds = sorted({e.severity for e in uncorrected})
        results.append(
            ctx.result(
                target,
                "ghes_ue",
                Status.FAIL,
                f"{where}: {len(uncorrected)} uncorrected memory error(s) reported by the firmware "
                f"({' and '.join(kinds)}, APEI GHES): the memory returned data ECC could not "
                "repair; drain, reboot and run a memory test, and replace the DIMM if it errs again",
                value=len(uncorrected),
                unit="errors",
                **evidence,
            )
        )
    corrected = [e for e in errs if not e.uncorrected]
    if corrected:
        rate, basis = _ghes_rate(corrected, stamps)
        if rate > ce_max:
            results.append(
                ctx.result(
                    target,
                    "ghes_ce_rate",
                    Status.WARN,
                    f"{where}: {rate:.0f} corrected memory errors per 24 h reported by the firmware "
                    f"({basis}), over {ce_max:g} (graders/host.yaml memory.ce_per_24h_max): plan "
                    "the DIMM's replacement",
                    value=round(rate, 1),
                    unit="CE/24h",
                    limit=ce_max,
                    **evidence,
                )
            )
    return results


def _ghes_rate(corrected: list[GhesMemoryError], stamps: list[Stamp | None]) -> tuple[float, str]:
    """Corrected records per 24 h: over the span of their boot-clock times where that is a day
    or more, else the count itself (all of it within a day)."""
    times = [
        s.seconds
        for e in corrected
        if (s := stamps[e.line_index] if e.line_index < len(stamps) else None) is not None
        and s.clock == "boot"
    ]
    count = len(corrected)
    if len(times) == count and times and max(times) - min(times) > DAY_S:
        span = max(times) - min(times)
        return count * DAY_S / span, f"{count} in {span / 3600:.0f} h of the kernel log"
    return float(count), f"{count} in the kernel log"


def _unplaced_ue(ctx: CheckContext, mc: MemoryController) -> list[Result]:
    """The controller's uncorrected errors EDAC could not place on a DIMM (none: no result)."""
    unplaced = mc.ue_noinfo or 0
    placed = sum(d.ue or 0 for d in mc.dimms)
    if not mc.dimms and mc.ue:
        unplaced = max(unplaced, mc.ue)
    elif mc.ue and mc.ue > placed:
        unplaced = max(unplaced, mc.ue - placed)
    if not unplaced:
        return []
    return [
        ctx.result(
            f"memory:{mc.name}",
            "edac_ue",
            Status.FAIL,
            f"memory controller {mc.name} has {unplaced} uncorrected memory error(s) EDAC "
            "could not place on a DIMM: find the DIMM from the BMC's event log "
            "(ipmitool sel elist) or rasdaemon (ras-mc-ctl --errors)",
            value=unplaced,
            unit="errors",
            ue_count=mc.ue,
            ue_noinfo_count=mc.ue_noinfo,
        )
    ]


def _edac(
    ctx: CheckContext, controllers: list[MemoryController], limits: dict[str, float]
) -> list[Result]:
    results: list[Result] = []
    history = _load_history(ctx)
    now = time.time()
    kept: dict[str, list[list[float]]] = {}
    ce_max = limits["ce_per_24h_max"]
    for mc in controllers:
        for dimm in mc.dimms:
            label = dimm.label or dimm.name
            target = f"dimm:{entity_name(label)}"
            evidence = {
                "edac": dimm.name,
                "label": label,
                "location": dimm.location,
                "size_mib": dimm.size_mib,
                "ce_count": dimm.ce,
                "ue_count": dimm.ue,
            }
            if dimm.ue:
                results.append(
                    ctx.result(
                        target,
                        "edac_ue",
                        Status.FAIL,
                        f"DIMM {label} ({dimm.name}) has {dimm.ue} uncorrected memory error(s) "
                        "since the EDAC counters were reset: ECC could not repair the data; "
                        "replace the DIMM",
                        value=dimm.ue,
                        unit="errors",
                        **evidence,
                    )
                )
            if dimm.ce is None:
                continue
            rate, basis = _ce_rate(history.get(dimm.name), dimm.ce, mc.seconds_since_reset, now)
            kept[dimm.name] = _kept_samples(history.get(dimm.name), dimm.ce, now)
            if rate > ce_max:
                results.append(
                    ctx.result(
                        target,
                        "edac_ce_rate",
                        Status.WARN,
                        f"DIMM {label} ({dimm.name}): {rate:.0f} corrected memory errors per 24 h "
                        f"({basis}), over {ce_max:g} (graders/host.yaml memory.ce_per_24h_max): a "
                        "DIMM that keeps correcting errors is likely to fail uncorrectably; plan "
                        "its replacement",
                        value=round(rate, 1),
                        unit="CE/24h",
                        limit=ce_max,
                        **evidence,
                    )
                )
        results.extend(_unplaced_ue(ctx, mc))
    _save_history(ctx, kept)
    dimms = sum(len(mc.dimms) for mc in controllers)
    if not any(r.metric == "edac_ue" for r in results):
        results.append(
            ctx.result(
                "node",
                "edac",
                Status.PASS,
                f"EDAC: no uncorrected memory errors on {len(controllers)} memory controller(s), "
                f"{dimms} DIMM(s)",
                value=sum(mc.ce or 0 for mc in controllers),
                unit="CE",
                controllers=[mc.name for mc in controllers],
            )
        )
    return results


def _ce_rate(
    samples: list[list[float]] | None, ce: int, since_reset_s: int | None, now: float
) -> tuple[float, str]:
    """Corrected errors per 24 h, and how that was worked out."""
    usable = [s for s in samples or [] if s[1] <= ce]
    if len(usable) != len(samples or []):
        usable = []  # the counter went down: reset since; the history is of another count
    if usable:
        older = [s for s in usable if s[0] <= now - DAY_S]
        base = older[-1] if older else usable[0]
        window = max(now - base[0], 1.0)
        growth = ce - base[1]
        if window >= DAY_S:
            return growth * DAY_S / window, f"{growth:.0f} in the last {window / 3600:.0f} h"
        return float(growth), f"{growth:.0f} in the last {window / 3600:.1f} h"
    if since_reset_s and since_reset_s > DAY_S:
        return ce * DAY_S / since_reset_s, (
            f"{ce} since the counters were reset {since_reset_s / 3600:.0f} h ago"
        )
    if since_reset_s:
        return float(ce), f"{ce} since the counters were reset {since_reset_s / 3600:.1f} h ago"
    return float(ce), f"{ce} since the counters were reset (time unknown)"


def _kept_samples(samples: list[list[float]] | None, ce: int, now: float) -> list[list[float]]:
    """The samples worth keeping: the last day's, the newest one older than it, and now's."""
    usable = [s for s in samples or [] if s[1] <= ce]
    if len(usable) != len(samples or []):
        usable = []
    older = [s for s in usable if s[0] <= now - DAY_S]
    recent = [s for s in usable if s[0] > now - DAY_S]
    kept = (older[-1:] + recent)[-48:]
    return kept + [[now, ce]]


def _load_history(ctx: CheckContext) -> dict[str, list[list[float]]]:
    if ctx.state_dir is None:
        return {}
    try:
        data = json.loads((ctx.state_dir / "host_memory.json").read_text())
    except (OSError, ValueError):
        return {}
    samples = data.get("ce_samples") if isinstance(data, dict) else None
    if not isinstance(samples, dict):
        return {}
    out = {}
    for name, series in samples.items():
        if isinstance(series, list) and all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(v, (int, float)) for v in s)
            for s in series
        ):
            out[str(name)] = series
    return out


def _save_history(ctx: CheckContext, kept: dict[str, list[list[float]]]) -> None:
    if ctx.state_dir is None:
        return
    try:
        atomic_file.write_json(ctx.state_dir / "host_memory.json", {"ce_samples": kept})
    except OSError:
        pass  # next run estimates from the reset time again


def _grace(ctx: CheckContext) -> bool:
    return ctx.sku is not None and ctx.sku.grace_host


def _installed(
    ctx: CheckContext,
    installed: InstalledMemory | None,
    controllers: list[MemoryController] | None,
    limits: dict[str, float],
) -> Result:
    expected = ctx.config.node.expected_memory_gib
    declared_by = "node.expected_memory_gib"
    if expected is None and ctx.ports.declared_host is not None:
        declared = ctx.ports.declared_host
        expected, declared_by = declared.memory_gib, f"{declared.declared_by}'s memory"
    if installed is None:
        return ctx.skip(
            "installed memory unreadable: neither /sys/devices/system/memory nor "
            "/proc/meminfo could be read",
            metric="memory_installed",
        )
    evidence: dict[str, Any] = {
        "source": installed.source,
        "blocks": installed.blocks,
        "block_bytes": installed.block_bytes,
        "gpu_node_gib": installed.gpu_node_gib,
    }
    if expected is None:
        return ctx.skip(
            f"{installed.gib:g} GiB installed ({installed.source}); not compared: "
            "set node.expected_memory_gib to the node's memory to find a missing "
            "DIMM",
            metric="memory_installed",
        )
    sizes = [d.size_mib for mc in controllers or [] for d in mc.dimms if d.size_mib]
    dimm_gib = min(sizes) / 1024 if sizes else float(limits["dimm_gib_default"])
    margin = dimm_gib * limits["missing_dimm_fraction"]
    if installed.source == "meminfo":
        margin += expected * limits["memtotal_reserved_fraction"]
    missing = expected - installed.gib
    evidence.update(
        expected_gib=expected,
        dimm_gib=dimm_gib,
        margin_gib=round(margin, 2),
        declared_by=declared_by,
    )
    if missing > margin and _grace(ctx):
        # Grace's LPDDR5X is soldered: no DIMM to reseat, and an expectation that counted a
        # GPU's memory reads short of it
        return ctx.result(
            "node",
            "memory_short",
            Status.FAIL,
            f"{installed.gib:g} GiB of host memory in NUMA nodes with CPUs, {expected:g} GiB "
            f"expected ({declared_by}): {missing:g} GiB short of a Grace host's soldered "
            "memory, with no DIMM to name"
            + (
                f" ({installed.gpu_node_gib:g} GiB more is GPU memory the driver onlined, not "
                "counted)"
                if installed.gpu_node_gib
                else ""
            )
            + "; check that the expectation counts the CPUs' memory only, and the BMC's log",
            value=installed.gib,
            unit="GiB",
            missing_gib=round(missing, 2),
            **evidence,
        )
    edac_gib = sum(sizes) / 1024
    if missing > margin and edac_gib >= expected - margin:
        # every DIMM is there to the memory controllers: the kernel does not online it all
        return ctx.result(
            "node",
            "memory_not_online",
            Status.FAIL,
            f"{installed.gib:g} GiB of memory online, {expected:g} GiB expected "
            f"({declared_by}), but EDAC lists {len(sizes)} DIMM(s) holding {edac_gib:g} GiB: "
            "no DIMM is missing; the kernel keeps the rest out (a mem= or memmap= boot "
            "argument, the firmware's memory mirroring or sparing, a hot-plug policy); check "
            "/proc/cmdline and the BIOS memory RAS mode",
            value=installed.gib,
            unit="GiB",
            missing_gib=round(missing, 2),
            edac_gib=round(edac_gib, 2),
            **evidence,
        )
    if missing > margin:
        dimms_missing = max(1, round(missing / dimm_gib))
        return ctx.result(
            "node",
            "memory_missing",
            Status.FAIL,
            f"{installed.gib:g} GiB of memory installed, {expected:g} GiB expected "
            f"({declared_by}): {missing:g} GiB missing, about {dimms_missing} DIMM(s) of "
            f"{dimm_gib:g} GiB (a DIMM not seated, failed at boot or disabled by the firmware; "
            "check the BMC's event log)",
            value=installed.gib,
            unit="GiB",
            missing_gib=round(missing, 2),
            **evidence,
        )
    return ctx.result(
        "node",
        "memory_installed",
        Status.PASS,
        f"{installed.gib:g} GiB of memory installed ({installed.source}), "
        f"{expected:g} GiB expected ({declared_by})",
        value=installed.gib,
        unit="GiB",
        **evidence,
    )
