"""Benchmark: the store's ``runs`` table under issue 34's stale-process load.

    .venv/bin/python bench/bench_runs_table.py [--processes 200] [--days 1] [--every-s 15]

``--processes`` real processes each beat one hour-old heartbeat (``node_agent.heartbeat``) and
then exec ``sleep``: alive, stale, never stepping. The real ``training_progress`` check runs
once over them with the shipped periodic suite's params, and the shipped grader grades its
results; those reasons are what the daemon records (``Store.record_run``) at every grade
change. Under this load the grade changes at every run of the check (each reason quotes its
heartbeat's age), so the bench records that run every ``--every-s`` simulated seconds (the
periodic suite's cadence of ``training_progress``) for ``--days`` days, and prints the
database's size (main file plus WAL, after a checkpoint) and the table's rows at each day.

The same script runs against an older checkout (``PYTHONPATH`` set to it) to measure before a
change: it uses only ``open_store`` and ``record_run``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("PYTHONPATH") or str(ROOT))

import node_agent  # noqa: E402
from node_agent.checking.context import CheckContext  # noqa: E402
from node_agent.checks.training_progress import run  # noqa: E402
from node_agent.grading.rules import load_grader  # noqa: E402
from node_agent.remediation.store import DB_NAME, open_store  # noqa: E402
from node_agent.resources import shipped_graders_dir  # noqa: E402

DAY = 86400.0

# Forks ``n`` children, each of which beats one hour-old heartbeat, prints its pid and execs
# ``sleep`` (the pid and its start time stay: the heartbeat stays its own); the launcher exits.
STALE_SLEEPERS = """
import os, sys, time
from node_agent.heartbeat import Heartbeat
for _ in range(int(sys.argv[2])):
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)  # not the launcher's stdout: run() waits for EOF
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600).beat(5)
        os.write(w, b"%d\\n" % os.getpid())
        os.close(w)
        os.execv("/bin/sleep", ["sleep", "86400"])
    os.close(w)
    sys.stdout.write(os.read(r, 64).decode())
    os.close(r)
"""


def start_sleepers(n: int, spool: Path) -> list[int]:
    """``n`` stale ``sleep`` processes whose launcher has exited (the check leaves out its own
    children, as the daemon's would be none of its jobs)."""
    launcher = subprocess.run(
        [sys.executable, "-c", STALE_SLEEPERS, str(spool), str(n)],
        env={**os.environ, "PYTHONPATH": str(Path(node_agent.__file__).parents[1])},
        capture_output=True,
        text=True,
        check=True,
    )
    return [int(x) for x in launcher.stdout.split()]


def graded_reasons(spool: Path, state: Path) -> list[dict]:
    suite = yaml.safe_load((ROOT / "suites" / "periodic.yaml").read_text())
    params = next(c for c in suite["checks"] if c["check"] == "training_progress")["params"]
    ctx = CheckContext(
        check="training_progress",
        gpu=None,
        kernel_log=None,
        config=None,
        inventory=None,
        sku=None,
        expected_gpus=None,
        mode="service",
        params={**params, "spool_dir": str(spool)},
        state_dir=state,
        timeout_s=45.0,
    )
    results = run(ctx)
    # the graders beside the node_agent imported (an older checkout's, to measure before)
    graders = Path(node_agent.__file__).parents[1] / "graders"
    grade = load_grader(graders if graders.is_dir() else shipped_graders_dir()).grade(
        results, "service"
    )
    return [r.to_dict() for r in grade.reasons]


def db_size(state: Path) -> int:
    return sum(
        (state / (DB_NAME + s)).stat().st_size
        for s in ("", "-wal")
        if (state / (DB_NAME + s)).exists()
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--processes", type=int, default=200)
    ap.add_argument("--days", type=float, default=1)
    ap.add_argument("--every-s", type=float, default=15)
    args = ap.parse_args()
    logging.getLogger("node_agent").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp_name:
        tmp = Path(tmp_name)
        spool = tmp / "spool" / "heartbeat"
        spool.mkdir(parents=True)
        pids = start_sleepers(args.processes, spool)
        try:
            t0 = time.perf_counter()
            reasons = graded_reasons(spool, tmp / "check-state")
            check_s = time.perf_counter() - t0
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        per_run = len(repr(reasons))
        print(
            f"{platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}: "
            f"{args.processes} stale processes -> {len(reasons)} reasons "
            f"(~{per_run / 1024:.0f} KiB as text), check {check_s:.1f} s"
        )
        state = tmp / "state"
        now = 1_760_000_000.0
        store = open_store(state, clock=lambda: now)
        steps = int(DAY / args.every_s)
        t0 = time.perf_counter()
        for day in range(1, int(args.days + 0.999) + 1):
            for _ in range(steps):
                now += args.every_s
                store.record_run("bench", now, "daemon", "service", "WARN", reasons)
            store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            (rows,) = store._conn.execute("SELECT COUNT(*) FROM runs").fetchone()
            print(
                f"day {day}: {steps * day} runs recorded, {rows} rows kept, "
                f"database {db_size(state) / 2**20:.1f} MiB"
            )
        took = time.perf_counter() - t0
        store.close()
        print(f"{steps * int(args.days + 0.999)} record_run calls in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
