"""Benchmark: the all-reduce sweep the ``nccl_allreduce`` check runs, printed as a table.

    .venv/bin/python bench/bench_allreduce.py [--ranks 2] [--backend gloo] \
        [--sizes 1024,65536,1048576,16777216] [--iters 20] [--warmup 5]

Columns follow nccl-tests' all_reduce_perf (out-of-place): size (B), time (us), algbw and
busbw (GB/s = 1e9 B/s, busbw = algbw * 2(n-1)/n) and #wrong. On a GPU node pass
``--backend nccl --ranks <GPUs>`` and compare with ``all_reduce_perf -b 1K -e 16M -f 2 -g N``.
"""

from __future__ import annotations

import argparse
import sys

from node_agent.checks.nccl_allreduce import run_ranks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--sizes", default="1024,65536,1048576,16777216")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=300)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = run_ranks(args.ranks, args.backend, sizes, args.iters, args.warmup, args.timeout_s)
    doc = runs[0].doc
    if not doc or "error" in doc or not all(r.proc.ok for r in runs):
        for r in runs:
            print(f"rank {r.rank}: {r.proc.describe_failure()}\n{r.proc.stderr[-800:]}")
        return 1
    print(f"# backend {doc['backend']}  ranks {doc['world_size']}  iters {doc['iters']}  "
          f"warmup {doc['warmup']}  torch {doc['torch']}")
    print(f"# {'size(B)':>12} {'time(us)':>10} {'algbw':>9} {'busbw':>9} {'#wrong':>7}")
    for row in doc["results"]:
        print(f"  {row['size_bytes']:12d} {row['time_us']:10.1f} {row['algbw_gbps']:9.3f} "
              f"{row['busbw_gbps']:9.3f} {row['wrong']:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
