"""Overhead and detection latency of the in-training SDC probe (``node_agent.sdc.SdcProbe``).

A training-like loop (a small MLP, forward + backward + SGD step) runs in one process:

1. warm-up;
2. blocks without and with ``probe.step()`` alternating (off, on, off, on, ...), so slow drift
   of the machine hits both sides alike; the probe's own clock only runs during "on" blocks,
   so budget saved up while it was off is not spent in a burst;
3. a faulty SM (SM 17 corrupting every tile it computes, ``corrupting_matmul`` with the probe's
   tile model) is installed at the compute boundary and the loop runs until the probe reports a
   ``confirmed`` verdict: the detection latency at that budget.

The probe runs its production path (whole-GPU exact probes round-robin over its specs; on CUDA
its own stream, preallocated buffers, pinned async readback) until the fault is installed.

Prints a Markdown table.  Runs on CPU or CUDA::

    .venv/bin/python bench/bench_sdc_overhead.py                  # CPU or the current GPU
    .venv/bin/python bench/bench_sdc_overhead.py --device cuda:0 --block-s 2 --blocks 30
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from node_agent.sdc import probes as sdc
from node_agent.sdc.validation import PausableClock


def make_model(device: torch.device, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.GELU(),
        torch.nn.Linear(2 * width, 2 * width),
        torch.nn.GELU(),
        torch.nn.Linear(2 * width, width),
    ).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def train_step(model, opt, x, y, device: torch.device) -> None:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # so a step's time is its GPU time


def run_block(seconds: float, step, probe: sdc.SdcProbe | None) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        step()
        if probe is not None:
            probe.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=0.001, help="budget fraction (default 0.001)")
    ap.add_argument("--width", type=int, default=512, help="MLP width")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block-s", type=float, default=2.0, help="seconds per off/on block")
    ap.add_argument("--blocks", type=int, default=16, help="off/on block pairs")
    ap.add_argument("--detect-timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    model, opt = make_model(device, args.width)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randn(args.batch, args.width, device=device)

    def step() -> None:
        train_step(model, opt, x, y, device)

    clock = PausableClock()
    with tempfile.TemporaryDirectory() as spool:
        probe = sdc.SdcProbe(device, budget_fraction=args.budget, spool_dir=spool, clock=clock)
        run_block(2.0, step, None)  # warm-up: allocator, kernels, thread pools
        off: list[float] = []
        on: list[float] = []
        ratios: list[float] = []  # per pair: mean step with / without - 1 (its spread is the noise)
        for _ in range(args.blocks):
            b_off = run_block(args.block_s, step, None)
            clock.resume()
            b_on = run_block(args.block_s, step, probe)
            probe.collect()  # the block's last probe, if it completed, is counted too
            clock.pause()
            off += b_off
            on += b_on
            ratios.append(statistics.fmean(b_on) / statistics.fmean(b_off) - 1)
        cost_s, elapsed_s, probes = probe.cost_s, clock(), probe.probes_run

        # Detection latency: install the fault, train on until the probe confirms it.
        clock.resume()
        probe.matmul = sdc.corrupting_matmul(tiles=probe.tiles, sm=17)  # the compute boundary
        t_fault = time.perf_counter()
        latency_s = None
        confirmed = None
        while time.perf_counter() - t_fault < args.detect_timeout_s:
            step()
            v = probe.step()
            if v is not None and v.status == "confirmed":
                latency_s = time.perf_counter() - t_fault
                confirmed = v
                break
        spooled = len(sdc.read_spool(spool))

    med_off, med_on = statistics.median(off), statistics.median(on)
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    print(
        f"device: {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, MLP width {args.width} batch {args.batch}, budget {args.budget:g}\n"
    )
    print(
        f"probe: {len(probe.specs)} whole-GPU specs ({', '.join(s.label() for s in probe.specs)}), "
        f"{probe.tiles_per_sm} tile(s) per SM of {probe.tiles.sm_count}, sm_coverage "
        f"{probe.coverage.value:g} ({probe.coverage.method}), device memory "
        f"{probe.memory_bytes / 2**20:.1f} MiB\n"
    )
    print("| metric | value |")
    print("|---|---|")
    print(f"| steps without / with probe | {len(off)} / {len(on)} |")
    print(f"| median step, without probe | {med_off * 1e3:.3f} ms |")
    print(f"| median step, with probe | {med_on * 1e3:.3f} ms |")
    print(f"| mean step, without / with probe | {mean_off * 1e3:.3f} / {mean_on * 1e3:.3f} ms |")
    print(f"| overhead, mean step time (on/off - 1) | {mean_on / mean_off - 1:+.3%} |")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"| overhead, per off/on pair: median (IQR) over {len(ratios)} pairs | "
        f"{q[1]:+.3%} ({q[0]:+.3%} .. {q[2]:+.3%}) |"
    )
    share = cost_s / elapsed_s
    print(
        f"| overhead, probe's own cost / elapsed | {share:.4%} ({probes} probes, {cost_s * 1e3:.1f} ms "
        f"in {elapsed_s:.1f} s; {'within' if share <= args.budget else 'OVER'} the {args.budget:.3%} budget) |"
    )
    if confirmed is not None:
        print(f"| detection latency (fault installed -> confirmed) | {latency_s:.2f} s |")
        print(
            f"| detecting probe | {confirmed.probe} {confirmed.dtype} {'x'.join(map(str, confirmed.shape))} |"
        )
    else:
        print(f"| detection latency | not detected within {args.detect_timeout_s:.0f} s |")
    print(f"| verdict files spooled | {spooled} |")
    return 0 if confirmed is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
