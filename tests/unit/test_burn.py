"""The burn engine's pieces: verification, confirmation, worker supervision, trace joining,
telemetry and the thermal findings."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from node_agent.compute import burn  # noqa: E402
from node_agent.compute.burn import (  # noqa: E402
    BurnEngine,
    BurnPlan,
    GpuTelemetry,
    Sample,
    TelemetrySampler,
    Verifier,
    count_wrong,
    join_trace,
    make_inputs,
    numerics,
    run_burn,
)
from node_agent.compute.devices import ComputeDevice, ComputeSpec  # noqa: E402
from node_agent.config import config_from_dict  # noqa: E402
from node_agent.gpu.base import GpuTimeout, NotSupported  # noqa: E402
from node_agent.sdc.probes import corrupting_matmul  # noqa: E402

CPU = torch.device("cpu")
PRECISIONS = ["bf16", "fp16", "tf32", "fp32"]


def product(precision, n=64, seed=0, matmul=torch.matmul):
    a, b = make_inputs(precision, n, CPU, seed)
    with numerics(precision):
        c = matmul(a, b)
    return a, b, c


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("seed", range(3))
def test_a_correct_product_flags_no_row_and_has_no_wrong_element(precision, seed):
    a, b, c = product(precision, seed=seed)
    verifier = Verifier(a, b, c, precision)
    assert verifier.flagged_rows(c) == []
    # the rigorous per-element bound holds for every row, not only flagged ones
    assert count_wrong(a, b.float().double(), c, list(range(64)), precision,
                       max_rows=64).wrong == 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_flipped_element_is_localised_to_its_row_and_column_and_counted_once(precision):
    a, b, c = product(precision)
    verifier = Verifier(a, b, c, precision)
    bad = c.clone()
    bad[37, 11] = bad[37, 11] * 1.5 + 1  # a wrong element well beyond rounding
    rows = verifier.flagged_rows(bad)
    assert rows == [37]
    check = count_wrong(a, b.float().double(), bad, rows, precision)
    assert check.wrong == 1 and check.rows_checked == [37]
    row, col, got, expected = check.examples[0]
    assert (row, col) == (37, 11) and got != pytest.approx(expected)


def test_non_finite_output_is_always_flagged():
    a, b, c = product("fp32")
    verifier = Verifier(a, b, c, "fp32")
    bad = c.clone()
    bad[5, 5] = float("nan")
    assert verifier.flagged_rows(bad) == [5]
    assert count_wrong(a, b.float().double(), bad, [5], "fp32").wrong == 1


def test_flagged_rows_beyond_the_recompute_limit_are_not_recomputed():
    a, b, c = product("fp32")
    bad = c + 1000.0  # every element wrong
    check = count_wrong(a, b.float().double(), bad, list(range(64)), "fp32", max_rows=2)
    assert check.rows_checked == [0, 1] and check.wrong == 2 * 64


class FlakyMatmul:
    """A matmul wrong on chosen calls only: a transient fault cannot be produced otherwise."""

    def __init__(self, wrong_calls):
        self.calls = 0
        self.wrong_calls = set(wrong_calls)
        self.corrupt = corrupting_matmul(seed=1)

    def __call__(self, a, b):
        self.calls += 1
        return self.corrupt(a, b) if self.calls in self.wrong_calls else torch.matmul(a, b)


def engine_with(matmul, precision="fp32"):
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, matmul)
    plan = BurnPlan(size=64, precisions=(precision,), sample_s=0.01, verify_every=1)
    engine = BurnEngine(device, plan)
    assert engine.prepare() == {}
    return engine


@pytest.mark.parametrize("wrong_calls, confirmed, rerun_wrong", [
    ({3}, False, 0),                # wrong once: the re-run is right -> transient
    (set(range(3, 100)), True, 1),  # wrong every time -> confirmed
])
def test_a_wrong_product_is_rerun_once_and_classified(wrong_calls, confirmed, rerun_wrong):
    # calls: 1 = prepare's first product, 2 = warm-up, 3 = the first verified product
    engine = engine_with(FlakyMatmul(wrong_calls))
    sent = []
    engine.run_window("fp32", 0.0, 0.0, sent.append)  # window already over: one product
    events = [m[1] for m in sent if m[0] == "wrong"]
    (sample,) = [m for m in sent if m[0] == "sample"]
    assert len(events) == 1
    assert events[0]["wrong"] == 1 and events[0]["rerun_wrong"] == rerun_wrong
    assert events[0]["confirmed"] is confirmed and events[0]["precision"] == "fp32"
    assert events[0]["shape"] == [64, 64, 64]
    assert sample[7] == 1  # the sample carries the wrong count too


def test_a_faulty_sm_on_every_launch_is_a_confirmed_wrong_product_in_the_burn():
    """The simulator's one-SM fault (every tile of SM 0 wrong, rate 1) at the burn's compute
    boundary: the burn's own verification sees and confirms it, as it sees a GPU-wide one."""
    from node_agent.sdc.tiles import sim_model

    model = sim_model(4)  # 4 SMs, so SM 0 computes 4 of a 64 x 64 output's 16 tiles
    engine = engine_with(corrupting_matmul(tiles=model, sm=0, rate=1.0, seed=2))
    sent = []
    engine.run_window("fp32", 0.0, 0.0, sent.append)
    (event,) = [m[1] for m in sent if m[0] == "wrong"]
    assert event["confirmed"] is True and event["wrong"] == 4 and event["rerun_wrong"] == 4


def test_a_correct_device_sends_samples_with_positive_throughput_and_no_wrong():
    engine = engine_with(torch.matmul, "bf16")
    sent = []
    engine.run_phase("bf16", burn.time.monotonic() + 0.05, burn.time.monotonic(), sent.append)
    samples = [Sample(*m[1:]) for m in sent]
    assert samples and all(m[0] == "sample" for m in sent)
    assert all(s.tflops > 0 and s.wrong == 0 and s.verified >= 1 for s in samples)


def test_join_trace_pairs_each_reading_with_the_sample_window_around_it():
    tel = GpuTelemetry(t_s=[0.0, 0.5, 1.5, 2.5, 3.5], temp_c=[40, 50, 60, None, 61],
                       mem_temp_c=[None] * 5, power_w=[100, 600, 650, 640, 100],
                       sm_clock_mhz=[1980] * 5, throttle=[["gpu_idle"], ["sw_power_cap"], None,
                                                          ["sw_power_cap"], []],
                       power_limit_w=700.0, slowdown_temp_c=90)
    samples = [Sample(0.2, 1.0, "bf16", 2e12, 1.0, 1, 0),   # 2 TFLOP/s over [0.2, 1.0]
               Sample(2.0, 3.0, "bf16", 4e12, 1.0, 1, 0)]   # 4 TFLOP/s over [2.0, 3.0]
    trace = join_trace(tel, samples)
    # before the first window: None; inside: its figure; between windows: the last one held;
    # after the last window: None
    assert trace["tflops"] == [None, 2.0, 2.0, 4.0, None]
    assert trace["temp_c"] == [40, 50, 60, None, 61]
    assert trace["throttle"][2] is None and trace["power_limit_w"] == 700.0
    assert list(trace) == ["t_s", "tflops", "temp_c", "power_w", "sm_clock_mhz", "mem_temp_c",
                           "throttle", "power_limit_w", "slowdown_temp_c"]


class HalfBlindGpu:
    """A GPU whose NVML lacks memory temperature and whose power query times out: the
    simulator answers every reading, so only a fake can stand for such a board."""

    index = 0

    def temperature_thresholds(self):
        raise NotSupported("no thresholds on this board")

    def temperature_c(self):
        return 55

    def memory_temperature_c(self):
        raise NotSupported("HBM temperature not reported")

    def power(self):
        raise GpuTimeout("nvmlDeviceGetPowerUsage did not return within 10 s")

    def clocks(self):
        raise NotSupported("clocks")

    def throttle_reasons(self):
        return frozenset({"sw_power_cap"})


class OneGpuBackend:
    def __init__(self):
        self.hints = []

    def devices(self):
        return [HalfBlindGpu()]

    def load_hint(self, indices, active):
        self.hints.append((list(indices), active))


def test_telemetry_keeps_sampling_when_readings_are_unsupported_or_time_out():
    backend = OneGpuBackend()
    sampler = TelemetrySampler(backend, [0], interval_s=0.01, t_zero=burn.time.monotonic())
    sampler.start()
    burn.time.sleep(0.05)
    tel = sampler.stop()[0]
    assert backend.hints == [([0], True), ([0], False)]
    assert len(tel.t_s) >= 2 and set(tel.temp_c) == {55}
    assert set(tel.mem_temp_c) == {None} and set(tel.power_w) == {None}
    assert tel.throttle[0] == ["sw_power_cap"] and tel.slowdown_temp_c is None
    assert "GpuTimeout" in tel.errors["power"] and "memory_temperature" in tel.errors


def tiny_plan(**hook):
    return BurnPlan(size=32, duration_s=1.0, precisions=("fp32",), sample_s=0.02,
                    verify_every=1000, stall_s=3.0, startup_timeout_s=120.0, hook=hook or None)


def sim_specs(n=3):
    return [ComputeSpec(i, simulated=True) for i in range(n)]


def test_a_worker_that_exits_is_an_error_for_that_gpu_only():
    out = run_burn(sim_specs(), tiny_plan(gpu=1, action="exit", after_samples=1, code=7),
                   deadline_s=150)
    dead = out.workers[1]
    assert dead.failure == "worker_died" and dead.exitcode == 7
    assert "gpu:1" in dead.failure_detail and "code 7" in dead.failure_detail
    for i in (0, 2):
        assert out.workers[i].failure is None and out.workers[i].samples


def test_a_worker_that_raises_reports_its_exception_text():
    out = run_burn(sim_specs(2), tiny_plan(gpu=0, action="raise", after_samples=2),
                   deadline_s=150)
    dead = out.workers[0]
    assert dead.failure == "worker_died" and dead.exitcode == 3
    assert "injected failure" in dead.last_words and "injected failure" in dead.failure_detail
    assert out.workers[1].failure is None


def test_a_worker_that_stops_sending_is_killed_as_stalled_and_the_run_ends():
    out = run_burn(sim_specs(2), tiny_plan(gpu=1, action="hang", after_samples=1),
                   deadline_s=150)
    stalled = out.workers[1]
    assert stalled.failure == "worker_stalled" and "3 s" in stalled.failure_detail
    assert stalled.exitcode is not None  # killed, not left behind
    assert out.workers[0].failure is None and out.workers[0].samples


def test_precisions_no_gpu_supports_are_skipped_with_the_reason():
    plan = BurnPlan(size=32, duration_s=0.3, precisions=("fp8", "fp32"), sample_s=0.02,
                    verify_every=1000, stall_s=3.0)
    out = run_burn(sim_specs(1), plan, deadline_s=150)
    assert out.precisions == ["fp32"]
    assert "not supported on the CPU" in out.skipped["fp8"]


# -- thermal findings on a given trace --------------------------------------------------------


def thermal_ctx(scenario_faults=()):
    from node_agent import resources
    from node_agent.checks import CheckContext
    from node_agent.gpu.sim import SimGpuBackend
    from node_agent.grading.sku import load_skus
    from node_agent.sim.scenario import Fault, Scenario

    config = config_from_dict({})
    sku = load_skus(resources.graders_dir(config))["h100-sxm5-80gb"]
    scenario = Scenario(sku=sku.id, gpus=2, source="t",
                        faults=tuple(Fault(**f) for f in scenario_faults))
    return CheckContext(check="thermal_power", gpu=SimGpuBackend(scenario, sku), kernel_log=None,
                        config=config, inventory=None, sku=sku, expected_gpus=2,
                        scenario=scenario)


def trace(power, tflops, temps=None, throttle=None, clocks=None):
    n = len(power)
    return {"t_s": [i * 1.0 for i in range(n)], "tflops": tflops, "temp_c": temps or [60] * n,
            "power_w": power, "sm_clock_mhz": clocks or [1980] * n, "mem_temp_c": [50] * n,
            "throttle": throttle or [["sw_power_cap"]] * n, "power_limit_w": 700.0,
            "slowdown_temp_c": 90}


def findings(ctx, tr):
    from node_agent.checks.thermal_power import gpu_findings

    return {r.metric: r for r in gpu_findings(ctx, 0, tr, "a test trace")}


def test_power_below_three_quarters_of_the_limit_at_full_load_is_a_finding():
    got = findings(thermal_ctx(), trace([400.0] * 10, [1.0] * 10))
    assert got["power_reached_fraction"].status.value == "fail"
    assert "57%" in got["power_reached_fraction"].detail


def test_low_power_is_not_graded_when_the_gpu_did_not_run_at_full_load():
    got = findings(thermal_ctx(), trace([400.0] * 10, [1.0] * 3 + [None] * 7))
    assert got["power_reached_fraction"].status.value == "skip"
    assert "full load" in got["power_reached_fraction"].detail


def test_sw_power_cap_is_normal_but_hw_power_brake_is_a_finding():
    calm = findings(thermal_ctx(), trace([680.0] * 4, [1.0] * 4))
    assert calm["throttle"].status.value == "pass"
    braked = findings(thermal_ctx(), trace([680.0] * 4, [1.0] * 4, throttle=[
        ["sw_power_cap"], ["hw_power_brake_slowdown", "sw_power_cap"], ["sw_power_cap"], None]))
    assert braked["throttle"].status.value == "fail"
    assert "hw_power_brake_slowdown in 1 of 3 readings" in braked["throttle"].detail


def test_time_above_slowdown_is_measured_from_the_readings():
    got = findings(thermal_ctx(), trace([680.0] * 5, [1.0] * 5, temps=[70, 91, 92, 80, 70]))
    result = got["temperature_max_c"]
    assert result.status.value == "fail" and result.value == 92
    assert result.evidence["time_above_slowdown_s"] == 2.0


def test_a_trace_without_readings_skips_rather_than_passes():
    empty = {k: [] for k in ("t_s", "tflops", "temp_c", "power_w", "sm_clock_mhz",
                             "mem_temp_c", "throttle")}
    got = findings(thermal_ctx(), {**empty, "power_limit_w": None, "slowdown_temp_c": None})
    assert {m: r.status.value for m, r in got.items()} == {
        "temperature_max_c": "skip", "power_reached_fraction": "skip", "sm_clock_drop": "skip",
        "throttle": "skip", "memory_temperature_max_c": "skip", "load_trace": "pass"}
