"""The hardware model: NVLink expectations, SKU matching by name and memory, a forced SKU, GPU
counts of add-in cards, and the inventory's record of lost GPUs.

The GPUs are the simulator's (no machine here has NVIDIA GPUs); the checks, the SKU files and
the grading rules are the real ones. Where a test stands in for real hardware (``scenario`` not
given to the check) the PCI bus is handed in, so the host's own bus does not enter the test.
"""

from __future__ import annotations

import pytest

from node_agent import resources
from node_agent.checking.context import HOST_PORTS, CheckContext
from node_agent.checks import inventory as inventory_check
from node_agent.checks import nvlink_fabric, nvml_health
from node_agent.checks.nvml_health import links as nvml_nvlink
from node_agent.config import config_from_dict
from node_agent.gpu.base import (
    DeviceLost,
    DriverStateError,
    GpuError,
    NoPermission,
    NotSupported,
    NvLink,
)
from node_agent.gpu.pci import PciBus, PciGpu
from node_agent.grading.rules import load_grader
from node_agent.hardware.sku import Sku, load_skus, match_sku
from node_agent.inventory import collect
from node_agent.kernel_log import LinesKernelLog
from node_agent.model import Level, Recovery, Status
from node_agent.sim.gpu_model import SimGpuBackend, SimGpuDevice
from node_agent.sim.node import stand_in_ports
from node_agent.sim.scenario import Fault, Scenario

CONFIG = config_from_dict({})
GRADERS = resources.graders_dir(CONFIG)
SKUS = load_skus(GRADERS)
GRADER = load_grader(GRADERS)
NO_PCI = PciBus(gpus=(), root="test")


def context(
    check: str,
    sku_id: str,
    gpus: int = 8,
    faults=(),
    *,
    sku_setting: str | None = None,
    no_sku: bool = False,
    simulated: bool = True,
    config=None,
    expected=None,
    virtualization: str = "none",
    pci: PciBus | None = None,
):
    """A check context over simulated GPUs of ``sku_id``. ``simulated=False`` grades them as
    real hardware would be (no scenario, an empty PCI bus handed in, or ``pci``)."""
    scenario = Scenario(
        sku=sku_id, gpus=gpus, source="t", faults=tuple(faults), virtualization=virtualization
    )
    backend = SimGpuBackend(scenario, SKUS[sku_id])
    inv = collect(backend, SKUS, sku_setting or sku_id)
    sku = None if no_sku else inv.sku
    cfg = config_from_dict(config or {})
    if expected is None:
        expected = cfg.node.expected_gpus or (
            gpus if simulated else sku.gpus_per_node if sku else None
        )
    return CheckContext(
        check=check,
        gpu=backend,
        kernel_log=LinesKernelLog([]),
        config=cfg,
        inventory=inv,
        sku=sku,
        expected_gpus=expected,
        ports=stand_in_ports(scenario, sku, backend) if simulated else HOST_PORTS,
        pci=None if simulated else pci or NO_PCI,
    )


def by_metric(results, metric):
    return [r for r in results if r.metric == metric]


# -- NVLink ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sku_id", ["h100-pcie-80gb", "h100-nvl-94gb", "a100-pcie-80gb", "l40s-48gb"]
)
def test_pcie_cards_without_a_bridge_are_not_nvlink_faults(sku_id):
    results = nvml_health.run(context("nvml_health", sku_id))
    states = by_metric(results, "nvlink_state")
    assert len(states) == 8 and all(r.status is Status.PASS for r in states)
    indices = SKUS[sku_id].section("nvlink").get("indices", 0)
    assert all(r.evidence["indices"] == indices and r.evidence["active"] == [] for r in states)
    assert GRADER.grade(results).level is Level.HEALTHY


def test_without_a_sku_file_inactive_link_indices_warn_and_never_fault():
    # the bug: a PCIe H100 answered for 18 link indices, all inactive -> "0 of 18" FAULT
    results = nvml_health.run(context("nvml_health", "h100-pcie-80gb", no_sku=True))
    states = by_metric(results, "nvlink_state")
    assert {r.status for r in states} == {Status.WARN}
    assert "0 of 18" in states[0].detail and "SKU file" in states[0].detail
    grade = GRADER.grade(results)
    assert grade.level is Level.WARN
    assert {r.rule for r in grade.reasons} == {"nvlink-unverified"}


def test_without_a_sku_file_a_baseboard_with_every_link_up_passes():
    results = nvml_health.run(context("nvml_health", "h100-sxm5-80gb", no_sku=True))
    assert {r.status for r in by_metric(results, "nvlink_state")} == {Status.PASS}


def test_link_indices_that_deny_p2p_capability_are_not_links():
    ctx = context("nvml_health", "l40s-48gb", no_sku=True)
    links = [NvLink(link=i, active=False, p2p_supported=False) for i in range(18)]
    result = nvml_nvlink.nvlink_state(ctx, "gpu:0", links)
    assert result.status is Status.PASS and result.evidence["not_p2p_capable"] == list(range(18))


def test_a_sku_link_count_still_catches_a_down_link():
    results = nvml_health.run(
        context("nvml_health", "b200-sxm-180gb", faults=[Fault("nvlink_down", 5, {"link": 17})])
    )
    down = [r for r in by_metric(results, "nvlink_state") if r.status is Status.FAIL]
    assert [(r.target, r.value, r.evidence["expected"]) for r in down] == [("gpu:5", 17, 18)]
    assert "17 of 18" in down[0].detail
    assert "down: link 17 (to NVSwitch 00000000:06:00.0)" in down[0].detail  # HGX B200's 2nd
    assert GRADER.grade(results).level is Level.ERROR  # restarted first, replaced if it stays


# -- temperature -------------------------------------------------------------------------------


@pytest.fixture
def quick_rereads(monkeypatch):
    monkeypatch.setattr(nvml_health, "SHUTDOWN_REREAD_S", 0.0)


def test_a_gpu_at_its_shutdown_threshold_in_every_reading_is_failed_cooling(quick_rereads):
    hot = [Fault("temperature", 3, {"celsius": 95})]
    results = by_metric(
        nvml_health.run(context("nvml_health", "h100-sxm5-80gb", faults=hot)), "temperature"
    )
    (failed,) = [r for r in results if r.status is Status.FAIL]
    assert failed.target == "gpu:3" and failed.evidence["readings_c"] == [95, 95, 95]
    assert GRADER.grade(results).level is Level.FAULT


def test_one_reading_at_the_shutdown_threshold_not_read_again_is_a_warning(
    quick_rereads, monkeypatch
):
    """A spike or a sensor's glitch in one sample of the daemon's ten-second watch asked for the
    node's replacement; the GPU is read again and the other readings decide."""
    series = iter([95, 61, 60])
    real = SimGpuDevice.temperature_c
    monkeypatch.setattr(
        SimGpuDevice, "temperature_c", lambda dev: next(series) if dev.index == 3 else real(dev)
    )
    results = by_metric(nvml_health.run(context("nvml_health", "h100-sxm5-80gb")), "temperature")
    (spike,) = [r for r in results if r.target == "gpu:3"]
    assert spike.status is Status.WARN and spike.evidence["readings_c"] == [95, 61, 60]
    assert "once" in spike.detail
    grade = GRADER.grade(results)
    assert grade.level is Level.WARN and {r.rule for r in grade.reasons} == {"temperature-slowdown"}


# -- SKU matching --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpus, expected",
    [
        ([("NVIDIA GB300", 284208)] * 4, "gb300-288gb"),  # GB300 NVL72 tray
        ([("A100-SXM4-40GB", 40536)] * 8, "a100-sxm4-40gb"),  # a pre-R470 driver's name
        ([("NVIDIA L40S", 46068)] * 4, "l40s-48gb"),  # ECC on
        ([("NVIDIA L40S", 49140)] * 4, "l40s-48gb"),  # ECC off: still an L40S
        (
            [("NVIDIA H100 80GB HBM3", 81559)] * 7 + [("NVIDIA H100 80GB HBM3", 40000)],
            "h100-sxm5-80gb",
        ),  # the node's median decides
        ([("nvidia h20", None)] * 8, "h20-96gb"),  # memory not reported: the name
    ],
)
def test_skus_are_matched_by_name_and_memory(gpus, expected):
    found = match_sku(gpus, SKUS)
    assert found.sku is not None and found.sku.id == expected, found.problem


@pytest.mark.parametrize(
    "gpus, fragment",
    [
        ([("NVIDIA GB300", 256703)], "another variant"),  # DGX Station GB300
        ([("NVIDIA H20", 143771)] * 8, "another variant"),  # the 141 GB H20
        ([("Tesla T4", 15360)], "no SKU file"),
        ([("NVIDIA L40S", 46068), ("NVIDIA H100 PCIe", 81559)], "different models"),
    ],
)
def test_no_sku_is_chosen_where_name_or_memory_disagree(gpus, fragment):
    found = match_sku(gpus, SKUS)
    assert found.sku is None and fragment in found.problem


def test_two_sku_files_that_both_fit_are_ambiguous_not_a_guess():
    data = {"memory_total_mib_min": 80000, "memory_total_mib_max": 90000}
    twins = {
        n: Sku(id=n, display_name=n, match=("NVIDIA X",), gpus_per_node=8, data=data, source=n)
        for n in ("a", "b")
    }
    found = match_sku([("NVIDIA X", 81000)], twins)
    assert found.sku is None and "several" in found.problem


def test_every_sku_file_matches_the_gpus_the_simulator_makes_of_it():
    for sku in SKUS.values():
        backend = SimGpuBackend(Scenario(sku=sku.id, gpus=2, source="t"), sku)
        inv = collect(backend, SKUS, "auto")
        assert inv.sku is not None and inv.sku.id == sku.id, (sku.id, inv.sku_problem)


# -- a forced SKU, per-GPU memory ---------------------------------------------------------------


def test_a_forced_sku_that_does_not_name_the_gpus_is_a_warned_finding():
    ctx = context("inventory", "l40s-48gb", sku_setting="h100-sxm5-80gb")
    assert ctx.inventory.sku.id == "h100-sxm5-80gb"
    results = inventory_check.run(ctx)
    [mismatch] = by_metric(results, "sku_mismatch")
    assert mismatch.status is Status.WARN
    assert "'NVIDIA L40S'" in mismatch.detail and "node.sku" in mismatch.detail
    assert "sku-mismatch" in {r.rule for r in GRADER.grade(results).reasons}


def test_a_gpu_whose_memory_is_outside_its_sku_range_is_named():
    ctx = context("inventory", "h100-sxm5-80gb", faults=[Fault("memory_total", 6, {"mib": 40960})])
    results = inventory_check.run(ctx)
    warned = [r for r in by_metric(results, "memory_total") if r.status is Status.WARN]
    assert [(r.target, r.value) for r in warned] == [("gpu:6", 40960)]
    assert "below the 80000 MiB" in warned[0].detail
    assert len(by_metric(results, "memory_total")) == 8


# -- GPU counts --------------------------------------------------------------------------------


def test_a_server_with_fewer_add_in_cards_than_the_common_build_is_not_missing_gpus():
    ctx = context("nvml_health", "l40s-48gb", gpus=4, simulated=False)
    assert ctx.expected_gpus == 8  # what the SKU's gpus_per_node says
    [count] = by_metric(nvml_health.run(ctx), "gpu_count")
    assert count.status is Status.PASS and "add-in card" in count.detail


def test_an_add_in_card_count_is_still_checked_when_configured():
    ctx = context(
        "nvml_health", "l40s-48gb", gpus=4, simulated=False, config={"node": {"expected_gpus": 8}}
    )
    [count] = by_metric(nvml_health.run(ctx), "gpu_count")
    assert count.status is Status.FAIL and "4 of 8" in count.detail


def test_a_baseboard_sku_still_counts_its_gpus():
    ctx = context("nvml_health", "h100-sxm5-80gb", gpus=4, simulated=False)
    [count] = by_metric(nvml_health.run(ctx), "gpu_count")
    assert count.status is Status.FAIL and "4 of 8" in count.detail


def test_a_vm_holding_part_of_a_baseboard_warns_naming_expected_gpus():
    ctx = context(
        "nvml_health", "h100-sxm5-80gb", gpus=2, simulated=False, virtualization="pass_through"
    )
    results = nvml_health.run(ctx)
    [count] = by_metric(results, "gpu_count")
    assert count.status is Status.WARN and "2 of 8" in count.detail
    assert "node.expected_gpus" in count.detail and count.evidence["lost_gpu_traces"] == []
    assert GRADER.grade(results).level is Level.WARN


def test_a_vm_holding_part_of_a_baseboard_with_a_gpu_nvml_lost_still_fails_its_count():
    bus = PciBus(
        gpus=tuple(
            PciGpu(
                bus_id=f"0000:{b:02x}:00.0", device_id=0x2330, class_code=0x030200, driver="nvidia"
            )
            for b in (0x18, 0x2A, 0x3A)
        ),
        root="test",
    )
    ctx = context(
        "nvml_health",
        "h100-sxm5-80gb",
        gpus=2,
        simulated=False,
        virtualization="pass_through",
        pci=bus,
    )
    results = nvml_health.run(ctx)
    [count] = by_metric(results, "gpu_count")
    assert count.status is Status.FAIL and "0000:3a:00.0" in count.detail
    assert GRADER.grade(results).level is Level.ERROR


def test_a_simulated_vm_missing_a_gpu_is_counted_against_its_scenario():
    # a scenario's gpus is the node's own count, as node.expected_gpus is
    results = nvml_health.run(
        context(
            "nvml_health",
            "h100-sxm5-80gb",
            faults=[Fault("missing_gpu", 7, {})],
            virtualization="pass_through",
        )
    )
    [count] = by_metric(results, "gpu_count")
    assert count.status is Status.FAIL and "7 of 8" in count.detail
    assert GRADER.grade(results).level is Level.ERROR


def test_a_vm_that_sees_its_nvlinks_grades_them_as_bare_metal_does():
    results = nvml_health.run(
        context(
            "nvml_health",
            "h100-sxm5-80gb",
            faults=[Fault("nvlink_down", 2, {"link": 4})],
            virtualization="pass_through",
        )
    )
    down = [r for r in by_metric(results, "nvlink_state") if r.status is not Status.PASS]
    assert [(r.target, r.status) for r in down] == [("gpu:2", Status.FAIL)]
    assert GRADER.grade(results).level is Level.ERROR


# -- the inventory keeps what it could not read -------------------------------------------------


def test_inventory_json_keeps_a_lost_gpu_with_its_error():
    ctx = context("inventory", "h100-sxm5-80gb", faults=[Fault("gpu_lost", 3, {})])
    data = ctx.inventory.to_dict()
    assert [g["index"] for g in data["gpus"]] == [0, 1, 2, 4, 5, 6, 7]
    [lost] = data["unreadable_gpus"]
    assert lost["index"] == 3 and lost["status"] == "gpu_lost" and "lost" in lost["error"]
    assert isinstance(ctx.inventory.unreadable[3], DeviceLost)


@pytest.mark.parametrize(
    "error", [NoPermission("nvmlDeviceGetUUID: Insufficient Permissions"), NotSupported("UUID")]
)
def test_an_identity_the_agent_may_not_read_is_an_error_never_a_gpu_fault(error):
    """A container without the GPUs' device files: NVML lists the GPUs and answers No
    Permission on each. That had graded every GPU gpu-unreadable, FAULT: replace the node."""
    ctx = context("inventory", "h100-sxm5-80gb")
    ctx.inventory.gpus[:] = [g for g in ctx.inventory.gpus if g.index != 3]
    ctx.inventory.unreadable[3] = error
    results = inventory_check.run(ctx)
    (unread,) = [r for r in results if r.target == "gpu:3" and r.metric == "identity"]
    assert unread.status is Status.ERROR and "device files" in unread.detail
    assert GRADER.grade(results).level is not Level.FAULT


@pytest.mark.parametrize(
    "message",
    [
        "nvmlDeviceGetUUID: Unknown Error",  # a container that lost its device access
        "nvmlDeviceGetUUID: Reset Required",
        "nvmlDeviceGetUUID: Operating System has blocked the request",
        "nvmlDeviceGetUUID: RM has detected an NVML/RM version mismatch",
    ],
)
def test_an_identity_error_that_is_not_a_lost_gpu_drains_and_is_never_replaced(message):
    """NVML's Unknown Error on a GPU's identity (and reset required, blocked by the OS, a
    version mismatch) had graded gpu-unreadable, FAULT: a replacement of a GPU whose other
    readings all passed. The driver's or the container's state: drained, never replaced."""
    ctx = context("inventory", "h100-sxm5-80gb")
    ctx.inventory.gpus[:] = [g for g in ctx.inventory.gpus if g.index != 3]
    ctx.inventory.unreadable[3] = DriverStateError(message)
    results = inventory_check.run(ctx)
    grade = GRADER.grade(results)
    assert grade.level is Level.ERROR
    (reason,) = [r for r in grade.reasons if r.target == "gpu:3"]
    assert reason.rule == "gpu-identity-error" and reason.remedy is not None


@pytest.mark.parametrize(
    "message",
    [
        "nvmlDeviceGetHandleByIndex: Insufficient External Power",
        "nvmlDeviceGetUUID: Interrupt request issue",
        "nvmlDeviceGetUUID: Corrupted infoROM",
    ],
)
def test_an_identity_error_of_the_gpus_own_stays_a_fault(message):
    """Insufficient power, an IRQ issue, a corrupted InfoROM: the GPU's own errors."""
    ctx = context("inventory", "h100-sxm5-80gb")
    ctx.inventory.gpus[:] = [g for g in ctx.inventory.gpus if g.index != 3]
    ctx.inventory.unreadable[3] = GpuError(message)
    (reason,) = [r for r in GRADER.grade(inventory_check.run(ctx)).reasons if r.target == "gpu:3"]
    assert (reason.rule, reason.level) == ("gpu-unreadable", Level.FAULT)


def test_every_nvlink_of_every_gpu_down_is_the_fabric_not_brought_up_never_eight_gpus():
    """An HGX board whose nvidia-fabricmanager is not running: NVML shows every link of every
    GPU inactive. That had been eight nvlink-down FAULTs, a replacement; it is the fabric (the
    fabric manager, or the switch board), held for an operator. One GPU's links stay its own."""
    every = [Fault("nvlink_down", g, {"link": n}) for g in range(8) for n in range(18)]
    results = nvml_health.run(context("nvml_health", "h100-sxm5-80gb", faults=every))
    assert not by_metric(results, "nvlink_state")
    (fabric,) = by_metric(results, "nvlink_fabric_down")
    assert fabric.target == "node" and len(fabric.evidence["per_gpu"]) == 8
    grade = GRADER.grade(results)
    assert grade.level is Level.ERROR and {r.rule for r in grade.reasons} == {"nvlink-fabric-down"}
    assert all(r.remedy is not None for r in grade.reasons)

    one = [Fault("nvlink_down", 3, {"link": n}) for n in range(18)]
    grade = GRADER.grade(nvml_health.run(context("nvml_health", "h100-sxm5-80gb", faults=one)))
    assert [(r.rule, r.target, r.remedy) for r in grade.reasons] == [("nvlink-down", "gpu:3", None)]


def test_the_same_links_down_on_every_gpu_are_the_switch_they_share_never_every_gpu():
    """An NVL72 rack with one of its nine switch trays out (an NVOS upgrade, a reboot): every
    GPU of every compute tray has the same 2 of its 18 links down. That was a FAULT per GPU, each
    tray replaced; it is the far end they share, held for an operator. One GPU's down link is
    restarted first (a reset retrains it) and replaced only if it stays down."""
    tray_out = [Fault("nvlink_down", g, {"link": n}) for g in range(4) for n in (6, 7)]
    results = nvml_health.run(context("nvml_health", "gb200-186gb", gpus=4, faults=tray_out))
    assert not by_metric(results, "nvlink_state")
    (alike,) = by_metric(results, "nvlink_down_alike")
    assert (alike.target, alike.evidence["links_down"], alike.evidence["gpus"]) == (
        "node",
        [6, 7],
        4,
    )
    grade = GRADER.grade(results, "service")
    assert [(r.rule, r.level, r.remedy) for r in grade.reasons] == [
        ("nvlink-down-alike", Level.ERROR, "elsewhere")
    ]
    other = [*tray_out[:-1], Fault("nvlink_down", 3, {"link": 8})]  # gpu:3: links 6 and 8
    grade = GRADER.grade(
        nvml_health.run(context("nvml_health", "gb200-186gb", gpus=4, faults=other))
    )
    assert {(r.rule, r.level) for r in grade.reasons} == {("nvlink-down", Level.ERROR)}
    assert {r.remedy for r in grade.reasons} == {None} and len(grade.reasons) == 4
    # two GPUs see one link between them down at both ends: each GPU's own, not a far end
    pair = [Fault("nvlink_down", g, {"link": 3}) for g in range(2)]
    grade = GRADER.grade(
        nvml_health.run(context("nvml_health", "h100-sxm5-80gb", gpus=2, faults=pair))
    )
    assert {(r.rule, r.remedy) for r in grade.reasons} == {("nvlink-down", None)}


def test_a_tray_none_of_whose_gpus_registered_with_the_fabric_is_held_never_replaced():
    """A GB200 tray whose fabric manager (on the NVSwitch trays) is not up: every GPU's
    registration Not Started. It had been ERROR with no remedy: two reboots, then the compute
    tray replaced. One GPU alone short of it is still that GPU's."""
    waiting = [Fault("fabric_incomplete", g, {"state": "not_started"}) for g in range(4)]
    results = nvlink_fabric.run(context("nvlink_fabric", "gb200-186gb", gpus=4, faults=waiting))
    grade = GRADER.grade(results, "service")
    assert {r.rule for r in grade.reasons} == {"nvlink-fabric-unregistered"}
    assert all(r.remedy is not None for r in grade.reasons)
    alone = [Fault("fabric_incomplete", 2, {"state": "not_started"})]
    results = nvlink_fabric.run(context("nvlink_fabric", "gb200-186gb", gpus=4, faults=alone))
    (reason,) = GRADER.grade(results, "service").reasons
    assert (reason.rule, reason.target, reason.remedy) == (
        "nvlink-fabric-incomplete",
        "gpu:2",
        None,
    )


def test_nvlink_counters_are_readings_of_the_worst_link_with_every_link_in_the_evidence():
    """The counter history follows a rising NVLink (graders/trends.yaml) only if nvml_health
    reports the counters: per GPU, the worst link's value, every link in the evidence."""
    rising = Fault("counter_series", 3, {"counter": "nvlink_recovery", "values": [505], "link": 7})
    results = nvml_health.run(context("nvml_health", "h100-sxm5-80gb", faults=(rising,)))
    recoveries = {r.target: r for r in by_metric(results, "nvlink_recovery_errors")}
    assert set(recoveries) == {f"gpu:{i}" for i in range(8)}
    assert all(r.status is Status.PASS for r in recoveries.values())
    assert recoveries["gpu:3"].value == 505 and recoveries["gpu:3"].evidence["worst_link"] == 7
    assert recoveries["gpu:0"].value == 0 and len(recoveries["gpu:0"].evidence["per_link"]) == 18
    for metric in ("nvlink_replay_errors", "nvlink_crc_errors"):
        assert len(by_metric(results, metric)) == 8


@pytest.mark.parametrize(
    "action, recovery, status",
    [
        ("none", Recovery.NONE, Status.PASS),
        ("gpu_reset", Recovery.GPU_RESET, Status.FAIL),
        ("node_reboot", Recovery.NODE_REBOOT, Status.FAIL),
        ("drain_p2p", Recovery.DRAIN_P2P, Status.FAIL),
    ],
)
def test_the_drivers_recovery_action_is_a_typed_fact_of_the_result(action, recovery, status):
    """The planner reads ``Result.recovery`` (a model.Recovery), never the detail's words."""
    faults = [Fault("recovery_action", 2, {"action": action})]
    results = nvml_health.run(context("nvml_health", "h100-sxm5-80gb", faults=faults))
    (result,) = [r for r in by_metric(results, "recovery_action") if r.target == "gpu:2"]
    assert (result.recovery, result.status, result.value) == (recovery, status, action)
    assert result.to_dict()["recovery"] == recovery.value
