"""Check ``hbm_bandwidth``: device-to-device copy bandwidth of each GPU's memory.

Per GPU: two buffers of ``size_bytes`` (default 4 GiB, far beyond any cache, as nvbandwidth and
BabelStream size theirs) on the device, ``warmup`` untimed copies, then ``reps`` copies each
timed on the device's clock (synchronise, clock, copy, synchronise, clock). A copy reads and
writes every byte, so it moves ``2 x size_bytes`` (STREAM/BabelStream "copy" convention);
GB/s = 10^9 B/s. The GPUs are measured one at a time, round-robin per repetition, so anything
that disturbs the host for a moment (another process, a page-cache flush) lands on all GPUs
alike instead of on the one being measured.

Result per GPU (target ``gpu:N``): ``copy_gbps`` = the 90th percentile of the repetitions'
GB/s, with median, max, min and the figures of the run in evidence. Not the median, for the
reason ``pcie_bandwidth`` gives: a busy host can only slow a copy down, so the upper figures
are the GPU's and the lower ones the host's (docs/load_tests.md). Graded against the GPU's
siblings (graders/performance.yaml) and, where the figures are measured
(``ports.compute.measured``), the SKU's ``hbm_bw_gbps_min``.

On a stand-in node each GPU is a CPU stand-in (``node_agent.compute.devices``): the same code
copies CPU tensors at the suite's stand-in size, but a copy's time is modelled, not measured
(:mod:`node_agent.compute.copy_model`: 1.15 x the SKU's ``hbm_bw_gbps_min``, times a ``slow``
GPU's factor), because CPU memcpys time the host's load rather than a GPU's memory; a healthy
stand-in node therefore grades the same on an idle and on a busy machine.
In the daemon the latest figures are exported by :class:`HbmMetrics` (``SERVICE``).
Params: ``size_bytes`` (4 GiB), ``reps`` (10), ``warmup`` (2), ``sample_min_s`` (0: one copy
per repetition on a real GPU; ignored where copies are modelled).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from node_agent.checking.behaviour import (
    ServiceBehaviour,
)
from node_agent.checking.context import CheckContext
from node_agent.checking.figure_gauge import figure_gauge
from node_agent.checking.transfer import (
    CopyParams,
    copy_bytes,
    error_results,
    grade_figures,
    open_models,
    open_specs,
    rep_stats,
    timed_copy,
)
from node_agent.compute.devices import ComputeDevice, open_device
from node_agent.model import Result

DEFAULT_SIZE_BYTES = 4 << 30
METRIC = "copy_gbps"


@dataclass(frozen=True)
class Params(CopyParams):
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    CHECK: ClassVar[str] = "hbm_bandwidth"
    size_bytes: int = DEFAULT_SIZE_BYTES


def run(ctx: CheckContext) -> list[Result]:
    specs, unavailable = open_specs(ctx)
    if unavailable:
        return unavailable
    p = ctx.typed_params(Params)
    size, reps, warmup, sample_min_s = p.size_bytes, p.reps, p.warmup, p.sample_min_s
    models = open_models(ctx, specs)
    import torch

    out: list[Result] = []
    devices: dict[int, tuple[ComputeDevice, Any, Any]] = {}
    for spec in specs:
        try:
            dev = open_device(spec)
            src = torch.ones(size, dtype=torch.uint8, device=dev.device)
            dst = torch.empty_like(src)
            for _ in range(warmup):
                dst.copy_(src)
            dev.synchronize()
            devices[spec.index] = (dev, src, dst)
        except Exception as err:  # noqa: BLE001 - one GPU's failure is that GPU's result
            out.extend(
                error_results(
                    ctx, [METRIC], spec.index, err, f"allocating 2 x {size} B and warming up"
                )
            )
    times: dict[int, list[float]] = {i: [] for i in devices}
    failed: set[int] = set()
    for _ in range(reps):
        for index, (dev, src, dst) in devices.items():
            if index in failed:
                continue
            try:
                times[index].append(
                    timed_copy(
                        dev,
                        functools.partial(dst.copy_, src),
                        "hbm",
                        copy_bytes(size),
                        models.get(index),
                        sample_min_s,
                    )
                )
            except Exception as err:  # noqa: BLE001
                failed.add(index)
                out.extend(error_results(ctx, [METRIC], index, err, "the timed copy"))
    figures: dict[int, float] = {}
    evidence: dict[int, dict[str, Any]] = {}
    for index, (dev, _, _) in devices.items():
        if index in failed:
            continue
        stats = rep_stats(copy_bytes(size), times[index])
        figures[index] = stats.p90_gbps  # see the module docstring
        evidence[index] = {
            **stats.evidence(),
            "size_bytes": size,
            "bytes_per_copy": copy_bytes(size),
            "warmup": warmup,
            "counting": "2 x size per copy (read + write)",
            "times_s": [round(t, 9) for t in times[index]],
            **dev.info(),
            **(models[index].evidence() if index in models else {}),
        }
    devices.clear()  # free the buffers before grading
    out.extend(grade_figures(ctx, METRIC, "HBM copy", figures, evidence, "hbm_bw_gbps_min"))
    return out


#: ``node_agent_gpu_hbm_copy_bytes_per_second{gpu,uuid}``: the latest run's ``copy_gbps`` per GPU
HbmMetrics = figure_gauge(
    "node_agent_gpu_hbm_copy_bytes_per_second",
    "Device-to-device copy bandwidth of the GPU's memory in the latest hbm_bandwidth run "
    "(bytes/s, the p90 of its repetitions)",
    (), 1e9, lambda r: [] if r.metric == METRIC else None)  # fmt: skip


SERVICE = ServiceBehaviour(metrics=HbmMetrics)
