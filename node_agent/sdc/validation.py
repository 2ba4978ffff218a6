"""Figures the GPU validation (``make gpu-validate``) reports for the SDC probes.

Two functions, both on a real device, neither part of the agent's normal path:

- :func:`sdc_sm_coverage` -- ``sdc_sm_coverage``: the share of the current CUDA device's SMs
  that ran at least one tile of a whole-GPU probe round, measured with ``%smid``
  (``node_agent.sdc.coverage``). Never falls back to the tile model: a validation measures.
- :func:`sdc_training_overhead_percent` -- a small transformer training loop run in
  alternating blocks without and with ``SdcProbe.step()``; the median per-pair slowdown in
  percent (the in-training probe's budget is 0.1 %).

Both return a float; :func:`measure_sm_coverage` and :func:`measure_training_overhead` return
the details (method, SM ids seen, step times, the probe's own cost) for a report.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import node_agent.sdc.coverage as sdc_coverage
from node_agent.sdc.coverage import Coverage
from node_agent.sdc.exact import tile_model_for, whole_gpu_specs

if TYPE_CHECKING:
    from node_agent.sdc.probes import SdcProbe


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"no CUDA device: torch {torch.__version__} "
            f"({'CPU-only build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda}) "
            "sees none; run this on a GPU host"
        )
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"{dev} is not a CUDA device")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def measure_sm_coverage(
    device: torch.device | str | int | None = None,
    *,
    tiles_per_sm: int | None = None,
    method: str = "auto",
) -> Coverage:
    """Measure a whole-GPU probe round's SM coverage on a CUDA device with ``%smid``.

    ``device``: default the current CUDA device; ``tiles_per_sm``: default the delivery
    check's (4); ``method``: ``auto`` or one of ``node_agent.sdc.coverage.KERNELS``
    (``cupy``, ``triton``, ``jiterator``). Raises RuntimeError when there is no CUDA device or
    no kernel can read ``%smid`` (the message names each one tried)."""
    dev = _cuda_device(device)
    model = tile_model_for(dev)
    specs, _ = whole_gpu_specs(dev, model, tiles_per_sm=tiles_per_sm)
    shapes = sorted({(s.m, s.n) for s in specs})
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    seen: set[int] = set()
    used = ""
    blocks = 0
    for m, n in shapes:
        grid = model.tiles(m, n)
        ids, used = sdc_coverage.smids(dev, grid, method)
        seen |= ids
        blocks += grid
    return Coverage(min(1.0, len(seen) / sm_count), f"smid:{used}", sm_count, len(seen), blocks)


def sdc_sm_coverage(
    device: torch.device | str | int | None = None,
    *,
    tiles_per_sm: int | None = None,
    method: str = "auto",
) -> float:
    """``sdc_sm_coverage`` (0..1) of the current (or given) CUDA device: see
    :func:`measure_sm_coverage`."""
    return measure_sm_coverage(device, tiles_per_sm=tiles_per_sm, method=method).value


# --------------------------------------------------------------------------------------------
# Training overhead


@dataclasses.dataclass
class Overhead:
    """What :func:`measure_training_overhead` saw. ``percent``: median over off/on block pairs
    of (mean step with probe / mean step without - 1) x 100; ``probe_share_percent``: the
    probe's self-measured cost (``SdcProbe.cost_s``: every ``step()``'s host time and the
    probes' GPU time, the last probe's read back) over the time it ran, x 100. With
    ``probes_run`` 0 the run was too short for the budget to buy one probe, and ``percent`` is
    the noise of two identical loops. ``pair_percents``: each pair's overhead, in order;
    ``probe_cost_ms``: the probe's whole cost (its GPU time and every ``step()``'s host time);
    ``on_s``: the time the probe's clock ran (the "on" blocks)."""

    percent: float
    pairs: int
    steps_per_block: int
    step_ms_off: float
    step_ms_on: float
    probe_share_percent: float
    probes_run: int
    budget_fraction: float
    device: str
    verdicts: dict[str, int]
    pair_percents: list[float] = dataclasses.field(default_factory=list)
    probe_cost_ms: float = 0.0
    on_s: float = 0.0

    @property
    def within_budget(self) -> bool:
        """Whether the probe's own cost stayed within ``budget_fraction`` of the time it ran."""
        return self.probe_share_percent <= self.budget_fraction * 100.0 * (1 + 1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "within_budget": self.within_budget}


#: the steps timed after the warm-up that size the blocks when ``block_s`` is given
SIZING_STEPS = 5


class PausableClock:
    """Monotonic seconds that only advance while running: the probe's view of training time,
    so budget saved while the probe is off is not spent in a burst when it comes back.
    ``source``: the underlying clock (seconds; default ``time.perf_counter``)."""

    def __init__(self, source: Callable[[], float] = time.perf_counter) -> None:
        self.source = source
        self.total = 0.0
        self.since: float | None = None

    def resume(self) -> None:
        if self.since is None:
            self.since = self.source()

    def pause(self) -> None:
        if self.since is not None:
            self.total += self.source() - self.since
            self.since = None

    def __call__(self) -> float:
        since = self.since
        return self.total + (self.source() - since if since is not None else 0.0)


class _TinyTransformer(torch.nn.Module):
    """A small decoder-style language model: embedding, ``layers`` pre-norm transformer
    blocks (``torch.nn.TransformerEncoderLayer`` with a causal mask), a tied output head."""

    mask: torch.Tensor  # a buffer (``register_buffer``), typed for the checker

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d_model))
        block = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        logits: torch.Tensor = self.norm(x) @ self.embed.weight.t()
        return logits


def _training(
    dev: torch.device, vocab: int, d_model: int, heads: int, layers: int, seq: int, batch: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step of a fresh :class:`_TinyTransformer` (AdamW, bf16 autocast on CUDA)
    on fixed tokens, and the device synchronise that ends a timed block."""
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = _TinyTransformer(vocab, d_model, heads, layers, seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if cuda
        else torch.autocast("cpu", enabled=False)
    )

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)
            )
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    return train_step, sync


def _warm_up(
    train_step: Callable[[], None],
    sync: Callable[[], None],
    steps: int,
    block_s: float | None,
    steps_per_block: int,
) -> int:
    """Run the warm-up; the steps per block: ``steps_per_block``, or with ``block_s`` the steps
    that fit in it at the pace of a few timed steps after the warm-up (at least 10)."""
    for _ in range(steps):
        train_step()
    sync()
    if block_s is None:
        return steps_per_block
    t0 = time.perf_counter()
    for _ in range(SIZING_STEPS):
        train_step()
    sync()
    step_s = (time.perf_counter() - t0) / SIZING_STEPS
    return max(10, round(block_s / max(step_s, 1e-6)))


def _block(
    train_step: Callable[[], None],
    sync: Callable[[], None],
    steps: int,
    probe: SdcProbe | None,
) -> float:
    """The mean step time of ``steps`` training steps, each followed by ``probe.step()``."""
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step()
        if probe is not None:
            probe.step()
    sync()
    if probe is not None:
        probe.collect()  # a probe that completed in the block's last step is counted too
    return (time.perf_counter() - t0) / steps


def _alternate(
    train_step: Callable[[], None],
    sync: Callable[[], None],
    steps: int,
    pairs: int,
    probe: SdcProbe,
    clock: PausableClock,
) -> tuple[list[float], list[float], list[float]]:
    """``pairs`` blocks without and with the probe (its clock running in the "on" blocks
    only): their mean step times, and each pair's ratio less one."""
    off: list[float] = []
    on: list[float] = []
    ratios: list[float] = []
    for _ in range(pairs):
        t_off = _block(train_step, sync, steps, None)
        clock.resume()
        t_on = _block(train_step, sync, steps, probe)
        clock.pause()
        off.append(t_off)
        on.append(t_on)
        ratios.append(t_on / t_off - 1.0)
    return off, on, ratios


def measure_training_overhead(
    device: torch.device | str | int | None = None,
    *,
    budget_fraction: float = 0.001,
    pairs: int = 8,
    steps_per_block: int = 50,
    warmup_steps: int = 20,
    block_s: float | None = None,
    d_model: int = 512,
    heads: int = 8,
    layers: int = 4,
    seq: int = 256,
    batch: int = 16,
    vocab: int = 8192,
    probe_kwargs: dict[str, Any] | None = None,
) -> Overhead:
    """Train a small transformer (defaults: 4 layers, d_model 512, seq 256, batch 16, AdamW,
    bf16 autocast on CUDA) in ``pairs`` alternating blocks of ``steps_per_block`` steps without
    and with ``SdcProbe.step()`` after each step, and compare the blocks' mean step times.

    Blocks end with a device synchronise (to time them); inside a block nothing synchronises,
    so the probe's side stream overlaps training as it would in a real job. The probe's clock
    (:class:`PausableClock`) runs in the "on" blocks only. ``block_s``, when given, sizes the
    blocks in seconds instead: ``steps_per_block`` becomes the number of steps the warm-up's
    mean step time fits in it (at least 10), so the budget's share of the "on" time is known
    before the run (8 pairs of 3 s: 24 ms at 0.1 %, ten probes or more on a data-centre GPU).
    ``device``: default the current CUDA device, else the CPU (for a harness check; the CPU
    figure is noise). ``probe_kwargs`` go to ``SdcProbe`` (its spool is a temporary
    directory).

    The budget decides how many probes run: ``budget_fraction`` x the "on" time must cover a
    probe's cost before the first starts, so the defaults are sized for several probes on a
    data-centre GPU (the figures and their sizing are in docs/sdc.md). A shorter run measures
    no probe at all (``probes_run`` 0); a check of the harness raises the budget instead."""
    from node_agent.sdc.probes import SdcProbe

    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    train_step, sync = _training(dev, vocab, d_model, heads, layers, seq, batch)

    clock = PausableClock()
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="sdc-overhead-") as spool:
        probe = SdcProbe(
            dev,
            budget_fraction=budget_fraction,
            spool_dir=spool,
            clock=clock,
            **(probe_kwargs or {}),
        )
        steps_per_block = _warm_up(train_step, sync, warmup_steps, block_s, steps_per_block)
        off, on, ratios = _alternate(train_step, sync, steps_per_block, pairs, probe, clock)
        for v in probe.verdicts:
            counts[v.status] = counts.get(v.status, 0) + 1
        elapsed = clock()
    return Overhead(
        percent=statistics.median(ratios) * 100.0,
        pair_percents=[r * 100.0 for r in ratios],
        probe_cost_ms=probe.cost_s * 1e3,
        on_s=elapsed,
        pairs=pairs,
        steps_per_block=steps_per_block,
        step_ms_off=statistics.fmean(off) * 1e3,
        step_ms_on=statistics.fmean(on) * 1e3,
        probe_share_percent=(probe.cost_s / elapsed * 100.0) if elapsed > 0 else 0.0,
        probes_run=probe.probes_run,
        budget_fraction=budget_fraction,
        device=str(dev),
        verdicts=counts,
    )


def sdc_training_overhead_percent(
    device: torch.device | str | int | None = None, **kwargs: Any
) -> float:
    """The in-training probe's overhead on a small transformer loop, percent (median over
    off/on block pairs); keyword arguments as :func:`measure_training_overhead`."""
    return measure_training_overhead(device, **kwargs).percent
