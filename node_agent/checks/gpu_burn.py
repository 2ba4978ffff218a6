"""Check ``gpu_burn``: every GPU at once under large GEMMs, throughput and correctness.

One worker process per GPU runs n×n GEMMs back to back for ``duration_s`` in each precision the
SKU lists (``burn.precisions`` in ``graders/skus/*.yaml``) that the device supports, the
duration split evenly between them (engine and verification: :mod:`node_agent.compute.burn`). Results:

- ``tflops_<precision>`` per GPU: the median of the sustained-TFLOP/s samples (on a stand-in
  node the GEMM time is modelled from the SKU's rate: ``ComputeDevice.gemm_seconds``), status
  from the GPU's ratio to its siblings' median (``graders/performance.yaml``) and, where the
  figures are measured (``ports.compute.measured``), the SKU minimum
  ``tflops_<precision>_min`` (below it: ``fail``). Evidence: ``samples`` (``[[t_s, tflops],
  ...]`` over time), ``device``, ``siblings_median``, ``ratio_to_siblings``, ``minimum``.
- ``wrong_elements`` per GPU: ``fail`` when a wrong product repeated on its re-run
  (confirmed), ``warn`` when it did not (transient, evidence kept), else ``pass``.
- ``worker_died`` / ``worker_stalled`` (``error``) for a GPU whose worker exited or went silent
  for ``stall_s``; the other GPUs' results are still reported.
- ``tflops_<precision>`` ``skip`` on ``node`` for a precision that could not run, with why.

Params (seconds, except ``size``): ``duration_s`` (300), ``size`` (8192), ``precisions``
(default: the SKU's), ``sample_s`` (1), ``sample_interval_s`` (telemetry, 1), ``verify_every``
(8), ``verify_block`` (8), ``verify_lag`` (2: verified products whose on-device check may still
be in flight; the host never runs further ahead), ``stall_s`` (60), ``startup_timeout_s``
(180).

Output ``trace`` (declared in :data:`OUTPUTS`, read by ``thermal_power``): per GPU index, the
telemetry read through the GPU layer during the burn joined with the throughput:
``{"t_s", "tflops", "temp_c", "power_w", "sm_clock_mhz", "mem_temp_c", "throttle",
"power_limit_w", "slowdown_temp_c"}`` (lists over time, the last two single values);
``thermal_power`` grades it and the HTML report plots it.

In the daemon the latest figures are exported by :class:`BurnMetrics` (``SERVICE``).

Torch is required (the compute layer is torch-only; a CuPy engine would duplicate all of it):
without torch, or on a host where torch cannot use CUDA, the check skips with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from node_agent.checking.behaviour import (
    ServiceBehaviour,
    label,
    put_output,
)
from node_agent.checking.burn_run import BurnParams, burn, make_plan, worker_failures
from node_agent.checking.context import CheckContext
from node_agent.checking.figure_gauge import figure_gauge
from node_agent.checking.siblings import compare_with_siblings, load_thresholds
from node_agent.compute.burn import BurnOutcome, BurnPlan, Sample, WorkerReport
from node_agent.model import Result, Status

#: what the burn hands to later checks of the suite run (checking/behaviour.py)
OUTPUTS = ("trace",)


@dataclass(frozen=True)
class Params(BurnParams):
    """The burn's parameters (checking/burn_run.py), 300 s by default."""

    CHECK: ClassVar[str] = "gpu_burn"


def run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    outcome = burn(ctx, make_plan(ctx, params), params.sample_interval_s)
    if isinstance(outcome, list):
        return outcome
    put_output(ctx, "trace", outcome.trace())
    results = [
        ctx.result("node", f"tflops_{p}", Status.SKIP, why) for p, why in outcome.skipped.items()
    ]
    results += worker_failures(ctx, outcome)
    results += _throughput(ctx, outcome)
    results += [
        r
        for i, w in sorted(outcome.workers.items())
        if (r := _wrong_elements(ctx, i, w, outcome.plan)) is not None
    ]
    if not any(r.status is not Status.SKIP for r in results):
        results.append(
            ctx.result(
                "node",
                "ran",
                Status.ERROR,
                "the burn ran no GEMM on any GPU (see the other results)",
            )
        )
    for r in results:
        r.duration_s = outcome.duration_s
    return results


def _sig(value: float) -> float:
    return float(f"{value:.6g}")


def _throughput(ctx: CheckContext, outcome: BurnOutcome) -> list[Result]:
    thresholds = load_thresholds(ctx.config)
    plan = outcome.plan
    out: list[Result] = []
    for precision in outcome.precisions:
        # The median window: sustained throughput, throttling included.
        estimator = "median"
        values: dict[int, float] = {}
        for index, w in outcome.workers.items():
            figure = w.median_tflops(precision)
            if w.failure is None and figure is not None:
                values[index] = figure
        verdicts = compare_with_siblings(
            values, thresholds, what=f"{precision} GEMM", unit="TFLOP/s"
        )
        minimum = (
            ctx.sku.minimum(f"tflops_{precision}_min")
            if ctx.sku and ctx.ports.compute.measured
            else None
        )
        for index, value in sorted(values.items()):
            w = outcome.workers[index]
            verdict = verdicts[index]
            status, details = verdict.status, [verdict.detail] if verdict.detail else []
            if minimum is not None and value < minimum:
                sku = ctx.sku.display_name if ctx.sku else "the SKU file"
                details.append(
                    f"gpu:{index} {precision} GEMM {value:.4g} TFLOP/s is below the "
                    f"SKU minimum {minimum:g} TFLOP/s ({sku})"
                )
                tel = outcome.telemetry.get(index)
                cap = tel.power_cap if tel is not None else None
                # a GPU loses less throughput than power under a cap (its clocks drop, its
                # work per watt rises): below the minimum scaled by the cap is more than it
                capped = minimum * cap if cap is not None else None
                if capped is not None and value >= capped:
                    status = max(status, Status.WARN, key=lambda s: s.severity)
                    details.append(
                        f"its power limit is capped below the board's default, and the SKU "
                        f"minimum assumes the default; at most in proportion to the cap it "
                        f"would be {capped:.4g} TFLOP/s, which it reaches: the setting, not the "
                        "GPU (restore the limit with nvidia-smi -pl to test the GPU)"
                    )
                else:
                    status = Status.FAIL
            samples = w.samples_of(precision)
            if not details:
                sib = (
                    f"; siblings' median {verdict.siblings_median:.4g} TFLOP/s"
                    if verdict.siblings_median is not None
                    else ""
                )
                what = "median" if estimator == "median" else "upper quartile"
                details.append(
                    f"gpu:{index} {precision} GEMM {value:.4g} TFLOP/s sustained "
                    f"({what} of {len(samples)} samples, n={plan.size}){sib}"
                )
            out.append(
                ctx.result(
                    f"gpu:{index}",
                    f"tflops_{precision}",
                    status,
                    "; ".join(details),
                    value=_sig(value),
                    unit="TFLOP/s",
                    samples=[[round(s.t1_s, 3), _sig(s.tflops)] for s in samples],
                    device=w.info,
                    minimum=minimum,
                    size=plan.size,
                    estimator=estimator,
                    median_tflops=_sig(w.median_tflops(precision) or 0.0),
                    products_verified=sum(s.verified for s in samples),
                    verify_every=plan.verify_every,
                    verify_interval=_interval(samples, plan),
                    **verdict.evidence(),
                )
            )
    return out


def _interval(samples: list[Sample], plan: BurnPlan) -> int:
    """One product in this many was verified: the largest interval the samples report (the
    engine widens ``verify_every`` to keep checks within ``verify_budget``)."""
    return max((s.verify_interval for s in samples), default=0) or plan.verify_every


def _intervals_text(intervals: dict[str, int], plan: BurnPlan) -> str:
    if len(set(intervals.values())) <= 1:
        return str(next(iter(intervals.values()), plan.verify_every))
    return ", ".join(f"{n} ({p})" for p, n in intervals.items())


def _wrong_elements(
    ctx: CheckContext, index: int, w: WorkerReport, plan: BurnPlan
) -> Result | None:
    if not w.samples and not w.wrong_events:
        return None  # never ran: its failure or the node-level skip says why
    target = f"gpu:{index}"
    verified = sum(s.verified for s in w.samples)
    intervals = {
        p: _interval([s for s in w.samples if s.precision == p], plan)
        for p in dict.fromkeys(s.precision for s in w.samples)
    }
    evidence: dict[str, Any] = {
        "events": w.wrong_events,
        "events_total": w.wrong_events_total,
        "products_verified": verified,
        "verify_every": plan.verify_every,
        "verify_interval": intervals,
        "method": "block Freivalds on the device, read back without "
        "stalling it; flagged rows recomputed in float64 "
        "on the CPU, re-run once to confirm",
    }
    confirmed = [e for e in w.wrong_events if e["confirmed"]]
    events = confirmed or w.wrong_events
    if not events:
        return ctx.result(
            target,
            "wrong_elements",
            Status.PASS,
            f"gpu:{index}: no wrong elements in {verified} verified products "
            f"(one in {_intervals_text(intervals, plan)} verified)",
            value=0,
            unit="elements",
            **evidence,
        )
    count = sum(e["wrong"] for e in events)
    where = ", ".join(
        sorted({f"{e['precision']} {'x'.join(map(str, e['shape']))}" for e in events})
    )
    if confirmed:
        detail = (
            f"gpu:{index} computed wrong results: {count} wrong elements in {where} "
            f"GEMMs ({len(confirmed)} products), repeated on re-run: confirmed silent "
            "data corruption; replace the GPU"
        )
        status = Status.FAIL
    else:
        detail = (
            f"gpu:{index} computed {count} wrong elements in {where} GEMMs once; the "
            "re-run was right (transient; evidence kept, re-test)"
        )
        status = Status.WARN
    return ctx.result(
        target, "wrong_elements", status, detail, value=count, unit="elements", **evidence
    )


def _precision(result: Result) -> list[str] | None:
    return (
        [label(result.metric.removeprefix("tflops_"))]
        if result.metric.startswith("tflops_")
        else None
    )


#: ``node_agent_gpu_burn_flops_per_second{gpu,uuid,precision}``: the latest run's
#: ``tflops_<precision>`` per GPU in FLOP/s, for the fleet's outlier rules (packaging/prometheus/)
BurnMetrics = figure_gauge(
    "node_agent_gpu_burn_flops_per_second",
    "Sustained GEMM throughput of the GPU in the latest gpu_burn run (FLOP/s), per precision",
    ("precision",), 1e12, _precision)  # fmt: skip


SERVICE = ServiceBehaviour(metrics=BurnMetrics)
