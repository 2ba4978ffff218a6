"""Check ``host_power``: power-supply presence and status from the BMC over IPMI, and the power
events in its event log.

Runs ``ipmitool sdr type "Power Supply"`` and ``ipmitool -v sdr type "Power Unit"`` (the power
unit's redundancy sensor, type 09h, whose list view says ``ok`` while it asserts "Redundancy
Lost": ipmitool issue 176), or where ipmitool is absent FreeIPMI's ``ipmi-sensors
--sensor-types=Power_Supply,Power_Unit`` (``host.ipmitool``, ``ipmi_sensors``;
``host.timeout_s``), and judges each power supply's status sensor and each redundancy sensor
(:mod:`node_agent.parsers.ipmitool`, :mod:`node_agent.parsers.freeipmi`):

* ``psu_status`` (target ``psu:<name>``) — ``fail`` for a supply that failed (Failure detected,
  AC lost, inactive, a configuration error): the node runs on its remaining supplies, one more
  failure from going dark (graded ERROR); ``warn`` for a predictive failure, AC out of range, or
  a status sensor with no reading.
  An absent supply (no presence asserted) is judged by the BMC's redundancy sensors, since many
  boards list a sensor for a slot that is empty by design: ``fail`` when one says redundancy is
  lost or degraded (the design wants that supply), ``pass`` when all say fully redundant (the
  slot is empty by design), ``warn`` when there is none to tell (no drain on a guess).
* ``psu_redundancy`` (``node``) — ``fail`` when the BMC says redundancy is lost, ``warn`` when
  degraded.
* ``sel_power``/``sel`` — the event log's power events (``ipmitool sel elist``, or FreeIPMI's
  ``ipmi-sel``): :mod:`node_agent.checks.host_power.sel`.
Neither tool (Debian packages ``ipmitool``, ``freeipmi-tools``), no BMC device (``/dev/ipmi0``,
``/dev/ipmi/0``, ``/dev/ipmidev/0``: the ``ipmi_si``/``ipmi_devintf`` modules not loaded, or no
BMC), or a BMC that lists no power-supply sensor: a ``skip`` with the reason.
Params: ``dev_root``, ``ipmitool`` (the program; default ``host.ipmitool``), ``ipmi_sensors``,
``ipmi_sel``.
"""

from __future__ import annotations

from datetime import datetime, timezone

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import (
    HostParams,
    read_host,
    thresholds,
    tool_timeout_s,
)
from node_agent.checks.host_power.sel import sel_results
from node_agent.host.paths import HostPaths, entity_name
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.freeipmi import parse_ipmi_sensors
from node_agent.parsers.ipmitool import (
    PsuState,
    Redundancy,
    judge_psus,
    no_bmc_reason,
    parse_sdr,
    parse_sdr_verbose,
)
from node_agent.parsers.sel import parse_sel, parse_sel_time

ARGV = ("sdr", "type", "Power Supply")
UNIT_ARGV = ("sdr", "type", "Power Unit")  # run with -v: the states, not the list view's "ok"
FREEIPMI_ARGV = ("--sensor-types=Power_Supply,Power_Unit",)
DEVICES = ("ipmi0", "ipmi/0", "ipmidev/0")  # where ipmitool's open interface looks
MISSING = (
    "neither ipmitool nor FreeIPMI is installed (Debian/Ubuntu package `ipmitool`, or "
    "`freeipmi-tools`)"
)


#: the roots and tools it reads (checking/host_checks.py)
Params = HostParams.of("host_power")


def run(ctx: CheckContext) -> list[Result]:
    return read_host(ctx, "psu", ("ipmi",), _run)


def _tools(paths: HostPaths) -> tuple[str, str] | None:
    """("ipmitool", program), else ("freeipmi", ipmi-sensors), else None."""
    if (program := proc.which(paths.ipmitool)) is not None:  # a path must be an executable
        return "ipmitool", program
    if (program := proc.which(paths.ipmi_sensors)) is not None:
        return "freeipmi", program
    return None


def _run(ctx: CheckContext, paths: HostPaths) -> list[Result]:
    tools = _tools(paths)
    if tools is None:
        return [
            ctx.skip(
                f"{MISSING} ({paths.ipmitool!r} and {paths.ipmi_sensors!r} not found); cannot "
                "read the power supplies",
                metric="psu",
            )
        ]
    devices = [paths.dev / d for d in DEVICES]
    if not any(d.exists() for d in devices):
        return [
            ctx.skip(
                f"no BMC device ({', '.join(str(d) for d in devices)} absent): no "
                "BMC on this host, or the ipmi_si and ipmi_devintf kernel modules are "
                "not loaded (modprobe ipmi_si ipmi_devintf)",
                metric="psu",
            )
        ]
    kind, program = tools
    argv = [program, *ARGV] if kind == "ipmitool" else [program, *FREEIPMI_ARGV]
    out = proc.run(argv, timeout_s=tool_timeout_s(ctx))
    if not out.ok:
        return [_unread(ctx, out, kind)]
    try:
        rows = parse_sdr(out.stdout) if kind == "ipmitool" else parse_ipmi_sensors(out.stdout)
    except ParseError as err:
        return [
            ctx.result(
                "node",
                "psu",
                Status.ERROR,
                f"{kind} output unreadable: {err}",
                stdout_head=out.stdout[:500],
            )
        ]
    if kind == "ipmitool":  # the Power Unit's redundancy sensor (09h) beside the supplies
        unit = proc.run([program, "-v", *UNIT_ARGV], timeout_s=tool_timeout_s(ctx))
        rows += parse_sdr_verbose(unit.stdout) if unit.ok else []
    psus, redundancy = judge_psus(rows)
    results = _judged(ctx, psus, redundancy, kind)
    return results + _sel(ctx, paths, kind, program)


def _unread(ctx: CheckContext, out: proc.ProcResult, kind: str) -> Result:
    reason = no_bmc_reason(out.stderr)
    if reason:
        return ctx.skip(f"{kind} cannot reach the BMC: {reason}", metric="psu")
    if "permission denied" in out.stderr.lower():
        return ctx.skip(
            f"{kind} cannot open the BMC device as this user (run as root): "
            f"{out.describe_failure()}",
            metric="psu",
        )
    return ctx.result(
        "node", "psu", Status.ERROR, f"reading the power supplies failed: {out.describe_failure()}"
    )


def _judged(
    ctx: CheckContext, psus: list[PsuState], redundancy: list[Redundancy], kind: str
) -> list[Result]:
    if not psus and not redundancy:
        return [
            ctx.skip(
                "the BMC lists no power-supply status sensor (`ipmitool sdr type "
                '"Power Supply"` printed none): this platform\'s BMC does not report '
                "its supplies over IPMI"
                if kind == "ipmitool"
                else "the BMC lists no power-supply sensor (ipmi-sensors printed none)",
                metric="psu",
            )
        ]
    design = _design_verdict(redundancy)
    results = [_psu_result(ctx, p, design) for p in psus]
    for r in redundancy:
        status = {"lost": Status.FAIL, "degraded": Status.WARN}.get(r.verdict, Status.PASS)
        results.append(
            ctx.result(
                "node",
                "psu_redundancy",
                status,
                f"power supply redundancy ({r.sensor}): {', '.join(r.states)}"
                + ("; the node has no spare supply left" if r.verdict == "lost" else ""),
                value=r.verdict,
                sensor=r.sensor,
                states=list(r.states),
            )
        )
    return results


def _sel(ctx: CheckContext, paths: HostPaths, kind: str, program: str) -> list[Result]:
    """The BMC's event log (:mod:`node_agent.checks.host_power.sel`); a skip where it cannot be read."""
    if kind == "ipmitool":
        argv = [program, "sel", "elist"]
    elif (ipmi_sel := proc.which(paths.ipmi_sel)) is not None:
        argv = [ipmi_sel, "--output-event-state"]
    else:
        return [
            ctx.skip(f"the BMC's event log not read: {paths.ipmi_sel!r} not found", metric="sel")
        ]
    out = proc.run(argv, timeout_s=tool_timeout_s(ctx))
    if not out.ok:
        return [ctx.skip(f"the BMC's event log not read: {out.describe_failure()}", metric="sel")]
    try:
        events = parse_sel(out.stdout)
    except ParseError as err:
        return [ctx.skip(f"the BMC's event log not read: {err}", metric="sel")]
    now, clock = datetime.now(timezone.utc), "this host's clock"
    if kind == "ipmitool":
        got = proc.run([program, "sel", "time", "get"], timeout_s=tool_timeout_s(ctx))
        if got.ok and (bmc := parse_sel_time(got.stdout)) is not None:
            now, clock = bmc, "the BMC's clock"
    recent_h = thresholds(ctx, "power")["sel_recent_h"]
    return sel_results(ctx, events, now, clock, recent_h)


_WORDS = {
    "failed": "has failed",
    "absent": "is absent (no presence asserted)",
    "degraded": "reports",
    "unreadable": "gives no reading (status sensor `ns`)",
    "ok": "present and healthy",
}


def _design_verdict(redundancy: list[Redundancy]) -> str | None:
    """What the BMC's redundancy sensors say of the supplies' design: ``short`` (one says lost or
    degraded), ``met`` (all say fully redundant), None (the BMC has none)."""
    if not redundancy:
        return None
    return "met" if all(r.verdict == "redundant" for r in redundancy) else "short"


#: an absent supply's status, by what the redundancy sensors say of the design
_ABSENT = {"short": Status.FAIL, "met": Status.PASS, None: Status.WARN}


def _psu_result(ctx: CheckContext, psu: PsuState, design: str | None) -> Result:
    status = {
        "failed": Status.FAIL,
        "absent": _ABSENT[design],
        "degraded": Status.WARN,
        "unreadable": Status.WARN,
    }.get(psu.verdict, Status.PASS)
    said = ", ".join(psu.states) or psu.reading or "nothing asserted"
    if psu.verdict == "absent" and design != "short":
        detail = f"power supply {psu.psu} ({psu.sensor}) {_WORDS['absent']}: " + (
            "an empty slot by design, as the BMC reports the supplies fully redundant"
            if design == "met"
            else "this BMC has no redundancy sensor to tell a slot empty by design from a "
            "pulled or unplugged supply; look at the chassis"
        )
    elif status is Status.FAIL:
        detail = (
            f"power supply {psu.psu} ({psu.sensor}) {_WORDS[psu.verdict]}: {said}; the "
            "node runs without its redundancy, one more supply failure from going dark "
            "(check its cord and feed, then replace the supply)"
        )
    elif status is Status.WARN:
        detail = f"power supply {psu.psu} ({psu.sensor}) {_WORDS[psu.verdict]}: {said}"
    else:
        detail = f"power supply {psu.psu} ({psu.sensor}): {said}"
    return ctx.result(
        f"psu:{entity_name(psu.psu)}",
        "psu_status",
        status,
        detail,
        value=psu.verdict,
        sensor=psu.sensor,
        redundancy=design,
        entity=psu.entity,
        states=list(psu.states),
    )
