"""One rank of the all-reduce measurement: ``python -m node_agent.compute.allreduce --rank R ...``.

The ``nccl_allreduce`` check starts ``--world-size`` of these processes with
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``; each joins a ``torch.distributed``
process group (backend ``nccl`` on GPUs, ``gloo`` on CPU), sweeps the message sizes and prints
one JSON line on stdout (and to ``--out`` when given). Rank 0's line is the measurement.

For every size: ``--warmup`` untimed all-reduces, then ``--iters`` timed ones on a zero buffer
(sums stay 0, so no value overflows however many iterations run), then one correctness round in
which rank r contributes float32 ``r + 1`` everywhere. The exact sum ``n(n+1)/2`` is a small
integer, representable in float32, so any element that differs is wrong — not rounding.
:func:`measure` takes a ``spoil`` callable that alters the rank's contribution before it is
reduced: a test runs a rank in its own process with one, standing in for a rank that computes
or transfers bad data, and the spoiled elements must come back wrong on every rank.

Figures follow nccl-tests (PERFORMANCE.md): ``algbw = size_bytes / time``,
``busbw = algbw * 2(n-1)/n``, in GB/s (10^9 bytes/s), time per iteration in microseconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node_agent import atomic_file

SCHEMA = "node-agent.allreduce/1"
DTYPE_BYTES = 4  # float32
#: alters a rank's contribution (a float32 tensor) in place before the correctness round
Spoil = Callable[[Any], None]


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n (1.0 for n=2, 1.75 for n=8)."""
    return 2.0 * (world_size - 1) / world_size


def bandwidths(size_bytes: int, time_s: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 B/s) for one all-reduce of ``size_bytes`` taking ``time_s``.

    >>> bandwidths(1_000_000_000, 1.0, 8)
    (1.0, 1.75)
    """
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * bus_factor(world_size)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The rank's arguments (``argv`` as :func:`nccl_allreduce.worker_argv` writes them)."""
    ap = argparse.ArgumentParser(
        prog="python -m node_agent.compute.allreduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument(
        "--sizes", default="1048576", help="comma-separated message sizes in bytes (multiples of 4)"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="process-group timeout: how long to wait for peers",
    )
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace, spoil: Spoil | None = None) -> dict[str, Any]:
    """Join the group, sweep the sizes, leave the group; the JSON-ready measurement.
    ``spoil``: alters this rank's contribution to each correctness round (see the module
    docstring); None for a rank that contributes what it should."""
    import torch
    import torch.distributed as dist

    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA, and torch.cuda.is_available() is False")
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.init_process_group(
        args.backend,
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    rows = []
    try:
        n = args.world_size
        expected = n * (n + 1) / 2
        for size in (int(s) for s in str(args.sizes).split(",") if s.strip()):
            elements = max(1, size // DTYPE_BYTES)
            size_bytes = elements * DTYPE_BYTES
            buf = torch.zeros(elements, dtype=torch.float32, device=device)
            for _ in range(args.warmup):
                dist.all_reduce(buf)
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(buf)
            sync()
            elapsed = (time.perf_counter() - start) / max(1, args.iters)

            data = torch.full((elements,), float(args.rank + 1), dtype=torch.float32, device=device)
            if spoil is not None:
                spoil(data)
            dist.all_reduce(data)
            sync()
            wrong = int((data != expected).sum().item())
            algbw, busbw = bandwidths(size_bytes, elapsed, n)
            rows.append(
                {
                    "size_bytes": size_bytes,
                    "elements": elements,
                    "time_us": elapsed * 1e6,
                    "algbw_gbps": algbw,
                    "busbw_gbps": busbw,
                    "wrong": wrong,
                }
            )
    finally:
        dist.destroy_process_group()
    return {
        "schema": SCHEMA,
        "rank": args.rank,
        "world_size": args.world_size,
        "backend": args.backend,
        "device": str(device),
        "torch": torch.__version__,
        "iters": args.iters,
        "warmup": args.warmup,
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        doc = measure(args)
        code = 0
    except Exception as err:  # noqa: BLE001 - reported as JSON for the parent to read
        doc = {
            "schema": SCHEMA,
            "rank": args.rank,
            "world_size": args.world_size,
            "backend": args.backend,
            "error": f"{type(err).__name__}: {err}",
        }
        code = 1
    line = json.dumps(doc)
    if args.out:
        atomic_file.write_text(Path(args.out), line + "\n")
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
