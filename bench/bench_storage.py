"""Benchmark: the storage check's figures against a direct fio run of the same jobs.

    .venv/bin/python bench/bench_storage.py [PATH] [--size 64M] [--runtime-s 3]

Runs the ``storage`` check on PATH (default: a temporary directory), then fio itself with the
identical command line, and prints both with their ratio. The check should agree with fio within
0.9-1.1 (run-to-run noise of a shared disk; buffered reads on tmpfs vary more). Needs fio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from node_agent.checking.context import CheckContext
from node_agent.checks import storage
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.parsers.fio import parse_fio_json


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("path", nargs="?")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--runtime-s", type=float, default=3)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="alternate check and fio this many times; medians are compared",
    )
    args = ap.parse_args()
    mine: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        code = _once(args, mine, theirs)
        if code:
            return code
    print(f"{'metric':16} {'check':>12} {'fio':>12} {'ratio':>7}   (medians of {args.repeat})")
    for metric in theirs:
        a, b = statistics.median(mine[metric]), statistics.median(theirs[metric])
        print(f"{metric:16} {a:12.1f} {b:12.1f} {a / b:7.3f}")
    return 0


def _once(
    args: argparse.Namespace, mine: dict[str, list[float]], theirs: dict[str, list[float]]
) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
        path = Path(args.path or tmp)
        params = {"size": args.size, "runtime_s": args.runtime_s}
        ctx = CheckContext(
            check="storage",
            gpu=AbsentGpuBackend("bench"),
            kernel_log=None,
            config=config_from_dict({"storage": {"paths": [str(path)]}}),
            inventory=None,
            sku=None,
            expected_gpus=None,
            params=params,
        )
        results = {r.metric: r for r in storage.run(ctx)}
        if any(r.status.value == "error" for r in results.values()):
            print(json.dumps([r.to_dict() for r in results.values()], indent=1))
            return 1
        argv = next(iter(results.values())).evidence["argv"]
        direct = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
        Path(next(a for a in argv if a.startswith("--filename="))[11:]).unlink(missing_ok=True)
        fio_values = storage.figures(parse_fio_json(direct.stdout))
    print(
        f"path {path}  (direct I/O: {results['read_bw_mbps'].evidence['direct']})  "
        + "  ".join(f"{m}: check {results[m].value:.1f} fio {v:.1f}" for m, v in fio_values.items())
    )
    for metric, value in fio_values.items():
        mine.setdefault(metric, []).append(results[metric].value)
        theirs.setdefault(metric, []).append(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
