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
            raise ValueError(
                f"digest/Freivalds probe dtype {spec.dtype!r} is not one of "
                f"{sorted(set(NUMERICS) - {'fp8'})}"
            )
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
    spec: ProbeSpec,
    device: torch.device | str = "cpu",
    matmul: Matmul | None = None,
    previous: str | None = None,
    clock: Clock = time.perf_counter,
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
    if v.status == "pass" or previous is None:  # only a digest unlike ``previous`` fails
        v.detail = f"digest_gemm {spec.label()}: sha256 {d1[:16]}"
    else:
        v.detail = (
            f"digest_gemm {spec.label()}: output sha256 {d1[:16]} differs from this device's "
            f"earlier {previous[:16]}; "
            + (
                "re-run differed again"
                if v.status == "confirmed"
                else "re-run matched the earlier digest"
            )
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

# Unit roundoffs of the rigorous bound (Higham, *Accuracy and Stability of Numerical
# Algorithms*, 2nd ed., §3.5; u is half an ulp at 1.0 under round-to-nearest).
#: significand bits (implicit bit included) of what C may be stored in; an integer of at most
#: this many bits is exact in it
_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}
#: half the smallest subnormal of C's dtype: the absolute error of rounding a tiny sum into it
_UNDERFLOW = {
    torch.float64: 2.0**-1075,
    torch.float32: 2.0**-150,
    torch.bfloat16: 2.0**-134,
    torch.float16: 2.0**-25,
}
#: the fp32 accumulator of GPU and CPU GEMMs, taken as 4 units of fp32's 2^-24: tensor cores add
#: several aligned products at once and truncate toward zero (Fasi, Higham, Mikaitis, Pranesh,
#: "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021), which loses less than one fp32
#: ulp per operand per step; a (k+1)-operand truncating adder over K/k steps then stays within
#: gamma_K at u = 2^-22 for every k >= 1. Round-to-nearest (2^-24) and plain truncation (2^-23)
#: are inside it.
_ACC_ROUNDOFF = 2.0**-22
#: TF32 keeps 10 of fp32's 23 stored mantissa bits: 2^-11 when the kernel rounds its inputs to
#: nearest, 2^-10 when it truncates them (NVIDIA A100 whitepaper, "TF32 Tensor Core"); the bound
#: takes the larger
_TF32_INPUT_ROUNDOFF = 2.0**-10
_F64_ROUNDOFF = 2.0**-53
#: the bound is doubled: a margin for what the model leaves out (fused or split-K orders keep it)
_MARGIN = 2.0
#: column blocks of the float-mode check (each block is compared on its own): a corrupted
#: element must stand out from its block's rounding, not its whole row's
FREIVALDS_BLOCKS = 64


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k·u / (1 − k·u): the relative error bound of a k-term dot product."""
    if k * u >= 1:
        return float("inf")
    return k * u / (1.0 - k * u)


def _is_integral(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and bool((t == torch.round(t)).all())


def _exact_possible(
    a64: torch.Tensor, b64: torch.Tensor, out_dtype: torch.dtype, k: int, tf32: bool
) -> tuple[bool, float]:
    """(whether C = A·B can be exact, the largest |C| can be): integer inputs that TF32 keeps,
    and every partial sum an integer the fp32 accumulator and C's dtype both hold exactly."""
    if not (_is_integral(a64) and _is_integral(b64)):
        return False, 0.0
    amax = float(a64.abs().max()) if a64.numel() else 0.0
    bmax = float(b64.abs().max()) if b64.numel() else 0.0
    cbound = amax * bmax * k  # no partial sum of A·B can be larger
    if tf32 and max(amax, bmax) > 2.0**11:  # TF32 holds integers up to 2^11 exactly
        return False, cbound
    bits = _SIGNIFICAND_BITS.get(out_dtype)
    if bits is None:  # integer outputs hold every integer they can store
        return not out_dtype.is_floating_point, cbound
    acc_bits = 53 if out_dtype == torch.float64 else 24
    return cbound <= 2.0 ** min(bits, acc_bits), cbound


def freivalds_bound(
    A: torch.Tensor, C: torch.Tensor, k: int, tf32: bool = False
) -> tuple[float, float, float]:
    """(u_c, g_ab, eta): the float-mode bound is ``u_c·(|C|·|x|) + g_ab·(|A|·(|B|·|x|)) +
    eta·sum|x|`` per row or block (see :func:`freivalds_check`)."""
    u_out = 2.0 ** -_SIGNIFICAND_BITS.get(C.dtype, 53)
    n = C.shape[1]
    u_in = _TF32_INPUT_ROUNDOFF if tf32 and A.dtype == torch.float32 else 0.0
    # |ĉ − c| <= u_out/(1 − u_out)·|ĉ| + [gamma_K·(1 + u_in)² + 2·u_in + u_in²]·(|A||B|)
    # + eta; the float64 products C·x and A·(B·x) add gamma_n and gamma_(K+n) of float64.
    g64 = _gamma(k + n + 2, _F64_ROUNDOFF)
    u_c = _MARGIN * (u_out / (1.0 - u_out) + g64)
    g_ab = _MARGIN * (_gamma(k, _ACC_ROUNDOFF) * (1.0 + u_in) ** 2 + 2.0 * u_in + u_in * u_in + g64)
    return u_c, g_ab, _MARGIN * _UNDERFLOW.get(C.dtype, 0.0)


def freivalds_check(
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    rounds: int = 2,
    rtol: float | None = None,
    seed: int = 0,
    tf32: bool = False,
    blocks: int = FREIVALDS_BLOCKS,
) -> int:
    """Number of rows i of C = A·B where C·x disagrees with A·(B·x), in O(n²) per round.

    **Exact mode**, only where C can be exact: A and B integer-valued (and, under ``tf32``, no
    larger than 2^11, so TF32 keeps them), and every partial sum an integer that both the fp32
    accumulator and C's dtype hold (|A|max·|B|max·K <= 2^24, and <= 2^8 for a bf16 C, 2^11
    for fp16). x holds random nonzero integers in [-1024, 1024], the check runs exactly
    (integers in float64, every partial sum under 2^53) and any difference counts, so one
    changed element of C is always caught. Integer inputs do not make a bf16 or fp16 C exact:
    its rounding is real and takes the float mode.

    **Float mode** (everything else): x_j = ±U[0.5, 1.5) in float64; the columns are split
    into ``blocks`` blocks, and row i disagrees when, for some block J,

        |(C_J·x_J − A·(B_J·x_J))_i| > u_c·(|C_J|·|x_J|)_i + g·(|A|·(|B_J|·|x_J|))_i + eta·Σ|x_J|

    a rigorous bound on what a correct C can differ by (:func:`freivalds_bound`): C's own
    rounding, u_c = 2·(u_out/(1 − u_out) + gamma_(K+n+2) of float64), with u_out 2^-8 for
    bf16, 2^-11 fp16, 2^-24 fp32; the accumulation and the inputs' TF32 rounding,
    g = 2·(gamma_K·(1 + u_in)² + 2·u_in + u_in²) with gamma_K = K·u/(1 − K·u) at u = 2^-22
    (the dot-product bound of Higham, *Accuracy and Stability of Numerical Algorithms*,
    §3.5, with the unit roundoff widened to cover tensor cores' truncating multi-operand adds)
    and u_in = 2^-10 under ``tf32`` (inputs truncated to TF32's 10 mantissa bits), else 0;
    eta, C's underflow. The factor 2 is margin. A correct product therefore never
    disagrees, whatever the kernel's summation order; the price is that only corruption larger
    than its block's bound is seen (an exponent or high mantissa bit of a typical element,
    not a low mantissa bit). Assumes fp32 (or wider) accumulation rounded once into C: a
    split-K reduction in bf16 or fp16 (``allow_bf16_reduced_precision_reduction``) is outside
    it, which ``strict_matmul`` turns off. ``rtol`` (given) replaces the bound by
    ``rtol·(|A|·(|B|·|x|) + |C|·|x|)``.

    Non-finite rows of C always disagree. ``blocks`` (float mode) costs O(blocks·n²) for the
    reference; 1 compares whole rows.
    """
    if (
        A.dim() != 2
        or B.dim() != 2
        or C.dim() != 2
        or A.shape[1] != B.shape[0]
        or C.shape != (A.shape[0], B.shape[1])
    ):
        raise ValueError(
            f"freivalds_check: shapes A{tuple(A.shape)} B{tuple(B.shape)} C{tuple(C.shape)} do not chain"
        )
    if blocks < 1:
        raise ValueError(f"freivalds_check: blocks must be >= 1, got {blocks}")
    k = A.shape[1]
    n = C.shape[1]
    a64, b64, c64 = (t.to(torch.float64) for t in (A, B, C))
    bad = ~torch.isfinite(c64).all(dim=1)
    g = torch.Generator().manual_seed(seed)
    exact, cbound = _exact_possible(a64, b64, C.dtype, k, tf32)
    # Every partial sum below is an integer under cbound*1024*N; under 2^53 float64 holds them
    # all exactly (and float64 matmul runs on CUDA, int64 matmul does not).
    if exact and cbound * 1024 * max(n, 1) >= 2**53:
        exact = False
    if exact:
        bad |= _exact_disagreements(a64, b64, c64, cbound, rounds, g)
    else:
        bad |= _float_disagreements(A, C, a64, b64, c64, rounds, rtol, g, tf32, blocks)
    return int(bad.sum())


def _exact_disagreements(
    a64: torch.Tensor,
    b64: torch.Tensor,
    c64: torch.Tensor,
    cbound: float,
    rounds: int,
    g: torch.Generator,
) -> torch.Tensor:
    """:func:`freivalds_check`'s exact mode: the rows of C (float64) that are not A·B."""
    dev, n = c64.device, c64.shape[1]
    finite = torch.where(torch.isfinite(c64), c64, torch.zeros_like(c64))
    # A C element that is not an integer, or larger than any product of A and B can be,
    # is wrong for sure; the rest is compared exactly.
    wild = (finite != torch.round(finite)) | (finite.abs() > cbound)
    bad = wild.any(dim=1)
    ci = torch.where(wild, torch.zeros_like(finite), finite)
    for _ in range(rounds):
        x = torch.randint(1, 1025, (n, 1), generator=g, dtype=torch.int64)
        x = (x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)).to(torch.float64).to(dev)
        bad |= (ci @ x != a64 @ (b64 @ x)).squeeze(1)
    return bad


def _float_disagreements(
    A: torch.Tensor,
    C: torch.Tensor,
    a64: torch.Tensor,
    b64: torch.Tensor,
    c64: torch.Tensor,
    rounds: int,
    rtol: float | None,
    g: torch.Generator,
    tf32: bool,
    blocks: int,
) -> torch.Tensor:
    """:func:`freivalds_check`'s float mode: the rows of C whose blocks differ from A·B by
    more than :func:`freivalds_bound` allows (or ``rtol``)."""
    dev, k, n = c64.device, a64.shape[1], c64.shape[1]
    nb = max(1, min(blocks, n))
    # block J holds columns [edges[J], edges[J+1]); the columns' block index as a one-hot
    # (n × nb) matrix turns every blockwise sum into one float64 product
    edges = torch.linspace(0, n, nb + 1).round().long()
    col_block = torch.bucketize(torch.arange(n), edges[1:-1], right=True)
    onehot = torch.zeros(n, nb, dtype=torch.float64)
    onehot[torch.arange(n), col_block] = 1.0
    onehot = onehot.to(dev)
    c0 = torch.where(torch.isfinite(c64), c64, torch.zeros_like(c64))
    abs_a, abs_b, abs_c = a64.abs(), b64.abs(), c0.abs()
    u_c, g_ab, eta = freivalds_bound(A, C, k, tf32)
    bad = torch.zeros(c64.shape[0], dtype=torch.bool, device=dev)
    for _ in range(rounds):
        # |x_j| in [0.5, 1.5): a changed element of C moves its block by at least half the change.
        x = torch.rand(n, 1, generator=g, dtype=torch.float64) + 0.5
        x = (x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)).to(dev)
        xb = onehot * x  # n × nb: x, split by column block
        ax = xb.abs()
        lhs = c0 @ xb  # m × nb
        rhs = a64 @ (b64 @ xb)
        if rtol is not None:
            tol = rtol * (abs_a @ (abs_b @ ax) + abs_c @ ax)
        else:
            tol = u_c * (abs_c @ ax) + g_ab * (abs_a @ (abs_b @ ax)) + eta * ax.sum(0)
        bad |= ~((lhs - rhs).abs() <= tol).all(dim=1)
    return bad


def freivalds_probe(
    spec: ProbeSpec,
    device: torch.device | str = "cpu",
    matmul: Matmul | None = None,
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
    v.detail = v.detail.replace("elements differ", "rows disagree").replace(
        "elements match", "rows agree"
    )
    return v
