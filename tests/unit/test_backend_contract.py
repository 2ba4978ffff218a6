"""Every GPU backend answers the same questions with the same types: the simulator, the real NVML
backend on the stand-in libnvidia-ml.so.1 (tests/nvml_fake, loaded by the real nvidia-ml-py
through ctypes), and on a GPU host the `gpu`-marked test against real NVML."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.gpu import base, open_backend
from node_agent.gpu.nvml import NvmlBackend, open_nvml
from node_agent.gpu.replay import StateNvml, open_replay
from node_agent.hardware.sku import load_skus
from node_agent.sim.gpu_model import SimGpuBackend
from node_agent.sim.node import open_gpus
from node_agent.sim.nvml_state import NVML_FAULT_KINDS, render, write_state
from node_agent.sim.scenario import ComputeProcess, Fault, Scenario, load_scenario
from node_agent.yamlfile import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

READINGS = {
    "identity": base.Identity,
    "temperature_c": int,
    "temperature_thresholds": base.TemperatureThresholds,
    "power": base.Power,
    "clocks": base.Clocks,
    "throttle_reasons": frozenset,
    "pcie": base.PcieLink,
    "ecc": base.EccCounts,
    "row_remap": base.RowRemap,
    "persistence_mode": bool,
    "recovery_action": str,
    "nvlinks": list,
    "memory_temperature_c": int,
    "retired_pages": base.RetiredPages,
    "compute_processes": list,
    "utilization": base.Utilization,
    "virtualization_mode": str,
    "fabric": base.GpuFabric,
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
        # each reading may be "not available" (a driver without the recovery-action field, a
        # GPU without clock-event reasons): check the value only where there is one
        assert (_reading(device, "throttle_reasons") or frozenset()) <= set(base.THROTTLE_REASONS)
        assert _reading(device, "recovery_action") in (None, *base.RECOVERY_ACTIONS)
        assert _reading(device, "virtualization_mode") in (None, *base.VIRTUALIZATION_MODES)
        for proc in _reading(device, "compute_processes") or []:
            assert isinstance(proc, base.GpuProcess) and isinstance(proc.pid, int), proc
            assert proc.pid > 0
            assert proc.used_memory_bytes is None or (
                isinstance(proc.used_memory_bytes, int) and proc.used_memory_bytes >= 0
            ), proc
        util = _reading(device, "utilization")
        if util is not None:
            assert isinstance(util.gpu_pct, int) and isinstance(util.memory_pct, int), util
            assert 0 <= util.gpu_pct <= 100 and 0 <= util.memory_pct <= 100, util


def test_simulator_satisfies_the_backend_contract():
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    for sku in skus.values():
        backend = open_gpus(Scenario(sku=sku.id, gpus=sku.gpus_per_node, source="t"), sku)
        assert_contract(backend)
        assert len(backend.devices()) == sku.gpus_per_node


def test_simulator_keeps_the_contract_under_load_and_models_the_load():
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    sku = skus["h100-sxm5-80gb"]
    backend = open_gpus(Scenario(sku=sku.id, gpus=2, source="t"), sku)
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
    backend = open_gpus(
        Scenario(sku=sku.id, gpus=2, source="t", faults=(Fault(kind="spin", gpu=1, params={}),)),
        sku,
    )
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
    backend = open_gpus(
        Scenario(
            sku=sku.id,
            gpus=3,
            source="t",
            compute_processes=(
                ComputeProcess(gpu=0, pid=4242, used_memory_mib=1024),
                ComputeProcess(gpu=0, pid=4243),
                ComputeProcess(gpu=2, pid=4244),
            ),
        ),
        sku,
    )
    gpu0, gpu1, gpu2 = backend.devices()
    assert gpu0.compute_processes() == [
        base.GpuProcess(4242, 1024 * 1024 * 1024),
        base.GpuProcess(4243, None),
    ]
    assert gpu1.compute_processes() == []
    assert gpu2.compute_processes() == [base.GpuProcess(4244, None)]


def test_scenario_file_compute_processes_are_loaded_and_range_checked(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "sku: h100-sxm5-80gb\ngpus: 2\ncompute_processes:\n"
        "  - {gpu: 1, pid: 77, used_memory_mib: 10}\nfaults: [{kind: spin, gpu: 0}]\n"
    )
    loaded = load_scenario(path)
    assert loaded.compute_processes == (ComputeProcess(gpu=1, pid=77, used_memory_mib=10),)
    assert loaded.has(0, "spin")
    path.write_text("sku: h100-sxm5-80gb\ngpus: 2\ncompute_processes: [{gpu: 2, pid: 77}]\n")
    with pytest.raises(ConfigError, match=r"compute_processes\[0\]: key 'gpu': 2 is out of range"):
        load_scenario(path)


@pytest.mark.parametrize("fault", ["gpu_lost", "driver_hang"])
def test_new_simulated_readings_fail_like_the_others_on_a_lost_or_hung_gpu(fault):
    sku = _h100()
    scenario = Scenario(
        sku=sku.id,
        gpus=1,
        source="t",
        faults=(Fault(kind=fault, gpu=0, params={}),),
        compute_processes=(ComputeProcess(gpu=0, pid=4242),),
    )
    (dev,) = SimGpuBackend(scenario, sku, call_timeout_s=0.01).devices()
    error = base.DeviceLost if fault == "gpu_lost" else base.GpuTimeout
    with pytest.raises(error):
        dev.compute_processes()
    with pytest.raises(error):
        dev.utilization()


def test_load_hints_reach_only_a_stand_in_and_are_a_no_op_on_this_host():
    from node_agent.checking.ports import Ports
    from node_agent.gpu.absent import AbsentGpuBackend
    from node_agent.sim.node import stand_in_ports

    absent = AbsentGpuBackend("no NVIDIA driver")
    assert isinstance(absent, base.GpuBackend)
    assert not isinstance(absent, base.StandInBackend)  # real hardware reports its own state
    host = Ports()
    host.load_hint([0, 1], True)  # nothing to model; must not raise
    host.load_hint([0, 1], False)
    sku = load_skus(resources.graders_dir(config_from_dict({})))["h100-sxm5-80gb"]
    scenario = Scenario(sku=sku.id, gpus=2, source="t")
    stand_in = open_gpus(scenario, sku)
    assert isinstance(stand_in, base.StandInBackend)
    assert stand_in_ports(scenario, sku, stand_in).load_hint == stand_in.load_hint


@pytest.mark.gpu
def test_nvml_satisfies_the_backend_contract_on_a_gpu_host():
    backend = open_backend()
    if backend.unavailable_reason:
        pytest.skip(f"no GPU: {backend.unavailable_reason}")
    try:
        assert_contract(backend)
    finally:
        backend.close()


# -- the real NVML backend on the stand-in libnvidia-ml.so.1 ----------------------------------


@pytest.fixture(scope="session")
def nvml_fake_lib(pytestconfig):
    """Build tests/nvml_fake into build/nvml-fake and load it where pynvml will look for it."""
    path = harness.build()
    harness.preload(pytestconfig)
    return path


@pytest.fixture
def fake_nvml(nvml_fake_lib, tmp_path, monkeypatch):
    """``open(scenario, switches=(), extra=None, call_timeout_s=5)``: the real NVML backend
    (real nvidia-ml-py, real ctypes) on the stand-in library, showing ``scenario``."""
    state = tmp_path / "nvml.state"
    monkeypatch.delenv("NVML_FAKE_SCENARIO", raising=False)
    monkeypatch.setenv("NVML_FAKE_STATE", str(state))
    opened = []

    def open_(scenario, switches=(), extra=None, call_timeout_s=5.0):
        write_state(state, render(scenario, _sku(scenario.sku), switches, extra))
        backend = open_nvml(call_timeout_s=call_timeout_s)
        opened.append(backend)
        return backend

    open_.state = state
    yield open_
    harness.close_backends(state, opened)


def _sku(sku_id):
    return load_skus(resources.graders_dir(config_from_dict({})))[sku_id]


def _outcome(device, method):
    """A reading's value, or the kind of error it raised (NotSupported, DeviceLost, ...)."""
    try:
        return getattr(device, method)()
    except base.GpuError as err:
        for kind in (base.NotSupported, base.NoPermission, base.DeviceLost, base.GpuTimeout):
            if isinstance(err, kind):
                return kind.__name__
        return base.GpuError.__name__


def _node_readings(backend):
    return [{method: _outcome(dev, method) for method in READINGS} for dev in backend.devices()]


def test_nvml_backend_on_the_stand_in_library_keeps_the_contract_on_a_healthy_h100(fake_nvml):
    backend = fake_nvml(load_scenario(harness.REPO / "scenarios" / "healthy-h100.yaml"))
    assert_contract(backend)
    assert len(backend.devices()) == 8
    assert backend.driver() == base.DriverInfo(
        driver_version="570.86.15", cuda_version="12.8", nvml_version="12.570.86.15"
    )
    for dev in backend.devices():
        assert dev.recovery_action() == "none"
        assert len(dev.nvlinks()) == 18
        assert all(link.active and link.p2p_supported for link in dev.nvlinks())
        ecc = dev.ecc()  # an Ampere or later GPU to a root agent: SRAM status read, clean
        assert (ecc.sram_uncorrectable_aggregate, ecc.sram_threshold_exceeded) == (0, False)


def test_nvml_backend_keeps_the_contract_where_optional_functions_are_unsupported(fake_nvml):
    scenario = Scenario(
        sku="h100-sxm5-80gb",
        gpus=2,
        source="t",
        compute_processes=(ComputeProcess(gpu=0, pid=4242),),
    )
    backend = fake_nvml(
        scenario,
        harness.SPARSE_SWITCHES,
        extra={0: harness.SPARSE_FIELDS, 1: harness.SPARSE_FIELDS},
    )
    assert_contract(backend)
    dev = backend.devices()[0]
    for method in (
        "recovery_action",
        "memory_temperature_c",
        "temperature_thresholds",
        "retired_pages",
        "row_remap",
        "persistence_mode",
        "compute_processes",
        "utilization",
    ):
        with pytest.raises(base.NotSupported):
            getattr(dev, method)()
    ident = dev.identity()
    assert (ident.serial, ident.vbios, ident.memory_total_mib) == (None, None, None)
    assert dev.power() == base.Power(usage_w=84.0, enforced_limit_w=None, default_limit_w=None)
    assert dev.clocks() == base.Clocks(sm_mhz=1980, sm_max_mhz=None, memory_mhz=2619)
    assert dev.pcie().replay_count is None
    ecc = dev.ecc()
    assert (ecc.aggregate_dbe_sram, ecc.aggregate_dbe_dram) == (None, None)
    assert (ecc.sram_uncorrectable_aggregate, ecc.sram_threshold_exceeded) == (None, None)
    # an older driver: the _v2 CUDA version and clocks "throttle" reasons answer instead
    assert backend.driver() == base.DriverInfo("570.86.15", "12.8", None)
    assert dev.throttle_reasons() == {"gpu_idle"}
    # NVLink capabilities unsupported: active links still count, none are invented
    assert [link.link for link in dev.nvlinks()] == list(range(18))
    assert {(link.replay_errors, link.recovery_errors) for link in dev.nvlinks()} == {(None, None)}
    assert {link.p2p_supported for link in dev.nvlinks()} == {False}  # not reported: not usable
    # nor is the far end: Not Supported stays None, no peer named
    assert {(link.remote_type, link.remote_pci_bus_id, link.peer) for link in dev.nvlinks()} == {
        (None, None, None)
    }
    with pytest.raises(base.NotSupported, match="Xid events"):
        backend.wait_xid_events(0.05)


# One scenario per NVML-level fault kind (docs/simulation.md); the GPU indices avoid a missing
# GPU before another (NVML numbers the GPUs it finds 0..n-1; the simulator keeps the gaps).
NVML_FAULTS = {
    "xid": {"kind": "xid", "gpu": 2, "code": 79},
    "row_remap_pending": {"kind": "row_remap_pending", "gpu": 2},
    "row_remap_failure": {"kind": "row_remap_failure", "gpu": 2},
    "ecc_dbe_volatile": {"kind": "ecc_dbe_volatile", "gpu": 1, "count": 2},
    "ecc_sbe_volatile": {"kind": "ecc_sbe_volatile", "gpu": 1, "count": 5000},
    "ecc_sram_uncorrectable": {
        "kind": "ecc_sram_uncorrectable",
        "gpu": 2,
        "count": 3,
        "unit": "sm",
    },
    "sram_threshold_exceeded": {"kind": "sram_threshold_exceeded", "gpu": 1},
    "memory_total": {"kind": "memory_total", "gpu": 0, "mib": 40960},
    "missing_gpu": {"kind": "missing_gpu", "gpu": 3},
    "pci_only": {"kind": "pci_only", "gpu": 3},
    "gpu_lost": {"kind": "gpu_lost", "gpu": 3},
    "temperature": {"kind": "temperature", "gpu": 0, "celsius": 95},
    "pcie_width": {"kind": "pcie_width", "gpu": 3, "lanes": 8},
    "throttle": {"kind": "throttle", "gpu": 2, "reasons": ["hw_slowdown", "sw_power_cap"]},
    "nvlink_down": {"kind": "nvlink_down", "gpu": 1, "link": 3},
    "recovery_action": {"kind": "recovery_action", "gpu": 1, "action": "gpu_reset"},
    "persistence_off": {"kind": "persistence_off", "gpu": 0},
    "driver_hang": {"kind": "driver_hang", "gpu": 2},
    "spin": {"kind": "spin", "gpu": 3},
    # the NVLink fabric, on a GB200 tray (an H100 has none to register)
    "fabric_degraded": {"kind": "fabric_degraded", "gpu": 2, "mask": ["route_unhealthy"]},
    "fabric_incomplete": {"kind": "fabric_incomplete", "gpu": 1, "state": "in_progress"},
    "wrong_clique": {"kind": "wrong_clique", "gpu": 0, "clique": 5},
}
#: the SKU each fault's parity case runs on (the rest: an H100)
FAULT_SKU = {k: "gb200-186gb" for k in ("fabric_degraded", "fabric_incomplete", "wrong_clique")}
#: how long a parity case's NVML call may take before it counts as hung: what ``driver_hang``
#: costs its case, and long enough that a loaded test machine (three xdist workers on two
#: cores) never makes a healthy call look hung (0.3 s did once)
HUNG_CALL_S = 1.0


def test_every_nvml_level_fault_kind_has_a_parity_case():
    assert set(NVML_FAULTS) == NVML_FAULT_KINDS


@pytest.mark.parametrize("kind", sorted(NVML_FAULTS))
def test_nvml_backend_reads_each_fault_as_the_simulator_shows_it(fake_nvml, kind):
    raw = dict(NVML_FAULTS[kind])
    fault = Fault(kind=raw.pop("kind"), gpu=raw.pop("gpu"), params=raw)
    scenario = Scenario(
        sku=FAULT_SKU.get(kind, "h100-sxm5-80gb"),
        gpus=4,
        source="t",
        faults=(fault,),
        compute_processes=(ComputeProcess(gpu=0, pid=4242, used_memory_mib=512),),
    )
    sim = SimGpuBackend(scenario, _sku(scenario.sku), call_timeout_s=HUNG_CALL_S)
    nvml = fake_nvml(scenario, call_timeout_s=HUNG_CALL_S)
    sim_readings, nvml_readings = _node_readings(sim), _node_readings(nvml)
    if kind in ("missing_gpu", "pci_only"):  # the same GPUs, numbered by NVML without the gap
        for reading in sim_readings:
            reading["identity"] = dataclasses.replace(reading["identity"], index=None)
        for reading in nvml_readings:
            reading["identity"] = dataclasses.replace(reading["identity"], index=None)
    assert nvml_readings == sim_readings
    assert len(nvml.devices()) == (3 if kind in ("missing_gpu", "pci_only") else 4)
    if kind == "driver_hang":  # wedged: the event wait fails fast like every other call
        with pytest.raises(base.GpuTimeout):
            nvml.wait_xid_events(0.05)
        return
    expected = [(e.gpu_index, e.code) for e in sim.wait_xid_events(0.05)]
    assert [(e.gpu_index, e.code) for e in nvml.wait_xid_events(0.2)] == expected
    assert expected == ([(2, 79)] if kind == "xid" else [])
    assert nvml.wait_xid_events(0.05) == []  # each event once


# -- NVLink: each link's far end and NVLink 5's error counts and BERs --------------------------

#: (SKU, where its links go, whether it answers NVLink 5's fields)
NVLINK_BOARDS = {
    "gb200-186gb": ("switch", "00000004:01:00.0", True),  # link 7: switch tray 4, chip 1
    "b200-sxm-180gb": ("switch", "00000000:05:00.0", True),  # HGX B200: 2 NVSwitches
    "h100-sxm5-80gb": ("switch", "00000000:06:00.0", False),  # HGX H100: 4 NVSwitches
    "a100-sxm4-80gb": ("switch", "00000000:08:00.0", False),  # HGX A100: 6
}


@pytest.mark.parametrize("sku", sorted(NVLINK_BOARDS))
def test_nvlink_peers_and_nvlink5_fields_read_alike_through_sim_stand_in_and_replay(fake_nvml, sku):
    """A link's far end (nvmlDeviceGetNvLinkRemoteDeviceType, ...RemotePciInfo_v2) and NVLink
    5's per-link field values (effective and symbol errors and their BERs) read the same from
    the simulator, the real backend on the C stand-in, and the Python replay; before NVLink 5
    the fields answer Not Supported and stay None."""
    symbol = Fault("counter_series", 1, {"counter": "nvlink_symbol", "values": [40], "link": 7})
    scenario = Scenario(sku=sku, gpus=4, source="t", faults=(symbol,))
    sim = SimGpuBackend(scenario, _sku(sku))
    python, c = _state_nvml(scenario), fake_nvml(scenario)
    try:
        links = [dev.nvlinks() for dev in sim.devices()]
        assert [dev.nvlinks() for dev in c.devices()] == links
        assert [dev.nvlinks() for dev in python.devices()] == links
    finally:
        python.close()
    kind, bus, nvlink5 = NVLINK_BOARDS[sku]
    link7 = links[1][7]
    assert (link7.remote_type, link7.remote_pci_bus_id) == (kind, bus)
    assert link7.peer == f"NVSwitch {bus}"
    if nvlink5:
        assert (link7.symbol_errors, link7.symbol_ber, link7.effective_errors) == (40, 4e-14, 0)
        assert links[0][7].symbol_errors == 0 and links[0][7].symbol_ber == 0.0
    else:
        assert {(link.symbol_errors, link.effective_ber) for gpu in links for link in gpu} == {
            (None, None)
        }


def test_nvlink5_fields_and_the_far_end_answer_not_supported_on_the_real_h100_capture():
    """The real H100 VM recorded fields 219-222 as Not Supported (and no link answers):
    replayed, the backend asks for none of them and reports no link, nothing invented."""
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    scenario = load_scenario(harness.REPO / "scenarios" / "real" / "h100-sxm5-vm.yaml", skus)
    gpu = scenario.nvml["gpus"][0]
    assert {gpu[f"field.{i}"]["code"] for i in (219, 220, 221, 222)} == {3}
    replay = open_gpus(scenario, skus[scenario.sku])
    try:
        assert [dev.nvlinks() for dev in replay.devices()] == [[]]
    finally:
        replay.close()


def test_the_faults_read_through_nvml_are_the_ones_injected(fake_nvml):
    """The parity above would hold if neither way showed a fault: these are the values."""
    scenario = Scenario(
        sku="h100-sxm5-80gb",
        gpus=4,
        source="t",
        faults=tuple(
            Fault(
                kind=raw["kind"],
                gpu=raw["gpu"],
                params={k: v for k, v in raw.items() if k not in ("kind", "gpu")},
            )
            for raw in (
                NVML_FAULTS["ecc_sram_uncorrectable"],
                NVML_FAULTS["sram_threshold_exceeded"],
                NVML_FAULTS["memory_total"],
            )
        ),
    )
    gpu0, gpu1, gpu2, gpu3 = fake_nvml(scenario).devices()
    assert gpu0.identity().memory_total_mib == 40960
    ecc1, ecc2 = gpu1.ecc(), gpu2.ecc()
    assert (ecc1.sram_threshold_exceeded, ecc1.sram_uncorrectable_aggregate) == (True, 0)
    assert (ecc2.sram_threshold_exceeded, ecc2.sram_uncorrectable_aggregate) == (False, 3)
    assert ecc2.sram_uncorrectable_by_unit["sm"] == 3
    assert gpu3.ecc().sram_uncorrectable_aggregate == 0


@pytest.mark.parametrize("state", ["not_loaded", "not_installed"])
def test_a_driver_that_is_down_reads_through_nvml_as_the_simulator_says(fake_nvml, state):
    scenario = Scenario(sku="h100-sxm5-80gb", gpus=4, source="t", driver=state)
    sim = SimGpuBackend(scenario, _sku(scenario.sku))
    write_state(fake_nvml.state, render(scenario, _sku(scenario.sku)))
    nvml = open_backend()  # what the agent opens without --simulate
    assert (nvml.unavailable_reason, nvml.broken) == (sim.unavailable_reason, sim.broken)
    assert nvml.devices() == sim.devices() == []
    assert nvml.unavailable_reason.startswith("no NVIDIA driver")


# -- virtualization and captured nodes ------------------------------------------------------------


def test_a_scenario_virtualization_key_reads_the_same_through_the_simulator_and_nvml(fake_nvml):
    scenario = Scenario(sku="h100-sxm5-80gb", gpus=2, source="t", virtualization="pass_through")
    sim = SimGpuBackend(scenario, _sku(scenario.sku))
    nvml = fake_nvml(scenario)
    assert [d.virtualization_mode() for d in sim.devices()] == ["pass_through"] * 2
    assert [d.virtualization_mode() for d in nvml.devices()] == ["pass_through"] * 2
    bare = SimGpuBackend(Scenario(sku="h100-sxm5-80gb", gpus=1, source="t"), _sku(scenario.sku))
    assert bare.devices()[0].virtualization_mode() == "none"


def _state_nvml(scenario, switches=(), call_timeout_s=HUNG_CALL_S):
    backend = NvmlBackend(
        StateNvml(render(scenario, _sku(scenario.sku), switches).splitlines()), call_timeout_s
    )
    backend.init()
    return backend


@pytest.mark.parametrize("kind", sorted(set(NVML_FAULTS) - {"driver_hang"}))
def test_the_python_replay_answers_nvml_as_the_stand_in_library_does(fake_nvml, kind):
    """gpu/replay.py's StateNvml (what --simulate runs a capture on) and the C stand-in read
    the same state file alike, through the same NVML backend: every reading, fault by fault.
    (A hang is the stand-in's alone: a capture records a call that timed out as its error.)"""
    raw = dict(NVML_FAULTS[kind])
    fault = Fault(kind=raw.pop("kind"), gpu=raw.pop("gpu"), params=raw)
    scenario = Scenario(
        sku=FAULT_SKU.get(kind, "h100-sxm5-80gb"),
        gpus=4,
        source="t",
        faults=(fault,),
        virtualization="pass_through",
        compute_processes=(ComputeProcess(gpu=0, pid=4242, used_memory_mib=512),),
    )
    python, c = _state_nvml(scenario), fake_nvml(scenario, call_timeout_s=HUNG_CALL_S)
    try:
        assert _node_readings(python) == _node_readings(c)
        assert python.driver() == c.driver()
    finally:
        python.close()


def test_the_python_replay_answers_like_the_stand_in_where_functions_are_unsupported(fake_nvml):
    scenario = Scenario(sku="h100-sxm5-80gb", gpus=2, source="t")
    switches = harness.SPARSE_SWITCHES
    python = _state_nvml(scenario, switches)
    c = fake_nvml(scenario, switches)
    try:
        assert _node_readings(python) == _node_readings(c)
        assert python.driver() == c.driver()
    finally:
        python.close()


REAL_CAPTURES = {
    "h100": (harness.REPO / "scenarios" / "real" / "h100-sxm5-vm.yaml", "NVIDIA H100 80GB HBM3"),
    "h200": (
        harness.REPO.parent / "shared" / "realworld" / "gpu-h200-vm" / "capture.yaml",
        "NVIDIA H200",
    ),
}


@pytest.mark.parametrize("which", sorted(REAL_CAPTURES))
def test_the_real_h100_capture_reads_alike_through_simulate_and_the_stand_in(fake_nvml, which):
    """scenarios/real/h100-sxm5-vm.yaml (one H100) and ../shared/realworld/gpu-h200-vm's
    capture (one H200), each pass-through, every NVLink call Not Supported: what --simulate
    opens (the replay backend) and what the stand-in serves agree."""
    path, name = REAL_CAPTURES[which]
    if not path.is_file():
        pytest.skip(f"the real capture is not here: {path}")
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    scenario = load_scenario(path, skus)
    replay = open_gpus(scenario, skus[scenario.sku])
    try:
        assert replay.simulated and replay.name == "replay"
        assert_contract(replay)
        c = fake_nvml(scenario)
        assert _node_readings(replay) == _node_readings(c)
        (dev,) = replay.devices()
        assert dev.virtualization_mode() == "pass_through"
        assert dev.nvlinks() == []
        with pytest.raises(base.NotSupported):
            dev.retired_pages()
        assert dev.identity().name == name
        assert dev.row_remap() == base.RowRemap(0, 0, False, False)
        assert replay.driver() == base.DriverInfo("580.159.04", "13.0", "13.580.159.04")
    finally:
        replay.close()


def test_a_replayed_capture_whose_gpus_report_xid_events_waits_for_them():
    """A capture that recorded ``event_types`` (a real H200's did) registers its GPUs for Xid
    events under --simulate, and a wait with none pending returns none, as NVML's does."""
    gpu = {"name": "NVIDIA H200", "uuid": "GPU-1", "pci.bus_id": "00000000:00:06.0"}
    backend = open_replay({"system": {}, "gpus": [{**gpu, "event_types": 65439}]})
    try:
        assert backend.wait_xid_events(0.05) == []
    finally:
        backend.close()
