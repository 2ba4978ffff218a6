"""The NVLink fabric reading (nvml.h's struct, states and health-mask bits), the one rule that
says which NVLink judgments apply (gpu/nvlink_topology.py), and the nvlink_fabric check's
params. The NVML answers come from the Python replay of a rendered scenario state (no GPU
runs here: NVML is the one thing not real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.checks.nvlink_fabric import Params
from node_agent.gpu.base import GpuFabric, NotSupported, NvLink, fabric_mask
from node_agent.gpu.nvlink_topology import (
    HIDDEN,
    MULTI_NODE,
    NVLINK,
    NVSWITCH,
    PCIE,
    UNKNOWN,
    Applicability,
    classify,
    node,
    nvlink_applicability,
    tray_domain,
)
from node_agent.gpu.nvml import open_nvml
from node_agent.gpu.nvml_calls import NvmlAnswer, fabric_members, fabric_value
from node_agent.gpu.record import record_gpu
from node_agent.gpu.replay import StateNvml
from node_agent.hardware.sku import load_skus
from node_agent.sim.nvml_state import Switch, render
from node_agent.sim.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
SKUS = load_skus(REPO / "graders")
ZERO = "00000000-0000-0000-0000-000000000000"
DOMAIN = "6a1c2e8f-3b4d-4e5f-8a9b-0c1d2e3f4a5b"


def fabric(**kw: object) -> GpuFabric:
    values: dict[str, object] = {
        "state": "completed",
        "status": 0,
        "cluster_uuid": DOMAIN,
        "clique_id": 2,
        "health_mask": fabric_mask(),
        "health_summary": "healthy",
    }
    values.update(kw)
    return GpuFabric(**values)  # type: ignore[arg-type]


def replayed(name: str, *switches: Switch):
    scenario = load_scenario(REPO / "scenarios" / name, SKUS)
    text = render(scenario, SKUS[scenario.sku], switches)
    return open_nvml(lib=StateNvml(text.splitlines()))


# -- the health mask, as nvml.h defines it -----------------------------------------------------


def test_the_real_gb200_mask_flags_nothing():
    # qx-gb200.xml: bandwidth Full, route recovery / unhealthy / access timeout False
    assert fabric(health_mask=0xAA).health == []


@pytest.mark.parametrize(
    "mask, flags",
    [
        (0x1, ["degraded_bandwidth"]),  # NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE << 0
        (0x1 << 2, ["route_recovery"]),
        (0x1 << 4, ["route_unhealthy"]),
        (0x1 << 6, ["access_timeout_recovery"]),
        (0x5 << 8, ["incorrect_configuration:insufficient_nvlinks"]),
        (0x2 << 14, ["fabric_manager_disconnected"]),
        (0x1 << 8, []),  # INCORRECT_CONFIGURATION_NONE: a correct configuration
    ],
)
def test_each_health_mask_field_is_read_at_its_nvml_shift(mask, flags):
    assert fabric(health_mask=mask).health == flags


def test_a_mask_built_from_flags_reads_back_as_those_flags():
    mask = fabric_mask("degraded_bandwidth", "route_unhealthy")
    assert fabric(health_mask=mask).health == ["degraded_bandwidth", "route_unhealthy"]
    with pytest.raises(ValueError, match="unknown fabric health flags"):
        fabric_mask("bandwidth_low")


def test_a_zero_cluster_uuid_is_no_domain():
    assert fabric().in_domain and not fabric(cluster_uuid=ZERO).in_domain


# -- applicability: from NVML's answers, never from the virtualization mode alone --------------


def test_a_pass_through_gb200_whose_fabric_answers_is_multi_node():
    # the real p6e tray is a pass-through VM: its fabric, not its mode, decides
    applies = classify(
        [], fabric(cluster_uuid="00000001-0000-0000-0000-000000000001"), "pass_through"
    )
    assert applies.kind == MULTI_NODE and applies.multi_node and applies.clique_id == 2


@pytest.mark.parametrize(
    "links, answered, mode, kind",
    [
        (
            [NvLink(i, True, p2p_supported=True) for i in range(18)],
            fabric(cluster_uuid=ZERO),
            "none",
            NVSWITCH,
        ),
        ([NvLink(i, True, p2p_supported=True) for i in range(18)], None, "none", NVLINK),
        ([], None, "pass_through", HIDDEN),
        ([], None, "vgpu", HIDDEN),
        ([], None, "none", PCIE),
        ([NvLink(i, False, p2p_supported=False) for i in range(18)], None, "pass_through", PCIE),
        (None, None, "none", UNKNOWN),
    ],
)
def test_each_kind_of_nvlink_is_told_from_the_answers(links, answered, mode, kind):
    applies = classify(links, answered, mode)
    assert applies.kind == kind and applies.why
    assert applies.multi_node is (kind == MULTI_NODE)


def test_the_node_is_the_most_nvlink_any_gpu_shows():
    pcie = Applicability(PCIE, "pcie")
    multi = Applicability(MULTI_NODE, "multi", DOMAIN, 2)
    assert node([pcie, multi, pcie]) is multi
    assert node([]).kind == UNKNOWN


@pytest.mark.parametrize(
    "name, kind",
    [
        ("healthy-gb200-186gb.yaml", MULTI_NODE),
        ("hgx-b200-single-node.yaml", NVSWITCH),
        ("healthy-h100.yaml", NVLINK),
        ("healthy-l40s-48gb.yaml", PCIE),
        ("real/h100-sxm5-vm.yaml", HIDDEN),
    ],
)
def test_nvlink_applicability_asks_the_backend(name, kind):
    backend = replayed(name)
    try:
        assert nvlink_applicability(backend).kind == kind
    finally:
        backend.close()


# -- the tray's domain ---------------------------------------------------------------------------


def test_the_tray_domain_is_the_one_most_gpus_report():
    fabrics = {0: fabric(clique_id=5), 1: fabric(), 2: fabric(), 3: fabric()}
    assert tray_domain(fabrics) == (DOMAIN, 2)
    assert tray_domain({0: fabric(cluster_uuid=ZERO)}) is None
    # a tie: the lowest GPU's
    assert tray_domain({0: fabric(clique_id=3), 1: fabric()}) == (DOMAIN, 3)


# -- the state key, the replay, the recorder -----------------------------------------------------


def test_the_state_key_holds_the_v3_struct_members():
    value = fabric_value(fabric(health_mask=0xAA))
    assert value == f"3 0 {DOMAIN} 2 0xaa 1"
    members = fabric_members(value)
    assert members["clusterUuid"] == bytes.fromhex(DOMAIN.replace("-", ""))
    assert (members["state"], members["cliqueId"], members["healthMask"]) == (3, 2, 0xAA)


@pytest.mark.parametrize("text", ["3 0 not-a-uuid 2 0xaa 1", "3 0", "-1 0 " + DOMAIN + " 2 0 1"])
def test_a_malformed_fabric_value_answers_unknown(text):
    with pytest.raises(NvmlAnswer) as err:
        fabric_members(text)
    assert err.value.code == 999


def test_the_replay_answers_the_versioned_call_with_health():
    backend = replayed("gb200-fabric-degraded.yaml")
    try:
        read = backend.devices()[2].fabric()
    finally:
        backend.close()
    assert read.health == ["degraded_bandwidth"] and read.health_summary == "limited_capacity"
    assert (read.cluster_uuid, read.clique_id, read.state) == (DOMAIN, 2, "completed")


def test_a_driver_without_the_versioned_call_is_read_through_the_older_one():
    backend = replayed("healthy-gb200-186gb.yaml", Switch("absent", "nvmlDeviceGetGpuFabricInfoV"))
    try:
        read = backend.devices()[0].fabric()
    finally:
        backend.close()
    assert (read.state, read.cluster_uuid, read.clique_id) == ("completed", DOMAIN, 2)
    assert read.health_mask is None and read.health_summary is None


def test_a_gpu_without_a_fabric_is_not_supported():
    backend = replayed("healthy-h100.yaml")
    try:
        with pytest.raises(NotSupported):
            backend.devices()[0].fabric()
    finally:
        backend.close()


def test_the_recorder_records_what_the_replay_answers():
    backend = replayed("gb200-wrong-clique.yaml")
    try:
        keys = [record_gpu(backend, i)["fabric"] for i in range(4)]
    finally:
        backend.close()
    assert keys[0] == f"3 0 {DOMAIN} 5 0x1aa 1"
    assert keys[1:] == [f"3 0 {DOMAIN} 2 0x1aa 1"] * 3


# -- the check's params --------------------------------------------------------------------------


def test_params_take_the_operators_domain():
    params = Params.parse({"cluster_uuid": DOMAIN.upper(), "clique_id": 2})
    assert (params.cluster_uuid, params.clique_id) == (DOMAIN, 2)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"clique": 2}, "unknown key(s) clique"),
        ({"cluster_uuid": "rack-7"}, "8-4-4-4-12"),
        ({"clique_id": -1}, "whole number"),
        ({"clique_id": True}, "whole number"),
    ],
)
def test_bad_params_say_what_was_expected(raw, words):
    with pytest.raises(ValueError, match="nvlink_fabric") as err:
        Params.parse(raw)
    assert words in str(err.value)
