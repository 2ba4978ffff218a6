"""The Kubernetes DaemonSet keeps the metrics endpoint off the cluster network and probes
liveness from inside the container; the probe's command is run here against a real server."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
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


KUBERNETES_DOC = MANIFEST.parents[2] / "docs" / "kubernetes.md"
CONTAINERFILE = MANIFEST.parents[1] / "container" / "Containerfile"


def _round_trip(document: dict, model: str) -> dict:
    """The document read into the official client's model and written back: a field the
    Kubernetes API does not have (a typo, a wrong level) is dropped on the way."""
    client = pytest.importorskip(
        "kubernetes.client", reason="the kubernetes extra (make deps-test)"
    )
    api = client.ApiClient()
    return api.sanitize_for_serialization(api._ApiClient__deserialize(document, model))


def _training_pod() -> dict:
    """The training pod of docs/kubernetes.md (its one YAML block)."""
    block = KUBERNETES_DOC.read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_daemonset_and_the_documented_training_pod_use_only_kubernetes_api_fields():
    config_map, daemonset = _docs()
    assert _round_trip(config_map, "V1ConfigMap") == config_map
    assert _round_trip(daemonset, "V1DaemonSet") == daemonset
    pod = _training_pod()
    assert _round_trip(pod, "V1Pod") == pod


def test_nvrx_socket_directory_is_a_host_path_the_training_pod_mounts_at_the_same_place(tmp_path):
    config_map, daemonset = _docs()
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    socket_dir = str(Path(load_config(path).daemon.nvhcd.socket or "/").parent)
    assert socket_dir == "/run/node-agent"
    spec = daemonset["spec"]["template"]["spec"]
    for pod, mode in ((spec, "DirectoryOrCreate"), (_training_pod()["spec"], "Directory")):
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == socket_dir]
        assert volumes[mount["name"]]["hostPath"] == {"path": socket_dir, "type": mode}
    endpoint = f"unix://{socket_dir}/nvhcd.sock"
    assert endpoint in _training_pod()["spec"]["containers"][0]["command"]


def test_daemonset_gets_nvml_from_the_nvidia_toolkit_without_taking_a_gpu():
    _, daemonset = _docs()
    spec = daemonset["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert spec["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_image_is_non_root_and_the_daemonset_names_root_for_the_daemon():
    users = [
        line.split()[1]
        for line in CONTAINERFILE.read_text().splitlines()
        if line.startswith("USER ")
    ]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    _, daemonset = _docs()
    context = daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert context["runAsUser"] == 0
