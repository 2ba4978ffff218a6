"""The runner isolates checks: a hang or a crash becomes an error result, and the run goes on."""

from __future__ import annotations

import threading
import time

import pytest
import yaml

from node_agent import runner
from node_agent.config import config_from_dict
from node_agent.environment import open_environment
from node_agent.model import Result, Status
from node_agent.suite import CheckSpec, Suite


@pytest.fixture
def env(tmp_path):
    path = tmp_path / "healthy.yaml"
    path.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2}))
    environment = open_environment(
        config_from_dict({"state_dir": str(tmp_path / "state")}), str(path)
    )
    yield environment
    environment.close()


@pytest.fixture
def fake_checks(monkeypatch):
    release = threading.Event()

    def hangs(ctx):
        release.wait(30)
        return [ctx.result("node", "x", Status.PASS, "late")]

    def crashes(ctx):
        raise RuntimeError("driver returned garbage")

    def silent(ctx):
        return []

    def fine(ctx):
        return [ctx.result("node", "x", Status.PASS, "ok")]

    table = {"hangs": hangs, "crashes": crashes, "silent": silent, "fine": fine}
    monkeypatch.setattr(runner, "resolve", table.__getitem__)
    yield
    release.set()


def suite_of(*specs: CheckSpec) -> Suite:
    return Suite(name="t", mode="delivery", checks=specs, source="test")


def test_a_hanging_check_ends_at_its_timeout_as_error_and_the_run_goes_on(env, fake_checks):
    start = time.monotonic()
    results = runner.run_suite(suite_of(CheckSpec("hangs", timeout_s=0.3), CheckSpec("fine")), env)
    assert time.monotonic() - start < 5
    hung, fine = results
    assert (hung.check, hung.metric, hung.status) == ("hangs", "timeout", Status.ERROR)
    assert "0.3 s" in hung.detail
    assert fine.status is Status.PASS


def test_a_crashing_check_is_an_error_with_its_exception(env, fake_checks):
    (result,) = runner.run_suite(suite_of(CheckSpec("crashes")), env)
    assert result.status is Status.ERROR and result.metric == "crashed"
    assert "RuntimeError: driver returned garbage" in result.detail
    assert "traceback" in result.evidence


def test_a_check_that_reports_nothing_is_an_error_not_a_pass(env, fake_checks):
    (result,) = runner.run_suite(suite_of(CheckSpec("silent")), env)
    assert result.status is Status.ERROR


def test_progress_is_reported_for_each_check(env, fake_checks):
    events = []
    runner.run_suite(
        suite_of(CheckSpec("fine"), CheckSpec("fine")),
        env,
        progress=lambda event, spec, i, n, results: events.append((event, i, n)),
    )
    assert events == [("start", 1, 2), ("done", 1, 2), ("start", 2, 2), ("done", 2, 2)]


def test_every_result_carries_a_duration(env, fake_checks):
    (result,) = runner.run_suite(suite_of(CheckSpec("fine")), env)
    assert isinstance(result, Result) and result.duration_s > 0


def test_the_runner_gives_each_check_its_deadline_and_abandons_it_there(env, monkeypatch):
    seen = {}

    def reads_its_deadline(ctx):
        seen["deadline"], seen["left"] = ctx.deadline, ctx.remaining_s(margin_s=0.0)
        return [ctx.result("node", "x", Status.PASS, "ok")]

    monkeypatch.setattr(runner, "resolve", lambda name: reads_its_deadline)
    before = time.monotonic()
    runner.run_check(CheckSpec("reads", timeout_s=30.0), env, "delivery")
    after = time.monotonic()
    assert before + 30.0 <= seen["deadline"] <= after + 30.0
    assert 0.0 < seen["left"] <= 30.0
