"""node_agent.heartbeat: the in-training progress heartbeat (stdlib only, never raises)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from node_agent.atomic_file import ensure_spool_dirs, ensure_user_spool
from node_agent.heartbeat import (
    SCHEMA,
    Heartbeat,
    heartbeat_file,
    identity_from_env,
    read_heartbeats,
    remove_stale,
)


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_beat_writes_one_complete_file_per_process_and_no_temp_files(tmp_path):
    spool = tmp_path / "heartbeat"
    hb = Heartbeat(spool, rank=3, job="test-job")
    hb.beat(7)
    files = sorted(p.name for p in spool.iterdir())
    assert files == [f"{os.getpid()}.json"]
    record = json.loads((spool / files[0]).read_text())
    assert record["schema"] == SCHEMA and record["pid"] == os.getpid()
    assert record["step"] == 7 and record["rank"] == 3 and record["job"] == "test-job"
    assert [r for _, r in read_heartbeats(spool)] == [record]


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
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "16",
        "SLURM_JOB_ID": "4242",
        "TORCHELASTIC_RUN_ID": "run-x",
    }
    ident = identity_from_env(env)
    assert (ident["rank"], ident["local_rank"], ident["world_size"]) == (5, 1, 16)
    assert ident["job"] == "slurm:4242" and ident["torchelastic_run_id"] == "run-x"
    assert identity_from_env({"TORCHELASTIC_RUN_ID": "run-x"})["job"] == "torchelastic:run-x"
    assert identity_from_env({"KUBERNETES_POD_NAME": "trainer-0"})["job"] == "pod:trainer-0"
    assert (
        identity_from_env({"HOSTNAME": "trainer-1", "KUBERNETES_SERVICE_HOST": "10.0.0.1"})["job"]
        == "pod:trainer-1"
    )
    # outside Kubernetes HOSTNAME is the node, not a job: the launcher's pid groups the ranks
    bare = identity_from_env({"HOSTNAME": "node7", "RANK": "x"}, ppid=999)
    assert bare["job"] == "ppid:999" and bare["rank"] is None


def test_heartbeat_module_imports_without_torch_or_the_agent(tmp_path):
    code = (
        "import sys; import node_agent.heartbeat as h; "
        "bad = [m for m in ('torch', 'yaml', 'psutil', 'node_agent.checks') if m in sys.modules]; "
        "print(bad)"
    )
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


# -- clean strings -----------------------------------------------------------------------------


def _beat(**extra) -> str:
    return json.dumps(
        {"schema": SCHEMA, "pid": os.getpid(), "step": 1, "step_at": 1.0, **extra},
        ensure_ascii=True,
    )


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"job": "\ud800"}, "lone surrogate"),  # valid JSON, no text: \ud800
        ({"pause": {"reason": "x\udfff", "since": 1.0, "max_s": 1.0}}, "lone surrogate"),
        ({"log_file": "/tmp/a\0b"}, "NUL byte"),
        ({"\ud800": 1}, "lone surrogate"),  # in a key too
        ({"job": "slurm:1\x1b[2J"}, "control character U+001B"),
        ({"hostname": "a\u202eb"}, "control character U+202E"),
        ({"log_file": "train.log"}, "not an absolute path"),
        ({"log_file": "/logs/a\nb.log"}, "control character U+000A"),
    ],
)
def test_a_heartbeat_with_unusable_text_is_refused_naming_its_writer(tmp_path, extra, why):
    (tmp_path / "bad.json").write_text(_beat(**extra))
    (tmp_path / "good.json").write_text(_beat(job="slurm:1", log_file="/logs/train.log"))
    errors: list = []
    beats = read_heartbeats(tmp_path, errors)
    assert [p.name for p, _ in beats] == ["good.json"]
    ((path, reason),) = errors
    assert path.name == "bad.json" and why in reason and f"written by uid {os.getuid()}" in reason


def test_a_surrogate_pair_is_text_and_is_kept(tmp_path):
    (tmp_path / "ok.json").write_text(_beat(job="\ud83d\ude80-run"))  # one astral character
    ((_, record),) = read_heartbeats(tmp_path)
    assert record["job"] == "\U0001f680-run"


# -- where each uid writes, and what the reader believes ---------------------------------------


def _shared(path):
    path.mkdir(mode=0o755)
    path.chmod(0o1777)  # the node's spool: sticky, writable by everyone
    return path


def test_in_a_shared_spool_each_uid_writes_in_its_own_private_directory(tmp_path):
    spool = _shared(tmp_path / "heartbeat")
    hb = Heartbeat(spool, min_interval_s=0)
    hb.beat(3)
    own = spool / str(os.geteuid())
    assert hb.path == own / f"{os.getpid()}.json" == heartbeat_file(spool, os.getpid())
    st = os.lstat(own)
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (os.geteuid(), "0o700")
    ((path, record),) = read_heartbeats(spool)
    assert path == hb.path and record["step"] == 3
    hb.close()
    assert not hb.path.exists()


def test_a_uid_directory_squatted_by_another_user_neither_blocks_the_writer_nor_is_read(tmp_path):
    """Root runs the test: a directory chowned to another uid is what that user would make."""
    spool = _shared(tmp_path / "heartbeat")
    squat = spool / str(os.geteuid())
    squat.mkdir()
    os.chown(squat, 54321, 54321)
    (squat / f"{os.getpid()}.json").write_text(_beat(step=99))  # a forged beat in it
    os.chown(squat / f"{os.getpid()}.json", 54321, 54321)
    hb = Heartbeat(spool, min_interval_s=0)
    hb.beat(5)
    assert hb.path.parent == spool and hb.path.name.startswith(f"{os.getpid()}.")
    assert hb.path.name != f"{os.getpid()}.json"  # a name nobody could have guessed
    errors: list = []
    ((path, record),) = read_heartbeats(spool, errors)
    assert path == hb.path and record["step"] == 5
    assert any(p == squat and "owned by uid 54321" in why for p, why in errors), errors


def test_a_uid_directory_others_may_write_to_is_not_believed(tmp_path):
    spool = _shared(tmp_path / "heartbeat")
    loose = spool / "54321"
    loose.mkdir()
    (loose / "1.json").write_text(_beat())
    os.chown(loose, 54321, 54321)
    loose.chmod(0o777)
    errors: list = []
    assert read_heartbeats(spool, errors) == []
    assert any(p == loose and "mode 0777" in why for p, why in errors), errors
    loose.chmod(0o700)
    assert len(read_heartbeats(spool)) == 1  # listed by its name, owned by that uid


def test_ensure_user_spool_takes_a_squatted_name_back_for_its_uid(tmp_path):
    spool = _shared(tmp_path / "heartbeat")
    squat = spool / "54321"
    (squat / "deep").mkdir(parents=True)
    os.symlink("/etc/passwd", squat / "deep" / "link")
    os.chown(squat, 4242, 4242)
    note = ensure_user_spool(spool, 54321)
    assert note and "taken by uid 4242" in note
    st = os.lstat(squat)
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (54321, "0o700")
    assert list(squat.iterdir()) == [] and sorted(p.name for p in spool.iterdir()) == ["54321"]
    assert os.path.exists("/etc/passwd")  # a link inside was removed, never followed
    assert ensure_user_spool(spool, 54321) is None  # nothing left to do
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert ensure_user_spool(private, 54321) is None and not (private / "54321").exists()


def test_ensure_spool_dirs_makes_reachable_spools_whatever_the_umask(tmp_path):
    code = (
        "import os, sys; os.umask(0o077); from node_agent.atomic_file import "
        "ensure_spool_dirs; print(ensure_spool_dirs(sys.argv[1]))"
    )
    root = tmp_path / "var" / "spool" / "node-agent"
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    modes = {
        p: oct(os.stat(p).st_mode & 0o7777)
        for p in (root.parent, root, root / "heartbeat", root / "sdc")
    }
    assert modes == {
        root.parent: "0o755",
        root: "0o755",
        root / "heartbeat": "0o1777",
        root / "sdc": "0o1777",
    }
    root.chmod(0o700)  # what an older agent under umask 077 left
    assert any("made it 0755" in n for n in ensure_spool_dirs(root))
    assert oct(os.stat(root).st_mode & 0o7777) == "0o755"


def test_remove_stale_never_follows_a_uid_directory_swapped_for_a_link(tmp_path):
    """The uid's directory is its owner's to rename: made a link to another directory after
    the read, root's removal must not reach through it."""
    spool = _shared(tmp_path / "heartbeat")
    own = spool / "54321"
    own.mkdir(mode=0o700)
    (own / "7.json").write_text(_beat())
    os.chown(own, 54321, 54321)
    (spool / "8.json").write_text(_beat())
    old = 1_000.0
    for f in (own / "7.json", spool / "8.json"):
        os.utime(f, (old, old))
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "7.json").write_text("root's")
    os.utime(victim / "7.json", (old, old))
    paths = [p for p, _ in read_heartbeats(spool)]
    assert sorted(p.name for p in paths) == ["7.json", "8.json"]
    own.rename(spool / ".moved")
    os.symlink(victim, own)  # the swap
    assert remove_stale(spool, paths, now=old + 100_000, older_than_s=86_400) == [spool / "8.json"]
    assert (victim / "7.json").read_text() == "root's"
    os.unlink(own)
    (spool / ".moved").rename(own)
    assert remove_stale(spool, paths, now=old + 100_000, older_than_s=86_400) == [own / "7.json"]
    assert (
        remove_stale(spool, [tmp_path / "etc" / "7.json"], now=old + 100_000, older_than_s=0) == []
    )  # never outside the spool
