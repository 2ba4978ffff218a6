"""Benchmark: how long a fault found while a check is wedged is answered as something fitter.

    .venv/bin/python bench/bench_stall_window.py [--timeout-s 30]

Runs ``node-agent daemon`` on a simulated healthy 8-GPU node with two checks: ``nvml_health``
every 10 s and ``sdc`` in its child process (``--timeout-s``). Once the node answers HEALTHY,
a SIGHUP restarts the schedule, the ``sdc`` child is stopped (SIGSTOP: a child wedged in the
driver), and the scenario gains a row-remap failure on GPU 2. ``/healthz`` is polled every
100 ms: the times from the stop to the first answer that is not HEALTHY (UNKNOWN: the checks
behind the wedged one are late) and to FAULT (``nvml_health`` ran again after the child's
timeout and kill grace).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from node_agent.peers import free_loopback_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from agent_daemon import agent_daemon  # noqa: E402 - tests/agent_daemon.py

HEALTHY = {"sku": "h100-sxm5-80gb", "gpus": 8, "faults": []}
FAULTY = {**HEALTHY, "faults": [{"kind": "row_remap_failure", "gpu": 2}]}


def healthz(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return answer.read().decode().strip()
    except OSError as err:
        return f"unreachable: {err}"


def wait_for(what, timeout_s: float, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every_s)
    raise SystemExit(f"gave up after {timeout_s:g} s")


def write_scenario(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=30.0, help="the sdc check's timeout")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    scenario, suite, config = tmp / "scenario.yaml", tmp / "suite.yaml", tmp / "config.yaml"
    write_scenario(scenario, HEALTHY)
    sdc = {"digest_shapes": [[32, 32, 32]], "dtypes": ["fp32"]}
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "stall",
                "mode": "service",
                "checks": [
                    {"check": "nvml_health", "timeout_s": 30, "every_s": 10},
                    {
                        "check": "sdc",
                        "timeout_s": args.timeout_s,
                        "every_s": 600,
                        "params": {
                            "tiles_per_sm": 2,
                            "digest_shapes": [[128, 128, 128]],
                            "repeats": 1,
                            "freivalds_n": 0,
                            "min_free_mib": 2048,
                            "simulated": sdc,
                        },
                    },
                ],
            }
        )
    )
    port = free_loopback_port()
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp / "state"),
                "spool_dir": str(tmp / "spool"),
                "daemon": {
                    "listen": f"127.0.0.1:{port}",
                    "act": False,
                    "subprocess_checks": ["sdc"],
                },
            }
        )
    )
    with agent_daemon(config, scenario, suite, tmp / "daemon.log") as daemon:
        wait_for(lambda: healthz(port).startswith("ok HEALTHY"), 120)
        daemon.send_signal(signal.SIGHUP)

        def sdc_child() -> psutil.Process | None:
            return next(
                (
                    c
                    for c in psutil.Process(daemon.pid).children()
                    if "check_child" in " ".join(c.cmdline())
                ),
                None,
            )

        child = wait_for(sdc_child, 60, every_s=0.02)
        child.suspend()
        stopped = time.monotonic()
        write_scenario(scenario, FAULTY)
        first_unfit = None
        while (answer := healthz(port)) != "ok FAULT":
            if first_unfit is None and not answer.startswith("ok HEALTHY"):
                first_unfit = time.monotonic() - stopped
            if time.monotonic() - stopped > 4 * args.timeout_s + 120:
                raise SystemExit(f"no FAULT after {time.monotonic() - stopped:.0f} s: {answer}")
            time.sleep(0.1)
        fault = time.monotonic() - stopped
        unfit = f"{first_unfit:.1f} s" if first_unfit is not None else "never"
        print(
            f"sdc child stopped (timeout_s {args.timeout_s:g}): first answer not HEALTHY "
            f"after {unfit}, FAULT after {fault:.1f} s"
        )


if __name__ == "__main__":
    main()
