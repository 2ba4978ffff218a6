"""SDC probes on a real CUDA GPU (``make gpu-validate``): every whole-GPU exact spec equals its
golden in every dtype the GPU has (fp8 through ``torch._scaled_mm``), the accumulators are as
wide as the exactness argument needs, ``%smid`` shows a whole-GPU round reaching every SM, and
the in-training probe runs on its own stream, reads its result back asynchronously, never
synchronises the host, and holds no more device memory than it states (64 MiB by default).

Without a GPU every test here skips, saying so."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest

torch = pytest.importorskip("torch")

from node_agent.sdc import coverage as sdc_coverage  # noqa: E402
from node_agent.sdc import exact  # noqa: E402
from node_agent.sdc import probes as sdc  # noqa: E402
from node_agent.sdc.probes import ProbeSpec, SdcProbe  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

FP32_ACC = ["fp32", "tf32", "bf16", "fp16"]


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _drain(probe: SdcProbe, want: int, timeout_s: float = 120.0) -> list:
    """Call step() until ``want`` verdicts came back (the CUDA path completes them later)."""
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        v = probe.step()
        if v is not None:
            out.append(v)
        else:
            time.sleep(0.001)
    return out


def _busy_default_stream(ms: float = 300.0) -> None:
    """Queue about ``ms`` of work on the default stream, as a training step would."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = x @ x
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end), 0.01)
    for _ in range(int(ms / per) + 1):
        y = torch.tanh(y @ x)


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP32_ACC)
def test_gpu_accumulates_bf16_fp16_tf32_fp32_products_in_full_fp32(dtype):
    model = exact.tile_model_for(_cuda())
    assert sdc.accumulator_check(dtype, _cuda(), tiles=model) is None


def test_gpu_whole_gpu_exact_specs_equal_their_goldens():
    dev = _cuda()
    model = exact.tile_model_for(dev)
    specs, skipped = sdc.whole_gpu_specs(dev, model)
    assert model.sm_count == torch.cuda.get_device_properties(dev).multi_processor_count
    lower = {
        d: why
        for d in {s.dtype for s in specs}
        if (why := sdc.accumulator_check(d, dev, tiles=model))
    }
    assert set(lower) <= {"fp8"}, lower  # only fp8 may accumulate narrower than fp32
    for spec in specs:
        if spec.dtype in lower:
            continue
        assert model.coverage([(spec.m, spec.n)]) == 1.0
        v = sdc.exact_gemm_probe(spec, dev, tiles=model)
        assert v.status == "pass", v.detail
    print(
        f"\n{torch.cuda.get_device_name(dev)}: {[s.label() for s in specs]}; skipped {skipped}; "
        f"lower-precision {lower}"
    )


@pytest.mark.parametrize("dtype", FP32_ACC)
@pytest.mark.parametrize(
    "shape",
    list(sdc.DEFAULT_SHAPES) + [(1024, 256, 1024), (4096, 64, 512)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_gpu_explicit_shapes_equal_their_goldens(dtype: str, shape) -> None:
    spec = ProbeSpec(*shape, dtype=dtype)
    v = sdc.exact_gemm_probe(spec, "cuda")
    assert v.status == "pass", v.detail


def test_gpu_fp8_probe_through_scaled_mm():
    dev = _cuda()
    why = exact.dtype_unsupported("fp8", dev)
    if why:
        pytest.skip(why)
    model = exact.tile_model_for(dev)
    lower = sdc.accumulator_check("fp8", dev, tiles=model)
    if lower is not None:
        assert "accumulates in lower precision" in lower
        pytest.skip(f"measured, and the probe skips fp8 as designed: {lower}")
    (spec,) = sdc.whole_gpu_specs(dev, model, ["fp8"])[0]
    assert (spec.k, exact.input_bits(spec)) == (32, 4)
    assert sdc.exact_gemm_probe(spec, dev, tiles=model).status == "pass"
    bad = sdc.exact_gemm_probe(spec, dev, sdc.corrupting_matmul(tiles=model, sm=3), tiles=model)
    assert bad.status == "confirmed" and len(bad.evidence["tile_residues"]) == 1


def test_gpu_corruption_is_confirmed_and_freivalds_agrees() -> None:
    spec = ProbeSpec(512, 256, 512, "bf16")
    v = sdc.exact_gemm_probe(spec, "cuda", matmul=sdc.corrupting_matmul())
    assert v.status == "confirmed" and v.mismatched_elements == 1
    a, b = exact._inputs_cpu(spec)
    ad, bd = a.cuda(), b.cuda()
    assert sdc.freivalds_check(ad, bd, ad @ bd) == 0
    assert sdc.freivalds_check(ad, bd, sdc.corrupting_matmul()(ad, bd)) == 1


def test_gpu_run_probes_all_pass_and_digests_agree_across_gpus() -> None:
    digests: dict = {}
    for i in range(torch.cuda.device_count()):
        vs = sdc.run_probes(f"cuda:{i}")
        assert {v.status for v in vs} == {"pass"}, [v.detail for v in vs if v.status != "pass"]
        digests[i] = "".join(v.evidence["digest"] for v in vs if v.probe == "digest_gemm")
    assert sdc.odd_one_out(digests) == []


# -- %smid coverage --------------------------------------------------------------------------


def _kernel_missing(name: str) -> str | None:
    if name in ("cupy", "triton") and importlib.util.find_spec(name) is None:
        return f"{name} is not installed (pip install {name})"
    return None


@pytest.mark.parametrize("kernel", sorted(sdc_coverage.KERNELS))
def test_smid_shows_a_whole_gpu_round_reaching_every_sm(kernel):
    missing = _kernel_missing(kernel)
    if missing:
        pytest.skip(missing)
    from node_agent.sdc.validation import measure_sm_coverage

    cov = measure_sm_coverage(method=kernel)
    sm_count = torch.cuda.get_device_properties(_cuda()).multi_processor_count
    assert cov.method == f"smid:{kernel}" and cov.sm_count == sm_count
    assert cov.value == 1.0, cov
    print(f"\n{kernel}: {cov}")


def test_smid_shows_an_old_fixed_probe_reaching_one_sm():
    model = exact.tile_model_for(_cuda())
    ids, _ = sdc_coverage.smids(_cuda(), model.tiles(128, 128))
    assert len(ids) == 1  # one 128 x 128 tile: one SM of the GPU's many


def test_sdc_sm_coverage_validation_figure_is_a_share():
    from node_agent.sdc import sdc_sm_coverage

    assert sdc_sm_coverage() == 1.0


# -- the in-training probe -------------------------------------------------------------------


def test_probe_runs_on_its_own_stream_and_never_synchronises_the_host(tmp_path) -> None:
    default = torch.cuda.current_stream()
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path)
    assert probe._stream is not None and probe._stream != default
    _busy_default_stream()
    time.sleep(0.05)  # let the budget (half the elapsed time) allow the first probe
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call below raises
    try:
        first = probe.step()  # queues the first probe, returns at once
        assert first is None and probe._pending is not None
        assert not default.query()  # the training stream is still busy: step() did not wait
        verdicts = _drain(probe, want=len(probe.specs))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.cuda.current_stream() == default
    assert len(verdicts) == len(probe.specs)
    assert {v.status for v in verdicts} == {"pass"}, [v.detail for v in verdicts]
    assert {v.shape for v in verdicts} == {s.shape for s in probe.specs}
    assert probe.cost_s > 0 and all(v.duration_s > 0 for v in verdicts)  # CUDA-event timing
    assert {v.evidence["sm_coverage"] for v in verdicts} == {1.0}
    torch.cuda.synchronize()


def test_probe_result_comes_back_at_a_later_step_through_pinned_memory(tmp_path) -> None:
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path)
    assert probe._readback is not None and probe._readback.count.is_pinned()
    _busy_default_stream(100.0)
    time.sleep(0.05)  # let the budget allow the first probe
    assert probe.step() is None and probe._pending is not None  # launched ...
    assert probe.probes_run == 0  # ... not read
    (v,) = _drain(probe, want=1)
    assert probe.probes_run == 1 and v.status == "pass"


def test_collect_reads_back_a_completed_probe_and_starts_no_other(tmp_path) -> None:
    """The end of a measured stretch: the probe launched at its last step is counted."""
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path)
    time.sleep(0.05)  # let the budget allow the first probe
    assert probe.step() is None and probe._pending is not None
    torch.cuda.synchronize()
    v = probe.collect()
    assert v is not None and v.status == "pass" and probe.probes_run == 1
    assert probe._pending is None and probe.collect() is None  # nothing started in its place
    assert probe.cost_s > 0


def test_side_stream_probe_confirms_injected_corruption(tmp_path) -> None:
    dev = _cuda()
    probe = SdcProbe(
        budget_fraction=0.5,
        spool_dir=tmp_path,
        matmul=sdc.corrupting_matmul(tiles=exact.tile_model_for(dev), sm=11),
    )
    verdicts = _drain(probe, want=2)
    assert {v.status for v in verdicts} == {"confirmed"}
    assert all(len(v.evidence["tile_residues"]) == 1 for v in verdicts)  # one SM's tiles
    assert [v.status for v in sdc.read_spool(tmp_path)] == ["confirmed", "confirmed"]


def test_probe_device_memory_stays_within_what_it_states(tmp_path) -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path)
    _drain(probe, want=len(probe.specs))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    print(
        f"\nSdcProbe holds {held / 2**20:.1f} MiB (states {probe.memory_bytes / 2**20:.1f} MiB, "
        f"{probe.tiles_per_sm} tile(s) per SM, shapes {sorted({s.shape for s in probe.specs})})"
    )
    assert probe.memory_bytes <= 64 * 2**20
    assert held <= 64 * 2**20
    assert held <= probe.memory_bytes + 2**20  # 1 MiB for allocator rounding of small tensors


def test_training_overhead_harness_runs_on_the_gpu():
    """The harness, not the figure: 2 pairs of 20 steps are about 0.5 s of probe time, which at
    the default 0.1 % buys 0.5 ms, less than one probe costs in training (about 1.4 ms on an
    H100: the GPU host counted 0 probes at 2 x 10 steps). At 5 % it buys several; every one
    must pass, be counted (the last one read back too) and keep the probe within its budget."""
    from node_agent.sdc.validation import measure_training_overhead

    o = measure_training_overhead(pairs=2, steps_per_block=20, warmup_steps=5, budget_fraction=0.05)
    print(f"\n{o}")
    assert math.isfinite(o.percent) and o.probes_run >= 2, o
    assert o.verdicts == {"pass": o.probes_run}, o
    assert o.within_budget and 0 < o.probe_share_percent <= 5.0, o


def test_sdc_check_probes_every_cuda_gpu_clean_with_measured_coverage() -> None:
    """The check's own path (compute.open_device -> probe_node) on the real GPUs: whole-GPU
    exact probes in every dtype, %smid coverage, no GPU an odd one out."""
    from node_agent.checks import sdc as sdc_check
    from node_agent.compute import devices as compute

    specs = compute.compute_specs(list(range(torch.cuda.device_count())), None)
    runs = {s.index: sdc_check.GpuRun(s.index, compute.open_device(s)) for s in specs}
    plan, notes = sdc_check.make_plan({"repeats": 2, "freivalds_n": 512}, on_cuda=True)
    assert notes == [] and set(plan.dtypes) == {"fp32", "tf32", "bf16", "fp16", "fp8"}
    sdc_check.probe_node(runs, plan)
    for run in runs.values():
        bad = [v.detail for v in run.verdicts if v.status != "pass"]
        assert not bad, bad
        assert run.coverage is not None and run.coverage.value == 1.0
        assert run.coverage.method.startswith("smid:"), run.coverage
        assert set(run.skipped) <= {"fp8"}, run.skipped
