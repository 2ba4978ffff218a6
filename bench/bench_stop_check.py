"""Benchmark: a healthy N-node stop-check from start to stop-check.json, and where the time goes.

    .venv/bin/python bench/bench_stop_check.py [--nodes 6] [--gpus 8] [--replay] [--runs 3]

Starts N simulated nodes (healthy H100 scenarios, ``--gpus`` simulated GPUs each) as N local
processes, one rank each (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as a launcher sets them),
and reports per run: the wall time from the first start to ``stop-check.json`` on disk, each
phase's time as rank 0 measured it, and the time before the first phase (process start, torch
import, join, process group). Goal (issue 26): a healthy six-node job at most 90 s on a 2-core
machine.

Why the time does not grow with N on a real cluster: every phase is a constant number of
collective rounds (one gather per phase, a ring exchange with the two neighbours, one
min/max reduction per grid axis per replay round); only the gathers' payload grows, and it is
bytes (a 64-character hash per GPU, a few numbers per node). Here all N ranks share 2 cores, so
the wall time grows with N for a reason a cluster does not have: N Python processes start and
compute on the same two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from node_agent.peers import free_loopback_port

AGENT = str(Path(sys.executable).with_name("node-agent"))


def one_run(nodes: int, gpus: int, replay: bool, workdir: Path) -> dict:
    scen = workdir / "scenarios"
    scen.mkdir(parents=True, exist_ok=True)
    for rank in range(nodes):
        (scen / f"n{rank}.yaml").write_text(
            yaml.safe_dump(
                {"sku": "h100-sxm5-80gb", "gpus": gpus, "hostname": f"node{rank}", "faults": []}
            )
        )
    key = workdir / "job.key"
    if not key.exists():  # the job's key, as the launchers make it (every message is signed)
        key.write_text(secrets.token_hex(32) + "\n")
        key.chmod(0o600)
    config = workdir / "config.yaml"
    config.write_text(
        yaml.safe_dump({"state_dir": str(workdir / "state"), "kernel_log": {"path": os.devnull}})
    )
    out = workdir / f"out-{time.time_ns()}"
    port = free_loopback_port()
    args = [
        "stop-check",
        "--config",
        str(config),
        "--key-file",
        str(key),
        "--simulate",
        str(scen / "n{rank}.yaml"),
        "--out",
        str(out),
    ] + (["--replay", "--rounds", "4"] if replay else [])
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [AGENT, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(nodes),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(nodes)
    ]
    summary = out / "stop-check.json"
    while not summary.exists() and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    to_summary = time.perf_counter() - start
    for p in procs:
        p.communicate(timeout=300)
    total = time.perf_counter() - start
    if not summary.exists():
        raise SystemExit(f"no stop-check.json: {procs[0].stderr}")
    data = json.loads(summary.read_text())
    phases = {k: v["duration_s"] for k, v in data["phases"].items() if "skipped" not in v}
    return {
        "to_summary_s": to_summary,
        "all_exited_s": total,
        "phases_s": phases,
        "before_phases_s": to_summary - sum(phases.values()),
        "suspects": len(data["suspects"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stop-check-") as tmp:
        runs = [one_run(args.nodes, args.gpus, args.replay, Path(tmp)) for _ in range(args.runs)]
    print(
        f"# {args.nodes} nodes x {args.gpus} simulated GPUs, replay={args.replay}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    for i, r in enumerate(runs):
        phases = "  ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items())
        print(
            f"run {i}: to stop-check.json {r['to_summary_s']:.1f} s (before the phases "
            f"{r['before_phases_s']:.1f} s; {phases}); all ranks exited {r['all_exited_s']:.1f} s;"
            f" suspects {r['suspects']}"
        )
    print(f"median to stop-check.json: {statistics.median(r['to_summary_s'] for r in runs):.1f} s")
    return 0 if all(r["suspects"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
