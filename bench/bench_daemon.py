"""Benchmark: the daemon's own footprint and its XID detection latency.

    .venv/bin/python bench/bench_daemon.py [--minutes 10] [--scenario scenarios/healthy-h100.yaml]

Starts two ``node-agent daemon`` processes against the same simulated 8-GPU node: one with the
shipped periodic suite at its default cadence, one idle (a suite whose only check runs once an
hour). Samples each one's resident memory and CPU time (its own, not its children's: the SDC
probe and other compute checks run in child processes, which the goal excludes) every 5 s for
``--minutes``. Then measures XID detection latency on the default daemon: the scenario file
gains an XID, and the time until ``/metrics`` shows it is taken from a 10 ms poll, 5 times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from node_agent.peers import free_loopback_port


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def start(tmp: Path, name: str, scenario: Path, suite: str | None) -> tuple[subprocess.Popen, int]:
    port = free_loopback_port()
    config = tmp / f"config-{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {"state_dir": str(tmp / f"state-{name}"), "daemon": {"listen": f"127.0.0.1:{port}"}}
        )
    )
    argv = [
        sys.executable,
        "-m",
        "node_agent.commands.main",
        "daemon",
        "--config",
        str(config),
        "--simulate",
        str(scenario),
        "--log-level",
        "WARNING",
    ]
    if suite:
        argv += ["--suite", suite]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "w"))
    deadline = time.monotonic() + 60
    while "node_agent_up" not in metrics(port):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"daemon {name} did not start; see {tmp / f'{name}.log'}")
        time.sleep(0.2)
    return proc, port


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--scenario", default="scenarios/healthy-h100.yaml")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    scenario = tmp / "scenario.yaml"
    base = yaml.safe_load(Path(args.scenario).read_text())
    scenario.write_text(yaml.safe_dump(base))
    idle_suite = tmp / "idle.yaml"
    idle_suite.write_text(
        yaml.safe_dump(
            {
                "name": "idle",
                "mode": "service",
                "checks": [{"check": "nvml_health", "every_s": 3600, "timeout_s": 30}],
            }
        )
    )

    daemons = {"default cadence": start(tmp, "default", scenario, None)}
    try:
        daemons["idle"] = start(tmp, "idle", scenario, str(idle_suite))
        return measure(args, daemons, scenario, base)
    finally:
        for proc, _ in daemons.values():
            proc.terminate()
            proc.wait(timeout=10)


def measure(args: argparse.Namespace, daemons: dict, scenario: Path, base: dict) -> int:
    ps = {name: psutil.Process(p.pid) for name, (p, _) in daemons.items()}
    cpu0 = {name: p.cpu_times() for name, p in ps.items()}
    t0 = time.monotonic()
    rss: dict[str, list[float]] = {name: [] for name in daemons}
    while time.monotonic() - t0 < args.minutes * 60:
        for name, p in ps.items():
            rss[name].append(p.memory_info().rss / 2**20)
        time.sleep(5)
    elapsed = time.monotonic() - t0
    print(
        f"# footprint over {elapsed / 60:.1f} min, 8 simulated GPUs "
        f"({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})"
    )
    print("| daemon | RSS median MB | RSS max MB | CPU % of one core (own, children excluded) |")
    print("|---|---|---|---|")
    for name, p in ps.items():
        c1 = p.cpu_times()
        own = (c1.user - cpu0[name].user) + (c1.system - cpu0[name].system)
        print(
            f"| {name} | {statistics.median(rss[name]):.1f} | {max(rss[name]):.1f} | "
            f"{100 * own / elapsed:.3f} |"
        )

    _, port = daemons["default cadence"]
    latencies = []
    for gpu, code in ((5, 79), (1, 48), (2, 94), (6, 63), (0, 31)):
        base.setdefault("faults", []).append({"kind": "xid", "gpu": gpu, "code": code})
        staged = scenario.with_suffix(".tmp")
        staged.write_text(yaml.safe_dump(base))

        def seen(text: str, gpu: int = gpu, code: int = code) -> bool:
            return any(
                line.startswith("node_agent_gpu_xid_errors_total{")
                and f'gpu="{gpu}"' in line
                and f'code="{code}"' in line
                for line in text.splitlines()
            )

        t_inject = time.monotonic()
        os.replace(staged, scenario)
        while not seen(metrics(port)):
            if time.monotonic() - t_inject > 10:
                break
            time.sleep(0.01)
        latencies.append(time.monotonic() - t_inject)
    print(
        f"\nXID injection -> /metrics latency, 5 runs: "
        f"{', '.join(f'{x * 1000:.0f} ms' for x in latencies)} "
        f"(median {statistics.median(latencies) * 1000:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
