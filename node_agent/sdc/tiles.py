"""Which SM computes which output tile of a GEMM: the model the SDC probes are sized by.

Standard library only (the simulator and the daemon use it without torch).

**The model.** A GEMM's output (M x N) is cut into tiles of ``tile_m x tile_n``; tile ``t``
(row-major over the tile grid: ``t = (i // tile_m) * tiles_n + j // tile_n``) runs on SM
``(t + r) mod S``, where ``S`` is the GPU's SM count and ``r`` is the SM the launch's first
tile lands on. That is what a persistent tile scheduler does (CUTLASS's persistent kernels and
cuBLAS's on Hopper launch one CTA per SM; CTA ``c`` takes tiles ``c, c + S, c + 2S, ...``) and
what the hardware block scheduler does to a non-persistent grid's first wave (blocks handed out
in order to free SMs). The hardware does not promise which SM gets the first tile, so ``r`` is a
parameter: the simulator draws it per launch (``node_agent.sdc.inject``); coverage figures take
the worst case. A launch of ``T`` tiles therefore reaches ``min(T, S)`` SMs whatever ``r`` is,
and one of ``T >= S`` tiles reaches every SM. Real kernels differ in detail (tile shapes of
64..256, swizzled tile orders, split-K); on a GPU the share of SMs a probe round reaches is
measured with ``%smid`` (``node_agent.sdc.coverage``), and this model is the fallback.

**Whole-GPU probe shapes.** :func:`whole_gpu_mn` picks an output of at least
``tiles_per_sm * S`` tiles, so every SM runs several tiles per probe (the margin covers a real
scheduler that is less even than the model), with both sides multiples of the golden's period
``block`` (the probe's inputs repeat with that period, so its golden value is a small block,
see ``node_agent.sdc.exact``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

#: SM count of a simulated GPU whose SKU file gives none: an H100 SXM5 (132 of GH100's 144 SMs,
#: NVIDIA H100 Tensor Core GPU Architecture whitepaper), the reference SKU of the scenarios
DEFAULT_SM_COUNT = 132
#: modeled output tile of a real GPU's GEMM: 128 x 128 is the common CUTLASS/cuBLAS tile for
#: bf16/fp16 on Ampere and Hopper (CUTLASS default threadblock shapes)
GPU_TILE = (128, 128)
#: tile of a simulated GPU: smaller, so the CPU stand-in's whole-GPU GEMMs stay CPU-sized
#: (132 SMs x 2 tiles of 16 x 16 is a 320 x 256 output); the SM assignment is the same function
SIM_TILE = (16, 16)
#: period of the probe inputs on a GPU / a simulated GPU (the golden is block x block)
GPU_BLOCK = 256
SIM_BLOCK = 64
#: tiles per SM per whole-GPU probe: 4 on a GPU (margin over the model: real block schedulers
#: are not perfectly round-robin), 2 on a simulated one (the model is exact there)
GPU_TILES_PER_SM = 4
SIM_TILES_PER_SM = 2


@dataclass(frozen=True)
class TileModel:
    """``sm_count`` SMs computing output tiles of ``tile_m x tile_n`` round-robin."""

    sm_count: int
    tile_m: int = GPU_TILE[0]
    tile_n: int = GPU_TILE[1]

    def __post_init__(self) -> None:
        if self.sm_count < 1 or self.tile_m < 1 or self.tile_n < 1:
            raise ValueError(f"tile model needs sm_count, tile_m, tile_n >= 1, got {self}")

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """Tile rows and columns of an ``m x n`` output (edge tiles partly filled)."""
        return (math.ceil(m / self.tile_m), math.ceil(n / self.tile_n))

    def tiles(self, m: int, n: int) -> int:
        rows, cols = self.grid(m, n)
        return rows * cols

    def tile_of(self, i: int, j: int, n: int) -> int:
        """Index of the tile holding output element (i, j) of an output ``n`` wide."""
        return (i // self.tile_m) * self.grid(1, n)[1] + j // self.tile_n

    def sm_of(self, tile: int, rotation: int = 0) -> int:
        """The SM that computes ``tile`` when the launch's first tile lands on ``rotation``."""
        return (tile + rotation) % self.sm_count

    def tiles_on(self, sm: int, m: int, n: int, rotation: int = 0) -> list[int]:
        """The tiles of an ``m x n`` output that SM ``sm`` computes."""
        first = (sm - rotation) % self.sm_count
        return list(range(first, self.tiles(m, n), self.sm_count))

    def sms_reached(self, m: int, n: int) -> int:
        """How many SMs one launch of an ``m x n`` output reaches (any rotation)."""
        return min(self.tiles(m, n), self.sm_count)

    def coverage(self, shapes: Iterable[tuple[int, int]]) -> float:
        """Share of SMs one round of launches of these ``(m, n)`` outputs is sure to reach.

        Each launch may start anywhere, so the round is sure of its largest launch's SMs
        (a lower bound: other launches usually add more)."""
        reached = max((self.sms_reached(m, n) for m, n in shapes), default=0)
        return reached / self.sm_count

    def sm_counts(self, tiles: Iterable[int], rotation: int = 0) -> dict[int, int]:
        """``{sm: how many of these tiles it computed}`` (for a mismatch's evidence)."""
        return dict(sorted(Counter(self.sm_of(t, rotation) for t in tiles).items()))


def gpu_model(sm_count: int) -> TileModel:
    """The model of a real GPU with ``sm_count`` SMs (128 x 128 tiles)."""
    return TileModel(sm_count, *GPU_TILE)


def sim_model(sm_count: int | None = None) -> TileModel:
    """The model of a simulated GPU (16 x 16 tiles; ``DEFAULT_SM_COUNT`` SMs unless given)."""
    return TileModel(sm_count or DEFAULT_SM_COUNT, *SIM_TILE)


def whole_gpu_mn(model: TileModel, tiles_per_sm: int, block: int) -> tuple[int, int]:
    """An output (M, N) of at least ``tiles_per_sm * sm_count`` tiles, near square, each side
    a multiple of both the tile side and ``block``.

    >>> whole_gpu_mn(TileModel(132, 128, 128), 4, 256)   # H100: 24 x 22 = 528 tiles
    (3072, 2816)
    >>> whole_gpu_mn(TileModel(132, 16, 16), 2, 64)      # simulated H100: 20 x 16 = 320 tiles
    (320, 256)
    """
    if tiles_per_sm < 1 or block < 1:
        raise ValueError(f"tiles_per_sm and block must be >= 1, got {tiles_per_sm}, {block}")
    unit_m = math.lcm(model.tile_m, block)
    unit_n = math.lcm(model.tile_n, block)
    # tiles per unit along each side: the grid grows in these steps
    qm, qn = unit_m // model.tile_m, unit_n // model.tile_n
    target = tiles_per_sm * model.sm_count
    rows = math.ceil(math.ceil(math.sqrt(target)) / qm) * qm
    cols = math.ceil(math.ceil(target / rows) / qn) * qn
    return rows * model.tile_m, cols * model.tile_n
