"""The GPU burn as checks start it: its plan from a check's params, running it on the node's
GPUs within the check's timeout, and the workers that failed. ``gpu_burn`` reports its
throughput and correctness; ``thermal_power`` runs a short one when the suite ran no
``gpu_burn`` before it. Not a check (not in the registry): a helper below both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.compute.burn import BurnOutcome, BurnPlan, run_burn
from node_agent.compute.devices import ComputeUnavailable
from node_agent.model import Result, Status

DEFAULT_PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


B = TypeVar("B", bound="BurnParams")


@dataclass(frozen=True)
class BurnParams:
    """The burn's parameters (a suite's ``params``), validated by :meth:`parse`; ``gpu_burn``
    and ``thermal_power`` each subclass it as their ``Params`` with their own duration."""

    CHECK: ClassVar[str] = "gpu_burn"

    duration_s: float = 300.0
    precisions: tuple[str, ...] = ()  # empty: the SKU's, else DEFAULT_PRECISIONS
    size: int = 8192
    sample_s: float = 1.0
    verify_every: int = 8
    verify_block: int = 8
    verify_lag: int = 2
    verify_budget: float | None = BurnPlan.verify_budget  # null: no bound
    stall_s: float = 60.0
    startup_timeout_s: float = 180.0
    sample_interval_s: float = 1.0

    @classmethod
    def parse(cls: type[B], raw: Mapping[str, Any]) -> B:
        """ValueError naming the key and what was expected."""
        r = Reader(cls.CHECK, raw, cls)
        budget = r.nullable_number("verify_budget", above=0)
        if budget is not None and budget > 1:
            r.fail("verify_budget", budget, "a fraction above 0 and at most 1, or null")
        return cls(
            duration_s=r.positive("duration_s"),
            precisions=r.strings("precisions"),
            size=r.integer("size", 1),
            sample_s=r.positive("sample_s"),
            verify_every=r.integer("verify_every", 1),
            verify_block=r.integer("verify_block", 1),
            verify_lag=r.integer("verify_lag", 0),
            verify_budget=budget,
            stall_s=r.positive("stall_s"),
            startup_timeout_s=r.positive("startup_timeout_s"),
            sample_interval_s=r.positive("sample_interval_s"),
        )


def sku_precisions(ctx: CheckContext, p: BurnParams) -> tuple[str, ...]:
    """The precisions to burn: ``params.precisions``, else the SKU's, else a safe default."""
    if p.precisions:
        return p.precisions
    listed = ctx.sku.section("burn").get("precisions") if ctx.sku else None
    return tuple(listed) if listed else DEFAULT_PRECISIONS


def make_plan(ctx: CheckContext, p: BurnParams, max_precisions: int | None = None) -> BurnPlan:
    return BurnPlan(
        size=p.size,
        duration_s=p.duration_s,
        precisions=sku_precisions(ctx, p),
        max_precisions=max_precisions,
        sample_s=p.sample_s,
        verify_every=p.verify_every,
        verify_block=p.verify_block,
        verify_lag=p.verify_lag,
        verify_budget=p.verify_budget,
        stall_s=p.stall_s,
        startup_timeout_s=p.startup_timeout_s,
    )


def burn(ctx: CheckContext, plan: BurnPlan, sample_interval_s: float) -> BurnOutcome | list[Result]:
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
    margin_s = max(10.0, 0.1 * ctx.timeout_s)  # for killing stragglers and reporting
    deadline_s = ctx.remaining_s(margin_s)  # from now: the runner's deadline, less the margin
    if plan.duration_s + plan.stall_s > deadline_s:
        return [
            ctx.result(
                "node",
                "burn_plan",
                Status.ERROR,
                f"params.duration_s {plan.duration_s:g} s plus stall_s "
                f"{plan.stall_s:g} s does not fit in the check's timeout_s "
                f"{ctx.timeout_s:g} s (less a {margin_s:g} s "
                "margin): raise timeout_s in the suite file or shorten the burn",
                duration_s=plan.duration_s,
                timeout_s=ctx.timeout_s,
            )
        ]
    return run_burn(
        specs,
        plan,
        ctx.gpu,
        sample_interval_s=sample_interval_s,
        deadline_s=deadline_s,
        load_hint=ctx.ports.load_hint,
    )


def worker_failures(ctx: CheckContext, outcome: BurnOutcome) -> list[Result]:
    """One ``error`` result per GPU whose worker died or stalled; but where every GPU's worker
    failed the same way (one error, or none ever got running), one ``node`` result
    ``workers_all_failed`` (rule ``burn-workers-all-failed``: software, held, never a GPU
    replaced): a torch built without this GPU's architecture, a CUDA or driver mismatch, memory
    another process holds. Eight GPUs do not fail alike at once; a software stack does."""
    workers = outcome.workers
    failed = {i: w for i, w in workers.items() if w.failure}
    words = {w.last_words for w in failed.values()}
    alike = len(words) == 1 and bool(next(iter(words)))  # one error, said by every worker
    never_ran = not any(w.samples for w in failed.values())
    if len(workers) >= 2 and len(failed) == len(workers) and (alike or never_ran):
        first = failed[min(failed)]
        return [
            ctx.result(
                "node",
                "workers_all_failed",
                Status.ERROR,
                f"every GPU's burn worker failed ({len(failed)} of {len(workers)}"
                + (f", each with: {first.last_words}" if alike else ", none got running")
                + "): the software stack, not the GPUs (a torch build without this GPU's "
                "architecture, a CUDA or driver mismatch, memory another process holds); check "
                "`python -c 'import torch; print(torch.cuda.get_arch_list())'` and the driver",
                per_gpu={f"gpu:{i}": w.failure_detail for i, w in sorted(failed.items())},
                traceback=first.traceback[-2000:],
            )
        ]
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
