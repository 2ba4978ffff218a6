"""Check ``host_cpu``: CPU thermal throttling, and the CPUs online against expected.

Reads ``/sys/devices/system/cpu`` (:mod:`node_agent.host.cpu`):

* ``cpu_throttle`` (``node``) — ``warn`` when the thermal throttle counters (every CPU's
  ``core_throttle_count`` and ``package_throttle_count``) grew since the last run by more than
  ``graders/host.yaml`` ``cpu.throttle_growth_max``: the CPUs ran into their thermal limit and
  slowed down (fans, heatsink, airflow). Last counts in ``state_dir``/``host_cpu.json``; a first
  run counts from boot; a drop is a reset. Where the ``thermal_throttle`` directory is absent
  (sysfs not exposed, a container), the same counters are read from the kernel log's therm_throt
  lines (``CPU3: Package temperature above threshold, cpu clock throttled (total events = N)``,
  their printed totals; :mod:`node_agent.host.cpu`). Neither (not x86, most VMs): a ``skip``
  saying so.
* ``cpus_online`` (``node``) — ``fail`` (graded ERROR) when fewer CPUs are online than
  ``node.expected_cpus`` (without it, what the node's ports declare: a stand-in host's), naming the
  missing ones; a ``skip`` when nothing declares what to expect.
Params: ``sys_root``.
"""

from __future__ import annotations

from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import (
    Counters,
    HostParams,
    read_host,
    thresholds,
)
from node_agent.checking.host_log import kernel_messages
from node_agent.host.cpu import (
    THROTTLE_WORDS,
    CpuState,
    parse_throttle_message,
    read_cpus,
    throttle_from_lines,
)
from node_agent.host.paths import HostPaths, format_cpu_list
from node_agent.model import Result, Status

#: the roots and tools it reads (checking/host_checks.py)
Params = HostParams.of("host_cpu")


def run(ctx: CheckContext) -> list[Result]:
    return read_host(ctx, "cpus_online", ("cpu",), _judge)


def _judge(ctx: CheckContext, paths: HostPaths) -> list[Result]:
    state = read_cpus(paths.sys)
    return [_throttle(ctx, state), _online(ctx, state)]


def _log_counters(ctx: CheckContext) -> tuple[dict[int, tuple[int | None, int | None]], str]:
    """The throttle counters the kernel log's therm_throt lines show, and what was read."""
    found = kernel_messages(ctx, THROTTLE_WORDS)
    lines = [t for m in found.messages if (t := parse_throttle_message(m.text)) is not None]
    said = found.unreadable or f"{found.source}: {len(lines)} throttle line(s)"
    return throttle_from_lines(lines), said


def _throttle(ctx: CheckContext, state: CpuState) -> Result:
    throttle, source = state.throttle, "sysfs"
    if not throttle:
        throttle, said = _log_counters(ctx)
        source = f"kernel log ({said})"
        if not throttle:
            return ctx.skip(
                "no CPU thermal throttle counters (/sys/devices/system/cpu/cpu*/"
                "thermal_throttle absent: not an x86 host with the therm_throt driver, "
                f"or a VM) and no therm_throt line in the kernel log ({said})",
                metric="cpu_throttle",
            )
    limit = thresholds(ctx, "cpu")["throttle_growth_max"]
    counters = Counters.load(ctx, "host_cpu")
    grew: dict[str, int] = {}
    total = 0
    for cpu, (core, package) in throttle.items():
        for kind, value in (("core", core), ("package", package)):
            if value is None:
                continue
            total += value
            delta = counters.growth(f"cpu{cpu}.{kind}", value)
            if delta:
                grew[f"cpu{cpu}.{kind}"] = delta
    counters.save()
    growth = sum(grew.values())
    if growth > limit:
        shown = ", ".join(f"{k} +{v}" for k, v in list(grew.items())[:8])
        return ctx.result(
            "node",
            "cpu_throttle",
            Status.WARN,
            f"CPU thermal throttling: {growth} episode(s) since the last run ({shown}"
            f"{', ...' if len(grew) > 8 else ''}): the CPUs reached their thermal limit and "
            "slowed down; check fans, heatsinks and airflow",
            value=growth,
            unit="episodes",
            limit=limit,
            grew=grew,
            total_since_boot=total,
            source=source,
        )
    return ctx.result(
        "node",
        "cpu_throttle",
        Status.PASS,
        f"no CPU thermal throttling since the last run ({len(throttle)} "
        f"CPUs, {total} episode(s) since boot; {source})",
        value=0,
        unit="episodes",
        total_since_boot=total,
        source=source,
    )


def _smt_off_explains(state: CpuState, online: int, expected: int) -> bool:
    """SMT off, and exactly one thread of each core online: every CPU the kernel has is
    present, as declared, and half of them (the sibling threads) offline. A core or a socket
    lost beside it breaks the equality and stays a finding."""
    present = len(state.present or ())
    return state.smt in ("off", "forceoff") and present == expected and 2 * online == present


def _online(ctx: CheckContext, state: CpuState) -> Result:
    expected = ctx.config.node.expected_cpus
    declared_by = "node.expected_cpus"
    if expected is None and ctx.ports.declared_host is not None:
        declared = ctx.ports.declared_host
        expected, declared_by = declared.cpus, f"{declared.declared_by}'s CPUs"
    if state.online is None:
        return ctx.skip("/sys/devices/system/cpu/online cannot be read", metric="cpus_online")
    online = len(state.online)
    if expected is None:
        return ctx.skip(
            f"{online} CPUs online ({format_cpu_list(state.online)}); not compared: "
            "set node.expected_cpus to find CPUs gone offline",
            metric="cpus_online",
        )
    evidence = {
        "online": format_cpu_list(state.online),
        "expected": expected,
        "declared_by": declared_by,
        "present": format_cpu_list(state.present) if state.present is not None else None,
    }
    if _smt_off_explains(state, online, expected):
        return ctx.result(
            "node",
            "cpus_online",
            Status.WARN,
            f"{online} CPUs online, {expected} expected ({declared_by}), and SMT is "
            f"{state.smt} (/sys/devices/system/cpu/smt/control): the sibling threads are "
            "offline by that setting (nosmt, a hardening policy), not lost; turn SMT on or "
            "set node.expected_cpus to the count without it",
            value=online,
            unit="CPUs",
            smt=state.smt,
            **evidence,
        )
    if online < expected:
        seen = set(state.online)
        missing = [c for c in range(expected) if c not in seen]
        if state.present:
            missing = sorted(set(missing) | (set(state.present) - seen))
        return ctx.result(
            "node",
            "cpus_online",
            Status.FAIL,
            f"{online} CPUs online, {expected} expected ({declared_by}): CPU(s) "
            f"{format_cpu_list(missing) or 'unknown'} offline or missing (taken offline by the "
            "kernel after machine checks, by an operator, or a socket not detected)",
            value=online,
            unit="CPUs",
            missing=format_cpu_list(missing),
            **evidence,
        )
    return ctx.result(
        "node",
        "cpus_online",
        Status.PASS,
        f"{online} CPUs online, {expected} expected ({declared_by})",
        value=online,
        unit="CPUs",
        **evidence,
    )
