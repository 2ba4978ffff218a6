"""Silent-data-corruption (SDC) probes: matrix multiplies whose right answer is known.

This module is the in-training probe API of the design's "SDC probes" section. It imports only
the standard library and torch (and its own ``node_agent.sdc`` siblings; no pynvml, no yaml, no
other ``node_agent`` module), so a training job can use it without the rest of the agent::

    from node_agent.sdc import SdcProbe

    probe = SdcProbe()            # current CUDA device, 0.1 % budget, spool under /var/spool/node-agent/sdc
    for batch in loader:
        loss = model(batch).sum(); loss.backward(); opt.step()
        probe.step()              # never raises; queues a probe only while under budget

Three probes, cheapest first (see ``docs/sdc.md``):

1. ``exact_gemm_probe`` (``node_agent.sdc.exact``): whole-GPU GEMMs (every SM runs several
   output tiles, ``node_agent.sdc.tiles``) on integer inputs with the dtype's full significand
   and K small enough that the accumulator is exact in any order; the golden is the exact sum
   rounded once to the output dtype, and *any* difference is corruption.
2. ``digest_probe`` (``node_agent.sdc.reference``): full-mantissa random inputs; the sha256 of
   the output is compared across the GPUs of a node and with the same GPU's earlier digest.
3. ``freivalds_check``: C·x against A·(B·x) for a big GEMM, O(n²), with a documented bound.

A mismatch is re-run before it is believed (``node_agent.sdc.verdicts``): it is ``confirmed`` (a
FAULT) when the re-run or another probe run in the same window mismatches, ``transient`` (a
WARN, kept as evidence) otherwise. Every probe takes a ``matmul`` callable (default
``node_agent.sdc.exact.gemm``): that is the compute boundary where the simulator injects
corruption (``corrupting_matmul``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the caller imports it; sdc stays stdlib + torch at runtime
    from node_agent.heartbeat import Heartbeat

import node_agent.sdc.coverage as sdc_coverage
from node_agent.sdc.coverage import Coverage
from node_agent.sdc.exact import (  # noqa: F401 - re-exported: the probe API
    DTYPES,
    NUMERICS,
    WHOLE_GPU_SPECS,
    AccumulatorCheck,
    ExactState,
    Matmul,
    Outcome,
    ProbeSpec,
    Readback,
    Workspace,
    accumulator_check,
    check_spec,
    dtype_unsupported,
    exact_state,
    gemm,
    golden,
    golden_out,
    input_bits,
    output_bytes,
    plan_whole_gpu,
    state_bytes,
    strict_matmul,
    tile_model_for,
    whole_gpu_specs,
)
from node_agent.sdc.inject import corrupting_matmul
from node_agent.sdc.reference import (  # noqa: F401 - re-exported
    _random_inputs,
    _sha256,
    digest_probe,
    freivalds_check,
    freivalds_probe,
    odd_one_out,
)
from node_agent.sdc.spool import (  # noqa: F401 - re-exported: the probe API's verdicts and spool
    SPOOL_SCHEMA,
    Verdict,
    default_spool_dir,
    read_spool,
    read_spool_files,
    write_verdict,
)
from node_agent.sdc.tiles import TileModel
from node_agent.sdc.verdicts import Window, error_verdict, make_verdict, upgrade_in_window

__all__ = [
    "DTYPES",
    "DEFAULT_SHAPES",
    "ProbeSpec",
    "Verdict",
    "SdcProbe",
    "accumulator_check",
    "corrupting_matmul",
    "default_specs",
    "default_spool_dir",
    "digest_probe",
    "dtype_unsupported",
    "exact_gemm_probe",
    "fit_whole_gpu",
    "freivalds_check",
    "freivalds_probe",
    "golden",
    "golden_out",
    "odd_one_out",
    "cublas_workspace_bytes",
    "probe_memory_bytes",
    "read_spool",
    "read_spool_files",
    "run_probes",
    "strict_matmul",
    "whole_gpu_specs",
    "write_verdict",
]

log = logging.getLogger(__name__)

Clock = Callable[[], float]

#: (M, K, N) of the digest probes (and of exact probes given explicit shapes). Odd sizes on
#: purpose: they select other GEMM kernels / tile paths than powers of two do. They are small:
#: a digest is hashed on the host, so it cannot be whole-GPU; the exact probes are.
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = ((128, 128, 128), (96, 256, 160), (257, 64, 33))
#: dtypes of probes given explicit shapes, in order (tf32 and fp8 where the device has them)
SHAPE_DTYPES = ("fp32", "bf16", "fp16", "tf32")
#: tiles per SM the in-training probe asks for (the delivery check uses 4); SdcProbe takes fewer
#: when its memory, the cuBLAS workspace of its stream included, would pass max_memory_mib: on an
#: H100 (32 MiB workspace) that is 1 tile per SM, 1536 x 1536 outputs, 55.3 MiB in all
TRAINING_TILES_PER_SM = 2
#: device memory the in-training probe may hold by default, MiB (the issue's bound)
DEFAULT_MAX_MEMORY_MIB = 64.0
#: completed probes whose costs bound the next probe's expected cost (SdcProbe, "The budget
#: holds by construction"): at least this many, and at least one round over the specs
RECENT_COSTS = 8
#: idle step() calls whose longest host time is added, twice, to the next probe's expected cost
IDLE_CALLS = 64


def default_specs(
    device: torch.device | str | None = None,
    shapes: Iterable[tuple[int, int, int]] | None = None,
    seed: int = 0,
    tiles: TileModel | None = None,
    dtypes: Iterable[str] | None = None,
    tiles_per_sm: int | None = None,
) -> list[ProbeSpec]:
    """The exact probes for ``device``: whole-GPU specs (``whole_gpu_specs``) without
    ``shapes``; with them, every shape in every dtype the device runs (``SHAPE_DTYPES``: tf32
    only on CUDA), inputs as wide as K allows."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if shapes is None:
        specs, _ = whole_gpu_specs(
            dev, tiles, tuple(dtypes) if dtypes is not None else None, tiles_per_sm, seed
        )
        return specs
    names = [d for d in (dtypes or SHAPE_DTYPES) if dtype_unsupported(d, dev) is None]
    return [ProbeSpec(*shape, dtype=d, seed=seed) for shape in shapes for d in names]


def cublas_workspace_bytes(device: torch.device | str) -> int:
    """The cuBLAS workspace torch gives each (handle, stream): ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KIB:COUNT`` pairs) when set, else 32 MiB on compute capability 9.x, 10.x and 12.x
    and 8 MiB + 128 KiB elsewhere (torch's defaults, ``aten/src/ATen/cuda/CublasHandlePool.cpp``).
    The probe's own stream gets one; 0 on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    major, _ = torch.cuda.get_device_capability(dev)
    return 4096 * 8 * 1024 if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def probe_memory_bytes(
    specs: Iterable[ProbeSpec],
    tiles: TileModel | None = None,
    acc_dtypes: Iterable[str] = (),
    workspace_bytes: int = 0,
) -> int:
    """Device bytes an in-training probe with these specs holds at most: every spec's inputs
    and golden block, one output buffer and one mismatch mask (the largest spec's), the
    per-tile map, the accumulator checks' inputs plus one check's transient output and mask,
    and ``workspace_bytes`` (the cuBLAS workspace of its stream, ``cublas_workspace_bytes``).
    Pure arithmetic: no device needed (``docs/sdc.md`` gives the H100 figures).
    """
    specs = list(specs)
    if not specs:
        return workspace_bytes
    total = workspace_bytes + sum(state_bytes(s) for s in specs)
    total += max(output_bytes(s) for s in specs) + max(s.m * s.n for s in specs)
    if tiles is not None:
        total += max(s.m * tiles.grid(s.m, s.n)[1] + tiles.tiles(s.m, s.n) for s in specs)
    side = 4 * (tiles.tile_m if tiles else 128)
    peak = 0
    for name in set(acc_dtypes):
        x = NUMERICS[name]
        size_in = torch.empty((), dtype=x.dtype).element_size()
        size_out = torch.empty((), dtype=x.out_dtype).element_size()
        total += 2 * side * 32 * size_in
        peak = max(peak, side * side * (size_out + 1))
    return total + peak


def fit_whole_gpu(
    model: TileModel,
    dtypes: Iterable[str],
    tiles_per_sm: int,
    block: int,
    max_bytes: float,
    workspace_bytes: int = 0,
    seed: int = 0,
) -> tuple[list[ProbeSpec], int, int]:
    """(specs, tiles per SM, device bytes): the most tiles per SM, up to ``tiles_per_sm``, whose
    whole-GPU specs fit ``max_bytes`` (``probe_memory_bytes``, ``workspace_bytes`` included);
    ValueError when even 1 tile per SM does not. Pure: no device needed.

    >>> from node_agent.sdc.tiles import gpu_model
    >>> names = [d for d, _, _ in WHOLE_GPU_SPECS]        # an H100: every dtype, 32 MiB workspace
    >>> specs, per_sm, need = fit_whole_gpu(gpu_model(132), names, 2, 256, 64 * 2**20, 32 * 2**20)
    >>> per_sm, specs[0].label(), round(need / 2**20, 1)
    (1, 'bf16 1536x256x1536', 55.3)
    """
    names = list(dict.fromkeys(dtypes))
    per_sm = max(1, tiles_per_sm)
    while True:
        specs = plan_whole_gpu(model, names, per_sm, block, seed)
        need = probe_memory_bytes(specs, model, {s.dtype for s in specs}, workspace_bytes)
        if need <= max_bytes:
            return specs, per_sm, need
        if per_sm <= 1:
            raise ValueError(
                f"whole-GPU probes need {need / 2**20:.1f} MiB of device memory even "
                f"at 1 tile per SM ({workspace_bytes / 2**20:.1f} MiB cuBLAS "
                f"workspace included), over {max_bytes / 2**20:.1f} MiB"
            )
        per_sm -= 1


# --------------------------------------------------------------------------------------------
# Standalone probes (the check, `node-agent sdc`)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def exact_gemm_probe(
    spec: ProbeSpec,
    device: torch.device | str = "cpu",
    matmul: Matmul | None = None,
    clock: Clock = time.perf_counter,
    tiles: TileModel | None = None,
) -> Verdict:
    """Run one exact-arithmetic GEMM on ``device`` (on its current stream), compare with the
    golden value; re-run once on a mismatch. ``tiles`` (the device's tile model) adds which
    tiles mismatched to the evidence. Returns a Verdict (never ``error``: an exception
    propagates to the caller).

    >>> exact_gemm_probe(ProbeSpec(64, 64, 64, "bf16")).status
    'pass'
    """
    dev = torch.device(device)
    t0 = clock()
    state = exact_state(spec, dev, tiles)
    first = state.launch(matmul)()
    rerun = state.launch(matmul)() if first.mismatched else None
    _sync(dev)
    return make_verdict(
        "exact_gemm", spec, dev, first, rerun, clock() - t0, {"input_bits": input_bits(spec)}
    )


def run_probes(
    device: torch.device | str,
    duration_s: float | None = None,
    matmul: Matmul | None = None,
    shapes: Iterable[tuple[int, int, int]] | None = None,
    clock: Clock = time.monotonic,
    tiles: TileModel | None = None,
) -> list[Verdict]:
    """Run the accumulator checks and every exact (whole-GPU unless ``shapes``), digest and
    Freivalds probe on ``device`` once; with ``duration_s`` (seconds), repeat the exact probes
    until that much time has passed (at least one pass). A second mismatch on the device
    confirms a transient one (``node_agent.sdc.verdicts``).

    A probe that raises becomes an ``error`` verdict; the others still run. Digest verdicts
    carry ``evidence['digest']`` for ``odd_one_out`` across the node's GPUs; every verdict
    carries ``evidence['sm_coverage']`` (the tile model's figure).
    """
    dev = torch.device(device)
    model = tiles or tile_model_for(dev)
    specs = default_specs(dev, shapes, tiles=model)
    skipped: dict[str, str] = {}
    for name in sorted({s.dtype for s in specs}):
        try:
            why = accumulator_check(name, dev, matmul, model)
        except Exception as err:  # noqa: BLE001 - a dtype whose check cannot run is probed anyway
            log.warning("sdc accumulator check %s on %s failed: %s", name, dev, err)
            why = None
        if why:
            skipped[name] = why
    specs = [s for s in specs if s.dtype not in skipped]
    cover = sdc_coverage.modeled(model, [(s.m, s.n) for s in specs]).evidence()
    window = Window()
    start = clock()
    verdicts: list[Verdict] = []

    def guarded(kind: str, fn: Callable[..., Verdict], spec: ProbeSpec, **kw: Any) -> None:
        try:
            v = fn(spec, dev, matmul, **kw)
        except Exception as err:  # a probe that cannot run is reported, never a pass
            log.exception("sdc %s %s on %s failed", kind, spec.label(), dev)
            v = error_verdict(kind, spec, dev, err)
        if kind == "exact_gemm":
            upgrade_in_window(v, window)
        v.evidence.update(cover)
        if skipped:
            v.evidence["skipped_dtypes"] = skipped
        verdicts.append(v)

    for spec in specs:
        guarded("exact_gemm", exact_gemm_probe, spec, tiles=model)
    digest_names = [
        d for d in ("fp32", "bf16", "fp16", "tf32") if dtype_unsupported(d, dev) is None
    ]
    for shape in shapes or DEFAULT_SHAPES:
        for name in digest_names:
            guarded("digest_gemm", digest_probe, ProbeSpec(*shape, dtype=name))
    big = 1024 if dev.type == "cuda" else 256
    for name in ("fp32", "bf16") + (("tf32",) if dev.type == "cuda" else ()):
        guarded("freivalds", freivalds_probe, ProbeSpec(big, big, big, name))
    while duration_s is not None and clock() - start < duration_s:
        for spec in specs:
            guarded(
                "exact_gemm",
                exact_gemm_probe,
                dataclasses.replace(spec, seed=spec.seed + 1),
                tiles=model,
            )
            if clock() - start >= duration_s:
                break
    return verdicts


# --------------------------------------------------------------------------------------------
# In-training API


@dataclasses.dataclass
class _Pending:
    kind: str  # "exact_gemm" or "digest_gemm"
    spec: ProbeSpec
    read: Callable[[], Any]
    start: Any  # torch.cuda.Event or clock value
    end: Any
    host_s: float = 0.0  # host time spent queuing it (the training thread's cost)
    first: Outcome | None = None  # set while a confirmation re-run is in flight
    first_cost_s: float = 0.0


def _probe_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch device: default the current CUDA device, else the CPU; an int is
    a CUDA device index."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


class SdcProbe:
    """Run SDC probes from inside a training loop within a time budget.

    Call ``step()`` once per training step. It measures the wall time since creation and the
    probes' own cumulative cost, and starts the next probe only while
    ``(cost + expected cost of the next probe) <= budget_fraction * elapsed``, the first one
    included (its expected cost is its warm-up's at construction). The budget is spent on
    whole-GPU exact probes, round-robin over the specs (``whole_gpu_specs``: every dtype the GPU
    runs, bf16 fp16 tf32 fp8 fp32).

    **The budget holds by construction.** The cost is everything the probe takes: the host
    time of every ``step()`` call (the gate, launching, polling the event, reading the result
    back; an idle call too) and, on CUDA, the probe's GPU time. The expected cost of the next
    probe is the largest of its own last cost (its warm-up's until it has run in training) and
    the cost of every probe of the last round (:data:`RECENT_COSTS`): on a GPU busy with
    training a probe's stream waits behind the training kernels, and a probe costs what its
    neighbours did there, not what it cost on the idle GPU at construction (docs/sdc.md gives
    the measured figures). So a probe that costs no more than the costliest recent one leaves
    ``cost <= budget_fraction * elapsed`` true when it completes; one that costs more (the first
    under training load) overspends by that excess only, which the next start waits to repay.

    **Set-up, at construction** (a one-off, not counted against the budget): inputs and golden
    blocks are made on the device, an output buffer, a mismatch mask and pinned host buffers
    are allocated, each dtype's accumulator is checked (a kernel that accumulates in lower
    precision has its dtype skipped, logged, and named in verdicts'
    ``evidence['skipped_dtypes']``), every spec runs once (warming cuBLAS up on the probe's
    stream, and timing each spec's expected cost), and ``sm_coverage`` is measured with ``%smid`` (``measure_coverage``) or taken from
    the tile model.

    **Never stalls training.** On CUDA ``step()`` only *queues* work on the probe's own stream
    (``torch.cuda.Stream``): the GEMM into the preallocated output, the comparison against the
    device-resident golden, the mismatch count and per-tile map copied to pinned memory, and a
    CUDA event behind them. A later ``step()`` reads the pinned result once the event has
    completed (``Event.query()``). Nothing synchronises the host with the training stream or the
    probe's. The cost counted against the budget is the probe's GPU time (CUDA events) plus the
    host time ``step()`` spent queuing and reading it. On the CPU the probe runs synchronously,
    timed with ``clock``.

    **Memory.** Device memory held is :attr:`memory_bytes` (``probe_memory_bytes``, the cuBLAS
    workspace of the probe's stream included), at most ``max_memory_mib`` (default 64): the
    whole-GPU output shrinks (fewer tiles per SM, from ``tiles_per_sm``, default 3) until it
    fits, and construction fails if even one tile per SM does not.

    **Verdicts.** A mismatch is re-run (at a later step); it is ``confirmed`` when the re-run,
    or another probe run within ``confirm_window`` probe runs (default: one round over the
    specs), mismatched too, else ``transient``. Non-pass verdicts (transient, confirmed,
    error) are written to ``spool_dir`` (default ``default_spool_dir()``) with
    ``write_verdict``; ``spool_passes=True`` writes passes too. Every verdict's evidence has
    ``sm_coverage``. ``step()`` logs and swallows every exception (recorded as an ``error``
    verdict, with exponential back-off) unless ``raise_errors=True``. ``verdicts`` keeps the
    last ``keep`` verdicts in memory.

    ``shapes``: (M, K, N) tuples for explicit exact probes instead of the whole-GPU ones.
    ``digests=True`` adds a small digest probe per round (``DEFAULT_SHAPES``, compared with this
    GPU's earlier digest). ``clock`` (seconds, monotonic), ``matmul`` and ``sm_count`` are
    injectable for tests and the simulator.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        budget_fraction: float = 0.001,
        spool_dir: str | os.PathLike[str] | None = None,
        shapes: Iterable[tuple[int, int, int]] | None = None,
        raise_errors: bool = False,
        *,
        matmul: Matmul | None = None,
        clock: Clock = time.monotonic,
        seed: int = 0,
        spool_passes: bool = False,
        digests: bool = False,
        keep: int = 100,
        heartbeat: Heartbeat | None = None,
        dtypes: Iterable[str] | None = None,
        tiles_per_sm: int = TRAINING_TILES_PER_SM,
        sm_count: int | None = None,
        max_memory_mib: float = DEFAULT_MAX_MEMORY_MIB,
        confirm_window: int | None = None,
        measure_coverage: bool = True,
    ) -> None:
        if not 0 < budget_fraction < 1:
            raise ValueError(f"budget_fraction must be in (0, 1), got {budget_fraction}")
        self.device = _probe_device(device)
        self.budget_fraction = budget_fraction
        self.spool_dir = Path(spool_dir) if spool_dir is not None else default_spool_dir()
        self.raise_errors = raise_errors
        self.matmul = matmul
        self.clock = clock
        self.spool_passes = spool_passes
        self.keep = keep
        self.tiles = tile_model_for(self.device, sm_count)
        cuda = self.device.type == "cuda"
        self.specs, self.tiles_per_sm, self.memory_bytes = self._size(
            seed,
            list(shapes) if shapes is not None else None,
            tuple(dtypes) if dtypes is not None else None,
            tiles_per_sm,
            max_memory_mib,
        )
        self.skipped: dict[str, str] = {}
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._init_digests(seed, digests)
        self._states: dict[ProbeSpec, ExactState] = {}
        self._workspace: Workspace | None = None
        self._readback: Readback | None = None
        self._warm: dict[tuple[str, ProbeSpec], float] = {}
        self._prepare()
        self.coverage = self._coverage(measure_coverage and cuda)
        self._build_plan()
        self._init_accounting(clock, confirm_window)
        #: optional progress heartbeat (node_agent.heartbeat): ``step()`` beats it, so a job
        #: that already calls ``step()`` per training step gets hang detection for free
        self.heartbeat = heartbeat

    def _init_digests(self, seed: int, digests: bool) -> None:
        """The digest probes' specs and rotation (none unless ``digests``)."""
        self._digests: dict[ProbeSpec, str] = {}
        self._digest_specs = (
            [ProbeSpec(*s, dtype=d, seed=seed) for s in DEFAULT_SHAPES for d in ("bf16", "fp32")]
            if digests
            else []
        )
        self._digest_plan = itertools.cycle(self._digest_specs) if digests else None
        self._digest_host: dict[ProbeSpec, torch.Tensor] = {}

    def _init_accounting(self, clock: Clock, confirm_window: int | None) -> None:
        """The budget's and the verdicts' bookkeeping, from the warm-up's costs on."""
        self._window = Window(confirm_window or max(1, len(self.specs)))
        self._expected: dict[tuple[str, ProbeSpec], float] = dict(self._warm)
        self._pending: _Pending | None = None
        self._errors = 0
        self._blocked_until = float("-inf")
        #: no probe can start before this clock time (the budget gate, cached by _may_start)
        self._gate_at = float("-inf")
        self.started = clock()
        self.cost_s = 0.0
        self._last_cost_s = max(self._warm.values(), default=0.0)
        self._recent: collections.deque[float] = collections.deque(
            maxlen=max(RECENT_COSTS, len(self.specs) + len(self._digest_specs))
        )
        #: host seconds of the recent step() calls that started and read nothing (recent
        #: only: one call the OS or the garbage collector paused must not slow probes for good)
        self._idle_calls: collections.deque[float] = collections.deque(maxlen=IDLE_CALLS)
        self.probes_run = 0
        self.verdicts: list[Verdict] = []

    # -- set-up (construction only: uploads and allocations happen here, not in step()) ------

    def _size(
        self,
        seed: int,
        shapes: list[tuple[int, int, int]] | None,
        dtypes: tuple[str, ...] | None,
        tiles_per_sm: int,
        max_memory_mib: float,
    ) -> tuple[list[ProbeSpec], int, int]:
        """The specs, tiles per SM and device bytes (``fit_whole_gpu`` on CUDA)."""
        if self.device.type != "cuda" or shapes is not None:
            specs = default_specs(self.device, shapes, seed, self.tiles, dtypes, tiles_per_sm)
            for s in specs:
                check_spec(s)  # fail at construction, not inside the loop
            if self.device.type != "cuda":
                return specs, tiles_per_sm, 0
            workspace = cublas_workspace_bytes(self.device)
            need = probe_memory_bytes(specs, self.tiles, {s.dtype for s in specs}, workspace)
            if need > max_memory_mib * 2**20:
                raise ValueError(
                    f"SdcProbe on {self.device}: the given shapes need "
                    f"{need / 2**20:.1f} MiB of device memory, over "
                    f"max_memory_mib={max_memory_mib:g}"
                )
            return specs, tiles_per_sm, need
        from node_agent.sdc.tiles import GPU_BLOCK

        _, skipped = whole_gpu_specs(self.device, self.tiles, dtypes, 1)
        names = [
            d for d, _, _ in WHOLE_GPU_SPECS if d not in skipped and (dtypes is None or d in dtypes)
        ]
        try:
            return fit_whole_gpu(
                self.tiles,
                names,
                tiles_per_sm,
                GPU_BLOCK,
                max_memory_mib * 2**20,
                cublas_workspace_bytes(self.device),
                seed,
            )
        except ValueError as err:
            raise ValueError(
                f"SdcProbe on {self.device}: {err}; raise max_memory_mib or pass fewer dtypes"
            ) from None

    def _prepare(self) -> None:
        ctx = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        dev = (
            torch.cuda.device(self.device) if self._stream is not None else contextlib.nullcontext()
        )
        with dev, ctx:
            for name in sorted({s.dtype for s in self.specs}):
                try:
                    why = AccumulatorCheck(name, self.device, self.tiles).launch(self.matmul)()
                except Exception as err:  # noqa: BLE001 - step() reports a dtype that cannot run
                    log.warning(
                        "sdc accumulator check %s on %s could not run: %s", name, self.device, err
                    )
                    why = None
                if why:
                    self.skipped[name] = why
                    log.warning("sdc on %s: %s", self.device, why)
            self.specs = [s for s in self.specs if s.dtype not in self.skipped]
            for spec in self.specs:
                self._states[spec] = ExactState(spec, self.device, self.tiles)
            for spec in self._digest_specs:
                a, b = _random_inputs(spec, self.device)
                if self._stream is not None:
                    self._digest_host[spec] = torch.empty(
                        spec.m, spec.n, dtype=a.dtype, pin_memory=True
                    )
            if self._stream is not None and self.specs:
                self._workspace = Workspace(
                    self.device,
                    max(output_bytes(s) for s in self.specs),
                    max(s.m * s.n for s in self.specs),
                )
                self._readback = Readback(max(st.tile_count for st in self._states.values()))
            if self.matmul is None:
                self._warm_up()
        if self._stream is not None:
            self._stream.synchronize()

    def _warm_up(self) -> None:
        """Run every spec once (on CUDA: cuBLAS's handle, workspace and kernel choice for this
        stream happen here, not in step()) and keep its time as the spec's expected cost, so
        even the first probe waits for the budget to allow it."""
        for spec, state in self._states.items():
            for _ in range(2):  # the second run is timed: the first pays one-off initialisation
                t0 = time.perf_counter()
                if state.launch(None, self._workspace)().mismatched:
                    log.warning(
                        "sdc on %s: warm-up run of %s mismatched; the rotation re-checks it",
                        self.device,
                        spec.label(),
                    )
            self._warm[("exact_gemm", spec)] = time.perf_counter() - t0

    def _coverage(self, measure: bool) -> Coverage:
        shapes = [(s.m, s.n) for s in self.specs]
        if not shapes:
            return sdc_coverage.NONE_RAN
        if measure:
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    return sdc_coverage.measure(self.device, self.tiles, shapes)
            except Exception as err:  # noqa: BLE001 - never fail a training job over a figure
                log.warning("sdc: measuring sm_coverage on %s failed: %s", self.device, err)
        why = (
            "simulated GPU: coverage from the tile model"
            if self._stream is None
            else "not measured (measure_coverage=False or it failed)"
        )
        return sdc_coverage.modeled(self.tiles, shapes, why)

    def _build_plan(self) -> None:
        self._plan = itertools.cycle(self.specs) if self.specs else None
        self._in_round = 0
        self._next = self._take()

    def _take(self) -> tuple[str, ProbeSpec] | None:
        if self._digest_plan is not None and (
            self._plan is None or self._in_round >= len(self.specs)
        ):
            self._in_round = 0
            return ("digest_gemm", next(self._digest_plan))
        if self._plan is None:
            return None
        self._in_round += 1
        return ("exact_gemm", next(self._plan))

    # -- budget ------------------------------------------------------------------------------

    def overhead(self) -> float:
        """Probe cost so far as a fraction of the wall time since creation."""
        elapsed = self.clock() - self.started
        return self.cost_s / elapsed if elapsed > 0 else 0.0

    def expected_cost_s(self) -> float:
        """What the next probe is expected to cost, seconds: the most of its own last cost (its
        warm-up's until it ran here; the last probe's when neither is known) and the costs of
        the recent probes (see the class docstring), plus twice the longest of the recent
        ``step()`` calls that did nothing (the gate and the clock reads, which the calls that
        launch it and read it back spend too)."""
        if self._next is None:
            return 0.0
        own = self._expected.get(self._next, self._last_cost_s)
        # + the bookkeeping of the two step() calls that launch it and read it back
        return max(own, max(self._recent, default=0.0)) + 2 * max(self._idle_calls, default=0.0)

    def _may_start(self, now: float) -> bool:
        if now < self._blocked_until or now < self._gate_at or self._next is None:
            return False
        # With an injected matmul there is no warm-up: the first probe runs at once, as nothing
        # is known of its cost; every later one waits for the budget.
        need = self.cost_s + self.expected_cost_s()
        if need <= self.budget_fraction * (now - self.started) or (
            self.probes_run == 0 and not self._warm
        ):
            return True
        # The earliest the budget can allow it: cost_s only grows, so until then the calls
        # skip the gate's arithmetic. Their own cost is charged, and the gate, recomputed
        # then, waits again if it has to: the budget still holds by construction.
        self._gate_at = self.started + need / self.budget_fraction
        return False

    # -- the loop hook -----------------------------------------------------------------------

    def step(self) -> Verdict | None:
        """Advance the probe; returns a verdict when one completed at this step, else None.

        With ``heartbeat=`` given, also records the step (``Heartbeat.beat`` never raises)."""
        if self.heartbeat is not None:
            self.heartbeat.beat()
        entered = self.clock()
        runs = self.probes_run
        pending = self._pending
        try:
            return self._step(entered)
        except Exception as err:
            if self.raise_errors:
                raise
            log.exception("sdc probe on %s failed; training continues", self.device)
            kind, spec = self._pending_or_next()
            self._pending = None
            self._errors += 1
            backoff_s = min(3600.0, 10.0 * 2 ** (self._errors - 1))
            self._blocked_until = self.clock() + backoff_s
            v = error_verdict(kind, spec, self.device, err)
            v.detail += f"; next probe in {backoff_s:.0f} s"
            v.evidence.update(self._evidence())
            self._record(v)
            return v
        finally:
            spent = self.clock() - entered  # the training thread's time in here, all of it
            self.cost_s += spent
            if self.probes_run == runs and self._pending is pending:
                self._idle_calls.append(spent)

    def collect(self) -> Verdict | None:
        """Read back a probe that has completed, starting none: the verdict, else None (nothing
        in flight, or not done yet). For the end of a measured stretch, so that the last probe
        is counted; its host time is counted as ``step()``'s is."""
        if self._pending is None or not self._done(self._pending):
            return None
        entered = self.clock()
        try:
            return self._finish(self._pending)
        finally:
            self.cost_s += self.clock() - entered

    def _pending_or_next(self) -> tuple[str, ProbeSpec | None]:
        if self._pending is not None:
            return self._pending.kind, self._pending.spec
        return self._next or ("exact_gemm", None)

    def _step(self, now: float) -> Verdict | None:
        """``now``: the clock as step() was entered (one read less on every idle call)."""
        if self._pending is not None:
            if not self._done(self._pending):
                return None
            return self._finish(self._pending)
        if not self._may_start(now):
            return None
        assert self._next is not None
        kind, spec = self._next
        self._next = self._take()
        self._pending = self._launch(kind, spec)
        if self._stream is None:  # CPU: already done
            return self._finish(self._pending)
        return None

    def _launch(
        self, kind: str, spec: ProbeSpec, first: Outcome | None = None, first_cost_s: float = 0.0
    ) -> _Pending:
        t0 = self.clock()
        if self._stream is not None:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record(self._stream)
                read = self._queue(kind, spec)
                end.record(self._stream)
            return _Pending(kind, spec, read, start, end, self.clock() - t0, first, first_cost_s)
        read = self._queue(kind, spec)
        return _Pending(kind, spec, read, t0, self.clock(), 0.0, first, first_cost_s)

    def _queue(self, kind: str, spec: ProbeSpec) -> Callable[[], Any]:
        if kind == "exact_gemm":
            return self._states[spec].launch(self.matmul, self._workspace, self._readback)
        a, b = _random_inputs(spec, self.device)
        with strict_matmul(NUMERICS[spec.dtype].tf32):
            out = (self.matmul or gemm)(a, b)
        host = self._digest_host.get(spec)
        if host is not None:
            host.copy_(out, non_blocking=True)
        else:
            host = out
        return lambda: _sha256(host)

    def _done(self, p: _Pending) -> bool:
        return self._stream is None or bool(p.end.query())

    def _cost(self, p: _Pending) -> float:
        if self._stream is not None:
            # GPU time (CUDA events report milliseconds) plus the host time queuing it
            return float(p.start.elapsed_time(p.end)) / 1000.0 + p.host_s
        return float(p.end - p.start)

    def _evidence(self) -> dict[str, Any]:
        ev = self.coverage.evidence()
        ev["tiles_per_sm"] = self.tiles_per_sm
        if self.skipped:
            ev["skipped_dtypes"] = dict(self.skipped)
        return ev

    def _finish(self, p: _Pending) -> Verdict | None:
        self._pending = None
        t0 = self.clock()
        result = p.read()
        cost = self._cost(p) + (self.clock() - t0)  # the read is host time on the training thread
        if self._stream is not None:
            # the GPU time; the host time is counted by step() around all of this
            self.cost_s += p.start.elapsed_time(p.end) / 1000.0
        self.probes_run += 1
        self._recent.append(cost)
        key = (p.kind, p.spec)
        if p.first is None:
            self._expected[key] = cost
            self._last_cost_s = cost
        if p.kind == "exact_gemm":
            outcome = result
        else:
            prev = self._digests.get(p.spec)
            if prev is None:
                self._digests[p.spec] = result
            outcome = Outcome(
                int(prev is not None and result != prev),
                1,
                {"digest": result, "previous_digest": prev},
            )
        if p.first is None and outcome.mismatched:
            # Re-run before believing it; the verdict comes when the re-run completes.
            self._pending = self._launch(p.kind, p.spec, outcome, cost)
            if self._stream is None:
                return self._finish(self._pending)
            return None
        first, rerun = (p.first, outcome) if p.first is not None else (outcome, None)
        hits = 0
        if p.kind == "exact_gemm":
            hits = self._window.hits() if first.mismatched else 0
            self._window.record(int(first.mismatched > 0) + int(bool(rerun and rerun.mismatched)))
        v = make_verdict(
            p.kind,
            p.spec,
            self.device,
            first,
            rerun,
            p.first_cost_s + cost,
            self._evidence(),
            window_hits=hits,
        )
        if p.kind == "exact_gemm":
            v.evidence["input_bits"] = input_bits(p.spec)
        if p.kind == "digest_gemm" and v.status != "pass":
            v.mismatched_elements = 0
            v.detail = (
                f"digest_gemm {p.spec.label()}: output sha256 differs from this device's earlier "
                f"{first.evidence.get('previous_digest', '')[:16]}; "
                + (
                    "re-run differed again"
                    if v.status == "confirmed"
                    else "re-run matched the earlier digest"
                )
            )
        self._errors = 0
        self._record(v)
        return v

    def _record(self, v: Verdict) -> None:
        self.verdicts.append(v)
        del self.verdicts[: -self.keep]
        if v.status == "confirmed":
            log.error("SDC confirmed on %s: %s", v.device, v.detail)
        elif v.status == "transient":
            log.warning("SDC transient on %s: %s", v.device, v.detail)
        if v.status != "pass" or self.spool_passes:
            try:
                write_verdict(self.spool_dir, v)
            except OSError as err:
                if self.raise_errors:
                    raise
                log.error("sdc: cannot write verdict to %s: %s (%s)", self.spool_dir, err, v.detail)
