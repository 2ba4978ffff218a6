"""Benchmark: the counter history's size on disk over simulated days (issue 28, "Done when").

    .venv/bin/python bench/bench_history.py [--days 30] [--gpus 8] [--every-s 300] [--json]

A simulated node of ``--gpus`` H100s runs the real ``nvml_health`` check once; its results name
the series the shipped ``graders/trends.yaml`` keeps for such a node (corrected ECC, SRAM,
remapped rows twice, PCIe replays: 5 a GPU; the nodes' HCA ports and EDAC add theirs where
present). The bench then feeds those results through the daemon's trend watch every
``--every-s`` simulated seconds for ``--days`` days, with every counter rising (so no point is
a repeat), and prints the database size (main file plus WAL, after a checkpoint) at each day.

The history keeps one raw point per 5-minute bucket, so readings more often than every 300 s
only rewrite the bucket's point: the size is the same at the daemon's 10-s cadence, only the
write count differs (``--every-s 10`` shows it, about 30x slower to run). ``bytes/GPU/day`` is
the growth over the run divided by GPUs and days; the steady state is the size at the end,
where the raw and hourly tiers are full and only the daily tier (one point a series a day,
capped at 366) still grows.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml

from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.grading.trends import load_trend_specs
from node_agent.model import Result
from node_agent.resources import shipped_graders_dir, suites_dir
from node_agent.runner import run_check
from node_agent.service.history import Bound, open_history
from node_agent.service.trend_watch import TrendWatch, trends_file
from node_agent.suite import load_suite

DAY = 86400.0


def node_results(gpus: int, tmp: Path) -> list[Result]:
    scenario = tmp / "node.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": gpus}))
    config = load_config(None)
    env = open_environment(config, str(scenario))
    try:
        spec = next(
            c for c in load_suite("periodic", suites_dir(config)).checks if c.check == "nvml_health"
        )
        return run_check(spec, env, "service")
    finally:
        env.close()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--days", type=float, default=30)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--every-s", type=float, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.getLogger("node_agent").setLevel(logging.ERROR)  # every series trends here
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp_name:
        tmp = Path(tmp_name)
        results = node_results(args.gpus, tmp)
        specs = load_trend_specs(trends_file(shipped_graders_dir(), shipped_graders_dir()))
        # a link's own series is kept from its first error only (graders/trends.yaml ``each``)
        series = [s for s in specs.samples(results) if not s.part or s.value > 0]
        now = [1_760_000_000.0]
        history = open_history(tmp / "state", lambda: now[0], Bound())
        watch = TrendWatch(specs, history, lambda: now[0])
        steps_per_day = int(DAY / args.every_s)
        sizes = [(0.0, history.size_bytes())]
        cpu0 = time.process_time()
        step = 0
        for day in range(1, int(args.days) + 1):
            for _ in range(steps_per_day):
                step += 1
                for r in results:  # every counter rises by one a reading: no repeats
                    if isinstance(r.value, (int, float)) and not isinstance(r.value, bool):
                        r.value = step
                    if "corrected_rows" in r.evidence:
                        r.evidence["corrected_rows"] = step
                watch.update(results, None)
                now[0] += args.every_s
            sizes.append((float(day), history.size_bytes()))
        cpu = time.process_time() - cpu0
        points = history.point_count()
        history.close()
    final = sizes[-1][1]
    growth = (final - sizes[0][1]) / args.gpus / args.days
    out = {
        "machine": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "gpus": args.gpus,
        "days": args.days,
        "every_s": args.every_s,
        "series": len(series),
        "series_per_gpu": len(series) / max(args.gpus, 1),
        "points": points,
        "max_points_per_series": Bound().max_points,
        "size_bytes_by_day": {f"{d:g}": s for d, s in sizes},
        "steady_state_bytes": final,
        "bytes_per_gpu_per_day": round(growth),
        "cpu_s_per_update": round(cpu / max(step, 1), 6),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{args.gpus} GPUs, {len(series)} series ({out['series_per_gpu']:g} a GPU), a reading "
        f"every {args.every_s:g} s for {args.days:g} simulated days"
    )
    for d, s in sizes:
        if d in (0, 1, 2, 3, 7, 14, 21) or d == sizes[-1][0]:
            print(f"  day {d:>4g}: {s / 1024:8.1f} KiB")
    print(
        f"steady state after {args.days:g} days: {final / 1024:.1f} KiB "
        f"({points} points; at most {Bound().max_points} a series)"
    )
    print(f"growth: {growth:.0f} bytes per GPU per day (averaged over the run)")
    print(f"cost: {out['cpu_s_per_update'] * 1000:.2f} ms of CPU per update (record + trends)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
