"""Check ``thermal_power``: temperature, power, clocks and throttling of each GPU under load.

It grades the telemetry trace that ``gpu_burn`` hands over as its declared output ``trace``
(:data:`INPUTS`; read through the GPU layer while every GPU ran GEMMs; keys in
:mod:`node_agent.checks.gpu_burn`).
When the burn did not run earlier in the suite, it runs its own short burn
(``params.duration_s``, default 60 s, the SKU's first precision) to get one.

Findings per GPU (target ``gpu:N``):

- ``temperature_max_c``: the hottest reading, and the time at or above the slowdown threshold
  (NVML's own, else the SKU file's); reaching it under load is ``fail``.
- ``power_reached_fraction``: the power drawn under load (90th percentile of the readings while
  the GPU's burn was running) over the enforced limit. Below ``power_reached_fraction_min``
  (DCGM's targeted-power rule of thumb) is ``fail`` — only when the GPU ran at full load (its
  burn sent throughput for at least ``full_load_fraction`` of the readings).
- ``sm_clock_drop``: 1 − median SM clock under load / max SM clock; above
  ``sm_clock_drop_max`` is ``warn``.
- ``throttle``: clock-event reasons seen; ``hw_slowdown``, ``hw_thermal_slowdown`` and
  ``hw_power_brake_slowdown`` are ``fail``; ``sw_power_cap`` is normal under a full load.
- ``memory_temperature_max_c`` where the GPU reports it; at or above its max operating
  temperature is ``warn``.
- ``load_trace`` (``pass``, informational): the GPU's whole trace as evidence, for plots.

Thresholds: ``graders/thermal_power.yaml`` (the same for every GPU model; their one home,
docs/thresholds.md), and the SKU file's ``thermal.slowdown_c`` where NVML reports none. On a
stand-in node the scenario models these readings under load (``ports.load_hint``), so the same
thresholds apply to them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from node_agent.checking.behaviour import get_input
from node_agent.checking.burn_run import BurnParams, burn, make_plan, worker_failures
from node_agent.checking.context import CheckContext
from node_agent.checking.thresholds import load_topic
from node_agent.gpu.base import GpuError
from node_agent.gpu.throttle import ABNORMAL_THROTTLE
from node_agent.model import Result, Status

#: the topic file of the thresholds (checking/thresholds.py) and its schema
TOPIC = "thermal_power"
_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}
THERMAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "power_reached_fraction_min": _FRACTION,
        "sm_clock_drop_max": _FRACTION,
        "full_load_fraction": _FRACTION,
    },
}
#: keys an older SKU file kept under ``limits``; they hold for every model, so they moved
MOVED_FROM_SKU = ("power_reached_fraction_min", "sm_clock_drop_max")
#: the burn's telemetry trace, from gpu_burn earlier in the suite run (checking/behaviour.py)
INPUTS = {"trace": "gpu_burn"}


@dataclass(frozen=True)
class Params(BurnParams):
    """The burn's parameters (checking/burn_run.py) for its own short burn, when the suite ran
    no ``gpu_burn`` before it: 60 s by default, the first precision only."""

    CHECK: ClassVar[str] = "thermal_power"

    duration_s: float = 60.0


def run(ctx: CheckContext) -> list[Result]:
    if stale := stale_sku_limits(ctx):
        return [stale]
    trace = get_input(ctx, "trace")
    source = "gpu_burn earlier in this suite"
    results: list[Result] = []
    if trace is None:
        params = ctx.typed_params(Params)
        plan = make_plan(ctx, params, max_precisions=1)
        outcome = burn(ctx, plan, params.sample_interval_s)
        if isinstance(outcome, list):
            return outcome
        results += worker_failures(ctx, outcome)
        trace = outcome.trace()
        source = f"its own {plan.duration_s:g} s {', '.join(outcome.precisions)} burn"
    for index in sorted(trace):
        results += gpu_findings(ctx, index, trace[index], source)
    if not results:
        results.append(ctx.skip("the burn produced no telemetry: no GPU ran"))
    return results


def stale_sku_limits(ctx: CheckContext) -> Result | None:
    """The error for a SKU file that still sets a threshold that moved to
    ``graders/thermal_power.yaml`` (an operator's copy from before the move), else None: two
    homes for one number would leave the reader guessing which one judged."""
    stale = [k for k in MOVED_FROM_SKU if ctx.sku is not None and ctx.sku.limit(k) is not None]
    if not stale or ctx.sku is None:
        return None
    return ctx.result(
        "node",
        "thresholds",
        Status.ERROR,
        f"{ctx.sku.source}: limits.{', limits.'.join(stale)} moved to graders/{TOPIC}.yaml "
        "(the same for every GPU model): set the value there (an operator's graders_dir holds "
        "the keys it changes) and remove it from the SKU file",
        moved=stale,
    )


def _limits(ctx: CheckContext, index: int) -> dict[str, Any]:
    """The thresholds (graders/thermal_power.yaml, the SKU's slowdown temperature) and the
    GPU's own static readings (max SM clock, memory max temp)."""
    sku = ctx.sku
    th = load_topic(ctx.config, TOPIC, THERMAL_SCHEMA, "thermal_power grading file")
    out: dict[str, Any] = {
        "power_fraction_min": th["power_reached_fraction_min"],
        "clock_drop_max": th["sm_clock_drop_max"],
        "full_load_fraction": th["full_load_fraction"],
        "sku_slowdown_c": sku.section("thermal").get("slowdown_c") if sku else None,
        "sm_max_mhz": None,
        "memory_max_c": None,
    }
    device = next((d for d in ctx.gpu.devices() if d.index == index), None)
    if device is not None:
        try:
            out["sm_max_mhz"] = device.clocks().sm_max_mhz
        except GpuError:
            pass
        try:
            out["memory_max_c"] = device.temperature_thresholds().memory_max_operating_c
        except GpuError:
            pass
    return out


def _present(values: list[Any], keep: list[int] | None = None) -> list[Any]:
    idx = range(len(values)) if keep is None else keep
    return [values[i] for i in idx if i < len(values) and values[i] is not None]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def gpu_findings(ctx: CheckContext, index: int, trace: dict[str, Any], source: str) -> list[Result]:
    """All findings of one GPU from its trace (see the module docstring)."""
    target = f"gpu:{index}"
    limits = _limits(ctx, index)
    t_s = trace.get("t_s") or []
    loaded = [i for i, v in enumerate(trace.get("tflops") or []) if v is not None]
    full_load = bool(t_s) and len(loaded) >= limits["full_load_fraction"] * len(t_s)
    span = (t_s[-1] - t_s[0]) if len(t_s) > 1 else 0.0
    load_note = f"{len(loaded)} of {len(t_s)} readings while its burn ran"
    out = [
        _temperature(ctx, target, trace, limits, span),
        _power(ctx, target, trace, limits, loaded, full_load, load_note),
        _clock_drop(ctx, target, trace, limits, loaded),
        _throttle(ctx, target, trace),
        _memory_temperature(ctx, target, trace, limits),
        ctx.result(
            target,
            "load_trace",
            Status.PASS,
            f"{target}: {len(t_s)} telemetry readings over {span:.1f} s under load (from {source})",
            value=len(t_s),
            unit="samples",
            **trace,
        ),
    ]
    return out


def _temperature(
    ctx: CheckContext, target: str, trace: dict[str, Any], limits: dict[str, Any], span: float
) -> Result:
    temps = trace.get("temp_c") or []
    present = _present(temps)
    if not present:
        return ctx.result(
            target,
            "temperature_max_c",
            Status.SKIP,
            f"{target}: GPU temperature not available during the burn",
        )
    slowdown = trace.get("slowdown_temp_c") or limits["sku_slowdown_c"]
    hottest = max(present)
    t_s = trace["t_s"]
    above_s = 0.0
    if slowdown is not None:  # each hot reading counts until the next reading
        for i, temp in enumerate(temps[:-1]):
            if temp is not None and temp >= slowdown:
                above_s += t_s[i + 1] - t_s[i]
        above_s = min(above_s, span) if span else above_s
    evidence = {
        "slowdown_c": slowdown,
        "time_above_slowdown_s": round(above_s, 3),
        "load_span_s": round(span, 3),
        "readings": len(present),
    }
    if slowdown is not None and hottest >= slowdown:
        return ctx.result(
            target,
            "temperature_max_c",
            Status.FAIL,
            f"{target} reached {hottest:g} °C under load, at or above its "
            f"slowdown threshold {slowdown:g} °C for {above_s:.1f} s of "
            f"{span:.1f} s: it throttles under sustained load; check airflow, "
            "fans and heatsink, then re-run",
            value=hottest,
            unit="°C",
            **evidence,
        )
    return ctx.result(
        target,
        "temperature_max_c",
        Status.PASS,
        f"{target} max {hottest:g} °C under load"
        + (
            f" (slowdown at {slowdown:g} °C)"
            if slowdown is not None
            else " (no slowdown threshold known)"
        ),
        value=hottest,
        unit="°C",
        **evidence,
    )


def _power(
    ctx: CheckContext,
    target: str,
    trace: dict[str, Any],
    limits: dict[str, Any],
    loaded: list[int],
    full_load: bool,
    load_note: str,
) -> Result:
    limit = trace.get("power_limit_w")
    powers = _present(trace.get("power_w") or [], loaded)
    if not powers or not limit:
        why = "power draw" if not powers else "the enforced power limit"
        return ctx.result(
            target,
            "power_reached_fraction",
            Status.SKIP,
            f"{target}: {why} not available under load",
        )
    reached = _percentile(powers, 0.9)
    fraction = reached / limit
    minimum = limits["power_fraction_min"]
    evidence = {
        "power_p90_w": reached,
        "power_max_w": max(powers),
        "power_limit_w": limit,
        "minimum": minimum,
        "full_load": full_load,
        "rule": f"graders/{TOPIC}.yaml power_reached_fraction_min (DCGM targeted_power's "
        "target_power_min_ratio)",
    }
    if not full_load:
        status = Status.SKIP
        detail = f"{target}: power not graded, the GPU did not run at full load ({load_note})"
    elif fraction < minimum:
        status = Status.FAIL
        detail = (
            f"{target} drew {reached:.0f} W under full load (90th percentile), "
            f"{fraction:.0%} of its {limit:.0f} W enforced limit, below "
            f"{minimum:.0%}: check power delivery, power-brake and clock settings"
        )
    else:
        status = Status.PASS
        detail = (
            f"{target} drew {reached:.0f} W under full load, {fraction:.0%} of its "
            f"{limit:.0f} W enforced limit"
        )
    return ctx.result(
        target, "power_reached_fraction", status, detail, value=round(fraction, 4), **evidence
    )


def _clock_drop(
    ctx: CheckContext, target: str, trace: dict[str, Any], limits: dict[str, Any], loaded: list[int]
) -> Result:
    clocks = _present(trace.get("sm_clock_mhz") or [], loaded)
    if not clocks:
        return ctx.result(
            target,
            "sm_clock_drop",
            Status.SKIP,
            f"{target}: SM clock not available while the burn ran",
        )
    sm_max = limits["sm_max_mhz"] or max(clocks)
    median = statistics.median(clocks)
    drop = max(0.0, 1.0 - median / sm_max)
    allowed = limits["clock_drop_max"]
    evidence = {
        "sm_clock_median_mhz": median,
        "sm_clock_min_mhz": min(clocks),
        "sm_max_mhz": sm_max,
        "maximum": allowed,
    }
    status = Status.WARN if drop > allowed else Status.PASS
    detail = (
        f"{target} SM clock {median:.0f} MHz under load, {drop:.0%} below its max "
        f"{sm_max:.0f} MHz" + (f" (more than {allowed:.0%})" if status is Status.WARN else "")
    )
    return ctx.result(target, "sm_clock_drop", status, detail, value=round(drop, 4), **evidence)


def _throttle(ctx: CheckContext, target: str, trace: dict[str, Any]) -> Result:
    readings = _present(trace.get("throttle") or [])
    if not readings:
        return ctx.result(
            target,
            "throttle",
            Status.SKIP,
            f"{target}: clock-event reasons not available during the burn",
        )
    seen = Counter(reason for reasons in readings for reason in reasons)
    abnormal = sorted(r for r in seen if r in ABNORMAL_THROTTLE)
    evidence: dict[str, Any] = {
        "reasons_seen": dict(sorted(seen.items())),
        "readings": len(readings),
    }
    if abnormal:
        words = ", ".join(f"{r} in {seen[r]} of {len(readings)} readings" for r in abnormal)
        return ctx.result(
            target,
            "throttle",
            Status.FAIL,
            f"{target} clocks held down under load by {words}: the hardware is "
            "protecting itself (heat, power brake or an external slowdown "
            "signal); check cooling and power delivery",
            value=",".join(abnormal),
            **evidence,
        )
    return ctx.result(
        target,
        "throttle",
        Status.PASS,
        f"{target}: no hardware throttling under load (seen: "
        f"{', '.join(sorted(seen)) or 'no reasons'})",
        value="",
        **evidence,
    )


def _memory_temperature(
    ctx: CheckContext, target: str, trace: dict[str, Any], limits: dict[str, Any]
) -> Result:
    present = _present(trace.get("mem_temp_c") or [])
    if not present:
        return ctx.result(
            target,
            "memory_temperature_max_c",
            Status.SKIP,
            f"{target}: memory temperature not reported by this GPU",
        )
    hottest, mem_max = max(present), limits["memory_max_c"]
    hot = mem_max is not None and hottest >= mem_max
    return ctx.result(
        target,
        "memory_temperature_max_c",
        Status.WARN if hot else Status.PASS,
        f"{target} HBM max {hottest:g} °C under load"
        + (f", at or above its max operating {mem_max:g} °C" if hot else ""),
        value=hottest,
        unit="°C",
        max_c=mem_max,
    )
