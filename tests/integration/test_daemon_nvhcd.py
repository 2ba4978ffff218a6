"""The real daemon answers NVRx's node health check over its Unix socket, and fails closed.

The daemon runs as a subprocess on a simulated node; the client keeps NVRx's wire contract and
behaviour (tests/nvrx_client.py says why it is not NVRx's own class), including its fail-open
rules: a missing socket, a timeout or a refused call reads as healthy. So the daemon must answer
from the node's state, never from a partial run: the FAULT here (an HCA port down and an
uncorrectable memory error, which no Xid announces) is found by the schedule's last check, and
the checks before it grade HEALTHY.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")

from nvrx_client import DEFAULT_ARGS, NodeHealthCheck, stall_calls  # noqa: E402
from waiting import wait_for  # tests/waiting.py

AGENT = str(Path(sys.executable).with_name("node-agent"))
FAULTS = [
    {"kind": "hca_port_down", "hca": "mlx5_1"},
    {"kind": "edac_ue", "dimm": "CPU0_DIMM_A1", "count": 1},
]
SUITE = {
    "name": "periodic",
    "mode": "service",
    "checks": [
        {"check": c, "timeout_s": 30, "every_s": 3600}
        for c in ("nvml_health", "sdc_spool", "inventory", "hca_ports", "host_memory")
    ],
}


def write_scenario(path: Path, faults: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        yaml.safe_dump(
            {"sku": "h100-sxm5-80gb", "gpus": 8, "hcas": ["mlx5_0", "mlx5_1"], "faults": faults}
        )
    )
    os.replace(tmp, path)


class Node:
    """A simulated node and its daemon's files; ``start()`` runs ``node-agent daemon``."""

    def __init__(self, tmp_path: Path, faults: list[dict]) -> None:
        self.scenario = tmp_path / "scenario.yaml"
        self.sock = tmp_path / "run" / "nvhcd.sock"
        self.state = tmp_path / "state"
        self.config = tmp_path / "config.yaml"
        self.suite = tmp_path / "periodic.yaml"
        write_scenario(self.scenario, faults)
        self.suite.write_text(yaml.safe_dump(SUITE))
        self.config.write_text(
            yaml.safe_dump(
                {
                    "state_dir": str(self.state),
                    "spool_dir": str(tmp_path / "spool"),
                    "daemon": {
                        "listen": "127.0.0.1:0",
                        "act": False,
                        "nvhcd": {"socket": str(self.sock)},
                    },
                }
            )
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        argv = [AGENT, "daemon", "--config", str(self.config), "--simulate", str(self.scenario)]
        self.proc = subprocess.Popen(
            [*argv, "--suite", str(self.suite)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.proc

    def start_activated(self, held: socket.socket) -> subprocess.Popen:
        """The daemon as systemd starts it for a ``.socket`` unit: ``held`` as fd 3, with
        ``LISTEN_FDS=1`` and ``LISTEN_PID`` its own pid (bash, which takes any fd number in a
        redirection, then execs the agent)."""
        argv = [AGENT, "daemon", "--config", str(self.config), "--simulate", str(self.scenario)]
        self.proc = subprocess.Popen(
            ["bash", "-c", 'LISTEN_FDS=1 LISTEN_PID=$$ exec "$@" 3<&"$FD"', "bash", *argv]
            + ["--suite", str(self.suite)],
            env={**os.environ, "FD": str(held.fileno())},
            pass_fds=(held.fileno(),),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.proc

    def start_kept(self) -> subprocess.Popen:
        """``node-agent daemon --keep-socket``, as the DaemonSet runs it."""
        argv = [AGENT, "daemon", "--keep-socket", "--config", str(self.config)]
        self.proc = subprocess.Popen(
            [*argv, "--simulate", str(self.scenario), "--suite", str(self.suite)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.proc

    def stop(self) -> str:
        if self.proc is None:
            return ""
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        finally:
            self.proc = None
        return err


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, FAULTS)
    try:
        yield n
    finally:
        n.stop()


def poll(
    sock: Path, until, limit_s: float = 120, then_s: float = 2.0, every_s: float = 0.25
) -> list[tuple[float, bool, dict]]:
    """NVRx's client asked every ``every_s`` (each time as a launcher that just started: NVRx
    tests the socket's existence once, when its client is made) until ``until(answer)`` has
    held for ``then_s`` more seconds, or for ``limit_s`` (the caller's asserts say which)."""
    answers: list[tuple[float, bool, dict]] = []
    t0 = time.monotonic()
    reached: float | None = None
    while time.monotonic() - t0 < limit_s:
        client = NodeHealthCheck(f"unix://{sock}")
        healthy = client()
        answer = {"skipped": client.skipped, **(client.last_output or {})}
        answers.append((round(time.monotonic() - t0, 2), healthy, answer))
        if reached is None and answer["skipped"] is None and until(answer):
            reached = time.monotonic()
        if reached is not None and time.monotonic() - reached >= then_s:
            break
        time.sleep(every_s)
    return answers


def schedule_done(answer: dict) -> bool:
    """The daemon has run every check of its suite itself (none only restored from disk)."""
    return answer.get("complete") is True and not answer.get("restored_checks")


def check_never_healthy(answers: list[tuple[float, bool, dict]]) -> list[dict]:
    """No answer said healthy; a skip only for a socket not made yet, before the first answer.
    Returns the answers that came from the daemon."""
    served = [a for a in answers if a[2]["skipped"] is None]
    assert served, f"the daemon never answered: {answers[-3:]}"
    assert not [a for a in answers if a[1] and a[2]["skipped"] is None], answers
    first = answers.index(served[0])
    late_skips = [a for a in answers[first:] if a[2]["skipped"] is not None]
    assert not late_skips, f"the service vanished or failed open once up: {late_skips[:3]}"
    assert all("does not exist" in a[2]["skipped"] for a in answers[:first]), answers[:first]
    return [a[2] for a in served]


def test_a_fault_node_is_never_answered_healthy_from_its_first_second_nor_after_a_restart(node):
    node.start()
    served = check_never_healthy(poll(node.sock, schedule_done))
    levels = [a["level"] for a in served]
    assert levels[-1] == "FAULT", levels
    # before the schedule is complete the answer is UNKNOWN, or a failure already found (how
    # far the first checks got by the first answer depends on the machine's speed)
    early = [a["level"] for a in served if not a.get("complete")]  # UNKNOWN has no "complete"
    assert set(early) <= {"UNKNOWN", "ERROR", "FAULT"}, levels
    last = served[-1]
    assert last["complete"] is True and {"hca-port-down"} <= set(last["failed_checks"])
    assert sorted(last["result_age_s"]) == sorted(c["check"] for c in SUITE["checks"])
    assert last["args_received"] == list(DEFAULT_ARGS)  # NVRx 0.7's request, accepted
    state = node.state / "daemon-state.json"
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    assert json.loads(state.read_text())["grade"]["level"] == "FAULT"
    err = node.stop()
    assert "--no-slurm --group prolog epilog logs gpu" in err

    node.start()
    served = check_never_healthy(poll(node.sock, schedule_done))
    # this boot's stored results count at once, marked as restored with their age (those the
    # new daemon has not run again by its first answer: how many it ran first depends on the
    # machine's speed)
    assert served[0]["level"] == "FAULT", served[0]
    assert set(served[0]["restored_checks"]) <= {c["check"] for c in SUITE["checks"]}
    assert schedule_done(served[-1]) and served[-1]["level"] == "FAULT", served[-1]


def test_two_stalled_calls_do_not_delay_a_third(node):
    """Two calls that send their headers and never their message (same uid: under the cap)."""

    node.start()
    assert wait_for(
        node.sock.exists, 120, interval_s=0.1
    )  # a bound on a hang: other tests run at once
    release = threading.Event()
    stalled = stall_calls(node.sock, 2, release)
    try:
        time.sleep(0.5)  # both are in the service, waiting for a message
        # a call held behind the stalled ones would wait for their close at 5 s
        # (nvhcd.CALL_S); half that leaves a loaded machine's own slowness room
        for _ in range(5):
            client = NodeHealthCheck(str(node.sock), request_timeout_sec=2.5)
            t0 = time.monotonic()
            healthy = client()
            took = time.monotonic() - t0
            assert client.skipped is None, client.skipped  # answered, not timed out
            assert healthy is False and took < 2.5, (took, client.last_output)
    finally:
        release.set()
        for channel, _ in stalled:
            channel.close()


def test_a_service_that_cannot_be_served_is_a_warn_in_the_grade(tmp_path):
    """A socket path whose directory cannot be made (a file stands there): the daemon runs on,
    and says so in its grade and its metrics."""
    import urllib.request

    from node_agent.service.daemon import Daemon

    (tmp_path / "run").write_text("a file, not a directory")
    n = Node(tmp_path, [])
    suite = {**SUITE, "checks": [{"check": "inventory", "timeout_s": 30, "every_s": 3600}]}
    n.suite.write_text(yaml.safe_dump(suite))
    daemon = Daemon(str(n.config), str(n.scenario), suite=str(n.suite))
    thread = threading.Thread(target=daemon.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: daemon.view and daemon.view.complete, 60), daemon.view
        reasons = [r for r in daemon.grade.reasons if r.target == "node"]
        assert daemon.grade.level.name == "WARN"
        assert any("NOT served" in r.message for r in reasons), reasons
        port = daemon.listen_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'node_agent_nvhcd_served{hostname="sim-node"} 0.0' in text
    finally:
        daemon.stop()
        thread.join(10)


def test_a_socket_systemd_holds_keeps_a_call_made_across_a_restart_waiting_not_healthy(node):
    """Under the shipped ``node-agent.socket`` systemd holds the listening socket across
    restarts of the daemon and passes it in (socket activation). Here the test plays systemd: it
    binds the socket, keeps it, and hands it to each daemon as fd 3 with ``LISTEN_FDS`` and
    ``LISTEN_PID``. A call made while the daemon is down had found no socket (healthy, to NVRx);
    now it waits in the backlog, and the next daemon answers it: not healthy."""
    node.sock.parent.mkdir(mode=0o755)
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.bind(str(node.sock))
    held.listen(16)
    os.chmod(node.sock, 0o666)
    node.start_activated(held)
    served = check_never_healthy(poll(node.sock, schedule_done))
    assert served[-1]["level"] == "FAULT"
    assert "held across restarts" in node.stop()
    assert node.sock.exists()  # the daemon leaves systemd's socket alone

    gap: dict = {}
    client = NodeHealthCheck(f"unix://{node.sock}")  # made while the socket exists, as NVRx does
    call = threading.Thread(target=lambda: gap.update(healthy=client(), skipped=client.skipped))
    call.start()
    time.sleep(2)  # the daemon is down: the call waits in the socket's backlog
    assert call.is_alive(), gap
    node.start_activated(held)
    call.join(60)
    assert gap == {"healthy": False, "skipped": None}, gap
    assert client.last_output["level"] in ("UNKNOWN", "FAULT")
    held.close()


def test_a_daemon_that_crashes_in_a_container_leaves_its_socket_held_and_the_call_answered(node):
    """In a container no systemd holds the socket: ``daemon --keep-socket`` (the DaemonSet's
    command) binds it and runs the daemon under it. The daemon killed outright (a crash, the
    OOM killer): the socket stays, a call made meanwhile waits, and the daemon the keeper starts
    next answers it, not healthy. SIGTERM then stops both and removes the socket."""
    proc = node.start_kept()
    keeper = psutil.Process(proc.pid)
    served = check_never_healthy(poll(node.sock, schedule_done))
    assert served[-1]["level"] == "FAULT"
    (daemon,) = keeper.children()
    daemon.kill()
    daemon.wait(10)
    client = NodeHealthCheck(f"unix://{node.sock}")
    assert node.sock.exists()
    gap: dict = {}
    call = threading.Thread(target=lambda: gap.update(healthy=client(), skipped=client.skipped))
    call.start()
    call.join(60)
    assert gap == {"healthy": False, "skipped": None}, (gap, node.stop())
    assert client.last_output["level"] in ("UNKNOWN", "FAULT")
    (again,) = keeper.children()
    assert again.pid != daemon.pid
    err = node.stop()
    assert proc.returncode == 0 and not again.is_running(), err
    assert "a new daemon in" in err and not node.sock.exists(), err
