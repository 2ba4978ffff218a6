"""hbm_bandwidth and pcie_bandwidth on real CUDA GPUs: figures in the range the hardware can
reach, pinned host memory, the link read under load."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from node_agent.checking.context import CheckContext  # noqa: E402
from node_agent.checks import hbm_bandwidth, pcie_bandwidth  # noqa: E402
from node_agent.config import config_from_dict  # noqa: E402
from node_agent.gpu import open_backend  # noqa: E402
from node_agent.model import Status  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture
def ctx_for():
    backend = open_backend()
    if backend.unavailable_reason:
        pytest.skip(f"NVML unavailable: {backend.unavailable_reason}")

    def make(check, **params):
        return CheckContext(
            check=check,
            gpu=backend,
            kernel_log=None,
            config=config_from_dict({}),
            inventory=None,
            sku=None,
            expected_gpus=None,
            params=params,
            state_dir=Path("/tmp"),
        )

    yield make
    backend.close()


def test_gpu_copy_bandwidth_is_measured_per_gpu(ctx_for):
    results = hbm_bandwidth.run(ctx_for("hbm_bandwidth", size_bytes=1 << 30, reps=5))
    copies = [r for r in results if r.metric == "copy_gbps"]
    assert len(copies) == torch.cuda.device_count()
    for r in copies:
        assert r.status in (Status.PASS, Status.WARN, Status.FAIL), r.detail
        # any datacenter GPU since V100 copies faster than 300 GB/s; none beyond 10 TB/s yet
        assert 300 < r.value < 10_000, r.detail
        assert r.evidence["max_gbps"] >= r.value and r.evidence["device"].startswith("cuda")


def test_pcie_copies_are_pinned_and_link_read_under_load(ctx_for):
    results = pcie_bandwidth.run(
        ctx_for("pcie_bandwidth", size_bytes=64 << 20, reps=5, concurrent_s=0.5)
    )
    h2d = [r for r in results if r.metric == "h2d_gbps"]
    assert len(h2d) == torch.cuda.device_count()
    for r in h2d:
        assert r.evidence["pinned"] is True
        assert 3 < r.value < 130, r.detail  # Gen3 x4 at worst .. Gen6 x16
    together = [r for r in results if r.metric == "d2h_gbps_concurrent"]
    assert together and all(r.value > 0 for r in together)
    links = [r for r in results if r.metric == "pcie_link_under_load"]
    assert links and all(r.status in (Status.PASS, Status.FAIL, Status.SKIP) for r in links)
    for r in links:
        if r.status is not Status.SKIP:
            assert r.evidence["gen_current"] >= 1 and r.evidence["copies_in_flight"] >= 1
