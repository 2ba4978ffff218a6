"""NVLink per link, by what is at its other end: nvml_health's counters name each link's peer
(NVML's remote device type and PCI bus id) and, on NVLink 5, report the effective and symbol
errors with their BERs; the recorder keeps them; the trend watch grades a link whose symbol
errors grow in 15 of its last 30 one-minute windows WARN, naming the link and its peer.

The GPUs are the simulator's (no machine here has NVIDIA GPUs); the check, the trends file, the
grading rules and the history are the real ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent import resources
from node_agent.checking.context import CheckContext
from node_agent.checks import nvml_health
from node_agent.config import config_from_dict
from node_agent.gpu.nvml import NvmlBackend
from node_agent.gpu.record import record_nvml
from node_agent.gpu.replay import StateNvml, open_replay
from node_agent.grading.rules import load_grader
from node_agent.grading.trends import load_trend_specs
from node_agent.hardware.sku import load_skus
from node_agent.inventory import collect
from node_agent.kernel_log import LinesKernelLog
from node_agent.model import Level, Result, Status
from node_agent.service.history import Bound, open_history
from node_agent.service.trend_watch import TrendWatch
from node_agent.sim.gpu_model import SimGpuBackend
from node_agent.sim.node import stand_in_ports
from node_agent.sim.nvml_state import render
from node_agent.sim.scenario import Fault, Scenario, load_scenario

CONFIG = config_from_dict({})
GRADERS = resources.graders_dir(CONFIG)
SKUS = load_skus(GRADERS)
REPO = Path(__file__).resolve().parents[2]
SYMBOL_SCENARIO = REPO / "scenarios" / "gb200-nvlink-symbol-errors.yaml"
T0 = 1_760_000_040.0  # a minute boundary
#: GPU 3 link 7 of a GB200 tray, as the simulator addresses switch tray 4's second chip
LINK7_PEER = "NVSwitch 00000004:01:00.0"


def context(scenario: Scenario) -> CheckContext:
    """nvml_health's context over one simulated backend (its counter series advance per run)."""
    sku = SKUS[scenario.sku]
    backend = SimGpuBackend(scenario, sku)
    inv = collect(backend, SKUS, scenario.sku)
    return CheckContext(
        check="nvml_health",
        gpu=backend,
        kernel_log=LinesKernelLog([]),
        config=CONFIG,
        inventory=inv,
        sku=inv.sku,
        expected_gpus=scenario.gpus,
        ports=stand_in_ports(scenario, inv.sku, backend),
        pci=None,
    )


def symbol_errors(count: int, sku: str = "gb200-186gb") -> Scenario:
    fault = Fault("counter_series", 3, {"counter": "nvlink_symbol", "values": [count], "link": 7})
    return Scenario(sku=sku, gpus=4, source="t", faults=(fault,))


def one(results: list[Result], metric: str, target: str) -> Result:
    (result,) = [r for r in results if r.metric == metric and r.target == target]
    return result


def test_nvlink5_symbol_errors_are_a_reading_with_the_links_ber_and_peer() -> None:
    results = nvml_health.run(context(symbol_errors(40)))
    symbols = one(results, "nvlink_symbol_errors", "gpu:3")
    assert (symbols.status, symbols.value, symbols.evidence["worst_link"]) == (Status.PASS, 40, 7)
    assert symbols.evidence["per_link"]["7"] == 40 and len(symbols.evidence["per_link"]) == 18
    assert symbols.evidence["ber_by_link"]["7"] == 4e-14
    assert symbols.evidence["peer_by_link"]["7"] == LINK7_PEER
    assert f"link 7 (to {LINK7_PEER})" in symbols.detail
    effective = one(results, "nvlink_effective_errors", "gpu:3")
    assert effective.value == 0 and effective.evidence["ber_by_link"]["7"] == 0.0
    # the replay counters of every link carry the same peers for the history's series
    replays = one(results, "nvlink_replay_errors", "gpu:0")
    assert replays.evidence["peer_by_link"]["0"] == "NVSwitch 00000001:00:00.0"


def test_hopper_answers_no_nvlink5_counters_and_nothing_is_reported_for_them() -> None:
    """An HGX H100 answers the NVLink 5 fields Not Supported: no effective or symbol results,
    the same grade; its links still name their NVSwitches."""
    results = nvml_health.run(context(symbol_errors(40, "h100-sxm5-80gb")))
    metrics = {r.metric for r in results}
    assert "nvlink_symbol_errors" not in metrics and "nvlink_effective_errors" not in metrics
    replays = one(results, "nvlink_replay_errors", "gpu:3")
    assert replays.evidence["peer_by_link"]["7"] == "NVSwitch 00000000:06:00.0"
    assert load_grader(GRADERS).grade(results).level is Level.HEALTHY


def test_symbol_errors_growing_in_15_of_30_windows_warn_naming_the_link_and_its_peer(
    tmp_path: Path,
) -> None:
    """scenarios/gb200-nvlink-symbol-errors.yaml read once a minute: at the 30th reading link
    7 of GPU 3 grew in 15 of its last 30 windows, nvidia-resiliency-ext's rule: WARN."""
    now = [T0]
    specs = load_trend_specs(GRADERS / "trends.yaml")
    history = open_history(tmp_path / "state", lambda: now[0], Bound())
    watch = TrendWatch(specs, history, lambda: now[0])
    ctx = context(load_scenario(SYMBOL_SCENARIO, SKUS))
    try:
        for minute in range(31):
            watch.update(nvml_health.run(ctx), None)
            if minute == 28:  # 14 windows rose so far: nothing yet
                assert not [r for r in watch.results() if r.metric == "nvlink_link_errors"]
            now[0] += 60.0
        (warn,) = [r for r in watch.results() if r.metric == "nvlink_link_errors"]
        assert (warn.status, warn.target, warn.value) == (Status.WARN, "gpu:3", 15)
        assert f"gpu:3 link 7 (to {LINK7_PEER})" in warn.detail
        assert (warn.evidence["series"], warn.evidence["link"]) == ("nvlink_symbol", "7")
        assert warn.evidence["peer"] == LINK7_PEER
        grade = load_grader(GRADERS).grade(watch.results(), "service")
        assert grade.level is Level.WARN
        assert [r.rule for r in grade.reasons] == ["nvlink-link-persistent-errors"]
    finally:
        history.close()


def test_a_capture_records_each_links_peer_and_nvlink5_fields_and_replays_them() -> None:
    scenario = symbol_errors(40)
    lines = render(scenario, SKUS[scenario.sku]).splitlines()
    nvml = record_nvml(call_timeout_s=2, lib=StateNvml(lines))
    gpu = nvml["gpus"][3]
    assert gpu["nvlink.7.remote_type"] == 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert gpu["nvlink.7.remote_pci"] == "00000004:01:00.0"
    assert gpu["field.221.7"] == "ulonglong 40"
    assert gpu["field.222.7"] == "uint 1038"  # mantissa 4, exponent 14: 4e-14
    replay = open_replay(nvml)
    try:
        sim = SimGpuBackend(scenario, SKUS[scenario.sku])
        assert replay.devices()[3].nvlinks() == sim.devices()[3].nvlinks()
    finally:
        replay.close()


def test_a_capture_keeps_a_links_not_supported_nvlink5_field_as_not_supported() -> None:
    """Link 0 answers a symbol count, link 7 Not Supported. The field scan without a scope
    records link 0's value under the unscoped key; the per-link record keeps link 7's Not
    Supported (left out, the replay would read the unscoped key for it), so link 7 replays as
    None, never link 0's count."""
    scenario = Scenario(sku="h100-sxm5-80gb", gpus=1, source="t")
    extra = {0: ["field.221.0 ulonglong 9", "field.221.7 error 3"]}
    lines = render(scenario, SKUS[scenario.sku], extra=extra).splitlines()
    nvml = record_nvml(call_timeout_s=2, lib=StateNvml(lines))
    gpu = nvml["gpus"][0]
    assert gpu["field.221"] == "ulonglong 9" and gpu["field.221.0"] == "ulonglong 9"
    assert gpu["field.221.7"] == {"error": "Not Supported", "code": 3}
    replay = open_replay(nvml)
    try:
        links = replay.devices()[0].nvlinks()
        assert (links[0].symbol_errors, links[7].symbol_errors) == (9, None)
    finally:
        replay.close()


def test_an_active_links_far_end_is_read_once_and_unsupported_nvlink5_fields_are_not_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon reads the links every 10 s: the far end of an active link is wired, read
    once; a down link's is asked again; a GPU that answered every NVLink 5 field Not Supported
    (Hopper) is not asked for them again."""
    down = Fault("nvlink_down", 0, {"link": 3})
    scenario = Scenario(sku="h100-sxm5-80gb", gpus=1, source="t", faults=(down,))
    asked: list[str] = []
    answer, fields = StateNvml._answer, StateNvml.nvmlDeviceGetFieldValues

    def counting(self, call, name, *args):
        asked.append(name)
        return answer(self, call, name, *args)

    def counting_fields(self, handle, ids):
        asked.append("nvmlDeviceGetFieldValues")
        return fields(self, handle, ids)

    monkeypatch.setattr(StateNvml, "_answer", counting)
    monkeypatch.setattr(StateNvml, "nvmlDeviceGetFieldValues", counting_fields)
    backend = NvmlBackend(StateNvml(render(scenario, SKUS[scenario.sku]).splitlines()), 5.0)
    backend.init()
    try:
        (dev,) = backend.devices()
        first = dev.nvlinks()
        assert "nvmlDeviceGetFieldValues" in asked and asked.count(
            "nvmlDeviceGetNvLinkRemoteDeviceType"
        ) == len(first)
        asked.clear()
        assert dev.nvlinks() == first
        assert [n for n in asked if "Remote" in n or "Field" in n] == [
            "nvmlDeviceGetNvLinkRemoteDeviceType",  # link 3, down: asked again
            "nvmlDeviceGetNvLinkRemotePciInfo_v2",
        ]
        assert first[3].peer == "NVSwitch 00000000:05:00.0" and first[3].symbol_errors is None
    finally:
        backend.close()
