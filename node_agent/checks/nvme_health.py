"""Check ``nvme_health``: each NVMe controller's SMART / Health log.

Lists controllers from ``/sys/class/nvme`` (:mod:`node_agent.host.nvme`) and reads each one's
SMART / Health log with ``nvme smart-log /dev/nvmeN -o json`` (``host.nvme``; every nvme-cli
JSON form) or, where nvme-cli is absent, ``smartctl -x -j /dev/nvmeN`` (smartmontools 7.0 on),
parsed by :mod:`node_agent.parsers.nvme`; ``host.timeout_s`` bounds each:

* ``critical_warning`` (target ``disk:nvmeN``) — ``warn`` when the drive raised its critical
  warning (the bits named in the detail); ``fail`` (graded ERROR) when a media or spare bit
  (spare below threshold, reliability degraded, read-only) is set on a drive holding one of
  ``storage.paths``, the scratch space the suites need.
* ``available_spare`` (``disk:nvmeN``) — ``fail`` (graded ERROR) when Available Spare is below
  Available Spare Threshold, in either tool's form and whether or not the drive also set
  critical-warning bit 0: it has run out of the blocks it remaps failing flash to, and writes
  are next to fail (most drives go read-only soon after). A threshold over 100 (reserved by the
  NVMe specification, printed by some firmware) is not compared: ``warn`` saying so.
* ``wear`` (``disk:nvmeN``) — ``warn`` when "Percentage Used" is over ``graders/host.yaml``
  ``nvme.percent_used_max`` (90), and always at 100 or more: the drive has used its rated
  endurance (the NVMe specification's 100; it may go on working, so no drain).
* ``media_errors`` (``disk:nvmeN``) — ``warn`` when the drive counted media and data integrity
  errors (data it could not recover) since it was made and raised no critical warning (with
  one, the warning's detail counts them): kept visible, the drive's own verdict is the critical
  warning and the spare.
No NVMe controller, or neither nvme-cli nor smartctl (Debian/Ubuntu packages ``nvme-cli``,
``smartmontools``): a ``skip`` with the reason; a drive that refuses the log to a non-root
user: a ``skip`` saying to run as root.
Params: ``sys_root``, ``proc_root`` (its ``self/mounts``), ``dev_root``, ``nvme``, ``smartctl``.
"""

from __future__ import annotations

import json
from typing import Any

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import (
    HostParams,
    read_host,
    thresholds,
    tool_timeout_s,
)
from node_agent.host.nvme import CONTROLLER, NvmeController, controllers_holding, list_controllers
from node_agent.host.paths import HostPaths
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.nvme import SmartLog, parse_smart_log, parse_smartctl_json

MISSING = (
    "neither nvme-cli nor smartctl is installed (Debian/Ubuntu packages `nvme-cli` or "
    "`smartmontools`)"
)
#: smartctl's exit status bits 0 and 1: the command line or the device open failed, so its
#: JSON holds no reading (smartctl(8), RETURN VALUES); bits 2-7 are the disk's state
SMARTCTL_FATAL_BITS = 0x03
#: NVMe Base Specification: Percentage Used 100 = the rated endurance reached
ENDURANCE_PERCENT = 100


#: the roots and tools it reads (checking/host_checks.py)
Params = HostParams.of("nvme_health")


def run(ctx: CheckContext) -> list[Result]:
    return read_host(ctx, "nvme", ("nvme",), _run)


def _reader(paths: HostPaths) -> tuple[str, str] | None:
    """(tool, program) that reads the health logs: nvme-cli, else smartctl, else None."""
    for tool, name in (("nvme", paths.nvme), ("smartctl", paths.smartctl)):
        program = proc.which(name)  # a path (host.nvme) must be an executable file
        if program is not None:
            return tool, program
    return None


def _run(ctx: CheckContext, paths: HostPaths) -> list[Result]:
    controllers = list_controllers(paths.sys)
    if not controllers:
        return [
            ctx.skip(f"no NVMe controller ({paths.sys / 'class/nvme'} lists none)", metric="nvme")
        ]
    reader = _reader(paths)
    if reader is None:
        return [
            ctx.skip(
                f"{MISSING} ({paths.nvme!r} and {paths.smartctl!r} not found); cannot read the "
                f"SMART logs of {', '.join(c.name for c in controllers)}",
                metric="nvme",
            )
        ]
    wear_max = thresholds(ctx, "nvme")["percent_used_max"]
    scratch = controllers_holding(list(ctx.config.storage.paths), paths.proc)
    results: list[Result] = []
    for ctrl in controllers:
        if not CONTROLLER.match(ctrl.name):  # never a name sysfs did not give in this form
            continue
        target = f"disk:{ctrl.name}"
        holds = sorted(p for p, c in scratch.items() if c == ctrl.name)
        evidence: dict[str, Any] = {
            "model": ctrl.model,
            "serial": ctrl.serial,
            "firmware": ctrl.firmware,
            "namespaces": list(ctrl.namespaces),
            "storage_paths": holds,
            "read_with": reader[0],
        }
        log = _read_log(ctx, reader, paths, ctrl, evidence)
        if isinstance(log, Result):
            results.append(log)
            continue
        evidence.update(
            critical_warning=f"0x{log.critical_warning:02x}",
            percent_used=log.percent_used,
            avail_spare=log.avail_spare,
            spare_thresh=log.spare_thresh,
            media_errors=log.media_errors,
        )
        name = f"{ctrl.name} ({ctrl.model or 'NVMe'}, serial {ctrl.serial or 'n/a'})"
        results.append(_critical_warning(ctx, target, name, log, holds, evidence))
        results.extend(_spare_wear_media(ctx, target, name, log, wear_max, evidence))
    return results


def _read_log(
    ctx: CheckContext,
    reader: tuple[str, str],
    paths: HostPaths,
    ctrl: NvmeController,
    evidence: dict[str, Any],
) -> SmartLog | Result:
    """The controller's SMART / Health log, or the result that says why it could not be read."""
    tool, program = reader
    target = f"disk:{ctrl.name}"
    device = str(paths.dev / ctrl.name)
    argv = (
        [program, "smart-log", device, "-o", "json"]
        if tool == "nvme"
        else [program, "-x", "-j", device]
    )
    out = proc.run(argv, timeout_s=tool_timeout_s(ctx))
    denied = "permission denied" in (out.stderr + out.stdout).lower()
    # smartctl exits non-zero for a disk's state (bits 2-7) with its JSON whole on stdout
    usable = out.ok or (
        tool == "smartctl"
        and not out.timed_out
        and out.returncode is not None
        and not out.returncode & SMARTCTL_FATAL_BITS
    )
    if denied and not (tool == "smartctl" and usable):
        return ctx.skip(
            f"{ctrl.name}: the SMART log needs root ({out.describe_failure()})",
            target=target,
            metric="critical_warning",
        )
    if not usable:
        said = _smartctl_said(out.stdout) if tool == "smartctl" else ""
        return ctx.result(
            target,
            "smart_log",
            Status.ERROR,
            f"{ctrl.name}: {out.describe_failure()}" + (f" ({said})" if said else ""),
            **evidence,
        )
    try:
        if tool == "nvme":
            return parse_smart_log(out.stdout)
        return parse_smartctl_json(out.stdout).log
    except ParseError as err:
        return ctx.result(target, "smart_log", Status.ERROR, f"{ctrl.name}: {err}", **evidence)


def _smartctl_said(stdout: str) -> str:
    """What smartctl's JSON says went wrong (its ``messages``), or ''."""
    try:
        doc = json.loads(stdout)
    except ValueError:
        return ""
    tool = doc.get("smartctl") if isinstance(doc, dict) else None
    found = tool.get("messages") if isinstance(tool, dict) else None
    if not isinstance(found, list):
        return ""
    return "; ".join(str(m.get("string", ""))[:200] for m in found if isinstance(m, dict))


def _critical_warning(
    ctx: CheckContext,
    target: str,
    name: str,
    log: SmartLog,
    holds: list[str],
    evidence: dict[str, Any],
) -> Result:
    if not log.critical_warning:
        detail = f"{name}: no critical warning"
        return ctx.result(target, "critical_warning", Status.PASS, detail, value=0, **evidence)
    on_scratch = log.media_warning and holds
    detail = (
        f"{name} raised its critical warning 0x{log.critical_warning:02x}: "
        f"{'; '.join(log.warnings) or 'reserved bits'}"
    )
    if log.media_errors:
        detail += f"; {log.media_errors} media and data integrity error(s) over its life"
    if on_scratch:
        detail += (
            f"; it holds {', '.join(holds)} (storage.paths), which the suites need: replace the "
            "drive"
        )
    return ctx.result(
        target,
        "critical_warning",
        Status.FAIL if on_scratch else Status.WARN,
        detail,
        value=log.critical_warning,
        **evidence,
    )


def _spare_wear_media(
    ctx: CheckContext,
    target: str,
    name: str,
    log: SmartLog,
    wear_max: float,
    evidence: dict[str, Any],
) -> list[Result]:
    results = [r for r in (_spare(ctx, target, name, log, evidence),) if r is not None]
    if log.percent_used is not None:
        results.append(_wear(ctx, target, name, log.percent_used, wear_max, evidence))
    if log.media_errors and not log.critical_warning:  # else the warning's detail says it
        results.append(
            ctx.result(
                target,
                "media_errors",
                Status.WARN,
                f"{name}: {log.media_errors} media and data integrity error(s) over its life "
                "(reads the drive could not recover); watch for more, and for the spare and "
                "critical warning",
                value=log.media_errors,
                unit="errors",
                **evidence,
            )
        )
    return results


def _spare(
    ctx: CheckContext, target: str, name: str, log: SmartLog, evidence: dict[str, Any]
) -> Result | None:
    spare, floor = log.avail_spare, log.spare_thresh
    if spare is None or floor is None:
        return None
    if log.spare_below_threshold:
        status = Status.FAIL
        detail = (
            f"{name}: {spare} % spare left, below its threshold of {floor} %: the drive has "
            "run out of the blocks it remaps failing flash to, and its writes are next to "
            "fail; drain and replace the drive"
        )
    elif floor > 100:
        status = Status.WARN
        detail = (
            f"{name}: Available Spare Threshold {floor} % is a value the NVMe specification "
            f"reserves (0-100), so the spare ({spare} %) cannot be judged; the drive's "
            "firmware reports nonsense: update it or ask its vendor"
        )
    else:
        status = Status.PASS
        detail = f"{name}: {spare} % spare left (threshold {floor} %)"
    return ctx.result(
        target, "available_spare", status, detail, value=spare, unit="%", limit=floor, **evidence
    )


def _wear(
    ctx: CheckContext,
    target: str,
    name: str,
    used: int,
    wear_max: float,
    evidence: dict[str, Any],
) -> Result:
    worn = used > wear_max or used >= ENDURANCE_PERCENT
    detail = f"{name}: {used} % of its rated endurance used"
    if used >= ENDURANCE_PERCENT:
        detail += (
            " (100 = the rated endurance reached; the drive may go on working, but its "
            "vendor no longer vouches for it): plan its replacement"
        )
    elif worn:
        detail += (
            f", over {wear_max:g} % (graders/host.yaml nvme.percent_used_max): plan its replacement"
        )
    return ctx.result(
        target,
        "wear",
        Status.WARN if worn else Status.PASS,
        detail,
        value=used,
        unit="%",
        limit=wear_max,
        **evidence,
    )
