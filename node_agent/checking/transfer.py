"""What the bandwidth checks (``hbm_bandwidth``, ``pcie_bandwidth``) share: the GB/s arithmetic,
timing on a compute device's clock, opening the devices, and grading the per-GPU figures.

Units: GB/s is 10^9 bytes per second, as nvidia-smi, bandwidthTest and nccl-tests print it.
Grading follows DESIGN.md: every figure is compared with the median of its siblings on the same
node (``graders/performance.yaml``: WARN clearly below, ``fail`` far below); the SKU's absolute
minimum (``graders/skus/*.yaml`` ``performance``) applies where the node's compute port measures
(``ports.compute.measured``: real GPUs), not to a stand-in node's CPU devices, whose absolute
figures mean nothing.

Timing: a real GPU's copies are timed on its clock (:func:`timed`); a stand-in GPU's copies
run on the CPU but their time is modelled from the SKU's link and memory figures and the
stand-in's faults (:func:`timed_copy`, :mod:`node_agent.compute.copy_model`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.siblings import compare_with_siblings, load_thresholds
from node_agent.compute.copy_model import CopyModel
from node_agent.compute.devices import ComputeDevice, ComputeSpec, ComputeUnavailable
from node_agent.model import Result, Status

GB = 1e9  # bytes in a GB (decimal, as bandwidth tools report)


def gbps(bytes_moved: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 B/s) of ``bytes_moved`` in ``seconds``.

    >>> gbps(copy_bytes(4 * 10**9), 0.004)   # a 4 GB device copy (read + write) in 4 ms
    2000.0
    """
    if seconds <= 0:
        raise ValueError(
            f"a transfer cannot take {seconds!r} s; the device clock did not "
            "advance (clock resolution too coarse for this size: use larger buffers)"
        )
    return bytes_moved / seconds / GB


def copy_bytes(size_bytes: int) -> int:
    """Bytes a device-to-device copy of ``size_bytes`` moves through memory: each byte is read
    once and written once (the STREAM "copy" and BabelStream convention), so 2 x size."""
    return 2 * size_bytes


@dataclass(frozen=True)
class RepStats:
    """Bandwidth over a run's repetitions (each timed on its own), in GB/s."""

    median_gbps: float
    max_gbps: float
    min_gbps: float
    reps: int
    p90_gbps: float  # exceeded by a tenth of the repetitions

    def evidence(self) -> dict[str, Any]:
        return {
            "median_gbps": round(self.median_gbps, 4),
            "max_gbps": round(self.max_gbps, 4),
            "min_gbps": round(self.min_gbps, 4),
            "p90_gbps": round(self.p90_gbps, 4),
            "reps": self.reps,
        }


def rep_stats(bytes_per_rep: int, times_s: Sequence[float]) -> RepStats:
    """Median, max and min bandwidth of repetitions that each moved ``bytes_per_rep``.

    >>> rep_stats(10**9, [0.5, 0.25, 1.0]).median_gbps
    2.0
    """
    if not times_s:
        raise ValueError("no repetition was timed (reps must be at least 1)")
    figures = [gbps(bytes_per_rep, t) for t in times_s]
    # "inclusive": interpolated between the figures, never beyond the largest
    p90 = (
        statistics.quantiles(figures, n=10, method="inclusive")[-1]
        if len(figures) > 1
        else figures[0]
    )
    return RepStats(
        median_gbps=statistics.median(figures),
        max_gbps=max(figures),
        min_gbps=min(figures),
        reps=len(figures),
        p90_gbps=p90,
    )


def timed(dev: ComputeDevice, work: Callable[[], object], min_s: float = 0.0) -> float:
    """Seconds one run of ``work`` takes on ``dev``'s clock, from idle to finished.

    ``work`` runs back to back until the clock has advanced by more than ``min_s`` (at least
    once, and until the clock moved at all); the result is the elapsed time over the runs.
    On a real GPU one large copy is milliseconds and ``min_s`` stays 0. On a stand-in device
    the clock is CPU time divided by the ``slow`` factor (:meth:`ComputeDevice.clock`), so a slow
    stand-in GPU measures slower; there the small CPU copies are microseconds, near the
    resolution of CPU-time accounting, and a ``min_s`` of a fraction of a millisecond keeps
    every sample well above it."""
    runs = 0
    dev.synchronize()
    start = dev.clock()
    while True:
        work()
        runs += 1
        dev.synchronize()
        elapsed = dev.clock() - start
        if elapsed > min_s and elapsed > 0:
            return elapsed / runs


def timed_copy(
    dev: ComputeDevice,
    work: Callable[[], object],
    kind: str,
    bytes_moved: int,
    model: CopyModel | None,
    min_s: float = 0.0,
) -> float:
    """Seconds one copy takes on ``dev``: timed on a real GPU (:func:`timed`), modelled on a
    stand-in.

    On a stand-in GPU the copy still runs once (the same buffers and code as on a GPU, and
    its failures are real), but the figure is ``model.seconds(kind, bytes_moved)``: CPU
    stand-ins timing memcpys measure the host's load, not a link (docs/load_tests.md), see
    :mod:`node_agent.compute.copy_model`.
    """
    if model is None:
        if dev.simulated:  # a CPU device's copy times the host's load, never a GPU's link
            raise ValueError(f"{dev.label} is a stand-in but has no copy model")
        return timed(dev, work, min_s)
    work()
    dev.synchronize()
    return model.seconds(kind, bytes_moved)


def open_models(ctx: CheckContext, specs: Sequence[ComputeSpec]) -> dict[int, CopyModel]:
    """The copy models of the node's stand-in GPUs (empty where compute is measured)."""
    return ctx.ports.compute.copy_models(list(specs))


def open_specs(ctx: CheckContext) -> tuple[list[ComputeSpec], list[Result] | None]:
    """The compute specs of the node's GPUs, or the results that say why there are none.

    Where compute is measured on the node's GPUs, a node without a driver skips
    (``ctx.gpus_unavailable``); a stand-in node computes on CPU stand-ins; torch missing or
    unable to use CUDA skips with the operator's next step."""
    if ctx.ports.compute.measured:
        unavailable = ctx.gpus_unavailable()
        if unavailable:
            return [], unavailable
    indices = sorted(d.index for d in ctx.gpu.devices())
    if not indices:
        return [], [ctx.skip("no GPUs visible: nothing to measure")]
    try:
        return ctx.ports.compute.specs(indices), None
    except ComputeUnavailable as err:
        return [], ctx.compute_unavailable(str(err))


def grade_figures(
    ctx: CheckContext,
    metric: str,
    what: str,
    figures: Mapping[int, float],
    evidence: Mapping[int, dict[str, Any]],
    minimum_key: str | None,
    ungraded_reason: str | None = None,
) -> list[Result]:
    """One result per GPU for ``metric`` (GB/s, higher is better): siblings first, then the
    SKU's ``minimum_key`` on real hardware. A figure can be both far below its siblings and
    below the minimum; the detail then says both. With ``ungraded_reason`` the figures are
    reported (ratio to the siblings in evidence) but always ``pass``, the reason in the detail."""
    verdicts = compare_with_siblings(figures, load_thresholds(ctx.config), what, "GB/s")
    minimum = ctx.sku.minimum(minimum_key) if ctx.sku and minimum_key else None
    measured = ctx.ports.compute.measured
    apply_minimum = minimum is not None and measured and ungraded_reason is None
    out = []
    for index, value in sorted(figures.items()):
        verdict = verdicts[index]
        status, findings = verdict.status, [verdict.detail] if verdict.detail else []
        if ungraded_reason is not None:
            status, findings = Status.PASS, []
        if apply_minimum and minimum is not None and value < minimum:
            status = Status.FAIL
            findings.append(
                f"gpu:{index} {what} {value:.4g} GB/s is below the SKU minimum "
                f"{minimum:g} GB/s ({ctx.sku.id if ctx.sku else 'no SKU'})"
            )
        if findings:
            detail = "; ".join(findings)
        else:
            note = (
                f"not graded: {ungraded_reason}"
                if ungraded_reason is not None
                else "no SKU minimum applied: modelled figures of stand-in GPUs"
                if not measured and minimum
                else f"SKU minimum {minimum:g} GB/s"
                if apply_minimum
                else "no SKU minimum"
            )
            median = verdict.siblings_median
            detail = (
                f"gpu:{index} {what} {value:.4g} GB/s"
                + (f" (siblings' median {median:.4g} GB/s)" if median else "")
                + f"; {note}"
            )
        out.append(
            ctx.result(
                f"gpu:{index}",
                metric,
                status,
                detail,
                value=round(value, 4),
                unit="GB/s",
                minimum=minimum if apply_minimum else None,
                **verdict.evidence(),
                **evidence.get(index, {}),
            )
        )
    return out


def error_results(
    ctx: CheckContext, metrics: Sequence[str], index: int, err: BaseException, doing: str
) -> list[Result]:
    """``error`` results for one GPU whose measurement broke (the others still report)."""
    hint = (
        " (out of memory: lower params.size_bytes or free the GPU)"
        if "out of memory" in str(err).lower()
        else ""
    )
    return [
        ctx.result(
            f"gpu:{index}",
            metric,
            Status.ERROR,
            f"gpu:{index}: {doing} failed: {type(err).__name__}: {err}{hint}",
            error=f"{type(err).__name__}: {err}",
        )
        for metric in metrics
    ]


C = TypeVar("C", bound="CopyParams")


@dataclass(frozen=True)
class CopyParams:
    """The copy measurement's parameters both bandwidth checks take (a suite's ``params``),
    validated by :meth:`parse`; each check's ``Params`` subclasses it, with its own
    ``size_bytes`` default and name."""

    CHECK: ClassVar[str] = "copy"

    size_bytes: int = 256 << 20
    reps: int = 10
    warmup: int = 2
    sample_min_s: float = 0.0

    @classmethod
    def parse(cls: type[C], raw: Mapping[str, Any]) -> C:
        """ValueError naming the key and what was expected."""
        return cls(**cls.read(Reader(cls.CHECK, raw, cls)))

    @classmethod
    def read(cls, r: Reader) -> dict[str, Any]:
        """The copy fields read by ``r``; a subclass's ``parse`` adds its own."""
        return {
            "size_bytes": r.integer("size_bytes", 1),
            "reps": r.integer("reps", 1),
            "warmup": r.integer("warmup", 0),
            "sample_min_s": r.number("sample_min_s", at_least=0),
        }
