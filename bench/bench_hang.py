"""Benchmark: hang -> verdict latency of ``training_progress``, and what watching costs the
training loop (``Heartbeat.beat()`` per call, one py-spy stack sample, the slowdown of a loop
that is being sampled).

    .venv/bin/python bench/bench_hang.py [--every-s 15] [--trials 3] [--loop-s 20]
    .venv/bin/python bench/bench_hang.py --vfork 80     # the issue 29 attack, timed

``--vfork N`` (needs ``cc``): N processes blocked in ``vfork()`` with hour-old heartbeats. It
times one ``py-spy dump --nonblocking`` of such a process and one that stops it (which waits
until killed), then one run of the check with the periodic suite's params and timeout
(45 s): its wall time, how many stacks it sampled and what it reported.

Latency: a real worker beats every 50 ms and stops (sleeps, stays alive) at a random phase of
the check's schedule; the check runs in-process every ``every_s`` (as the daemon runs it) with
the shipped periodic-suite params until it reports ``training_hang``. Model, with stall time T
(``stall_after_s``, 30), period E and sampling time S ((stack_samples - 1) x stack_interval_s +
the py-spy calls, ~2 s): T - 1 s <= latency <= T + E + S, i.e. <= ~47 s with the defaults.

Slowdown: a CPU "training loop" (a 384x384 float32 matmul chain in torch on one thread, or a
pure-Python loop when torch is missing) times every step for ``--loop-s`` seconds while it is
dumped once a second; the time each dump costs the loop is the excess of the steps that overlap
it (see ``sampling_pause_s``). The slowdown of a job the daemon samples is that loss x 3 dumps
per ``every_s``. A healthy job is never stack-sampled: the only cost it pays is ``beat()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.checking.context import CheckContext  # noqa: E402
from node_agent.checks.training_progress import run  # noqa: E402
from node_agent.heartbeat import Heartbeat  # noqa: E402
from node_agent.suite import load_suite  # noqa: E402
from node_agent.training.stacks import find_py_spy  # noqa: E402

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

#: runs for argv[1] seconds, then writes every step's (start, duration) in monotonic seconds to
#: the file argv[2] (not stdout: the parent reads only after the loop ends)
LOOP = """
import json, sys, time
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
steps, t_end = [], time.monotonic() + float(sys.argv[1])
while True:
    t0 = time.monotonic()
    if t0 >= t_end:
        break
    step()
    steps.append((t0, time.monotonic() - t0))
with open(sys.argv[2], "w") as f:
    json.dump(steps, f)
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
    return CheckContext(
        check="training_progress",
        gpu=None,
        kernel_log=None,
        config=None,
        inventory=None,
        sku=None,
        expected_gpus=None,
        mode="service",
        params=params,
        state_dir=state,
        timeout_s=45.0,
    )


def one_trial(every_s: float, params: dict) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        state, stop = Path(d) / "state", Path(d) / "stop"
        script = Path(d) / "worker.py"
        script.write_text(WORKER)
        spool = state / "spool" / "heartbeat"
        # started through a launcher that exits at once: the check leaves out the agent's own
        # descendants (its GPU workers), and a training process is never one of them
        launcher = subprocess.run(
            [
                sys.executable,
                "-c",
                "import subprocess as s, sys; print(s.Popen(sys.argv[1:], "
                "stdout=s.DEVNULL, stderr=s.DEVNULL).pid)",
                sys.executable,
                str(script),
                str(spool),
                str(stop),
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        )
        worker_pid = int(launcher.stdout)
        try:
            deadline = time.monotonic() + 30
            while not (spool / f"{worker_pid}.json").exists():
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
                    # the worker's spool, named: with config=None the check has no default
                    results = run(ctx(state, **{**params, "spool_dir": str(spool)}))
                    hang = [r for r in results if r.metric == "training_hang"]
                    if hang:
                        assert stopped is not None, "hang reported before the rank stopped"
                        return time.monotonic() - stopped, hang[0].evidence
                time.sleep(0.01)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)


def py_spy_sample_cost(py_spy: str, *extra: str) -> tuple[float, float]:
    """(wall s, CPU s) of one ``py-spy dump --json`` of a sleeping Python process."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        walls, cpus = [], []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(
                [py_spy, "dump", "--pid", str(target.pid), "--json", *extra],
                capture_output=True,
                timeout=30,
                check=True,
            )
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return statistics.median(walls), statistics.median(cpus)
    finally:
        target.kill()
        target.wait()


def sampling_pause_s(py_spy: str, seconds: float, every_s: float) -> list[float]:
    """The time a training loop loses to each ``py-spy dump`` of it, in seconds.

    The loop times every step; a dump stops the process while it reads its stack, so the step
    that spans a dump takes longer than the loop's median step. The loss of one dump is the
    excess of the steps overlapping it. Measuring the loss per dump directly is far less noisy
    than comparing throughput with and without sampling on a shared machine."""
    record = Path(tempfile.mkdtemp()) / "steps.json"
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(seconds), str(record)])
    windows = []
    try:
        time.sleep(2.0)  # imports and warm-up
        while True:
            t0 = time.monotonic()
            done = subprocess.run(
                [py_spy, "dump", "--pid", str(loop.pid), "--json"], capture_output=True, timeout=30
            )
            if done.returncode != 0 or loop.poll() is not None:
                break  # the loop finished
            windows.append((t0, time.monotonic()))
            time.sleep(every_s)
        loop.wait(timeout=seconds + 60)
    finally:
        loop.kill()
    steps = json.loads(record.read_text())
    median = statistics.median(d for _, d in steps)
    losses = []
    for a, b in windows:
        over = [d - median for t, d in steps if t < b and t + d > a]
        losses.append(max(0.0, sum(over)))
    return losses


VFORK_C = r"""
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
int block_in_vfork(unsigned seconds) {
    pid_t parent = getpid();
    pid_t child = vfork();
    if (child == 0) { while (seconds-- > 0 && getppid() == parent) sleep(1); _exit(0); }
    if (child < 0) return -1;
    int status; waitpid(child, &status, 0); return 0;
}
"""

VFORK_WORKER = """
import ctypes, sys, time
from node_agent.heartbeat import Heartbeat
Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600).beat(5)
print("ready", flush=True)
ctypes.CDLL(sys.argv[2]).block_in_vfork(600)
"""


def vfork_attack(n: int, py_spy: str | None) -> None:
    """Issue 29's attack: ``n`` processes blocked in vfork() with stale heartbeats."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("vfork attack: skipped (no C compiler)")
        return
    with tempfile.TemporaryDirectory() as d:
        lib, spool = Path(d) / "libvfork.so", Path(d) / "spool" / "heartbeat"
        (Path(d) / "vfork.c").write_text(VFORK_C)
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(Path(d) / "vfork.c")], check=True
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # started through a launcher that exits at once (the check leaves out its own children)
        launcher = subprocess.run(
            [
                sys.executable,
                "-c",
                "import subprocess as s, sys\nfor _ in range(int(sys.argv[1])):"
                "\n    p = s.Popen(sys.argv[2:], stdout=s.PIPE, stderr=s.DEVNULL); p.stdout.readline()"
                "; print(p.pid)",
                str(n),
                sys.executable,
                "-c",
                VFORK_WORKER,
                str(spool),
                str(lib),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        pids = [int(x) for x in launcher.stdout.split()]
        try:
            time.sleep(1.0)
            if py_spy:
                t0 = time.perf_counter()
                subprocess.run(
                    [py_spy, "dump", "--nonblocking", "--json", "--pid", str(pids[0])],
                    capture_output=True,
                    timeout=30,
                )
                print(
                    f"py-spy dump --nonblocking of a vfork-blocked process: "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
                )
                t0 = time.perf_counter()
                try:
                    subprocess.run(
                        [py_spy, "dump", "--json", "--pid", str(pids[0])],
                        capture_output=True,
                        timeout=10,
                    )
                    print(f"py-spy dump (stopping) of it: {time.perf_counter() - t0:.1f} s")
                except subprocess.TimeoutExpired:
                    print("py-spy dump (stopping) of it: still waiting after 10 s, killed")
            params = {**periodic_params(), "spool_dir": str(spool)}
            t0 = time.perf_counter()
            results = run(ctx(Path(d) / "state", **params))
            took = time.perf_counter() - t0
            hangs = [r for r in results if r.metric == "training_hang"]
            sampled = sum(r.evidence["signals"]["stack"].get("available", False) for r in hangs)
            statuses = sorted({f"{r.metric}:{r.status.value}" for r in results})
            print(
                f"check against {n} vfork-blocked processes: {took:.1f} s of its 45 s timeout; "
                f"{len(hangs)} hangs, {sampled} stacks sampled; results {statuses}"
            )
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every-s", type=float, default=15.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--loop-s", type=float, default=40.0)
    ap.add_argument("--skip-loop", action="store_true", help="latency trials only")
    ap.add_argument(
        "--vfork",
        type=int,
        metavar="N",
        help="only the issue 29 attack: N processes blocked in vfork()",
    )
    args = ap.parse_args()
    if args.vfork:
        vfork_attack(args.vfork, find_py_spy())
        return
    print(f"beat() throttled (min_interval_s=1): {beat_cost_us(200_000, 1.0):.2f} us/call")
    print(f"beat() writing every call (min_interval_s=0): {beat_cost_us(2_000, 0.0):.1f} us/call")
    py_spy = find_py_spy()
    if py_spy is None or args.skip_loop:
        print("stack-sampling costs: " + ("skipped" if py_spy else "py-spy not installed"))
    else:
        wall, cpu = py_spy_sample_cost(py_spy)
        print(
            f"py-spy dump --json: {wall * 1e3:.0f} ms wall, {cpu * 1e3:.0f} ms CPU per sample "
            "(median of 5)"
        )
        wall, cpu = py_spy_sample_cost(py_spy, "--nonblocking")
        print(
            f"py-spy dump --json --nonblocking (what the check takes): {wall * 1e3:.0f} ms "
            f"wall, {cpu * 1e3:.0f} ms CPU per sample (median of 5)"
        )
        losses = sampling_pause_s(py_spy, args.loop_s, 1.0)
        loss = statistics.median(losses)
        suspect = 3 * loss / args.every_s
        print(
            f"loop time lost per py-spy dump: median {loss * 1e3:.1f} ms, p90 "
            f"{sorted(losses)[int(0.9 * (len(losses) - 1))] * 1e3:.1f} ms over {len(losses)} "
            f"dumps -> slowdown {100 * suspect:.3f} % while a job is suspect (3 dumps every "
            f"{args.every_s:g} s), {100 * loss:.2f} % at 1 dump/s; 0 for a healthy job "
            "(never sampled)"
        )
    params = periodic_params()
    latencies = []
    for i in range(args.trials):
        latency, evidence = one_trial(args.every_s, params)
        latencies.append(latency)
        stack = evidence["signals"]["stack"]
        print(
            f"trial {i + 1}: hang -> verdict {latency:.2f} s (agreeing: "
            f"{', '.join(evidence['agreeing'])}; stack: {stack.get('stuck_in') or stack['detail']})"
        )
    print(
        f"every_s={args.every_s:g}, periodic params {params}: latency median "
        f"{statistics.median(latencies):.2f} s, max {max(latencies):.2f} s"
    )
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
