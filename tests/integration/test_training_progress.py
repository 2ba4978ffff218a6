"""``training_progress`` against real training-like processes that write heartbeats.

Each worker is a real Python process looping over ``Heartbeat.beat(step)`` with ``RANK`` set;
the check runs through the real CLI (``node-agent check --suite <suite with
training_progress>``), whose config's state dir holds the heartbeat spool. When py-spy is
installed (it is in the dev venv) and may ptrace the workers, the hang carries their stacks;
where it may not, the stack signal must say unavailable with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

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
    """The injected fault: this rank stops joining the all-reduce (sleeps outside it)."""
    while True:
        time.sleep(60)


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


def _suite(tmp_path: Path, **params) -> str:
    path = tmp_path / "progress-suite.yaml"
    path.write_text(yaml.safe_dump({"name": "progress", "mode": "service", "checks": [
        {"check": "training_progress", "timeout_s": 60,
         "params": {"stack_samples": 2, "stack_interval_s": 0.5, **params}}]}))
    return str(path)


def _spool(tmp_path: Path) -> Path:
    return tmp_path / "state" / "spool" / "heartbeat"


def _start(tmp_path: Path, source: str, args: list[str], env_by_rank: list[dict[str, str]]):
    script = tmp_path / "worker.py"
    script.write_text(source)
    procs = []
    for extra in env_by_rank:
        env = {**os.environ, "TORCHELASTIC_RUN_ID": "test-job", **extra}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
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
                r["step"] >= min_step and r["step_time_s"] for r in steps.values()):
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
    pytest.fail(f"condition not reached within {deadline_s} s; last report: "
                f"{json.dumps(seen[-1][1]['results'], indent=1)[:3000] if seen else None}")


def _by_metric(report, metric):
    return [r for r in report["results"] if r["metric"] == metric]


def _assert_stack_signal(stack: dict, innermost: str) -> None:
    if stack["available"]:
        assert stack["identical"] is True and innermost in stack["stuck_in"], stack
    else:  # no py-spy, or no ptrace permission: said, with the reason
        assert stack["reason"], stack


def test_rank_that_stops_stepping_is_reported_hung_and_grades_error(agent, tmp_path):
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    procs = _start(tmp_path, WORKER, [str(spool), "0.05", str(stop)],
                   [{"RANK": str(r), "WORLD_SIZE": "3"} for r in range(3)])
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 3, 60, procs)
        suite = _suite(tmp_path, hang_after_s=2)
        before = agent("check", "--suite", suite, "--json")
        assert before.code == 0, before.stderr
        assert not _by_metric(before.json(), "training_hang")
        assert {r["target"] for r in _by_metric(before.json(), "training_progress")} == {
            "rank:0", "rank:1", "rank:2"}

        (tmp_path / "stop.rank2").touch()  # rank 2 stops stepping; it stays alive
        seen = _poll(agent, suite, lambda rep: _by_metric(rep, "training_hang"))
        code, report = seen[-1]
        assert code == 3 and report["grade"]["level"] == "ERROR"
        (hang,) = _by_metric(report, "training_hang")
        assert hang["target"] == "rank:2" and hang["status"] == "fail"
        assert "rank 2" in hang["detail"] and "torchelastic:test-job" in hang["detail"]
        assert hang["evidence"]["pid"] == procs[2].pid and hang["value"] >= 2  # rounded to 0.1 s
        _assert_stack_signal(hang["evidence"]["stack"], "stop_participating")
        # the healthy ranks are never called hung
        assert all(r["target"] == "rank:2" for _, rep in seen
                   for r in _by_metric(rep, "training_hang"))
        assert {r["target"] for r in _by_metric(report, "training_progress")} == {
            "rank:0", "rank:1"}
    finally:
        _stop(procs)
    # the processes are gone: their heartbeats are ignored, nothing is hung any more
    after = agent("check", "--suite", _suite(tmp_path, hang_after_s=2), "--json")
    assert after.code == 0, after.stderr
    (result,) = after.json()["results"]
    assert result["status"] == "skip" and "exited processes" in result["detail"]


def test_rank_three_times_slower_is_a_straggler_warn_never_a_hang(agent, tmp_path):
    spool = _spool(tmp_path)
    procs = _start(tmp_path, WORKER, [str(spool), "0.05", str(tmp_path / "never")],
                   [{"RANK": "0"}, {"RANK": "1"}])
    script = tmp_path / "worker.py"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test-job", "RANK": "2"}
    procs.append(subprocess.Popen([sys.executable, str(script), str(spool), "0.15",
                                   str(tmp_path / "never")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 3, 60, procs)
        seen = _poll(agent, _suite(tmp_path, hang_after_s=2),
                     lambda rep: _by_metric(rep, "training_straggler"))
        code, report = seen[-1]
        assert code == 0 and report["grade"]["level"] == "WARN"
        (slow,) = _by_metric(report, "training_straggler")
        assert slow["target"] == "rank:2" and slow["status"] == "warn" and slow["value"] >= 2
        assert "median" in slow["detail"]
        assert not [r for _, rep in seen for r in _by_metric(rep, "training_hang")]
    finally:
        _stop(procs)


def test_no_heartbeats_is_a_skip_that_says_how_to_instrument(agent, tmp_path):
    run = agent("check", "--suite", _suite(tmp_path), "--json")
    assert run.code == 0, run.stderr
    (result,) = run.json()["results"]
    assert result["status"] == "skip"
    assert result["detail"] == "no training process writes heartbeats (node_agent.heartbeat)"


def test_hang_without_py_spy_says_the_stack_signal_is_unavailable(agent, tmp_path):
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    (tmp_path / "stop.rank0").touch()  # stops at step 0
    procs = _start(tmp_path, WORKER, [str(spool), "0.05", str(stop)], [{"RANK": "0"}])
    try:
        deadline = time.monotonic() + 60
        while not (spool / f"{procs[0].pid}.json").exists():
            assert time.monotonic() < deadline, "worker wrote no heartbeat"
            time.sleep(0.1)
        suite = _suite(tmp_path, hang_after_s=1, py_spy=str(tmp_path / "no-such-py-spy"))
        seen = _poll(agent, suite, lambda rep: _by_metric(rep, "training_hang"))
        (hang,) = _by_metric(seen[-1][1], "training_hang")
        stack = hang["evidence"]["stack"]
        assert stack["available"] is False and "command not found" in stack["reason"]
        assert "unavailable" in hang["detail"]
    finally:
        _stop(procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed: no gloo all-reduce to hang")
def test_gloo_allreduce_hang_names_the_rank_outside_the_collective_as_likely_origin(
        agent, tmp_path):
    spool, stop = _spool(tmp_path), tmp_path / "stop"
    port = str(_free_port())
    procs = _start(tmp_path, GLOO_WORKER, [str(spool), str(stop)],
                   [{"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(3)])
    try:
        _wait_for_steps(spool, [p.pid for p in procs], 5, 120, procs)
        suite = _suite(tmp_path, hang_after_s=2)
        before = agent("check", "--suite", suite, "--json")
        assert before.code == 0, before.stderr
        assert not _by_metric(before.json(), "training_hang")

        stop.touch()  # rank 2 stops joining the all-reduce; ranks 0 and 1 block inside it
        seen = _poll(agent, suite, lambda rep: len(_by_metric(rep, "training_hang")) == 3)
        code, report = seen[-1]
        assert code == 3 and report["grade"]["level"] == "ERROR"
        hangs = {r["target"]: r for r in _by_metric(report, "training_hang")}
        assert set(hangs) == {"rank:0", "rank:1", "rank:2"}
        stacks = [h["evidence"]["stack"] for h in hangs.values()]
        if all(s["available"] for s in stacks):
            assert hangs["rank:2"]["evidence"]["likely_origin"] is True
            assert "likely origin" in hangs["rank:2"]["detail"]
            assert hangs["rank:0"]["evidence"]["likely_origin"] is False
            assert hangs["rank:0"]["evidence"]["stack"]["in_collective"] is True
            assert "stop_participating" in hangs["rank:2"]["evidence"]["stack"]["stuck_in"]
        else:
            assert all(s["reason"] for s in stacks if not s["available"])
    finally:
        _stop(procs)
