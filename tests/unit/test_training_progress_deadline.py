"""``training_progress`` returns before the runner's deadline (issue 29): what a training user
controls can keep a read waiting (``/proc`` of a process stuck in the kernel, a log file on a
FUSE or NFS mount that never answers), and a check the runner abandons grades ``check-hang``
ERROR. So each stage ends before the deadline the runner gives the check (``ctx.deadline``), a
stage that does not is a WARN naming it, and a log file's ``stat`` is bounded.

The blocking reads are stood in for by functions that wait on an event: a FUSE file system or a
process stuck in the kernel cannot be made here without privileges the tests do not assume.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checking.ports import Ports
from node_agent.checks import training_progress as tp
from node_agent.config import config_from_dict
from node_agent.environment import Environment
from node_agent.model import Status
from node_agent.runner import run_check
from node_agent.suite import CheckSpec


def _ctx(tmp_path: Path, timeout_s: float, **params) -> CheckContext:
    return CheckContext(
        check="training_progress",
        gpu=None,
        kernel_log=None,
        config=config_from_dict({}),  # the shipped graders/training.yaml
        inventory=None,
        sku=None,
        expected_gpus=None,
        mode="service",
        params={"spool_dir": str(tmp_path / "spool"), **params},
        state_dir=tmp_path / "state",
        timeout_s=timeout_s,
    )


def test_the_checks_stages_end_before_the_runners_deadline(tmp_path):
    for timeout_s in (5.0, 45.0, 60.0, 600.0):
        ctx = _ctx(tmp_path, timeout_s)
        started = ctx.deadline - timeout_s
        stages_end = ctx.stage_end() - started
        assert timeout_s * 0.5 <= stages_end <= timeout_s - 2.0
        assert stages_end >= tp.sampling_end(ctx) - started  # sampling ends before it
        assert tp.sampling_end(ctx) - started == pytest.approx(tp.SAMPLING_SHARE * timeout_s)


def test_a_discovery_that_never_returns_is_a_warn_naming_the_stage_not_a_check_hang(
    tmp_path, monkeypatch
):
    release = threading.Event()

    def stuck_discover(*_args, **_kwargs):  # /proc of a process stuck in the kernel
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(tp, "discover", stuck_discover)
    try:
        (result,) = tp.run(_ctx(tmp_path, timeout_s=3.0))
    finally:
        release.set()
    assert (result.metric, result.status) == ("training_discovery", Status.WARN)
    assert result.evidence["cause"] == "deadline"
    assert result.evidence["stage"] == "finding the training processes"
    assert "no hang is reported this run" in result.detail


def test_through_the_runner_the_same_stall_is_never_the_runners_timeout(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(tp, "discover", lambda *a, **k: release.wait(30))
    # what the runner reads of an Environment, for a node with no GPU and the default config
    env = SimpleNamespace(
        gpu=None,
        kernel_log=None,
        inventory=None,
        sku=None,
        expected_gpus=None,
        ports=Ports(),
        simulated=False,
        node=SimpleNamespace(param_overlay=None),
        config=config_from_dict({}),
        writable_state_dir=lambda: tmp_path / "state",
    )
    env.check_context = partial(Environment.check_context, env)  # the real one, on these fields
    try:
        results = run_check(
            CheckSpec("training_progress", 3.0, {"spool_dir": str(tmp_path / "spool")}),
            env,
            "service",
        )
    finally:
        release.set()
    assert [r.metric for r in results] == ["training_discovery"]
    assert results[0].status is Status.WARN


def test_a_log_file_whose_stat_never_returns_is_unavailable_and_not_stated_again(monkeypatch):
    release = threading.Event()
    real = tp.activity.log_silence_signal
    calls = []

    def stat(path, *, now, silence_s):
        calls.append(path)
        if path == "/fuse/job.log":
            release.wait(30)  # a file system its user keeps from answering
        return real(path, now=now, silence_s=silence_s)

    monkeypatch.setattr(tp.activity, "log_silence_signal", stat)
    try:
        first = tp.bounded_log_signals(
            ["/fuse/job.log", "/nonexistent/x.log", None], now=0.0, silence_s=60, limit_s=0.3
        )
        again = tp.bounded_log_signals(["/fuse/job.log"], now=0.0, silence_s=60, limit_s=0.3)
    finally:
        release.set()
    assert not first[0].available and "did not return within 0.3 s" in first[0].detail
    assert not first[1].available and "does not exist" in first[1].detail
    assert not first[2].available and "no log file configured" in first[2].detail
    assert "from an earlier run has not returned" in again[0].detail
    assert calls.count("/fuse/job.log") == 1
