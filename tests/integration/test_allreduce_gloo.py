"""The nccl_allreduce check with real torch.distributed (gloo) across 2 CPU processes.

torch (CPU build) is a dev dependency of these tests: pip install torch==2.13.0.
"""

from __future__ import annotations

import time

import psutil
import pytest

from node_agent.checks import CheckContext, nccl_allreduce
from node_agent.compute.allreduce import corrupted_count
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.model import Status

SIZES = [4096, 65536, 1048576]
SMALL = {"sizes": SIZES, "iters": 5, "warmup": 2, "cpu_ranks": 2, "timeout_s": 60}


def make_ctx(**params) -> CheckContext:
    return CheckContext(check="nccl_allreduce", gpu=AbsentGpuBackend("no GPU on CI"),
                        kernel_log=None, config=config_from_dict({}), inventory=None, sku=None,
                        expected_gpus=None, params={**SMALL, **params})


def by_metric(results, metric):
    return [r for r in results if r.metric == metric]


def test_gloo_allreduce_two_ranks_measures_every_size_correctly():
    results = nccl_allreduce.run(make_ctx())
    rows = by_metric(results, "busbw_gbps")
    assert [r.evidence["size_bytes"] for r in rows] == SIZES, results
    for r in rows:
        assert r.status is Status.PASS and r.value > 0
        assert r.evidence["backend"] == "gloo" and r.evidence["world_size"] == 2
        assert r.evidence["wrong"] == 0
        # busbw = algbw * 2(n-1)/n, and n=2 makes them equal
        assert r.evidence["busbw"] == pytest.approx(r.evidence["algbw"])
        assert r.evidence["algbw"] == pytest.approx(
            r.evidence["size_bytes"] / (r.evidence["time_us"] * 1e-6) / 1e9)
    (peak,) = by_metric(results, "busbw_peak_gbps")
    assert peak.status is Status.PASS and "not graded" in peak.detail
    assert peak.value == max(r.value for r in rows)
    (wrong,) = by_metric(results, "wrong_elements")
    assert wrong.status is Status.PASS and wrong.value == 0


def test_corrupted_rank_contribution_is_counted_wrong():
    results = nccl_allreduce.run(make_ctx(corrupt_rank=1))
    (wrong,) = by_metric(results, "wrong_elements")
    assert wrong.status is Status.FAIL
    assert wrong.value == sum(corrupted_count(s // 4) for s in SIZES)
    assert wrong.evidence["wrong_by_size"][4096] == corrupted_count(1024)


def _worker_pids() -> set[int]:
    pids = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "node_agent.compute.allreduce" in cmd:
            pids.add(p.pid)
    return pids


def test_peer_that_never_connects_is_error_at_the_time_limit_and_leaves_no_process():
    before = _worker_pids()
    start = time.monotonic()
    runs = nccl_allreduce.run_ranks(2, "gloo", [4096], iters=1, warmup=0, timeout_s=6,
                                    start_ranks=[0])  # rank 1 never starts
    elapsed = time.monotonic() - start
    assert elapsed < 15
    ctx = make_ctx()
    result = nccl_allreduce._failure(ctx, runs, 6)
    assert result is not None and result.status is Status.ERROR
    assert _worker_pids() - before == set()


def test_check_with_unreachable_peer_reports_error(monkeypatch):
    real = nccl_allreduce.run_ranks

    def only_rank0(*args, **kwargs):
        return real(*args, **kwargs, start_ranks=[0])

    monkeypatch.setattr(nccl_allreduce, "run_ranks", only_rank0)
    (result,) = nccl_allreduce.run(make_ctx(timeout_s=5))
    assert result.status is Status.ERROR
    assert result.metric == "busbw_peak_gbps"


def test_torch_missing_skips_with_install_hint(monkeypatch):
    monkeypatch.setattr(nccl_allreduce, "torch_available", lambda: False)
    (result,) = nccl_allreduce.run(make_ctx())
    assert result.status is Status.SKIP
    assert result.detail.startswith("torch not installed (")
    assert "-m pip install" in result.detail and "torch" in result.detail


@pytest.mark.parametrize("peak, status", [(350.0, Status.FAIL), (450.0, Status.PASS)])
def test_nccl_peak_graded_against_sku_minimum_only_for_nccl(peak, status):
    from pathlib import Path

    from node_agent.grading.sku import load_sku

    sku = load_sku(Path(__file__).resolve().parents[2] / "graders" / "skus"
                   / "h100-sxm5-80gb.yaml")  # nccl_allreduce_busbw_gbps_min: 400
    ctx = make_ctx()
    ctx.sku = sku
    rows = [{"size_bytes": 1 << 30, "time_us": 1.0, "algbw": peak / 1.75, "busbw": peak,
             "wrong": 0}]
    nccl = nccl_allreduce._results(ctx, rows, {"backend": "nccl"}, graded=True, duration=1.0)
    (result,) = by_metric(nccl, "busbw_peak_gbps")
    assert result.status is status and result.evidence["minimum"] == 400
    gloo = nccl_allreduce._results(ctx, rows, {"backend": "gloo"}, graded=False, duration=1.0)
    assert by_metric(gloo, "busbw_peak_gbps")[0].status is Status.PASS
