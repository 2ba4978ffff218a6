"""The burn on a real CUDA GPU: a few seconds of bf16 and fp32 GEMMs through the real worker
processes, with NVML telemetry when the driver answers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from node_agent.compute.burn import BurnPlan, run_burn  # noqa: E402
from node_agent.compute.devices import ComputeSpec  # noqa: E402
from node_agent.gpu import open_backend  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


def test_burn_on_gpu_0_is_fast_correct_and_traced():
    backend = open_backend()
    try:
        plan = BurnPlan(
            size=4096,
            duration_s=6.0,
            precisions=("bf16", "fp32"),
            sample_s=0.5,
            verify_every=8,
            stall_s=60.0,
            startup_timeout_s=120.0,
        )
        out = run_burn([ComputeSpec(0)], plan, backend, sample_interval_s=0.5, deadline_s=200)
    finally:
        backend.close()
    worker = out.workers[0]
    assert worker.failure is None, worker.failure_detail
    assert out.precisions == ["bf16", "fp32"]
    for precision in out.precisions:
        assert worker.median_tflops(precision) > 1.0  # any datacenter GPU is far above this
    assert worker.wrong_events == []
    assert sum(s.verified for s in worker.samples) > 0
    trace = out.trace()[0]
    if backend.unavailable_reason is None:
        assert trace["t_s"] and any(t is not None for t in trace["temp_c"])
        assert any(v is not None for v in trace["tflops"])


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_correct_products_on_the_gpu_never_send_the_burn_to_the_cpu(monkeypatch, precision):
    """The tf32 phase that starved an H100: its tensor cores' truncating sums were flagged on
    nearly every check, and every flag recomputed rows on the CPU while the GPU idled. A
    correct GPU's products must be cleared on the device, with one full synchronisation per
    window and the host never waiting on the newest check."""
    from node_agent.compute import burn
    from node_agent.compute.devices import open_device

    recomputed = []
    real = burn.count_wrong
    monkeypatch.setattr(burn, "count_wrong", lambda *a, **k: recomputed.append(1) or real(*a, **k))

    class Counting(burn.DeviceWaits):
        drains = 0

        def synchronize(self):
            Counting.drains += 1
            super().synchronize()

    device = open_device(ComputeSpec(0))
    waits = Counting(device.device)
    engine = burn.BurnEngine(device, BurnPlan(size=4096, precisions=(precision,)), waits=waits)
    assert engine.prepare() == {}
    sent = []
    start = burn.time.monotonic()
    engine.run_phase(precision, start + 3.0, start, sent.append)
    samples = [m for m in sent if m[0] == "sample"]
    assert recomputed == [] and [m for m in sent if m[0] == "wrong"] == []
    assert sum(m[6] for m in samples) >= 8  # products were verified
    # one drain per window, plus preparation's and the warm-up's
    assert Counting.drains <= len(samples) + 2
