"""Benchmark: the all-reduce sweep the ``nccl_allreduce`` check runs, printed as a table.

    .venv/bin/python bench/bench_allreduce.py [--ranks 2] [--backend gloo] \
        [--sizes 1024,65536,1048576,16777216] [--iters 20] [--warmup 5]

Columns follow nccl-tests' all_reduce_perf (out-of-place): size (B), time (us), algbw and
busbw (GB/s = 1e9 B/s, busbw = algbw * 2(n-1)/n) and #wrong. On a GPU node pass
``--backend nccl --ranks <GPUs>`` and compare with ``all_reduce_perf -b 1K -e 16M -f 2 -g N``.

``--compare [--rounds 5]``: the check's busbw against a plain ``torch.distributed.all_reduce``
loop (this file's ``--plain-rank`` workers: join the group, warm up, barrier, time ``iters``
all-reduces, nothing else) with the same backend, ranks, sizes and iterations, in one run.
The two alternate round by round (check, plain, check, plain, ...) so a neighbour's load on a
shared machine falls on both; the ratio per size is median(check busbw) / median(plain busbw).
Goal (issue 5): >= 0.95, the check does not under-report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from node_agent import proc
from node_agent.checks.nccl_allreduce import free_port, run_ranks
from node_agent.compute.allreduce import bandwidths


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--sizes", default="1024,65536,1048576,16777216")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument(
        "--compare",
        action="store_true",
        help="check vs a plain torch.distributed loop, alternating rounds",
    )
    ap.add_argument("--rounds", type=int, default=5, help="--compare: rounds of each")
    ap.add_argument("--plain-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.plain_rank is not None:
        return plain_worker(
            args.plain_rank,
            args.ranks,
            args.backend,
            sizes,
            args.iters,
            args.warmup,
            args.timeout_s,
        )
    if args.compare:
        return compare(args, sizes)
    runs = run_ranks(args.ranks, args.backend, sizes, args.iters, args.warmup, args.timeout_s)
    doc = runs[0].doc
    if not doc or "error" in doc or not all(r.proc.ok for r in runs):
        for r in runs:
            print(f"rank {r.rank}: {r.proc.describe_failure()}\n{r.proc.stderr[-800:]}")
        return 1
    print(
        f"# backend {doc['backend']}  ranks {doc['world_size']}  iters {doc['iters']}  "
        f"warmup {doc['warmup']}  torch {doc['torch']}"
    )
    print(f"# {'size(B)':>12} {'time(us)':>10} {'algbw':>9} {'busbw':>9} {'#wrong':>7}")
    for row in doc["results"]:
        print(
            f"  {row['size_bytes']:12d} {row['time_us']:10.1f} {row['algbw_gbps']:9.3f} "
            f"{row['busbw_gbps']:9.3f} {row['wrong']:7d}"
        )
    return 0


def plain_worker(
    rank: int, world: int, backend: str, sizes: list[int], iters: int, warmup: int, timeout_s: float
) -> int:
    """A plain all-reduce loop; prints one JSON line {size_bytes: busbw_gbps}."""
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    out = {}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) / iters
        out[str(buf.numel() * 4)] = bandwidths(buf.numel() * 4, elapsed, world)[1]
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


def _plain_round(args: argparse.Namespace, sizes: list[int]) -> dict[int, float]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--ranks",
        str(args.ranks),
        "--backend",
        args.backend,
        "--sizes",
        ",".join(map(str, sizes)),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--timeout-s",
        f"{args.timeout_s:g}",
    ]
    runs: dict[int, proc.ProcResult] = {}

    def one(rank: int) -> None:
        runs[rank] = proc.run([*argv, "--plain-rank", str(rank)], args.timeout_s, env=env)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(r.ok for r in runs.values()):
        raise RuntimeError("; ".join(r.describe_failure() for r in runs.values() if not r.ok))
    return {int(k): v for k, v in json.loads(runs[0].stdout.strip().splitlines()[-1]).items()}


def _check_round(args: argparse.Namespace, sizes: list[int]) -> dict[int, float]:
    runs = run_ranks(args.ranks, args.backend, sizes, args.iters, args.warmup, args.timeout_s)
    doc = runs[0].doc
    if not doc or "error" in doc or not all(r.proc.ok for r in runs):
        raise RuntimeError("; ".join(r.proc.describe_failure() for r in runs))
    return {row["size_bytes"]: row["busbw_gbps"] for row in doc["results"]}


def compare(args: argparse.Namespace, sizes: list[int]) -> int:
    check: dict[int, list[float]] = {}
    plain: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        for into, measure in ((check, _check_round), (plain, _plain_round)):
            for size, busbw in measure(args, sizes).items():
                into.setdefault(size, []).append(busbw)
    print(
        f"# backend {args.backend}  ranks {args.ranks}  iters {args.iters}  warmup "
        f"{args.warmup}  rounds {args.rounds} (alternating)  busbw GB/s, medians"
    )
    print(f"# {'size(B)':>12} {'check':>9} {'plain':>9} {'ratio':>7}   check range / plain range")
    worst = None
    for size in sorted(check):
        c, p = statistics.median(check[size]), statistics.median(plain[size])
        ratio = c / p
        worst = ratio if worst is None else min(worst, ratio)
        print(
            f"  {size:12d} {c:9.4f} {p:9.4f} {ratio:7.3f}   "
            f"{min(check[size]):.4f}-{max(check[size]):.4f} / "
            f"{min(plain[size]):.4f}-{max(plain[size]):.4f}"
        )
    print(f"# worst ratio {worst:.3f} (goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
