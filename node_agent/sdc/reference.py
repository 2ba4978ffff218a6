"""Probes whose right answer is not known in advance: digests and Freivalds.

Standard library and torch only (part of the training-side ``node_agent.sdc``).

- ``digest_probe``: full-mantissa random inputs from a fixed seed; the sha256 of the output is
  compared across the GPUs of a node (``odd_one_out``) and with the same GPU's earlier digest.
  Bit-exact only within one SKU and software stack.
- ``freivalds_check``: C·x against A·(B·x) for a big GEMM, O(n²), with a documented bound.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from node_agent.sdc.exact import NUMERICS, Matmul, Outcome, ProbeSpec, gemm, strict_matmul
from node_agent.sdc.spool import Verdict
from node_agent.sdc.verdicts import make_verdict

Clock = Callable[[], float]

# Unit roundoff (half an ulp at 1.0) of what the output is rounded to; TF32 rounds inputs to 10
# mantissa bits (NVIDIA A100 whitepaper, "TF32 Tensor Core").
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_TF32_INPUT_ROUNDOFF = 2.0**-11
_FP32_ACC_ROUNDOFF = 2.0**-24


# --------------------------------------------------------------------------------------------
# Random-data GEMM with digests

_RANDOM_INPUTS: dict[tuple[ProbeSpec, str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _random_inputs(spec: ProbeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn on the CPU so that every GPU of the node multiplies the very same bits.
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (spec, str(device), str(stream))
    hit = _RANDOM_INPUTS.get(key)
    if hit is None:
        if spec.dtype not in NUMERICS or spec.dtype == "fp8":
            raise ValueError(f"digest/Freivalds probe dtype {spec.dtype!r} is not one of "
                             f"{sorted(set(NUMERICS) - {'fp8'})}")
        dtype = NUMERICS[spec.dtype].dtype
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
    a, b = _random_inputs(spec, device)
    with strict_matmul(NUMERICS[spec.dtype].tf32):
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
    mm = matmul or gemm
    t0 = clock()
    d1 = _digest_once(spec, dev, mm)
    first = Outcome(0, 1, {})
    rerun = None
    ev: dict[str, Any] = {"digest": d1}
    if previous is not None and d1 != previous:
        d2 = _digest_once(spec, dev, mm)
        first = Outcome(1, 1, {"digest_differs_from_previous": previous})
        rerun = Outcome(int(d2 != previous), 1, {"digest": d2})
        if d2 == previous:
            ev["digest"] = d2
    v = make_verdict("digest_gemm", spec, dev, first, rerun, clock() - t0, ev)
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
    mm = matmul or gemm
    t0 = clock()

    def once() -> Outcome:
        a, b = _random_inputs(spec, dev)
        with strict_matmul(NUMERICS[spec.dtype].tf32):
            c = mm(a, b)
        rows = freivalds_check(a, b, c, tf32=NUMERICS[spec.dtype].tf32, seed=spec.seed)
        return Outcome(rows, spec.m, {"unit": "rows"})

    first = once()
    rerun = once() if first.mismatched else None
    v = make_verdict("freivalds", spec, dev, first, rerun, clock() - t0)
    v.detail = v.detail.replace("elements differ", "rows disagree").replace("elements match", "rows agree")
    return v
