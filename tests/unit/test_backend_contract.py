"""Every GPU backend answers the same questions with the same types (simulator and NVML fake;
on a GPU host the `gpu`-marked test runs the same contract against real NVML)."""

from __future__ import annotations

import dataclasses

import pytest

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.gpu import base, open_backend
from node_agent.gpu.sim import SimGpuBackend
from node_agent.grading.sku import load_skus
from node_agent.sim.scenario import ComputeProcess, Fault, Scenario, load_scenario
from node_agent.yamlfile import ConfigError

READINGS = {
    "identity": base.Identity, "temperature_c": int, "temperature_thresholds": base.TemperatureThresholds,
    "power": base.Power, "clocks": base.Clocks, "throttle_reasons": frozenset, "pcie": base.PcieLink,
    "ecc": base.EccCounts, "row_remap": base.RowRemap, "persistence_mode": bool,
    "recovery_action": str, "nvlinks": list, "memory_temperature_c": int,
    "retired_pages": base.RetiredPages, "compute_processes": list,
    "utilization": base.Utilization,
}


def _reading(device, method):
    try:
        return getattr(device, method)()
    except base.NotSupported:
        return None


def assert_contract(backend):
    assert isinstance(backend, base.GpuBackend)
    assert isinstance(backend.driver(), base.DriverInfo)
    for device in backend.devices():
        assert isinstance(device, base.GpuDevice)
        for method, kind in READINGS.items():
            try:
                value = getattr(device, method)()
            except base.NotSupported:
                continue  # "not available" is an answer; anything else must be a value
            assert isinstance(value, kind), (method, value)
            if dataclasses.is_dataclass(value):
                dataclasses.asdict(value)
        assert device.throttle_reasons() <= set(base.THROTTLE_REASONS)
        assert device.recovery_action() in base.RECOVERY_ACTIONS
        for proc in _reading(device, "compute_processes") or []:
            assert isinstance(proc, base.GpuProcess) and isinstance(proc.pid, int), proc
            assert proc.pid > 0
            assert proc.used_memory_bytes is None or (
                isinstance(proc.used_memory_bytes, int) and proc.used_memory_bytes >= 0), proc
        util = _reading(device, "utilization")
        if util is not None:
            assert isinstance(util.gpu_pct, int) and isinstance(util.memory_pct, int), util
            assert 0 <= util.gpu_pct <= 100 and 0 <= util.memory_pct <= 100, util


def test_simulator_satisfies_the_backend_contract():
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    for sku in skus.values():
        backend = open_backend(Scenario(sku=sku.id, gpus=sku.gpus_per_node, source="t"), sku)
        assert_contract(backend)
        assert len(backend.devices()) == sku.gpus_per_node


def test_simulator_keeps_the_contract_under_load_and_models_the_load():
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    sku = skus["h100-sxm5-80gb"]
    backend = open_backend(Scenario(sku=sku.id, gpus=2, source="t"), sku)
    idle = backend.devices()[0].power().usage_w
    backend.load_hint([0], True)
    assert_contract(backend)
    gpu0, gpu1 = backend.devices()
    assert gpu0.power().usage_w > 0.75 * gpu0.power().enforced_limit_w > idle
    assert gpu0.utilization() == base.Utilization(gpu_pct=98, memory_pct=60)
    assert gpu1.utilization() == base.Utilization(gpu_pct=0, memory_pct=0)
    assert gpu0.throttle_reasons() == {"sw_power_cap"}
    assert gpu1.power().usage_w == idle  # only the GPUs named are under load
    backend.load_hint([0], False)
    assert gpu0.power().usage_w == idle and gpu0.throttle_reasons() == {"gpu_idle"}
    assert gpu0.utilization() == base.Utilization(gpu_pct=0, memory_pct=0)


def _h100():
    return load_skus(resources.graders_dir(config_from_dict({})))["h100-sxm5-80gb"]


def test_spin_fault_reads_fully_busy_with_no_memory_traffic_and_near_idle_power():
    sku = _h100()
    backend = open_backend(Scenario(sku=sku.id, gpus=2, source="t", faults=(
        Fault(kind="spin", gpu=1, params={}),)), sku)
    healthy, spinning = backend.devices()
    assert spinning.utilization() == base.Utilization(gpu_pct=100, memory_pct=0)
    idle_w = healthy.power().usage_w
    assert idle_w < spinning.power().usage_w < 0.25 * spinning.power().enforced_limit_w
    assert "gpu_idle" not in spinning.throttle_reasons()
    backend.load_hint([0, 1], True)  # the spin is the GPU's own state, whatever the agent runs
    assert spinning.utilization() == base.Utilization(gpu_pct=100, memory_pct=0)
    assert healthy.utilization().gpu_pct == 98
    assert_contract(backend)


def test_simulator_lists_the_scenario_compute_processes_per_gpu():
    sku = _h100()
    backend = open_backend(Scenario(sku=sku.id, gpus=3, source="t", compute_processes=(
        ComputeProcess(gpu=0, pid=4242, used_memory_mib=1024), ComputeProcess(gpu=0, pid=4243),
        ComputeProcess(gpu=2, pid=4244))), sku)
    gpu0, gpu1, gpu2 = backend.devices()
    assert gpu0.compute_processes() == [base.GpuProcess(4242, 1024 * 1024 * 1024),
                                        base.GpuProcess(4243, None)]
    assert gpu1.compute_processes() == []
    assert gpu2.compute_processes() == [base.GpuProcess(4244, None)]


def test_scenario_file_compute_processes_are_loaded_and_range_checked(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("sku: h100-sxm5-80gb\ngpus: 2\ncompute_processes:\n"
                    "  - {gpu: 1, pid: 77, used_memory_mib: 10}\nfaults: [{kind: spin, gpu: 0}]\n")
    loaded = load_scenario(path)
    assert loaded.compute_processes == (ComputeProcess(gpu=1, pid=77, used_memory_mib=10),)
    assert loaded.has(0, "spin")
    path.write_text("sku: h100-sxm5-80gb\ngpus: 2\ncompute_processes: [{gpu: 2, pid: 77}]\n")
    with pytest.raises(ConfigError, match=r"compute_processes\[0\]: key 'gpu': 2 is out of range"):
        load_scenario(path)


@pytest.mark.parametrize("fault", ["gpu_lost", "driver_hang"])
def test_new_simulated_readings_fail_like_the_others_on_a_lost_or_hung_gpu(fault):
    sku = _h100()
    scenario = Scenario(sku=sku.id, gpus=1, source="t",
                        faults=(Fault(kind=fault, gpu=0, params={}),),
                        compute_processes=(ComputeProcess(gpu=0, pid=4242),))
    (dev,) = SimGpuBackend(scenario, sku, call_timeout_s=0.01).devices()
    error = base.DeviceLost if fault == "gpu_lost" else base.GpuTimeout
    with pytest.raises(error):
        dev.compute_processes()
    with pytest.raises(error):
        dev.utilization()


def test_every_backend_accepts_load_hints():
    from node_agent.gpu.absent import AbsentGpuBackend

    absent = AbsentGpuBackend("no NVIDIA driver")
    assert isinstance(absent, base.GpuBackend)
    absent.load_hint([0, 1], True)  # nothing to model; must not raise
    absent.load_hint([0, 1], False)


@pytest.mark.gpu
def test_nvml_satisfies_the_backend_contract_on_a_gpu_host():
    backend = open_backend()
    if backend.unavailable_reason:
        pytest.skip(f"no GPU: {backend.unavailable_reason}")
    try:
        assert_contract(backend)
    finally:
        backend.close()
