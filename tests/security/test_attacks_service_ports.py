"""A local user holds the port (or socket) of a service the agent asks, and answers in its name.

Where ``nv-hostengine`` is not running, any user may listen on its port first (5555 is above
1023) and answer the agent's health watches: a watch's failure is ``dcgm-health-hardware-fail``,
FAULT, a replacement. Likewise the IMEX daemon's command port (``IMEX_CMD_PORT``), which
``nvidia-imex-ctl`` asks for this node's state in its NVLink domain (not READY: ERROR, a drain),
a webhook receiver on loopback, and the port perftest's server and client meet on (a user
holding perftest's fixed 18515 first had the client measure against its own server: a slow
figure, ERROR). And the daemon's metrics port, which a user holding it had made the daemon exit.
The user here is a real ``useradd`` user holding a real port or socket; what its program would
answer is played by stand-ins (DCGM, IMEX and RDMA cannot run without their hardware): DCGM
bindings whose host-engine handle reports a double-bit ECC error, and a ``dcgmi``,
``nvidia-imex-ctl`` and ``ib_write_bw`` that record being run. The agent must never ask the
user's program: it starts no DCGM engine at all (two on one node can deadlock in the driver),
runs no tool against it, sends no action to it, and says whose the port was.
"""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace as ns

import pytest
import yaml
from agent_daemon import graded_daemon  # tests/agent_daemon.py
from dcgm_fakes import fake_bindings  # tests/dcgm_fakes.py
from waiting import wait_for  # tests/waiting.py

from node_agent.checking.context import HOST_PORTS, CheckContext
from node_agent.checks import dcgm_diag, dcgm_health, imex, rdma
from node_agent.config import config_from_dict
from node_agent.gpu.dcgm import open_dcgm
from node_agent.hardware.sku import load_sku, load_skus
from node_agent.model import Status
from node_agent.peers import free_loopback_port
from node_agent.resources import shipped_graders_dir
from node_agent.schedulers.base import AdapterError
from node_agent.schedulers.webhook import WebhookAdapter
from node_agent.service import daemon as daemon_module
from node_agent.sim.gpu_model import SimGpuBackend
from node_agent.sim.scenario import Scenario
from tests.unit.test_hca_ports import make_port  # the sysfs tree of an HCA port

REPO = Path(__file__).resolve().parents[2]
PERFTEST = REPO / "tests" / "data" / "perftest"

LISTEN = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""

SOCKET = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


class PresentGpus:
    """A GPU backend that is present: the DCGM checks ask only that."""

    name = "stand-in"
    simulated = False
    unavailable_reason = None
    broken = False

    def devices(self):
        return []


def squatters_word(handle):
    """The host engine's handle answers a double-bit ECC error; the embedded one, nothing."""
    if handle == "h-None":
        return ns(overallHealth=0, incidentCount=0, incidents=[])
    dbe = ns(
        system=0x10,
        health=20,
        error=ns(code=4, msg=b"Detected 1 volatile DBE in GPU 0\0"),
        entityInfo=ns(entityGroupId=1, entityId=0),
    )
    return ns(overallHealth=20, incidentCount=1, incidents=[dbe])


def context(check: str, port: int, gpu=None, **params) -> CheckContext:
    return CheckContext(
        check=check,
        gpu=gpu or PresentGpus(),
        kernel_log=None,
        config=config_from_dict({"dcgm": {"hostengine": f"127.0.0.1:{port}"}}),
        inventory=None,
        sku=None,
        expected_gpus=None,
        params=params,
        timeout_s=60.0,
        ports=HOST_PORTS,
    )


def health_check(port: int, tmp_path, **fakes):
    (tmp_path / "pydcgm.py").write_text("")
    bindings, calls = fake_bindings(health_response=squatters_word, **fakes)
    results = dcgm_health.run(
        context("dcgm_health", port),
        opener=lambda c: open_dcgm(c, candidates=[tmp_path], loader=lambda p: bindings),
    )
    return results, calls


def test_a_users_program_on_the_host_engines_port_is_never_asked(user, tmp_path):
    port = free_loopback_port()
    user.popen(LISTEN, str(port))
    (err,), calls = health_check(port, tmp_path)
    # neither the user's port nor an engine of the agent's own beside it (two engines on one
    # node can deadlock in the driver): the check could not run, and says whose the port is
    assert calls.handles == [] and err.status is Status.ERROR
    assert f"held by uid {user.uid} ({user.name})" in err.detail
    assert "dcgm.hostengine_users" in err.detail


def test_a_port_that_changes_hands_while_connecting_is_left(user, tmp_path):
    """Root's engine held the port when it was read; by the time the bindings connected, the
    user's program did. The port is read again after connecting, and the engine is left."""
    port = free_loopback_port()
    engine = socket.socket()
    engine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    engine.bind(("127.0.0.1", port))
    engine.listen()

    def hand_over(address):
        engine.close()
        user.popen(LISTEN, str(port))

    (err,), calls = health_check(port, tmp_path, on_connect=hand_over)
    assert calls.handles == [f"127.0.0.1:{port}"] and calls.shutdowns == 1
    assert err.status is Status.ERROR and calls.health_set == []  # nothing asked of it
    assert f"after connecting, port {port} of this host is held by uid {user.uid}" in err.detail


def test_dcgmi_is_not_run_against_a_users_program_on_the_port(user, tmp_path):
    """Without the bindings the diagnostic runs through ``dcgmi``, which asks whatever listens
    on the port; a stand-in ``dcgmi`` here would print DCGM's "isolate GPU 2" report."""
    port = free_loopback_port()
    user.popen(LISTEN, str(port))
    dcgmi = tmp_path / "dcgmi"
    dcgmi.write_text(f'#!/bin/sh\ntouch "{tmp_path}/ran"\n')
    dcgmi.chmod(0o755)
    ctx = context("dcgm_diag", port, dcgmi=str(dcgmi))
    (err,) = dcgm_diag.run(ctx, opener=lambda c: open_dcgm(c, candidates=[tmp_path / "none"]))
    assert err.status is Status.ERROR and not (tmp_path / "ran").exists()
    assert f"held by uid {user.uid} ({user.name})" in err.detail


def imex_node(tmp_path, command_service: str):
    """A GB200 tray (simulated NVML: IMEX applies) in a two-node domain whose daemon config
    names ``command_service``; a stand-in nvidia-imex-ctl that records being run."""
    (tmp_path / "config.cfg").write_text(f"IMEX_CMD_ENABLED=1\n{command_service}\n")
    (tmp_path / "nodes_config.cfg").write_text("10.0.0.1\n10.0.0.2\n")
    tool = tmp_path / "nvidia-imex-ctl"
    tool.write_text(f'#!/bin/sh\ntouch "{tmp_path}/ran"\n')
    tool.chmod(0o755)
    gb200 = load_skus(shipped_graders_dir())["gb200-186gb"]
    tray = SimGpuBackend(Scenario(sku="gb200-186gb", gpus=4, source="test"), gb200)
    return context(
        "imex",
        0,
        gpu=tray,
        tool=str(tool),
        config=str(tmp_path / "config.cfg"),
        nodes_config=str(tmp_path / "nodes_config.cfg"),
    )


def test_imex_ctl_is_not_run_against_a_users_program_on_the_command_port(user, tmp_path):
    port = free_loopback_port()
    user.popen(LISTEN, str(port))
    (err,) = imex.run(imex_node(tmp_path, f"IMEX_CMD_PORT={port}"))
    assert err.status is Status.ERROR and not (tmp_path / "ran").exists()
    assert f"held by uid {user.uid} ({user.name})" in err.detail


def test_imex_ctl_is_not_run_against_a_users_command_socket(user, attack_dir, tmp_path):
    """The command service on a Unix socket: one the user made where the config points."""
    path = attack_dir / "imex.sock"
    user.popen(SOCKET, str(path))
    (err,) = imex.run(imex_node(tmp_path, f"IMEX_CMD_UNIX_DOMAIN_PATH={path}"))
    assert err.status is Status.ERROR and not (tmp_path / "ran").exists()
    assert f"belongs to uid {user.uid} ({user.name})" in err.detail


def rdma_node(tmp_path, monkeypatch, **params):
    """One ACTIVE NDR port in a sysfs tree (no RDMA device here) and a stand-in ib_write_bw
    that records its argv and prints a slow run (what a client measuring against a user's
    throttled server would see)."""
    make_port(tmp_path / "sys", "mlx5_0")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "ib_write_bw"
    stub.write_text(
        f'#!/bin/sh\necho "$@" >> "{tmp_path}/runs"\ncat "{PERFTEST / "ib_write_bw_mib_roce.txt"}"\n'
    )
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    ctx = CheckContext(
        check="rdma",
        gpu=PresentGpus(),
        kernel_log=None,
        config=config_from_dict({}),
        inventory=None,
        sku=load_sku(REPO / "graders" / "skus" / "h100-sxm5-80gb.yaml"),
        expected_gpus=None,
        params={"sysfs_root": str(tmp_path / "sys"), "server_start_s": 0.2, **params},
    )
    results = rdma.run(ctx)
    (bw,) = [r for r in results if r.metric == "write_bw_gbps"]
    runs = (tmp_path / "runs").read_text().splitlines() if (tmp_path / "runs").exists() else []
    return bw, runs


def test_rdma_client_never_measures_against_a_users_program_on_its_port(
    user, tmp_path, monkeypatch
):
    port = free_loopback_port()
    user.popen(LISTEN, str(port))
    bw, runs = rdma_node(tmp_path, monkeypatch, tcp_port=port)
    assert bw.status is Status.ERROR and "not measured" in bw.detail
    assert f"held by uid {user.uid} ({user.name})" in bw.detail
    assert not [r for r in runs if r.endswith("127.0.0.1")]  # the client never ran


def test_rdma_meets_on_a_port_no_user_can_know_in_advance(user, tmp_path, monkeypatch):
    """perftest's fixed 18515 is what a user would hold; the check's default is a free port."""
    user.popen(LISTEN, "18515")
    bw, runs = rdma_node(tmp_path, monkeypatch)
    assert bw.status is not Status.ERROR, bw.detail  # measured (the stand-in's slow figure)
    assert runs and all("-p 18515" not in r for r in runs)


def test_a_user_holding_the_metrics_port_does_not_switch_the_daemon_off(
    user, tmp_path, monkeypatch
):
    """The daemon had exited when it could not listen on ``daemon.listen``: a user who held
    127.0.0.1:9847 first (say across a restart) left NVRx no socket (healthy, to NVRx), no watch
    and no remediation. It now watches on, with a WARN naming the port's holder, and takes the
    port back once it is free."""
    port = free_loopback_port()
    squatter = user.popen(LISTEN, str(port))
    monkeypatch.setattr(daemon_module, "HTTP_RETRY_S", 0.5)
    scenario, suite, config = tmp_path / "s.yaml", tmp_path / "p.yaml", tmp_path / "c.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2, "faults": []}))
    suite.write_text(
        yaml.safe_dump(
            {"name": "p", "mode": "service", "checks": [{"check": "nvml_health", "every_s": 1}]}
        )
    )
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"listen": f"127.0.0.1:{port}"},
            }
        )
    )
    with graded_daemon(config, scenario, suite) as daemon:
        (reason,) = [r for r in daemon.grade.reasons if "NOT served" in r.message]
        assert f"held by uid {user.uid} ({user.name})" in reason.message
        assert daemon.view.level == "WARN" and daemon.listen_address is None
        squatter.kill()
        assert wait_for(lambda: daemon.listen_address == ("127.0.0.1", port), 10)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            assert answer.read().decode().startswith("ok HEALTHY")


HTTP_OK = r"""
import http.server, sys
log = sys.argv[2]
class Ok(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        with open(log, "a") as f:
            f.write(self.path + "\n")
        self.send_response(200)
        self.end_headers()
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok)
print("listening", flush=True)
server.serve_forever()
"""


def test_a_webhook_receiver_a_user_runs_on_loopback_is_never_sent_an_action(
    user, attack_dir, tmp_path
):
    """A loopback receiver shows no certificate: a user's server on its port, answering 200,
    had the agent record a drain as delivered that no scheduler ever saw."""
    port, posts = free_loopback_port(), attack_dir / "posts"
    user.popen(HTTP_OK, str(port), str(posts))
    (tmp_path / "secret").write_text("s3cret\n")
    webhook = {"url": f"http://127.0.0.1:{port}/hook", "secret_file": str(tmp_path / "secret")}
    adapter = WebhookAdapter.from_config(
        config_from_dict({"adapter": {"webhook": {**webhook, "retries": 0}}})
    )
    with pytest.raises(AdapterError, match=f"not sent: .*held by uid {user.uid} \\({user.name}\\)"):
        adapter.drain("gpu-01", "node-agent: FAULT xid79 gpu:5")
    assert not posts.exists()
