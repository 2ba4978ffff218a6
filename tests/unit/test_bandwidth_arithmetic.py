"""The GB/s arithmetic and verdicts of hbm_bandwidth / pcie_bandwidth, without measuring."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checking.transfer import copy_bytes, gbps, rep_stats, timed, timed_copy
from node_agent.checks import pcie_bandwidth
from node_agent.checks.pcie_bandwidth import LinkReading, link_result
from node_agent.compute.copy_model import copy_model, pcie_link_gbps
from node_agent.compute.devices import ComputeSpec, open_device
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.gpu.base import GpuTimeout, NotSupported, PcieLink
from node_agent.grading.rules import load_grader
from node_agent.hardware.sku import load_sku
from node_agent.model import Level, Status
from node_agent.resources import graders_dir
from node_agent.sim.node import ScenarioCompute
from node_agent.sim.scenario import Fault, Scenario

REPO = Path(__file__).resolve().parents[2]


def test_gbps_is_decimal_gigabytes_per_second():
    assert gbps(50e9, 1.0) == 50.0
    assert gbps(256 * 2**20, 0.005) == pytest.approx(53.687, rel=1e-4)  # bandwidthTest-like


def test_device_copy_counts_bytes_read_and_written():
    assert copy_bytes(4 * 2**30) == 8 * 2**30
    # a 4 GiB copy in 2.86 ms is ~3.0 TB/s of HBM traffic (H100 SXM5 territory)
    assert gbps(copy_bytes(4 * 2**30), 0.00286) == pytest.approx(3003.5, rel=1e-3)


def test_a_clock_that_did_not_advance_is_refused_not_infinite():
    with pytest.raises(ValueError, match="did not advance"):
        gbps(1e9, 0.0)


def test_rep_stats_median_max_min_p90():
    stats = rep_stats(10**9, [1.0, 0.5, 0.25, 2.0, 1.0])  # 1, 2, 4, 0.5, 1 GB/s
    assert (stats.median_gbps, stats.max_gbps, stats.min_gbps, stats.reps) == (1.0, 4.0, 0.5, 5)
    assert stats.median_gbps <= stats.p90_gbps <= stats.max_gbps
    assert rep_stats(10**9, [0.5]).p90_gbps == 2.0


def test_rep_stats_without_repetitions_is_an_error():
    with pytest.raises(ValueError, match="no repetition"):
        rep_stats(1, [])


class _StepClock:
    """A device whose clock advances by a set step per reading (fake: a real clock cannot give
    the exact elapsed times this arithmetic is checked against)."""

    def __init__(self, steps):
        self._steps = list(steps)
        self.now = 0.0
        self.synced = 0

    def synchronize(self):
        self.synced += 1

    def clock(self):
        self.now += self._steps.pop(0)
        return self.now


def test_timed_synchronises_and_divides_by_runs_until_min_s_passed():
    dev = _StepClock([0.0, 0.0, 0.0001, 0.0003])  # start, then 0 / 0.1 ms / 0.4 ms elapsed
    calls = []
    seconds = timed(dev, lambda: calls.append(1), min_s=0.0002)
    assert len(calls) == 3 and seconds == pytest.approx(0.0004 / 3)
    assert dev.synced == 4  # before the start, and after every run


def test_timed_keeps_going_while_the_clock_has_not_moved():
    dev = _StepClock([5.0, 0.0, 0.002])
    assert timed(dev, lambda: None) == pytest.approx(0.001)


def _ctx(sku="h100-sxm5-80gb"):
    return CheckContext(
        check="pcie_bandwidth",
        gpu=AbsentGpuBackend("test"),
        kernel_log=None,
        config=config_from_dict({}),
        inventory=None,
        sku=load_sku(REPO / "graders" / "skus" / f"{sku}.yaml") if sku else None,
        expected_gpus=None,
    )


def _link(gen, width, gen_max=5, width_max=16):
    return LinkReading(link=PcieLink(gen, gen_max, width, width_max, 0), copies_in_flight=3)


@pytest.mark.parametrize(
    "gen, width, status, words",
    [
        (5, 16, Status.PASS, "Gen5 x16 while copying"),
        (5, 8, Status.FAIL, "x8 of x16"),
        (4, 16, Status.FAIL, "Gen4 of Gen5"),
        (3, 4, Status.FAIL, "Gen3 of Gen5 and x4 of x16"),
    ],
)
def test_link_under_load_graded_against_sku_gen_and_width(gen, width, status, words):
    result = link_result(_ctx(), 2, _link(gen, width))
    assert result.status is status and result.target == "gpu:2"
    assert words in result.detail
    assert result.evidence["gen_expected"] == 5 and result.evidence["width_expected"] == 16


class _Copying:
    """A GPU that copies (no GPU here: its copies do nothing) for ``_link_under_load``."""

    def __init__(self) -> None:
        self.dev = types.SimpleNamespace(
            spec=types.SimpleNamespace(index=0), synchronize=lambda: None
        )

    def h2d(self) -> None:
        pass

    def d2h(self) -> None:
        pass


class _Nvml:
    """NVML's PCIe link answers, one per call (the last repeated): a stand-in for the driver."""

    def __init__(self, *gens: int) -> None:
        self.gens, self.calls = list(gens), 0

    def pcie(self) -> PcieLink:
        gen = self.gens[min(self.calls, len(self.gens) - 1)]
        self.calls += 1
        return PcieLink(gen, 5, 16, 16, 0)


def test_a_link_still_training_up_when_first_read_is_read_again_and_passes(monkeypatch):
    """The first reading under load caught the link at its idle Gen1 (it trains up as the copies
    start), and one reading drained the node as a degraded link."""
    monkeypatch.setattr(pcie_bandwidth, "LINK_READ_GAP_S", 0.0)
    nvml = _Nvml(1, 5)
    reading = pcie_bandwidth._link_under_load(_Copying(), nvml, timeout_s=10)
    assert (reading.link.gen_current, reading.reads, nvml.calls) == (5, 2, 2)
    assert link_result(_ctx(), 0, reading).status is Status.PASS


def test_a_link_low_in_every_reading_fails_and_a_full_one_is_read_once(monkeypatch):
    monkeypatch.setattr(pcie_bandwidth, "LINK_READ_GAP_S", 0.0)
    low = pcie_bandwidth._link_under_load(_Copying(), _Nvml(1), timeout_s=10)
    assert low.reads == pcie_bandwidth.LINK_READS and low.link.gen_current == 1
    result = link_result(_ctx(), 0, low)
    assert result.status is Status.FAIL and result.evidence["link_reads"] == 3
    full = _Nvml(5)
    assert pcie_bandwidth._link_under_load(_Copying(), full, timeout_s=10).reads == 1
    assert full.calls == 1


def test_link_without_sku_is_graded_against_its_own_maximum():
    assert link_result(_ctx(sku=None), 0, _link(4, 16, gen_max=4)).status is Status.PASS
    bad = link_result(_ctx(sku=None), 0, _link(4, 8, gen_max=4))
    assert bad.status is Status.FAIL and "the link's maximum" in bad.detail


@pytest.mark.parametrize(
    ("gen", "width", "gen_max", "width_max", "status", "words"),
    [
        (4, 16, 4, 16, Status.WARN, "Gen4 of the SKU's Gen5"),  # a Gen5 GPU in a Gen4 server
        (5, 8, 5, 8, Status.WARN, "x8 of the SKU's x16"),  # an x16 GPU in a slot wired x8
        (3, 16, 4, 16, Status.FAIL, "Gen3 of Gen4"),  # below what this server gives it
        (4, 8, 4, 16, Status.FAIL, "x8 of x16"),
    ],
)
def test_a_link_short_of_the_sku_only_where_the_system_cannot_give_more_is_the_platforms(
    gen, width, gen_max, width_max, status, words
):
    """NVML's maxima are "possible with this device and system". An H100 in a Gen4 server, or
    in a slot wired x8, trains as far as it can and was a FAULT on every GPU: a replacement of
    hardware that is fine. A WARN naming the platform; below what the system gives, a FAIL."""
    result = link_result(_ctx(), 1, _link(gen, width, gen_max, width_max))
    assert result.status is status and words in result.detail, result.detail
    grade = load_grader(graders_dir(config_from_dict({}))).grade([result])
    assert grade.level is (Level.WARN if status is Status.WARN else Level.ERROR)


def test_link_not_readable_is_skip_and_a_hung_read_is_error():
    unsupported = link_result(_ctx(), 1, LinkReading(error=NotSupported("no PCIe info")))
    assert unsupported.status is Status.SKIP
    hung = link_result(_ctx(), 1, LinkReading(error=GpuTimeout("did not return")))
    assert hung.status is Status.ERROR and "did not return" in hung.detail


# -- the copy model of simulated GPUs ---------------------------------------------------------


def _scenario(*faults, gpus=8, sku="h100-sxm5-80gb"):
    return Scenario(
        sku=sku,
        gpus=gpus,
        source="test",
        faults=tuple(Fault(kind=k, gpu=g, params=p) for k, g, p in faults),
    )


@pytest.mark.parametrize(
    "gen, width, expected",
    [
        (3, 16, 15.75),
        (4, 16, 31.51),
        (5, 16, 63.02),
        (5, 8, 31.51),
        (6, 16, 121.0),
    ],
)
def test_pcie_link_rate_per_direction_after_line_coding(gen, width, expected):
    assert pcie_link_gbps(gen, width) == pytest.approx(expected, abs=0.01)


def test_model_of_a_healthy_gpu_follows_the_sku_link_and_memory_floor():
    sku = load_sku(REPO / "graders" / "skus" / "h100-sxm5-80gb.yaml")
    model = copy_model(0, 1.0, sku)
    # Gen5 x16: 63.0 GB/s x 0.83 = 52.3, inside the ~50-55 GB/s pinned copies reach
    assert model.h2d_gbps == model.d2h_gbps == pytest.approx(52.31, abs=0.01)
    assert model.hbm_copy_gbps == pytest.approx(2500 * 1.15)  # the SKU floor x 1.15
    assert model.seconds("h2d", 52_305_000_000) == pytest.approx(1.0, rel=1e-3)


def test_narrow_link_and_slow_fault_show_in_the_model():
    sku = load_sku(REPO / "graders" / "skus" / "h100-sxm5-80gb.yaml")
    scenario = _scenario(("pcie_width", 4, {"lanes": 8}), ("slow", 3, {"factor": 0.5}))
    specs = ScenarioCompute(scenario, sku).specs([0, 3, 4])
    models = ScenarioCompute(scenario, sku).copy_models(specs)
    healthy, slow, narrow = models[0], models[3], models[4]
    assert narrow.h2d_gbps / healthy.h2d_gbps == pytest.approx(0.5)
    assert narrow.hbm_copy_gbps == healthy.hbm_copy_gbps  # a narrow link leaves HBM alone
    assert narrow.basis["pcie_link"] == "Gen5 x8" and narrow.basis["pcie_expected"] == "Gen5 x16"
    assert slow.h2d_gbps / healthy.h2d_gbps == pytest.approx(0.5)
    assert slow.hbm_copy_gbps / healthy.hbm_copy_gbps == pytest.approx(0.5)


@pytest.mark.parametrize(
    "sku_file", sorted(p.name for p in (REPO / "graders" / "skus").glob("*.yaml"))
)
def test_every_sku_models_its_healthy_gpus_alike(sku_file):
    sku = load_sku(REPO / "graders" / "skus" / sku_file)
    specs = [ComputeSpec(i, simulated=True) for i in range(sku.gpus_per_node or 8)]
    models = ScenarioCompute(_scenario(sku=sku.id), sku).copy_models(specs)
    figures = {(m.h2d_gbps, m.d2h_gbps, m.hbm_copy_gbps) for m in models.values()}
    assert len(figures) == 1  # the same figure for every healthy GPU: siblings' ratio 1.0
    ((h2d, _, hbm),) = figures
    assert h2d > 0 and hbm > 0


def test_simulated_copy_time_is_the_model_not_the_cpu_time():
    torch = pytest.importorskip("torch")
    dev = open_device(ComputeSpec(0, simulated=True))
    model = copy_model(0, 1.0, None)
    src = torch.ones(1 << 16, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ran = []

    def copy_and_burn():  # however long the CPU takes, the figure is the model's
        dst.copy_(src)
        sum(range(200_000))
        ran.append(1)

    seconds = timed_copy(dev, copy_and_burn, "hbm", copy_bytes(src.numel()), model)
    assert ran == [1] and bool((dst == 1).all())
    assert seconds == model.seconds("hbm", 2 << 16)
    with pytest.raises(ValueError, match="is a stand-in but has no copy model"):
        timed_copy(dev, copy_and_burn, "hbm", 1, None)
