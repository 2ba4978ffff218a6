"""The container image (packaging/container/), built for real and run as the DaemonSet runs it.

``make image``'s builder (packaging/container/build-image) builds it with whichever of docker,
podman and buildah works here; the base comes from Debian's registry or, where none can be
reached, from Debian's packages (debootstrap). A cold build takes minutes; the base tarball,
the wheels and the builder's layers are cached (``~/.cache/node-agent/image``), so a warm one
takes about a minute and a half. Inside the image: ``node-agent check --simulate`` on a healthy
H100 exits 0 as the image's non-root user, and the daemon, as root on the host's network as in
packaging/kubernetes/daemonset.yaml, serves /metrics that a real Prometheus scrapes. The GPUs
are the simulator's (no GPU here). Skips, with the reason, where this host cannot build an
image (no working builder; no registry and no debootstrap as root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from node_agent.peers import free_loopback_port

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "container" / "build-image"
TAG = "localhost/node-agent:test"
SCENARIOS = "/scenarios"  # REPO/scenarios, mounted read-only
UNBUILDABLE = 3  # build-image's exit status for "this host cannot build an image"

# one build (the module's ``image``) for every test, on one xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.xdist_group("image")]


class Image:
    """The built image and how to run a command in it with the builder that built it."""

    def __init__(self, builder: str, ref: str) -> None:
        self.builder, self.ref = builder, ref
        self.containers: list[str] = []  # buildah's working containers, removed at the end

    def config(self) -> dict:
        if self.builder == "buildah":
            out = subprocess.run(
                ["buildah", "inspect", "--type", "image", self.ref],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout  # fmt: skip
            return json.loads(out)["OCIv1"]["config"]
        out = subprocess.run(
            [self.builder, "image", "inspect", self.ref],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        return json.loads(out)[0]["Config"]

    def argv(
        self,
        args: list[str],
        mounts: dict[Path, str],
        user: str | None,
        writable: dict[Path, str] | None = None,
    ) -> list[str]:
        """The command line that runs the image's entrypoint with ``args`` on the host's
        network (as ``hostNetwork: true``), ``mounts`` read-only and ``writable`` not, as
        ``user`` (None: the image's own)."""
        volumes = [f"--volume={host}:{inside}:ro" for host, inside in mounts.items()]
        volumes += [f"--volume={host}:{inside}" for host, inside in (writable or {}).items()]
        as_user = [f"--user={user}"] if user else []
        if self.builder == "buildah":
            # buildah run runs a command, not the entrypoint: take the image's own
            entrypoint = self.config()["Entrypoint"]
            return ["buildah", "run", "--isolation", "chroot", *volumes, *as_user,
                    self.container(), "--", *entrypoint, *args]  # fmt: skip
        return [self.builder, "run", "--rm", "--network=host", *volumes, *as_user, self.ref, *args]

    def container(self) -> str:
        out = subprocess.run(
            ["buildah", "from", "--quiet", self.ref],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        name = out.stdout.strip()
        self.containers.append(name)
        return name

    def cleanup(self) -> None:
        for name in self.containers:
            subprocess.run(["buildah", "rm", name], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def image():
    if os.geteuid() != 0 and shutil.which("docker") is None:
        pytest.skip("building the image needs root (buildah, debootstrap) or a docker daemon")
    proc = subprocess.run(
        [sys.executable, str(BUILD), "--tag", TAG],
        capture_output=True, text=True, timeout=1700, cwd=REPO,
    )  # fmt: skip
    if proc.returncode == UNBUILDABLE:
        pytest.skip(f"this host cannot build the image: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = proc.stdout.strip().splitlines()[-1]  # "built TAG with BUILDER on BASE: SIZE in S"
    built_image = Image(built.split(" with ")[1].split()[0], TAG)
    try:
        yield built_image
    finally:
        built_image.cleanup()


def poll(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    return None


def fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def test_image_runs_as_a_non_root_user_with_node_agent_as_its_entrypoint(image):
    config = image.config()
    assert config["User"].split(":")[0] not in ("", "0", "root"), config
    assert config["Entrypoint"] == ["/opt/node-agent/bin/node-agent"], config


def test_check_in_the_image_on_a_simulated_healthy_h100_exits_0(image):
    argv = image.argv(
        ["check", "--simulate", f"{SCENARIOS}/healthy-h100.yaml"],
        {REPO / "scenarios": SCENARIOS},
        user=None,
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "HEALTHY" in proc.stdout or "WARN" in proc.stdout, proc.stdout[-3000:]


def test_daemon_in_the_image_serves_metrics_a_real_prometheus_scrapes(image, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus server not installed (Debian package prometheus)")
    port, prom_port = free_loopback_port(), free_loopback_port()
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir(mode=0o755)
    (etc / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "daemon": {
                    "listen": f"127.0.0.1:{port}",
                    "nvhcd": {"socket": "/run/node-agent/nvhcd.sock"},
                }
            }
        )
    )
    argv = image.argv(  # the DaemonSet's command, its NVRx socket on a host directory
        ["daemon", "--keep-socket", "--config", "/etc/node-agent/config.yaml",
         "--simulate", f"{SCENARIOS}/healthy-h100.yaml"],
        {REPO / "scenarios": SCENARIOS, etc: "/etc/node-agent"},
        user="0:0",  # the DaemonSet's runAsUser
        writable={run: "/run/node-agent"},
    )  # fmt: skip
    daemon = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    scrape = tmp_path / "prometheus.yml"
    scrape.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "node-agent",
                        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                    }
                ],
            }
        )
    )
    server = subprocess.Popen(
        [prometheus, f"--config.file={scrape}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        metrics = poll(lambda: fetch(f"http://127.0.0.1:{port}/metrics"), 120)
        assert metrics and "node_agent_health_level" in (metrics or ""), (
            daemon.poll(),
            daemon.stderr.read()[-3000:] if daemon.poll() is not None else "",
        )
        query = (
            f"http://127.0.0.1:{prom_port}/api/v1/query?query="
            "node_agent_health_level%7Bjob%3D%22node-agent%22%7D"
        )

        def scraped():
            answer = json.loads(fetch(query) or "{}")
            return answer.get("data", {}).get("result")

        result = poll(scraped, 60)
        assert result, "Prometheus did not scrape the daemon in the image"
        assert result[0]["value"][1] == "0"  # HEALTHY
        assert stat.S_ISSOCK((run / "nvhcd.sock").stat().st_mode)  # where a training pod finds it
    finally:
        server.terminate()
        server.wait(timeout=30)
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=30)
