"""NVRx's node health-check service against a real unprivileged user (round 3).

The findings, replayed as a ``useradd`` user against root's daemon, each now failing:
- the socket's directory was 0700: the job's user could not reach the 0666 socket, and NVRx
  skipped the check (healthy);
- two calls that send headers and never their message held the service's workers: a FAULT
  node's check timed out (NVRx: healthy);
- any local user was told every reason, other users' job names, uids, pids and py-spy frames.

The client the user runs keeps NVRx's contract and behaviour (tests/nvrx_client.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from agent_daemon import graded_daemon  # tests/agent_daemon.py
from waiting import wait_for

pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")

from nvrx_client import STALL, NodeHealthCheck  # noqa: E402

from node_agent.model import Result, Status  # noqa: E402
from node_agent.service import nvhcd  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# NVRx's client, run as the user: prints whether it passed, what it skipped and the output
ASK = """
import json, sys
from nvrx_client import NodeHealthCheck
client = NodeHealthCheck(sys.argv[1], request_timeout_sec=5)
healthy = client()
print(json.dumps({"healthy": healthy, "skipped": client.skipped, "output": client.last_output}))
"""
VICTIM_UID = 4321  # another user's job: its uid need not exist for the daemon to report it


def _hang(uid: int, job: str, pid: int) -> Result:
    """A hung rank as training_progress reports it (its job and stack are the user's)."""
    return Result(
        "training_progress",
        f"job:slurm:{pid}@uid:{uid}/rank:0",
        "training_hang",
        Status.FAIL,
        f"rank 0 (pid {pid}, job {job}): training hang suspected; stuck in "
        f"all_reduce ({job}_model.py:42)",
        evidence={"uid": uid, "pid": pid, "job": job},
    )


@pytest.fixture
def daemon(shared_dir):
    """Root's daemon serving NVRx on a socket under a directory that does not exist yet (as
    /run/node-agent before the daemon), on a simulated node."""
    root = shared_dir / "root"
    root.mkdir()
    root.chmod(0o755)
    (root / "kern.log").write_text("")
    sock = shared_dir / "run" / "node-agent" / "nvhcd.sock"
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(root / "state"),
                "spool_dir": str(root / "spool"),
                "kernel_log": {"path": str(root / "kern.log")},
                "daemon": {"act": False, "listen": "127.0.0.1:0", "nvhcd": {"socket": str(sock)}},
            }
        )
    )
    node = root / "node.yaml"
    node.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2}))
    suite = root / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "mode": "service",
                "checks": [{"check": "inventory", "timeout_s": 10, "every_s": 3600}],
            }
        )
    )
    with graded_daemon(config, node, suite) as d:
        yield d, sock


def ask_as(user, sock: Path) -> dict:
    done = user.py(ASK, str(sock), env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_jobs_user_reaches_the_socket_and_sees_no_other_users_job(user, daemon):
    d, sock = daemon
    assert oct(sock.parent.stat().st_mode & 0o777) == "0o755"
    d._record(
        "training_progress",
        [_hang(VICTIM_UID, "llama-secret", 777), _hang(user.uid, "mine-visible", 888)],
        time.time(),
        0.1,
    )
    assert d.view.level == "ERROR"

    answer = ask_as(user, sock)
    assert answer["skipped"] is None, answer  # reached, not skipped as unreachable
    assert answer["healthy"] is False and answer["output"]["level"] == "ERROR"
    text = json.dumps(answer["output"])
    for secret in ("llama-secret", str(VICTIM_UID), "pid 777", "slurm:777"):
        assert secret not in text, (secret, text)
    assert "mine-visible" in text and "mine-visible_model.py" in text  # the user's own job
    # the user's own hung job counts against the node for it, told in full; the other user's
    # hang is theirs (the node is not drained for it either) and does not
    assert answer["output"]["fail_count"] == 1
    # root is told everything
    root = NodeHealthCheck(str(sock))
    assert root() is False and "llama-secret" in json.dumps(root.last_output)


def test_a_users_stalled_calls_never_delay_the_jobs_answer(user, daemon):
    """The user holds 16 calls that never send their message (the round's finding: 2 were
    enough); root's NVRx answer still comes at once, every time."""
    d, sock = daemon
    d._record("training_progress", [_hang(VICTIM_UID, "job", 777)], time.time(), 0.1)
    user.popen(STALL, str(sock), "16", env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    # the user's process has opened more calls than it may hold: some were closed for room
    assert wait_for(lambda: d._nvhcd is not None and d._nvhcd.evicted >= 1, 60)
    took = []
    for _ in range(20):
        # a call held behind the stalled ones would wait for their close (nvhcd.CALL_S); half
        # that leaves a loaded machine's own slowness room
        client = NodeHealthCheck(str(sock), request_timeout_sec=nvhcd.CALL_S / 2)
        t0 = time.monotonic()
        healthy = client()
        took.append(time.monotonic() - t0)
        assert client.skipped is None, client.skipped  # answered, never timed out
        assert healthy is False
    assert max(took) < nvhcd.CALL_S / 2, took
    # the user holds at most 4 at any time; the rest were closed to make room (or ran past
    # their 5 s on a slow machine, which closes them too)
    gate = d._nvhcd._gate if d._nvhcd is not None else None
    assert gate is not None and gate.evicted >= 1
    held = [c for c in list(gate._calls.values()) if c.uid == user.uid and not c.closed.is_set()]
    assert len(held) <= 4, len(held)
