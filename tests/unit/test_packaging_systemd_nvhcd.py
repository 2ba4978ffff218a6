"""The shipped systemd unit lets the daemon serve NVRx's socket, at NVRx's default path too.

The unit makes /run read-only (ProtectSystem=strict); the round's finding was a daemon that
could not create /var/run/nvhcd.sock and ran on unserved. The unit now gives it a runtime
directory, and the tmpfiles snippet links NVRx's default path to the socket there.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.service.nvhcd import DEFAULT_SOCKET

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "packaging" / "systemd" / "node-agent.service"
TMPFILES = REPO / "packaging" / "systemd" / "node-agent-tmpfiles.conf"


SOCKET_UNIT = REPO / "packaging" / "systemd" / "node-agent.socket"


def section(unit: Path, name: str) -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read_string(unit.read_text())
    return dict(parser[name])


def service_section() -> dict[str, str]:
    return section(UNIT, "Service")


def test_the_socket_unit_holds_the_daemons_socket_in_a_directory_a_stop_keeps():
    """systemd holds the socket across restarts (tests/integration/test_daemon_nvhcd.py plays
    its part); a service stop that removed the runtime directory would take the socket's path
    with it, and NVRx would find no socket."""
    sock = section(SOCKET_UNIT, "Socket")
    assert sock["ListenStream"] == DEFAULT_SOCKET and sock["SocketMode"] == "0666"
    assert service_section()["RuntimeDirectoryPreserve"] == "yes"
    # the service's own name: systemd passes it to node-agent.service however that starts;
    # and only where an operator enables it (unset daemon.nvhcd.socket: nothing would accept)
    assert SOCKET_UNIT.stem == UNIT.stem and "Service" not in sock
    assert "socket" not in section(UNIT, "Unit").get("Wants", "")


def test_the_unit_gives_the_daemon_a_runtime_directory_users_can_reach():
    service = service_section()
    assert service["ProtectSystem"] == "strict"  # /run is read-only but for what is named
    assert service["RuntimeDirectory"] == "node-agent"
    assert service["RuntimeDirectoryMode"] == "0755"
    assert Path(DEFAULT_SOCKET).parent == Path("/run") / service["RuntimeDirectory"]


def test_tmpfiles_links_nvrx_default_socket_path_to_the_daemons(tmp_path):
    if shutil.which("systemd-tmpfiles") is None:
        pytest.skip("systemd-tmpfiles is not installed (Debian package systemd)")
    done = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(TMPFILES)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    link = tmp_path / "run" / "nvhcd.sock"
    assert link.is_symlink() and os.readlink(link) == DEFAULT_SOCKET


def test_nvrx_asking_through_the_link_reaches_the_daemon(tmp_path):
    pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")
    from nvrx_client import NodeHealthCheck

    from node_agent.service.node_state import NodeView
    from node_agent.service.nvhcd import HealthAnswerer, NvhcdServer

    real = tmp_path / "run" / "node-agent" / "nvhcd.sock"
    link = tmp_path / "run" / "nvhcd.sock"
    server = NvhcdServer(HealthAnswerer(lambda: NodeView("FAULT", graded_at=1.0)), real)
    server.start()
    try:
        link.symlink_to(real)
        client = NodeHealthCheck(f"unix://{link}")
        assert client() is False and client.skipped is None
        assert client.last_output["level"] == "FAULT"
    finally:
        server.stop()
    assert NodeHealthCheck(f"unix://{link}")() is True  # the link dangles: NVRx skips


TAKE = r"""
import os, socket, sys
from node_agent.service.sd_notify import inherited_unix_listener
real, asked = sys.argv[1], sys.argv[2]
held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
held.bind(real)
held.listen(1)
os.dup2(held.fileno(), 3)  # where systemd puts the first passed socket
env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid())}
taken = inherited_unix_listener(asked, env)
print(taken is not None and taken.fileno() == 3)
"""


@pytest.mark.parametrize("spelt", ["same", "through a link", "another socket"])
def test_the_socket_systemd_passes_is_taken_by_the_file_it_is_not_by_its_spelling(tmp_path, spelt):
    """systemd's ListenStream=/run/node-agent/nvhcd.sock and daemon.nvhcd.socket
    /var/run/node-agent/nvhcd.sock are one socket (/var/run is /run): compared as strings, the
    daemon had removed systemd's socket and bound one of its own, and the gap was back."""
    real = tmp_path / "run" / "nvhcd.sock"
    real.parent.mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to(tmp_path / "run")
    asked = {
        "same": real,
        "through a link": tmp_path / "var" / "run" / "nvhcd.sock",
        "another socket": tmp_path / "run" / "other.sock",
    }[spelt]
    done = subprocess.run(
        [sys.executable, "-c", TAKE, str(real), str(asked)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(spelt != "another socket")
    if spelt == "another socket":
        assert "none of them bound to" in done.stderr  # said, not silent
