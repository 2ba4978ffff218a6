"""The slurm adapter against a REAL Slurm: munge + slurmctld + slurmd on loopback
(tests/slurm_cluster.py, Debian packages munge slurmctld slurmd slurm-client).

Every assertion about the node's state is read back from Slurm itself (``scontrol show node``,
``sinfo -R``), not from the adapter. The only stand-in is the hung ``scontrol`` (a script that
sleeps), because a real scontrol cannot be made to hang on demand.
"""

from __future__ import annotations

import re
import stat
import sys
from pathlib import Path

import pytest

from node_agent.config import config_from_dict
from node_agent.schedulers import AdapterError, AdapterStatus, open_adapter
from node_agent.schedulers.slurm import (
    JOB_NOT_RUNNING,
    REBOOT_UNAVAILABLE,
    SlurmAdapter,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster as _slurm  # noqa: E402

#: one Slurm cluster per worker: its tests share it (pytest-xdist)
pytestmark = pytest.mark.xdist_group("slurm")


def adapter_for(cluster, **slurm_cfg) -> SlurmAdapter:
    """The adapter as the CLI builds it (open_adapter from a config), talking to ``cluster``."""
    config = config_from_dict({"adapter": {"name": "slurm", "slurm": slurm_cfg}})
    adapter = open_adapter(config)
    assert isinstance(adapter, SlurmAdapter)
    adapter.env = cluster.env()
    return adapter


def test_node_drained_by_hand_reports_its_own_reason_not_the_agents(slurm):
    slurm.drain("bad DIMM, ticket 4711")
    state = adapter_for(slurm).node_state(slurm.node)
    assert state.drained
    assert state.reason == "bad DIMM, ticket 4711"
    assert not state.drained_by_agent  # the remediation must not resume this node
    assert slurm.show_node()["Reason"].startswith("bad DIMM, ticket 4711")


def test_list_nodes_reports_every_node_with_its_drain_state(slurm):
    slurm.drain("node-agent: FAULT xid79 gpu:1", slurm.fake_nodes[0])
    slurm.drain("maintenance", slurm.fake_nodes[1])
    nodes = {n.name: n for n in adapter_for(slurm).list_nodes()}
    assert set(nodes) == set(slurm.all_nodes)
    assert nodes[slurm.fake_nodes[0]].drained_by_agent
    assert nodes[slurm.fake_nodes[1]].drained and not nodes[slurm.fake_nodes[1]].drained_by_agent
    assert not nodes[slurm.node].drained
    agent_share = sum(n.drained_by_agent for n in nodes.values()) / len(nodes)
    assert agent_share == 1 / len(slurm.all_nodes)


def test_replace_sets_fail_state_with_replace_reason(slurm):
    adapter = adapter_for(slurm)
    adapter.replace(slurm.node, "FAULT row_remap_failure gpu:2")
    fields = slurm.show_node()
    assert "FAIL" in fields["State"]
    assert fields["Reason"].startswith("node-agent: replace: FAULT row_remap_failure gpu:2")
    state = adapter.node_state(slurm.node)
    assert state.drained and state.drained_by_agent
    # (sinfo appends "*" while slurmctld waits for the node's next ping after a state change)
    assert re.search(rf"^{slurm.node}\|fail\*?\|node-agent: replace:", slurm.sinfo_reasons(), re.M)


def test_reboot_without_reboot_program_leaves_node_drained_and_says_so(slurm):
    """The CI stand-in: this cluster has no RebootProgram, so Slurm cannot reboot."""
    adapter = adapter_for(slurm)
    outcome = adapter.restart(slurm.node, "ERROR row_remap_pending gpu:2")
    assert outcome.status is AdapterStatus.DONE  # the node is out of service for the re-test
    detail = outcome.detail
    assert detail.startswith(REBOOT_UNAVAILABLE)
    assert "RebootProgram" in detail
    fields = slurm.show_node()
    assert "DRAIN" in fields["State"]
    assert fields["Reason"].startswith("node-agent: ERROR row_remap_pending gpu:2")


def test_reboot_keeps_an_existing_agent_drain_reason(slurm):
    adapter = adapter_for(slurm)
    adapter.drain(slurm.node, "ERROR xid48 gpu:3")
    adapter.restart(slurm.node, "restart 1/2 for xid48")
    assert slurm.show_node()["Reason"].startswith("node-agent: ERROR xid48 gpu:3")


@pytest.fixture(scope="module")
def rebootable_cluster(tmp_path_factory):
    """A second real cluster whose slurm.conf has a RebootProgram (``/bin/true``: the request
    goes through Slurm for real; the host does not actually reboot)."""
    reason = _slurm.missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = _slurm.start_cluster(
        tmp_path_factory.mktemp("slurm-reboot"), reboot_program="/bin/true"
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def test_reboot_request_with_reboot_program_is_accepted_by_slurm(rebootable_cluster):
    cluster = rebootable_cluster
    adapter = adapter_for(cluster)
    detail = adapter.restart(cluster.node, "ERROR xid79 gpu:5").detail
    assert "reboot requested" in detail
    fields = cluster.show_node()
    # ASAP: Slurm drains the node and marks the reboot (REBOOT_REQUESTED, or REBOOT_ISSUED
    # once slurmctld has passed it to slurmd's RebootProgram).
    assert "REBOOT" in fields["State"], fields
    assert fields.get("Reason", "").startswith("node-agent: ERROR xid79 gpu:5"), fields
    assert adapter.node_state(cluster.node).drained_by_agent or "REBOOT" in fields["State"]


def test_hung_scontrol_raises_adapter_error_after_its_timeout(slurm, tmp_path):
    """A stand-in scontrol that hangs (a real one cannot be made to on demand)."""
    hung = tmp_path / "scontrol-hangs"
    hung.write_text("#!/bin/sh\nsleep 300\n")
    hung.chmod(hung.stat().st_mode | stat.S_IXUSR)
    adapter = adapter_for(slurm, scontrol=str(hung), timeout_s=0.5)
    with pytest.raises(AdapterError, match="did not finish within"):
        adapter.drain(slurm.node, "FAULT xid79 gpu:5")
    assert "DRAIN" not in slurm.show_node()["State"]


def test_failing_scontrol_raises_adapter_error_with_its_stderr(slurm):
    adapter = adapter_for(slurm)
    with pytest.raises(AdapterError, match="Node no-such-node not found") as err:
        adapter.drain("no-such-node", "FAULT xid79 gpu:5")
    assert "node.name" in str(err.value)  # tells the operator what to fix


def test_scontrol_missing_is_adapter_error_naming_the_key(slurm, tmp_path):
    adapter = adapter_for(slurm, scontrol=str(tmp_path / "nope" / "scontrol"))
    with pytest.raises(AdapterError, match="adapter.slurm.scontrol"):
        adapter.node_state(slurm.node)


def test_node_name_that_is_not_a_hostname_is_refused_before_scontrol_runs(slurm, tmp_path):
    marker = tmp_path / "ran"
    spy = tmp_path / "scontrol-spy"
    spy.write_text(f"#!/bin/sh\ntouch {marker}\n")
    spy.chmod(0o755)
    adapter = adapter_for(slurm, scontrol=str(spy))
    for bad in ("na-node1 State=RESUME", "-h", "../x", "a;b", ""):
        with pytest.raises(AdapterError, match="node name"):
            adapter.drain(bad, "FAULT")
    assert not marker.exists()


# -- restart_job: a hung training job is requeued, the node is left alone ---------------------
HANG_REASON = "node-agent: ERROR training-hang job slurm:{} rank:0 made no step for 412 s"


def test_restart_job_requeues_a_real_batch_job_running_on_the_node(slurm):
    job = slurm.submit()
    running = slurm.wait_job(job, "RUNNING")
    assert running["NodeList"] == slurm.node and running["Restarts"] == "0"
    outcome = adapter_for(slurm).restart_job(
        slurm.node, f"slurm:{job}@uid:0", HANG_REASON.format(job)
    )
    detail = outcome.detail
    assert outcome.status is AdapterStatus.DONE
    assert detail.startswith(f"slurm: requeued job {job}"), detail
    fields = slurm.show_job(job)
    assert fields["Restarts"] == "1", fields
    # requeued: killed on the node (COMPLETING), then back in the queue (PENDING, BeginTime)
    assert fields["JobState"] in ("REQUEUED", "COMPLETING", "PENDING"), fields
    slurm.wait_job(job, "PENDING")
    node = slurm.show_node()
    assert "DRAIN" not in node["State"] and "Reason" not in node, node  # the node untouched


def test_restart_job_refuses_a_job_running_on_another_node_and_does_not_requeue_it(slurm):
    """The agent of na-fake1 is handed the id of a job that runs on na-node1 (a job id from
    an untrusted heartbeat file): Slurm's own allocation says no."""
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    other = slurm.fake_nodes[0]
    with pytest.raises(
        AdapterError,
        match=rf"restarts only Slurm jobs running on {other}; "
        rf"job slurm:{job}@uid:0 runs on {slurm.node}",
    ):
        adapter_for(slurm).restart_job(other, f"slurm:{job}@uid:0", HANG_REASON.format(job))
    fields = slurm.show_job(job)
    assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "0"), fields


def test_restart_job_leaves_a_job_that_is_not_running_alone(slurm):
    job = slurm.submit("--hold")
    slurm.wait_job(job, "PENDING")
    outcome = adapter_for(slurm).restart_job(
        slurm.node, f"slurm:{job}@uid:0", HANG_REASON.format(job)
    )
    assert outcome.status is AdapterStatus.ALREADY, outcome
    assert outcome.detail.startswith(JOB_NOT_RUNNING) and "PENDING" in outcome.detail
    assert slurm.show_job(job)["Restarts"] == "0"


def test_restart_job_of_a_job_slurm_does_not_know_names_the_id(slurm):
    with pytest.raises(AdapterError, match="job slurm:999999@uid:0 is not known to Slurm"):
        adapter_for(slurm).restart_job(slurm.node, "slurm:999999@uid:0", HANG_REASON.format(999999))


def test_restart_job_of_a_no_requeue_job_fails_with_what_to_do(slurm):
    job = slurm.submit("--no-requeue")
    slurm.wait_job(job, "RUNNING")
    with pytest.raises(AdapterError, match="--no-requeue.*scancel"):
        adapter_for(slurm).restart_job(slurm.node, f"slurm:{job}@uid:0", HANG_REASON.format(job))
    assert slurm.show_job(job)["JobState"] == "RUNNING"


def test_restart_job_refuses_an_array_id_naming_several_tasks(slurm):
    job = slurm.submit("--array=1-3", "--hold")
    with pytest.raises(AdapterError, match="listed 3 record"):
        adapter_for(slurm).restart_job(slurm.node, f"slurm:{job}@uid:0", HANG_REASON.format(job))


def test_restart_job_refuses_another_users_job_and_does_not_requeue_it(slurm):
    """The job runs as root (sbatch as root); the hung process that named it runs as uid
    1001: a user's process may put any SLURM_JOB_ID in its environment."""
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    with pytest.raises(
        AdapterError,
        match=rf"REFUSED: not requeueing Slurm job {job}: it "
        r"belongs to uid 0, but the hung process that named "
        r"it runs as uid 1001",
    ):
        adapter_for(slurm).restart_job(slurm.node, f"slurm:{job}@uid:1001", HANG_REASON.format(job))
    fields = slurm.show_job(job)
    assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "0"), fields


def test_restart_job_refuses_a_job_id_without_the_processes_uid(slurm, tmp_path):
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    with pytest.raises(AdapterError, match="does not carry the uid of the hung process"):
        adapter_for(slurm).restart_job(slurm.node, f"slurm:{job}", HANG_REASON.format(job))
    assert slurm.show_job(job)["Restarts"] == "0"


@pytest.mark.parametrize(
    "job",
    [
        "pod:ml/trainer-0",
        "torchelastic:abc",
        "slurm:1;reboot",
        "slurm:1 State=RESUME",
        "slurm:-h",
        "slurm:12_x",
        "slurm:",
        "slurm:1@uid:0;reboot",
        "slurm:1@uid:-1",
        "slurm:1@uid:0@uid:0",
    ],
)
def test_restart_job_refuses_other_or_hostile_job_ids_before_any_slurm_command(
    slurm, tmp_path, job
):
    marker = tmp_path / "ran"
    spy = tmp_path / "spy"
    spy.write_text(f"#!/bin/sh\ntouch {marker}\n")
    spy.chmod(0o755)
    adapter = adapter_for(slurm, scontrol=str(spy), squeue=str(spy))
    with pytest.raises(AdapterError, match="job id|restarts only Slurm jobs running on"):
        adapter.restart_job(slurm.node, job, "ERROR training-hang")
    assert not marker.exists()
