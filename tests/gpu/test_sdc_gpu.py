"""SDC probes on a real CUDA GPU: the GPU's exact GEMM equals the CPU golden in every dtype, and
the in-training probe works on its side stream without blocking the default stream."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from node_agent.sdc import probes as sdc  # noqa: E402
from node_agent.sdc.probes import ProbeSpec, SdcProbe  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

DTYPES = ["fp32", "tf32", "bf16", "fp16"]
SHAPES = list(sdc.DEFAULT_SHAPES) + [(1024, 256, 1024), (4096, 64, 512)]


def _drain(probe: SdcProbe, want: int, timeout_s: float = 60.0) -> list:
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_exact_gemm_equals_cpu_golden(dtype: str, shape) -> None:
    spec = ProbeSpec(*shape, dtype=dtype)
    a, b, c = sdc.golden(spec)
    torch_dtype, tf32 = sdc.DTYPES[dtype]
    with sdc.strict_matmul(tf32):
        got = torch.matmul(a.to(torch_dtype).cuda(), b.to(torch_dtype).cuda())
    assert torch.equal(got.to(torch.float64).cpu(), c.to(torch.float64))
    v = sdc.exact_gemm_probe(spec, "cuda")
    assert v.status == "pass", v.detail


def test_gpu_corruption_is_confirmed_and_freivalds_agrees() -> None:
    spec = ProbeSpec(512, 256, 512, "bf16")
    v = sdc.exact_gemm_probe(spec, "cuda", matmul=sdc.corrupting_matmul())
    assert v.status == "confirmed" and v.mismatched_elements == 1
    a, b, _ = sdc.golden(spec)
    ad, bd = a.to(torch.bfloat16).cuda(), b.to(torch.bfloat16).cuda()
    assert sdc.freivalds_check(ad, bd, ad @ bd) == 0
    assert sdc.freivalds_check(ad, bd, sdc.corrupting_matmul()(ad, bd)) == 1


def test_gpu_run_probes_all_pass_and_digests_agree_across_gpus() -> None:
    digests: dict = {}
    for i in range(torch.cuda.device_count()):
        vs = sdc.run_probes(f"cuda:{i}")
        assert {v.status for v in vs} == {"pass"}, [v.detail for v in vs if v.status != "pass"]
        digests[i] = "".join(v.evidence["digest"] for v in vs if v.probe == "digest_gemm")
    assert sdc.odd_one_out(digests) == []


def test_probe_on_side_stream_works_and_leaves_training_stream_alone(tmp_path) -> None:
    default = torch.cuda.current_stream()
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path)
    assert probe.device.type == "cuda"
    assert probe._stream is not None and probe._stream != default
    # Keep the default stream busy, as training would, while probes run beside it.
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(5):
        x = torch.tanh(x @ x)
    verdicts = _drain(probe, want=len(sdc.default_specs("cuda")) * 2)
    assert torch.cuda.current_stream() == default
    assert verdicts and {v.status for v in verdicts} == {"pass"}, [v.detail for v in verdicts]
    assert {v.probe for v in verdicts} == {"exact_gemm", "digest_gemm"}
    assert probe.cost_s > 0 and all(v.duration_s > 0 for v in verdicts)  # CUDA-event timing
    torch.cuda.synchronize()


def test_side_stream_probe_confirms_injected_corruption(tmp_path) -> None:
    probe = SdcProbe(budget_fraction=0.5, spool_dir=tmp_path, matmul=sdc.corrupting_matmul(), digests=False)
    (v,) = _drain(probe, want=1)
    assert v.status == "confirmed" and v.probe == "exact_gemm"
    assert [s.status for s in sdc.read_spool(tmp_path)] == ["confirmed"]


def test_sdc_check_probes_every_cuda_gpu_clean_and_the_node_agrees() -> None:
    """The check's own path (compute.open_device -> probe_node) on the real GPUs, tf32 included:
    every exact GEMM equals the CPU golden and no GPU is an odd one out."""
    from node_agent.checks import sdc as sdc_check
    from node_agent.compute import devices as compute

    specs = compute.compute_specs(list(range(torch.cuda.device_count())), None)
    runs = {s.index: sdc_check.GpuRun(s.index, compute.open_device(s)) for s in specs}
    plan, notes = sdc_check.make_plan({"repeats": 2, "freivalds_n": 512}, on_cuda=True)
    assert notes == [] and {s.dtype for s in plan.specs} == set(DTYPES)
    sdc_check.probe_node(runs, plan)
    for run in runs.values():
        bad = [v.detail for v in run.verdicts if v.status != "pass"]
        assert not bad, bad
        assert len(run.digests) == len(plan.specs)
