"""The ``sdc`` check on real torch (CPU): whole-GPU exact probes on a simulated H100 with one
faulty SM, sm_coverage in every result, cross-GPU odd one out, each GPU's earlier digest under
the state dir, software changes, transient vs confirmed (and confirmed by a second mismatch).
Spool ingestion (``sdc_spool``) is tested in ``tests/unit/test_sdc_spool.py``.

Nodes are simulated (``node_agent.sim.gpu_model`` + ``node_agent.compute.devices`` CPU stand-ins): the probe
code, digests, history and grading are the real code. Where a fault the scenario language
cannot express is needed (a mismatch on the first call only), a CPU ``ComputeDevice`` is built
with the library's ``corrupting_matmul(times=1)``: that is the compute boundary itself, not a
fake of anything above it.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from node_agent import resources  # noqa: E402
from node_agent.checking.context import CheckContext  # noqa: E402
from node_agent.checks import sdc as sdc_check  # noqa: E402
from node_agent.compute.devices import ComputeDevice, ComputeSpec, open_device  # noqa: E402
from node_agent.config import config_from_dict  # noqa: E402
from node_agent.grading.rules import load_grader  # noqa: E402
from node_agent.model import Level, Status  # noqa: E402
from node_agent.runner import run_check  # noqa: E402
from node_agent.sdc import probes as sdc_lib  # noqa: E402
from node_agent.suite import CheckSpec  # noqa: E402

SMALL = {
    "shapes": [[16, 16, 16], [17, 32, 9]],
    "dtypes": ["fp32", "bf16", "fp16"],
    "repeats": 1,
    "freivalds_n": 32,
}


def run_sdc(env, mode="delivery", **params):
    return run_check(CheckSpec("sdc", timeout_s=120, params={**SMALL, **params}), env, mode)


def ctx_for(env, check="sdc", **params) -> CheckContext:
    return env.check_context(
        check,
        "delivery",
        params,
        state_dir=env.writable_state_dir(),
    )


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
    cross = [
        f
        for f in got["gpu:2"].evidence["findings"]
        if f["probe"] == "digest_gemm" and "odd one out" in f["detail"]
    ]
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
    history = [
        f
        for f in got["gpu:1"].evidence["findings"]
        if f["probe"] == "digest_gemm" and "earlier digest" in f["detail"]
    ]
    assert history and {f["status"] for f in history} == {"confirmed"}


def _tamper(env, index: int) -> None:
    """Make the stored digests of one GPU wrong, as if its earlier run had seen other bits."""
    path = history_file(env)
    data = json.loads(path.read_text())
    uuid = env.inventory.gpus[index].uuid
    data["gpus"][uuid]["digests"] = {k: "0" * 64 for k in data["gpus"][uuid]["digests"]}
    path.write_text(json.dumps(data))


def test_a_lone_gpu_unlike_its_history_with_every_known_answer_right_is_a_warning_not_sdc(node):
    """One GPU: nothing to compare with but its own history, which a software change the
    fingerprint misses moves as a defect would. Its exact probes all came out right, so the
    stale history alone made it "confirmed" and replaced. A warning that says how to tell; the
    old baseline stays, so the warning stays until an operator acts."""
    env = node(gpus=1)
    run_sdc(env)
    _tamper(env, 0)
    for _ in range(2):
        (result,) = run_sdc(node(gpus=1))
        assert (result.metric, result.status) == ("sdc_digest_drift", Status.WARN)
        assert "earlier ones" in result.detail and "run the sdc check on every GPU" in result.detail
    grade = load_grader(resources.graders_dir(config_from_dict({}))).grade([result], "delivery")
    assert (grade.level, grade.reasons[0].rule) == (Level.WARN, "sdc-digest-drift")


def test_a_lone_gpu_whose_known_answers_come_out_wrong_is_still_confirmed(node):
    env = node(gpus=1)
    run_sdc(env)
    _tamper(env, 0)
    (result,) = run_sdc(node(gpus=1, faults=[{"kind": "sdc", "gpu": 0}]))
    assert (result.metric, result.status) == ("sdc_confirmed", Status.FAIL)
    assert "exact_gemm" in result.detail


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


def test_two_gpus_that_drift_from_their_history_to_one_new_digest_are_a_software_change(node):
    """A cuBLAS wheel upgraded without torch's version changing: both GPUs of a two-GPU node
    compute new bits, the same ones. Without a majority (3 GPUs) each was "confirmed", a
    replacement of both. No two GPUs corrupt a product into the same bits: stale baselines.
    A GPU whose new digest differs from its sibling's stays confirmed
    (test_gpu_that_changes_from_its_earlier_digest_is_confirmed_on_the_next_run)."""
    env = node(gpus=2)
    run_sdc(env)
    _tamper(env, 0)
    _tamper(env, 1)
    got = by_target(run_sdc(node(gpus=2)))
    assert {got["gpu:0"].status, got["gpu:1"].status} == {Status.PASS}
    assert all("earlier digest was stale" in got[t].detail for t in ("gpu:0", "gpu:1"))


@pytest.mark.parametrize(
    "installed",
    [
        {"nvidia-cublas-cu12": "12.8.4.1"},
        {"nvidia-cublas-cu12": "12.4.5.8", "nvidia-cublas-cu13": "13.1.0.3"},  # cu12 left behind
        {},
    ],
)
def test_the_software_fingerprint_names_the_cublas_wheel_torch_loads(monkeypatch, installed):
    """pip upgrades nvidia-cublas-cu12 apart from torch, and new cuBLAS kernels give new bits:
    a fingerprint without it kept a stale baseline, and each GPU's new digest was "confirmed"."""
    from importlib import metadata

    from node_agent.checks.sdc import software_fingerprint

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    fp = software_fingerprint(_device(0), "NVIDIA H100", "580.1")
    wheel = ", ".join(f"{k} {v}" for k, v in installed.items()) or None
    assert fp.get("cublas") == wheel  # absent where torch carries its own


def test_service_mode_result_is_the_same_grade_path(node):
    results = run_sdc(node(gpus=2, faults=[{"kind": "sdc", "gpu": 0}]), mode="service")
    assert by_target(results)["gpu:0"].metric == "sdc_confirmed"


def test_invalid_shape_param_is_an_error_that_names_it(node):
    (r,) = run_sdc(node(gpus=1), shapes=[[8, 2**24, 8]])
    assert r.status is Status.ERROR and "exceeds" in r.detail and "suite" in r.detail
    assert r.evidence["sm_coverage"] == 0.0


# -- transient vs confirmed (compute boundary: corrupting_matmul) ----------------------------


def _device(index: int, matmul=None) -> ComputeDevice:
    return ComputeDevice(
        ComputeSpec(index, simulated=True), torch.device("cpu"), matmul or torch.matmul
    )


def _plan(**kw):
    plan, _ = sdc_check.make_plan({**SMALL, **kw}, on_cuda=False)
    return plan


def corrupt_once(shape: tuple[int, int], base=None):
    """A matmul wrong once: on its first product of an ``shape`` output (the accumulator
    checks run first and must not use the one wrong product up)."""
    mm = base or sdc_lib.gemm
    done = []

    def matmul(a, b):
        out = mm(a, b)
        if not done and tuple(out.shape) == shape:
            done.append(True)
            out = out.clone()
            out[1, 2] = -out[1, 2] - 1
        return out

    return matmul


def test_single_unrepeated_mismatch_is_transient_warn_with_evidence(node):
    env = node(gpus=3)
    runs = {
        i: sdc_check.GpuRun(i, _device(i, corrupt_once((16, 16)) if i == 1 else None))
        for i in range(3)
    }
    sdc_check.probe_node(runs, _plan())
    statuses = [v.status for v in runs[1].verdicts]
    assert statuses.count("transient") == 1 and "confirmed" not in statuses
    (r,) = sdc_check.results_for(ctx_for(env), runs[1])
    assert (r.metric, r.status) == ("sdc_transient", Status.WARN)
    assert r.evidence["findings"][0]["status"] == "transient"
    assert "re-run matched" in r.detail and "nothing repeated it" in r.detail
    assert env.grader.grade([r]).level.name == "WARN"


def test_a_second_mismatch_in_the_run_confirms_a_clean_rerun(node):
    """An intermittent SM: the re-run is clean, but another probe on the GPU mismatches too."""
    env = node(gpus=2)
    twice = corrupt_once((17, 9), corrupt_once((16, 16)))
    runs = {0: sdc_check.GpuRun(0, _device(0, twice)), 1: sdc_check.GpuRun(1, _device(1))}
    sdc_check.probe_node(runs, _plan())
    exact = [v for v in runs[0].verdicts if v.probe == "exact_gemm" and v.status != "pass"]
    assert [v.status for v in exact] == ["transient", "confirmed"]
    assert exact[1].evidence["rerun_mismatched_elements"] == 0
    assert exact[1].evidence["window_mismatches"] == 1
    (r,) = sdc_check.results_for(ctx_for(env), runs[0])
    assert (r.metric, r.status) == ("sdc_confirmed", Status.FAIL)
    assert env.grader.grade([r]).level.name == "FAULT"


def test_repeated_mismatch_is_confirmed_fault(node):
    env = node(gpus=3)
    runs = {
        i: sdc_check.GpuRun(i, _device(i, sdc_lib.corrupting_matmul() if i == 0 else None))
        for i in range(3)
    }
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
    assert "accumulator check could not run" in " ".join(results[0].evidence["notes"])
    assert env.grader.grade(results, "delivery").level.name == "ERROR"


def test_duration_repeats_rounds_over_a_bounded_set_of_seeds():
    """Goldens are cached per seed: cycling over ``seeds`` keeps a long run's memory bounded."""
    from node_agent.sdc import exact

    runs = {0: sdc_check.GpuRun(0, open_device(ComputeSpec(0, simulated=True)))}
    ticks = iter(range(1000))  # one "second" per clock read
    sdc_check.probe_node(
        runs,
        _plan(repeats=1, duration_s=6, seeds=2, shapes=[[15, 16, 17]]),
        clock=lambda: next(ticks),
    )
    assert runs[0].rounds >= 4
    assert {v.status for v in runs[0].verdicts} == {"pass"}
    assert {key[2] for key in exact._GOLDEN if key[0] == (15, 16, 17)} == {0, 1}


# -- whole-GPU probes and the faulty SM -------------------------------------------------------

WHOLE = {
    "dtypes": ["fp32", "bf16", "fp16"],
    "digest_shapes": [[16, 16, 16]],
    "repeats": 2,
    "freivalds_n": 32,
}


@pytest.mark.parametrize("rate", [1.0, 0.3])
def test_one_faulty_sm_of_132_is_found_on_its_gpu_only(node, rate):
    env = node(gpus=8, faults=[{"kind": "sdc", "gpu": 6, "sm": 17, "rate": rate}])
    got = by_target(run_sdc(env, **WHOLE, shapes=None))
    assert got["gpu:6"].metric == "sdc_confirmed", got["gpu:6"].detail
    assert {t for t, r in got.items() if r.status is not Status.PASS} == {"gpu:6"}
    assert env.grader.grade(list(got.values())).level.name == "FAULT"
    # the field engineer reads where the wrong tiles ran
    pattern = got["gpu:6"].evidence["sm_pattern"]
    assert pattern["runs_one_sm"] >= 2 and pattern["runs_several_sms"] == 0
    assert "single SM" in got["gpu:6"].detail


def test_every_result_reports_sm_coverage_1_on_the_simulated_h100(node):
    results = run_sdc(
        node(gpus=4, faults=[{"kind": "sdc", "gpu": 1, "sm": 100}]), **WHOLE, shapes=None
    )
    assert len(results) == 4
    for r in results:
        assert r.evidence["sm_coverage"] == 1.0 and r.evidence["sm_count"] == 132
        assert r.evidence["sm_coverage_method"] == "model"
        assert r.evidence["exact_shapes"] == ["320x256x256", "320x4x256"]
        assert r.evidence["skipped_dtypes"] == {}
    assert "reached 100% of 132 SMs" in by_target(results)["gpu:0"].detail


def test_small_fixed_shapes_report_the_few_sms_they_reach(node):
    (r,) = run_sdc(node(gpus=1), shapes=[[32, 32, 32]])
    assert r.evidence["sm_coverage"] == round(4 / 132, 4)  # 2 x 2 tiles of 16 x 16


def test_a_dtype_whose_kernel_accumulates_in_lower_precision_is_skipped_with_the_reason(node):
    env = node(gpus=1)

    def narrow_bf16(a, b):  # keeps 14 bits while accumulating bf16 products, as fp8 TCs do
        if a.dtype != torch.bfloat16:
            return sdc_lib.gemm(a, b)
        x, y = a.double(), b.double()
        acc = torch.zeros(x.shape[0], y.shape[1], dtype=torch.float64)
        for k in range(x.shape[1]):
            acc = acc + torch.outer(x[:, k], y[k, :])
            mant, exp = torch.frexp(acc)
            acc = torch.ldexp(torch.trunc(mant * 2.0**14) / 2.0**14, exp)
        return acc.to(torch.bfloat16)

    runs = {0: sdc_check.GpuRun(0, _device(0, narrow_bf16))}
    sdc_check.probe_node(
        runs, _plan(shapes=None, digest_shapes=[[16, 16, 16]], dtypes=["bf16", "fp32"])
    )
    (r,) = sdc_check.results_for(ctx_for(env), runs[0])
    assert r.status is Status.PASS
    assert set(r.evidence["skipped_dtypes"]) == {"bf16"}
    assert "accumulates in lower precision" in r.detail
    assert {v.dtype for v in runs[0].verdicts if v.probe == "exact_gemm"} == {"fp32"}


def test_sdc_fault_on_an_sm_the_sku_lacks_is_an_error_naming_the_scenario_key(node):
    (r,) = run_sdc(node(gpus=2, faults=[{"kind": "sdc", "gpu": 1, "sm": 500}]))
    assert r.status is Status.ERROR and "sm 500" in r.detail and "132 SMs" in r.detail
    assert r.evidence["sm_coverage"] == 0.0
