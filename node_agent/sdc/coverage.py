"""``sm_coverage``: the share of a GPU's SMs that ran at least one tile of a probe round.

On a CUDA GPU it is measured: a tiny kernel launched with one block per output tile of each
probe in the round (the grid a non-persistent 128 x 128-tile GEMM would launch) records the
``%smid`` special register of the SM each block ran on (PTX ISA, "Special Registers: %smid");
coverage is the number of distinct SM ids over ``multi_processor_count``. cuBLAS's own kernels
are closed and cannot be instrumented, so this measures how the GPU's block scheduler spreads a
grid of the probe's size, which is what decides whether a defective SM receives work. The
kernel comes from CuPy (``RawKernel``), Triton (inline PTX) or torch's jiterator (NVRTC, ships
with CUDA builds of torch), whichever is available, in that order. ``%smid`` values may be
sparse (PTX ISA: "not guaranteed to be contiguous"), so distinct ids are counted, never the
largest id.

Elsewhere (a CPU stand-in, or no kernel compiler available) coverage comes from the tile model
(``node_agent.sdc.tiles``), and ``method`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from node_agent.sdc.tiles import TileModel

log = logging.getLogger("node_agent.sdc.probes")

#: how long each block of the measuring kernel spins (ns) where the kernel can: long enough that
#: blocks overlap as a GEMM's do, so the scheduler must spread them rather than reuse one SM
SPIN_NS = 20_000


@dataclasses.dataclass(frozen=True)
class Coverage:
    """``value``: share of SMs reached (0..1); ``method``: ``smid:<kernel>`` when measured,
    ``model`` otherwise (``why`` then says why it was not measured)."""

    value: float
    method: str
    sm_count: int
    sms_reached: int
    blocks: int = 0
    why: str | None = None

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sm_coverage": round(self.value, 4),
            "sm_coverage_method": self.method,
            "sm_count": self.sm_count,
            "sms_reached": self.sms_reached,
        }
        if self.why:
            out["sm_coverage_note"] = self.why
        return out


def modeled(
    model: TileModel, shapes: Iterable[tuple[int, int]], why: str | None = None
) -> Coverage:
    """Coverage of a round of ``(M, N)`` outputs under the tile model (the share it is sure of)."""
    shapes = list(shapes)
    value = model.coverage(shapes)
    return Coverage(value, "model", model.sm_count, round(value * model.sm_count), why=why)


NONE_RAN = Coverage(0.0, "none: no probe ran", 0, 0)

# --------------------------------------------------------------------------------------------
# Kernels that record %smid per block

_CUDA_SRC = r"""
extern "C" __global__ void record_smid(int* out, long long spin_ns) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    if (threadIdx.x == 0) out[blockIdx.x] = (int)sm;
}
"""

_JITERATOR_SRC = r"""
template <typename T> T record_smid(T x) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    return static_cast<T>(sm);
}
"""

_KERNELS: dict[str, Any] = {}


def _cupy(device: torch.device, blocks: int) -> torch.Tensor:
    import cupy

    kernel = _KERNELS.get("cupy")
    if kernel is None:
        kernel = _KERNELS["cupy"] = cupy.RawKernel(_CUDA_SRC, "record_smid")
    with cupy.cuda.Device(device.index or 0):
        out = cupy.full((blocks,), -1, dtype=cupy.int32)
        kernel((blocks,), (128,), (out, cupy.int64(SPIN_NS)))
        cupy.cuda.get_current_stream().synchronize()
        return torch.as_tensor(out.get())


def _triton(device: torch.device, blocks: int) -> torch.Tensor:
    from node_agent.sdc.smid_triton import record_smid

    out = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    with torch.cuda.device(device):
        record_smid[(blocks,)](out, SPIN_NS)
    return out.cpu()


def _jiterator(device: torch.device, blocks: int) -> torch.Tensor:
    fn = _KERNELS.get("jiterator")
    if fn is None:
        fn = _KERNELS["jiterator"] = torch.cuda.jiterator._create_jit_fn(_JITERATOR_SRC)
    # an elementwise kernel: 128 threads x 4 elements per block, so 512 elements per block
    # (float32: jiterator's documented dtypes are floating; SM ids are small integers, exact)
    x = torch.zeros(blocks * 512, dtype=torch.float32, device=device)
    ids: torch.Tensor = fn(x).cpu().to(torch.int64)
    return ids


KERNELS: dict[str, Callable[[torch.device, int], torch.Tensor]] = {
    "cupy": _cupy,
    "triton": _triton,
    "jiterator": _jiterator,
}


def smids(device: torch.device, blocks: int, method: str = "auto") -> tuple[set[int], str]:
    """The distinct ``%smid`` values a grid of ``blocks`` blocks ran on, and the kernel used.

    ``method``: ``auto`` (the first of ``KERNELS`` that works) or one of its keys. Raises
    RuntimeError naming every kernel tried and why it failed."""
    names = list(KERNELS) if method == "auto" else [method]
    failures = []
    for name in names:
        if name not in KERNELS:
            raise ValueError(f"unknown %smid kernel {name!r}; one of {sorted(KERNELS)}")
        try:
            ids = KERNELS[name](device, blocks)
        except Exception as err:  # noqa: BLE001 - an unavailable kernel is the next one's turn
            failures.append(
                f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            )
            continue
        seen = {int(v) for v in ids.tolist() if int(v) >= 0}
        if not seen:
            failures.append(f"{name}: recorded no SM id")
            continue
        return seen, name
    raise RuntimeError(
        "cannot read %smid on "
        + str(device)
        + ": "
        + "; ".join(failures)
        + " (install cupy or triton, or use a CUDA build of torch with NVRTC)"
    )


def measure(
    device: torch.device | str,
    model: TileModel,
    shapes: Iterable[tuple[int, int]],
    method: str = "auto",
) -> Coverage:
    """Coverage of a probe round of ``(M, N)`` outputs on ``device``: measured with ``%smid``
    on a CUDA GPU (one grid per shape, one block per tile), the model's figure elsewhere or when
    no kernel can be built (``why`` says which)."""
    dev = torch.device(device)
    shapes = list(shapes)
    if dev.type != "cuda":
        return modeled(model, shapes, "simulated GPU: coverage from the tile model")
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    seen: set[int] = set()
    used = ""
    blocks = 0
    try:
        for m, n in shapes:
            grid = model.tiles(m, n)
            ids, used = smids(dev, grid, method)
            seen |= ids
            blocks += grid
    except RuntimeError as err:
        log.warning("sdc: %s; sm_coverage from the tile model", err)
        return modeled(model, shapes, f"not measured: {err}")
    return Coverage(min(1.0, len(seen) / sm_count), f"smid:{used}", sm_count, len(seen), blocks)
