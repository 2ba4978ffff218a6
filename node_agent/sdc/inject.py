"""Fault injection at the compute boundary: the matmul of a simulated faulty GPU.

The simulator (``node_agent.compute.devices``) and the tests hand :func:`corrupting_matmul` to
the probes in place of ``torch.matmul``; everything above it is the real code.

**One faulty SM** (``sm``, ``rate``, ``tiles``): the output is cut into the tile model's tiles
(``node_agent.sdc.tiles``); each launch draws where its first tile lands (the rotation ``r``,
uniform over the SMs: the hardware does not promise it), tile ``t`` runs on SM
``(t + r) mod S``, and every tile that runs on SM ``sm`` is wrong with probability ``rate``:
one element of it, at a drawn position, has one bit flipped. ``sm=None`` makes every SM
faulty. Draws come from ``random.Random(seed)``, so a run is reproducible and ``rate`` is
honoured over many launches.

**Legacy** (no ``tiles``): one element of every output, picked by ``seed``, has its bit flipped.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

import torch

from node_agent.sdc.tiles import TileModel

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: top stored mantissa bit: flipping it changes any value, zero included
_DEFAULT_BIT = {torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _mask(dtype: torch.dtype, bit: int | None) -> tuple[torch.dtype, int]:
    view = _INT_VIEW.get(dtype)
    if view is None:
        raise TypeError(f"corrupting_matmul: cannot flip bits of {dtype}")
    nbits = torch.iinfo(view).bits
    b = _DEFAULT_BIT[dtype] if bit is None else bit
    if not 0 <= b < nbits:
        raise ValueError(f"corrupting_matmul: bit {b} out of range for {dtype} ({nbits} bits)")
    return view, (1 << b) if b < nbits - 1 else -(1 << b)  # the sign bit as two's complement


def corrupting_matmul(
    bit: int | None = None,
    seed: int = 0,
    times: int | None = None,
    base: Matmul | None = None,
    *,
    tiles: TileModel | None = None,
    sm: int | None = None,
    rate: float = 1.0,
) -> Matmul:
    """A matmul that returns wrong elements: the simulated faulty GPU.

    ``bit``: which bit of an element's encoding to flip (default: the top mantissa bit);
    ``seed``: seeds the draws (or, without ``tiles``, picks the element); ``times``: corrupt
    only the first ``times`` calls (``times=1`` makes a transient); ``base``: the healthy
    matmul (default ``node_agent.sdc.exact.gemm``, which handles fp8).

    With ``tiles`` (the GPU's tile model): SM ``sm`` (``None``: every SM) corrupts each tile it
    computes with probability ``rate`` (0 < rate <= 1), as the module docstring describes.
    """
    if not 0 < rate <= 1:
        raise ValueError(f"corrupting_matmul: rate must be in (0, 1], got {rate}")
    mm: Matmul
    if base is None:
        from node_agent.sdc.exact import gemm

        mm = gemm
    else:
        mm = base
    calls = itertools.count()
    rng = random.Random(seed)

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = mm(a, b)
        if times is not None and next(calls) >= times:
            return out
        view, mask = _mask(out.dtype, bit)
        if tiles is None:
            idx = int(
                torch.randint(
                    0, out.numel(), (1,), generator=torch.Generator().manual_seed(seed)
                ).item()
            )
            out = out.clone()
            out.view(-1).view(view)[idx] ^= mask
            return out
        if sm is not None and not 0 <= sm < tiles.sm_count:
            raise ValueError(f"corrupting_matmul: sm {sm} out of range for {tiles.sm_count} SMs")
        m, n = out.shape[-2], out.shape[-1]
        rotation = rng.randrange(tiles.sm_count)
        faulty: Iterable[int]
        if sm is None:
            faulty = range(tiles.tiles(m, n))
        else:
            faulty = tiles.tiles_on(sm, m, n, rotation)
        hits = [t for t in faulty if rate >= 1 or rng.random() < rate]
        if not hits:
            return out
        out = out.clone()
        flat = out.view(-1, m, n).view(view) if out.dim() > 2 else out.view(view).view(1, m, n)
        cols = tiles.grid(m, n)[1]
        for t in hits:
            r0, c0 = (t // cols) * tiles.tile_m, (t % cols) * tiles.tile_n
            i = r0 + rng.randrange(min(tiles.tile_m, m - r0))
            j = c0 + rng.randrange(min(tiles.tile_n, n - c0))
            flat[:, i, j] ^= mask
        return out

    return matmul
