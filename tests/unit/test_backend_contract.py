"""Every GPU backend answers the same questions with the same types (simulator and NVML fake;
on a GPU host the `gpu`-marked test runs the same contract against real NVML)."""

from __future__ import annotations

import dataclasses

import pytest

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.gpu import base, open_backend
from node_agent.scenario import Scenario
from node_agent.sku import load_skus

READINGS = {
    "identity": base.Identity, "temperature_c": int, "temperature_thresholds": base.TemperatureThresholds,
    "power": base.Power, "clocks": base.Clocks, "throttle_reasons": frozenset, "pcie": base.PcieLink,
    "ecc": base.EccCounts, "row_remap": base.RowRemap, "persistence_mode": bool,
    "recovery_action": str, "nvlinks": list, "memory_temperature_c": int,
    "retired_pages": base.RetiredPages,
}


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
    assert gpu0.throttle_reasons() == {"sw_power_cap"}
    assert gpu1.power().usage_w == idle  # only the GPUs named are under load
    backend.load_hint([0], False)
    assert gpu0.power().usage_w == idle and gpu0.throttle_reasons() == {"gpu_idle"}


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
