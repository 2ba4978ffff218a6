"""Benchmark `node-agent fleet` over many synthetic node reports (goal: 10,000 reports of 8 GPUs
in <= 5 s and <= 1 GB on the 2-core CI machine).

Generates ``--nodes`` delivery reports (JSON, written by the agent's own writer) into a temp
directory — three of them with one GPU at 0.88x throughput — then runs the real command
``node-agent fleet DIR --json`` as a subprocess ``--repeat`` times and reports wall time, the
peak RSS of the whole process tree (main process plus its reader pool, polled with psutil every
20 ms) and the largest single process (getrusage), and checks the suspects are the planted ones.

    .venv/bin/python bench/bench_fleet.py --nodes 10000 --trace-points 60
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from node_agent.report import json_report

# The synthetic reports are test material, kept in tests/ so that they never ship in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from synthetic_reports import synthetic_report  # noqa: E402

SLOW = {17: 2, 4242: 5, 9001: 7}  # node index -> GPU at 0.88x


def generate(directory: Path, nodes: int, trace_points: int) -> int:
    total = 0
    for i in range(nodes):
        slow = {SLOW[i]: 0.88} if i in SLOW else None
        report = synthetic_report(
            f"node{i:05d}", seed=i, gpu_factors=slow, trace_points=trace_points
        )
        total += json_report.write(report, directory).stat().st_size
    return total


def run_once(directory: Path) -> tuple[float, int, int, dict]:
    argv = [
        sys.executable,
        "-c",
        "import sys; from node_agent.commands.main import main; sys.exit(main())",
        "fleet",
        str(directory),
        "--json",
    ]
    out = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE)
    peak_tree = 0
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [parent, *parent.children(recursive=True)]
            peak_tree = max(peak_tree, sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read().decode()
    if proc.returncode not in (0, 3):
        raise SystemExit(f"fleet failed with {proc.returncode}: {stderr}")
    out.seek(0)
    data = json.loads(out.read())
    biggest_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, peak_tree, biggest_kb * 1024, data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument(
        "--trace-points",
        type=int,
        default=60,
        help="load_trace samples per GPU (60: a one-minute burn at 1 Hz)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", help="reuse/keep reports here instead of a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        directory = Path(args.dir or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        existing = len(list(directory.glob("*.json")))
        if existing != args.nodes:
            t = time.perf_counter()
            size = generate(directory, args.nodes, args.trace_points)
            print(
                f"generated {args.nodes} reports ({size / 1e6:.0f} MB) in "
                f"{time.perf_counter() - t:.1f} s",
                file=sys.stderr,
            )
        size = sum(p.stat().st_size for p in directory.glob("*.json"))
        walls, trees = [], []
        for _ in range(args.repeat):
            wall, tree, biggest, data = run_once(directory)
            walls.append(wall)
            trees.append(tree)
        planted = {(f"node{i:05d}", f"gpu:{g}") for i, g in SLOW.items() if i < args.nodes}
        found = {(s["node"], s["target"]) for s in data["suspects"]}
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(
            json.dumps(
                {
                    "command": "node-agent fleet DIR --json",
                    "reports": args.nodes,
                    "gpus_per_report": 8,
                    "trace_points": args.trace_points,
                    "bytes_on_disk": size,
                    "cpus": len(os.sched_getaffinity(0)),
                    "wall_s": [round(w, 2) for w in walls],
                    "wall_s_median": round(statistics.median(walls), 2),
                    "peak_rss_tree_mb": round(max(trees) / 2**20),
                    "peak_rss_largest_process_mb": round(biggest / 2**20),
                    "suspects": len(data["suspects"]),
                    "planted_found": sorted(planted & found),
                    "unexpected": sorted(found - planted),
                    "loadavg_after": load,
                },
                indent=2,
            )
        )
        return 0 if found == planted else 1


if __name__ == "__main__":
    sys.exit(main())
