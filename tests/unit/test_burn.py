"""The burn engine's pieces: verification, confirmation, worker supervision, trace joining,
telemetry and the thermal findings."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from waiting import wait_for  # noqa: E402  (tests/waiting.py)

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
from node_agent.grading.rules import load_grader  # noqa: E402
from node_agent.model import Status  # noqa: E402
from node_agent.resources import shipped_graders_dir  # noqa: E402
from node_agent.sdc.probes import corrupting_matmul  # noqa: E402

GRADER = load_grader(shipped_graders_dir())

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
    assert count_wrong(a, b.float().double(), c, list(range(64)), precision, max_rows=64).wrong == 0


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


@pytest.mark.parametrize(
    "wrong_calls, confirmed, rerun_wrong",
    [
        ({3}, False, 0),  # wrong once: the re-run is right -> transient
        (set(range(3, 100)), True, 1),  # wrong every time -> confirmed
    ],
)
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


# -- the tf32 phase that left the GPU idle ----------------------------------------------------
#
# On an H100 the burn's tf32 phase ran at 81 TFLOP/s where plain torch.matmul ran at 401.8, with
# power falling and the SM clock at its maximum: the GPU waited on the host. Tensor cores add
# aligned products and truncate toward zero (Fasi, Higham, Mikaitis, Pranesh 2021), a bias the
# old round-to-nearest noise model did not allow for; in tf32, whose fp32 output rounding is too
# small to hide it, nearly every verified product was flagged, and every flag recomputed rows in
# float64 on the CPU while the GPU sat idle. No GPU runs here: the tensor core is emulated.


def truncating_product(a, b, step=8):
    """A·B as a tensor core sums it: ``step`` products at a time into an fp32 accumulator,
    each sum truncated toward zero (then stored as fp32)."""
    a64, b64 = a.double(), b.double()
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], step):
        exact = acc.double() + a64[:, k0 : k0 + step] @ b64[k0 : k0 + step]
        nearest = exact.float()
        away = nearest.double().abs() > exact.abs()
        acc = torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    return acc


class TruncatingTensorCore:
    """A deterministic kernel with a truncating accumulator (the same inputs give the same
    bits; emulating one costs seconds on a CPU, so its product is computed once).
    ``first``: the matmul of the first call, e.g. a round-to-nearest kernel that preparation
    happened to get before the kernel changed."""

    def __init__(self, first=None):
        self.first, self.calls, self.cache = first, 0, {}

    def __call__(self, a, b):
        self.calls += 1
        if self.first is not None and self.calls == 1:
            return self.first(a, b)
        key = (a.data_ptr(), b.data_ptr(), tuple(a.shape), tuple(b.shape))
        if key not in self.cache:
            self.cache[key] = truncating_product(a, b)
        return self.cache[key].clone()


def test_a_truncating_tf32_accumulator_is_not_flagged_but_a_wrong_element_still_is():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 8192, generator=g).half().float()  # tf32 inputs, as make_inputs
    b = torch.randn(8192, 64, generator=g).half().float()
    c = truncating_product(a, b)
    verifier = Verifier(a, b, c, "tf32")
    # the old tolerance, noise statistics alone, is exceeded by the bias in most rows
    assert int((verifier.deviation(c) > verifier.noise).any(1).sum()) > 32
    assert verifier.flagged_rows(c) == []
    assert count_wrong(a, b.double(), c, list(range(64)), "tf32", max_rows=64).wrong == 0
    bad = c.clone()
    bad[9, 40] += 1000  # beyond the rigorous bound at K = 8192 (about 20 here): convicted
    assert verifier.flagged_rows(bad) == [9]
    assert count_wrong(a, b.double(), bad, [9], "tf32").wrong == 1
    small = c.clone()
    small[9, 40] += 0.5  # within it: still flagged (the check sees it), not convicted
    assert verifier.flagged_rows(small) == [9]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_first_product_already_wrong_teaches_nothing(precision):
    """A persistent fault is in preparation's product too: its deviation must not become the
    kernel's rounding, or every later product repeating it would pass."""
    a, b, c = product(precision)
    wrong = c.clone()
    wrong[20, 30] = wrong[20, 30] * 4 + 8  # beyond the rigorous bound
    verifier = Verifier(a, b, wrong, precision)
    assert verifier.flagged_rows(wrong) == [20]
    assert verifier.flagged_rows(c) == []


class Recomputations:
    """Counts the burn's float64 recomputations on the CPU (each one a host-side stall)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = burn.count_wrong

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(burn, "count_wrong", counting)


@pytest.mark.parametrize(
    "first, most",
    [
        (None, 0),  # the kernel preparation saw is the kernel that runs
        (torch.matmul, 1),  # it changed after preparation: one recomputation clears it, then none
    ],
)
def test_a_correct_tf32_kernel_does_not_send_the_burn_to_the_cpu(monkeypatch, first, most):
    kernel = TruncatingTensorCore(first)
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, kernel)
    engine = BurnEngine(device, BurnPlan(size=512, precisions=("tf32",), verify_every=1))
    assert engine.prepare() == {}
    recomputed = Recomputations(monkeypatch)
    sent = []
    for _ in range(4):
        engine.run_window("tf32", 0.0, 0.0, sent.append)  # one verified product each
    assert recomputed.calls <= most
    assert [m for m in sent if m[0] == "wrong"] == []
    assert sum(m[6] for m in sent if m[0] == "sample") == 4


class CountingWaits(burn.DeviceWaits):
    """The engine's waits, counted, on a device that is always behind: a check is never done
    until waited for, so only the engine's bound on checks in flight decides when it waits.
    ``launched`` is the matmul count, read at each record and wait."""

    def __init__(self, launched):
        super().__init__(CPU)
        self.launched = launched
        self.synchronizes = 0
        self.waits = []  # products launched after the awaited check's record
        self.host = set()  # the host copies it handed out (reading them is free)
        self.recorded = []

    def host_buffer(self, shape, dtype):
        buffer = super().host_buffer(shape, dtype)
        self.host.add(buffer.data_ptr())
        return buffer

    def to_host(self, t, into):
        assert into.data_ptr() in self.host, "a check's verdict copied to a buffer not handed out"
        return super().to_host(t, into)

    def record(self):
        event = {"launched": self.launched()}
        self.recorded.append(event)
        return event

    def done(self, event):
        return event.get("waited", False)

    def wait(self, event):
        event["waited"] = True
        self.waits.append(self.launched() - event["launched"])

    def synchronize(self):
        self.synchronizes += 1
        for event in self.recorded:
            event["waited"] = True


class HostReads(torch.overrides.TorchFunctionMode):
    """Every read of a tensor's values by the host (each a full synchronisation on a GPU),
    except of the host copies the engine's waits handed out."""

    READS = {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "cpu",
        "numpy",
        "nonzero",
        "to",
    }

    def __init__(self, allowed):
        super().__init__()
        self.allowed, self.reads = allowed, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in self.READS and first is not None and first.data_ptr() not in self.allowed:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class CountedMatmul:
    def __init__(self, base=torch.matmul):
        self.base, self.calls = base, 0

    def __call__(self, a, b):
        self.calls += 1
        return self.base(a, b)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_window_synchronises_once_and_waits_only_on_checks_well_behind(precision):
    matmul = CountedMatmul()
    waits = CountingWaits(lambda: matmul.calls)
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, matmul)
    plan = BurnPlan(size=64, precisions=(precision,), verify_every=2, verify_lag=2)
    engine = BurnEngine(device, plan, waits=waits)
    assert engine.prepare() == {}
    engine.run_window(precision, 0.0, 0.0, lambda m: None)  # warm-up and one product, untimed
    for _ in range(10):  # a loaded machine may run too few products in one window
        waits.synchronizes, waits.waits = 0, []
        sent = []
        reads = HostReads(waits.host)
        with reads:
            engine.run_window(precision, burn.time.monotonic() + 0.3, 0.0, sent.append)
        (sample,) = sent
        products = sample[4] / (2.0 * 64**3)
        if products >= 12:
            break
    assert products >= 12, "the window should have run a dozen products"
    assert waits.synchronizes == 1  # the window's end, nothing else drains the device
    assert reads.reads == []  # no .item()/.tolist()/.cpu()/nonzero on a device tensor
    # each wait is for a check at least verify_lag x verify_every products old: the device
    # still has those queued behind it
    assert waits.waits and min(waits.waits) >= plan.verify_lag * plan.verify_every
    assert sample[6] == products // 2 + (products % 2)  # every 2nd and the last verified
    assert sample[7] == 0


def test_a_wrong_product_is_reported_a_bounded_number_of_products_later():
    """The check runs behind the GEMMs, but no more than verify_lag checks behind."""
    matmul = CountedMatmul(FlakyMatmul({6}))  # call 6: the 4th product of the window below
    waits = CountingWaits(lambda: matmul.calls)
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, matmul)
    plan = BurnPlan(size=64, precisions=("fp32",), verify_every=1, verify_lag=2)
    engine = BurnEngine(device, plan, waits=waits)
    assert engine.prepare() == {}  # call 1
    seen_at = []

    def send(message):
        if message[0] == "wrong":
            seen_at.append(matmul.calls)

    engine.run_window("fp32", burn.time.monotonic() + 0.3, 0.0, send)  # 2: warm-up, 3...
    assert len(seen_at) == 1
    # wrong at call 6; the re-run is one more call; at most verify_lag products in between
    assert 6 < seen_at[0] <= 6 + plan.verify_lag + 1


# -- verification's share of the device ---------------------------------------------------------
#
# On an H200 the burn ran at 0.94 of a plain matmul loop in fp8 (0.97 in bf16): each check is
# memory-bound work on the GEMMs' stream, about the same device time whatever the precision, so
# one check in 8 products cost the short fp8 products 6 %. The interval is now set at warm-up from
# a timed product and check. No GPU runs here: a stub clock stands in for the CUDA events.


class StubClock(CountingWaits):
    """The engine's waits on a device whose clock the test sets: at warm-up a product takes
    ``product_s`` and a check ``check_s`` (the marks are read in that order)."""

    def __init__(self, launched, product_s, check_s):
        super().__init__(launched)
        self.timed = True
        self.times = iter([0.0, product_s, product_s + check_s])
        self.marks = 0

    def mark(self):
        self.marks += 1
        return next(self.times)

    def seconds(self, start, end):
        return end - start


def windows_with_clock(product_s, check_s, budget=0.01, verify_every=2, products=200):
    """Sample windows of a stand-in timed by a stub clock, until ``products`` have run;
    returns the engine, its waits, and (sample, products in it) per window."""
    matmul = CountedMatmul()
    waits = StubClock(lambda: matmul.calls, product_s, check_s)
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, matmul)
    plan = BurnPlan(size=64, precisions=("fp32",), verify_every=verify_every, verify_budget=budget)
    engine = BurnEngine(device, plan, waits=waits)
    assert engine.prepare() == {}
    sent = []
    while sum(m[4] for m in sent) < products * 2.0 * 64**3 and len(sent) < 100:
        engine.run_window("fp32", burn.time.monotonic() + 0.1, 0.0, sent.append)
    windows = [(Sample(*m[1:]), round(m[4] / (2.0 * 64**3))) for m in sent]
    assert sum(n for _, n in windows) >= products, "the windows should have run enough products"
    return engine, waits, windows


def test_a_check_dearer_than_the_budget_allows_is_run_on_fewer_products():
    # a check costs half a product: at 1 % of the device's time, one product in 50
    engine, waits, windows = windows_with_clock(product_s=1e-3, check_s=0.5e-3)
    assert waits.marks == 3  # one product and one check timed, once per precision
    assert engine.intervals == {"fp32": 50}
    for sample, products in windows:  # every 50th product, and each window's last one
        assert sample.verify_interval == 50
        assert sample.verified == products // 50 + (products % 50 != 0)


def test_a_cheap_check_keeps_the_plans_interval():
    engine, _, windows = windows_with_clock(product_s=1e-3, check_s=1e-6, products=20)
    assert engine.intervals == {"fp32": 2}
    for sample, products in windows:
        assert sample.verify_interval == 2
        assert sample.verified == products // 2 + (products % 2)


def test_without_a_budget_every_verify_every_th_product_is_checked_whatever_it_costs():
    _, waits, windows = windows_with_clock(1e-3, check_s=1.0, budget=None, products=1)
    assert waits.marks == 0 and {s.verify_interval for s, _ in windows} == {2}


def test_a_stand_in_gpu_keeps_the_plans_interval_its_checks_cost_its_modelled_time_nothing():
    engine = engine_with(torch.matmul)  # a stand-in: its GEMM time is modelled from FLOPs
    assert not engine.waits.timed
    sent = []
    engine.run_window("fp32", 0.0, 0.0, sent.append)
    assert Sample(*sent[-1][1:]).verify_interval == 1 == engine.plan.verify_every


@pytest.mark.parametrize(
    "every, budget, product_s, check_s, interval",
    [
        (8, 0.01, 0.89e-3, 0.40e-3, 45),  # an H200's fp8 product and an unbuffered check
        (8, 0.01, 1.67e-3, 0.10e-3, 8),  # bf16 with a cheap check: the plan's
        (8, 0.01, 0.0, 0.40e-3, 8),  # nothing measured: the plan's
        (8, None, 1e-3, 1.0, 8),
        (0, 0.5, 1.0, 0.1, 1),
    ],
)
def test_verify_interval(every, budget, product_s, check_s, interval):
    assert burn.verify_interval(every, budget, product_s, check_s) == interval


@pytest.mark.parametrize("budget", [0, -0.1, 1.5, "1%", float("nan")])
def test_a_verify_budget_outside_zero_to_one_is_refused_with_what_to_fix(budget):
    with pytest.raises(ValueError, match="verify_budget .* above 0 and at most 1"):
        BurnPlan(verify_budget=budget)


def test_checks_reuse_the_host_buffers_made_for_them_and_the_verifiers_own():
    matmul = CountedMatmul()
    waits = CountingWaits(lambda: matmul.calls)
    device = ComputeDevice(ComputeSpec(0, simulated=True), CPU, matmul)
    plan = BurnPlan(size=64, precisions=("fp32",), verify_every=1, verify_lag=2)
    engine = BurnEngine(device, plan, waits=waits)
    assert engine.prepare() == {}
    ring = list(waits.host)
    assert len(ring) == plan.verify_lag + 1  # made once, at preparation
    used = []
    real = waits.to_host
    waits.to_host = lambda t, into: used.append(into.data_ptr()) or real(t, into)
    for _ in range(30):  # windows until a dozen checks (a loaded machine runs few per window)
        engine.run_window("fp32", burn.time.monotonic() + 0.1, 0.0, lambda m: None)
        if len(used) >= 12:
            break
    assert len(used) >= 12 and set(used) == set(ring) == waits.host  # no buffer made since
    # in turn: a buffer comes back only after verify_lag other checks
    assert all(used[i] == used[i + len(ring)] for i in range(len(used) - len(ring)))
    job = engine.jobs["fp32"]
    a, b, c = job.a, job.b, matmul(job.a, job.b)
    verdict = job.verifier.ok_rows(c)
    c[3, 5] += 1e3
    assert job.verifier.ok_rows(c).data_ptr() == verdict.data_ptr()  # no tensor allocated
    assert job.verifier.flagged_rows(c) == [3] and (a, b) == (job.a, job.b)


def test_join_trace_pairs_each_reading_with_the_sample_window_around_it():
    tel = GpuTelemetry(
        t_s=[0.0, 0.5, 1.5, 2.5, 3.5],
        temp_c=[40, 50, 60, None, 61],
        mem_temp_c=[None] * 5,
        power_w=[100, 600, 650, 640, 100],
        sm_clock_mhz=[1980] * 5,
        throttle=[["gpu_idle"], ["sw_power_cap"], None, ["sw_power_cap"], []],
        power_limit_w=700.0,
        slowdown_temp_c=90,
    )
    samples = [
        Sample(0.2, 1.0, "bf16", 2e12, 1.0, 1, 0),  # 2 TFLOP/s over [0.2, 1.0]
        Sample(2.0, 3.0, "bf16", 4e12, 1.0, 1, 0),
    ]  # 4 TFLOP/s over [2.0, 3.0]
    trace = join_trace(tel, samples)
    # before the first window: None; inside: its figure; between windows: the last one held;
    # after the last window: None
    assert trace["tflops"] == [None, 2.0, 2.0, 4.0, None]
    assert trace["temp_c"] == [40, 50, 60, None, 61]
    assert trace["throttle"][2] is None and trace["power_limit_w"] == 700.0
    assert list(trace) == [
        "t_s",
        "tflops",
        "temp_c",
        "power_w",
        "sm_clock_mhz",
        "mem_temp_c",
        "throttle",
        "power_limit_w",
        "slowdown_temp_c",
    ]


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
    sampler = TelemetrySampler(
        backend, [0], interval_s=0.01, t_zero=burn.time.monotonic(), load_hint=backend.load_hint
    )
    sampler.start()
    assert wait_for(lambda: len(sampler.telemetry[0].t_s) >= 2, 10), "no second sample in 10 s"
    tel = sampler.stop()[0]
    assert backend.hints == [([0], True), ([0], False)]
    assert len(tel.t_s) >= 2 and set(tel.temp_c) == {55}
    assert set(tel.mem_temp_c) == {None} and set(tel.power_w) == {None}
    assert tel.throttle[0] == ["sw_power_cap"] and tel.slowdown_temp_c is None
    assert "GpuTimeout" in tel.errors["power"] and "memory_temperature" in tel.errors


@dataclass(frozen=True)
class Fault:
    """Injected into the burn's workers (``BurnPlan.after_sample``): GPU ``gpu``'s worker
    exits with ``code``, hangs or raises once it has sent ``after_samples`` samples. A
    module-level class, so it pickles into the worker processes."""

    gpu: int | None  # None: every GPU's worker
    action: str  # exit | hang | raise
    after_samples: int = 0
    code: int = 7

    def __call__(self, index: int, samples_sent: int) -> None:
        if self.gpu not in (None, index) or samples_sent != self.after_samples:
            return
        if self.action == "exit":
            os._exit(self.code)
        if self.action == "hang":
            time.sleep(3600)
        if self.action == "raise":
            raise RuntimeError("injected failure (burn test fault)")


def tiny_plan(**fault):
    return BurnPlan(
        size=32,
        duration_s=1.0,
        precisions=("fp32",),
        sample_s=0.02,
        verify_every=1000,
        stall_s=3.0,
        startup_timeout_s=120.0,
        after_sample=Fault(**fault) if fault else None,
    )


def sim_specs(n=3):
    return [ComputeSpec(i, simulated=True) for i in range(n)]


def test_a_worker_that_exits_is_an_error_for_that_gpu_only():
    out = run_burn(
        sim_specs(), tiny_plan(gpu=1, action="exit", after_samples=1, code=7), deadline_s=150
    )
    dead = out.workers[1]
    assert dead.failure == "worker_died" and dead.exitcode == 7
    assert "gpu:1" in dead.failure_detail and "code 7" in dead.failure_detail
    for i in (0, 2):
        assert out.workers[i].failure is None and out.workers[i].samples


def test_a_worker_that_raises_reports_its_exception_text():
    out = run_burn(sim_specs(2), tiny_plan(gpu=0, action="raise", after_samples=2), deadline_s=150)
    dead = out.workers[0]
    assert dead.failure == "worker_died" and dead.exitcode == 3
    assert "injected failure" in dead.last_words and "injected failure" in dead.failure_detail
    assert out.workers[1].failure is None


def test_every_worker_failing_alike_is_the_software_stack_held_never_a_gpu_replaced():
    """Every GPU's worker raising the same error at start (a torch without the GPU's
    architecture says "no kernel image is available"): eight worker_died ERRORs, with no
    software marker, had gone drain, reboot, reboot, replace. One GPU's death stays its own."""
    from node_agent.checking.burn_run import worker_failures

    ctx = thermal_ctx()
    everyone = run_burn(sim_specs(3), tiny_plan(gpu=None, action="raise"), deadline_s=150)
    (alike,) = worker_failures(ctx, everyone)
    assert (alike.target, alike.metric, alike.status) == (
        "node",
        "workers_all_failed",
        Status.ERROR,
    )
    assert "injected failure" in alike.detail and len(alike.evidence["per_gpu"]) == 3
    (reason,) = GRADER.grade([alike]).reasons
    assert (reason.rule, reason.remedy is not None) == ("burn-workers-all-failed", True)

    one = run_burn(sim_specs(3), tiny_plan(gpu=1, action="raise"), deadline_s=150)
    (own,) = worker_failures(ctx, one)
    assert (own.target, own.metric) == ("gpu:1", "worker_died")

    # workers that ran and then all stalled say nothing: no error in common, each its own
    stalled = run_burn(
        sim_specs(2), tiny_plan(gpu=None, action="hang", after_samples=1), deadline_s=150
    )
    assert [r.metric for r in worker_failures(ctx, stalled)] == ["worker_stalled"] * 2


def test_a_worker_that_stops_sending_is_killed_as_stalled_and_the_run_ends():
    out = run_burn(sim_specs(2), tiny_plan(gpu=1, action="hang", after_samples=1), deadline_s=150)
    stalled = out.workers[1]
    assert stalled.failure == "worker_stalled" and "3 s" in stalled.failure_detail
    assert stalled.exitcode is not None  # killed, not left behind
    assert out.workers[0].failure is None and out.workers[0].samples


def test_precisions_no_gpu_supports_are_skipped_with_the_reason():
    plan = BurnPlan(
        size=32,
        duration_s=0.3,
        precisions=("fp8", "fp32"),
        sample_s=0.02,
        verify_every=1000,
        stall_s=3.0,
    )
    out = run_burn(sim_specs(1), plan, deadline_s=150)
    assert out.precisions == ["fp32"]
    assert "not supported on the CPU" in out.skipped["fp8"]


# -- thermal findings on a given trace --------------------------------------------------------


def thermal_ctx(scenario_faults=()):
    from node_agent import resources
    from node_agent.checking.context import CheckContext
    from node_agent.hardware.sku import load_skus
    from node_agent.sim.gpu_model import SimGpuBackend
    from node_agent.sim.node import stand_in_ports
    from node_agent.sim.scenario import Fault, Scenario

    config = config_from_dict({})
    sku = load_skus(resources.graders_dir(config))["h100-sxm5-80gb"]
    scenario = Scenario(
        sku=sku.id, gpus=2, source="t", faults=tuple(Fault(**f) for f in scenario_faults)
    )
    gpus = SimGpuBackend(scenario, sku)
    return CheckContext(
        check="thermal_power",
        gpu=gpus,
        kernel_log=None,
        config=config,
        inventory=None,
        sku=sku,
        expected_gpus=2,
        ports=stand_in_ports(scenario, sku, gpus),
    )


def trace(power, tflops, temps=None, throttle=None, clocks=None):
    n = len(power)
    return {
        "t_s": [i * 1.0 for i in range(n)],
        "tflops": tflops,
        "temp_c": temps or [60] * n,
        "power_w": power,
        "sm_clock_mhz": clocks or [1980] * n,
        "mem_temp_c": [50] * n,
        "throttle": throttle or [["sw_power_cap"]] * n,
        "power_limit_w": 700.0,
        "slowdown_temp_c": 90,
    }


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
    braked = findings(
        thermal_ctx(),
        trace(
            [680.0] * 4,
            [1.0] * 4,
            throttle=[
                ["sw_power_cap"],
                ["hw_power_brake_slowdown", "sw_power_cap"],
                ["sw_power_cap"],
                None,
            ],
        ),
    )
    assert braked["throttle"].status.value == "fail"
    assert "hw_power_brake_slowdown in 1 of 3 readings" in braked["throttle"].detail


def test_time_above_slowdown_is_measured_from_the_readings():
    got = findings(thermal_ctx(), trace([680.0] * 5, [1.0] * 5, temps=[70, 91, 92, 80, 70]))
    result = got["temperature_max_c"]
    assert result.status.value == "fail" and result.value == 92
    assert result.evidence["time_above_slowdown_s"] == 2.0


def test_a_trace_without_readings_skips_rather_than_passes():
    empty = {
        k: []
        for k in ("t_s", "tflops", "temp_c", "power_w", "sm_clock_mhz", "mem_temp_c", "throttle")
    }
    got = findings(thermal_ctx(), {**empty, "power_limit_w": None, "slowdown_temp_c": None})
    assert {m: r.status.value for m, r in got.items()} == {
        "temperature_max_c": "skip",
        "power_reached_fraction": "skip",
        "sm_clock_drop": "skip",
        "throttle": "skip",
        "memory_temperature_max_c": "skip",
        "load_trace": "pass",
    }


# -- gpu-validate's burn_vs_plain, per precision ----------------------------------------------


def _gpu_validate_steps():
    import importlib.util
    import sys
    from pathlib import Path

    if "gpu_validate_steps" in sys.modules:  # loaded by the harness's tests already
        return sys.modules["gpu_validate_steps"]
    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_validate_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_validate_steps", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate_steps"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_burn_vs_plain_reports_every_precision_and_the_lowest_ratio():
    """On the CPU at a tiny size (the harness, not the figure: CPU ratios mean nothing)."""
    steps = _gpu_validate_steps()
    step = steps.STEP_BY_NAME["burn_vs_plain"]
    assert set(step.figures) == {"burn_vs_plain_matmul"} | {
        f"burn_vs_plain_matmul_{p}" for p in ("bf16", "fp16", "tf32", "fp32", "fp8")
    }
    got = steps.burn_vs_plain(
        device="cpu",
        precisions=("fp32", "bf16", "fp8"),
        size=64,
        block_s=0.05,
        pairs=2,
        command="c",
    )
    assert got["burn_vs_plain_matmul_fp32"]["value"] > 0
    assert got["burn_vs_plain_matmul_bf16"]["value"] > 0
    fp8 = got["burn_vs_plain_matmul_fp8"]
    assert fp8["value"] is None and fp8["reason"].startswith("not run: fp8 GEMMs are not supported")
    lowest = min(
        got["burn_vs_plain_matmul_fp32"]["value"], got["burn_vs_plain_matmul_bf16"]["value"]
    )
    assert got["burn_vs_plain_matmul"]["value"] == lowest
    assert got["burn_vs_plain_matmul"]["detail"].startswith("the lowest precision's ratio")


def test_burn_vs_plain_names_the_precisions_its_time_box_leaves_out():
    steps = _gpu_validate_steps()
    got = steps.burn_vs_plain(
        device="cpu",
        precisions=("fp32",),
        size=64,
        block_s=0.05,
        pairs=2,
        command="c",
        deadline_s=0.01,
    )
    assert got["burn_vs_plain_matmul_fp32"]["reason"].startswith("not run: the step's time box")
    assert got["burn_vs_plain_matmul"]["value"] is None
    assert "fp32: not run: the step's time box" in got["burn_vs_plain_matmul"]["reason"]


def test_the_burn_check_reports_the_interval_the_engine_verified_at():
    """The engine widens ``verify_every`` to keep checks within ``verify_budget``; the check's
    evidence and detail say how many products one verified one stood for, per precision."""
    from node_agent.checks.gpu_burn import _interval, _intervals_text
    from node_agent.compute.burn import Sample

    plan = BurnPlan(size=64, precisions=("fp8", "bf16"), verify_every=8)
    fp8 = [Sample(0, 1, "fp8", 1.0, 1.0, 2, 0, 71), Sample(1, 2, "fp8", 1.0, 1.0, 2, 0, 71)]
    bf16 = [Sample(2, 3, "bf16", 1.0, 1.0, 3, 0, 38)]
    assert _interval(fp8, plan) == 71 and _interval(bf16, plan) == 38
    assert _interval([Sample(0, 1, "fp8", 1.0, 1.0, 2, 0)], plan) == 8  # none reported
    assert _intervals_text({"fp8": 71, "bf16": 38}, plan) == "71 (fp8), 38 (bf16)"
    assert _intervals_text({"fp8": 8, "bf16": 8}, plan) == "8"


@pytest.mark.parametrize(
    ("share", "limit_w", "status", "words"),
    [
        (0.6, 700.0, Status.FAIL, "below the SKU minimum"),  # the default limit: the GPU's own
        (0.7, 450.0, Status.WARN, "capped below the board's default"),  # 450/700 explains 0.64
        (0.1, 680.0, Status.FAIL, "below the SKU minimum"),  # more than a 3 % cap explains
    ],
)
def test_every_gpu_below_the_sku_minimum_under_a_power_cap_is_the_setting_not_eight_gpus(
    share, limit_w, status, words
):
    """An operator capped every GPU's power (``nvidia-smi -pl 450``, a facility's policy): the
    burn computes below the SKU minimum, which assumes the default limit, on every GPU alike.
    Each was an ERROR, two reboots, then every GPU replaced. A shortfall the cap explains (no
    more than in proportion to it) is a WARN naming it; at the default limit, or further below
    than the cap explains, it is still a finding."""
    from node_agent.checking.context import CheckContext
    from node_agent.checking.ports import Ports
    from node_agent.checks.gpu_burn import _throughput
    from node_agent.compute.burn import BurnOutcome, GpuTelemetry, Sample, WorkerReport
    from node_agent.gpu.absent import AbsentGpuBackend
    from node_agent.hardware.sku import load_skus
    from node_agent.model import Level

    config = config_from_dict({})
    sku = load_skus(shipped_graders_dir())["h100-sxm5-80gb"]
    ctx = CheckContext(
        check="gpu_burn",
        gpu=AbsentGpuBackend("test"),
        kernel_log=None,
        config=config,
        inventory=None,
        sku=sku,
        expected_gpus=8,
        ports=Ports(),  # compute measured on the node's GPUs: the SKU minima apply
    )
    tflops = share * sku.minimum("tflops_bf16_min")
    one_second = [Sample(0, 1, "bf16", tflops * 1e12, 1.0, 1, 0)]
    workers = {i: WorkerReport(i, samples=list(one_second)) for i in range(8)}
    telemetry = {i: GpuTelemetry(power_limit_w=limit_w, power_default_w=700.0) for i in range(8)}
    plan = BurnPlan(size=64, precisions=("bf16",), verify_every=8)
    results = _throughput(ctx, BurnOutcome(plan, workers, ["bf16"], {}, telemetry, 1.0))
    assert [round(r.value / tflops, 3) for r in results] == [1.0] * 8
    assert {r.status for r in results} == {status}
    assert all(words in r.detail for r in results), results[0].detail
    level = load_grader(shipped_graders_dir()).grade(results).level
    assert level is (Level.WARN if status is Status.WARN else Level.ERROR)
