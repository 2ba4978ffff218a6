"""``node-agent accept/check --act --adapter slurm`` end to end against a REAL Slurm
(munge + slurmctld + slurmd on loopback, tests/slurm_cluster.py).

GPU faults come from the simulator (no GPU here); everything the scheduler does is real and is
read back from Slurm (``scontrol show node``, ``sinfo -R``). The test cluster has no
RebootProgram: the reboot request takes the adapter's documented stand-in (the node stays
drained, ``reboot-unavailable:``), and a second run with the fault gone plays the node after
its reboot.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

XID79 = [{"kind": "xid", "gpu": 5, "code": 79}]
ROW_REMAP_PENDING = [{"kind": "row_remap_pending", "gpu": 2}]


@pytest.fixture
def node_agent(slurm, tmp_path):
    """Run the real CLI with a config whose node.name is the Slurm node, SLURM_CONF set."""
    def write_config(**safety) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({
            "node": {"name": slurm.node}, "state_dir": str(tmp_path / "state"),
            "adapter": {"name": "log", "slurm": {"timeout_s": 15}},
            **({"safety": safety} if safety else {})}))
        return str(path)

    config = {"path": write_config(max_drained_fraction=0.5)}

    def run(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", "import sys; from node_agent.cli import main; "
                "sys.exit(main())", *args, "--config", config["path"]]
        return subprocess.run(argv, capture_output=True, text=True, timeout=240,
                              env=slurm.env(), cwd=tmp_path)

    run.configure = lambda **safety: config.update(path=write_config(**safety))  # type: ignore[attr-defined]
    return run


def test_xid79_accept_act_leaves_node_drained_with_reason_naming_the_fault(slurm, node_agent,
                                                                           scenario):
    proc = node_agent("accept", "--simulate", scenario(XID79), "--act", "--adapter", "slurm")
    assert proc.returncode == 4, proc.stderr  # FAULT
    fields = slurm.show_node()
    assert "DRAIN" in fields["State"] or "FAIL" in fields["State"], fields
    reason = fields["Reason"]
    assert reason.startswith("node-agent:")
    assert "FAULT" in reason and "79" in reason and "gpu:5" in reason, reason
    listed = [line for line in slurm.sinfo_reasons().splitlines()
              if line.startswith(f"{slurm.node}|")]
    assert listed and "79" in listed[0] and "gpu:5" in listed[0], slurm.sinfo_reasons()


def test_node_drained_by_hand_is_never_resumed_by_the_agent(slurm, node_agent, scenario):
    slurm.run("scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN",
              "Reason=bad DIMM, ticket 4711")
    for faults in (ROW_REMAP_PENDING, []):  # an ERROR to remediate, then a clean node
        node_agent("check", "--simulate", scenario(faults), "--act", "--adapter", "slurm")
        fields = slurm.show_node()
        assert "DRAIN" in fields["State"], fields
        assert fields["Reason"].startswith("bad DIMM, ticket 4711"), fields


def test_error_drains_requests_reboot_retests_and_resumes(slurm, node_agent, scenario):
    first = node_agent("accept", "--simulate", scenario(ROW_REMAP_PENDING), "--act",
                       "--adapter", "slurm")
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


def test_blast_radius_refuses_drain_when_share_already_drained_by_agent(slurm, node_agent,
                                                                        scenario):
    for fake in slurm.fake_nodes[:2]:  # 2 of 4 nodes already drained by the agent
        slurm.run("scontrol", "update", f"NodeName={fake}", "State=DRAIN",
                  "Reason=node-agent: FAULT xid79 gpu:0")
    node_agent.configure(max_drained_fraction=0.25)
    proc = node_agent("accept", "--simulate", scenario(XID79), "--act", "--adapter", "slurm")
    out = proc.stdout + proc.stderr
    assert "refused" in out, out
    assert "DRAIN" not in slurm.show_node()["State"]
    assert "FAIL" not in slurm.show_node()["State"]
    status = node_agent("status", "--json")
    assert "refused" in status.stdout, status.stdout
