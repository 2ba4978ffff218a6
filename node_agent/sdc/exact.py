"""Exact-arithmetic GEMM probes: inputs, goldens and the on-device comparison.

Standard library and torch only (part of the training-side ``node_agent.sdc``).

**Why the answer is exact on any kernel.** The inputs are integers (times a power of two, see
``scale_exp``) with at most the input format's significant bits (``NUMERICS``: bf16 8, fp16 and
tf32 11, fp8 e4m3 4), so every input is exactly representable, TF32's input rounding included.
Every product is then an integer of at most ``2 * bits`` bits, exact in fp32, and K is chosen so
that ``K * vmax**2 < 2**acc_bits`` (24 for an fp32 accumulator): *every* partial sum, in
*any* order or grouping (tile order, split-K, the tensor core's multi-operand adds, which align
products to the largest exponent and truncate beyond the accumulator's width: Fasi, Higham,
Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021), is an integer
below ``2**acc_bits`` and so exact. The accumulator ends holding the exact sum, and the kernel
rounds it once to the output dtype. The golden value is the exact int64 sum rounded once to the
output dtype, round-to-nearest-even (what cuBLAS's and oneDNN's epilogues do), so it equals the
output bit for bit: no tolerance, and *any* difference is corruption.

**Where it does not hold** (``docs/sdc.md``): an accumulator narrower than ``acc_bits``
(Hopper's fp8 tensor cores keep about 14 bits: DeepSeek-V3 technical report, section 3.3.2;
hence ``acc_bits`` 13 for fp8), which :func:`accumulator_check` detects so the dtype is skipped
with the reason; a split-K reduction stored in the output dtype (double rounding), which
``strict_matmul`` turns off; and subnormal results (flushed to zero by some kernels), which
``scale_exp`` keeps out of fp16's range.

**Whole-GPU shapes, small goldens.** A whole-GPU probe's output is thousands of elements on a
side (``node_agent.sdc.tiles``). Its inputs repeat with period ``block``: A is a
``block x K`` block stacked ``M / block`` times, B a ``K x block`` block side by side
``N / block`` times, so the output repeats too and the golden is one ``block x block`` block,
kept on the device in the output dtype. The comparison broadcasts it over the output; every
tile still computes its full dot products on its own SM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from node_agent.sdc.tiles import TileModel

log = logging.getLogger("node_agent.sdc.probes")

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How one probe dtype computes: input and output dtypes, TF32, and the exactness budget."""

    name: str
    dtype: torch.dtype  # inputs
    out_dtype: torch.dtype  # what the GEMM writes
    tf32: bool  # fp32 tensors on TF32 tensor cores
    full_bits: int  # significant bits of the input format (implicit bit included)
    acc_bits: int  # every partial sum stays below 2**acc_bits (exact accumulator)
    scale_exp: int = 0  # inputs are integers * 2**-scale_exp


_FP8 = getattr(torch, "float8_e4m3fn", None)

#: probe dtype name -> its numerics. fp16 inputs are scaled by 2**-5 so sums up to 2**24 land in
#: fp16's range (max 65504) and the smallest nonzero sum (2**-10) stays normal (>= 2**-14).
#: fp8 writes bf16 (as training's fp8 GEMMs do) and keeps partial sums below 2**13, inside the
#: ~14 bits Hopper's fp8 tensor cores accumulate with (DeepSeek-V3 report, section 3.3.2).
NUMERICS: dict[str, Numerics] = {
    "fp32": Numerics("fp32", torch.float32, torch.float32, False, 24, 24),
    "tf32": Numerics("tf32", torch.float32, torch.float32, True, 11, 24),
    "bf16": Numerics("bf16", torch.bfloat16, torch.bfloat16, False, 8, 24),
    "fp16": Numerics("fp16", torch.float16, torch.float16, False, 11, 24, scale_exp=5),
}
if _FP8 is not None:
    NUMERICS["fp8"] = Numerics("fp8", _FP8, torch.bfloat16, False, 4, 13)

#: probe dtype name -> (torch dtype of the inputs, TF32 allowed); kept for callers of 0.x
DTYPES: dict[str, tuple[torch.dtype, bool]] = {n: (x.dtype, x.tf32) for n, x in NUMERICS.items()}

#: (dtype, input significant bits, K) of the whole-GPU exact probes, in rotation order: each
#: dtype's full significand with the largest K the 2**acc_bits bound allows (fp16 and tf32:
#: 4 * 2047**2 < 2**24, so K = 4), then 8-bit inputs with K = 256 (256 * 255**2 < 2**24) for
#: the deep-K path training's GEMMs take (every k-lane of the MMA, the K loop, split-K).
WHOLE_GPU_SPECS: tuple[tuple[str, int, int], ...] = (
    ("bf16", 8, 256),
    ("fp16", 11, 4),
    ("tf32", 11, 4),
    ("fp8", 4, 32),
    ("fp16", 8, 256),
    ("tf32", 8, 256),
    ("fp32", 8, 256),
)


def numerics(name: str) -> Numerics:
    if name not in NUMERICS:
        why = " (this torch has no float8_e4m3fn)" if name == "fp8" else ""
        raise ValueError(f"probe dtype {name!r} is not one of {sorted(NUMERICS)}{why}")
    return NUMERICS[name]


def dtype_unsupported(name: str, device: torch.device) -> str | None:
    """None when ``device`` runs exact GEMMs in ``name``; else why not (a skip reason)."""
    if name not in NUMERICS:
        return f"{name}: this torch {torch.__version__} has no such dtype"
    if device.type != "cuda":
        if name == "tf32":
            return "tf32: the CPU has no TF32 tensor cores"
        if name == "fp8":
            return "fp8: the CPU has no fp8 GEMM"
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if name in ("bf16", "tf32") and major < 8:
        return f"{name}: needs compute capability 8.0 or newer, the GPU has {major}.{minor}"
    if name == "fp8":
        if (major, minor) < (8, 9):
            return f"fp8: needs compute capability 8.9 or newer (Ada, Hopper), the GPU has {major}.{minor}"
        if not hasattr(torch, "_scaled_mm"):
            return f"fp8: torch {torch.__version__} has no torch._scaled_mm"
    return None


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """One exact probe: GEMM shape (M, K, N), dtype name, input seed, and

    ``bits``: significant bits of the integer inputs (default: as many as the dtype's format
    has and K allows, see :func:`input_bits`); ``block``: period (rows, cols) of the inputs
    and the golden (default: the whole output, no repetition)."""

    m: int
    k: int
    n: int
    dtype: str = "fp32"
    seed: int = 0
    bits: int | None = None
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)

    @property
    def period(self) -> tuple[int, int]:
        return self.block or (self.m, self.n)

    def label(self) -> str:
        return f"{self.dtype} {self.m}x{self.k}x{self.n}"


def input_bits(spec: ProbeSpec) -> int:
    """Significant bits of ``spec``'s inputs: ``spec.bits``, or the most the dtype has with
    ``K * (2**bits - 1)**2 < 2**acc_bits``; ValueError when not even 1 bit fits or the given
    bits break the bound."""
    x = numerics(spec.dtype)
    limit = 2**x.acc_bits
    if spec.bits is not None:
        if not 1 <= spec.bits <= x.full_bits:
            raise ValueError(
                f"exact probe {spec.label()}: bits {spec.bits} outside 1..{x.full_bits} "
                f"({spec.dtype} has {x.full_bits} significant bits)"
            )
        vmax = 2**spec.bits - 1
        if spec.k * vmax * vmax >= limit:
            raise ValueError(
                f"exact probe {spec.label()}: worst-case |partial sum| K*vmax^2 = "
                f"{spec.k * vmax * vmax} exceeds {limit}, the exact range of the "
                f"{x.acc_bits}-bit accumulator; use K <= {(limit - 1) // (vmax * vmax)} for "
                f"{spec.bits}-bit inputs"
            )
        return spec.bits
    for bits in range(x.full_bits, 0, -1):
        vmax = 2**bits - 1
        if spec.k * vmax * vmax < limit:
            return bits
    raise ValueError(
        f"exact probe {spec.label()}: K = {spec.k} exceeds {limit - 1}: even inputs "
        f"of +-1 could round in the {x.acc_bits}-bit accumulator; use a smaller K"
    )


def check_spec(spec: ProbeSpec) -> tuple[Numerics, int]:
    """(numerics, vmax) of a valid spec; ValueError naming what is wrong otherwise."""
    x = numerics(spec.dtype)
    if min(spec.m, spec.k, spec.n) < 1:
        raise ValueError(f"exact probe {spec.label()}: M, K, N must be positive")
    pm, pn = spec.period
    if pm < 1 or pn < 1 or spec.m % pm or spec.n % pn:
        raise ValueError(f"exact probe {spec.label()}: block {spec.block} must divide M x N")
    if spec.dtype == "fp8" and (spec.m % 16 or spec.k % 16 or spec.n % 16):
        raise ValueError(
            f"exact probe {spec.label()}: fp8 GEMMs (torch._scaled_mm) need M, K, N multiples of 16"
        )
    bits = input_bits(spec)
    return x, 2**bits - 1


@contextlib.contextmanager
def strict_matmul(tf32: bool = False) -> Iterator[None]:
    """Disable TF32 (unless asked) and reduced-precision reductions; restore afterwards.

    These flags are process-wide and read when a matmul is launched, so flipping them inside
    the training thread's ``step()`` call does not affect training kernels launched before or
    after it.
    """
    m = torch.backends.cuda.matmul
    saved = (
        m.allow_tf32,
        m.allow_bf16_reduced_precision_reduction,
        m.allow_fp16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
    )
    try:
        m.allow_tf32 = tf32
        m.allow_bf16_reduced_precision_reduction = False
        m.allow_fp16_reduced_precision_reduction = False
        torch.backends.cudnn.allow_tf32 = tf32
        yield
    finally:
        (
            m.allow_tf32,
            m.allow_bf16_reduced_precision_reduction,
            m.allow_fp16_reduced_precision_reduction,
            torch.backends.cudnn.allow_tf32,
        ) = saved


# --------------------------------------------------------------------------------------------
# The GEMM itself (fp8 goes through torch._scaled_mm)

_ONES: dict[str, torch.Tensor] = {}


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (into ``out`` when given); for fp8 (e4m3) inputs ``torch._scaled_mm`` with
    unit scales, bf16 output and ``use_fast_accum=False`` (B must be column-major, as
    :class:`ExactState` lays it out)."""
    if _FP8 is not None and a.dtype == _FP8:
        key = str(a.device)
        one = _ONES.get(key)
        if one is None:
            one = _ONES[key] = torch.ones((), device=a.device, dtype=torch.float32)
        kw = {"out": out} if out is not None else {}
        res = torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False, **kw
        )
        return res[0] if isinstance(res, tuple) else res  # torch < 2.4 returned (out, amax)
    if out is not None:
        return torch.matmul(a, b, out=out)
    return torch.matmul(a, b)


# --------------------------------------------------------------------------------------------
# Goldens (CPU, cached per spec)

_GOLDEN: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_GOLDEN_OUT: dict[tuple[Any, ...], torch.Tensor] = {}


def _key(spec: ProbeSpec) -> tuple[Any, ...]:
    return (spec.shape, spec.dtype, spec.seed, input_bits(spec), spec.period)


def _draw(shape: tuple[int, int], bits: int, g: torch.Generator) -> torch.Tensor:
    """Integers of at most ``bits`` significant bits: three in four use all of them (magnitude
    in [2**(bits-1), 2**bits - 1], a full significand), one in four is uniform in
    [-(2**bits - 1), 2**bits - 1] (small values and zeros, so exponents vary too)."""
    vmax = 2**bits - 1
    lo = 2 ** (bits - 1)
    full = torch.randint(lo, vmax + 1, shape, generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int64) * 2 - 1
    mixed = torch.randint(-vmax, vmax + 1, shape, generator=g, dtype=torch.int64)
    pick = torch.randint(0, 4, shape, generator=g, dtype=torch.int64)
    return torch.where(pick == 0, mixed, full * sign)


def golden(spec: ProbeSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, A@B) as int64 CPU tensors, one period of each: A is ``block_m x K``, B
    ``K x block_n``, the exact product ``block_m x block_n`` (the whole output when the spec
    has no ``block``). Computed once per spec and cached."""
    key = _key(spec)
    hit = _GOLDEN.get(key)
    if hit is None:
        _, vmax = check_spec(spec)
        bits = input_bits(spec)
        pm, pn = spec.period
        g = torch.Generator().manual_seed(spec.seed)
        a = _draw((pm, spec.k), bits, g)
        b = _draw((spec.k, pn), bits, g)
        hit = _GOLDEN[key] = (a, b, a @ b)
    return hit


def golden_out(spec: ProbeSpec) -> torch.Tensor:
    """The golden block as the GEMM writes it: the exact sum, scaled, rounded once to the output
    dtype (round-to-nearest-even: |sum| < 2**24 and the scale is a power of two, so the step to
    fp32 is exact and fp32 -> output is the one rounding). Cached."""
    key = _key(spec)
    hit = _GOLDEN_OUT.get(key)
    if hit is None:
        x, _ = check_spec(spec)
        _, _, c = golden(spec)
        scaled = c.to(torch.float64) * 2.0 ** (-2 * x.scale_exp)
        hit = _GOLDEN_OUT[key] = scaled.to(torch.float32).to(x.out_dtype)
    return hit


def _inputs_cpu(spec: ProbeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M x K) and B (K x N) in the input dtype: the period blocks repeated."""
    x, _ = check_spec(spec)
    a, b, _ = golden(spec)
    pm, pn = spec.period
    s = 2.0 ** (-x.scale_exp)
    a_full = (a.to(torch.float32) * s).repeat(spec.m // pm, 1).to(x.dtype)
    b_full = (b.to(torch.float32) * s).repeat(1, spec.n // pn).to(x.dtype)
    return a_full, b_full


# --------------------------------------------------------------------------------------------
# A spec on a device: inputs, golden, comparison


@dataclasses.dataclass
class Outcome:
    """One run of one probe, before confirmation."""

    mismatched: int
    total: int
    evidence: dict[str, Any]


class Readback:
    """Pinned host buffers the device copies a probe's result into (no host synchronisation):
    the mismatch count and the per-tile mismatch map."""

    def __init__(self, tiles: int) -> None:
        self.count = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.tiles = torch.zeros(max(tiles, 1), dtype=torch.bool, pin_memory=True)

    @property
    def nbytes(self) -> int:
        return self.count.numel() * 8 + self.tiles.numel()


class Workspace:
    """Preallocated device buffers one probe at a time writes into (output and mismatch mask),
    so the memory an in-training probe holds is fixed, not what the caching allocator keeps."""

    def __init__(self, device: torch.device, out_bytes: int, elements: int) -> None:
        self.out = torch.empty(out_bytes, dtype=torch.uint8, device=device)
        self.bad = torch.empty(elements, dtype=torch.bool, device=device)

    def out_view(self, m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.out[: m * n * size].view(dtype).view(m, n)

    def bad_view(self, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= s
        return self.bad[:count].view(shape)

    @property
    def nbytes(self) -> int:
        return self.out.numel() + self.bad.numel()


def output_bytes(spec: ProbeSpec) -> int:
    """Bytes of the spec's output."""
    x = numerics(spec.dtype)
    return spec.m * spec.n * torch.empty((), dtype=x.out_dtype).element_size()


def state_bytes(spec: ProbeSpec) -> int:
    """Device bytes a spec keeps between probes: its inputs and its golden block."""
    x = numerics(spec.dtype)
    size_in = torch.empty((), dtype=x.dtype).element_size()
    size_out = torch.empty((), dtype=x.out_dtype).element_size()
    pm, pn = spec.period
    return (spec.m * spec.k + spec.k * spec.n) * size_in + pm * pn * size_out


class ExactState:
    """One spec's inputs and golden on one device (made on the stream current at creation, which
    must be the stream the probe runs on), and the queued comparison."""

    def __init__(
        self, spec: ProbeSpec, device: torch.device, tiles: TileModel | None = None
    ) -> None:
        self.spec = spec
        self.device = device
        self.numerics, _ = check_spec(spec)
        self.tiles = tiles
        a, b = _inputs_cpu(spec)
        self.a = a.to(device)
        self.b = b.to(device)
        if spec.dtype == "fp8":
            self.b = self.b.t().contiguous().t()  # torch._scaled_mm wants B column-major
        self.golden_block = golden_out(spec)
        self.gold = self.golden_block.to(device)
        pm, pn = spec.period
        self._gold4 = self.gold.view(1, pm, 1, pn)
        self._tiled = (
            tiles is not None and spec.m % tiles.tile_m == 0 and spec.n % tiles.tile_n == 0
        )

    @property
    def tile_count(self) -> int:
        return self.tiles.tiles(self.spec.m, self.spec.n) if self.tiles else 0

    def launch(
        self,
        mm: Matmul | None = None,
        workspace: Workspace | None = None,
        readback: Readback | None = None,
    ) -> Callable[[], Outcome]:
        """Queue the GEMM and its comparison on the current stream; return ``read()``.

        With ``readback`` (pinned buffers), only device work and non-blocking copies are
        queued: call ``read()`` after an event recorded behind them has completed. Without it,
        ``read()`` synchronises the stream and gathers fuller evidence (first mismatches).
        ``workspace`` (preallocated buffers) is used for the default GEMM; an injected ``mm``
        (the simulator's) allocates its own output.
        """
        s = self.spec
        pm, pn = s.period
        with strict_matmul(self.numerics.tf32):
            if mm is None and workspace is not None:
                out = gemm(
                    self.a, self.b, out=workspace.out_view(s.m, s.n, self.numerics.out_dtype)
                )
            else:
                out = (mm or gemm)(self.a, self.b)
        shape4 = (s.m // pm, pm, s.n // pn, pn)
        if workspace is not None:
            bad = torch.ne(out.view(shape4), self._gold4, out=workspace.bad_view(shape4))
        else:
            bad = out.view(shape4) != self._gold4  # NaN counts as a mismatch
        bad2 = bad.view(s.m, s.n)
        count = bad2.sum()
        tile_bad = None
        if self._tiled and self.tiles is not None:
            tm, tn = self.tiles.tile
            tile_bad = bad2.view(s.m // tm, tm, s.n // tn, tn).any(dim=3).any(dim=1).view(-1)
        if readback is not None:
            readback.count.copy_(count.view(1), non_blocking=True)
            if tile_bad is not None:
                readback.tiles[: tile_bad.numel()].copy_(tile_bad, non_blocking=True)

            def read_pinned() -> Outcome:
                n = int(readback.count[0])
                ev: dict[str, Any] = {}
                if n and tile_bad is not None:
                    ev.update(
                        self._tile_evidence(
                            readback.tiles[: tile_bad.numel()].nonzero().view(-1).tolist()
                        )
                    )
                return Outcome(n, s.m * s.n, ev)

            return read_pinned

        def read() -> Outcome:
            n = int(count.item())
            ev: dict[str, Any] = {}
            if n:
                idx = torch.nonzero(bad2)
                first = idx[:5].tolist()
                gold = self.golden_block
                ev["first"] = [
                    [[i, j], float(out[i, j]), float(gold[i % pm, j % pn])] for i, j in first
                ]
                if self.tiles is not None:
                    if tile_bad is not None:
                        bad_tiles = tile_bad.nonzero().view(-1).tolist()
                    else:
                        bad_tiles = sorted(
                            {self.tiles.tile_of(i, j, s.n) for i, j in idx[:10_000].tolist()}
                        )
                    ev.update(self._tile_evidence(bad_tiles))
            return Outcome(n, s.m * s.n, ev)

        return read

    def _tile_evidence(self, bad_tiles: list[int]) -> dict[str, Any]:
        """Which tiles mismatched, and their residues mod the SM count: tiles with one residue
        ran on one SM under the round-robin model (``node_agent.sdc.tiles``), wherever the
        launch started."""
        assert self.tiles is not None
        residues = self.tiles.sm_counts(bad_tiles)
        return {
            "tiles": bad_tiles[:32],
            "tiles_mismatched": len(bad_tiles),
            "tiles_total": self.tile_count,
            "tile": list(self.tiles.tile),
            "tile_residues": {str(k): v for k, v in residues.items()},
            "sm_count": self.tiles.sm_count,
        }


_STATES: dict[tuple[Any, ...], ExactState] = {}


def exact_state(
    spec: ProbeSpec, device: torch.device, tiles: TileModel | None = None
) -> ExactState:
    """The cached :class:`ExactState` of ``spec`` on ``device`` and its current stream."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (spec, str(device), str(stream), tiles)
    hit = _STATES.get(key)
    if hit is None:
        hit = _STATES[key] = ExactState(spec, device, tiles)
    return hit


# --------------------------------------------------------------------------------------------
# Is the kernel's accumulator as wide as the exactness argument needs?

ACC_CHECK_K = 32


def accumulator_inputs(name: str, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A, B, exact value of every output element) for :func:`accumulator_check`.

    Each dot product is ``+2**(acc_bits-1)`` (k = 0), ``-2**(acc_bits-1)`` (k = K/2) and
    ``K - 2`` products of 1. Partial sums never exceed ``2**(acc_bits-1) + K``, so an
    accumulator as wide as the probes assume gets ``K - 2`` exactly in any order; a narrower one
    drops the ones added while the big term is in it (and gets less)."""
    x = numerics(name)
    k = ACC_CHECK_K
    hi = (x.acc_bits - 1 + 1) // 2
    lo = (x.acc_bits - 1) - hi
    s = 2.0 ** (-x.scale_exp)
    a = torch.ones(m, k, dtype=torch.float32)
    b = torch.ones(k, n, dtype=torch.float32)
    a[:, 0], a[:, k // 2] = 2.0**hi, -(2.0**hi)
    b[0, :], b[k // 2, :] = 2.0**lo, 2.0**lo
    return (a * s).to(x.dtype), (b * s).to(x.dtype), k - 2


class AccumulatorCheck:
    """Is ``name``'s GEMM on ``device`` as exact as the probes assume? (see
    :func:`accumulator_check`). Inputs are made once; :meth:`launch` queues a run."""

    def __init__(self, name: str, device: torch.device, tiles: TileModel | None = None) -> None:
        self.name = name
        self.numerics = numerics(name)
        side = 4 * (tiles.tile_m if tiles else 128)
        a, b, self.exact = accumulator_inputs(name, side, side)
        self.total = side * side
        self.a, self.b = a.to(device), b.to(device)
        if name == "fp8":
            self.b = self.b.t().contiguous().t()
        up = 2.0 ** (2 * self.numerics.scale_exp)
        self._want = torch.tensor(self.exact / up, dtype=self.numerics.out_dtype).to(device)
        self._unscale = torch.tensor([up, up, 1.0], dtype=torch.float64).to(device)

    @property
    def nbytes(self) -> int:
        """Device bytes held (inputs) plus the transient peak of a run (output and mask)."""
        x = self.numerics
        size_in = torch.empty((), dtype=x.dtype).element_size()
        size_out = torch.empty((), dtype=x.out_dtype).element_size()
        return (self.a.numel() + self.b.numel()) * size_in + self.total * (size_out + 1)

    def launch(
        self, mm: Matmul | None = None, pinned: torch.Tensor | None = None
    ) -> Callable[[], str | None]:
        """Queue the check on the current stream; ``read()`` gives None or the skip reason.
        With ``pinned`` (3 float64, pinned host memory) nothing synchronises: call ``read()``
        after an event recorded behind the copy has completed."""
        x = self.numerics
        with strict_matmul(x.tf32):
            out = (mm or gemm)(self.a, self.b)
        # statistics in the output dtype (exact: small integers, scaled), so the transient
        # memory is the output and one mask, nothing wider
        stats = (
            torch.stack(
                [out.min().double(), out.max().double(), (out != self._want).sum().double()]
            )
            * self._unscale
        )
        if pinned is not None:
            pinned.copy_(stats, non_blocking=True)
            return lambda: self.judge(*pinned.tolist())
        return lambda: self.judge(*stats.tolist())

    def judge(self, lo: float, hi: float, wrong: float) -> str | None:
        if wrong == 0:
            return None
        if wrong == self.total and lo == hi and lo == int(lo) and 0 <= lo < self.exact:
            return (
                f"{self.name}: this GEMM kernel accumulates in lower precision than the exact "
                f"probe needs ({self.numerics.acc_bits} bits): a sum of "
                f"+-2^{self.numerics.acc_bits - 1} and {self.exact} ones came out {int(lo)}, "
                f"not {self.exact}; the {self.name} exact probes are skipped"
            )
        log.warning(
            "sdc accumulator check %s: %d of %d elements wrong, not the lower-precision "
            "pattern (the probes will report it)",
            self.name,
            int(wrong),
            self.total,
        )
        return None


def accumulator_check(
    name: str,
    device: torch.device | str,
    matmul: Matmul | None = None,
    tiles: TileModel | None = None,
) -> str | None:
    """None when ``name``'s GEMM on ``device`` keeps every bit the exact probe relies on.

    Otherwise the reason the dtype must be skipped: every output element came back the same
    integer, short of the exact value by ones the accumulator dropped, which is the signature of
    a kernel that accumulates in lower precision (a faulty SM corrupts only its own tiles, and
    never into that pattern). A mismatch of any other shape is left to the probes. Synchronises
    the device's current stream."""
    return AccumulatorCheck(name, torch.device(device), tiles).launch(matmul)()


# --------------------------------------------------------------------------------------------
# Whole-GPU specs


def tile_model_for(device: torch.device | str, sm_count: int | None = None) -> TileModel:
    """The tile model of ``device``: a CUDA GPU's SM count from
    ``torch.cuda.get_device_properties(...).multi_processor_count`` (128 x 128 tiles); a CPU
    stand-in is a simulated GPU of ``sm_count`` SMs (default ``tiles.DEFAULT_SM_COUNT``)."""
    import node_agent.sdc.tiles as tiles_mod

    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return tiles_mod.gpu_model(sm_count or props.multi_processor_count)
    return tiles_mod.sim_model(sm_count)


def plan_whole_gpu(
    model: TileModel,
    dtypes: tuple[str, ...] | list[str],
    tiles_per_sm: int,
    block: int,
    seed: int = 0,
) -> list[ProbeSpec]:
    """The ``WHOLE_GPU_SPECS`` of these dtypes for a GPU of this tile model (pure: no device).

    >>> from node_agent.sdc.tiles import gpu_model
    >>> [s.label() for s in plan_whole_gpu(gpu_model(132), ["bf16", "fp16"], 4, 256)]
    ['bf16 3072x256x2816', 'fp16 3072x4x2816', 'fp16 3072x256x2816']
    """
    import node_agent.sdc.tiles as tiles_mod

    m, n = tiles_mod.whole_gpu_mn(model, tiles_per_sm, block)
    return [
        ProbeSpec(m, k, n, name, seed=seed, bits=bits, block=(block, block))
        for name, bits, k in WHOLE_GPU_SPECS
        if name in dtypes
    ]


def whole_gpu_specs(
    device: torch.device | str,
    tiles: TileModel | None = None,
    dtypes: tuple[str, ...] | list[str] | None = None,
    tiles_per_sm: int | None = None,
    seed: int = 0,
) -> tuple[list[ProbeSpec], dict[str, str]]:
    """The whole-GPU exact specs for ``device`` (``WHOLE_GPU_SPECS`` whose dtype is in
    ``dtypes`` and runs there) and ``{dtype: why skipped}`` for the others.

    The output is :func:`node_agent.sdc.tiles.whole_gpu_mn` of the device's tile model:
    ``tiles_per_sm`` (default 4 on a GPU, 2 simulated) tiles per SM, inputs repeating with the
    golden's period (256 on a GPU, 64 simulated)."""
    import node_agent.sdc.tiles as tiles_mod

    dev = torch.device(device)
    model = tiles or tile_model_for(dev)
    cuda = dev.type == "cuda"
    per_sm = tiles_per_sm or (tiles_mod.GPU_TILES_PER_SM if cuda else tiles_mod.SIM_TILES_PER_SM)
    block = tiles_mod.GPU_BLOCK if cuda else tiles_mod.SIM_BLOCK
    names = [name for name, _, _ in WHOLE_GPU_SPECS]
    wanted = [d for d in dict.fromkeys(names) if dtypes is None or d in dtypes]
    skipped = {d: why for d in wanted if (why := dtype_unsupported(d, dev))}
    runnable = [d for d in wanted if d not in skipped]
    return plan_whole_gpu(model, runnable, per_sm, block, seed), skipped
