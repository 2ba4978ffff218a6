"""The steps of the GPU proof (bench/gpu_validate.py): what each one measures and how.

Each ``step_*`` function runs in a child process of bench/gpu_validate.py
(``--run-step NAME``), inside that step's time box and process group, and returns its figures
(:func:`figure`). The measuring functions take their device and sizes as arguments, so the
tests run them on the CPU and the simulated node (tests/integration/test_gpu_validate_run.py);
torch and node_agent are imported inside them, so this module itself is standard library only.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PY = "python3"  # how commands are written in the figures (the GPU image's interpreter)

#: figure -> unit, in the order of the table
UNITS = {
    "nvml_contract": "tests passed",
    "pytest_gpu": "tests passed",
    "burn_tflops_bf16": "TFLOP/s",
    "burn_tflops_fp16": "TFLOP/s",
    "burn_tflops_tf32": "TFLOP/s",
    "burn_tflops_fp8": "TFLOP/s",
    "burn_vs_plain_matmul": "ratio",
    "burn_vs_plain_matmul_bf16": "ratio",
    "burn_vs_plain_matmul_fp16": "ratio",
    "burn_vs_plain_matmul_tf32": "ratio",
    "burn_vs_plain_matmul_fp32": "ratio",
    "burn_vs_plain_matmul_fp8": "ratio",
    "hbm_gbps": "GB/s",
    "pcie_h2d_gbps": "GB/s",
    "pcie_d2h_gbps": "GB/s",
    "sdc_probe_overhead_pct": "%",
    "sdc_sm_coverage": "share of SMs",
    "accept_delivery_s": "s",
    "daemon_rss_mb": "MiB",
    "daemon_cpu_pct": "% of one core",
}
BURN_PRECISIONS = ("bf16", "fp16", "tf32", "fp8")
#: the burn: n of the n x n GEMMs (the delivery suite's), seconds per precision
BURN_SIZE, BURN_S_PER_PRECISION = 8192, 6.0
#: burn against plain matmul: every precision the burn runs, blocks of this many seconds,
#: alternating, this many pairs per precision (5 x 3 x 2 x 1 s = 30 s of GEMMs; on an H200 the
#: pairs of 2 s agreed within 0.004, so 1 s blocks lose nothing). Where the step's box leaves
#: less, each precision gets an equal share of what is left, in blocks down to the minimum.
VS_PLAIN_PRECISIONS = ("bf16", "fp16", "tf32", "fp32", "fp8")
VS_PLAIN_BLOCK_S, VS_PLAIN_PAIRS, VS_PLAIN_MIN_BLOCK_S = 1.0, 3, 0.25
#: per precision, beside its blocks: the plain loop's untimed first product, the engine's
#: sampling set-up, the reading back
VS_PLAIN_SLACK_S = 2.0
#: the SDC overhead: pairs of blocks of this many seconds (8 x 3 s "on": 24 ms of probe time at
#: the 0.1 % budget, ten probes or more at ~1.4 ms each), shortened to fit the step's box
SDC_OVERHEAD_PAIRS, SDC_OVERHEAD_BLOCK_S, SDC_OVERHEAD_SETUP_S = 8, 3.0, 25.0
#: the model it trains: GPU-bound, as a data-centre job is. The harness's default (d_model 512,
#: 4 layers, ~11 ms steps on an H200) is bound by the host's kernel launches, and there two
#: blocks *without* the probe differed by -7.6 % to +20.2 % (median +5.6 %, 6 pairs of 2.5 s):
#: the host's jitter, not the probe. A bf16 loop of d_model 2048 and 6 layers (37 ms steps, on
#: an H200, measured earlier) had its pairs agree within 0.3 %; this size is not yet timed
#: through this step.
SDC_OVERHEAD_MODEL = {"d_model": 2048, "heads": 16, "layers": 6}
DAEMON_WINDOW_S = 60.0
SDC_MODULE = "node_agent.sdc.validation"
#: the delivery suite's long durations, shortened so that the whole suite fits in its box here
#: (shipped: burn 300 s, thermal 60 s, sdc 180 s, storage 1G x 20 s per job, DCGM level 3 —
#: 15 to 30 minutes where DCGM is installed). check -> params merged over the suite's.
DELIVERY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gpu_burn": {"duration_s": 30},
    "thermal_power": {"duration_s": 10},
    "sdc": {"duration_s": 15},
    "storage": {"size": "256M", "runtime_s": 3},
    "nccl_allreduce": {"sizes": [1048576, 16777216, 268435456]},
    "dcgm_diag": {"level": 1},
}


@dataclass(frozen=True)
class Step:
    name: str
    figures: tuple[str, ...]
    needs: tuple[str, ...]  # "nvml" (a driver NVML answers on), "cuda" (torch sees a GPU)
    timeout_s: float  # its time box when the budget allows
    min_s: float  # below this it is not started (and later steps keep this much)
    command: str  # what the figures say was run


STEPS = (
    Step(
        "nvml_contract",
        ("nvml_contract",),
        ("nvml",),
        60,
        20,
        f"{PY} -m pytest -q -p no:cacheprovider tests/unit/test_backend_contract.py",
    ),
    Step(
        "pytest_gpu",
        ("pytest_gpu",),
        ("nvml", "cuda"),
        150,
        30,
        f"{PY} -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests",
    ),
    Step(
        "burn",
        tuple(f"burn_tflops_{p}" for p in BURN_PRECISIONS),
        ("cuda",),
        90,
        30,
        f"{PY} bench/gpu_validate.py --only burn  # run_burn, n={BURN_SIZE}, "
        f"{BURN_S_PER_PRECISION:g} s per precision",
    ),
    Step(
        "burn_vs_plain",
        ("burn_vs_plain_matmul",) + tuple(f"burn_vs_plain_matmul_{p}" for p in VS_PLAIN_PRECISIONS),
        ("cuda",),
        80,
        30,
        f"{PY} bench/gpu_validate.py --only burn_vs_plain  # BurnEngine vs torch.matmul, "
        f"{','.join(VS_PLAIN_PRECISIONS)} n={BURN_SIZE}, {VS_PLAIN_PAIRS} x "
        f"{VS_PLAIN_BLOCK_S:g} s pairs each",
    ),
    Step(
        "bandwidth",
        ("hbm_gbps", "pcie_h2d_gbps", "pcie_d2h_gbps"),
        ("nvml", "cuda"),
        90,
        25,
        "node-agent accept --only hbm_bandwidth,pcie_bandwidth --json",
    ),
    Step(
        "sdc_sm_coverage",
        ("sdc_sm_coverage",),
        ("cuda",),
        60,
        15,
        f"{PY} bench/gpu_validate.py --only sdc_sm_coverage  # {SDC_MODULE}",
    ),
    Step(
        "sdc_overhead",
        ("sdc_probe_overhead_pct",),
        ("cuda",),
        100,
        30,
        f"{PY} bench/gpu_validate.py --only sdc_overhead  # {SDC_MODULE}",
    ),
    Step(
        "accept_delivery",
        ("accept_delivery_s",),
        ("nvml", "cuda"),
        180,
        60,
        "node-agent accept --suite <delivery, durations shortened> --json",
    ),
    Step(
        "daemon",
        ("daemon_rss_mb", "daemon_cpu_pct"),
        ("nvml",),
        90,
        75,
        f"node-agent daemon for {DAEMON_WINDOW_S:g} s on real NVML (psutil: RSS, own CPU time)",
    ),
)
STEP_BY_NAME = {s.name: s for s in STEPS}


# -- figures -----------------------------------------------------------------------------------


def figure(
    name: str,
    value: float | None,
    reason: str | None = None,
    command: str = "",
    detail: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One figure; a null value must carry its reason, a number none."""
    if value is not None and not isinstance(value, int):
        value = float(f"{float(value):.6g}")
    elif value is None and not reason:
        reason = "no value was measured and no reason was given (a bug in bench/gpu_validate.py)"
    out = {
        "value": value,
        "unit": UNITS[name],
        "reason": reason if value is None else None,
        "command": command,
    }
    if detail:
        out["detail"] = detail
    out.update(extra)
    return out


# -- the children: one function per step -------------------------------------------------------


def step_probe(box_s: float) -> dict[str, Any]:
    """needs: {"nvml": reason or None, "cuda": reason or None}; machine: what nvidia-smi,
    NVML and torch say (name, driver, CUDA)."""
    machine: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
    }
    machine.update(_nvidia_smi())
    needs: dict[str, Any] = {"nvml": None, "cuda": None}
    try:
        from node_agent.gpu import open_backend

        backend = open_backend()
        try:
            needs["nvml"] = backend.unavailable_reason
            if backend.unavailable_reason is None:
                driver = backend.driver()
                machine.setdefault("driver", driver.driver_version)
                machine.setdefault("cuda", driver.cuda_version)
                if not backend.devices():
                    needs["nvml"] = "NVML loads but lists no GPU"
        finally:
            backend.close()
    except Exception as err:  # noqa: BLE001 - the reason is the figure's
        needs["nvml"] = f"opening NVML through node_agent.gpu failed: {type(err).__name__}: {err}"
    try:
        import torch
    except ImportError as err:
        needs["cuda"] = f"torch is not installed ({err})"
    else:
        machine["torch"] = torch.__version__
        machine["torch_cuda"] = torch.version.cuda
        if torch.version.cuda is None:
            needs["cuda"] = f"torch {torch.__version__} is a CPU-only build: it cannot use CUDA"
        elif not torch.cuda.is_available():
            needs["cuda"] = (
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
            )
        else:
            props = torch.cuda.get_device_properties(0)
            machine.setdefault("gpu", props.name)
            machine["sm_count"] = props.multi_processor_count
            machine["compute_capability"] = f"{props.major}.{props.minor}"
    return {"needs": needs, "machine": machine}


def _nvidia_smi() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"gpu_reason": "nvidia-smi not found"}
    try:
        q = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        header = subprocess.run([smi], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"gpu_reason": f"nvidia-smi failed: {err}"}
    rows = [r.split(", ") for r in q.stdout.strip().splitlines() if r.strip()]
    if q.returncode != 0 or not rows:
        return {"gpu_reason": f"nvidia-smi: {(q.stdout + q.stderr).strip()[:200]}"}
    out: dict[str, Any] = {"gpu": rows[0][0], "gpu_count": len(rows)}
    if len(rows[0]) > 1:
        out["driver"] = rows[0][1]
    m = re.search(r"CUDA Version:\s*([\d.]+)", header.stdout)
    if m:
        out["cuda"] = m.group(1)
    return out


def pytest_counts(junit_xml: Path) -> dict[str, int]:
    """passed/failed/errors/skipped/tests summed over a JUnit XML file's test suites."""
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for s in suites:
        counts["tests"] += int(s.get("tests", 0))
        counts["failed"] += int(s.get("failures", 0))
        counts["errors"] += int(s.get("errors", 0))
        counts["skipped"] += int(s.get("skipped", 0))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def _case_outcomes(junit_xml: Path) -> dict[str, str]:
    """test name -> "passed", "skipped: why", "failed: message" (for the detail)."""
    out = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = case.get("name", "?")
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                word = "skipped" if tag == "skipped" else "failed"
                out[name] = f"{word}: {(el.get('message') or '').strip()[:200]}"
                break
        else:
            out[name] = "passed"
    return out


def _uncollected(junit_xml: Path) -> list[str]:
    """Test modules pytest could not collect (junitxml: an ``error`` "collection failure")."""
    return [
        case.get("name", "?")
        for case in ET.parse(junit_xml).getroot().iter("testcase")
        if any(el.get("message") == "collection failure" for el in case.findall("error"))
    ]


def _pytest_figure(
    name: str,
    command: str,
    args: list[str],
    box_s: float,
    note: Callable[[dict[str, str]], str] | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *args,
        ]
        try:
            proc = subprocess.run(argv, cwd=REPO, timeout=max(5.0, box_s - 10))
        except subprocess.TimeoutExpired:
            return figure(name, None, f"pytest did not finish within {box_s - 10:.0f} s", command)
        if not junit.exists():
            return figure(name, None, f"pytest exited {proc.returncode} without a report", command)
        counts = pytest_counts(junit)
        cases = _case_outcomes(junit)
        uncollected = _uncollected(junit)
    detail = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped of {counts['tests']} (pytest exit {proc.returncode})"
    )
    bad = [f"{n}: {o}" for n, o in cases.items() if o.startswith("failed")]
    if bad:
        detail += "; " + "; ".join(bad[:5])
    if note:
        detail += note(cases)
    if uncollected:  # their tests never ran: a count of the rest would pass for the whole
        return figure(
            name,
            None,
            f"{len(uncollected)} test module(s) could not be collected "
            f"({', '.join(uncollected[:5])}), so their tests never ran; {detail}",
            command,
            counts=counts,
        )
    return figure(name, counts["passed"], None, command, detail, counts=counts)


def step_nvml_contract(box_s: float) -> dict[str, Any]:
    def note(cases: dict[str, str]) -> str:
        real = cases.get("test_nvml_satisfies_the_backend_contract_on_a_gpu_host")
        return f"; the real-NVML contract test: {real or 'not collected'}"

    step = STEP_BY_NAME["nvml_contract"]
    return {
        "nvml_contract": _pytest_figure(
            "nvml_contract", step.command, ["tests/unit/test_backend_contract.py"], box_s, note
        )
    }


def step_pytest_gpu(box_s: float) -> dict[str, Any]:
    step = STEP_BY_NAME["pytest_gpu"]
    return {
        "pytest_gpu": _pytest_figure(
            "pytest_gpu",
            step.command,
            ["-m", "gpu", "--continue-on-collection-errors", "tests"],
            box_s,
        )
    }


def burn_figures(
    spec: Any,
    size: int = BURN_SIZE,
    seconds_each: float = BURN_S_PER_PRECISION,
    deadline_s: float = 80.0,
    precisions: tuple[str, ...] = BURN_PRECISIONS,
    command: str = "",
) -> dict[str, Any]:
    """burn_tflops_<precision>: the median 1-s sample of node_agent.compute.burn.run_burn on
    ``spec``'s device (every product in 8 verified, as the gpu_burn check runs it)."""
    from node_agent.compute.burn import BurnPlan, run_burn

    plan = BurnPlan(
        size=size,
        duration_s=seconds_each * len(precisions),
        precisions=precisions,
        sample_s=min(1.0, seconds_each / 4),
        verify_every=8,
        stall_s=30.0,
        startup_timeout_s=max(10.0, deadline_s / 2),
    )
    out = run_burn([spec], plan, backend=None, sample_interval_s=1.0, deadline_s=deadline_s)
    worker = out.workers[spec.index]
    figures = {}
    for p in precisions:
        name = f"burn_tflops_{p}"
        samples = worker.samples_of(p)
        if p in out.skipped:
            figures[name] = figure(name, None, f"not run: {out.skipped[p]}", command)
        elif worker.failure:
            figures[name] = figure(
                name, None, f"{worker.failure}: {worker.failure_detail}", command
            )
        elif not samples:
            figures[name] = figure(
                name, None, "the burn produced no sample of this precision", command
            )
        else:
            wrong = sum(s.wrong for s in samples)
            tflops = [s.tflops for s in samples]
            detail = (
                f"median of {len(samples)} samples (min {min(tflops):.4g}, max "
                f"{max(tflops):.4g}), n={size}, {sum(s.verified for s in samples)} "
                f"products verified (Freivalds), {wrong} wrong elements; "
                f"{worker.info.get('cuda_name') or worker.info.get('device')}"
            )
            figures[name] = figure(name, worker.median_tflops(p), None, command, detail)
    return figures


def step_burn(box_s: float) -> dict[str, Any]:
    from node_agent.compute.devices import ComputeSpec

    return burn_figures(ComputeSpec(0), deadline_s=box_s - 10, command=STEP_BY_NAME["burn"].command)


def burn_vs_plain(
    device: str = "cuda:0",
    precision: str | None = None,
    size: int = BURN_SIZE,
    block_s: float = VS_PLAIN_BLOCK_S,
    pairs: int = VS_PLAIN_PAIRS,
    command: str = "",
    precisions: tuple[str, ...] = VS_PLAIN_PRECISIONS,
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """burn_vs_plain_matmul_<precision>: the burn engine's TFLOP/s over a bare torch.matmul
    loop's, per precision (``precision`` alone when given), on the same inputs (the engine's
    own A and B), kernel and numerics, alternating blocks in one process (the order flips every
    pair, so drift of clocks and temperature hits both sides alike); the median of the pairs'
    ratios. The plain loop launches back to back, at most 4 products ahead of the device
    (events, never a drain) and synchronises once per block: as fast as the device goes.
    ``burn_vs_plain_matmul``: the lowest of the precisions' ratios (the goal, >= 0.97, holds
    for every precision). A precision the device lacks is null with the reason. With
    ``deadline_s`` (seconds from now) each precision still to run gets an equal share of the
    time left: blocks of ``block_s``, or shorter down to VS_PLAIN_MIN_BLOCK_S; a precision
    the share leaves no time for is null saying so."""
    import torch

    from node_agent.compute.burn import BurnEngine, BurnPlan, numerics
    from node_agent.compute.devices import ComputeDevice, ComputeSpec

    began = time.monotonic()
    wanted = (precision,) if precision else tuple(precisions)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cdev = ComputeDevice(ComputeSpec(dev.index or 0), dev, torch.matmul)
    plan = BurnPlan(size=size, precisions=wanted, sample_s=min(1.0, block_s), verify_every=8)
    engine = BurnEngine(cdev, plan)
    skipped = engine.prepare()
    figures: dict[str, Any] = {}
    measured: dict[str, float] = {}
    details: list[str] = []
    todo = [p for p in wanted if p not in skipped]
    for p in wanted:
        name = f"burn_vs_plain_matmul_{p}"
        if p in skipped:
            figures[name] = figure(name, None, f"not run: {skipped[p]}", command)
            continue
        block = _vs_plain_block(block_s, pairs, deadline_s, time.monotonic() - began, todo)
        todo.remove(p)
        if block is None:
            figures[name] = figure(
                name,
                None,
                f"not run: the step's time box ({deadline_s:g} s) left too little for "
                f"{pairs} pairs of {VS_PLAIN_MIN_BLOCK_S:g} s blocks",
                command,
            )
            continue
        ours, plain = _burn_and_plain(engine, cdev, p, block, pairs, numerics)
        ratios = [a / b for a, b in zip(ours, plain, strict=True)]
        measured[p] = statistics.median(ratios)
        figures[name] = figure(
            name,
            measured[p],
            None,
            command,
            (
                f"{p} n={size}: burn engine median {statistics.median(ours):.4g} TFLOP/s, plain "
                f"matmul median {statistics.median(plain):.4g} TFLOP/s; per-pair ratios "
                f"{', '.join(f'{r:.3f}' for r in ratios)} ({pairs} pairs of {block:g} s, order "
                f"alternating; the engine verifies 1 product in "
                f"{engine.intervals.get(p, plan.verify_every)}, its checks held to "
                f"{plan.verify_budget} of the device's time); device "
                f"{cdev.device}"
            ),
        )
        details.append(f"{p} {measured[p]:.3f}")
    if measured:
        worst = min(measured, key=lambda p: measured[p])
        figures["burn_vs_plain_matmul"] = figure(
            "burn_vs_plain_matmul",
            measured[worst],
            None,
            command,
            f"the lowest precision's ratio ({worst}); "
            + ", ".join(details)
            + "; "
            + str(figures[f"burn_vs_plain_matmul_{worst}"]["detail"]),
        )
    else:
        figures["burn_vs_plain_matmul"] = figure(
            "burn_vs_plain_matmul",
            None,
            "no precision was measured: "
            + "; ".join(f"{p}: {figures[f'burn_vs_plain_matmul_{p}']['reason']}" for p in wanted),
            command,
        )
    return figures


def _vs_plain_block(
    block_s: float, pairs: int, deadline_s: float | None, used_s: float, todo: list[str]
) -> float | None:
    """The block length for the next of the ``todo`` precisions: ``block_s``, or its equal
    share of the time left before ``deadline_s``; None under VS_PLAIN_MIN_BLOCK_S."""
    if deadline_s is None:
        return block_s
    share_s = (deadline_s - used_s) / max(1, len(todo)) - VS_PLAIN_SLACK_S
    block = min(block_s, round(share_s / (2 * pairs), 2))
    return block if block >= VS_PLAIN_MIN_BLOCK_S else None


def _burn_and_plain(
    engine: Any, cdev: Any, precision: str, block_s: float, pairs: int, numerics: Any
) -> tuple[list[float], list[float]]:
    """TFLOP/s of the engine's blocks and of the plain loop's, ``pairs`` of each, alternating."""
    job = engine.jobs[precision]
    m, k = job.a.shape
    n = job.b.shape[1]

    def engine_block() -> float:
        sent: list[tuple] = []
        t0 = time.monotonic()
        engine.run_phase(precision, t0 + block_s, t0, sent.append)
        samples = [s for s in sent if s[0] == "sample"]
        return sum(s[4] for s in samples) / sum(s[5] for s in samples) / 1e12

    def plain_block() -> float:
        with numerics(precision):
            job.matmul(job.a, job.b)  # untimed: kernel choice, as the engine warms up
            cdev.synchronize()
            count, t0 = 0, time.perf_counter()
            behind: list[Any] = []
            while time.perf_counter() - t0 < block_s:
                job.matmul(job.a, job.b)
                count += 1
                # at most 4 products queued ahead (so the block ends on time), never drained
                behind.append(engine.waits.record())
                if len(behind) > 4:
                    engine.waits.wait(behind.pop(0))
            cdev.synchronize()
            elapsed = time.perf_counter() - t0
        return 2.0 * m * k * n * count / elapsed / 1e12

    ours: list[float] = []
    plain: list[float] = []
    for i in range(pairs):
        if i % 2 == 0:
            ours.append(engine_block())
            plain.append(plain_block())
        else:
            plain.append(plain_block())
            ours.append(engine_block())
    return ours, plain


def step_burn_vs_plain(box_s: float) -> dict[str, Any]:
    return burn_vs_plain(command=STEP_BY_NAME["burn_vs_plain"].command, deadline_s=box_s - 5)


def _agent(args: list[str], timeout_s: float, cwd: Path) -> subprocess.CompletedProcess:
    """``node-agent ARGS`` from this source tree, with a private state directory."""
    config = cwd / "config.yaml"
    if not config.exists():
        config.write_text(f"state_dir: {cwd / 'state'}\n")
    argv = [sys.executable, "-m", "node_agent.commands.main", *args, "--config", str(config)]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def _result(report: dict[str, Any], check: str, metric: str) -> dict[str, Any] | None:
    """gpu:0's ``metric`` of ``check``; else the check's node-wide result (the skip or error
    that says why it measured nothing)."""
    results = [r for r in report.get("results", []) if r["check"] == check]
    for r in results:
        if r["metric"] == metric and r["target"] == "gpu:0":
            return r
    return next((r for r in results if r["target"] == "node"), None)


def bandwidth_figures(report: dict[str, Any], command: str) -> dict[str, Any]:
    """hbm_gbps, pcie_h2d_gbps, pcie_d2h_gbps from a report of the agent's own checks."""
    figures = {}
    for name, check, metric in (
        ("hbm_gbps", "hbm_bandwidth", "copy_gbps"),
        ("pcie_h2d_gbps", "pcie_bandwidth", "h2d_gbps"),
        ("pcie_d2h_gbps", "pcie_bandwidth", "d2h_gbps"),
    ):
        r = _result(report, check, metric)
        if r is None:
            figures[name] = figure(
                name, None, f"the report has no {check} {metric} result for gpu:0", command
            )
        elif r.get("value") is None:
            figures[name] = figure(name, None, f"{check} {r['status']}: {r['detail']}", command)
        else:
            ev = r.get("evidence", {})
            detail = (
                f"{check} {metric} ({r['status']}): p90 of {ev.get('reps')} copies, "
                f"median {ev.get('median_gbps')}, {ev.get('size_bytes')} B; {r['detail']}"
            )
            figures[name] = figure(name, r["value"], None, command, detail)
    return figures


def step_bandwidth(box_s: float) -> dict[str, Any]:
    command = STEP_BY_NAME["bandwidth"].command
    with tempfile.TemporaryDirectory() as tmp:
        proc = _agent(
            [
                "accept",
                "--only",
                "hbm_bandwidth,pcie_bandwidth",
                "--json",
                "--out",
                str(Path(tmp) / "reports"),
            ],
            box_s - 10,
            Path(tmp),
        )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        why = f"node-agent accept exited {proc.returncode}: {_tail(proc.stderr)}"
        return {
            n: figure(n, None, why, command) for n in ("hbm_gbps", "pcie_h2d_gbps", "pcie_d2h_gbps")
        }
    return bandwidth_figures(report, command)


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _validation(name: str) -> tuple[Callable[..., Any] | None, str | None]:
    """``node_agent.sdc.validation.<name>``, or why it cannot be had."""
    import importlib

    try:
        module = importlib.import_module(SDC_MODULE)
    except ModuleNotFoundError as err:
        if err.name == SDC_MODULE:
            return None, f"{SDC_MODULE} not available"
        raise
    fn = getattr(module, name, None)
    return (fn, None) if callable(fn) else (None, f"{SDC_MODULE} has no {name}()")


def step_sdc_sm_coverage(box_s: float) -> dict[str, Any]:
    """sdc_sm_coverage: measure_sm_coverage() on the current device (%smid of a whole-GPU
    probe round; it never falls back to the tile model)."""
    name = "sdc_sm_coverage"
    command = f"{PY} -c 'from {SDC_MODULE} import measure_sm_coverage as m; print(m())'"
    fn, why = _validation("measure_sm_coverage")
    if fn is None:
        return {name: figure(name, None, why, command)}
    cov = fn()
    detail = (
        f"{cov.sms_reached} of {cov.sm_count} SMs ran at least one tile of "
        f"{cov.blocks} blocks ({cov.method})" + (f"; {cov.why}" if cov.why else "")
    )
    return {name: figure(name, cov.value, None, command, detail)}


def step_sdc_overhead(box_s: float) -> dict[str, Any]:
    """sdc_probe_overhead_pct: measure_training_overhead() (a transformer of
    SDC_OVERHEAD_MODEL's size trained in alternating blocks without and with SdcProbe.step()
    at the default 0.1 % budget), its blocks sized in seconds to fit the box (SDC_OVERHEAD_*).
    Null only when no probe ran: two identical loops differ by noise alone."""
    name = "sdc_probe_overhead_pct"
    pairs = SDC_OVERHEAD_PAIRS
    block_s = max(0.5, min(SDC_OVERHEAD_BLOCK_S, (box_s - SDC_OVERHEAD_SETUP_S) / (2 * pairs)))
    command = (
        f"{PY} -c 'from {SDC_MODULE} import measure_training_overhead as m; "
        f"print(m(pairs={pairs}, block_s={block_s:g}, "
        + ", ".join(f"{k}={v}" for k, v in SDC_OVERHEAD_MODEL.items())
        + "))'"
    )
    fn, why = _validation("measure_training_overhead")
    if fn is None:
        return {name: figure(name, None, why, command)}
    o = fn(pairs=pairs, block_s=block_s, **SDC_OVERHEAD_MODEL)
    budget_pct = 100 * o.budget_fraction
    seen = (
        f"{o.probes_run} probes in {o.on_s:.1f} s of training with the probe, costing "
        f"{o.probe_cost_ms:.2f} ms ({o.probe_share_percent:.3f} % of that time, "
        + ("within" if o.within_budget else "OVER")
        + f" its {budget_pct:g} % budget); per-pair overheads "
        + ", ".join(f"{p:+.2f} %" for p in o.pair_percents)
        + f"; {o.pairs} pairs of {o.steps_per_block} steps, {o.step_ms_off:.3f} ms/step "
        f"without, {o.step_ms_on:.3f} ms with; verdicts {o.verdicts}; {o.device}"
    )
    if o.probes_run == 0:
        return {name: figure(name, None, f"no probe ran: {seen}", command)}
    return {name: figure(name, o.percent, None, command, f"median over the pairs; {seen}")}


def delivery_suite(path: Path) -> dict[str, Any]:
    """The shipped delivery suite with DELIVERY_OVERRIDES merged in, written to ``path``."""
    import yaml

    suite = yaml.safe_load((REPO / "suites" / "delivery.yaml").read_text())
    for check in suite["checks"]:
        extra = DELIVERY_OVERRIDES.get(check["check"])
        if extra:
            check["params"] = {**(check.get("params") or {}), **extra}
    suite["description"] = (
        "the delivery suite with durations shortened for "
        "bench/gpu_validate.py: " + json.dumps(DELIVERY_OVERRIDES)
    )
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return suite


def step_accept_delivery(box_s: float) -> dict[str, Any]:
    command = STEP_BY_NAME["accept_delivery"].command
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "delivery-gpu-validate.yaml"
        delivery_suite(suite)
        t0 = time.monotonic()
        try:
            proc = _agent(
                ["accept", "--suite", str(suite), "--json", "--out", str(Path(tmp) / "reports")],
                box_s - 10,
                Path(tmp),
            )
        except subprocess.TimeoutExpired:
            return {
                "accept_delivery_s": figure(
                    "accept_delivery_s",
                    None,
                    f"node-agent accept did not finish within {box_s - 10:.0f} s",
                    command,
                )
            }
        seconds = time.monotonic() - t0
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return {
            "accept_delivery_s": figure(
                "accept_delivery_s",
                None,
                f"node-agent accept exited {proc.returncode} without a "
                f"report: {_tail(proc.stderr)}",
                command,
            )
        }
    (
        Path(os.environ.get("GPU_VALIDATE_WORK", tempfile.gettempdir()))
        / "accept_delivery.report.json"
    ).write_text(json.dumps(report, indent=1))
    statuses: dict[str, int] = {}
    for r in report["results"]:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    not_clean = sorted(
        {
            f"{r['check']} {r['status']}"
            for r in report["results"]
            if r["status"] in ("fail", "error")
        }
    )
    detail = (
        f"grade {report['grade']['level']} (exit {proc.returncode}); "
        + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
        + (f"; {', '.join(not_clean)}" if not_clean else "")
        + f"; durations shortened: {json.dumps(DELIVERY_OVERRIDES)}"
    )
    return {"accept_delivery_s": figure("accept_delivery_s", seconds, None, command, detail)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def daemon_figures(
    box_s: float,
    window_s: float = DAEMON_WINDOW_S,
    simulate: str | None = None,
    command: str = "",
    start_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """daemon_rss_mb (the largest RSS seen, sampled every second) and daemon_cpu_pct (its own
    CPU time over the window; the checks it runs in child processes are excluded, as in
    bench/bench_daemon.py) of ``node-agent daemon`` with the shipped periodic suite."""
    import psutil

    names = ("daemon_rss_mb", "daemon_cpu_pct")
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        config = Path(tmp) / "config.yaml"
        config.write_text(
            f"state_dir: {Path(tmp) / 'state'}\ndaemon:\n  listen: 127.0.0.1:{port}\n"
        )
        argv = [
            sys.executable,
            "-m",
            "node_agent.commands.main",
            "daemon",
            "--config",
            str(config),
            "--log-level",
            "WARNING",
        ]
        if simulate:
            argv += ["--simulate", simulate]
        log = Path(tmp) / "daemon.log"
        with open(log, "wb") as err:
            # in this step's process group (run_child cleans it up), not a session of its own
            proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.DEVNULL, stderr=err)
        try:
            t_start = time.monotonic()
            while "node_agent_up" not in (text := _metrics(port)):
                if proc.poll() is not None or time.monotonic() - t_start > start_timeout_s:
                    why = (
                        f"the daemon exited {proc.returncode}"
                        if proc.poll() is not None
                        else f"the daemon did not serve /metrics within {start_timeout_s:g} s"
                    )
                    return {
                        n: figure(n, None, f"{why}: {_tail(log.read_text())}", command)
                        for n in names
                    }
                time.sleep(0.2)
            started_s = time.monotonic() - t_start
            window = max(5.0, min(window_s, box_s - started_s - 20))
            p = psutil.Process(proc.pid)
            cpu0, t0 = p.cpu_times(), time.monotonic()
            rss: list[float] = []
            while time.monotonic() - t0 < window:
                rss.append(p.memory_info().rss / 2**20)
                time.sleep(1.0)
            cpu1, elapsed = p.cpu_times(), time.monotonic() - t0
            text = _metrics(port)
            alive = proc.poll() is None
        finally:
            proc.terminate()  # SIGTERM: the daemon's clean shutdown
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    own = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    gpu_lines = sum(1 for ln in text.splitlines() if ln.startswith("node_agent_gpu_"))
    sim = 'simulated="true"' in text
    note = (
        f"over {elapsed:.0f} s after a {started_s:.1f} s start"
        + (f" (shortened from {window_s:g} s to fit the box)" if window < window_s else "")
        + f"; {len(rss)} samples; /metrics had {gpu_lines} node_agent_gpu_ lines"
        + (
            ", SIMULATED"
            if sim
            else ", real NVML"
            if gpu_lines
            else ", not simulated but no GPU on /metrics (no driver?)"
        )
        + ("" if alive else "; the daemon had exited by the end")
    )
    return {
        "daemon_rss_mb": figure(
            "daemon_rss_mb",
            max(rss),
            None,
            command,
            f"max RSS; median {statistics.median(rss):.1f} MiB; {note}",
        ),
        "daemon_cpu_pct": figure(
            "daemon_cpu_pct",
            100.0 * own / elapsed,
            None,
            command,
            f"own CPU time {own:.2f} s (children excluded); {note}",
        ),
    }


def step_daemon(box_s: float) -> dict[str, Any]:
    return daemon_figures(box_s, command=STEP_BY_NAME["daemon"].command)


STEP_FUNCTIONS: dict[str, Callable[[float], dict[str, Any]]] = {
    "probe": step_probe,
    "nvml_contract": step_nvml_contract,
    "pytest_gpu": step_pytest_gpu,
    "burn": step_burn,
    "burn_vs_plain": step_burn_vs_plain,
    "bandwidth": step_bandwidth,
    "sdc_sm_coverage": step_sdc_sm_coverage,
    "sdc_overhead": step_sdc_overhead,
    "accept_delivery": step_accept_delivery,
    "daemon": step_daemon,
}
