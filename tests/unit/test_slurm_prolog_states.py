"""The shipped Slurm prolog runs a job only on a node the agent has in service.

The prolog runs as shipped, under ``sh`` with an empty environment as slurmd gives it; the agent
it asks is a stub script printing what ``node-agent status --json`` prints, for every
remediation state there is (``NodeState``). Under the real slurmd:
tests/integration/test_slurm_scripts.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from node_agent.remediation.states import NodeState

PROLOG = Path(__file__).resolve().parents[2] / "packaging" / "slurm" / "node-agent-prolog"


def run_prolog(tmp_path: Path, state: str) -> subprocess.CompletedProcess:
    agent = tmp_path / "node-agent"
    status = json.dumps({"remediation": {"state": state}})
    agent.write_text(f"#!/bin/sh\nprintf '%s\\n' '{status}'\n")
    agent.chmod(0o755)
    return subprocess.run(
        ["/bin/sh", str(PROLOG)],
        env={
            "NODE_AGENT": str(agent),
            "NODE_AGENT_LOG_DIR": str(tmp_path),
            "SLURM_JOB_ID": "42",
            "SLURMD_NODENAME": "gpu-07",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("state", [s.value for s in NodeState])
def test_the_prolog_refuses_a_job_in_every_state_but_in_service(tmp_path, state):
    done = run_prolog(tmp_path, state)
    if state == NodeState.IN_SERVICE.value:
        assert (done.returncode, done.stderr) == (0, "")
    else:
        assert done.returncode == 1, done.stderr
        assert f"node gpu-07 is '{state}'" in done.stderr
        assert "scontrol release 42" in done.stderr
        assert "refusing job 42" in (tmp_path / "node-agent-prolog.log").read_text()
