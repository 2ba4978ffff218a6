"""The shipped Slurm scripts (packaging/slurm/node-agent-{prolog,epilog,healthcheck}) on a REAL
Slurm (munge + slurmctld + slurmd on loopback, tests/slurm_cluster.py).

The prolog and the epilog run under the real slurmd, which starts them with an environment of
its own making (no PATH); the health check and the epilog also run under ``env -i`` with only
the scripts' own settings (``NODE_AGENT``, ``NODE_AGENT_CONFIG``, ``NODE_AGENT_LOG_DIR``) and
``SLURM_CONF`` (the test cluster's, where a real node has /etc/slurm/slurm.conf). The node's
GPUs are the simulator's (no GPU here): ``NODE_AGENT`` is a two-line wrapper that runs the
real agent with ``--simulate``; everything Slurm does is real and read back from Slurm.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as _slurm  # tests/slurm_cluster.py
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "packaging" / "slurm"
AGENT = Path(sys.executable).with_name("node-agent")
XID64 = [{"kind": "xid", "gpu": 5, "code": 64}]
ONLY_FINDERS = ("--only", "inventory,nvml_health,xid")
IDLE_HOOK = "#!/bin/sh\nexit 0\n"

# the real Slurm test cluster: one xdist worker runs every test that uses one
pytestmark = pytest.mark.xdist_group("slurm")


class HookedCluster(_slurm.SlurmCluster):
    """The test cluster with a Prolog and an Epilog, each a script the test rewrites."""

    @property
    def hooks(self) -> Path:
        return self.root / "hooks"

    def _slurm_conf(self, ctld_port: int, slurmd_port: int, fake_port: int) -> str:
        self.hooks.mkdir(parents=True, exist_ok=True)
        for hook in ("prolog", "epilog"):
            write_script(self.hooks / hook, IDLE_HOOK)
        conf = super()._slurm_conf(ctld_port, slurmd_port, fake_port)
        return conf + f"Prolog={self.hooks / 'prolog'}\nEpilog={self.hooks / 'epilog'}\n"


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture(scope="module")
def hooked_cluster(tmp_path_factory):
    reason = _slurm.missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = HookedCluster(root=tmp_path_factory.mktemp("slurm-hooks"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(hooked_cluster):
    _slurm.reset_cluster(hooked_cluster)
    for hook in ("prolog", "epilog"):
        write_script(hooked_cluster.hooks / hook, IDLE_HOOK)
    return hooked_cluster


@pytest.fixture
def settings(cluster, tmp_path, scenario):
    """The scripts' settings for one test: a config for the cluster's node, a log folder and an
    agent wrapper on a simulated node (``settings["faults"]`` chooses its faults)."""
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node": {"name": cluster.node},
                "state_dir": str(tmp_path / "state"),
                "adapter": {"name": "slurm", "slurm": {"timeout_s": 15}},
                "safety": {"max_drained_fraction": 0.5},
            }
        )
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    wrapper = tmp_path / "node-agent"
    values = {
        "NODE_AGENT": str(wrapper),
        "NODE_AGENT_CONFIG": str(config),
        "NODE_AGENT_LOG_DIR": str(logs),
    }

    def simulate(faults) -> None:
        write_script(wrapper, f'#!/bin/sh\nexec {AGENT} "$@" --simulate {scenario(faults)}\n')

    simulate([])
    return {"values": values, "logs": logs, "simulate": simulate, "config": config}


def hook(cluster, name: str, script: str, settings) -> None:
    """Make the cluster's ``name`` hook run the shipped ``script`` with the test's settings."""
    lines = [f"{key}={value}\nexport {key}\n" for key, value in settings["values"].items()]
    write_script(
        cluster.hooks / name, "#!/bin/sh\n" + "".join(lines) + f"exec {SCRIPTS / script}\n"
    )


def run_empty_env(script: str, settings, cluster, **overrides) -> subprocess.CompletedProcess:
    """``env -i`` with the settings and SLURM_CONF alone: no PATH, no HOME."""
    values = {**settings["values"], "SLURM_CONF": str(cluster.conf), **overrides}
    argv = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in values.items()), str(SCRIPTS / script)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def agent_drains(settings, cluster) -> None:
    """The agent's own state: out of service after an Xid 64 (its log adapter: Slurm's node is
    left as it is, as when the agent's drain could not reach slurmctld)."""
    proc = subprocess.run(
        [str(AGENT), "accept", *ONLY_FINDERS, "--act", "--adapter", "log",
         "--config", str(settings["config"]), "--simulate", settings["last_scenario"]],
        capture_output=True, text=True, timeout=120, env=cluster.env(),
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr


def wait_requeued(cluster, job: str, timeout_s: float = 30) -> dict[str, str]:
    """The job's fields once the prolog's refusal has put it back in the queue."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = cluster.show_job(job)
        if fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0":
            return fields
        time.sleep(0.3)
    raise AssertionError(f"job {job} was not requeued by the prolog: {fields}\n{cluster.logs()}")


def is_agents_fault_drain(node: dict[str, str]) -> bool:
    """Out of service by the agent's hand (its ``node-agent:`` reason) for the simulated Xid 64
    on gpu:5: drained, or FAIL (the agent's replace)."""
    reason, state = node.get("Reason", ""), node["State"]
    out = "DRAIN" in state or "FAIL" in state
    return out and reason.startswith("node-agent:") and "xid-64 gpu:5" in reason


@pytest.fixture
def drained_by_agent(settings, cluster, scenario):
    settings["last_scenario"] = scenario(XID64)
    agent_drains(settings, cluster)
    return settings


def test_prolog_under_slurmd_lets_a_job_run_on_a_node_in_service(cluster, settings):
    hook(cluster, "prolog", "node-agent-prolog", settings)
    job = cluster.submit()
    cluster.wait_job(job, "RUNNING")
    assert "DRAIN" not in cluster.show_node()["State"]


def test_prolog_refuses_job_on_node_agent_took_out_and_slurm_holds_it_until_released(
    cluster, drained_by_agent
):
    hook(cluster, "prolog", "node-agent-prolog", drained_by_agent)
    job = cluster.submit()
    fields = wait_requeued(cluster, job)
    assert fields["Reason"] == "launch_failed_requeued_held", fields
    assert fields["Priority"] == "0", fields
    node = cluster.show_node()
    assert "DRAIN" in node["State"] and node["Reason"].startswith("Prolog error"), node
    told = (drained_by_agent["logs"] / "node-agent-prolog.log").read_text()
    assert f"refusing job {job}" in told and f"scontrol release {job}" in told, told
    cluster.run("scontrol", "release", job)
    assert cluster.show_job(job)["Priority"] != "0"


def test_prolog_with_nohold_on_prolog_fail_requeues_the_refused_job_without_a_hold(
    cluster, drained_by_agent
):
    conf = cluster.conf.read_text()
    cluster.conf.write_text(conf + "SchedulerParameters=nohold_on_prolog_fail\n")
    try:
        cluster.run("scontrol", "reconfigure")
        hook(cluster, "prolog", "node-agent-prolog", drained_by_agent)
        job = cluster.submit()
        fields = wait_requeued(cluster, job)
        assert fields["Priority"] != "0", fields
        assert fields["Reason"] != "launch_failed_requeued_held", fields
        assert "Prolog error" in cluster.show_node()["Reason"]
    finally:
        cluster.conf.write_text(conf)
        cluster.run("scontrol", "reconfigure")


def test_epilog_under_slurmd_drains_node_a_job_left_with_xid64(cluster, settings):
    settings["simulate"](XID64)
    hook(cluster, "epilog", "node-agent-epilog", settings)
    job = cluster.submit(wrap="true")
    deadline = time.monotonic() + 60
    while not is_agents_fault_drain(cluster.show_node()) and time.monotonic() < deadline:
        time.sleep(0.5)
    node = cluster.show_node()
    assert is_agents_fault_drain(node), (
        job,
        node,
        cluster.logs(),
    )


def test_healthcheck_under_env_i_drains_with_node_agent_reason_and_exits_0(cluster, settings):
    settings["simulate"](XID64)
    proc = run_empty_env("node-agent-healthcheck", settings, cluster)
    assert proc.returncode == 0, (proc.stderr, (settings["logs"] / "node-agent-healthcheck.log"))
    node = cluster.show_node()
    assert is_agents_fault_drain(node), (node["State"], node.get("Reason"))


def test_healthcheck_under_env_i_makes_a_missing_agent_visible(cluster, settings):
    proc = run_empty_env("node-agent-healthcheck", settings, cluster, NODE_AGENT="node-agent-gone")
    assert proc.returncode == 127, proc
    assert "exit 127" in proc.stderr and "not checked" in proc.stderr, proc.stderr
    logged = (settings["logs"] / "node-agent-healthcheck.log").read_text()
    assert "exit 127" in logged, logged
    assert "DRAIN" not in cluster.show_node()["State"]


def test_epilog_under_env_i_logs_a_missing_agent_and_exits_0(cluster, settings):
    proc = run_empty_env("node-agent-epilog", settings, cluster, NODE_AGENT="node-agent-gone")
    assert proc.returncode == 0, proc
    logged = (settings["logs"] / "node-agent-epilog.log").read_text()
    assert "exit 127" in logged and "not checked" in logged, logged


def test_epilog_under_env_i_with_a_healthy_node_leaves_it_in_service(cluster, settings):
    proc = run_empty_env("node-agent-epilog", settings, cluster)
    assert proc.returncode == 0, proc
    logged = settings["logs"] / "node-agent-epilog.log"
    assert not logged.exists() or "failed" not in logged.read_text(), logged.read_text()
    assert "DRAIN" not in cluster.show_node()["State"]
