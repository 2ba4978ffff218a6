"""Benchmark: hang -> verdict latency of ``training_progress``, and what watching costs the
training loop (``Heartbeat.beat()`` per call, one py-spy stack sample, the slowdown of a loop
that is being sampled).

    .venv/bin/python bench/bench_hang.py [--every-s 15] [--trials 3] [--loop-s 20]

Latency: a real worker beats every 50 ms and stops (sleeps, stays alive) at a random phase of
the check's schedule; the check runs in-process every ``every_s`` (as the daemon runs it) with
the shipped periodic-suite params until it reports ``training_hang``. Model, with stall time T
(``stall_after_s``, 30), period E and sampling time S ((stack_samples - 1) x stack_interval_s +
the py-spy calls, ~2 s): T - 1 s <= latency <= T + E + S, i.e. <= ~47 s with the defaults.

Slowdown: a CPU "training loop" (a 384x384 float32 matmul chain in torch on one thread, or a
pure-Python loop when torch is missing) runs in a child process for ``--loop-s`` seconds per
phase, alternating phases: not sampled; sampled as the daemon samples a *suspect* job
(``stack_samples`` 3, 1 s apart, every ``every_s``); and sampled continuously at 1 Hz (the worst
case). A healthy job is never stack-sampled: the only cost it pays is ``beat()``.
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
from node_agent.checks.training_progress import run  # noqa: E402
from node_agent.heartbeat import Heartbeat  # noqa: E402
from node_agent.stack_sampling import find_py_spy  # noqa: E402
from node_agent.suite import load_suite  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

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

#: prints its step count every 0.5 s on stdout; the parent computes steps/s per phase
LOOP = """
import sys, time
try:
    import torch
    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    def step():
        global a
        a = torch.tanh(a @ a * 0.01)
except ImportError:
    def step():
        sum(i * i for i in range(20000))
steps, t_end = 0, time.monotonic() + float(sys.argv[1])
next_print = time.monotonic() + 0.5
while time.monotonic() < t_end:
    step(); steps += 1
    if time.monotonic() >= next_print:
        print(time.monotonic(), steps, flush=True); next_print += 0.5
"""


def periodic_params() -> dict:
    suite = load_suite("periodic", ROOT / "suites")
    return dict(next(c for c in suite.checks if c.check == "training_progress").params)


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
                        params=params, state_dir=state, timeout_s=45.0)


def one_trial(every_s: float, params: dict) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        state, stop = Path(d) / "state", Path(d) / "stop"
        script = Path(d) / "worker.py"
        script.write_text(WORKER)
        spool = state / "spool" / "heartbeat"
        worker = subprocess.Popen([sys.executable, str(script), str(spool), str(stop)],
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 30
            while not (spool / f"{worker.pid}.json").exists():
                if time.monotonic() > deadline:
                    raise SystemExit("worker wrote no heartbeat in 30 s")
                time.sleep(0.05)
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
                    results = run(ctx(state, **params))
                    hang = [r for r in results if r.metric == "training_hang"]
                    if hang:
                        assert stopped is not None, "hang reported before the rank stopped"
                        return time.monotonic() - stopped, hang[0].evidence
                time.sleep(0.01)
        finally:
            worker.kill()
            worker.wait()


def py_spy_sample_cost(py_spy: str) -> tuple[float, float]:
    """(wall s, CPU s) of one ``py-spy dump --json`` of a sleeping Python process."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        walls, cpus = [], []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run([py_spy, "dump", "--pid", str(target.pid), "--json"],
                           capture_output=True, timeout=30, check=True)
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return statistics.median(walls), statistics.median(cpus)
    finally:
        target.kill()
        target.wait()


def loop_rate(py_spy: str, seconds: float, schedule: list[float]) -> float:
    """Steps/s of the loop while ``py-spy dump`` runs at the offsets in ``schedule`` (s)."""
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    pending = sorted(schedule)
    try:
        while pending and time.monotonic() - t0 < seconds:
            wait = pending[0] - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(min(wait, 0.05))
                continue
            pending.pop(0)
            subprocess.run([py_spy, "dump", "--pid", str(loop.pid), "--json"],
                           capture_output=True, timeout=30)
        out, _ = loop.communicate(timeout=seconds + 60)
    finally:
        loop.kill()
    points = [tuple(map(float, line.split())) for line in out.splitlines() if line.strip()]
    # skip the first second (imports, warm-up): rate over the rest of the phase
    start = next(p for p in points if p[0] - points[0][0] >= 1.0)
    end = points[-1]
    return (end[1] - start[1]) / (end[0] - start[0])


def slowdown(py_spy: str, loop_s: float, every_s: float, rounds: int) -> dict[str, list[float]]:
    suspect = [t + k for t in _range(1.0, loop_s, every_s) for k in (0.0, 1.0, 2.0)]
    continuous = list(_range(1.0, loop_s, 1.0))
    phases = {"not sampled": [], f"3 samples every {every_s:g} s": suspect,
              "1 sample per second": continuous}
    rates: dict[str, list[float]] = {name: [] for name in phases}
    for _ in range(rounds):
        for name, schedule in phases.items():
            rates[name].append(loop_rate(py_spy, loop_s, schedule))
    return rates


def _range(start: float, stop: float, step: float):
    t = start
    while t < stop:
        yield t
        t += step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every-s", type=float, default=15.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--loop-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"beat() throttled (min_interval_s=1): {beat_cost_us(200_000, 1.0):.2f} us/call")
    print(f"beat() writing every call (min_interval_s=0): {beat_cost_us(2_000, 0.0):.1f} us/call")
    py_spy = find_py_spy()
    if py_spy is None:
        print("py-spy: not installed; stack-sampling costs not measured")
    else:
        wall, cpu = py_spy_sample_cost(py_spy)
        print(f"py-spy dump --json: {wall * 1e3:.0f} ms wall, {cpu * 1e3:.0f} ms CPU per sample "
              "(median of 5)")
        rates = slowdown(py_spy, args.loop_s, args.every_s, args.rounds)
        base = statistics.median(rates["not sampled"])
        for name, values in rates.items():
            med = statistics.median(values)
            print(f"loop {name}: {med:.1f} steps/s (runs {', '.join(f'{v:.1f}' for v in values)})"
                  f"; slowdown {100 * (1 - med / base):+.2f} %")
    params = periodic_params()
    latencies = []
    for i in range(args.trials):
        latency, evidence = one_trial(args.every_s, params)
        latencies.append(latency)
        stack = evidence["signals"]["stack"]
        print(f"trial {i + 1}: hang -> verdict {latency:.2f} s (agreeing: "
              f"{', '.join(evidence['agreeing'])}; stack: {stack.get('stuck_in') or stack['detail']})")
    print(f"every_s={args.every_s:g}, periodic params {params}: latency median "
          f"{statistics.median(latencies):.2f} s, max {max(latencies):.2f} s")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
