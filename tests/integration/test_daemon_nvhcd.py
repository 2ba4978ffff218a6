"""The real daemon answers NVRx's node health check over its Unix socket (docs/stop_check.md).

The daemon runs as a subprocess on a simulated node; the client keeps NVRx's wire contract and
behaviour (tests/nvrx_client.py says why it is not NVRx's own class: the registry's NVRx has no
node health-check client). The daemon's periodic suite here reads only the SDC spool, so what
NVML says reaches the answer only through the service's own quick-suite refresh: the test can
then see that a request grades the node without ever causing an action.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")

from nvrx_client import NodeHealthCheck  # noqa: E402

AGENT = str(Path(sys.executable).with_name("node-agent"))


def wait_for(predicate, timeout_s: float):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def write_scenario(path: Path, faults: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults}))
    os.replace(tmp, path)


@pytest.fixture
def daemon(tmp_path):
    scenario, sock = tmp_path / "scenario.yaml", tmp_path / "run" / "nvhcd.sock"
    write_scenario(scenario, [])
    suite = tmp_path / "periodic.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "periodic",
                "mode": "service",
                "checks": [{"check": "sdc_spool", "timeout_s": 30, "every_s": 3600}],
            }
        )
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {
                    "listen": "127.0.0.1:0",
                    "act": True,
                    "nvhcd": {"socket": str(sock), "max_age_s": 0.5, "min_refresh_s": 0},
                },
            }
        )
    )
    proc = subprocess.Popen(
        [
            AGENT,
            "daemon",
            "--config",
            str(config),
            "--simulate",
            str(scenario),
            "--suite",
            str(suite),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(sock.exists, 60), proc.stderr.read() if proc.poll() is not None else ""
        yield proc, scenario, sock, tmp_path / "state"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def ask(sock: Path) -> tuple[bool, dict]:
    client = NodeHealthCheck(f"unix://{sock}")
    healthy = client()
    assert client.skipped is None, client.skipped
    return healthy, client.last_output


def test_the_daemon_answers_healthy_error_and_fault_and_never_acts_on_a_request(daemon):
    proc, scenario, sock, state = daemon
    assert oct(sock.stat().st_mode & 0o777) == "0o666"
    healthy, output = ask(sock)
    assert healthy is True and output["fail_count"] == 0 and output["level"] == "HEALTHY"

    write_scenario(scenario, [{"kind": "row_remap_pending", "gpu": 2}])
    healthy, output = wait_for(
        lambda: (lambda a: a if a[1]["level"] == "ERROR" else None)(ask(sock)), 30
    )
    assert healthy is False and output["fail_count"] >= 1
    assert any(r["target"] == "gpu:2" for r in output["reasons"])

    # a FAULT only NVML's counters show (the daemon's XID watch, which acts on its own evidence,
    # does not see it): volatile double-bit ECC errors
    write_scenario(scenario, [{"kind": "ecc_dbe_volatile", "gpu": 5, "count": 2}])
    healthy, output = wait_for(
        lambda: (lambda a: a if a[1]["level"] == "FAULT" else None)(ask(sock)), 30
    )
    assert healthy is False
    assert any(r["target"] == "gpu:5" and r["level"] == "FAULT" for r in output["reasons"])

    # asking graded the node for the answer; the daemon itself acted on nothing
    log = state / "actions.log"
    assert not log.exists() or log.read_text().strip() == ""


def test_with_the_daemon_down_nvrx_skips_the_check(daemon):
    proc, _, sock, _ = daemon
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert not sock.exists()
    client = NodeHealthCheck(f"unix://{sock}")
    assert client() is True and "does not exist" in client.skipped


def test_many_ranks_asking_at_once_run_the_quick_suite_once_per_interval(tmp_path):
    """The answerer alone, with the daemon's refresh counted: 64 requests, one refresh."""
    from node_agent.service.nvhcd import GradeView, HealthAnswerer

    calls = []

    def refresh():
        calls.append(time.time())
        return GradeView("HEALTHY", graded_at=time.time())

    answerer = HealthAnswerer(lambda: None, refresh, max_age_s=60, min_refresh_s=30)
    answers = [json.loads(answerer.answer([])["output"]) for _ in range(64)]
    assert len(calls) == 1 and all(a["fail_count"] == 0 for a in answers)
