"""The Kubernetes DaemonSet keeps the metrics endpoint off the cluster network and probes
liveness from inside the container; the probe's command is run here against a real server."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import yaml

from node_agent.config import load_config
from node_agent.service.metrics import MetricsServer

MANIFEST = Path(__file__).resolve().parents[2] / "packaging" / "kubernetes" / "daemonset.yaml"


def _docs() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    return config_map, daemonset


def test_daemonset_listens_on_loopback_and_the_config_loads(tmp_path):
    config_map, _ = _docs()
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    assert load_config(path).daemon.listen == "127.0.0.1:9847"


def test_daemonset_liveness_is_an_exec_probe_that_runs_in_root():
    _, daemonset = _docs()
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]
    assert "exec" in probe and "httpGet" not in probe
    assert container["workingDir"] == "/"
    assert "ports" not in container


def test_liveness_command_passes_on_200_and_fails_on_503():
    _, daemonset = _docs()
    command = daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"][
        "command"
    ]
    healthy = {"ok": True}
    server = MetricsServer(
        ("127.0.0.1", 0),
        {
            "/healthz": lambda: (
                (200, "text/plain", b"ok HEALTHY\n")
                if healthy["ok"]
                else (503, "text/plain", b"stalled\n")
            )
        },
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    argv = [
        sys.executable if a == "python3" else a.replace(":9847/", f":{server.server_address[1]}/")
        for a in command
    ]
    try:
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
        healthy["ok"] = False
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0
    finally:
        server.shutdown()
        server.server_close()


def test_the_agent_acts_on_the_node_its_pod_runs_on_not_its_hostname(monkeypatch):
    """The DaemonSet hands the agent its node's name from the downward API, and the agent's node
    name (remediation, the Kubernetes adapter's own-node guard) is that, not the pod's hostname."""
    from node_agent.config import NODE_NAME_ENV, config_from_dict
    from node_agent.remediation.host import node_name

    _, daemonset = _docs()
    env = {e["name"]: e for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[NODE_NAME_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    monkeypatch.setenv(NODE_NAME_ENV, "gpu-17")
    assert node_name(config_from_dict({})) == "gpu-17"
    assert node_name(config_from_dict({"node": {"name": "set-by-operator"}})) == "set-by-operator"
