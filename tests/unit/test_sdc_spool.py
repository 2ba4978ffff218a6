"""The ``sdc_spool`` check: training jobs' verdicts are reports; only the agent's own probe
makes a FAULT (DESIGN.md, "Trust boundary" and "SDC probes").

Nodes are simulated (``node_agent.sim.gpu_model``): its NVML lists the compute processes the
scenario names, here real processes of the test (so ``/proc`` gives their uid), and its
compute devices are CPU stand-ins that a scenario's ``sdc`` fault corrupts. The agent's
confirming probe is the real ``node-agent check`` child process running the real ``sdc`` check.
The unprivileged-writer cases run as a real user in ``tests/security``; here the file owner is
set with ``chown`` (root runs the tests).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checks import sdc_spool
from node_agent.model import Status
from node_agent.sdc import spool as sdc_lib

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: the agent's own SDC probe cannot run",
)


@pytest.fixture
def job():
    """A real process standing for a training job (NVML lists it when the scenario says so)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait()


def ctx_for(env, timeout_s: float = 120.0, **params) -> CheckContext:
    return env.check_context(
        "sdc_spool",
        "service",
        params,
        state_dir=env.writable_state_dir(),
        timeout_s=timeout_s,
    )


def spool_of(env):
    return env.config.spool_dir / "sdc"


def verdict(status: str, device: str = "cuda:3", **evidence) -> sdc_lib.Verdict:
    return sdc_lib.Verdict(
        probe="exact_gemm",
        device=device,
        shape=(128, 128, 128),
        dtype="bf16",
        status=status,
        mismatched_elements=1 if status != "pass" else 0,
        detail=f"exact_gemm bf16 128x128x128: 1 of 16384 elements differ ({status})",
        duration_s=0.003,
        timestamp=1763726400.0,
        evidence=evidence,
    )


def only(results, metric=None):
    (r,) = results
    assert metric is None or r.metric == metric, (r.metric, r.detail)
    return r


def test_confirmed_verdict_whose_writer_runs_nothing_on_the_gpu_is_an_unverified_warn(node):
    env = node()
    sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    r = only(sdc_spool.run(ctx_for(env)), "sdc_report_unverified")
    assert (r.target, r.status) == ("gpu:3", Status.WARN)
    assert "written by uid 0" in r.detail and "uid 0 runs no compute process on gpu:3" in r.detail
    assert env.grader.grade([r]).level.name == "WARN"
    # a report, once: nothing stands, nothing is repeated
    assert only(sdc_spool.run(ctx_for(env))).status is Status.PASS


def test_confirmed_verdict_of_another_uid_than_the_gpus_process_is_not_believed(node, job):
    env = node(compute_processes=[{"gpu": 3, "pid": job.pid}])
    path = sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    os.chown(path, 65534, 65534)
    r = only(sdc_spool.run(ctx_for(env)), "sdc_report_unverified")
    assert "uid 65534 runs no compute process on gpu:3" in r.detail
    assert "processes of uid 0 there" in r.detail and r.evidence["writer_uids"] == [65534]


@needs_torch
def test_report_of_the_gpus_own_process_makes_the_agent_probe_and_a_clean_probe_stays_warn(
    node, job
):
    env = node(compute_processes=[{"gpu": 3, "pid": job.pid}])
    sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    r = only(sdc_spool.run(ctx_for(env)), "sdc_reported")
    assert (r.target, r.status) == ("gpu:3", Status.WARN)
    assert f"uid 0 (pid {job.pid}, running on gpu:3)" in r.detail
    assert "the agent's own probe did not confirm it" in r.detail
    assert env.grader.grade([r]).level.name == "WARN"
    assert only(sdc_spool.run(ctx_for(env))).status is Status.PASS


@needs_torch
def test_only_the_agents_own_confirmation_faults_and_it_stands_until_set_healthy(node, job):
    env = node(faults=[{"kind": "sdc", "gpu": 3}], compute_processes=[{"gpu": 3, "pid": job.pid}])
    sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    r = only(sdc_spool.run(ctx_for(env)), "sdc_confirmed")
    assert (r.target, r.status, r.evidence["source"]) == ("gpu:3", Status.FAIL, "agent probe")
    assert "confirmed by the agent's own probe" in r.detail and r.evidence["reporter_uid"] == 0
    assert env.grader.grade([r]).level.name == "FAULT"
    # the finding is the agent's: deleting the spool file does not clear it
    for f in spool_of(env).iterdir():
        f.unlink()
    again = only(sdc_spool.run(ctx_for(env)), "sdc_confirmed")
    assert again.evidence["source"] == "agent probe (standing)"
    assert "set-healthy" in again.detail
    assert sdc_spool.clear_standing(env.config.state_dir) == 1
    assert only(sdc_spool.run(ctx_for(env))).status is Status.PASS


@needs_torch
def test_standing_confirmation_goes_with_the_replaced_gpu(node, job):
    env = node(faults=[{"kind": "sdc", "gpu": 3}], compute_processes=[{"gpu": 3, "pid": job.pid}])
    sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    assert only(sdc_spool.run(ctx_for(env))).status is Status.FAIL
    replaced = node(hostname="sim-node-after-repair")  # other GPU UUIDs
    assert only(sdc_spool.run(ctx_for(replaced))).status is Status.PASS


def test_report_waits_for_the_probe_when_the_check_has_too_little_time(node, job):
    env = node(compute_processes=[{"gpu": 3, "pid": job.pid}])
    sdc_lib.write_verdict(spool_of(env), verdict("confirmed"))
    r = only(sdc_spool.run(ctx_for(env, timeout_s=5)), "sdc_reported")
    assert r.status is Status.WARN and "awaiting the agent's own probe" in r.detail
    assert "raise sdc_spool's timeout_s" in r.detail and r.evidence["tries"] == 1
    # still pending (a WARN) on the next run; the retry is due only after confirm_retry_s
    again = only(sdc_spool.run(ctx_for(env, timeout_s=5)), "sdc_reported")
    assert "the next probe is due at" in again.detail and again.evidence["tries"] == 1


def test_standing_fault_of_an_older_agent_that_believed_the_spool_becomes_a_report(node):
    env = node()
    cursor = sdc_spool.cursor_path(env.config.state_dir)
    cursor.parent.mkdir(parents=True)
    cursor.write_text(
        json.dumps(
            {
                "schema": sdc_spool.CURSOR_SCHEMA,
                "ingested": {},
                "standing": [
                    {
                        "file": "sdc-1.json",
                        "target": "gpu:3",
                        "gpu_uuid": None,
                        "detail": "forged",
                        "verdict_at": 1.0,
                        "graded_at": 2.0,
                    }
                ],
            }
        )
    )
    r = only(sdc_spool.run(ctx_for(env, confirm=False)), "sdc_reported")
    assert r.status is Status.WARN and "confirmation is off" in r.detail


def test_a_jobs_probe_error_is_a_warn_naming_the_writer_not_an_agent_error(node):
    env = node()
    sdc_lib.write_verdict(spool_of(env), verdict("error"))
    r = only(sdc_spool.run(ctx_for(env)), "sdc_probe_error")
    assert r.status is Status.WARN and "written by uid 0" in r.detail
    assert env.grader.grade([r], "delivery").level.name == "WARN"


def test_transient_is_warned_once(node):
    env = node()
    sdc_lib.write_verdict(spool_of(env), verdict("transient", device="cuda:5"))
    r = only(sdc_spool.run(ctx_for(env)), "sdc_transient")
    assert (r.target, r.status) == ("gpu:5", Status.WARN)
    assert only(sdc_spool.run(ctx_for(env))).status is Status.PASS


def test_verdict_maps_by_gpu_uuid_when_it_carries_one(node):
    env = node()
    uuid = env.inventory.gpus[6].uuid
    sdc_lib.write_verdict(spool_of(env), verdict("transient", device="cuda:0", gpu_uuid=uuid))
    r = only(sdc_spool.run(ctx_for(env)))
    assert r.target == "gpu:6" and "CUDA_VISIBLE_DEVICES" not in r.detail


def test_half_written_file_is_never_read_and_a_truncated_one_is_reported_once(node):
    env = node()
    spool = spool_of(env)
    full = json.dumps(verdict("confirmed").to_dict())
    spool.mkdir(parents=True)
    (spool / ".sdc-1763726400000000000-42-0-confirmed.json.x1y2.tmp").write_text(full[:50])
    r = only(sdc_spool.run(ctx_for(env)), "sdc_spool")
    assert r.status is Status.PASS and r.value == 0
    (spool / "sdc-1-1-1-confirmed.json").write_text(full[:40])
    assert only(sdc_spool.run(ctx_for(env))).metric == "sdc_spool_unreadable"
    assert only(sdc_spool.run(ctx_for(env))).metric == "sdc_spool"


def test_cursor_forgets_files_removed_from_the_spool(node):
    env = node()
    path = sdc_lib.write_verdict(spool_of(env), verdict("transient"))
    sdc_spool.run(ctx_for(env))
    cursor = sdc_spool.cursor_path(env.config.state_dir)
    assert path.name in json.loads(cursor.read_text())["ingested"]
    os.unlink(path)
    sdc_spool.run(ctx_for(env))
    assert json.loads(cursor.read_text())["ingested"] == {}


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("device", "cuda:3\ud800", "lone surrogate"),  # valid JSON (\ud800), no text
        ("detail", "ok\u0000HEALTHY", "NUL byte"),
        ("device", "cuda:3\x1b[2J", "control character U+001B"),
        ("probe", "exact\u202egemm", "control character U+202E"),
    ],
)
def test_a_verdict_with_unusable_text_is_reported_unreadable_naming_its_writer(
    node, field, value, why
):
    env = node()
    spool = spool_of(env)
    spool.mkdir(parents=True)
    data = {**verdict("confirmed").to_dict(), field: value}
    (spool / "sdc-1-1-1-confirmed.json").write_text(json.dumps(data, ensure_ascii=True))
    errors: list = []
    assert sdc_lib.read_verdicts(spool, errors) == []
    ((path, reason),) = errors
    assert why in reason and path.name == "sdc-1-1-1-confirmed.json"
    assert f"written by uid {os.getuid()}" in reason
    r = only(sdc_spool.run(ctx_for(env)))
    assert (r.metric, r.status) == ("sdc_spool_unreadable", Status.WARN), r.detail
    r.detail.encode("utf-8")  # whatever the file held, the result is text


def test_control_characters_in_a_verdicts_detail_are_kept_for_the_terminal_to_escape(node):
    env = node()
    sdc_lib.write_verdict(spool_of(env), verdict("transient"))
    data = {**verdict("transient").to_dict(), "detail": "mismatch \x1b[31mred\x1b[0m"}
    (spool_of(env) / "sdc-2-2-2-transient.json").write_text(json.dumps(data))
    assert [v.detail for v in sdc_lib.read_spool(spool_of(env))][
        -1
    ] == "mismatch \x1b[31mred\x1b[0m"
