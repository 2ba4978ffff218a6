"""The GPU burn as checks start it: its plan from a check's params, running it on the node's
GPUs within the check's timeout, and the workers that failed. ``gpu_burn`` reports its
throughput and correctness; ``thermal_power`` runs a short one when the suite ran no
``gpu_burn`` before it. Not a check (not in the registry): a helper below both."""

from __future__ import annotations

from node_agent.checks import CheckContext
from node_agent.compute.burn import BurnOutcome, BurnPlan, run_burn
from node_agent.compute.devices import ComputeUnavailable
from node_agent.model import Result, Status

DEFAULT_PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def sku_precisions(ctx: CheckContext) -> tuple[str, ...]:
    """The precisions to burn: ``params.precisions``, else the SKU's, else a safe default."""
    if ctx.params.get("precisions"):
        return tuple(ctx.params["precisions"])
    listed = ctx.sku.section("burn").get("precisions") if ctx.sku else None
    return tuple(listed) if listed else DEFAULT_PRECISIONS


def make_plan(
    ctx: CheckContext,
    precisions: tuple[str, ...],
    duration_s: float,
    max_precisions: int | None = None,
) -> BurnPlan:
    p = ctx.params
    return BurnPlan(
        size=int(p.get("size", 8192)),
        duration_s=float(duration_s),
        precisions=precisions,
        max_precisions=max_precisions,
        sample_s=float(p.get("sample_s", 1.0)),
        verify_every=int(p.get("verify_every", 8)),
        verify_block=int(p.get("verify_block", 8)),
        verify_lag=int(p.get("verify_lag", 2)),
        stall_s=float(p.get("stall_s", 60.0)),
        startup_timeout_s=float(p.get("startup_timeout_s", 180.0)),
    )


def burn(ctx: CheckContext, plan: BurnPlan) -> BurnOutcome | list[Result]:
    """Run the burn on every GPU of the node, or say why it cannot run (skip/error results).

    Finishes within the check's ``timeout_s``: the engine's deadline leaves a margin for
    killing stragglers, and a duration that cannot fit is an error before anything starts."""
    unavailable = ctx.gpus_unavailable()
    if unavailable:
        return unavailable
    indices = [d.index for d in ctx.gpu.devices()]
    if not indices:
        return [ctx.skip("no GPUs visible: nothing to burn")]
    try:
        specs = ctx.ports.compute.specs(indices)
    except ComputeUnavailable as err:
        return ctx.compute_unavailable(str(err))
    deadline_s = ctx.timeout_s - max(10.0, 0.1 * ctx.timeout_s)
    if plan.duration_s + plan.stall_s > deadline_s:
        return [
            ctx.result(
                "node",
                "burn_plan",
                Status.ERROR,
                f"params.duration_s {plan.duration_s:g} s plus stall_s "
                f"{plan.stall_s:g} s does not fit in the check's timeout_s "
                f"{ctx.timeout_s:g} s (less a {ctx.timeout_s - deadline_s:g} s "
                "margin): raise timeout_s in the suite file or shorten the burn",
                duration_s=plan.duration_s,
                timeout_s=ctx.timeout_s,
            )
        ]
    return run_burn(
        specs,
        plan,
        ctx.gpu,
        sample_interval_s=float(ctx.params.get("sample_interval_s", 1.0)),
        deadline_s=deadline_s,
        load_hint=ctx.ports.load_hint,
    )


def worker_failures(ctx: CheckContext, outcome: BurnOutcome) -> list[Result]:
    """One ``error`` result per GPU whose worker died or stalled."""
    out = []
    for index, w in sorted(outcome.workers.items()):
        if w.failure:
            out.append(
                ctx.result(
                    f"gpu:{index}",
                    w.failure,
                    Status.ERROR,
                    w.failure_detail + "; look for Xid errors in the kernel log, reset the GPU "
                    "and re-run the burn",
                    exitcode=w.exitcode,
                    error=w.last_words,
                    traceback=w.traceback[-2000:],
                    samples_received=len(w.samples),
                )
            )
    return out
