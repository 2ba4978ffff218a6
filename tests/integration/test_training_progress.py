"""``training_progress`` against real training-like processes that write heartbeats.

Each worker is a real Python process looping over ``Heartbeat.beat(step)`` with ``RANK`` set;
the check runs through the real CLI (``node-agent check --suite <suite with
training_progress>``), whose ``spool_dir`` param names the heartbeat spool under ``tmp_path``. py-spy (in the dev
extras) samples their stacks; the tests whose hang needs the stack to agree skip when it may
not ptrace the workers, and one test runs without py-spy on purpose.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from slurm_cgroup import slurm_job_fixture  # noqa: F401 - the slurm_job fixture
from training_graders import split_thresholds, use_training_thresholds

from node_agent.peers import free_loopback_port
from node_agent.training.stacks import find_py_spy

WORKER = '''
import os, sys, time
from node_agent.heartbeat import Heartbeat

spool, step_s, stop_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]


def stop_participating():
    """The injected fault: this rank stops stepping (sleeps outside any collective)."""
    while True:
        time.sleep(60)


hb = Heartbeat(spool, min_interval_s=0.2)
step = 0
while True:
    hb.beat(step)
    if os.path.exists(f"{stop_file}.rank{os.environ.get('RANK')}"):  # stop this rank only
        stop_participating()
    time.sleep(step_s)
    step += 1
'''

GLOO_WORKER = '''
import os, sys, time
import torch
import torch.distributed as dist
from node_agent.heartbeat import Heartbeat

spool, stop_file = sys.argv[1], sys.argv[2]


def stop_participating():
    """The injected fault: this rank stops joining the all-reduce (sleeps outside it) until
    the stop file is removed."""
    while os.path.exists(stop_file):
        time.sleep(0.2)


dist.init_process_group("gloo")
rank = dist.get_rank()
hb = Heartbeat(spool, min_interval_s=0.2)
t = torch.ones(1024)
step = 0
while True:
    hb.beat(step)
    if rank == dist.get_world_size() - 1 and os.path.exists(stop_file):
        stop_participating()
    dist.all_reduce(t)
    time.sleep(0.02)
    step += 1
'''


JOB = "job:unverified:torchelastic:test-job"  # a run id has no kernel witness
SLURM_JOB = "4242"  # a job slurmd's cgroup holds the workers in (the slurm_job fixture)
VERIFIED = f"job:slurm:{SLURM_JOB}@uid:{os.geteuid()}"  # the uid travels with a Slurm job


def _in_slurm_job(cgroups, procs) -> None:
    for p in procs:
        cgroups.adopt(p.pid, SLURM_JOB)


SYNC_WORKER = """
import os, sys, time
import torch
import torch.distributed as dist
from node_agent.heartbeat import Heartbeat

dist.init_process_group("gloo")
rank = dist.get_rank()
work_s = 0.12 if rank == dist.get_world_size() - 1 else 0.03  # the last rank is 4x slower
hb = Heartbeat(sys.argv[1], min_interval_s=0.2)
t = torch.ones(1024)
step = 0
while True:
    began = time.monotonic()
    time.sleep(work_s)                       # this rank's forward and backward
    compute_s = time.monotonic() - began
    dist.all_reduce(t)                       # everyone waits for the slowest here
    hb.beat(step, compute_s=compute_s)
    step += 1
"""


def _suite(tmp_path: Path, **params) -> str:
    """A suite of training_progress alone; ``params`` override the check's defaults, its
    thresholds among them through the run's graders directory (tests/training_graders.py)."""
    path = tmp_path / "progress-suite.yaml"
    params, thresholds = split_thresholds(params)
    use_training_thresholds(tmp_path, thresholds)
    params = {"spool_dir": str(_spool(tmp_path)), **params}
    path.write_text(
        yaml.safe_dump(
            {
                "name": "progress",
                "mode": "service",
                "checks": [{"check": "training_progress", "timeout_s": 60, "params": params}],
            }
        )
    )
    return str(path)


FAST = {"stall_after_s": 2, "straggler_for_s": 0, "stack_samples": 2, "stack_interval_s": 0.5}


def _spool(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "heartbeat"


def _start(tmp_path: Path, source: str, args: list[str], env_by_rank: list[dict[str, str]]):
    script = tmp_path / "worker.py"
    script.write_text(source)
    procs = []
    for extra in env_by_rank:
        env = {**os.environ, "TORCHELASTIC_RUN_ID": "test-job", **extra}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    return procs


def _stop(procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def _wait_for_steps(spool: Path, pids: list[int], min_step: int, deadline_s: float, procs) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        steps = {}
        for pid in pids:
            with contextlib.suppress(OSError, ValueError):
                steps[pid] = json.loads((spool / f"{pid}.json").read_text())
        if len(steps) == len(pids) and all(
            r["step"] >= min_step and r["step_time_s"] for r in steps.values()
        ):
            return
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"worker exited: {dead[0].stderr.read().decode()[-2000:]}"
        time.sleep(0.1)
    pytest.fail(f"workers did not write heartbeats with step >= {min_step} in {deadline_s} s")


def _poll(agent, suite: str, until, deadline_s: float = 90):
    """Run the check until ``until(report)``; every report seen is returned."""
    seen = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        run = agent("check", "--suite", suite, "--json")
        assert run.code in (0, 3), run.stderr
        seen.append((run.code, run.json()))
        if until(seen[-1][1]):
            return seen
    pytest.fail(
        f"condition not reached within {deadline_s} s; last report: "
        f"{json.dumps(seen[-1][1]['results'], indent=1)[:3000] if seen else None}"
    )


def _by_metric(report, metric):
    return [r for r in report["results"] if r["metric"] == metric]


def _one_straggler(agent, tmp_path: Path, straggler_for_s: float):
    """Run the check until it names a straggler: (every report seen, the last, its straggler).
    The grade is WARN (exit 0): a straggler is never acted on."""
    seen = _poll(
        agent,
        _suite(tmp_path, **{**FAST, "straggler_for_s": straggler_for_s}),
        lambda rep: _by_metric(rep, "training_straggler"),
    )
    code, report = seen[-1]
    assert code == 0 and report["grade"]["level"] == "WARN"
    (slow,) = _by_metric(report, "training_straggler")
    return seen, report, slow


def _require_stacks(pid: int) -> None:
    """Skip unless py-spy can read ``pid``: within a minute a hang needs the still stack to
    agree with the silent heartbeat (alone, the heartbeat takes hang_after_s, 300 s)."""
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.skip("py-spy is not installed (it is in the dev extras): no stack signal")
    done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"py-spy may not read the workers here (ptrace): {done.stderr[-200:]!r}")


def _stack(result: dict) -> dict:
    return result["evidence"]["signals"]["stack"]


def test_rank_that_stops_stepping_is_reported_hung_and_grades_error(agent, tmp_path, slurm_job):
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    procs = _start(
        tmp_path,
        WORKER,
        [str(spool), "0.05", str(stop)],
        [{"RANK": str(r), "WORLD_SIZE": "3", "SLURM_JOB_ID": SLURM_JOB} for r in range(3)],
    )
    _in_slurm_job(slurm_job, procs)
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 3, 60, procs)
        _require_stacks(procs[2].pid)
        suite = _suite(tmp_path, **FAST)
        before = agent("check", "--suite", suite, "--json")
        assert before.code == 0, before.stderr
        assert not _by_metric(before.json(), "training_hang")
        assert {r["target"] for r in _by_metric(before.json(), "training_progress")} == {
            f"{VERIFIED}/rank:0",
            f"{VERIFIED}/rank:1",
            f"{VERIFIED}/rank:2",
        }, [(r["metric"], r["target"], r["status"], r["detail"]) for r in before.json()["results"]]

        (tmp_path / "stop.rank2").touch()  # rank 2 stops stepping; it stays alive
        seen = _poll(agent, suite, lambda rep: _by_metric(rep, "training_hang"))
        code, report = seen[-1]
        assert code == 3 and report["grade"]["level"] == "ERROR"
        (hang,) = _by_metric(report, "training_hang")
        assert hang["target"] == f"{VERIFIED}/rank:2" and hang["status"] == "fail"
        assert "rank 2" in hang["detail"] and f"slurm:{SLURM_JOB}" in hang["detail"]
        assert hang["evidence"]["pid"] == procs[2].pid and hang["value"] >= 2  # rounded to 0.1 s
        assert hang["evidence"]["verified"] is True
        stack = _stack(hang)
        assert stack["available"] and stack["identical"], stack
        assert "stop_participating" in stack["stuck_in"]
        assert "heartbeat" in hang["evidence"]["agreeing"]
        # the evidence of the hang is kept in the state dir for the people who debug it
        evidence = json.loads(Path(hang["evidence"]["evidence_file"]).read_text())
        assert evidence["job"] == f"slurm:{SLURM_JOB}" and len(evidence["processes"]) == 3
        # the healthy ranks are never called hung
        assert all(
            r["target"] == f"{VERIFIED}/rank:2"
            for _, rep in seen
            for r in _by_metric(rep, "training_hang")
        )
        assert {r["target"] for r in _by_metric(report, "training_progress")} == {
            f"{VERIFIED}/rank:0",
            f"{VERIFIED}/rank:1",
        }
    finally:
        _stop(procs)
    # the processes are gone: their heartbeats are ignored, nothing is hung any more
    after = agent("check", "--suite", _suite(tmp_path, **FAST), "--json")
    assert after.code == 0, after.stderr
    (result,) = after.json()["results"]
    assert result["status"] == "skip" and "exited processes" in result["detail"]


def test_a_hang_of_a_job_the_kernel_does_not_vouch_for_is_a_warn_naming_its_uid(agent, tmp_path):
    """A torchelastic run id is the user's word only (no slurmd or kubepods cgroup): the same
    stopped rank is a WARN naming the uid, never an ERROR, and no evidence file is written
    (anyone can make such a hang; the newest 200 files are kept, and real hangs' must stay)."""
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    procs = _start(
        tmp_path,
        WORKER,
        [str(spool), "0.05", str(stop)],
        [{"RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)],
    )
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 3, 60, procs)
        (tmp_path / "stop.rank1").touch()
        suite = _suite(tmp_path, **{**FAST, "hang_after_s": 3})  # the heartbeat alone decides
        seen = _poll(agent, suite, lambda rep: _by_metric(rep, "training_hang"))
        code, report = seen[-1]
        assert code == 0 and report["grade"]["level"] == "WARN", report["grade"]
        (hang,) = _by_metric(report, "training_hang")
        assert hang["target"] == f"{JOB}/rank:1" and hang["status"] == "warn"
        assert hang["evidence"]["verified"] is False and hang["evidence"]["uid"] == os.geteuid()
        assert f"uid {os.geteuid()}'s rank 1" in hang["detail"]
        assert "nothing is restarted" in hang["detail"]
        assert "evidence_file" not in hang["evidence"] or not hang["evidence"]["evidence_file"]
        assert not (tmp_path / "state" / "hang" / "evidence").exists() or not list(
            (tmp_path / "state" / "hang" / "evidence").iterdir()
        )
    finally:
        _stop(procs)


def test_rank_three_times_slower_is_a_straggler_warn_never_a_hang(agent, tmp_path):
    spool = _spool(tmp_path)
    procs = _start(
        tmp_path,
        WORKER,
        [str(spool), "0.05", str(tmp_path / "never")],
        [{"RANK": "0"}, {"RANK": "1"}],
    )
    script = tmp_path / "worker.py"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test-job", "RANK": "2"}
    procs.append(
        subprocess.Popen(
            [sys.executable, str(script), str(spool), "0.15", str(tmp_path / "never")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    )
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 3, 60, procs)
        seen, report, slow = _one_straggler(agent, tmp_path, straggler_for_s=2)
        assert slow["target"] == f"{JOB}/rank:2" and slow["status"] == "warn"
        assert slow["value"] >= 2 and "median" in slow["detail"]
        assert len(seen) >= 2  # persistently slow: seen in more than one run before the WARN
        assert not [r for _, rep in seen for r in _by_metric(rep, "training_hang")]
    finally:
        _stop(procs)


def test_no_training_process_is_a_skip_that_says_how_to_instrument(agent, tmp_path):
    run = agent("check", "--suite", _suite(tmp_path), "--json")
    assert run.code == 0, run.stderr
    (result,) = run.json()["results"]
    assert result["status"] == "skip"
    assert "none writes heartbeats (node_agent.heartbeat)" in result["detail"]


def test_hang_without_py_spy_says_the_stack_signal_is_unavailable(agent, tmp_path):
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    (tmp_path / "stop.rank0").touch()  # stops at step 0
    procs = _start(tmp_path, WORKER, [str(spool), "0.05", str(stop)], [{"RANK": "0"}])
    try:
        deadline = time.monotonic() + 60
        while not (spool / f"{procs[0].pid}.json").exists():
            assert time.monotonic() < deadline, "worker wrote no heartbeat"
            time.sleep(0.1)
        no_py_spy = str(tmp_path / "no-such-py-spy")
        # stalled, but with the stack unreadable only one signal says so: not yet a hang
        early = agent("check", "--suite", _suite(tmp_path, **FAST, py_spy=no_py_spy), "--json")
        assert early.code in (0, 3), early.stderr
        # past hang_after_s the heartbeat alone is enough
        suite = _suite(tmp_path, **FAST, hang_after_s=3, py_spy=no_py_spy)
        seen = _poll(agent, suite, lambda rep: _by_metric(rep, "training_hang"))
        (hang,) = _by_metric(seen[-1][1], "training_hang")
        stack = _stack(hang)
        assert stack["available"] is False and "command not found" in stack["detail"]
        assert "stack unavailable" in hang["detail"] and "heartbeat alone" in hang["detail"]
    finally:
        _stop(procs)


#: the periodic suite's default ``stall_after_s``; the slack covers the ranks' last step (a
#: rank already in a step when the stop file appears finishes it) and the stack samples
STALL_S, STALL_SLACK_S = 30.0, 5.0


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: no gloo all-reduce to hang",
)
def test_gloo_allreduce_hang_is_reported_within_60_s_naming_the_stopped_rank_as_origin(
    agent, tmp_path, slurm_job
):
    """The issue's scenario, with the periodic suite's defaults (stall 30 s, 3 stack samples
    1 s apart) and the check run every 15 s as the daemon does: three real ranks all-reduce
    over gloo; rank 2 stops joining (sleeps outside the collective), then resumes."""
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    port = str(free_loopback_port())
    procs = _start(
        tmp_path,
        GLOO_WORKER,
        [str(spool), str(stop)],
        [
            {
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "SLURM_JOB_ID": SLURM_JOB,
            }
            for r in range(3)
        ],
    )
    _in_slurm_job(slurm_job, procs)
    every_s = 15.0
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 5, 120, procs)
        _require_stacks(procs[2].pid)
        suite = _suite(tmp_path)
        before = agent("check", "--suite", suite, "--json")
        assert before.code == 0, before.stderr
        assert len(_by_metric(before.json(), "training_progress")) == 3

        stop.touch()  # rank 2 stops joining the all-reduce; ranks 0 and 1 block inside it
        stopped = time.monotonic()
        seen = []  # (seconds from the stop to the start of a check run, its report)
        while True:
            tick = time.monotonic()
            run = agent("check", "--suite", suite, "--json")
            assert run.code in (0, 3), run.stderr
            seen.append((tick - stopped, run.json()))
            if len(_by_metric(seen[-1][1], "training_hang")) == 3:
                break
            if seen[-1][0] >= STALL_S + STALL_SLACK_S:
                break
            time.sleep(max(0.0, every_s - (time.monotonic() - tick)))
        # At the latest the first run that starts once the ranks have been silent for the stall
        # threshold names every rank: with the daemon's 15 s cadence, within 30 + 15 s of the
        # hang and one run (a bound in the check's own terms, so on any machine: how long a run
        # takes is the machine's speed)
        started_s, report = seen[-1]
        hangs = {r["target"]: r for r in _by_metric(report, "training_hang")}
        assert set(hangs) == {f"{VERIFIED}/rank:0", f"{VERIFIED}/rank:1", f"{VERIFIED}/rank:2"}, (
            started_s,
            report,
        )
        assert report["grade"]["level"] == "ERROR"
        origin, waiting = hangs[f"{VERIFIED}/rank:2"], hangs[f"{VERIFIED}/rank:0"]
        assert origin["evidence"]["likely_origin"] is True
        assert "likely origin" in origin["detail"]
        assert "stop_participating" in _stack(origin)["stuck_in"]
        assert waiting["evidence"]["likely_origin"] is False
        assert _stack(waiting)["in_collective"] is True

        stop.unlink()  # rank 2 joins again: the job makes progress, nothing is hung any more
        _wait_for_steps(
            spool,
            [p.pid for p in procs],
            max(json.loads((spool / f"{p.pid}.json").read_text())["step"] for p in procs) + 5,
            60,
            procs,
        )
        after = agent("check", "--suite", suite, "--json")
        assert after.code == 0, after.stderr
        assert not _by_metric(after.json(), "training_hang")
        assert len(_by_metric(after.json(), "training_progress")) == 3
    finally:
        _stop(procs)


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: no gloo all-reduce to synchronise ranks",
)
def test_straggler_in_a_synchronous_job_is_found_from_the_compute_time_before_the_collective(
    agent, tmp_path
):
    """In a synchronous all-reduce job every rank's step time is the slowest rank's; the rank
    that is slow shows only in the time it spends before the collective (``compute_s``)."""
    spool = _spool(tmp_path)
    port = str(free_loopback_port())
    procs = _start(
        tmp_path,
        SYNC_WORKER,
        [str(spool)],
        [
            {"RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(3)
        ],
    )
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 5, 120, procs)
        seen, report, slow = _one_straggler(agent, tmp_path, straggler_for_s=1)
        assert (
            slow["target"] == f"{JOB}/rank:2" and slow["evidence"]["compared"] == "compute_time_s"
        )
        assert slow["value"] >= 2 and "compute time per step" in slow["detail"]
        step_times = [r["evidence"]["step_time_s"] for r in report["results"]]
        assert max(step_times) < 1.5 * min(step_times)  # the step times alone show nothing
        assert not [r for _, rep in seen for r in _by_metric(rep, "training_hang")]
    finally:
        _stop(procs)


def test_heartbeats_of_exited_processes_older_than_stale_file_s_are_removed(agent, tmp_path):
    """Removed through directory fds that follow no link (heartbeat.remove_stale); a recent
    one of an exited process stays (its job may be restarting)."""
    spool = _spool(tmp_path)
    for _ in range(2):
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\nfrom node_agent.heartbeat import "
                "Heartbeat\nHeartbeat(sys.argv[1], min_interval_s=0).beat(1)",
                str(spool),
            ],
            check=True,
            env={**os.environ, "RANK": "0"},
        )
    old, recent = sorted(spool.glob("*.json"))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    run = agent("check", "--suite", _suite(tmp_path, stale_file_s=3600), "--json")
    assert run.code == 0, run.stderr
    assert not old.exists() and recent.exists()
