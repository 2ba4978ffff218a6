"""Benchmark: time from a rank stopping to the ``training_progress`` verdict, the cost of
``Heartbeat.beat()`` per call, and the cost of one py-spy stack sample.

    .venv/bin/python bench/bench_hang.py [--every-s 2] [--hang-after-s 3] [--trials 3]

Latency model (the daemon runs the check every ``every_s`` E; a heartbeat is written at most
every ``min_interval_s`` m; stack sampling takes S, about (stack_samples - 1) *
stack_interval_s plus the py-spy calls):

    H - m  <=  verdict latency  <=  H + E + S

so the default periodic suite (H = 300, E = 15, S ~ 2.5 s) reports a hang within ~318 s; set
``hang_after_s`` to 40 for the issue's 60 s goal. The measured run starts a real worker that
beats every 50 ms, stops it at a random phase of the check's schedule, and calls the check
(in-process, as the daemon does) every E seconds until it reports ``training_hang``.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.checks import CheckContext  # noqa: E402
from node_agent.checks.training_progress import find_py_spy, run  # noqa: E402
from node_agent.heartbeat import Heartbeat  # noqa: E402

WORKER = """
import os, sys, time
from node_agent.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], rank=0, job="bench")
step = 0
while not os.path.exists(sys.argv[2]):
    hb.beat(step); step += 1; time.sleep(0.05)
while True:
    time.sleep(60)
"""


def beat_cost_us(n: int, min_interval_s: float) -> float:
    with tempfile.TemporaryDirectory() as d:
        hb = Heartbeat(d, min_interval_s=min_interval_s)
        t0 = time.perf_counter()
        for step in range(n):
            hb.beat(step)
        return (time.perf_counter() - t0) / n * 1e6


def ctx(state: Path, **params) -> CheckContext:
    return CheckContext(check="training_progress", gpu=None, kernel_log=None, config=None,
                        inventory=None, sku=None, expected_gpus=None, mode="service",
                        params=params, state_dir=state, timeout_s=60.0)


def one_trial(every_s: float, hang_after_s: float) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        state, stop = Path(d) / "state", Path(d) / "stop"
        script = Path(d) / "worker.py"
        script.write_text(WORKER)
        spool = state / "spool" / "heartbeat"
        worker = subprocess.Popen([sys.executable, str(script), str(spool), str(stop)])
        try:
            deadline = time.monotonic() + 30
            while not (spool / f"{worker.pid}.json").exists():
                if time.monotonic() > deadline:
                    raise SystemExit("worker wrote no heartbeat in 30 s")
                time.sleep(0.05)
            # the check's schedule runs from now; the rank stops at a random phase of it
            next_run = time.monotonic()
            stop_at = next_run + 0.5 + random.uniform(0, every_s)
            stopped = None
            while True:
                now = time.monotonic()
                if stopped is None and now >= stop_at:
                    stop.touch()
                    stopped = time.monotonic()
                if now >= next_run:
                    next_run += every_s
                    results = run(ctx(state, hang_after_s=hang_after_s))
                    hang = [r for r in results if r.metric == "training_hang"]
                    if hang:
                        assert stopped is not None, "hang reported before the rank stopped"
                        return time.monotonic() - stopped, hang[0].evidence["stack"]
                time.sleep(0.01)
        finally:
            worker.kill()
            worker.wait()


def py_spy_sample_cost() -> tuple[float, float] | None:
    """(wall s, CPU s) of one ``py-spy dump --json`` of a sleeping Python process."""
    py_spy = find_py_spy(ctx(Path(tempfile.gettempdir())))
    if py_spy is None:
        return None
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        walls, cpus = [], []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            done = subprocess.run([py_spy, "dump", "--pid", str(target.pid), "--json"],
                                  capture_output=True, timeout=30)
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode != 0:
                print(f"py-spy failed: {done.stderr.decode()[-300:]}")
                return None
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return statistics.median(walls), statistics.median(cpus)
    finally:
        target.kill()
        target.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every-s", type=float, default=2.0)
    ap.add_argument("--hang-after-s", type=float, default=3.0)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    print(f"beat() throttled (min_interval_s=1): {beat_cost_us(200_000, 1.0):.2f} us/call")
    print(f"beat() writing every call (min_interval_s=0): {beat_cost_us(2_000, 0.0):.1f} us/call")
    cost = py_spy_sample_cost()
    print("py-spy dump --json: " + (f"{cost[0] * 1e3:.0f} ms wall, {cost[1] * 1e3:.0f} ms CPU "
                                   "per sample (median of 5)" if cost else "unavailable"))
    latencies = []
    for i in range(args.trials):
        latency, stack = one_trial(args.every_s, args.hang_after_s)
        latencies.append(latency)
        print(f"trial {i + 1}: hang -> verdict {latency:.2f} s (stack available: "
              f"{stack.get('available')}, {stack.get('stuck_in') or stack.get('reason')})")
    print(f"every_s={args.every_s:g} hang_after_s={args.hang_after_s:g}: latency median "
          f"{statistics.median(latencies):.2f} s, max {max(latencies):.2f} s; model bound "
          f"H + E + S = {args.hang_after_s + args.every_s:g} s + sampling")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
