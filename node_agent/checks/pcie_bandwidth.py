"""Check ``pcie_bandwidth``: host<->device copy bandwidth per GPU, alone and all together, and
the PCIe link each GPU trained to, read while it carries traffic.

Per GPU a host buffer (page-locked — pinned — on CUDA, as ``bandwidthTest --memory=pinned``
and nvbandwidth measure) and a device buffer of ``size_bytes`` (default 256 MiB); ``warmup``
untimed copies each way, then:

1. **One at a time** (``h2d_gbps``, ``d2h_gbps``): ``reps`` host-to-device and device-to-host
   copies per GPU, each timed on the device's clock (synchronise, clock, copy, synchronise,
   clock), round-robin over the GPUs so a passing disturbance of the host hits all GPUs alike.
   A copy moves ``size_bytes`` once (bandwidthTest's convention); GB/s = 10^9 B/s. The value is
   the 90th percentile of the repetitions' GB/s (median, max and min are in evidence): a
   host<->device copy also crosses host memory and the CPU that waits on it, so a busy host
   slows some repetitions — never speeds one up — and the upper figures are the link's own
   (why p90 and not the median: docs/load_tests.md).
2. **Link under load** (``pcie_link_under_load``): each GPU copies back to back while another
   thread reads its link (``GpuDevice.pcie()``, NVML ``nvmlDeviceGetCurrPcieLinkGeneration``/
   ``Width``); copies continue until the reading has landed. An idle GPU drops its link to a
   lower generation to save power, so an idle reading says nothing; under load a link below the
   SKU's ``pcie`` gen/width (or the link's own maximum when there is no SKU) is a degraded
   link. Readings the backend cannot give are ``skip``.
3. **All together** (``h2d_gbps_concurrent``, ``d2h_gbps_concurrent``): one thread per GPU,
   each on its own CUDA stream, started together (a barrier), each copying back to back for the
   same window of ``concurrent_s`` seconds, timing each copy; a GPU's figure is the 90th
   percentile of its copies' GB/s (copies the contended host disturbed are left out). GPUs behind one PCIe switch share its uplink, so together they can fall well
   below their figures alone; the evidence keeps the node's aggregate and its ratio to the sum
   of the one-at-a-time figures.

Grading: every metric against the GPU's siblings (graders/performance.yaml); on real hardware
the one-at-a-time figures also against the SKU's ``pcie_h2d_gbps_min``/``pcie_d2h_gbps_min``
(not the concurrent ones: a healthy shared switch legitimately divides its uplink). Where the
node's compute port models its figures (CPU stand-ins), the concurrent figures are reported,
not graded (``STAND_IN_TOGETHER``).

On a stand-in node each GPU is a CPU stand-in (``node_agent.compute.devices``): pinned memory
is skipped (``pin_memory`` needs CUDA) and the "transfers" are CPU-to-CPU tensor copies — the
evidence says so. Their time is modelled, not measured (:mod:`node_agent.compute.copy_model`):
the link's data rate (the SKU's generation, the stand-in's ``pcie_width`` lanes) x 0.83 x a
``slow`` GPU's factor (why modelled: docs/load_tests.md). The link under load comes from the
stand-in's NVML.
In the daemon the latest figures are exported by :class:`PcieMetrics` (``SERVICE``).
Params: ``size_bytes`` (256 MiB), ``reps`` (10), ``warmup`` (2), ``concurrent_s`` (2.0 per
direction), ``link_timeout_s`` (10), ``worker_timeout_s`` (120 + 2 x concurrent_s),
``sample_min_s`` (0: one copy per timed sample; see ``transfer.timed``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from node_agent.checking.behaviour import (
    ServiceBehaviour,
)
from node_agent.checking.context import CheckContext
from node_agent.checking.figure_gauge import figure_gauge
from node_agent.checking.params import Reader
from node_agent.checking.transfer import (
    CopyParams,
    error_results,
    grade_figures,
    open_models,
    open_specs,
    rep_stats,
    timed_copy,
)
from node_agent.compute.copy_model import CopyModel
from node_agent.compute.devices import ComputeDevice, ComputeSpec, open_device
from node_agent.gpu.base import GpuDevice, GpuError, NoPermission, NotSupported, PcieLink
from node_agent.model import Result, Status

DEFAULT_LINK_TIMEOUT_S = 10.0
DEFAULT_CONCURRENT_S = 2.0
ALONE = ("h2d_gbps", "d2h_gbps")
TOGETHER = ("h2d_gbps_concurrent", "d2h_gbps_concurrent")
LINK = "pcie_link_under_load"
# CPU stand-ins copying at once contend for the host's cores and caches, not for a PCIe switch,
# and differ from one another by more than a slow GPU would (docs/load_tests.md)
STAND_IN_TOGETHER = (
    "stand-in node: CPU stand-ins copying together contend for the host's "
    "cores and caches, not for a PCIe switch (graded on real hardware)"
)
STAND_IN_NOTE = (
    "stand-in: CPU-to-CPU tensor copies, not pinned (pin_memory needs CUDA), "
    "timed by the copy model (the link's rate x efficiency x slow factor; "
    "node_agent.compute.copy_model); only the ratios to the siblings are graded"
)


@dataclass
class _Gpu:
    """One GPU's buffers and stream for the whole check."""

    dev: ComputeDevice
    host: Any  # torch.Tensor on the CPU, pinned on CUDA nodes
    device_buf: Any  # torch.Tensor on the device
    stream: Any  # torch.cuda.Stream, or None on the CPU
    model: CopyModel | None = None  # a stand-in GPU's modelled copy rates
    times: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in ALONE})

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.stream)

    def h2d(self) -> None:
        with self.stream_context():
            self.device_buf.copy_(self.host, non_blocking=True)

    def d2h(self) -> None:
        with self.stream_context():
            self.host.copy_(self.device_buf, non_blocking=True)

    def timed(self, kind: str, min_s: float) -> float:
        """Seconds of one ``h2d`` or ``d2h`` copy (timed on a GPU, modelled on a stand-in)."""
        work = self.h2d if kind == "h2d" else self.d2h
        return timed_copy(self.dev, work, kind, int(self.host.numel()), self.model, min_s)


@dataclass(frozen=True)
class Params(CopyParams):
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    CHECK: ClassVar[str] = "pcie_bandwidth"
    link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S
    concurrent_s: float = DEFAULT_CONCURRENT_S
    worker_timeout_s: float | None = None  # None: 120 s plus two concurrent windows

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader(cls.CHECK, raw, cls)
        return cls(
            **cls.read(r),
            link_timeout_s=r.positive("link_timeout_s"),
            concurrent_s=r.positive("concurrent_s"),
            worker_timeout_s=r.optional_number("worker_timeout_s", above=0),
        )


def run(ctx: CheckContext) -> list[Result]:
    specs, unavailable = open_specs(ctx)
    if unavailable:
        return unavailable
    p = ctx.typed_params(Params)
    size, reps, warmup, sample_min_s = p.size_bytes, p.reps, p.warmup, p.sample_min_s
    link_timeout, window_s = p.link_timeout_s, p.concurrent_s
    # workers start, allocate and warm up, then copy for two windows
    worker_timeout = p.worker_timeout_s or 120.0 + 2 * window_s

    models = open_models(ctx, specs)
    # 1. one at a time, round-robin per repetition
    gpus, out = _alone(ctx, specs, models, size, warmup, reps, sample_min_s)
    # 2. the link, read while the GPU copies
    nvml = {d.index: d for d in ctx.gpu.devices()}
    links = {i: _link_under_load(g, nvml.get(i), link_timeout) for i, g in gpus.items()}
    # 3. all together, each GPU in its own process (the parent's buffers freed first)
    alone_specs = [g.dev.spec for g in gpus.values()]
    infos = {
        i: {**_memory_note(g), **g.dev.info(), **(g.model.evidence() if g.model else {})}
        for i, g in gpus.items()
    }
    times = {i: g.times for i, g in gpus.items()}
    gpus.clear()
    together = _concurrent(
        alone_specs, size, warmup, window_s, sample_min_s, worker_timeout, models
    )

    common = {"size_bytes": size, "warmup": warmup}
    alone_figures: dict[str, dict[int, float]] = {m: {} for m in ALONE}
    evidence: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in (*ALONE, *TOGETHER)}
    for index, per_metric in times.items():
        info = {**common, **_link_evidence(links[index]), **infos[index]}
        for metric in ALONE:
            stats = rep_stats(size, per_metric[metric])
            alone_figures[metric][index] = stats.p90_gbps  # see the module docstring
            evidence[metric][index] = {**stats.evidence(), **info}
    together_figures: dict[str, dict[int, float]] = {m: {} for m in TOGETHER}
    for metric, alone_metric in zip(TOGETHER, ALONE, strict=True):
        shared = {**common, "window_s": window_s}
        out.extend(
            _together_metric(
                ctx,
                metric,
                together[metric],
                alone_figures[alone_metric],
                shared,
                infos,
                together_figures[metric],
                evidence[metric],
            )
        )
    out.extend(_graded(ctx, alone_figures, together_figures, evidence))
    out.extend(link_result(ctx, index, links[index]) for index in sorted(links))
    return out


def _alone(
    ctx: CheckContext,
    specs: list[ComputeSpec],
    models: dict[int, CopyModel],
    size: int,
    warmup: int,
    reps: int,
    sample_min_s: float,
) -> tuple[dict[int, _Gpu], list[Result]]:
    """Each GPU set up, then timed alone ``reps`` times, round-robin; a GPU that fails is
    dropped with its error results."""
    out: list[Result] = []
    gpus: dict[int, _Gpu] = {}
    for spec in specs:
        try:
            gpus[spec.index] = _setup(spec, size, warmup, models.get(spec.index))
        except Exception as err:  # noqa: BLE001 - one GPU's failure is that GPU's result
            out.extend(
                error_results(
                    ctx,
                    [*ALONE, *TOGETHER],
                    spec.index,
                    err,
                    f"allocating 2 x {size} B and warming up",
                )
            )
    for _ in range(reps):
        for index, g in list(gpus.items()):
            try:
                g.times["h2d_gbps"].append(g.timed("h2d", sample_min_s))
                g.times["d2h_gbps"].append(g.timed("d2h", sample_min_s))
            except Exception as err:  # noqa: BLE001
                del gpus[index]
                out.extend(
                    error_results(
                        ctx, [*ALONE, *TOGETHER], index, err, "a timed host<->device copy"
                    )
                )
    return gpus, out


def _together_metric(
    ctx: CheckContext,
    metric: str,
    per_gpu: dict[int, Any],
    alone: dict[int, float],
    shared: dict[str, Any],
    infos: dict[int, dict[str, Any]],
    figures: dict[int, float],
    evidence: dict[int, dict[str, Any]],
) -> list[Result]:
    """One concurrent metric's figures and evidence, filled in per GPU (with the node's
    aggregate against the sum alone); the error results of the GPUs whose workers failed."""
    ok = {i: v[0] for i, v in per_gpu.items() if isinstance(v, tuple)}
    aggregate = sum(ok.values())
    alone_sum = sum(alone.get(i, 0.0) for i in ok)
    node = {
        "node_aggregate_gbps": round(aggregate, 4),
        "gpus_together": len(ok),
        "ratio_to_sum_alone": round(aggregate / alone_sum, 4) if alone_sum else None,
    }
    out: list[Result] = []
    for index, value in sorted(per_gpu.items()):
        if not isinstance(value, tuple):
            out.extend(
                error_results(ctx, [metric], index, value, "the concurrent host<->device copies")
            )
            continue
        figures[index] = value[0]
        evidence[index] = {
            "size_bytes": shared["size_bytes"],
            "warmup": shared["warmup"],
            "p90_gbps": round(value[0], 4),
            "median_gbps": round(value[1], 4),
            "copies": value[2],
            "window_s": shared["window_s"],
            **node,
            **infos[index],
        }
    return out


def _graded(
    ctx: CheckContext,
    alone: dict[str, dict[int, float]],
    together: dict[str, dict[int, float]],
    evidence: dict[str, dict[int, dict[str, Any]]],
) -> list[Result]:
    """The figures held to the SKU's minima (alone) and to the siblings (together)."""
    out: list[Result] = []
    for metric, what, minimum_key in (
        ("h2d_gbps", "PCIe host-to-device", "pcie_h2d_gbps_min"),
        ("d2h_gbps", "PCIe device-to-host", "pcie_d2h_gbps_min"),
    ):
        out.extend(grade_figures(ctx, metric, what, alone[metric], evidence[metric], minimum_key))
    for metric, what in (
        ("h2d_gbps_concurrent", "PCIe host-to-device with all GPUs together"),
        ("d2h_gbps_concurrent", "PCIe device-to-host with all GPUs together"),
    ):
        out.extend(
            grade_figures(
                ctx,
                metric,
                what,
                together[metric],
                evidence[metric],
                None,
                None if ctx.ports.compute.measured else STAND_IN_TOGETHER,
            )
        )
    return out


def _setup(spec: ComputeSpec, size: int, warmup: int, model: CopyModel | None = None) -> _Gpu:
    import torch

    dev = open_device(spec)
    cuda = dev.device.type == "cuda"
    host = torch.ones(size, dtype=torch.uint8, pin_memory=cuda)
    g = _Gpu(
        dev=dev,
        host=host,
        device_buf=torch.empty(size, dtype=torch.uint8, device=dev.device),
        stream=torch.cuda.Stream(dev.device) if cuda else None,  # type: ignore[no-untyped-call]
        model=model,
    )
    for _ in range(warmup):
        g.h2d()
        g.d2h()
    dev.synchronize()
    return g


def _memory_note(g: _Gpu) -> dict[str, Any]:
    if g.model is not None:  # a modelled figure: the copy ran on the stand-in's memory
        return {"pinned": False, "note": STAND_IN_NOTE}
    return {"pinned": bool(g.host.is_pinned())}


# -- the link under load ----------------------------------------------------------------------


@dataclass(frozen=True)
class LinkReading:
    """What one GPU's link read while it copied: a PcieLink, or why there is none."""

    link: PcieLink | None = None  # the best of the readings (a link still training up reads low)
    error: GpuError | None = None
    copies_in_flight: int = 0  # copies the GPU ran while the reading was taken
    reads: int = 1  # readings taken: more than one when the first was below the link's maxima


#: a link read below its maxima while the GPU copies is read again, this many times in all, this
#: far apart, and the best reading is judged: a link that trains up from its idle speed as the
#: copies start read Gen1 once and was drained as degraded
LINK_READS = 3
LINK_READ_GAP_S = 0.02


def _link_under_load(g: _Gpu, nvml: GpuDevice | None, timeout_s: float) -> LinkReading:
    """Read ``nvml.pcie()`` on a second thread while this one keeps the GPU copying (again, up
    to :data:`LINK_READS` readings, while it reads below the link's maxima).

    Copies go two at a time before each synchronise, so the GPU is idle only for the moment
    between a synchronise and the next launch; they stop once the reading has landed (or
    ``timeout_s`` passed: a hung driver call is then reported as a timeout)."""
    if nvml is None:
        return LinkReading(error=NotSupported("the GPU backend does not list this GPU"))
    landed = threading.Event()
    got: dict[str, Any] = {}

    def read() -> None:
        try:
            for n in range(1, LINK_READS + 1):
                link = nvml.pcie()
                got["reads"] = n
                best = got.get("link")
                if best is None or _rank(link) > _rank(best):
                    got["link"] = best = link
                if _rank(best) >= (best.gen_max, best.width_max):
                    break
                time.sleep(LINK_READ_GAP_S)
        except GpuError as err:
            got.setdefault("error", err)
        finally:
            landed.set()

    copies = 0
    g.h2d()  # load first, then read
    copies += 1
    reader = threading.Thread(target=read, name=f"pcie-link-gpu{g.dev.spec.index}", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not landed.is_set() and time.monotonic() < deadline:
        g.h2d()
        g.d2h()
        copies += 2
        g.dev.synchronize()
    g.dev.synchronize()
    if not landed.is_set():
        from node_agent.gpu.base import GpuTimeout

        return LinkReading(
            error=GpuTimeout(
                f"reading the PCIe link did not return within "
                f"{timeout_s:g} s; the driver may be hung"
            ),
            copies_in_flight=copies,
        )
    link = got.get("link")
    return LinkReading(
        link=link,
        error=None if link is not None else got.get("error"),
        copies_in_flight=copies,
        reads=got.get("reads", 1),
    )


def _rank(link: PcieLink) -> tuple[int, int]:
    return link.gen_current, link.width_current


def _link_evidence(reading: LinkReading) -> dict[str, Any]:
    if reading.link is None:
        return {"link_under_load": None}
    link = reading.link
    return {"link_under_load": f"Gen{link.gen_current} x{link.width_current}"}


def link_result(ctx: CheckContext, index: int, reading: LinkReading) -> Result:
    """``pcie_link_under_load`` of one GPU: fail when the loaded link is below the SKU's
    generation or width (or, without a SKU, below the link's own maximum) where the system
    gives it that; warn where the system cannot (:meth:`PcieLink.shortfall`)."""
    target = f"gpu:{index}"
    if reading.link is None:
        err = reading.error
        if isinstance(err, (NotSupported, NoPermission)):
            return ctx.result(target, LINK, Status.SKIP, f"PCIe link not available: {err}")
        return ctx.result(
            target,
            LINK,
            Status.ERROR,
            f"reading the PCIe link of gpu:{index} under load failed: {err}",
            error=str(err),
        )
    link = reading.link
    sku = ctx.sku
    sku_pcie = sku.section("pcie") if sku else {}
    want_gen = int(sku_pcie.get("gen") or link.gen_max)
    want_width = int(sku_pcie.get("width") or link.width_max)
    source = f"SKU {sku.id}" if sku and sku_pcie else "the link's maximum"
    evidence: dict[str, Any] = {
        "gen_current": link.gen_current,
        "gen_max": link.gen_max,
        "width_current": link.width_current,
        "width_max": link.width_max,
        "gen_expected": want_gen,
        "width_expected": want_width,
        "expected_from": source,
        "copies_in_flight": reading.copies_in_flight,
        "link_reads": reading.reads,
    }
    value = f"Gen{link.gen_current} x{link.width_current}"
    degraded, platform = link.shortfall(want_gen, want_width)
    if degraded:
        return ctx.result(
            target,
            LINK,
            Status.FAIL,
            f"gpu:{index} PCIe link at {' and '.join(degraded)} ({source}, within what the "
            f"system gives) while copying, best of {reading.reads} reading(s): a degraded "
            "link (reboot to retrain it; if it stays, reseat or replace the GPU, riser or cable)",
            value=value,
            **evidence,
        )
    if platform:
        return ctx.result(
            target,
            LINK,
            Status.WARN,
            f"gpu:{index} PCIe link at {value} while copying, all the system gives this GPU "
            f"({' and '.join(platform)}; NVML's maximum for this device and system): the slot "
            "or platform, not the GPU",
            value=value,
            **evidence,
        )
    return ctx.result(
        target,
        LINK,
        Status.PASS,
        f"gpu:{index} PCIe link at {value} while copying (expected "
        f"Gen{want_gen} x{want_width}, {source})",
        value=value,
        **evidence,
    )


# -- all GPUs together ------------------------------------------------------------------------


_Together = dict[str, dict[int, "tuple[float, float, int] | BaseException"]]


def _worker_figure(result: Any, metric: str) -> tuple[float, float, int] | Exception:
    """A worker's answer for one metric: its (p90, median, copies), or the error it sent."""
    value = result.get(metric) if isinstance(result, dict) else None
    if value is not None:
        p90, median, copies = value
        return (p90, median, copies)
    return RuntimeError(
        result.get("error", "no figure") if isinstance(result, dict) else str(result)
    )


def _stop(workers: list[Any], deadline: float) -> None:
    """Wait for each worker until the deadline; kill those still running."""
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()) if w.is_alive() else 0)
        if w.is_alive():
            w.kill()
            w.join(timeout=5)


def _concurrent(
    specs: list[ComputeSpec],
    size: int,
    warmup: int,
    window_s: float,
    sample_min_s: float,
    timeout_s: float,
    models: dict[int, CopyModel] | None = None,
) -> _Together:
    """Per direction, each GPU's (p90 GB/s, median GB/s, copies) while all GPUs copy at once,
    or the error it hit.

    One worker process per GPU (its own CUDA context and stream), forked from a forkserver
    that has imported torch once. A barrier starts them together; each copies back to back
    until the shared window of ``window_s`` wall-clock seconds has passed, timing each copy on
    its own device clock. The figure is the 90th percentile of the copies' GB/s: with every
    GPU's process contending for the host, a copy the host disturbed (a context switch, a cache
    another process evicted) is slower, never faster, so the upper figures are the link's own;
    in the steady state of a GPU copy they equal the median anyway. A fixed window rather than a fixed
    number of copies keeps every GPU loaded for the whole measurement (a fast GPU does not
    finish early and leave the switch to the others). Processes rather than threads because a
    stand-in GPU's clock is its process's CPU time: each stand-in then measures its own
    copies, whatever share of the host's cores the scheduler gave it."""
    import multiprocessing

    out: _Together = {m: {} for m in TOGETHER}
    if not specs:
        return out
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["torch", "node_agent.compute.devices"])
    barrier = mp.Barrier(len(specs))
    queue = mp.Queue()
    workers = [
        mp.Process(
            target=concurrent_worker,
            name=f"pcie-together-gpu{s.index}",
            args=(
                s,
                size,
                warmup,
                window_s,
                sample_min_s,
                barrier,
                queue,
                timeout_s,
                (models or {}).get(s.index),
            ),
            daemon=True,
        )
        for s in specs
    ]
    for w in workers:
        w.start()
    deadline = time.monotonic() + timeout_s
    pending = {s.index for s in specs}
    try:
        while pending and time.monotonic() < deadline:
            try:
                index, result = queue.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - queue.Empty: look again until the deadline
                if not any(w.is_alive() for w in workers) and queue.empty():
                    break
                continue
            pending.discard(index)
            for metric in TOGETHER:
                out[metric][index] = _worker_figure(result, metric)
    finally:
        _stop(workers, deadline)
        queue.close()
    for index in pending:
        for metric in TOGETHER:
            out[metric][index] = TimeoutError(
                f"the worker process of gpu:{index} reported nothing within {timeout_s:g} s "
                "(a hung copy or driver); it was killed"
            )
    return out


def concurrent_worker(
    spec: ComputeSpec,
    size: int,
    warmup: int,
    window_s: float,
    sample_min_s: float,
    barrier: Any,
    queue: Any,
    timeout_s: float,
    model: CopyModel | None = None,
) -> None:
    """One GPU's side of the together measurement (runs in its own process)."""
    result: dict[str, Any] = {}
    try:
        g = _setup(spec, size, warmup, model)
        for metric, kind in zip(TOGETHER, ("h2d", "d2h"), strict=True):
            barrier.wait(timeout=timeout_s)
            deadline = time.monotonic() + window_s
            seconds: list[float] = []
            while not seconds or time.monotonic() < deadline:
                seconds.append(g.timed(kind, sample_min_s))
            stats = rep_stats(size, seconds)
            result[metric] = (stats.p90_gbps, stats.median_gbps, stats.reps)
    except threading.BrokenBarrierError:
        result["error"] = (
            "abandoned: another GPU's worker failed or did not start in time, so "
            "the GPUs could not copy together (see that GPU's result)"
        )
    except BaseException as err:  # noqa: BLE001 - the parent reports it as this GPU's error
        barrier.abort()  # the others stop waiting for this one
        result["error"] = f"{type(err).__name__}: {err}"
    queue.put((spec.index, result))


#: a figure's metric -> its (direction, mode) labels in the exported series
PCIE_FIGURES = {
    "h2d_gbps": ("h2d", "alone"),
    "d2h_gbps": ("d2h", "alone"),
    "h2d_gbps_concurrent": ("h2d", "concurrent"),
    "d2h_gbps_concurrent": ("d2h", "concurrent"),
}


#: ``node_agent_gpu_pcie_bytes_per_second{gpu,uuid,direction,mode}``: the latest run's four
#: figures per GPU
PcieMetrics = figure_gauge(
    "node_agent_gpu_pcie_bytes_per_second",
    "Host-device copy bandwidth over PCIe in the latest pcie_bandwidth run (bytes/s): "
    "direction h2d|d2h, mode alone|concurrent",
    ("direction", "mode"), 1e9,
    lambda r: list(PCIE_FIGURES[r.metric]) if r.metric in PCIE_FIGURES else None)  # fmt: skip


SERVICE = ServiceBehaviour(metrics=PcieMetrics)
