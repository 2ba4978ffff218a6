"""Burn efficiency: the burn engine's sustained TFLOP/s over a plain matmul loop's, per precision.

Both run in this one process on the same device, inputs, kernel and numerics (TF32 on only for
``tf32``, no reduced-precision reductions), alternating in blocks of ``--block-s`` seconds so
that drift of the machine (clocks, temperature, other load) hits both alike. The engine's
figure includes everything the burn does per product: the Freivalds check of one product in
``--verify-every`` on the device, its verdict read back behind an event, and the host waits
that keep it at most ``verify_lag`` checks ahead. The plain loop launches back to back, at most
4 products ahead of the device (events, never a drain), and synchronises once per block. Goal
on a GPU: efficiency >= 0.97 for every precision. On the CPU it documents the harness and the
cost of the check against a CPU's GEMM, which is not the GPU's ratio.

The engine's host waits are counted too (``waits/window``: blocking waits for a check,
``drains/window``: full synchronisations, one per window by design).

    .venv/bin/python bench/bench_burn.py --device cpu --size 512 --precisions bf16,tf32,fp32
    .venv/bin/python bench/bench_burn.py --device cuda:0 --size 8192 --block-s 5 --blocks 6
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
from typing import Any

import torch

from node_agent.compute.burn import PRECISIONS, BurnEngine, BurnPlan, DeviceWaits, numerics
from node_agent.compute.devices import ComputeDevice, ComputeSpec


class CountedWaits(DeviceWaits):
    """The engine's waits, counted (blocking waits for a check; full synchronisations)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.waits = 0
        self.drains = 0

    def wait(self, event: Any) -> None:
        self.waits += 1
        super().wait(event)

    def synchronize(self) -> None:
        self.drains += 1
        super().synchronize()


class CpuTimedDevice(ComputeDevice):
    """The CPU, timed by this process's CPU time: other load on the machine is not counted
    (with one torch thread, CPU time is the work's own time)."""

    def clock(self) -> float:
        return time.process_time()


def plain_loop(engine: BurnEngine, precision: str, seconds: float) -> float:
    """TFLOP/s of the engine's own ``matmul(a, b)`` back to back for ``seconds``."""
    job = engine.jobs[precision]
    m, k = job.a.shape
    n = job.b.shape[1]
    waits = DeviceWaits(engine.device.device)
    with numerics(precision):
        job.matmul(job.a, job.b)
        waits.synchronize()
        count, behind = 0, []
        t0 = time.perf_counter()
        c0 = engine.device.clock()
        while time.perf_counter() - t0 < seconds:
            job.matmul(job.a, job.b)
            count += 1
            behind.append(waits.record())
            if len(behind) > 4:
                waits.wait(behind.pop(0))
        waits.synchronize()
        busy = engine.device.clock() - c0
    return 2.0 * m * k * n * count / busy / 1e12


def engine_loop(engine: BurnEngine, precision: str, seconds: float) -> tuple[float, int, int]:
    """(TFLOP/s, products verified, wrong elements) of the engine for ``seconds``."""
    sent: list[tuple] = []
    t0 = time.monotonic()
    engine.run_phase(precision, t0 + seconds, t0, sent.append)
    samples = [m for m in sent if m[0] == "sample"]
    tflops = sum(m[4] for m in samples) / sum(m[5] for m in samples) / 1e12
    return tflops, sum(m[6] for m in samples), sum(m[7] for m in samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", type=int, default=None, help="n of the n x n GEMMs")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--block-s", type=float, default=2.0)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per side, alternating")
    ap.add_argument("--verify-every", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    size = args.size or (8192 if dev.type == "cuda" else 512)
    spec = ComputeSpec(dev.index or 0, cpu_threads=args.threads)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        what = torch.cuda.get_device_name(dev)
    else:
        torch.set_num_threads(args.threads)
        what = (
            f"{platform.processor() or platform.machine()}, {args.threads} torch thread(s), "
            "timed by process CPU time"
        )
    device = (ComputeDevice if dev.type == "cuda" else CpuTimedDevice)(spec, dev, torch.matmul)
    precisions = [p for p in args.precisions.split(",") if p]
    plan = BurnPlan(
        size=size,
        precisions=tuple(precisions),
        sample_s=min(1.0, args.block_s),
        verify_every=args.verify_every,
    )
    waits = CountedWaits(dev)
    engine = BurnEngine(device, plan, waits=waits)
    skipped = engine.prepare()
    print(
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}; device {device.device} "
        f"({what}); n={size}, {args.blocks} x {args.block_s:g} s per side, verify 1 in "
        f"{args.verify_every}, torch {torch.__version__}"
    )
    print()
    print(
        "| precision | burn engine (TFLOP/s) | plain matmul loop (TFLOP/s) | efficiency | "
        "verified | wrong | waits/window | drains/window |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for precision in precisions:
        if precision in skipped:
            print(f"| {precision} | skipped: {skipped[precision]} | | | | | | |")
            continue
        ours, plain = [], []
        verified = wrong = windows = 0
        waits.waits = waits.drains = 0
        for i in range(args.blocks):
            if i % 2:
                plain.append(plain_loop(engine, precision, args.block_s))
            before = waits.drains
            tflops, v, w = engine_loop(engine, precision, args.block_s)
            ours.append(tflops)
            verified, wrong = verified + v, wrong + w
            windows += waits.drains - before
            if not i % 2:
                plain.append(plain_loop(engine, precision, args.block_s))
        a, b = statistics.median(ours), statistics.median(plain)
        per = max(1, windows)
        print(
            f"| {precision} | {a:.4g} | {b:.4g} | {a / b:.3f} | {verified} | {wrong} | "
            f"{waits.waits / per:.1f} | {waits.drains / per:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
