"""The nccl_allreduce check with real torch.distributed (gloo) across 2 CPU processes.

torch (CPU build) is a dev dependency of these tests: pip install torch==2.13.0.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from node_agent.checking.context import CheckContext
from node_agent.checks import nccl_allreduce
from node_agent.compute import allreduce
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.model import Status
from node_agent.peers import free_loopback_port
from node_agent.proc import python_module_argv

SIZES = [4096, 65536, 1048576]
SMALL = {"sizes": SIZES, "iters": 5, "warmup": 2, "cpu_ranks": 2, "timeout_s": 60}


def make_ctx(**params) -> CheckContext:
    return CheckContext(
        check="nccl_allreduce",
        gpu=AbsentGpuBackend("no GPU on CI"),
        kernel_log=None,
        config=config_from_dict({}),
        inventory=None,
        sku=None,
        expected_gpus=None,
        params={**SMALL, **params},
    )


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
            r.evidence["size_bytes"] / (r.evidence["time_us"] * 1e-6) / 1e9
        )
    (peak,) = by_metric(results, "busbw_peak_gbps")
    assert peak.status is Status.PASS and "not graded" in peak.detail
    assert peak.value == max(r.value for r in rows)
    (wrong,) = by_metric(results, "wrong_elements")
    assert wrong.status is Status.PASS and wrong.value == 0


#: every CORRUPT_STRIDE-th element of the wrong rank's contribution is off by one
CORRUPT_STRIDE = 64


def corrupted_count(elements: int) -> int:
    """How many elements :func:`spoil_every_64th` spoils in a buffer of ``elements``."""
    return len(range(0, elements, CORRUPT_STRIDE))


def spoil_every_64th(data) -> None:
    data[::CORRUPT_STRIDE] += 1.0


def test_corrupted_rank_contribution_is_counted_wrong(monkeypatch):
    """Rank 1 contributes wrong data: it runs in this process, its contribution spoiled by an
    injected callable; rank 0 is the check's own rank process, whose figures the check reads."""
    real = nccl_allreduce.run_ranks

    def rank_1_here(world_size, backend, sizes, iters, warmup, timeout_s, **kw):
        port = free_loopback_port()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        argv = nccl_allreduce.worker_argv(1, world_size, backend, sizes, iters, warmup, 30.0)
        args = allreduce.parse_args(argv[argv.index("node_agent.compute.allreduce") + 1 :])
        here: dict = {}

        def rank_1() -> None:
            try:
                here["doc"] = allreduce.measure(args, spoil=spoil_every_64th)
            except Exception as err:  # noqa: BLE001 - reported by the assertion below
                here["error"] = err

        thread = threading.Thread(target=rank_1, daemon=True)
        thread.start()
        runs = real(
            world_size, backend, sizes, iters, warmup, timeout_s, start_ranks=[0], master_port=port
        )
        thread.join(timeout_s)
        assert "doc" in here, f"the wrong rank did not run: {here.get('error')}"
        return runs

    monkeypatch.setattr(nccl_allreduce, "run_ranks", rank_1_here)
    results = nccl_allreduce.run(make_ctx())
    (wrong,) = by_metric(results, "wrong_elements")
    assert wrong.status is Status.FAIL
    assert wrong.value == sum(corrupted_count(s // 4) for s in SIZES)
    assert wrong.evidence["wrong_by_size"][4096] == corrupted_count(1024)


def _left_behind(before: set[int], within_s: float = 5.0) -> set[int]:
    """Rank processes that are not ``before`` and still alive ``within_s`` after the run: a
    killed process dies when it is next scheduled, which on a loaded machine is not at once
    (one was still listed as the run returned, with two test workers on two cores)."""
    deadline = time.monotonic() + within_s
    while (left := _worker_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _worker_pids() -> set[int]:
    """This test's rank processes: ``run_ranks`` starts them as children of this process, so
    the other xdist worker's ranks (an agent's all-reduce check running meanwhile) are not
    counted."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:  # ended, or a zombie: not left running
            continue
        if "node_agent.compute.allreduce" in cmd:
            pids.add(p.pid)
    return pids


def test_peer_that_never_connects_is_error_at_the_time_limit_and_leaves_no_process():
    before = _worker_pids()
    start = time.monotonic()
    runs = nccl_allreduce.run_ranks(
        2, "gloo", [4096], iters=1, warmup=0, timeout_s=6, start_ranks=[0]
    )  # rank 1 never starts
    elapsed = time.monotonic() - start
    assert elapsed < 15
    ctx = make_ctx()
    result = nccl_allreduce._failure(ctx, runs, 6)
    assert result is not None and result.status is Status.ERROR
    assert _left_behind(before) == set()


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

    from node_agent.hardware.sku import load_sku

    sku = load_sku(
        Path(__file__).resolve().parents[2] / "graders" / "skus" / "h100-sxm5-80gb.yaml"
    )  # nccl_allreduce_busbw_gbps_min: 400
    ctx = make_ctx()
    ctx.sku = sku
    rows = [
        {"size_bytes": 1 << 30, "time_us": 1.0, "algbw": peak / 1.75, "busbw": peak, "wrong": 0}
    ]
    nccl = nccl_allreduce._results(ctx, rows, {"backend": "nccl"}, ungraded=None, duration=1.0)
    (result,) = by_metric(nccl, "busbw_peak_gbps")
    assert result.status is status and result.evidence["minimum"] == 400
    gloo = nccl_allreduce._results(
        ctx, rows, {"backend": "gloo"}, ungraded="backend gloo on CPU", duration=1.0
    )
    assert by_metric(gloo, "busbw_peak_gbps")[0].status is Status.PASS


def _h100_sku():
    from pathlib import Path

    from node_agent.hardware.sku import load_sku

    return load_sku(
        Path(__file__).resolve().parents[2] / "graders" / "skus" / "h100-sxm5-80gb.yaml"
    )


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_board_minimum_does_not_grade_fewer_ranks_than_the_board_has(ranks):
    # nccl_allreduce_busbw_gbps_min is nccl-tests on all 8 GPUs of an HGX H100 over NVLink
    ctx = make_ctx()
    ctx.sku = _h100_sku()
    why = nccl_allreduce._not_graded_because(ctx, "nccl", ranks)
    assert why is not None and "all 8 GPUs" in why and f"had {ranks} ranks" in why
    rows = [{"size_bytes": 1 << 30, "time_us": 1.0, "algbw": 60.0, "busbw": 60.0, "wrong": 0}]
    (peak,) = by_metric(
        nccl_allreduce._results(ctx, rows, {"backend": "nccl"}, ungraded=why, duration=1.0),
        "busbw_peak_gbps",
    )
    assert peak.status is Status.PASS and "not graded" in peak.detail


def test_one_cpu_rank_skips_because_busbw_is_zero_by_definition():
    (result,) = nccl_allreduce.run(make_ctx(cpu_ranks=1))
    assert result.status is Status.SKIP and result.metric == "busbw_peak_gbps"
    assert "2(n-1)/n is 0 by definition" in result.detail
    assert result.evidence["world_size"] == 1


def test_one_gpu_allreduce_skips_instead_of_an_error_of_busbw_zero():
    """One real-looking GPU (a stand-in device: no GPU runs here) takes the nccl path, which
    stops before starting a rank: the real H100 in a VM graded "busbw 0.0 GB/s" ERROR."""
    from node_agent.gpu.base import NotSupported

    class OneGpu:
        name, simulated, unavailable_reason, broken = "nvml", False, None, False

        class Dev:
            index = 0

            def virtualization_mode(self):
                raise NotSupported("not asked")

        def devices(self):
            return [self.Dev()]

    ctx = make_ctx()
    ctx.gpu = OneGpu()
    ctx.sku = _h100_sku()
    (result,) = nccl_allreduce.run(ctx)
    assert result.status is Status.SKIP and result.evidence["backend"] == "nccl"
    assert result.evidence["world_size"] == 1 and "one rank" in result.detail


def test_ranks_never_import_from_the_working_directory(tmp_path, monkeypatch):
    """An agent started in a directory others can write to: a planted torch.py there must
    not run in the ranks (they run as python -P in /)."""
    marker = tmp_path / "planted-ran"
    (tmp_path / "torch.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('planted torch')\n"
    )
    monkeypatch.chdir(tmp_path)
    results = nccl_allreduce.run(make_ctx(sizes=[4096]))
    assert not marker.exists()
    (peak,) = by_metric(results, "busbw_peak_gbps")
    assert peak.status is Status.PASS, peak.detail


def test_rank_argv_is_python_dash_p_and_the_child_path_has_no_empty_entry():
    argv = nccl_allreduce.worker_argv(0, 2, "gloo", [4096], 1, 0, 5.0, python="/py")
    start = python_module_argv("node_agent.compute.allreduce", python="/py")
    assert argv[: len(start)] == start
    env = nccl_allreduce.child_env({"PYTHONPATH": ":/opt/x:"})
    entries = env["PYTHONPATH"].split(":")
    assert "" not in entries and entries[0] == "/opt/x"
    from pathlib import Path

    import node_agent

    assert str(Path(node_agent.__file__).resolve().parent.parent) in entries
