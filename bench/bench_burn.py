"""Burn efficiency: the burn engine's sustained TFLOP/s over a plain ``torch.matmul`` loop's.

Both run in this one process on the same device, shapes and numerics (TF32 on only for
``tf32``, no reduced-precision reductions), alternating in blocks of ``--block-s`` seconds so
that drift of the machine (clocks, temperature, other load) hits both alike. The engine's
figure includes everything the burn does per product: Freivalds verification of one product
in ``--verify-every`` and the synchronisation that bounds how far the host runs ahead. Goal on
a GPU: efficiency >= 0.97. On the CPU it documents the harness (and shows the cost of
verifying tiny products, which is not the GPU's ratio).

    .venv/bin/python bench/bench_burn.py --device cpu --size 256 --precisions fp32,bf16
    .venv/bin/python bench/bench_burn.py --device cuda:0 --size 8192 --block-s 5 --blocks 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from node_agent.compute.burn import BurnEngine, BurnPlan, fp8_matmul, make_inputs, numerics
from node_agent.compute.devices import ComputeDevice, ComputeSpec


def plain_loop(device: ComputeDevice, precision: str, n: int, seconds: float) -> float:
    """TFLOP/s of ``matmul(a, b)`` back to back for ``seconds``, synchronised at the end."""
    a, b = make_inputs(precision, n, device.device)
    mm = fp8_matmul(device.device) if precision == "fp8" else torch.matmul
    with numerics(precision):
        mm(a, b)
        device.synchronize()
        count, t0 = 0, time.perf_counter()
        c0 = device.clock()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):  # launch a few at a time, as the engine does between checks
                mm(a, b)
            count += 8
            device.synchronize()
        busy = device.clock() - c0
    return 2.0 * n**3 * count / busy / 1e12


def engine_loop(engine: BurnEngine, precision: str, seconds: float) -> float:
    sent: list[tuple] = []
    t0 = time.monotonic()
    engine.run_phase(precision, t0 + seconds, t0, sent.append)
    samples = [m for m in sent if m[0] == "sample"]
    return sum(m[4] for m in samples) / sum(m[5] for m in samples) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", type=int, default=None, help="n of the n x n GEMMs")
    ap.add_argument("--precisions", default="bf16,fp16,tf32,fp32")
    ap.add_argument("--block-s", type=float, default=2.0)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per side, alternating")
    ap.add_argument("--verify-every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    size = args.size or (8192 if dev.type == "cuda" else 256)
    spec = ComputeSpec(dev.index or 0, cpu_threads=args.threads)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        device = ComputeDevice(spec, dev, torch.matmul)
    else:
        torch.set_num_threads(args.threads)
        device = ComputeDevice(spec, dev, torch.matmul)
    precisions = [p for p in args.precisions.split(",") if p]
    plan = BurnPlan(size=size, precisions=tuple(precisions), sample_s=min(1.0, args.block_s),
                    verify_every=args.verify_every)
    engine = BurnEngine(device, plan)
    skipped = engine.prepare()
    print(f"device {device.device}, n={size}, {args.blocks} x {args.block_s:g} s per side, "
          f"verify 1 in {args.verify_every}, torch {torch.__version__}")
    print()
    print("| precision | burn engine (TFLOP/s) | plain matmul loop (TFLOP/s) | efficiency |")
    print("|---|---|---|---|")
    for precision in precisions:
        if precision in skipped:
            print(f"| {precision} | skipped: {skipped[precision]} | | |")
            continue
        ours, plain = [], []
        for _ in range(args.blocks):
            ours.append(engine_loop(engine, precision, args.block_s))
            plain.append(plain_loop(device, precision, size, args.block_s))
        a, b = statistics.median(ours), statistics.median(plain)
        print(f"| {precision} | {a:.4g} | {b:.4g} | {a / b:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
