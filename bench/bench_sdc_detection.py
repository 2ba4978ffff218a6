"""Detection power of the SDC probes against one faulty SM, before and after whole-GPU probes.

A GPU with one defective SM that corrupts each output tile it computes with probability R per
launch (the simulator's fault, ``node_agent.sdc.inject``). For R in 1.0, 0.3 and 0.05:

1. **Model, H100 scale** (132 SMs, 128 x 128 tiles): the probability that one probe round, and
   ``--rounds`` rounds of the delivery check, (a) see at least one mismatch and (b) confirm the
   fault, for the probes before this change
   (shapes 128x128x128, 96x256x160, 257x64x33 in fp32/bf16/fp16/tf32; a mismatch confirmed only
   when its immediate re-run mismatches too) and after (the whole-GPU exact specs, 4 tiles per
   SM; confirmed by a second mismatching run in the round). Exact arithmetic over the tile
   model's launch rotation, no sampling.
2. **Measured, simulated H100** (132 SMs, 16 x 16 tiles, CPU): the real check code
   (``node_agent.checks.sdc.probe_node``) with the delivery suite's simulated parameters, before
   (the old simulated shapes 32x32x32 and 33x64x17, old confirmation rule) and after, over
   ``--trials`` seeds: the share of runs that grade FAULT (``sdc_confirmed``) and that see
   any mismatch.

Prints Markdown tables::

    .venv/bin/python bench/bench_sdc_detection.py --trials 100
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from node_agent.checks import sdc as sdc_check
from node_agent.compute.devices import ComputeDevice, ComputeSpec
from node_agent.sdc import probes as sdc
from node_agent.sdc.tiles import TileModel, gpu_model, sim_model

RATES = (1.0, 0.3, 0.05)
FAULTY_SM = 17
OLD_SHAPES = ((128, 128, 128), (96, 256, 160), (257, 64, 33))
OLD_DTYPES = ("fp32", "bf16", "fp16", "tf32")


def tiles_on_sm_distribution(model: TileModel, m: int, n: int) -> dict[int, float]:
    """{tiles the faulty SM computes: probability} over a uniformly drawn launch rotation."""
    total = model.tiles(m, n)
    base, extra = divmod(total, model.sm_count)
    p_extra = extra / model.sm_count
    out = {base: 1.0 - p_extra}
    if extra:
        out[base + 1] = out.get(base + 1, 0.0) + p_extra
    return out


def p_mismatch(model: TileModel, m: int, n: int, rate: float) -> float:
    """Probability one launch of an m x n output has at least one wrong tile."""
    return sum(
        w * (1.0 - (1.0 - rate) ** t) for t, w in tiles_on_sm_distribution(model, m, n).items()
    )


def p_round(ps: list[float], rule: str) -> tuple[float, float]:
    """(P(at least one mismatching run), P(confirmed)) of a round of probes with these
    per-launch mismatch probabilities; each mismatch gets one re-run. ``rule``: ``rerun``
    (confirmed only when a re-run mismatches) or ``window`` (two mismatching runs in the round,
    a probe's re-run included)."""
    seen = 1.0 - math.prod(1.0 - p for p in ps)
    if rule == "rerun":
        return seen, 1.0 - math.prod(1.0 - p * p for p in ps)
    # distribution of mismatching runs, capped at 2
    dist = [1.0, 0.0, 0.0]
    for p in ps:
        step = [1.0 - p, p * (1.0 - p), p * p]  # 0, 1 or 2 mismatching runs for this probe
        new = [0.0, 0.0, 0.0]
        for a, pa in enumerate(dist):
            for b, pb in enumerate(step):
                new[min(2, a + b)] += pa * pb
        dist = new
    return seen, dist[2]


def model_table(rounds: int) -> list[str]:
    model = gpu_model(132)
    before = [shape for shape in OLD_SHAPES for _ in OLD_DTYPES]
    after = sdc.plan_whole_gpu(model, [d for d, _, _ in sdc.WHOLE_GPU_SPECS], 4, 256)
    lines = [
        "| R | before: P(seen), 1 round | before: P(confirmed), 1 round | "
        f"before: P(confirmed), {rounds} rounds | after: P(seen), 1 round | "
        f"after: P(confirmed), 1 round | after: P(confirmed), {rounds} rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate in RATES:
        pb = [p_mismatch(model, m, n, rate) for m, _, n in before]
        pa = [p_mismatch(model, s.m, s.n, rate) for s in after]
        b, a = p_round(pb, "rerun"), p_round(pa, "window")
        b_run, a_run = p_round(pb * rounds, "rerun")[1], p_round(pa * rounds, "window")[1]
        lines.append(
            f"| {rate:g} | {b[0]:.4f} | {b[1]:.5f} | {b_run:.3f} | {a[0]:.4f} | "
            f"{a[1]:.4f} | {a_run:.4f} |"
        )
    lines.append("")
    lines.append(
        f"(before: {len(before)} probes per round reaching 1-3 of 132 SMs; after: "
        f"{len(after)} whole-GPU probes, {model.tiles(after[0].m, after[0].n)} tiles each, "
        f"4 per SM. {rounds} rounds: a lower bound, by model, of what the delivery check's "
        "180 s give on an H100, see docs/sdc.md)"
    )
    return lines


def simulated_run(rate: float, seed: int, after: bool) -> tuple[bool, bool]:
    """One delivery-check run on one simulated H100 GPU with the faulty SM: (confirmed, seen)."""
    sm = sim_model()
    mm = sdc.corrupting_matmul(seed=seed, tiles=sm, sm=FAULTY_SM, rate=rate)
    dev = ComputeDevice(ComputeSpec(6, simulated=True), torch.device("cpu"), mm)
    params = {
        "dtypes": ["fp32", "bf16", "fp16"],
        "digest_shapes": [[32, 32, 32], [33, 64, 17]],
        "repeats": 2,
        "freivalds_n": 64,
    }
    if not after:
        params["shapes"] = [[32, 32, 32], [33, 64, 17]]
    plan, _ = sdc_check.make_plan(params, on_cuda=False)
    run = sdc_check.GpuRun(6, dev)
    sdc_check.probe_node({6: run}, plan)
    exact = [v for v in run.verdicts if v.probe == "exact_gemm"]
    seen = any(v.status != "pass" for v in run.verdicts)
    if after:
        confirmed = any(v.status == "confirmed" for v in run.verdicts)
    else:  # the old rule: only a mismatch whose own re-run mismatched, or a digest odd one out
        confirmed = any(
            v.status == "confirmed" and not v.evidence.get("window_mismatches") for v in exact
        ) or any(v.status == "confirmed" and v.probe != "exact_gemm" for v in run.verdicts)
    return confirmed, seen


def simulated_table(trials: int) -> list[str]:
    lines = [
        "| R | before: P(FAULT) | before: P(mismatch seen) | after: P(FAULT) | "
        "after: P(mismatch seen) | trials |",
        "|---|---|---|---|---|---|",
    ]
    for rate in RATES:
        row = []
        for after in (False, True):
            results = [simulated_run(rate, seed, after) for seed in range(trials)]
            row += [sum(c for c, _ in results) / trials, sum(s for _, s in results) / trials]
        lines.append(
            f"| {rate:g} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {row[3]:.2f} | {trials} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100, help="seeds per rate (simulated runs)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=100,
        help="rounds of the delivery check on a GPU, for the model (default 100)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("node_agent.sdc.probes").setLevel(logging.ERROR)  # expected mismatches
    print(f"faulty SM {FAULTY_SM}; torch {torch.__version__}\n")
    print("Model, H100 scale (132 SMs, 128 x 128 tiles), one probe round:\n")
    print("\n".join(model_table(args.rounds)))
    t0 = time.perf_counter()
    print(
        "\nMeasured, simulated H100 (132 SMs, 16 x 16 tiles), the delivery check's simulated "
        "parameters (2 rounds), one GPU:\n"
    )
    print("\n".join(simulated_table(args.trials)))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
