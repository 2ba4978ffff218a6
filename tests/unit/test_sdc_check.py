"""The ``sdc`` and ``sdc_spool`` checks on real torch (CPU): cross-GPU odd one out, each GPU's
earlier digest under the state dir, software changes, transient vs confirmed, spool ingestion.

Nodes are simulated (``node_agent.gpu.sim`` + ``node_agent.compute.devices`` CPU stand-ins): the probe
code, digests, history and grading are the real code. Where a fault the scenario language
cannot express is needed (a mismatch on the first call only), a CPU ``ComputeDevice`` is built
with the library's ``corrupting_matmul(times=1)``: that is the compute boundary itself, not a
fake of anything above it.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

torch = pytest.importorskip("torch")

from node_agent.checks import CheckContext, sdc_spool  # noqa: E402
from node_agent.checks import sdc as sdc_check  # noqa: E402
from node_agent.compute.devices import ComputeDevice, ComputeSpec, open_device  # noqa: E402
from node_agent.config import load_config  # noqa: E402
from node_agent.environment import open_environment  # noqa: E402
from node_agent.model import Status  # noqa: E402
from node_agent.runner import run_check  # noqa: E402
from node_agent.sdc import probes as sdc_lib  # noqa: E402
from node_agent.suite import CheckSpec  # noqa: E402

SMALL = {"shapes": [[16, 16, 16], [17, 32, 9]], "dtypes": ["fp32", "bf16", "fp16"],
         "repeats": 1, "freivalds_n": 32}


@pytest.fixture
def node(tmp_path):
    """``node(gpus=4, faults=(), **scenario)`` -> an opened simulated Environment whose state
    dir is ``tmp_path/state`` (shared by every node of one test: runs see each other's state)."""
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    envs = []

    def make(gpus=4, faults=(), **extra):
        path = tmp_path / f"scenario-{len(envs)}.yaml"
        path.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": gpus,
                                        "faults": list(faults), **extra}))
        env = open_environment(load_config(config_path), str(path))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def run_sdc(env, mode="delivery", **params):
    return run_check(CheckSpec("sdc", timeout_s=120, params={**SMALL, **params}), env, mode)


def ctx_for(env, check="sdc", **params) -> CheckContext:
    return CheckContext(check=check, gpu=env.gpu, kernel_log=env.kernel_log, config=env.config,
                        inventory=env.inventory, sku=env.sku, expected_gpus=env.expected_gpus,
                        params=params, state_dir=env.writable_state_dir(), scenario=env.scenario)


def by_target(results):
    return {r.target: r for r in results}


def history_file(env):
    return env.config.state_dir / "sdc" / "digests.json"


# -- the check on a simulated node -----------------------------------------------------------


def test_corrupting_gpu_is_the_only_one_confirmed_and_is_odd_one_out(node):
    results = run_sdc(node(gpus=4, faults=[{"kind": "sdc", "gpu": 2}]))
    got = by_target(results)
    assert got["gpu:2"].metric == "sdc_confirmed" and got["gpu:2"].status is Status.FAIL
    assert {t for t, r in got.items() if r.status is not Status.PASS} == {"gpu:2"}
    # the detail names the probe, shape, dtype and how many elements were wrong
    assert "exact_gemm fp32 16x16x16: 1 of 256 elements differ" in got["gpu:2"].detail
    cross = [f for f in got["gpu:2"].evidence["findings"]
             if f["probe"] == "digest_gemm" and "odd one out" in f["detail"]]
    assert cross and all(f["status"] == "confirmed" for f in cross)
    assert len(cross) == len(SMALL["shapes"]) * len(SMALL["dtypes"])


def test_healthy_node_passes_and_stores_each_gpus_digests(node):
    env = node(gpus=3)
    results = run_sdc(env)
    assert [r.status for r in results] == [Status.PASS] * 3
    stored = json.loads(history_file(env).read_text())
    assert sorted(stored["gpus"]) == sorted(g.uuid for g in env.inventory.gpus)
    assert len(next(iter(stored["gpus"].values()))["digests"]) == 6


def test_gpu_that_changes_from_its_earlier_digest_is_confirmed_on_the_next_run(node):
    """Two GPUs: no majority across GPUs, so only the GPU's own history can catch it."""
    assert {r.status for r in run_sdc(node(gpus=2))} == {Status.PASS}
    results = run_sdc(node(gpus=2, faults=[{"kind": "sdc", "gpu": 1}]), digest_history=True)
    got = by_target(results)
    assert got["gpu:0"].status is Status.PASS
    history = [f for f in got["gpu:1"].evidence["findings"]
               if f["probe"] == "digest_gemm" and "earlier digest" in f["detail"]]
    assert history and {f["status"] for f in history} == {"confirmed"}


def _tamper(env, index: int) -> None:
    """Make the stored digests of one GPU wrong, as if its earlier run had seen other bits."""
    path = history_file(env)
    data = json.loads(path.read_text())
    uuid = env.inventory.gpus[index].uuid
    data["gpus"][uuid]["digests"] = {k: "0" * 64 for k in data["gpus"][uuid]["digests"]}
    path.write_text(json.dumps(data))


def test_stored_digest_mismatch_with_same_software_is_confirmed(node):
    env = node(gpus=2)
    run_sdc(env)
    _tamper(env, 0)
    got = by_target(run_sdc(node(gpus=2)))
    assert got["gpu:0"].metric == "sdc_confirmed"
    assert "earlier digest" in got["gpu:0"].detail or any(
        "earlier digest" in f["detail"] for f in got["gpu:0"].evidence["findings"])


def test_software_change_invalidates_stored_digest_and_says_so(node):
    env = node(gpus=2, driver="570.86.15")
    run_sdc(env)
    _tamper(env, 0)
    got = by_target(run_sdc(node(gpus=2, driver="575.51.03")))
    assert got["gpu:0"].status is Status.PASS
    assert "software changed (driver 570.86.15 -> 575.51.03)" in got["gpu:0"].detail
    # the new baseline replaced the stale one: a third run on the new driver compares cleanly
    got = by_target(run_sdc(node(gpus=2, driver="575.51.03")))
    assert got["gpu:0"].status is Status.PASS and "software changed" not in got["gpu:0"].detail


def test_stale_history_is_replaced_when_the_gpu_agrees_with_the_node_majority(node):
    env = node(gpus=4)
    run_sdc(env)
    _tamper(env, 3)
    got = by_target(run_sdc(node(gpus=4)))
    assert got["gpu:3"].status is Status.PASS
    assert "earlier digest was stale" in got["gpu:3"].detail


def test_service_mode_result_is_the_same_grade_path(node):
    results = run_sdc(node(gpus=2, faults=[{"kind": "sdc", "gpu": 0}]), mode="service")
    assert by_target(results)["gpu:0"].metric == "sdc_confirmed"


def test_invalid_shape_param_is_an_error_that_names_it(node):
    (r,) = run_sdc(node(gpus=1), shapes=[[8, 512, 8]])
    assert r.status is Status.ERROR and "exceeds" in r.detail and "suite" in r.detail


# -- transient vs confirmed (compute boundary: corrupting_matmul) ----------------------------


def _device(index: int, matmul=None) -> ComputeDevice:
    return ComputeDevice(ComputeSpec(index, simulated=True), torch.device("cpu"),
                         matmul or torch.matmul)


def _plan(**kw):
    plan, _ = sdc_check.make_plan({**SMALL, **kw}, on_cuda=False)
    return plan


def test_single_unrepeated_mismatch_is_transient_warn_with_evidence(node):
    env = node(gpus=3)
    runs = {i: sdc_check.GpuRun(i, _device(i, sdc_lib.corrupting_matmul(times=1) if i == 1 else None))
            for i in range(3)}
    sdc_check.probe_node(runs, _plan())
    statuses = [v.status for v in runs[1].verdicts]
    assert statuses.count("transient") == 1 and "confirmed" not in statuses
    (r,) = sdc_check.results_for(ctx_for(env), runs[1])
    assert (r.metric, r.status) == ("sdc_transient", Status.WARN)
    assert r.evidence["findings"][0]["status"] == "transient"
    assert "matched on re-run" in r.detail
    assert env.grader.grade([r]).level.name == "WARN"


def test_repeated_mismatch_is_confirmed_fault(node):
    env = node(gpus=3)
    runs = {i: sdc_check.GpuRun(i, _device(i, sdc_lib.corrupting_matmul() if i == 0 else None))
            for i in range(3)}
    sdc_check.probe_node(runs, _plan())
    (r,) = sdc_check.results_for(ctx_for(env), runs[0])
    assert (r.metric, r.status) == ("sdc_confirmed", Status.FAIL)
    grade = env.grader.grade([r])
    assert grade.level.name == "FAULT" and grade.action.value == "replace"
    assert grade.reasons[0].rule == "sdc-confirmed"
    for i in (1, 2):
        assert {v.status for v in runs[i].verdicts} == {"pass"}


def test_probe_that_raises_is_an_error_result_never_a_pass(node):
    env = node(gpus=1)

    def broken(a, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    runs = {0: sdc_check.GpuRun(0, _device(0, broken))}
    sdc_check.probe_node(runs, _plan())
    results = sdc_check.results_for(ctx_for(env), runs[0])
    assert [(r.metric, r.status) for r in results] == [("sdc_probe_error", Status.ERROR)]
    assert "illegal memory access" in results[0].detail
    assert env.grader.grade(results, "delivery").level.name == "ERROR"


def test_duration_repeats_rounds_over_a_bounded_set_of_seeds():
    """Goldens are cached per seed: cycling over ``seeds`` keeps a long run's memory bounded."""
    runs = {0: sdc_check.GpuRun(0, open_device(ComputeSpec(0, simulated=True)))}
    ticks = iter(range(1000))  # one "second" per clock read
    sdc_check.probe_node(runs, _plan(repeats=1, duration_s=6, seeds=2, shapes=[[15, 16, 17]]),
                         clock=lambda: next(ticks))
    assert runs[0].rounds >= 4
    assert {v.status for v in runs[0].verdicts} == {"pass"}
    assert {seed for shape, _, seed in sdc_lib._GOLDEN if shape == (15, 16, 17)} == {0, 1}


# -- spool ingestion -------------------------------------------------------------------------


def _verdict(status: str, device: str = "cuda:3", **kw) -> sdc_lib.Verdict:
    return sdc_lib.Verdict(
        probe="exact_gemm", device=device, shape=(128, 128, 128), dtype="bf16", status=status,
        mismatched_elements=1 if status != "pass" else 0,
        detail=f"exact_gemm bf16 128x128x128: 1 of 16384 elements differ ({status})",
        duration_s=0.003, timestamp=1763726400.0, evidence=kw)


def spool_of(env):
    return env.config.state_dir / "spool" / "sdc"


def test_spool_confirmed_verdict_is_fault_and_stays_standing_until_gpu_replaced(node):
    env = node(gpus=8)
    sdc_lib.write_verdict(spool_of(env), _verdict("confirmed"))
    (r,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert (r.target, r.metric, r.status) == ("gpu:3", "sdc_confirmed", Status.FAIL)
    assert r.evidence["source"] == "spool"
    assert env.grader.grade([r]).level.name == "FAULT"
    # graded once as new; later runs report it as standing, not as a second verdict
    (again,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert (again.target, again.status, again.evidence["source"]) == ("gpu:3", Status.FAIL,
                                                                      "spool (standing)")
    assert again.value == 1 and "stays FAULT until the GPU is replaced" in again.detail
    # the same node with other GPU UUIDs (gpu:3 swapped): the standing fault is gone
    replaced = node(gpus=8, hostname="sim-node-after-repair")
    (after,) = sdc_spool.run(ctx_for(replaced, "sdc_spool"))
    assert after.status is Status.PASS


def test_spool_transient_is_warned_once(node):
    env = node(gpus=8)
    sdc_lib.write_verdict(spool_of(env), _verdict("transient", device="cuda:5"))
    (r,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert (r.target, r.metric, r.status) == ("gpu:5", "sdc_transient", Status.WARN)
    (again,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert again.status is Status.PASS


def test_spool_maps_by_gpu_uuid_when_the_verdict_carries_one(node):
    env = node(gpus=8)
    uuid = env.inventory.gpus[6].uuid
    sdc_lib.write_verdict(spool_of(env), _verdict("confirmed", device="cuda:0", gpu_uuid=uuid))
    (r,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert r.target == "gpu:6" and "CUDA_VISIBLE_DEVICES" not in r.detail


def test_half_written_spool_file_is_never_read_as_a_verdict(node):
    env = node(gpus=8)
    spool = spool_of(env)
    full = json.dumps(_verdict("confirmed").to_dict())
    spool.mkdir(parents=True)
    # a writer killed mid-write leaves its temp file: the name write_verdict uses before rename
    (spool / ".sdc-1763726400000000000-42-0-confirmed.json.x1y2.tmp").write_text(full[: len(full) // 2])
    (r,) = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert (r.metric, r.status) == ("sdc_spool", Status.PASS)
    assert r.value == 0
    # a truncated *.json (not from write_verdict) is reported once as unreadable, never graded
    (spool / "sdc-1-1-1-confirmed.json").write_text(full[:40])
    results = sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert [(x.metric, x.status) for x in results] == [("sdc_spool_unreadable", Status.WARN)]
    assert {x.metric for x in sdc_spool.run(ctx_for(env, "sdc_spool"))} == {"sdc_spool"}


def test_spool_cursor_forgets_files_removed_from_the_spool(node):
    env = node(gpus=8)
    path = sdc_lib.write_verdict(spool_of(env), _verdict("transient"))
    sdc_spool.run(ctx_for(env, "sdc_spool"))
    cursor = sdc_spool.cursor_path(env.config.state_dir)
    assert path.name in json.loads(cursor.read_text())["ingested"]
    os.unlink(path)
    sdc_spool.run(ctx_for(env, "sdc_spool"))
    assert json.loads(cursor.read_text())["ingested"] == {}
