"""``node-agent accept/check --act --adapter slurm`` end to end against a REAL Slurm
(munge + slurmctld + slurmd on loopback, tests/slurm_cluster.py).

GPU faults come from the simulator (no GPU here); everything the scheduler does is real and is
read back from Slurm (``scontrol show node``, ``sinfo -R``, ``scontrol show job``). A hung
training job is a real batch job; its ``training-hang`` grade is built here (the check's own
tests cover how it is found). The test cluster has no
RebootProgram: the reboot request takes the adapter's documented stand-in (the node stays
drained, ``reboot-unavailable:``), and a second run with the fault gone plays the node after
its reboot.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cloud_metadata_standin import MetadataStandIn  # tests/cloud_metadata_standin.py

from node_agent.model import Action, Grade, Level, Reason, utc_iso
from node_agent.remediation.executor import Remediator
from node_agent.remediation.plan import Safety
from node_agent.remediation.store import open_store
from node_agent.schedulers.slurm import JOB_NOT_RUNNING, SlurmAdapter

XID64 = [{"kind": "xid", "gpu": 5, "code": 64}]
ROW_REMAP_PENDING = [{"kind": "row_remap_pending", "gpu": 2}]

#: one Slurm cluster per worker: its tests share it (pytest-xdist)
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.fixture
def node_agent(slurm, tmp_path):
    """Run the real CLI with a config whose node.name is the Slurm node, SLURM_CONF set."""

    def write_config(**safety) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "node": {"name": slurm.node},
                    "state_dir": str(tmp_path / "state"),
                    "adapter": {"name": "log", "slurm": {"timeout_s": 15}},
                    **({"safety": safety} if safety else {}),
                }
            )
        )
        return str(path)

    config = {"path": write_config(max_drained_fraction=0.5)}

    def run(*args: str) -> subprocess.CompletedProcess:
        argv = [
            sys.executable,
            "-c",
            "import sys; from node_agent.commands.main import main; sys.exit(main())",
            *args,
            "--config",
            config["path"],
        ]
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=240, env=slurm.env(), cwd=tmp_path
        )

    run.configure = lambda **safety: config.update(path=write_config(**safety))  # type: ignore[attr-defined]
    return run


# The delivery runs here are about what the agent does through Slurm, not the load tests: the
# checks that find these faults (an Xid 64 in the kernel log, a pending row remap in NVML) are
# enough, and the other checks would pass on the stand-in node anyway.
ONLY_FINDERS = ("--only", "inventory,nvml_health,xid")


def test_xid64_accept_act_leaves_node_drained_with_reason_naming_the_fault(
    slurm, node_agent, scenario
):
    proc = node_agent(
        "accept", "--simulate", scenario(XID64), *ONLY_FINDERS, "--act", "--adapter", "slurm"
    )
    assert proc.returncode == 4, proc.stderr  # FAULT
    fields = slurm.show_node()
    assert "DRAIN" in fields["State"] or "FAIL" in fields["State"], fields
    reason = fields["Reason"]
    assert reason.startswith("node-agent:")
    assert "FAULT" in reason and "64" in reason and "gpu:5" in reason, reason
    listed = [
        line for line in slurm.sinfo_reasons().splitlines() if line.startswith(f"{slurm.node}|")
    ]
    assert listed and "64" in listed[0] and "gpu:5" in listed[0], slurm.sinfo_reasons()


def test_node_drained_by_hand_is_never_resumed_by_the_agent(slurm, node_agent, scenario):
    slurm.drain("bad DIMM, ticket 4711")
    for faults in (ROW_REMAP_PENDING, []):  # an ERROR to remediate, then a clean node
        node_agent("check", "--simulate", scenario(faults), "--act", "--adapter", "slurm")
        fields = slurm.show_node()
        assert "DRAIN" in fields["State"], fields
        assert fields["Reason"].startswith("bad DIMM, ticket 4711"), fields


def test_error_drains_requests_reboot_retests_and_resumes(slurm, node_agent, scenario):
    first = node_agent(
        "accept",
        "--simulate",
        scenario(ROW_REMAP_PENDING),
        *ONLY_FINDERS,
        "--act",
        "--adapter",
        "slurm",
    )
    assert first.returncode == 3, first.stderr  # ERROR
    out = first.stdout + first.stderr
    assert "reboot-unavailable:" in out  # the documented stand-in: no RebootProgram here
    fields = slurm.show_node()
    assert "DRAIN" in fields["State"], fields
    assert fields["Reason"].startswith("node-agent: ERROR row-remap-pending gpu:2"), fields
    # The node "after its reboot": the fault is gone; the agent re-tests and resumes it.
    second = node_agent("check", "--simulate", scenario([]), "--act", "--adapter", "slurm")
    assert "DRAIN" not in slurm.show_node()["State"], (second.stdout, second.stderr)
    assert slurm.node not in slurm.run("sinfo", "-R", "--noheader", "-o", "%N").stdout


def test_blast_radius_refuses_drain_when_share_already_drained_by_agent(
    slurm, node_agent, scenario
):
    for fake in slurm.fake_nodes[:2]:  # 2 of 4 nodes already drained by the agent
        slurm.drain("node-agent: FAULT xid64 gpu:0", fake)
    node_agent.configure(max_drained_fraction=0.25)
    proc = node_agent(
        "accept", "--simulate", scenario(XID64), *ONLY_FINDERS, "--act", "--adapter", "slurm"
    )
    out = proc.stdout + proc.stderr
    assert "refused" in out, out
    assert "DRAIN" not in slurm.show_node()["State"]
    assert "FAIL" not in slurm.show_node()["State"]
    status = node_agent("status", "--json")
    assert "refused" in status.stdout, status.stdout


class _Report:
    """The fields of a Report the remediator reads."""

    def __init__(self, grade: Grade):
        self.grade, self.suite, self.mode = grade, "periodic", "service"

    def to_dict(self) -> dict:
        return {"grade": self.grade.to_dict()}


def slurm_remediator(store, slurm, state_dir: Path | None) -> Remediator:
    """The remediator of ``slurm``'s real node, through the Slurm adapter, default safety."""
    return Remediator(
        store,
        SlurmAdapter(env=slurm.env()),
        slurm.node,
        Safety(),
        state_dir=state_dir,
        warn=lambda _m: None,
    )


def _hang(job: str, uid: int = 0) -> Grade:
    """The grade training_progress gives a verified job's hang: the job carries the hung
    process's uid (the test's jobs run as root, sbatch as root)."""
    return Grade(
        Level.ERROR,
        Action.RESTART,
        (
            Reason(
                "training-hang",
                Level.ERROR,
                f"job:slurm:{job}@uid:{uid}/rank:0",
                "rank 0 (pid 4242) made no step for 412 s; stuck in all_reduce",
            ),
        ),
    )


def test_hung_job_is_requeued_through_slurm_and_the_node_stays_in_service(slurm, tmp_path):
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    store = open_store(tmp_path / "state")
    try:
        rem = slurm_remediator(store, slurm, tmp_path / "state")
        out = rem.remediate(_Report(_hang(job)))
        assert [(r.action, r.outcome) for r in out.records] == [("restart-job", "done")], out
        assert slurm.show_job(job)["Restarts"] == "1"
        node = slurm.show_node()
        assert "DRAIN" not in node["State"] and "Reason" not in node, node
        assert store.node_record(slurm.node).state == "in-service"
        # the check sees the hang again while Slurm kills the job: not requeued twice
        again = rem.remediate(_Report(_hang(job)))
        assert again.records == [] and any("dedup" in n for n in again.notes)
        assert slurm.show_job(job)["Restarts"] == "1"
    finally:
        store.close()


def test_a_hung_process_naming_another_users_job_gets_no_requeue(slurm, tmp_path):
    """The hung process runs as uid 1001 and its job id is root's running job: the remediator
    records the restart as failed with the adapter's refusal, and Slurm's job is untouched."""
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    store = open_store(tmp_path / "state")
    try:
        rem = slurm_remediator(store, slurm, tmp_path / "state")
        out = rem.remediate(_Report(_hang(job, uid=1001)))
        (rec,) = out.records
        assert (rec.action, rec.outcome) == ("restart-job", "failed"), rec
        assert "belongs to uid 0" in rec.detail and "uid 1001" in rec.detail, rec.detail
        fields = slurm.show_job(job)
        assert (fields["JobState"], fields["Restarts"]) == ("RUNNING", "0"), fields
    finally:
        store.close()


def test_recovered_job_restart_after_the_requeue_happened_is_not_repeated(slurm, tmp_path):
    """The agent died after `scontrol requeue` and before closing its journal row: the next
    run sends it again, Slurm says the job is no longer running, nothing is requeued twice."""
    job = slurm.submit()
    slurm.wait_job(job, "RUNNING")
    slurm.run("scontrol", "requeue", job)  # what the interrupted run had done
    store = open_store(tmp_path / "state")
    try:
        store.journal_plan(
            key=f"{slurm.node}|restart-job|training-hang@job:slurm:{job}@uid:0|0",
            node=slurm.node,
            action="restart-job",
            reason=f"node-agent: ERROR training-hang job slurm:{job}@uid:0",
            fault_code="training-hang",
            target=f"job:slurm:{job}@uid:0",
            attempt=0,
            to_state=None,
            trigger="auto",
            adapter="slurm",
            now=0.0,
            state="started",
        )
        out = slurm_remediator(store, slurm, None).recover()
        (rec,) = out.records
        assert rec.outcome == "done" and JOB_NOT_RUNNING in rec.detail, rec.detail
        assert slurm.show_job(job)["Restarts"] == "1"
        assert store.open_journal(slurm.node) == []
    finally:
        store.close()


def test_a_planned_maintenance_drains_naming_the_event_and_resumes_after_it(
    slurm, node_agent, scenario, tmp_path
):
    """The cloud's metadata service is a stand-in on loopback serving GCP's documented API
    (no cloud here: tests/cloud_metadata_standin.py); Slurm and the CLI are real."""
    soon = time.time() + 10 * 60
    window = {
        "type": "SCHEDULED",
        "maintenance_status": "PENDING",
        "window_start_time": utc_iso(soon),
        "window_end_time": utc_iso(soon + 3600),
    }
    with MetadataStandIn() as cloud:
        suite = tmp_path / "cloud.yaml"
        suite.write_text(
            yaml.safe_dump(
                {
                    "name": "cloud",
                    "mode": "service",
                    "checks": [
                        {
                            "check": "cloud_maintenance",
                            "timeout_s": 10,
                            "params": {"provider": "gcp", "metadata_url": cloud.url},
                        }
                    ],
                }
            )
        )

        def check() -> subprocess.CompletedProcess:
            return node_agent(
                "check",
                "--suite",
                str(suite),
                "--simulate",
                scenario([]),
                "--json",
                "--act",
                "--adapter",
                "slurm",
            )

        cloud.gcp_event, cloud.gcp_upcoming = "TERMINATE_ON_HOST_MAINTENANCE", window
        first = check()
        assert first.returncode == 3, first.stderr  # ERROR, remedy planned
        actions = [(a["action"], a["outcome"]) for a in json.loads(first.stdout)["actions"]]
        assert actions == [("drain", "done")], first.stdout  # no reboot, no replacement
        fields = slurm.show_node()
        assert "DRAIN" in fields["State"], fields
        assert fields["Reason"].startswith(
            "node-agent: ERROR cloud-maintenance node planned gcp TERMINATE_ON_HOST_MAINTENANCE "
            f"from {utc_iso(soon)}"
        ), fields
        # the event stands: still drained, nothing more done
        second = check()
        assert json.loads(second.stdout)["actions"] == [], second.stdout
        assert "DRAIN" in slurm.show_node()["State"]
        # the event is over (the metadata service announces nothing): the re-test resumes it
        cloud.gcp_event, cloud.gcp_upcoming = "NONE", None
        third = check()
        assert third.returncode == 0, third.stderr
        assert [a["action"] for a in json.loads(third.stdout)["actions"]] == ["resume"]
        assert "DRAIN" not in slurm.show_node()["State"]
        assert slurm.node not in slurm.run("sinfo", "-R", "--noheader", "-o", "%N").stdout
