"""The hang state survives between runs, a corrupt one is moved aside, evidence is bounded."""

from __future__ import annotations

import json

from node_agent.training import state as hang_state
from node_agent.training.state import HangState


def test_state_round_trips_between_runs(tmp_path):
    s = HangState.load(tmp_path, now=1.0)
    s.processes["10:5"] = {"agree_since": 100.0}
    s.save()
    again = HangState.load(tmp_path, now=2.0)
    assert again.processes == {"10:5": {"agree_since": 100.0}} and again.problem is None


def test_a_corrupt_state_file_is_moved_aside_and_said(tmp_path):
    (tmp_path / "state.json").write_text('{"schema": "node-agent.hang-st')  # truncated
    s = HangState.load(tmp_path, now=1234.0)
    assert s.processes == {} and "moved to state.json.corrupt-1234" in s.problem
    assert (tmp_path / "state.json.corrupt-1234").read_text().startswith('{"schema"')


def test_evidence_files_are_named_by_job_and_the_oldest_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(hang_state, "KEEP_EVIDENCE", 2)
    s = HangState(tmp_path)
    paths = [
        s.write_evidence("slurm:12/../../etc", 1_700_000_000.0 + i, {"i": i}) for i in range(3)
    ]
    left = sorted(p.name for p in (tmp_path / "evidence").iterdir())
    assert left == sorted(p.name for p in paths[1:])
    assert all("/" not in p.name.removesuffix(".json") for p in paths)
    assert json.loads(paths[-1].read_text()) == {"i": 2}
