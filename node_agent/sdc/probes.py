"""Silent-data-corruption (SDC) probes: small matrix multiplies whose right answer is known.

This module is the in-training probe API of the design's "SDC probes" section. It imports only
the standard library and torch (no pynvml, no yaml, no other ``node_agent`` module), so a
training job can use it without the rest of the agent::

    from node_agent.sdc import SdcProbe

    probe = SdcProbe()            # current CUDA device, 0.1 % budget, spool under the state dir
    for batch in loader:
        loss = model(batch).sum(); loss.backward(); opt.step()
        probe.step()              # never raises; runs a probe only while under budget

Three probes, cheapest first (see ``docs/sdc.md``):

1. ``exact_gemm_probe``: small-integer inputs, so every product and partial sum is exact in the
   fp32 accumulator and the output is exact in the output dtype; the golden value is an int64
   matmul on the CPU and *any* difference is corruption.
2. ``digest_probe``: full-mantissa inputs from a fixed seed; the sha256 of the output is compared
   across the GPUs of a node (``odd_one_out``) and with the same GPU's earlier digest.
3. ``freivalds_check``: C·x against A·(B·x) for a big GEMM, O(n²), with a documented bound.

A mismatch is re-run before it is believed: repeated is ``confirmed`` (a FAULT), unrepeated is
``transient`` (a WARN, kept as evidence). Every probe takes a ``matmul`` callable (default
``torch.matmul``): that is the compute boundary where the simulator injects corruption
(``corrupting_matmul``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the caller imports it; sdc stays stdlib + torch at runtime
    from node_agent.heartbeat import Heartbeat

from node_agent.sdc.spool import (  # noqa: F401 - re-exported: the probe API's verdicts and spool
    SPOOL_SCHEMA,
    Verdict,
    default_spool_dir,
    read_spool,
    read_spool_files,
    write_verdict,
)

__all__ = [
    "DTYPES",
    "DEFAULT_SHAPES",
    "ProbeSpec",
    "Verdict",
    "SdcProbe",
    "corrupting_matmul",
    "default_specs",
    "default_spool_dir",
    "digest_probe",
    "exact_gemm_probe",
    "freivalds_check",
    "freivalds_probe",
    "golden",
    "odd_one_out",
    "read_spool",
    "read_spool_files",
    "run_probes",
    "strict_matmul",
    "write_verdict",
]

log = logging.getLogger(__name__)

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Clock = Callable[[], float]


# Probe dtype name -> (torch dtype of inputs and output, TF32 allowed).
DTYPES: dict[str, tuple[torch.dtype, bool]] = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),  # fp32 tensors, TF32 tensor cores (CUDA only)
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
}

# Largest integer below which every integer is exact in the dtype: 2^(mantissa bits + 1).
# IEEE 754 binary32 / binary16 and bfloat16 have 23, 10 and 7 stored mantissa bits.
_EXACT_INT_LIMIT = {torch.float32: 2**24, torch.bfloat16: 2**8, torch.float16: 2**11}
# Unit roundoff (half an ulp at 1.0) of what the output is rounded to; TF32 rounds inputs to 10
# mantissa bits (NVIDIA A100 whitepaper, "TF32 Tensor Core").
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_TF32_INPUT_ROUNDOFF = 2.0**-11
_FP32_ACC_ROUNDOFF = 2.0**-24

# Integer input range per dtype for the exact probe: |a|, |b| <= vmax.  The output is stored in
# the probe dtype, so the bound that matters is vmax^2 * K within the *output's* exact range
# (bf16: 256, fp16: 2048), not only the fp32 accumulator's 2^24.
_EXACT_VMAX = {torch.float32: 2, torch.float16: 2, torch.bfloat16: 1}

# (M, K, N).  Odd sizes on purpose: they select different GEMM kernels / tile paths than the
# powers of two do.  K <= 256 keeps bf16 (vmax 1) and fp16 (vmax 2: 4*256 = 1024) exact.
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = ((128, 128, 128), (96, 256, 160), (257, 64, 33))


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """One probe configuration: GEMM shape (M, K, N), probe dtype name and input seed."""

    m: int
    k: int
    n: int
    dtype: str = "fp32"
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)

    def label(self) -> str:
        return f"{self.dtype} {self.m}x{self.k}x{self.n}"


def default_specs(
    device: torch.device | str | None = None,
    shapes: Iterable[tuple[int, int, int]] | None = None,
    seed: int = 0,
) -> list[ProbeSpec]:
    """Every shape in every dtype the device supports (``tf32`` only on CUDA)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    names = ["fp32", "bf16", "fp16"] + (["tf32"] if dev.type == "cuda" else [])
    return [ProbeSpec(*shape, dtype=d, seed=seed) for shape in (shapes or DEFAULT_SHAPES) for d in names]


# --------------------------------------------------------------------------------------------
# Numerics settings


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
# Exact-arithmetic GEMM

_GOLDEN: dict[tuple[tuple[int, int, int], str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_DEVICE_INPUTS: dict[tuple[ProbeSpec, str, str], tuple[torch.Tensor, ...]] = {}


def _check_exact(spec: ProbeSpec) -> tuple[torch.dtype, bool, int]:
    if spec.dtype not in DTYPES:
        raise ValueError(f"probe dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
    dtype, tf32 = DTYPES[spec.dtype]
    vmax = _EXACT_VMAX[dtype]
    bound = vmax * vmax * spec.k  # worst-case |sum| of K products of |a|,|b| <= vmax
    limit = min(_EXACT_INT_LIMIT[dtype], _EXACT_INT_LIMIT[torch.float32])
    if bound > limit:
        raise ValueError(
            f"exact probe {spec.label()}: worst-case |sum| {bound} exceeds {limit}, the exact "
            f"integer range of {spec.dtype} output / fp32 accumulator; use K <= {limit // (vmax * vmax)}"
        )
    return dtype, tf32, vmax


def golden(spec: ProbeSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, A@B) as int64 CPU tensors for an exact probe, computed once and cached.

    A and B hold integers in [-vmax, vmax] drawn from ``spec.seed`` (vmax 2, or 1 for bf16).
    """
    key = (spec.shape, spec.dtype, spec.seed)
    hit = _GOLDEN.get(key)
    if hit is None:
        _, _, vmax = _check_exact(spec)
        g = torch.Generator().manual_seed(spec.seed)
        a = torch.randint(-vmax, vmax + 1, (spec.m, spec.k), generator=g, dtype=torch.int64)
        b = torch.randint(-vmax, vmax + 1, (spec.k, spec.n), generator=g, dtype=torch.int64)
        hit = _GOLDEN[key] = (a, b, a @ b)
    return hit


def _exact_inputs(spec: ProbeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device copies of (A, B) in the probe dtype and the golden value as float64 (cached)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (spec, str(device), str(stream))
    hit = _DEVICE_INPUTS.get(key)
    if hit is None:
        dtype, _, _ = _check_exact(spec)
        a, b, c = golden(spec)
        hit = _DEVICE_INPUTS[key] = (
            a.to(dtype).to(device),
            b.to(dtype).to(device),
            c.to(torch.float64).to(device),
        )
    return hit  # type: ignore[return-value]


@dataclasses.dataclass
class _Outcome:
    """One run of one probe, before confirmation."""

    mismatched: int
    total: int
    evidence: dict[str, Any]


def _launch_exact(spec: ProbeSpec, device: torch.device, matmul: Matmul) -> Callable[[], _Outcome]:
    """Queue the exact GEMM and its comparison; return a function that reads the result.

    On CUDA the work is only queued (on the current stream); the returned function syncs.
    """
    dtype, tf32, _ = _check_exact(spec)
    a, b, expected = _exact_inputs(spec, device)
    with strict_matmul(tf32):
        out = matmul(a, b)
    got = out.to(torch.float64)
    bad = got != expected  # NaN counts as a mismatch
    count = bad.sum()
    first = torch.nonzero(bad)[:5] if device.type != "cuda" else None

    def read() -> _Outcome:
        n = int(count.item())
        ev: dict[str, Any] = {}
        if n:
            idx = first if first is not None else torch.nonzero(bad)[:5]
            ev["first"] = [
                [[int(i), int(j)], float(got[i, j]), float(expected[i, j])] for i, j in idx.tolist()
            ]
        return _Outcome(n, expected.numel(), ev)

    return read


def _describe(probe: str, spec: ProbeSpec, o: _Outcome, rerun: _Outcome | None) -> str:
    if not o.mismatched:
        return f"{probe} {spec.label()}: all {o.total} elements match"
    firsts = "; ".join(f"{tuple(i)} got {g!r} expected {e!r}" for i, g, e in o.evidence.get("first", []))
    again = (
        f"re-run repeated it ({rerun.mismatched} differ)"
        if rerun is not None and rerun.mismatched
        else "re-run matched (transient)"
    )
    return f"{probe} {spec.label()}: {o.mismatched} of {o.total} elements differ; {again}; first: {firsts}"


def _verdict(
    probe: str, spec: ProbeSpec, device: torch.device, first: _Outcome, rerun: _Outcome | None,
    duration_s: float, evidence: dict[str, Any] | None = None,
) -> Verdict:
    if not first.mismatched:
        status = "pass"
    elif rerun is not None and rerun.mismatched:
        status = "confirmed"
    else:
        status = "transient"
    ev = dict(first.evidence)
    if rerun is not None:
        ev["rerun_mismatched_elements"] = rerun.mismatched
        ev["rerun"] = rerun.evidence
    ev.update(evidence or {})
    return Verdict(
        probe=probe, device=str(device), shape=spec.shape, dtype=spec.dtype, status=status,
        mismatched_elements=first.mismatched, detail=_describe(probe, spec, first, rerun),
        duration_s=duration_s, timestamp=time.time(), evidence=ev,
    )


def _error_verdict(probe: str, spec: ProbeSpec | None, device: Any, err: BaseException, duration_s: float = 0.0) -> Verdict:
    return Verdict(
        probe=probe, device=str(device), shape=spec.shape if spec else (), dtype=spec.dtype if spec else "",
        status="error", mismatched_elements=0,
        detail=f"{probe} {spec.label() if spec else ''} could not run: {type(err).__name__}: {err}",
        duration_s=duration_s, timestamp=time.time(),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def exact_gemm_probe(
    spec: ProbeSpec, device: torch.device | str = "cpu", matmul: Matmul | None = None,
    clock: Clock = time.perf_counter,
) -> Verdict:
    """Run one exact-arithmetic GEMM on ``device`` (on its current stream), compare with the
    CPU golden value; re-run once on a mismatch.  Returns a Verdict (never ``error``: an
    exception propagates to the caller).

    >>> exact_gemm_probe(ProbeSpec(64, 64, 64, "bf16")).status
    'pass'
    """
    dev = torch.device(device)
    mm = matmul or torch.matmul
    t0 = clock()
    first = _launch_exact(spec, dev, mm)()
    rerun = _launch_exact(spec, dev, mm)() if first.mismatched else None
    _sync(dev)
    return _verdict("exact_gemm", spec, dev, first, rerun, clock() - t0)


# --------------------------------------------------------------------------------------------
# Random-data GEMM with digests

_RANDOM_INPUTS: dict[tuple[ProbeSpec, str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _random_inputs(spec: ProbeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn on the CPU so that every GPU of the node multiplies the very same bits.
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (spec, str(device), str(stream))
    hit = _RANDOM_INPUTS.get(key)
    if hit is None:
        dtype = DTYPES[spec.dtype][0]
        g = torch.Generator().manual_seed(spec.seed)
        a = torch.randn(spec.m, spec.k, generator=g, dtype=torch.float32).to(dtype)
        b = torch.randn(spec.k, spec.n, generator=g, dtype=torch.float32).to(dtype)
        hit = _RANDOM_INPUTS[key] = (a.to(device), b.to(device))
    return hit


def _sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's exact bytes (copied to the host first when needed)."""
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).hexdigest()


def _digest_once(spec: ProbeSpec, device: torch.device, matmul: Matmul) -> str:
    if spec.dtype not in DTYPES:
        raise ValueError(f"probe dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
    a, b = _random_inputs(spec, device)
    with strict_matmul(DTYPES[spec.dtype][1]):
        out = matmul(a, b)
    return _sha256(out)


def digest_probe(
    spec: ProbeSpec, device: torch.device | str = "cpu", matmul: Matmul | None = None,
    previous: str | None = None, clock: Clock = time.perf_counter,
) -> Verdict:
    """Random full-mantissa GEMM; ``evidence['digest']`` is the sha256 of the output bytes.

    Compare digests across the node's GPUs with ``odd_one_out``.  Given ``previous`` (this
    GPU's earlier digest for the same spec and software), a differing digest is re-run:
    different again is ``confirmed``, back to ``previous`` is ``transient``.
    """
    dev = torch.device(device)
    mm = matmul or torch.matmul
    t0 = clock()
    d1 = _digest_once(spec, dev, mm)
    first = _Outcome(0, 1, {})
    rerun = None
    ev: dict[str, Any] = {"digest": d1}
    if previous is not None and d1 != previous:
        d2 = _digest_once(spec, dev, mm)
        first = _Outcome(1, 1, {"digest_differs_from_previous": previous})
        rerun = _Outcome(int(d2 != previous), 1, {"digest": d2})
        if d2 == previous:
            ev["digest"] = d2
    v = _verdict("digest_gemm", spec, dev, first, rerun, clock() - t0, ev)
    if v.status == "pass":
        v.detail = f"digest_gemm {spec.label()}: sha256 {d1[:16]}"
    else:
        v.detail = (
            f"digest_gemm {spec.label()}: output sha256 {d1[:16]} differs from this device's "
            f"earlier {previous[:16]}; " + ("re-run differed again" if v.status == "confirmed" else "re-run matched the earlier digest")
        )
        v.mismatched_elements = 0  # unknown: a digest says that bits differ, not how many
    return v


def odd_one_out(digests: Mapping[Hashable, str]) -> list[Hashable]:
    """The devices whose digest differs from a strict majority's; [] without a majority.

    >>> odd_one_out({"cuda:0": "aa", "cuda:1": "aa", "cuda:2": "bb"})
    ['cuda:2']
    """
    if not digests:
        return []
    value, count = Counter(digests.values()).most_common(1)[0]
    if count * 2 <= len(digests):
        return []  # a tie (2 vs 2, or 1 vs 1) names no suspect
    return [dev for dev, d in digests.items() if d != value]


# --------------------------------------------------------------------------------------------
# Freivalds


def _is_integral(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and bool((t == torch.round(t)).all())


def freivalds_check(
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, rounds: int = 2, rtol: float | None = None,
    seed: int = 0, tf32: bool = False,
) -> int:
    """Number of rows i where C·x disagrees with A·(B·x) for random x, in O(n²) per round.

    Exact mode (A and B integer-valued): x holds random nonzero integers in [-1024, 1024],
    the check runs exactly (integers in float64, every partial sum under 2⁵³) and any
    difference counts, so one changed element of C is always caught.  Float mode: x_j = ±U[0.5, 1.5) in float64 and row i disagrees when

        |(C·x − A·(B·x))_i| > rtol · ((|A|·(|B|·|x|))_i + (|C|·|x|)_i)

    with default ``rtol = 2·(K·2⁻²⁴ + u_out + u_in)``: the worst-case fp32 accumulation error
    of K products (γ_K ≈ K·u, Higham, *Accuracy and Stability of Numerical Algorithms*, §3.5),
    plus rounding the result to C's dtype (u_out: 2⁻⁸ bf16, 2⁻¹¹ fp16, 2⁻²⁴ fp32), plus TF32
    input rounding (u_in = 2⁻¹¹ when ``tf32``), doubled as margin.  Float mode therefore only
    sees corruption larger than that bound (e.g. an exponent or high mantissa bit).
    Non-finite rows of C always disagree.
    """
    if A.dim() != 2 or B.dim() != 2 or C.dim() != 2 or A.shape[1] != B.shape[0] or C.shape != (A.shape[0], B.shape[1]):
        raise ValueError(f"freivalds_check: shapes A{tuple(A.shape)} B{tuple(B.shape)} C{tuple(C.shape)} do not chain")
    dev = C.device
    k = A.shape[1]
    a64, b64, c64 = (t.to(torch.float64) for t in (A, B, C))
    bad = ~torch.isfinite(c64).all(dim=1)
    g = torch.Generator().manual_seed(seed)
    exact = _is_integral(a64) and _is_integral(b64)
    if exact:
        amax = float(a64.abs().max()) if a64.numel() else 0.0
        bmax = float(b64.abs().max()) if b64.numel() else 0.0
        cbound = amax * bmax * k  # |(AB)_ij| can be no larger
        # Every partial sum below is an integer under amax*bmax*1024*K*N; under 2^53 float64
        # holds them all exactly (and float64 matmul runs on CUDA, int64 matmul does not).
        if cbound * 1024 * max(C.shape[1], 1) >= 2**53:
            exact = False
    if exact:
        finite = torch.where(torch.isfinite(c64), c64, torch.zeros_like(c64))
        # A C element that is not an integer, or larger than any product of A and B can be,
        # is wrong for sure; the rest is compared exactly.
        wild = (finite != torch.round(finite)) | (finite.abs() > cbound)
        bad |= wild.any(dim=1)
        ci = torch.where(wild, torch.zeros_like(finite), finite)
        for _ in range(rounds):
            x = torch.randint(1, 1025, (C.shape[1], 1), generator=g, dtype=torch.int64)
            x = (x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)).to(torch.float64).to(dev)
            bad |= (ci @ x != a64 @ (b64 @ x)).squeeze(1)
        return int(bad.sum())
    if rtol is None:
        u_out = _UNIT_ROUNDOFF.get(C.dtype, 2.0**-53)
        rtol = 2.0 * (k * _FP32_ACC_ROUNDOFF + u_out + (_TF32_INPUT_ROUNDOFF if tf32 else 0.0))
    c0 = torch.where(torch.isfinite(c64), c64, torch.zeros_like(c64))
    for _ in range(rounds):
        # |x_j| in [0.5, 1.5): a changed element of C moves its row by at least half the change.
        x = torch.rand(C.shape[1], 1, generator=g, dtype=torch.float64) + 0.5
        x = (x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)).to(dev)
        lhs = c0 @ x
        rhs = a64 @ (b64 @ x)
        ax = x.abs()
        tol = rtol * (a64.abs() @ (b64.abs() @ ax) + c0.abs() @ ax)
        bad |= ((lhs - rhs).abs() > tol).squeeze(1)
    return int(bad.sum())


def freivalds_probe(
    spec: ProbeSpec, device: torch.device | str = "cpu", matmul: Matmul | None = None,
    clock: Clock = time.perf_counter,
) -> Verdict:
    """A random GEMM (as a burn test would run) verified by ``freivalds_check``; re-run once."""
    dev = torch.device(device)
    mm = matmul or torch.matmul
    t0 = clock()

    def once() -> _Outcome:
        a, b = _random_inputs(spec, dev)
        with strict_matmul(DTYPES[spec.dtype][1]):
            c = mm(a, b)
        rows = freivalds_check(a, b, c, tf32=DTYPES[spec.dtype][1], seed=spec.seed)
        return _Outcome(rows, spec.m, {"unit": "rows"})

    first = once()
    rerun = once() if first.mismatched else None
    v = _verdict("freivalds", spec, dev, first, rerun, clock() - t0)
    v.detail = v.detail.replace("elements differ", "rows disagree").replace("elements match", "rows agree")
    return v


# --------------------------------------------------------------------------------------------
# Fault injection for the simulator and tests


_DEFAULT_BIT = {torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}  # top mantissa bit
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def corrupting_matmul(
    bit: int | None = None, seed: int = 0, times: int | None = None, base: Matmul | None = None,
) -> Matmul:
    """A matmul that flips one bit of one output element: the simulated faulty GPU.

    ``bit``: which bit of the element's IEEE encoding (default: the top mantissa bit, which
    changes any value, zero included); ``seed`` picks the element; ``times``: corrupt only the
    first ``times`` calls (``times=1`` makes a transient), ``None`` every call.
    """
    mm = base or torch.matmul
    calls = itertools.count()

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = mm(a, b)
        if times is not None and next(calls) >= times:
            return out
        view = _INT_VIEW.get(out.dtype)
        if view is None:
            raise TypeError(f"corrupting_matmul: cannot flip bits of {out.dtype}")
        nbits = torch.iinfo(view).bits
        b_ = _DEFAULT_BIT[out.dtype] if bit is None else bit
        if not 0 <= b_ < nbits:
            raise ValueError(f"corrupting_matmul: bit {b_} out of range for {out.dtype} ({nbits} bits)")
        mask = (1 << b_) if b_ < nbits - 1 else -(1 << b_)  # the sign bit as a two's-complement value
        idx = torch.randint(0, out.numel(), (1,), generator=torch.Generator().manual_seed(seed)).item()
        out = out.clone()
        flat = out.view(-1).view(view)
        flat[idx] ^= mask
        return out

    return matmul


# --------------------------------------------------------------------------------------------
# Spool: verdicts handed to the daemon as JSON files


# --------------------------------------------------------------------------------------------
# Standalone run (delivery check, `node-agent sdc`)


def run_probes(
    device: torch.device | str, duration_s: float | None = None, matmul: Matmul | None = None,
    shapes: Iterable[tuple[int, int, int]] | None = None, clock: Clock = time.monotonic,
) -> list[Verdict]:
    """Run every exact, digest and Freivalds probe on ``device`` once; with ``duration_s``
    (seconds), repeat the exact probes until that much time has passed (at least one pass).

    A probe that raises becomes an ``error`` verdict; the others still run.  Digest verdicts
    carry ``evidence['digest']`` for ``odd_one_out`` across the node's GPUs.
    """
    dev = torch.device(device)
    specs = default_specs(dev, shapes)
    start = clock()
    verdicts: list[Verdict] = []

    def guarded(kind: str, fn: Callable[..., Verdict], spec: ProbeSpec) -> None:
        try:
            verdicts.append(fn(spec, dev, matmul))
        except Exception as err:  # a probe that cannot run is reported, never a pass
            log.exception("sdc %s %s on %s failed", kind, spec.label(), dev)
            verdicts.append(_error_verdict(kind, spec, dev, err))

    for spec in specs:
        guarded("exact_gemm", exact_gemm_probe, spec)
    for spec in specs:
        guarded("digest_gemm", digest_probe, spec)
    big = 1024 if dev.type == "cuda" else 256
    for name in ("fp32", "bf16") + (("tf32",) if dev.type == "cuda" else ()):
        guarded("freivalds", freivalds_probe, ProbeSpec(big, big, big, name))
    while duration_s is not None and clock() - start < duration_s:
        for spec in specs:
            guarded("exact_gemm", exact_gemm_probe, dataclasses.replace(spec, seed=spec.seed + 1))
            if clock() - start >= duration_s:
                break
    return verdicts


# --------------------------------------------------------------------------------------------
# In-training API


@dataclasses.dataclass
class _Pending:
    spec: ProbeSpec
    kind: str
    read: Callable[[], Any]
    start: Any  # torch.cuda.Event or clock value
    end: Any
    first: _Outcome | None = None  # set while a confirmation re-run is in flight
    first_cost_s: float = 0.0


class SdcProbe:
    """Run SDC probes from inside a training loop within a time budget.

    Call ``step()`` once per training step.  It measures the wall time since creation and the
    probes' own cumulative cost, and starts the next probe only while
    ``(cost + expected cost of the next probe) <= budget_fraction * elapsed`` (the very first
    probe runs at once).  On CUDA the probe runs on a side stream (``torch.cuda.Stream``), is
    only *queued* by ``step()``, is timed with CUDA events and read at a later ``step()`` once
    its events completed, so training never waits for it.  On the CPU it runs synchronously,
    timed with ``clock``.

    Non-pass verdicts (transient, confirmed, error) are written to ``spool_dir`` (default
    ``default_spool_dir()``) with ``write_verdict``; set ``spool_passes=True`` to write passes
    too.  ``step()`` logs and swallows every exception (recorded as an ``error`` verdict, with
    exponential back-off) unless ``raise_errors=True``.  ``verdicts`` keeps the last
    ``keep`` verdicts in memory.

    ``shapes``: (M, K, N) tuples for the exact probes (K <= 256, see ``DEFAULT_SHAPES``).
    ``clock`` (seconds, monotonic) and ``matmul`` are injectable for tests and the simulator.
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
        digests: bool = True,
        keep: int = 100,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        if not 0 < budget_fraction < 1:
            raise ValueError(f"budget_fraction must be in (0, 1), got {budget_fraction}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device)
        self.budget_fraction = budget_fraction
        self.spool_dir = Path(spool_dir) if spool_dir is not None else default_spool_dir()
        self.raise_errors = raise_errors
        self.matmul = matmul
        self.clock = clock
        self.spool_passes = spool_passes
        self.keep = keep
        specs = default_specs(self.device, shapes, seed)
        for s in specs:
            _check_exact(s)  # fail at construction, not inside the loop
        # Exact and digest probes alternate, so an exact probe (which needs no earlier
        # baseline) is never more than two probes away when a fault appears.
        plan = [(kind, s) for s in specs for kind in (("exact_gemm", "digest_gemm") if digests else ("exact_gemm",))]
        self._plan = itertools.cycle(plan)
        self._next = next(self._plan)
        self._expected: dict[tuple[str, ProbeSpec], float] = {}
        self._digests: dict[ProbeSpec, str] = {}
        self._pending: _Pending | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._errors = 0
        self._blocked_until = float("-inf")
        self.started = clock()
        self.cost_s = 0.0
        self._last_cost_s = 0.0
        self.probes_run = 0
        self.verdicts: list[Verdict] = []
        #: optional progress heartbeat (node_agent.heartbeat): ``step()`` beats it, so a job
        #: that already calls ``step()`` per training step gets hang detection for free
        self.heartbeat = heartbeat

    # -- budget ------------------------------------------------------------------------------

    def overhead(self) -> float:
        """Probe cost so far as a fraction of the wall time since creation."""
        elapsed = self.clock() - self.started
        return self.cost_s / elapsed if elapsed > 0 else 0.0

    def _may_start(self, now: float) -> bool:
        if now < self._blocked_until:
            return False
        # A spec not yet measured is expected to cost what the last probe did.
        expected = self._expected.get(self._next, self._last_cost_s)
        return self.cost_s + expected <= self.budget_fraction * (now - self.started) or self.probes_run == 0

    # -- the loop hook -----------------------------------------------------------------------

    def step(self) -> Verdict | None:
        """Advance the probe; returns a verdict when one completed at this step, else None.

        With ``heartbeat=`` given, also records the step (``Heartbeat.beat`` never raises)."""
        if self.heartbeat is not None:
            self.heartbeat.beat()
        try:
            return self._step()
        except Exception as err:
            if self.raise_errors:
                raise
            log.exception("sdc probe on %s failed; training continues", self.device)
            kind, spec = self._pending_or_next()
            self._pending = None
            self._errors += 1
            backoff_s = min(3600.0, 10.0 * 2 ** (self._errors - 1))
            self._blocked_until = self.clock() + backoff_s
            v = _error_verdict(kind, spec, self.device, err)
            v.detail += f"; next probe in {backoff_s:.0f} s"
            self._record(v)
            return v

    def _pending_or_next(self) -> tuple[str, ProbeSpec]:
        if self._pending is not None:
            return self._pending.kind, self._pending.spec
        return self._next

    def _step(self) -> Verdict | None:
        if self._pending is not None:
            if not self._done(self._pending):
                return None
            return self._finish(self._pending)
        now = self.clock()
        if not self._may_start(now):
            return None
        kind, spec = self._next
        self._next = next(self._plan)
        self._pending = self._launch(kind, spec)
        if self._stream is None:  # CPU: already done
            return self._finish(self._pending)
        return None

    def _launch(self, kind: str, spec: ProbeSpec, first: _Outcome | None = None, first_cost_s: float = 0.0) -> _Pending:
        mm = self.matmul or torch.matmul
        if self._stream is not None:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
                read = self._queue(kind, spec, mm)
                end.record(self._stream)
        else:
            start = self.clock()
            read = self._queue(kind, spec, mm)
            end = self.clock()
        return _Pending(spec, kind, read, start, end, first, first_cost_s)

    def _queue(self, kind: str, spec: ProbeSpec, mm: Matmul) -> Callable[[], Any]:
        if kind == "exact_gemm":
            return _launch_exact(spec, self.device, mm)
        a, b = _random_inputs(spec, self.device)
        with strict_matmul(DTYPES[spec.dtype][1]):
            out = mm(a, b)
        if self._stream is not None:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
        else:
            host = out

        return lambda: _sha256(host)

    def _done(self, p: _Pending) -> bool:
        return self._stream is None or bool(p.end.query())

    def _cost(self, p: _Pending) -> float:
        if self._stream is not None:
            return p.start.elapsed_time(p.end) / 1000.0  # CUDA events report milliseconds
        return p.end - p.start

    def _finish(self, p: _Pending) -> Verdict | None:
        self._pending = None
        cost = self._cost(p)
        if self._stream is not None:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                t0 = self.clock()
                result = p.read()
                cost += self.clock() - t0  # host-side read, on the training thread
        else:
            t0 = self.clock()
            result = p.read()
            cost += self.clock() - t0
        self.cost_s += cost
        self.probes_run += 1
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
            outcome = _Outcome(int(prev is not None and result != prev), 1, {"digest": result, "previous_digest": prev})
        if p.first is None and outcome.mismatched:
            # Re-run before believing it; the verdict comes when the re-run completes.
            self._pending = self._launch(p.kind, p.spec, outcome, cost)
            if self._stream is None:
                return self._finish(self._pending)
            return None
        first, rerun = (p.first, outcome) if p.first is not None else (outcome, None)
        v = _verdict(p.kind, p.spec, self.device, first, rerun, p.first_cost_s + cost)
        if p.kind == "digest_gemm" and v.status != "pass":
            v.mismatched_elements = 0
            v.detail = (
                f"digest_gemm {p.spec.label()}: output sha256 differs from this device's earlier "
                f"{first.evidence.get('previous_digest', '')[:16]}; "
                + ("re-run differed again" if v.status == "confirmed" else "re-run matched the earlier digest")
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
