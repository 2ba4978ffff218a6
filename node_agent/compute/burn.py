"""The GPU burn engine behind the ``gpu_burn`` and ``thermal_power`` checks.

**Processes.** One worker process per GPU, all GPUs at once, started from a multiprocessing
``forkserver`` that has imported torch once (never plain ``fork``: CUDA does not survive it; the
server itself never touches CUDA); ``spawn`` would import torch again in every worker (the
cost is in docs/load_tests.md). Each worker rebuilds its device with
:func:`node_agent.compute.devices.open_device`, prepares fixed random inputs for every precision of the
plan, reports ``ready``, and on the parent's ``start`` runs large GEMMs back to back through the
precisions' phases (the burn's duration split evenly, every GPU in the same precision at the
same time). Each worker talks to the parent over its own pipe — not one shared queue, because
a worker killed while writing to a shared queue can leave the queue's lock held and silence
every other worker. Messages (tuples, first item the kind)::

    ("ready", device_info, {precision: skip_reason})
    ("sample", t0_s, t1_s, precision, flops, busy_s, verified, wrong, verify_interval)
    ("wrong", event)            # a wrong-element finding with its confirmation re-run
    ("error", text, traceback)  # the worker's last words before it exits non-zero
    ("done",)

Stand-in GPUs take turns on the CPU: the parent hands out one sample window at a time,
round-robin (``("turn", precision)``, answered by the sample). Eight CPU stand-ins time-slicing
a few cores would measure each other's interference instead of their own speed, and windows of
one round sit close together in time, so a load change on the machine hits every stand-in
alike and a healthy node's sibling ratios stay close (docs/load_tests.md). Real GPUs run free,
all at once.

``t0_s``/``t1_s`` bound the sample window in wall-clock seconds since the burn started (the
monotonic clock is system-wide on Linux, so the parent and the workers share it); ``busy_s``
is the window on the device's clock (:meth:`ComputeDevice.clock`: CPU time over the ``slow``
factor when simulated), so TFLOP/s = flops / busy_s / 1e12. Every message is a heartbeat: a
worker silent for ``stall_s`` is killed and reported ``worker_stalled``; one that exits early
is ``worker_died`` with its exit code and last words; the others' results stand.

**Verification** (:mod:`node_agent.compute.verify`): one product in ``verify_interval`` is
checked on the device in O(n²) by a block Freivalds test, its verdict read back behind an event
without stalling the stream; flagged rows are recomputed in float64 on the CPU against a
rigorous bound and a wrong product is re-run once (confirmed or transient). The host waits for
a check only when more than ``verify_lag`` are in flight, so it stays at most
``verify_lag`` × ``verify_interval`` products ahead and the device always has GEMMs queued; the
end of a sample window is the one full synchronisation. Every such wait goes through
:class:`DeviceWaits`, which tests replace to count them.

**Verification's share of the device is bounded by construction.** A check runs on the GEMMs'
stream and takes about the same device time whatever the precision (on an H200 at n = 8192,
about 0.55 ms, nearly all of it the block sums: :mod:`node_agent.compute.verify`), so at one
check in 8 products it cost the short products most: the burn ran at 0.94 of a plain matmul
loop in fp8 (0.77 ms a product) and 0.97 in bf16 (1.8 ms). At each precision's warm-up,
untimed, the engine times one product and one check on the device (CUDA events, the check
queued behind a product so that only device time counts) and verifies one product in
``max(verify_every, ceil(check_s / (verify_budget × product_s)))`` (:func:`verify_interval`),
so checks take at most ``verify_budget`` (1 %) of the device's time. Every sample reports the
interval it used. A stand-in GPU's GEMM time is modelled from its FLOPs
(:meth:`ComputeDevice.gemm_seconds`), so its checks cost that time nothing and it keeps
``verify_every``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import multiprocessing
import os
import statistics
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING, Any

from node_agent.compute.devices import ComputeDevice, ComputeSpec, open_device
from node_agent.compute.verify import (  # the burn's numerics and device waits, re-exported
    MAX_ROWS_RECOMPUTED,
    PRECISIONS,
    U_ACC,
    U_ACC_BOUND,
    U_OUT,
    DeviceWaits,
    RowCheck,
    Verifier,
    count_wrong,
    fp8_matmul,
    make_inputs,
    numerics,
    verify_interval,
)
from node_agent.gpu.base import GpuBackend, GpuError

if TYPE_CHECKING:
    pass

MAX_EVENTS_KEPT = 20  # wrong-element events kept per GPU (the count keeps going)

__all__ = [
    "MAX_ROWS_RECOMPUTED",
    "PRECISIONS",
    "U_ACC",
    "U_ACC_BOUND",
    "U_OUT",
    "BurnEngine",
    "BurnOutcome",
    "BurnPlan",
    "DeviceWaits",
    "RowCheck",
    "Sample",
    "Verifier",
    "WorkerReport",
    "count_wrong",
    "fp8_matmul",
    "make_inputs",
    "numerics",
    "run_burn",
    "verify_interval",
]


# -- the plan and what comes back --------------------------------------------------------------


@dataclass(frozen=True)
class BurnPlan:
    """What every worker runs. Seconds throughout; ``size`` is the square GEMM's n."""

    size: int = 8192
    duration_s: float = 300.0
    precisions: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")
    max_precisions: int | None = None  # run only the first N precisions every GPU supports
    sample_s: float = 1.0  # length of one throughput sample (also the heartbeat)
    verify_every: int = 8  # verify one product in this many, or in more (verify_budget)
    verify_block: int = 8  # columns per Freivalds block
    verify_lag: int = 2  # verified products whose check may still be in flight
    #: the most of the device's time the checks may take (a fraction; None: no bound, one
    #: product in ``verify_every`` whatever a check costs); see :func:`verify_interval`
    verify_budget: float | None = 0.01
    k_sigma: float = 6.0  # flagging threshold in noise standard deviations
    stall_s: float = 60.0  # no message for this long: the worker is stalled
    startup_timeout_s: float = 180.0  # spawn + import torch + open device + prepare inputs
    seed: int = 0
    #: called in each worker with (GPU index, samples sent so far) before its first sample and
    #: after each one; it must pickle (a module-level function): the workers are processes.
    #: Tests inject one that makes a worker exit, hang or raise.
    after_sample: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        budget = self.verify_budget
        if budget is not None and not (isinstance(budget, int | float) and 0 < budget <= 1):
            raise ValueError(
                f"verify_budget must be the fraction of the device's time verification may "
                f"take, above 0 and at most 1 (0.01 is 1 %), or null for no bound; got "
                f"{budget!r}: fix params.verify_budget in the suite file"
            )


@dataclass(frozen=True)
class Sample:
    t0_s: float
    t1_s: float
    precision: str
    flops: float
    busy_s: float
    verified: int
    wrong: int
    verify_interval: int = 0  # one product in this many was verified (0: not reported)

    @property
    def tflops(self) -> float:
        return self.flops / self.busy_s / 1e12 if self.busy_s > 0 else 0.0


@dataclass
class WorkerReport:
    """Everything one GPU's worker sent, and how it ended."""

    index: int
    info: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    wrong_events: list[dict[str, Any]] = field(default_factory=list)
    wrong_events_total: int = 0
    failure: str | None = None  # "worker_died" | "worker_stalled"
    failure_detail: str = ""
    exitcode: int | None = None
    last_words: str = ""  # the worker's own error text, if it sent one
    traceback: str = ""

    def samples_of(self, precision: str) -> list[Sample]:
        return [s for s in self.samples if s.precision == precision]

    def median_tflops(self, precision: str) -> float | None:
        values = [s.tflops for s in self.samples_of(precision)]
        return statistics.median(values) if values else None


@dataclass
class GpuTelemetry:
    """One GPU's readings through the GPU layer while the burn ran (None: not available)."""

    t_s: list[float] = field(default_factory=list)
    temp_c: list[float | None] = field(default_factory=list)
    mem_temp_c: list[float | None] = field(default_factory=list)
    power_w: list[float | None] = field(default_factory=list)
    sm_clock_mhz: list[float | None] = field(default_factory=list)
    throttle: list[list[str] | None] = field(default_factory=list)
    power_limit_w: float | None = None
    power_default_w: float | None = None  # the board's default limit: below it, a cap is set
    slowdown_temp_c: float | None = None
    errors: dict[str, str] = field(default_factory=dict)  # reading -> first error message

    @property
    def power_cap(self) -> float | None:
        """Enforced / default limit where the enforced one is below the board's default
        (someone capped it: ``nvidia-smi -pl``, a power policy), else None."""
        limit, default = self.power_limit_w, self.power_default_w
        if limit is None or not default or limit >= 0.98 * default:
            return None
        return limit / default


@dataclass
class BurnOutcome:
    plan: BurnPlan
    workers: dict[int, WorkerReport]
    precisions: list[str]  # what ran
    skipped: dict[str, str]  # precisions of the plan that did not run, and why
    telemetry: dict[int, GpuTelemetry]
    duration_s: float

    def trace(self) -> dict[int, dict[str, Any]]:
        """Per GPU, the telemetry joined with the burn's throughput: the ``trace`` that
        gpu_burn hands to thermal_power."""
        return {
            i: join_trace(self.telemetry.get(i), w.samples) for i, w in sorted(self.workers.items())
        }


def join_trace(tel: GpuTelemetry | None, samples: list[Sample]) -> dict[str, Any]:
    """The plotting trace of one GPU: at each telemetry time, the TFLOP/s of the sample window
    that covers it, or of the last window before it while more windows follow (a step plot;
    simulated GPUs compute in turns); None before the first window and after the last."""
    tel = tel or GpuTelemetry()
    ordered = sorted(samples, key=lambda s: s.t1_s)
    ends = [s.t1_s for s in ordered]

    def tflops_at(t: float) -> float | None:
        i = bisect.bisect_left(ends, t)
        if i == len(ordered) or (i == 0 and ordered[0].t0_s > t):
            return None
        covering = ordered[i] if ordered[i].t0_s <= t else ordered[i - 1]
        return float(f"{covering.tflops:.6g}")

    return {
        "t_s": [round(t, 3) for t in tel.t_s],
        "tflops": [tflops_at(t) for t in tel.t_s],
        "temp_c": list(tel.temp_c),
        "power_w": list(tel.power_w),
        "sm_clock_mhz": list(tel.sm_clock_mhz),
        "mem_temp_c": list(tel.mem_temp_c),
        "throttle": [list(r) if r is not None else None for r in tel.throttle],
        "power_limit_w": tel.power_limit_w,
        "slowdown_temp_c": tel.slowdown_temp_c,
    }


def phases(precisions: list[str], duration_s: float) -> list[tuple[str, float, float]]:
    """(precision, start_s, end_s) since the burn's start: the duration split evenly."""
    each = duration_s / max(1, len(precisions))
    return [(p, i * each, (i + 1) * each) for i, p in enumerate(precisions)]


# -- the worker ---------------------------------------------------------------------------------


@dataclass
class _Job:
    a: Any
    b: Any
    matmul: Callable[[Any, Any], Any]
    verifier: Verifier
    #: host buffers for the checks' verdicts, allocated once (pinned on a GPU), used in turn:
    #: ``verify_lag`` + 1 of them, since at most ``verify_lag`` checks are in flight when the
    #: next one is enqueued
    ring: list[Any] = field(default_factory=list)
    checks: int = 0  # checks enqueued so far (the next one's buffer is ring[checks % len])
    b64_cpu: Any = None
    b64_abs_cpu: Any = None


@dataclass
class _Check:
    """One verified product whose check is in flight: the product (kept alive until read),
    the per-row verdict's host copy, and the event that says the copy has landed."""

    c: Any
    ok_host: Any
    event: Any
    t_s: float


class BurnEngine:
    """One device's burn: inputs and verifiers per precision, and the timed GEMM loop.

    Runs in a worker process (or in-process for the benchmark and tests). ``waits`` is where
    the host waits on the device (default :class:`DeviceWaits`)."""

    def __init__(
        self, device: ComputeDevice, plan: BurnPlan, waits: DeviceWaits | None = None
    ) -> None:
        self.device = device
        self.plan = plan
        self.waits = waits or DeviceWaits(device.device)
        self.jobs: dict[str, _Job] = {}
        #: per precision, after its warm-up: one product in this many is verified
        self.intervals: dict[str, int] = {}

    def prepare(self) -> dict[str, str]:
        """Build every supported precision's inputs; returns {precision: why not} for the rest."""
        skipped: dict[str, str] = {}
        for precision in self.plan.precisions:
            if precision not in PRECISIONS:
                skipped[precision] = (
                    f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}"
                )
                continue
            if not self.device.supports(precision):
                where = "the CPU" if self.device.device.type == "cpu" else str(self.device.device)
                skipped[precision] = f"{precision} GEMMs are not supported on {where}" + (
                    " (simulated GPUs compute on the CPU)" if self.device.simulated else ""
                )
                continue
            try:
                self.jobs[precision] = self._job(precision)
            except Exception as err:  # e.g. no fp8 kernel in this torch/cuBLAS
                skipped[precision] = f"{precision} GEMM failed to run: {type(err).__name__}: {err}"
        return skipped

    def _job(self, precision: str) -> _Job:
        import torch

        n = self.plan.size
        a, b = make_inputs(precision, n, self.device.device, self.plan.seed)
        matmul = fp8_matmul(self.device.device) if precision == "fp8" else self.device.matmul
        with numerics(precision):
            c0 = matmul(a, b)
        verifier = Verifier(
            a, b, c0, precision, self.plan.verify_block, self.plan.k_sigma, self.plan.seed
        )
        rows = verifier.shape[0]
        lag = max(1, int(self.plan.verify_lag))
        ring = [self.waits.host_buffer((rows,), torch.bool) for _ in range(lag + 1)]
        self.waits.synchronize()
        return _Job(a, b, matmul, verifier, ring)

    def run_phase(
        self, precision: str, t_end: float, t_zero: float, send: Callable[[tuple[Any, ...]], None]
    ) -> None:
        """GEMMs back to back until monotonic time ``t_end``, one sample message per window."""
        while (now := time.monotonic()) < t_end:
            self.run_window(precision, min(now + self.plan.sample_s, t_end), t_zero, send)

    def run_window(
        self,
        precision: str,
        window_end: float,
        t_zero: float,
        send: Callable[[tuple[Any, ...]], None],
    ) -> None:
        """One sample window: products until monotonic ``window_end``, then one message.

        One product in the precision's interval (:func:`verify_interval`, set at its
        warm-up) is checked on the device, enqueued behind it, and read back when done; the
        host waits for a check only when more than ``verify_lag`` are in flight, so it runs
        at most ``verify_lag`` × that interval products ahead of the device and the device
        always has work queued. The window's end is the one full synchronisation."""
        job = self.jobs[precision]
        m, k, n = job.verifier.shape
        lag = max(1, int(self.plan.verify_lag))
        waits = self.waits
        in_flight: deque[_Check] = deque()
        with numerics(precision):
            if precision not in self.intervals:  # untimed: kernel selection, first touch
                self.intervals[precision] = self._warm_up(job)
            group = self.intervals[precision]
            w0 = time.monotonic()
            c_start = self.device.clock()
            products = verified = wrong = 0
            while True:
                c = job.matmul(job.a, job.b)
                products += 1
                over = time.monotonic() >= window_end
                if over or products % group == 0:  # the window's last product is verified too
                    in_flight.append(self._enqueue(job, c, w0 - t_zero))
                    verified += 1
                if over:
                    break
                while in_flight and (len(in_flight) > lag or waits.done(in_flight[0].event)):
                    wrong += self._settle(precision, job, in_flight.popleft(), send)
            waits.synchronize()
            flops = products * 2.0 * m * k * n
            busy = self.device.gemm_seconds(flops, precision, self.device.clock() - c_start)
            while in_flight:
                wrong += self._settle(precision, job, in_flight.popleft(), send)
        send(
            (
                "sample",
                w0 - t_zero,
                time.monotonic() - t_zero,
                precision,
                flops,
                busy,
                verified,
                wrong,
                group,
            )
        )

    def _warm_up(self, job: _Job) -> int:
        """A first product in the window's numerics (kernel selection, first touch), and the
        verification interval: on a timed device one product and one check are timed, the
        check queued behind the product so that the host's launch time is not counted."""
        waits, plan = self.waits, self.plan
        c = job.matmul(job.a, job.b)
        if plan.verify_budget is None or not waits.timed:
            waits.synchronize()
            return verify_interval(plan.verify_every, None, 0.0, 0.0)
        waits.to_host(job.verifier.ok_rows(c), job.ring[0])  # the check's first launch
        start = waits.mark()
        c = job.matmul(job.a, job.b)
        product = waits.mark()
        waits.to_host(job.verifier.ok_rows(c), job.ring[0])
        check = waits.mark()
        waits.synchronize()
        return verify_interval(
            plan.verify_every,
            plan.verify_budget,
            waits.seconds(start, product),
            waits.seconds(product, check),
        )

    def _enqueue(self, job: _Job, c: Any, t_s: float) -> _Check:
        """Enqueue the check of ``c`` on the device and its verdict's copy to the host, into
        the job's next host buffer (at most ``verify_lag`` checks are in flight, so the
        buffer's last check has been read)."""
        host = job.ring[job.checks % len(job.ring)]
        job.checks += 1
        self.waits.to_host(job.verifier.ok_rows(c), host)
        return _Check(c, host, self.waits.record(), t_s)

    def _settle(
        self, precision: str, job: _Job, check: _Check, send: Callable[[tuple[Any, ...]], None]
    ) -> int:
        """Read one check's verdict (waiting for it if it is not done); recompute flagged rows."""
        if not self.waits.done(check.event):
            self.waits.wait(check.event)
        ok = check.ok_host.tolist()  # a host copy: reading it waits on nothing
        if all(ok):
            return 0
        rows = [i for i, fine in enumerate(ok) if not fine]
        return self._verify_rows(precision, job, check.c, rows, check.t_s, send)

    def _verify_rows(
        self,
        precision: str,
        job: _Job,
        c: Any,
        rows: list[int],
        t_s: float,
        send: Callable[[tuple[Any, ...]], None],
    ) -> int:
        """Flagged rows of ``c``: recompute them on the CPU; re-run the product once when
        wrong (a finding, so this path may wait on the device)."""
        if job.b64_cpu is None:
            job.b64_cpu = job.b.float().double().cpu()
            job.b64_abs_cpu = job.b64_cpu.abs()
        # at most MAX_ROWS_RECOMPUTED rows, spread over the flagged ones (a fault in some
        # rows among many flagged ones is then likely among those recomputed)
        most = MAX_ROWS_RECOMPUTED
        picked = rows if len(rows) <= most else [rows[i * len(rows) // most] for i in range(most)]
        first = count_wrong(job.a, job.b64_cpu, c, picked, precision, b64_abs_cpu=job.b64_abs_cpu)
        if not first.wrong:
            # flagged by the noise statistics, cleared by the exact recomputation: this
            # product's rounding, within the rigorous bound, is the kernel's too
            job.verifier.forgive(c)
            return 0
        with numerics(precision):
            c2 = job.matmul(job.a, job.b)  # re-run once before believing it
        rows2 = job.verifier.flagged_rows(c2)
        second = count_wrong(job.a, job.b64_cpu, c2, rows2, precision, b64_abs_cpu=job.b64_abs_cpu)
        send(
            (
                "wrong",
                {
                    "t_s": round(t_s, 3),
                    "precision": precision,
                    "shape": list(job.verifier.shape),
                    "wrong": first.wrong,
                    "rows_flagged": len(rows),
                    "rows_checked": first.rows_checked,
                    "examples": first.examples,
                    "rerun_wrong": second.wrong,
                    "confirmed": second.wrong > 0,
                },
            )
        )
        return first.wrong


def _after_sample(plan: BurnPlan, index: int, samples_sent: int) -> None:
    if plan.after_sample is not None:
        plan.after_sample(index, samples_sent)


def worker_main(spec: ComputeSpec, plan: BurnPlan, conn: Any) -> None:
    """Entry point of one GPU's worker process (see the module docstring for the messages)."""
    # NVML numbers GPUs in PCI bus order; make CUDA agree before torch initialises it
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sent = 0
    try:
        _after_sample(plan, spec.index, 0)
        device = open_device(spec)
        engine = BurnEngine(device, plan)
        skipped = engine.prepare()
        conn.send(("ready", device.info(), skipped))
        msg = conn.recv()

        def send(message: tuple[Any, ...]) -> None:
            nonlocal sent
            conn.send(message)
            if message[0] == "sample":
                sent += 1
                _after_sample(plan, spec.index, sent)

        if msg[0] == "start":  # free-running: the whole schedule
            _, t_zero, schedule = msg
            for precision, _start, end in schedule:
                if precision in engine.jobs:
                    engine.run_phase(precision, t_zero + end, t_zero, send)
        elif msg[0] == "turns":  # one window per ("turn", precision) until ("end",)
            t_zero = msg[1]
            while (msg := conn.recv())[0] == "turn":
                engine.run_window(msg[1], time.monotonic() + plan.sample_s, t_zero, send)
        else:
            return
        conn.send(("done",))
    except BaseException as err:  # noqa: BLE001 - tell the parent, then exit non-zero
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)))
        os._exit(3)
    # Everything is said (pipe writes are synchronous); skip the interpreter's and torch's
    # teardown, which costs seconds per worker on a loaded machine.
    os._exit(0)


# -- telemetry in the parent ----------------------------------------------------------------------


def _reading(tel: GpuTelemetry, name: str, query: Callable[[], Any]) -> Any:
    """A reading's value, or None (first error message kept): never raises."""
    try:
        return query()
    except GpuError as err:
        tel.errors.setdefault(name, f"{type(err).__name__}: {err}")
        return None


class TelemetrySampler:
    """Reads each GPU through the GPU layer every ``interval_s`` while the burn runs.

    ``start()`` tells ``load_hint`` the load started (a stand-in node models its readings
    under load from it; on real GPUs it does nothing) and takes the first reading at once;
    ``stop()`` ends it and returns the readings. NotSupported, GpuTimeout and
    every other GPU-layer error make that reading None, never a crash; a sampler stuck in a
    hung driver call is abandoned after ``stop()`` waits a bounded time."""

    def __init__(
        self,
        backend: GpuBackend | None,
        indices: list[int],
        interval_s: float,
        t_zero: float,
        load_hint: Callable[[list[int], bool], None] | None = None,
    ) -> None:
        self.backend = backend
        self.load_hint = load_hint
        self.indices = indices
        self.interval_s = max(0.01, interval_s)
        self.t_zero = t_zero
        self.telemetry = {i: GpuTelemetry() for i in indices}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="burn-telemetry", daemon=True)
        self._devices: dict[int, Any] = {}

    def start(self) -> None:
        if self.backend is not None:
            self._devices = {d.index: d for d in self.backend.devices() if d.index in self.indices}
        if self.load_hint is not None:
            self.load_hint(self.indices, True)
        self._thread.start()

    def _loop(self) -> None:
        for index, dev in self._devices.items():
            tel = self.telemetry[index]
            limits = _reading(tel, "temperature_thresholds", dev.temperature_thresholds)
            tel.slowdown_temp_c = limits.slowdown_c if limits else None
        while True:
            self.sample_once()
            if self._stop.wait(self.interval_s):
                return

    def sample_once(self) -> None:
        for index, dev in self._devices.items():
            tel = self.telemetry[index]
            t = time.monotonic() - self.t_zero
            temp = _reading(tel, "temperature", dev.temperature_c)
            mem = _reading(tel, "memory_temperature", dev.memory_temperature_c)
            power = _reading(tel, "power", dev.power)
            clocks = _reading(tel, "clocks", dev.clocks)
            throttle = _reading(tel, "throttle_reasons", dev.throttle_reasons)
            with self._lock:
                tel.t_s.append(t)
                tel.temp_c.append(temp)
                tel.mem_temp_c.append(mem)
                tel.power_w.append(power.usage_w if power else None)
                tel.sm_clock_mhz.append(clocks.sm_mhz if clocks else None)
                tel.throttle.append(sorted(throttle) if throttle is not None else None)
                if power and power.enforced_limit_w is not None:
                    tel.power_limit_w = power.enforced_limit_w
                if power and power.default_limit_w is not None:
                    tel.power_default_w = power.default_limit_w

    def stop(self, wait_s: float = 15.0) -> dict[int, GpuTelemetry]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(wait_s)
        if self.load_hint is not None:
            self.load_hint(self.indices, False)
        with self._lock:
            return {i: _copy(t) for i, t in self.telemetry.items()}


def _copy(tel: GpuTelemetry) -> GpuTelemetry:
    return GpuTelemetry(
        list(tel.t_s),
        list(tel.temp_c),
        list(tel.mem_temp_c),
        list(tel.power_w),
        list(tel.sm_clock_mhz),
        list(tel.throttle),
        tel.power_limit_w,
        tel.power_default_w,
        tel.slowdown_temp_c,
        dict(tel.errors),
    )


# -- the supervisor in the parent -----------------------------------------------------------------


@dataclass
class _Handle:
    report: WorkerReport
    proc: Any
    conn: Any
    state: str = "starting"  # starting | ready | running | done | failed
    last_s: float = 0.0


def run_burn(
    specs: list[ComputeSpec],
    plan: BurnPlan,
    backend: GpuBackend | None = None,
    sample_interval_s: float = 1.0,
    deadline_s: float | None = None,
    load_hint: Callable[[list[int], bool], None] | None = None,
) -> BurnOutcome:
    """Burn every spec's device at once; always returns, within ``deadline_s`` (seconds from
    now) plus the time to kill stragglers.

    A worker that dies or stalls is killed and reported in its :class:`WorkerReport`; the
    others run on. Telemetry is read through ``backend`` while the GEMMs run; ``load_hint``
    (the check's port: a stand-in node models its readings under load) hears when the load
    starts and stops.
    """
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["torch", "node_agent.compute.devices"])
    in_turns = any(spec.simulated for spec in specs)
    began = time.monotonic()
    deadline = began + deadline_s if deadline_s is not None else math.inf
    handles: dict[int, _Handle] = {}
    telemetry: dict[int, GpuTelemetry] = {}
    precisions: list[str] = []
    skipped: dict[str, str] = {}
    try:
        for spec in specs:
            parent, child = mp.Pipe()
            proc = mp.Process(
                target=worker_main,
                args=(spec, plan, child),
                daemon=True,
                name=f"node-agent-burn-gpu{spec.index}",
            )
            proc.start()
            child.close()
            handles[spec.index] = _Handle(WorkerReport(spec.index), proc, parent, last_s=began)
        startup_end = min(deadline, began + plan.startup_timeout_s)
        _supervise(
            handles,
            plan,
            until=startup_end,
            waiting_for="ready",
            stall_detail=f"did not get ready within {plan.startup_timeout_s:g} s "
            "(spawn, import torch, open the device, prepare inputs)",
        )
        ready = [h for h in handles.values() if h.state == "ready"]
        precisions, skipped = _agree(plan, [h.report for h in ready])
        if ready and precisions:
            t_zero = time.monotonic() + 0.05
            schedule = phases(precisions, plan.duration_s)
            for h in ready:
                h.conn.send(("turns", t_zero) if in_turns else ("start", t_zero, schedule))
                h.state, h.last_s = "running", time.monotonic()
            sampler = TelemetrySampler(
                backend, [h.report.index for h in ready], sample_interval_s, t_zero, load_hint
            )
            sampler.start()
            stall_detail = (
                f"sent nothing for {plan.stall_s:g} s (a hung GPU, driver or kernel) and was killed"
            )
            try:
                if in_turns:
                    _hand_out_turns(handles, plan, t_zero, schedule, deadline, stall_detail)
                _supervise(
                    handles, plan, until=deadline, waiting_for="done", stall_detail=stall_detail
                )
            finally:
                telemetry = sampler.stop()
    finally:
        _shutdown(handles)
    return BurnOutcome(
        plan,
        {i: h.report for i, h in handles.items()},
        precisions,
        skipped,
        telemetry,
        time.monotonic() - began,
    )


def _agree(plan: BurnPlan, reports: list[WorkerReport]) -> tuple[list[str], dict[str, str]]:
    """The plan's precisions every ready worker supports (first ``max_precisions`` of them)."""
    run: list[str] = []
    skipped: dict[str, str] = {}
    for precision in plan.precisions:
        why = next((r.skipped[precision] for r in reports if precision in r.skipped), None)
        if why is not None:
            skipped[precision] = why
        elif plan.max_precisions is None or len(run) < plan.max_precisions:
            run.append(precision)
    if not reports:
        return [], {}
    return run, skipped


def _supervise(
    handles: dict[int, _Handle], plan: BurnPlan, until: float, waiting_for: str, stall_detail: str
) -> None:
    """Read messages until every live worker reached ``waiting_for`` ("ready" or "done"),
    killing the ones that die, stall, or are still going at ``until``."""
    target_states = {"ready": {"ready"}, "done": {"done"}}[waiting_for]
    while True:
        live = [h for h in handles.values() if h.state not in target_states | {"failed", "done"}]
        if not live:
            return
        now = time.monotonic()
        for h in live:
            stalled = (now - h.last_s > plan.stall_s) if waiting_for == "done" else False
            if stalled or now >= until:
                _fail(
                    h,
                    "worker_stalled",
                    f"the burn worker of gpu:{h.report.index} " + stall_detail,
                    kill=True,
                )
        live = [h for h in live if h.state != "failed"]
        if not live:
            return
        waitables = [h.conn for h in live] + [h.proc.sentinel for h in live]
        for obj in wait_any(waitables, timeout=0.2):
            h = next(x for x in live if obj is x.conn or obj == x.proc.sentinel)
            _drain(h)
            if not h.proc.is_alive() and h.state not in ("done", "failed"):
                _died(h)


def _hand_out_turns(
    handles: dict[int, _Handle],
    plan: BurnPlan,
    t_zero: float,
    schedule: list[tuple[str, float, float]],
    deadline: float,
    stall_detail: str,
) -> None:
    """Simulated GPUs: one sample window per worker in turn, round-robin, through every
    phase; then ("end",). A worker that dies or does not answer its turn within ``stall_s``
    is failed and skipped; the others go on."""
    for precision, _start, end in schedule:
        while time.monotonic() < min(t_zero + end, deadline):
            running = [h for h in handles.values() if h.state == "running"]
            if not running:
                return
            for h in running:
                if time.monotonic() >= min(t_zero + end, deadline):
                    break
                before = len(h.report.samples)
                try:
                    h.conn.send(("turn", precision))
                except OSError:
                    pass  # its death shows below
                h.last_s = time.monotonic()
                while len(h.report.samples) == before and h.state == "running":
                    _supervise_one(h, plan, deadline, stall_detail)
    for h in handles.values():
        if h.state == "running":
            with contextlib.suppress(OSError):
                h.conn.send(("end",))
            h.last_s = time.monotonic()


def _supervise_one(h: _Handle, plan: BurnPlan, deadline: float, stall_detail: str) -> None:
    """Wait briefly for one worker's messages; fail it when it died or stalled."""
    now = time.monotonic()
    if now - h.last_s > plan.stall_s or now >= deadline:
        _fail(
            h,
            "worker_stalled",
            f"the burn worker of gpu:{h.report.index} " + stall_detail,
            kill=True,
        )
        return
    wait_any([h.conn, h.proc.sentinel], timeout=0.2)
    _drain(h)
    if not h.proc.is_alive() and h.state not in ("done", "failed"):
        _died(h)


def _died(h: _Handle) -> None:
    _drain(h)
    h.proc.join(1)
    said = f": {h.report.last_words}" if h.report.last_words else ""
    _fail(
        h,
        "worker_died",
        f"the burn worker of gpu:{h.report.index} exited with code {h.proc.exitcode}{said}",
        kill=False,
    )


def _drain(h: _Handle) -> None:
    try:
        while h.conn.poll():
            _handle(h, h.conn.recv())
    except (EOFError, OSError):
        pass


def _handle(h: _Handle, msg: tuple[Any, ...]) -> None:
    h.last_s = time.monotonic()
    kind, rep = msg[0], h.report
    if kind == "ready":
        rep.info, rep.skipped = msg[1], dict(msg[2])
        h.state = "ready"
    elif kind == "sample":
        rep.samples.append(Sample(*msg[1:]))
    elif kind == "wrong":
        rep.wrong_events_total += 1
        if len(rep.wrong_events) < MAX_EVENTS_KEPT:
            rep.wrong_events.append(msg[1])
    elif kind == "error":
        rep.last_words, rep.traceback = msg[1], msg[2]
    elif kind == "done":
        h.state = "done"


def _fail(h: _Handle, metric: str, detail: str, kill: bool) -> None:
    if kill and h.proc.is_alive():
        h.proc.kill()
        h.proc.join(5)
    h.state = "failed"
    h.report.failure, h.report.failure_detail = metric, detail
    h.report.exitcode = h.proc.exitcode


def _shutdown(handles: dict[int, _Handle]) -> None:
    """Stop every worker still around: a polite stop, then SIGKILL; bounded waits."""
    for h in handles.values():
        if h.proc.is_alive() and h.state in ("starting", "ready"):
            with contextlib.suppress(OSError, ValueError):
                h.conn.send(("stop",))
    for h in handles.values():
        h.proc.join(2 if h.state == "done" else 0.5)
        if h.proc.is_alive():
            h.proc.kill()
            h.proc.join(5)
        if h.report.exitcode is None:
            h.report.exitcode = h.proc.exitcode
        with contextlib.suppress(OSError):
            h.conn.close()
