"""``node-agent hang-check`` and hang perception of processes that write no heartbeats.

The processes are real (Python children of the test, sampled with the real py-spy when the
venv has it and ptrace is allowed). The GPUs are simulated: no GPU exists on CI, so NVML's
compute-process list and the spinning-kernel readings come from a scenario (``--simulate``)
that names the real children's pids.
"""

from __future__ import annotations

import contextlib
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

from node_agent.training.stacks import find_py_spy

HUNG = "import time\ndef wait_for_peer():\n    time.sleep(600)\nwait_for_peer()\n"


def _start(env: dict[str, str]) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HUNG], env={**os.environ, **env})
    time.sleep(0.5)  # the interpreter is up and inside wait_for_peer
    return child


@contextlib.contextmanager
def _children(*envs):
    procs = [_start(e) for e in envs]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _py_spy_works(pid: int) -> bool:
    py_spy = find_py_spy()
    if py_spy is None:
        return False
    done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, timeout=30)
    return done.returncode == 0


def test_hang_check_pid_shows_the_stack_and_exits_0_when_one_signal_says_stuck(agent, tmp_path):
    with _children({"RANK": "3", "SLURM_JOB_ID": "4242"}) as (child,):
        run = agent(
            "hang-check", "--pid", str(child.pid), "--samples", "2", "--interval", "0.2", "--json"
        )
        assert run.code == 0, run.stderr
        (result,) = run.json()["results"]
        # SLURM_JOB_ID set by hand, no slurmd cgroup: named, but never restarted by the agent
        assert result["target"] == "job:unverified:slurm:4242/rank:3"
        assert result["metric"] == "training_progress" and result["status"] == "pass"
        stack = result["evidence"]["signals"]["stack"]
        if _py_spy_works(child.pid):
            assert stack["available"] and stack["identical"]
            assert "wait_for_peer" in stack["stuck_in"]
            assert "1 of 1 available signal(s)" in result["detail"]
        else:
            assert not stack["available"] and stack["detail"]


def test_hang_check_rejects_a_bad_pid_with_a_usage_error(agent):
    run = agent("hang-check", "--pid", "-5")
    assert run.code == 2 and "--pid -5" in run.stderr


@pytest.mark.parametrize("interval", ["nan", "inf", "-1"])
def test_hang_check_rejects_an_interval_that_is_not_a_finite_number(agent, interval):
    run = agent("hang-check", "--interval", interval)
    assert run.code == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "expected a finite number of seconds" in run.stderr and run.stdout == ""


def test_hang_check_on_a_pid_that_is_not_running_says_so(agent):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = agent("hang-check", "--pid", str(gone.pid), "--json")
    assert run.code == 0, run.stderr
    details = " ".join(r["detail"] for r in run.json()["results"])
    assert str(gone.pid) in details and "not running" in details


def _scenario(tmp_path: Path, pids_on_gpu: dict[int, int], spinning: list[int]) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "sku": "h100-sxm5-80gb",
                "gpus": 8,
                "compute_processes": [{"gpu": g, "pid": pid} for pid, g in pids_on_gpu.items()],
                "faults": [{"kind": "spin", "gpu": g} for g in spinning],
            }
        )
    )
    return str(path)


def _suite(tmp_path: Path, **params) -> str:
    """training_progress alone; its thresholds through the run's graders directory."""
    params, thresholds = split_thresholds(params)
    use_training_thresholds(tmp_path, thresholds)
    path = tmp_path / "suite.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "progress",
                "mode": "service",
                "checks": [
                    {
                        "check": "training_progress",
                        "timeout_s": 60,
                        "params": {"stack_samples": 2, "stack_interval_s": 0.2, **params},
                    }
                ],
            }
        )
    )
    return str(path)


def test_gpu_process_without_heartbeats_spinning_and_still_is_hung_once_confirmed(
    agent, tmp_path, slurm_job
):
    """NVML lists two ranks of a Slurm job (slurmd's cgroup holds them: tests/slurm_cgroup.py);
    gpu 0's kernel spins and its stack stands still across two runs ``confirm_s`` apart: a
    hang. gpu 1 works normally: never hung."""
    env = {"SLURM_JOB_ID": "77", "WORLD_SIZE": "2"}
    job = f"job:slurm:77@uid:{os.geteuid()}"
    with _children({**env, "RANK": "0"}, {**env, "RANK": "1"}) as (r0, r1):
        if not _py_spy_works(r0.pid):
            pytest.skip(
                "py-spy is missing or may not ptrace here: the stack signal, which "
                "must agree with the GPU, cannot be read"
            )
        for child in (r0, r1):
            slurm_job.adopt(child.pid, 77)
        scenario = _scenario(tmp_path, {r0.pid: 0, r1.pid: 1}, spinning=[0])
        suite = _suite(tmp_path, confirm_s=1)
        first = agent("check", "--simulate", scenario, "--suite", suite, "--json")
        assert first.code == 0, first.stderr
        by_target = {r["target"]: r for r in first.json()["results"]}
        r0_first = by_target[f"{job}/rank:0"]
        assert r0_first["metric"] == "training_progress"  # agreeing, not yet confirmed
        assert set(r0_first["evidence"]["agreeing"]) == {"gpu_activity", "stack"}
        assert r0_first["evidence"]["gpus"] == [0]
        assert "must hold" in r0_first["detail"]
        time.sleep(1.2)
        second = agent("check", "--simulate", scenario, "--suite", suite, "--json")
        assert second.code == 3, second.stderr
        report = second.json()
        hung = [r for r in report["results"] if r["metric"] == "training_hang"]
        assert [r["target"] for r in hung] == [f"{job}/rank:0"]
        assert hung[0]["evidence"]["signals"]["gpu_activity"]["hang"] is True
        evidence = json.loads(Path(hung[0]["evidence"]["evidence_file"]).read_text())
        assert {p["pid"] for p in evidence["processes"]} == {r0.pid, r1.pid}
        assert report["grade"]["level"] == "ERROR"


def test_the_same_hang_in_a_job_only_its_environment_names_is_a_warn(agent, tmp_path):
    """The same spinning, still rank whose job is a torchelastic run id (the user's word, no
    kernel witness): WARN naming the uid, exit 0."""
    env = {"TORCHELASTIC_RUN_ID": "sim-job", "WORLD_SIZE": "1", "RANK": "0"}
    with _children(env) as (r0,):
        if not _py_spy_works(r0.pid):
            pytest.skip(
                "py-spy is missing or may not ptrace here: the stack signal, which "
                "must agree with the GPU, cannot be read"
            )
        run = agent(
            "hang-check",
            "--simulate",
            _scenario(tmp_path, {r0.pid: 0}, spinning=[0]),
            "--samples",
            "2",
            "--interval",
            "0.2",
            "--json",
        )
        assert run.code == 0, run.stderr
        report = run.json()
        (hang,) = [r for r in report["results"] if r["metric"] == "training_hang"]
        assert hang["status"] == "warn" and hang["evidence"]["verified"] is False
        assert hang["target"] == "job:unverified:torchelastic:sim-job/rank:0"
        assert f"uid {os.geteuid()}'s" in hang["detail"]
        assert report["grade"]["level"] == "WARN"
