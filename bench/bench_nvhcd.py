"""Benchmark: NVRx's health-check answer while other callers stall the service.

    .venv/bin/python bench/bench_nvhcd.py [--stalled 16] [--calls 200] [--as-user nobody]

Serves a FAULT node's view on a Unix socket (the daemon's ``NvhcdServer``: the gate and gRPC),
opens ``--stalled`` calls that send their headers and never their message (each on its own
connection; run as ``--as-user`` when this runs as root, so they are another uid's, as an
attacker's would be), then times ``--calls`` calls made as NVRx makes them (a new channel per
call, its request, ``RunHealthCheck``). Prints p50/p99/max in milliseconds with and without
the stalled calls. Goal (issue 34): every answer well under a second; NVRx's own timeout is
60 s and it calls a timeout healthy.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def timed_calls(sock: Path, n: int) -> list[float]:
    from nvrx_client import NodeHealthCheck

    took = []
    for _ in range(n):
        client = NodeHealthCheck(str(sock), request_timeout_sec=5.0)
        t0 = time.perf_counter()
        healthy = client()
        took.append((time.perf_counter() - t0) * 1000)
        if client.skipped is not None or healthy:
            raise SystemExit(f"a call failed open: {client.skipped or 'healthy'}")
    return took


def summary(name: str, took: list[float]) -> str:
    q = statistics.quantiles(took, n=100)
    return f"{name:<28} p50 {q[49]:7.2f} ms  p99 {q[98]:7.2f} ms  max {max(took):7.2f} ms"


def stall(sock: Path, n: int, user: str | None) -> subprocess.Popen:
    prefix: list[str] = []
    if user and os.geteuid() == 0 and shutil.which("setpriv"):
        entry = pwd.getpwnam(user)
        prefix = [
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--clear-groups",
        ]
    from nvrx_client import STALL

    child = subprocess.Popen(
        [*prefix, sys.executable, "-c", STALL, str(sock), str(n)],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )
    if child.stdout is None or child.stdout.readline().strip() != "ready":
        raise SystemExit("the stalling process did not start")
    return child


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stalled", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--as-user", default="nobody", help="the stalling calls' user (when root)")
    args = ap.parse_args()

    from node_agent.service.node_state import NodeView, ViewReason
    from node_agent.service.nvhcd import HealthAnswerer, NvhcdServer

    view = NodeView(
        "FAULT", (ViewReason("xid", "FAULT", "gpu:5", "Xid 79"),), graded_at=time.time()
    )
    base = Path(tempfile.mkdtemp(prefix="bench-nvhcd-"))
    base.chmod(0o755)
    sock = base / "run" / "nvhcd.sock"
    server = NvhcdServer(HealthAnswerer(lambda: view), sock)
    server.start()
    try:
        timed_calls(sock, 10)  # warm up
        print(summary("no stalled calls", timed_calls(sock, args.calls)))
        child = stall(sock, args.stalled, args.as_user)
        try:
            time.sleep(0.5)
            who = args.as_user if os.geteuid() == 0 else "this uid"
            took = timed_calls(sock, args.calls)
            print(summary(f"{args.stalled} stalled ({who})", took))
        finally:
            child.kill()
            child.wait()
        print(f"calls the gate closed to make room: {server.evicted}")
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
