"""The burn's numerics: its inputs, its GEMMs, and how each product is verified.

**Verification: flag on the device, convict rigorously, never stall the stream.** A and B are
fixed per precision. At preparation, on the device, the exact product A·B is computed once in
float64 (O(n³), once; never per product) with |A|·|B|, and kept as block sums:
``ref[i, J] = sum over j in block J of (A·B)[i, j]`` for blocks of ``verify_block`` columns.
One product C in the burn's verify interval (``verify_every``, or more where a check would
take over ``verify_budget`` of the device's time) is checked in O(n²): ``R = C`` summed per
block (one pass over C, fp32 sums; x is all ones: a hardware fault does not know x, and two
wrong elements of one block cancelling exactly is not a fault model) against ``ref``. A block
is flagged when ``|R − ref|`` exceeds ``k_sigma`` standard deviations of the rounding noise (output rounding,
u²/3 per element of C, plus fp32 accumulation, sequential-sum model u²·K²/6·rms(a)²·rms(b)², plus
the fp32 sums themselves) **plus the kernel's own systematic deviation**: tensor cores add
aligned products and truncate toward zero (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior
of NVIDIA tensor cores", PeerJ CS 2021), a bias that round-to-nearest statistics do not allow
for. Where C's rounding is coarse (bf16, fp16) it hides that bias; in tf32, whose output is
fp32, it does not, and before this was modelled nearly every verified tf32 product was flagged
and sent to the CPU while the GPU idled (an H100's tf32 burn: 81 TFLOP/s against plain
matmul's 401.8). The deviation is learnt from the first product, block by block, only where
every element of that product is within the rigorous elementwise bound below (a product
already corrupted by a persistent fault teaches nothing) and the block within its rigorous
block bound; a deterministic kernel (cuBLAS GEMMs are, for a fixed configuration) then repeats
it bit for bit. A flagged product whose recomputed rows are right is learnt the same way, so a
kernel that changes its summation later costs one recomputation, not one per check.

In the burn (:mod:`node_agent.compute.burn`) the check never makes the host wait for the
device: its per-row verdict (m booleans) is copied to pinned host memory without blocking, an
event recorded behind it, and read when the event has passed; the host waits for a check only
when more than ``verify_lag`` are in flight, so it stays at most ``verify_lag`` × the interval
products ahead and the device always has GEMMs queued. The end of a sample window is the one
full synchronisation. Every such wait goes through
:class:`DeviceWaits`, which tests replace to count them.

A check allocates nothing: it writes into the verifier's own device buffers
(:meth:`Verifier.ok_rows`) and a ring of host buffers made once per precision. Its device time
is almost all the block sums, a reduction over groups of ``verify_block`` contiguous elements
that torch runs far below the memory's bandwidth: about 0.5 ms for an 8192² product on an
H200 in every precision, a third of a bf16 product's time and three quarters of an fp8 one's.
Hence the burn's ``verify_budget``, which sets how often a product is checked.

A flagged row is recomputed in float64 on the CPU (independent of the suspect GPU) and its
elements compared with a rigorous bound: ``2·(u_out·|c| + γ_K·(|A|·|B|))`` with
γ_K = K·u/(1 − K·u) (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.5) at
u = 2⁻²² (``U_ACC_BOUND``: four units of fp32's 2⁻²⁴, which covers truncating multi-operand
adders); only elements outside it count as wrong. fp8, whose accumulators keep about 14 bits
on Hopper (DeepSeek-V3 technical report, §3.3.2), uses the statistical bound at 8 sigma for
both steps. A product with wrong elements is re-run once: wrong again is *confirmed*, otherwise
*transient*. Inputs for ``tf32`` are rounded to 10 mantissa bits once, when they are made, so
TF32 input rounding is exact and only accumulation error remains.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from node_agent.compute.devices import PRECISION_DTYPES

if TYPE_CHECKING:
    import torch

PRECISIONS = ("bf16", "fp16", "tf32", "fp32", "fp8")
#: unit roundoff of the GEMM output (fp8 GEMMs write bf16)
U_OUT = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-24, "fp32": 2.0**-24, "fp8": 2.0**-8}
#: unit roundoff of the accumulator under round-to-nearest, for the noise statistics (fp32;
#: Hopper fp8 tensor cores keep about 14 bits)
U_ACC = {"bf16": 2.0**-24, "fp16": 2.0**-24, "tf32": 2.0**-24, "fp32": 2.0**-24, "fp8": 2.0**-14}
#: unit roundoff of the rigorous bound's fp32 accumulator: 4 units of 2^-24, which covers
#: round-to-nearest, truncation, and tensor cores' truncating multi-operand adds (the same
#: allowance as ``node_agent.sdc.reference.freivalds_check``)
U_ACC_BOUND = 2.0**-22
MAX_ROWS_RECOMPUTED = 8  # flagged rows recomputed on the CPU per product (a lower bound beyond)


# -- numerics (run inside the worker; torch imported lazily) ----------------------------------


def make_inputs(
    precision: str, n: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random n×n inputs (A, B) for ``precision`` on ``device``, same on every GPU."""
    import torch

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    if precision == "tf32":  # 10 stored mantissa bits: TF32 rounds nothing away
        a, b = a.half().float(), b.half().float()
    elif precision == "fp8":
        dtype = torch.float8_e4m3fn
        # torch._scaled_mm wants B column-major
        return a.to(device).to(dtype), b.to(device).to(dtype).t().contiguous().t()
    else:
        dtype = getattr(torch, PRECISION_DTYPES[precision])
        a, b = a.to(dtype), b.to(dtype)
    return a.to(device), b.to(device)


def fp8_matmul(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An fp8 (e4m3) GEMM with unit scales and bf16 output through ``torch._scaled_mm``.

    ``use_fast_accum=False`` asks cuBLAS to promote partial sums to fp32 periodically."""
    import torch

    one = torch.ones((), device=device, dtype=torch.float32)

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False
        )
        return out[0] if isinstance(out, tuple) else out  # torch < 2.4 returned (out, amax)

    return matmul


@contextlib.contextmanager
def numerics(precision: str) -> Iterator[None]:
    """TF32 on exactly for ``tf32``, off otherwise; no reduced-precision reductions."""
    from node_agent.sdc.probes import strict_matmul

    with strict_matmul(tf32=precision == "tf32"):
        yield


def _block_of(n: int, want: int) -> int:
    """The largest divisor of n not above ``want`` (so the columns split into equal blocks)."""
    return max(d for d in range(1, max(1, min(want, n)) + 1) if n % d == 0)


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k·u / (1 − k·u), the relative bound of a k-term dot product."""
    return k * u / (1.0 - k * u) if k * u < 1 else math.inf


class Verifier:
    """Block Freivalds check of C = A·B for fixed A and B, on C's device (see the module
    docstring): :meth:`ok_rows` enqueues it without waiting, :meth:`flagged_rows` waits.

    ``c0`` is a first product of A and B on the device under test. It sets the scale of the
    rounding noise, and its deviation from the exact sums, where within the rigorous bound, is
    the kernel's own systematic rounding (a truncating accumulator's bias): a later product
    that repeats it is not flagged.
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c0: torch.Tensor,
        precision: str,
        block: int = 8,
        k_sigma: float = 6.0,
        seed: int = 0,
    ) -> None:
        import torch

        m, k = a.shape
        n = b.shape[1]
        self.precision, self.shape = precision, (m, k, n)
        self.block = block = _block_of(n, block)
        self.nb = nb = n // block
        self.seed = seed  # x is all ones (see the module docstring); kept for callers
        a64 = a.float().double()
        b64 = b.float().double()
        # The exact product (float64 rounding only) and |A|·|B|, once: O(n³) in float64 on the
        # device at preparation, never per product.
        exact = a64 @ b64
        ab_abs = a64.abs_() @ b64.abs_()
        del a64, b64
        c64 = c0.float().double()
        # c0's elements within the rigorous bound (as count_wrong's): only blocks whose every
        # element is may teach the kernel's systematic rounding (a c0 already corrupted by a
        # persistent fault must not)
        element_ok = (c64 - exact).abs() <= self._element_bound(exact, ab_abs, k)
        self.ref = exact.reshape(m, nb, block).sum(-1).float()
        ab_blk = ab_abs.reshape(m, nb, block).sum(-1)
        del exact, ab_abs
        c64 = c64.reshape(m, nb, block)
        c_abs = c64.abs().sum(-1)
        var_out = (U_OUT[precision] ** 2 / 3.0) * (c64 * c64).sum(-1)
        af, bf = a.float(), b.float()
        ra2 = (af * af).double().mean(1)
        rb2 = (bf * bf).double().mean(0).view(nb, block).sum(-1)
        var_acc = (U_ACC[precision] ** 2 * k * k / 6.0) * ra2[:, None] * rb2[None, :]
        del c64, af, bf
        k_sig = max(k_sigma, 8.0) if precision == "fp8" else k_sigma
        # the fp32 sums of R and the fp32 rounding of ref: (block + 4) ulps of sum |c|
        fp32_sum = (block + 4) * 2.0**-24 * c_abs
        self.noise = k_sig * torch.sqrt(var_out + var_acc) + fp32_sum
        if precision == "fp8":  # no rigorous bound for a 14-bit accumulator: 8 sigma
            self.bound = self.noise
        else:  # what a correct C can differ by, summed over the block
            self.bound = (
                2.0 * (U_OUT[precision] * c_abs + _gamma(k, U_ACC_BOUND) * ab_blk) + fp32_sum
            )
        self.bias = torch.zeros_like(self.noise)
        self.tol = self.noise.float()
        self._learn(self.deviation(c0), element_ok.reshape(m, nb, block).all(-1))
        # the check's own buffers, allocated once: ok_rows writes into them in place (stream
        # order keeps a check's verdict intact until its copy to the host has read it)
        self._dev = torch.empty_like(self.ref)
        self._within = torch.empty(m, nb, dtype=torch.bool, device=self.ref.device)
        self._ok = torch.empty(m, dtype=torch.bool, device=self.ref.device)

    def _element_bound(self, exact: torch.Tensor, ab_abs: torch.Tensor, k: int) -> torch.Tensor:
        import torch

        p = self.precision
        if p == "fp8":
            return torch.full_like(exact, math.inf)  # judged by the block statistics alone
        return 2.0 * (U_OUT[p] * exact.abs() + _gamma(k, U_ACC_BOUND) * ab_abs)

    def _learn(self, dev: torch.Tensor, trusted: torch.Tensor | None = None) -> None:
        """Take the blocks' deviation of a product known or taken to be correct as the
        kernel's systematic rounding, where it is within the rigorous bound (and in
        ``trusted`` blocks only, when given)."""
        import torch

        within = dev.double() <= self.bound
        if trusted is not None:
            within &= trusted
        self.bias = torch.where(within, torch.maximum(self.bias, dev.double()), self.bias)
        self.tol = (self.noise + self.bias).float()

    def sums(self, c: torch.Tensor) -> torch.Tensor:
        """R = C·x per block (x all ones): one pass over C, fp32 sums."""
        import torch

        m, _, _ = self.shape
        return c.reshape(m, self.nb, self.block).sum(-1, dtype=torch.float32)

    def deviation(self, c: torch.Tensor) -> torch.Tensor:
        """|R − ref| per row and block (NaN where C is not finite)."""
        return (self.sums(c) - self.ref).abs_()

    def ok_rows(self, c: torch.Tensor) -> torch.Tensor:
        """Boolean per row, on C's device, enqueued without waiting: True where every block of
        the row agrees with A·B within the tolerance. Non-finite entries never agree.

        The same arithmetic as :meth:`deviation` compared with the tolerance, but into this
        verifier's own buffers, so a check allocates nothing: the tensor returned is one of
        them, overwritten by the next call (copy it, as ``DeviceWaits.to_host`` does, before
        it is needed again)."""
        import torch

        m, _, _ = self.shape
        dev = self._dev
        torch.sum(c.reshape(m, self.nb, self.block), -1, dtype=torch.float32, out=dev)
        torch.sub(dev, self.ref, out=dev).abs_()
        torch.le(dev, self.tol, out=self._within)
        return torch.all(self._within, 1, out=self._ok)

    def flags(self, c: torch.Tensor) -> torch.Tensor:
        """Boolean (rows × blocks): where C·x disagrees with A·(B·x) beyond the tolerance."""
        return ~(self.deviation(c) <= self.tol)

    def flagged_rows(self, c: torch.Tensor) -> list[int]:
        """Rows of C with at least one flagged block (waits for the device)."""
        return (~self.ok_rows(c)).nonzero().flatten().tolist()

    def forgive(self, c: torch.Tensor) -> None:
        """``c`` was flagged but its recomputed rows were right: its deviations within the
        rigorous bound are the kernel's rounding too (so a kernel whose rounding changed
        between products, e.g. another cuBLAS algorithm, is not recomputed again)."""
        self._learn(self.deviation(c))


def verify_interval(
    verify_every: int, budget: float | None, product_s: float, check_s: float
) -> int:
    """Verify one product in this many: ``verify_every``, or more where a check costs more
    than ``budget`` of the device's time at that rate (``check_s`` and ``product_s`` are one
    check's and one product's device time)."""
    every = max(1, int(verify_every))
    if budget is None or check_s <= 0 or product_s <= 0:  # nothing measured: the plan's
        return every
    return max(every, math.ceil(check_s / (budget * product_s)))


class DeviceWaits:
    """Every point where the burn's host waits on, reads from, or times its device.

    The engine never calls ``.item()``, ``.tolist()``, ``.cpu()`` or ``synchronize`` on a
    device tensor in its loop: each check's small per-row verdict is copied into a host buffer
    (:meth:`host_buffer`: pinned memory, allocated once per precision) without blocking
    (:meth:`to_host`), an event recorded behind it (:meth:`record`), and read once the event
    has passed (:meth:`done`), or waited for (:meth:`wait`) only when the checks in flight
    exceed the plan's ``verify_lag``; :meth:`synchronize` ends a sample window. On the CPU
    every operation has finished when it returns, so these are immediate.

    ``timed``: whether verification's device time is measured (:meth:`mark`,
    :meth:`seconds`) to bound its share (``BurnPlan.verify_budget``). By default on a GPU
    only: a stand-in's GEMM time is modelled from its FLOPs, which its checks do not slow.
    A constructor parameter of :class:`BurnEngine`: tests pass one that counts, or whose
    clock they set.
    """

    def __init__(self, device: torch.device, timed: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.timed = self.cuda if timed is None else timed

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for :meth:`to_host` to copy into (pinned on a GPU's host)."""
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_host(self, t: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` into the host buffer ``into``, enqueued behind the work that produces
        it (non-blocking); ``into`` is valid once an event recorded after this call is done,
        and must not be handed out again before it has been read."""
        into.copy_(t, non_blocking=self.cuda)
        return into

    def mark(self) -> Any:
        """A point on the device's timeline behind everything enqueued so far (a timing
        event on a GPU, the host clock on the CPU), for :meth:`seconds`."""
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Device seconds between two marks; both must have passed (after a synchronise)."""
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3

    def record(self) -> Any:
        """An event behind everything enqueued so far (None on the CPU)."""
        if not self.cuda:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, event: Any) -> bool:
        """Whether the device has passed ``event``; never blocks."""
        return event is None or bool(event.query())

    def wait(self, event: Any) -> None:
        """Block until the device has passed ``event`` (the work after it keeps running)."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        """Block until the device has finished everything (the end of a sample window)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)


@dataclass
class RowCheck:
    """Flagged rows recomputed in float64 on the CPU: wrong elements and a few examples."""

    wrong: int
    rows_checked: list[int]
    examples: list[list[float]]  # [row, col, got, expected]


def count_wrong(
    a: torch.Tensor,
    b64_cpu: torch.Tensor,
    c: torch.Tensor,
    rows: list[int],
    precision: str,
    max_rows: int = MAX_ROWS_RECOMPUTED,
    b64_abs_cpu: torch.Tensor | None = None,
) -> RowCheck:
    """Recompute ``rows`` of A·B in float64 on the CPU; count elements of C outside the bound
    ``2·(u_out·|c| + gamma_K·(|A|·|B|))`` (u = 2^-22 for the fp32 accumulator, see
    ``U_ACC_BOUND``; fp8: 8 sigma of the noise statistics).

    ``b64_cpu`` is B as float64 on the CPU, ``b64_abs_cpu`` its absolute values (the caller
    keeps both across calls; computed here when not given).
    """
    import torch

    rows = list(rows)[:max_rows]
    if not rows:
        return RowCheck(0, [], [])
    idx = torch.tensor(rows, device=a.device)
    a_src = a if a.element_size() > 1 else a.float()  # no row gather for fp8 everywhere
    a_rows = a_src.index_select(0, idx).float().double().cpu()
    got = c.index_select(0, idx.to(c.device)).float().double().cpu()
    ref = a_rows @ b64_cpu
    k = a_rows.shape[1]
    u_out, u_acc = U_OUT[precision], U_ACC[precision]
    if precision == "fp8":
        ra2 = (a_rows * a_rows).mean(1, keepdim=True)
        rb2 = (b64_cpu * b64_cpu).mean(0, keepdim=True)
        tol = 8.0 * torch.sqrt(u_out**2 / 3.0 * ref * ref + u_acc**2 * k * k / 6.0 * ra2 * rb2)
    else:
        b_abs = b64_abs_cpu if b64_abs_cpu is not None else b64_cpu.abs()
        tol = 2.0 * (u_out * ref.abs() + _gamma(k, U_ACC_BOUND) * (a_rows.abs() @ b_abs))
    bad = ~((got - ref).abs() <= tol)
    where = bad.nonzero().tolist()
    examples = [[rows[r], col, float(got[r, col]), float(ref[r, col])] for r, col in where[:5]]
    return RowCheck(int(bad.sum()), rows, examples)
