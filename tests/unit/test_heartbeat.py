"""node_agent.heartbeat: the in-training progress heartbeat (stdlib only, never raises)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from node_agent.heartbeat import SCHEMA, Heartbeat, identity_from_env, read_heartbeats


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_beat_writes_one_complete_file_per_process_and_no_temp_files(tmp_path):
    hb = Heartbeat(tmp_path, rank=3, job="test-job")
    hb.beat(7)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{os.getpid()}.json"]
    record = json.loads((tmp_path / files[0]).read_text())
    assert record["schema"] == SCHEMA and record["pid"] == os.getpid()
    assert record["step"] == 7 and record["rank"] == 3 and record["job"] == "test-job"
    assert [r for _, r in read_heartbeats(tmp_path)] == [record]


def test_beats_within_min_interval_are_not_written_and_step_time_is_the_window_mean(tmp_path):
    clock = FakeClock()
    hb = Heartbeat(tmp_path, min_interval_s=1.0, clock=clock)
    hb.beat(0)
    for step in range(1, 8):  # 7 steps of 0.125 s (exact in binary): inside the interval
        clock.t += 0.125
        hb.beat(step)
    assert hb.writes == 1
    assert json.loads(hb.path.read_text())["step"] == 0
    clock.t += 0.125
    hb.beat(8)  # 1.0 s after the first write
    record = json.loads(hb.path.read_text())
    assert hb.writes == 2 and record["step"] == 8
    assert record["step_time_s"] == 0.125


def test_beat_without_step_counts_steps_itself(tmp_path):
    clock = FakeClock()
    hb = Heartbeat(tmp_path, clock=clock)
    for _ in range(5):
        hb.beat()
        clock.t += 2.0
    assert json.loads(hb.path.read_text())["step"] == 4


def test_beat_never_raises_on_an_unwritable_spool_and_warns_once(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    clock = FakeClock()
    hb = Heartbeat(blocker / "heartbeat", clock=clock)
    with caplog.at_level("WARNING", logger="node_agent.heartbeat"):
        for step in range(3):
            hb.beat(step)
            clock.t += 5.0
    assert hb.failures == 3 and hb.writes == 0
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()


def test_identity_comes_from_the_launchers_environment():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "SLURM_JOB_ID": "4242",
           "TORCHELASTIC_RUN_ID": "run-x"}
    ident = identity_from_env(env)
    assert (ident["rank"], ident["local_rank"], ident["world_size"]) == (5, 1, 16)
    assert ident["job"] == "slurm:4242" and ident["torchelastic_run_id"] == "run-x"
    assert identity_from_env({"TORCHELASTIC_RUN_ID": "run-x"})["job"] == "torchelastic:run-x"
    assert identity_from_env({"KUBERNETES_POD_NAME": "trainer-0"})["job"] == "pod:trainer-0"
    assert identity_from_env({"HOSTNAME": "trainer-1", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
                             )["job"] == "pod:trainer-1"
    # outside Kubernetes HOSTNAME is the node, not a job: the launcher's pid groups the ranks
    bare = identity_from_env({"HOSTNAME": "node7", "RANK": "x"}, ppid=999)
    assert bare["job"] == "ppid:999" and bare["rank"] is None


def test_heartbeat_module_imports_without_torch_or_the_agent(tmp_path):
    code = ("import sys; import node_agent.heartbeat as h; "
            "bad = [m for m in ('torch', 'yaml', 'psutil', 'node_agent.checks') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_read_heartbeats_reports_a_foreign_file_and_skips_temp_files(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / ".123.abc.tmp").write_text("half")
    Heartbeat(tmp_path).beat(1)
    errors: list = []
    beats = read_heartbeats(tmp_path, errors)
    assert [r["step"] for _, r in beats] == [1]
    assert [p.name for p, _ in errors] == ["junk.json"]


def test_sdc_probe_step_beats_the_heartbeat_it_was_given(tmp_path):
    sdc = pytest.importorskip("node_agent.sdc.probes", reason="torch is not installed")
    hb = Heartbeat(tmp_path / "heartbeat", min_interval_s=0.0)
    probe = sdc.SdcProbe("cpu", spool_dir=tmp_path / "sdc", heartbeat=hb)
    for _ in range(3):
        probe.step()
    assert json.loads(hb.path.read_text())["step"] == 2 and hb.writes == 3


def test_a_declared_pause_is_written_at_once_and_cleared_after_without_a_slow_step(tmp_path):
    clock, wall = FakeClock(), FakeClock(1_000.0)
    hb = Heartbeat(tmp_path, min_interval_s=1.0, clock=clock, wall=wall)
    for step in range(3):
        clock.t += 0.5
        wall.t += 0.5
        hb.beat(step)
    with hb.pause("checkpoint", max_s=900):
        record = json.loads(hb.path.read_text())
        assert record["pause"] == {"reason": "checkpoint", "since": wall.t, "max_s": 900.0}
        clock.t += 300
        wall.t += 300
    after = json.loads(hb.path.read_text())
    assert after["pause"] is None and after["step_at"] == wall.t  # fresh after the pause
    assert after["step_time_s"] == 0.5  # 300 s of checkpoint is not a 300 s step
    clock.t += 1.0
    wall.t += 1.0
    hb.beat(3)
    assert json.loads(hb.path.read_text())["step_time_s"] == 1.0


def test_the_log_file_comes_from_the_argument_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NODE_AGENT_TRAIN_LOG", "/logs/train.log")
    hb = Heartbeat(tmp_path)
    hb.beat(0)
    assert json.loads(hb.path.read_text())["log_file"] == "/logs/train.log"
    hb2 = Heartbeat(tmp_path / "b", log_file=tmp_path / "mine.log")
    hb2.beat(0)
    assert json.loads(hb2.path.read_text())["log_file"] == str(tmp_path / "mine.log")


def test_compute_time_is_the_mean_of_compute_s_given_since_the_last_write(tmp_path):
    clock = FakeClock()
    hb = Heartbeat(tmp_path, min_interval_s=1.0, clock=clock)
    hb.beat(0, compute_s=0.1)
    assert json.loads(hb.path.read_text())["compute_time_s"] == 0.1
    for step, compute in ((1, 0.25), (2, 0.75)):
        clock.t += 0.5
        hb.beat(step, compute_s=compute)
    record = json.loads(hb.path.read_text())
    assert record["compute_time_s"] == 0.5 and record["step_time_s"] == 0.5
