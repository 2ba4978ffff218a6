"""Check ``nvme_health``: each NVMe controller's SMART / Health log.

Lists controllers from ``/sys/class/nvme`` (:mod:`node_agent.host.nvme`) and runs ``nvme
smart-log /dev/nvmeN -o json`` for each (``host.nvme``, ``host.timeout_s``), parsed by
:mod:`node_agent.parsers.nvme` (every nvme-cli JSON form):

* ``critical_warning`` (target ``disk:nvmeN``) — ``warn`` when the drive raised its critical
  warning (the bits named in the detail); ``fail`` (graded ERROR) when a media or spare bit
  (spare below threshold, reliability degraded, read-only) is set on a drive holding one of
  ``storage.paths``, the scratch space the suites need.
* ``wear`` (``disk:nvmeN``) — ``warn`` when "Percentage Used" is over ``graders/host.yaml``
  ``nvme.percent_used_max`` (90): the drive is near its rated endurance.
No NVMe controller, or no nvme-cli (Debian/Ubuntu package ``nvme-cli``): a ``skip`` with the
reason; a drive that refuses the log to a non-root user: a ``skip`` saying to run as root.
Params: ``sys_root``, ``proc_root`` (its ``self/mounts``), ``dev_root``, ``nvme``.
"""

from __future__ import annotations

from typing import Any

from node_agent import proc
from node_agent.checks import CheckContext
from node_agent.checks.host_common import host_paths, not_recorded, thresholds, tool_timeout_s
from node_agent.checks.ports import StandInFault
from node_agent.host.nvme import CONTROLLER, controllers_holding, list_controllers
from node_agent.host.paths import HostPaths
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.nvme import parse_smart_log

MISSING = "nvme-cli not installed (Debian/Ubuntu package `nvme-cli`)"


def run(ctx: CheckContext) -> list[Result]:
    if skip := not_recorded(ctx, "nvme"):
        return skip
    try:
        with host_paths(ctx, ("nvme",)) as paths:
            return _run(ctx, paths)
    except StandInFault as err:  # a scenario's fault naming a disk the stand-in lacks
        return [ctx.result("node", "scenario", Status.ERROR, str(err))]


def _run(ctx: CheckContext, paths: HostPaths) -> list[Result]:
    controllers = list_controllers(paths.sys)
    if not controllers:
        return [
            ctx.skip(f"no NVMe controller ({paths.sys / 'class/nvme'} lists none)", metric="nvme")
        ]
    program = proc.which(paths.nvme)  # a path (host.nvme) must be an executable file
    if program is None:
        return [
            ctx.skip(
                f"{MISSING} ({paths.nvme!r} not found); cannot read the SMART logs of "
                f"{', '.join(c.name for c in controllers)}",
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
        }
        out = proc.run(
            [program, "smart-log", str(paths.dev / ctrl.name), "-o", "json"],
            timeout_s=tool_timeout_s(ctx),
        )
        if not out.ok:
            if "permission denied" in (out.stderr + out.stdout).lower():
                results.append(
                    ctx.skip(
                        f"{ctrl.name}: the SMART log needs root ({out.describe_failure()})",
                        target=target,
                        metric="critical_warning",
                    )
                )
            else:
                results.append(
                    ctx.result(
                        target,
                        "smart_log",
                        Status.ERROR,
                        f"{ctrl.name}: {out.describe_failure()}",
                        **evidence,
                    )
                )
            continue
        try:
            log = parse_smart_log(out.stdout)
        except ParseError as err:
            results.append(
                ctx.result(target, "smart_log", Status.ERROR, f"{ctrl.name}: {err}", **evidence)
            )
            continue
        evidence.update(
            critical_warning=f"0x{log.critical_warning:02x}",
            percent_used=log.percent_used,
            avail_spare=log.avail_spare,
            spare_thresh=log.spare_thresh,
            media_errors=log.media_errors,
        )
        name = f"{ctrl.name} ({ctrl.model or 'NVMe'}, serial {ctrl.serial or 'n/a'})"
        if log.critical_warning:
            on_scratch = log.media_warning and holds
            status = Status.FAIL if on_scratch else Status.WARN
            detail = (
                f"{name} raised its critical warning 0x{log.critical_warning:02x}: "
                f"{'; '.join(log.warnings) or 'reserved bits'}"
            )
            if on_scratch:
                detail += (
                    f"; it holds {', '.join(holds)} (storage.paths), which the suites "
                    "need: replace the drive"
                )
            results.append(
                ctx.result(
                    target,
                    "critical_warning",
                    status,
                    detail,
                    value=log.critical_warning,
                    **evidence,
                )
            )
        else:
            results.append(
                ctx.result(
                    target,
                    "critical_warning",
                    Status.PASS,
                    f"{name}: no critical warning",
                    value=0,
                    **evidence,
                )
            )
        if log.percent_used is not None:
            worn = log.percent_used > wear_max
            results.append(
                ctx.result(
                    target,
                    "wear",
                    Status.WARN if worn else Status.PASS,
                    f"{name}: {log.percent_used} % of its rated endurance used"
                    + (
                        f", over {wear_max:g} % (graders/host.yaml nvme.percent_used_max): plan its "
                        "replacement"
                        if worn
                        else ""
                    ),
                    value=log.percent_used,
                    unit="%",
                    limit=wear_max,
                    **evidence,
                )
            )
    return results
