"""The GPU proof in one command: every figure the project claims for a GPU, measured on one.

    make gpu-validate              # scripts/gpu-validate: the wheels in .whl/, then this file
    python3 bench/gpu_validate.py [--out DIR] [--budget-s S] [--only STEP,...] [--doc PATH]
    python3 bench/gpu_validate.py --from FIGURES_JSON [--doc docs/benchmarks.md]

Runs these steps in order, each in its own process with its own time box, and writes
``out/gpu-validate/figures.json``, ``figures.md`` (the table for docs/benchmarks.md, "GPU
proof") and ``log.txt`` (every step's output):

============================  ===============================================================
step                          figures
============================  ===============================================================
``nvml_contract``             ``nvml_contract``: tests/unit/test_backend_contract.py on the
                              real driver (counts)
``pytest_gpu``                ``pytest_gpu``: ``pytest -m gpu`` (counts)
``burn``                      ``burn_tflops_{bf16,fp16,tf32,fp8}`` through
                              node_agent.compute.burn (fp8 where the GPU has it)
``burn_vs_plain``             ``burn_vs_plain_matmul``: the burn engine against a bare
                              ``torch.matmul`` loop of the same shapes, interleaved, as a ratio
``bandwidth``                 ``hbm_gbps``, ``pcie_h2d_gbps``, ``pcie_d2h_gbps``: the agent's
                              own checks (``node-agent accept --only ...``)
``sdc_sm_coverage``,          from node_agent.sdc.validation (the SDC wing's own measurements:
``sdc_overhead``              %smid coverage, SdcProbe.step() overhead in a training loop)
``accept_delivery``           ``accept_delivery_s``: the delivery suite end to end (durations
                              shortened to fit, see DELIVERY_OVERRIDES)
``daemon``                    ``daemon_rss_mb``, ``daemon_cpu_pct``: ``node-agent daemon`` for
                              60 s on real NVML, measured with psutil
============================  ===============================================================

Every figure is ``{"value": number | null, "unit": str, "reason": str | null, "command": str}``
(optionally ``detail``, a sentence, and ``counts`` for the pytest figures); ``reason`` says why
a value is null and is null otherwise. A step that cannot run here (no driver, no CUDA, a
module missing) is not started and its figures say why; a step that fails or outlives its time
box is killed with its whole process group and its figures carry the error; the run goes on.
The whole run is held to ``--budget-s`` (510 s): each step's box is cut so that the steps after
it keep their minimum, which keeps ``make gpu-validate`` under 9 minutes on one H100 (the GPU
machine takes commands of at most 10). The command exits 0 whenever it wrote the figures, so
on a host without a GPU it is a CI-safe no-op that explains every null.

This file is its own child: ``--run-step NAME --result FILE`` runs one step and writes its
figures as JSON. The parent uses only the standard library, so it reports even where the
agent's dependencies are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "node-agent.gpu-validate/1"
#: the steps' whole budget: with the wheel install and the writing it stays under 9 minutes
#: (the GPU machine's commands end at 10: /work/.library/device/README.md, "Limits")
DEFAULT_BUDGET_S = 510.0
PROBE_TIMEOUT_S = 60.0
#: what killing a step past its box may take (SIGTERM, 2 s, SIGKILL, the reaping): counted
#: against the budget for every step, so a run of time-outs still ends inside it
KILL_GRACE_S = 4.0
LOG_TAIL_BYTES = 60_000  # of each step's output kept in log.txt
PY = "python3"  # how commands are written in the figures (the GPU image's interpreter)

#: figure -> unit, in the order of the table
UNITS = {
    "nvml_contract": "tests passed", "pytest_gpu": "tests passed",
    "burn_tflops_bf16": "TFLOP/s", "burn_tflops_fp16": "TFLOP/s",
    "burn_tflops_tf32": "TFLOP/s", "burn_tflops_fp8": "TFLOP/s",
    "burn_vs_plain_matmul": "ratio", "hbm_gbps": "GB/s", "pcie_h2d_gbps": "GB/s",
    "pcie_d2h_gbps": "GB/s", "sdc_probe_overhead_pct": "%", "sdc_sm_coverage": "share of SMs",
    "accept_delivery_s": "s", "daemon_rss_mb": "MiB", "daemon_cpu_pct": "% of one core",
}
BURN_PRECISIONS = ("bf16", "fp16", "tf32", "fp8")
#: the burn: n of the n x n GEMMs (the delivery suite's), seconds per precision
BURN_SIZE, BURN_S_PER_PRECISION = 8192, 6.0
#: burn against plain matmul: bf16 blocks of this many seconds, alternating, this many pairs
VS_PLAIN_PRECISION, VS_PLAIN_BLOCK_S, VS_PLAIN_PAIRS = "bf16", 2.5, 4
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
    needs: tuple[str, ...]   # "nvml" (a driver NVML answers on), "cuda" (torch sees a GPU)
    timeout_s: float         # its time box when the budget allows
    min_s: float             # below this it is not started (and later steps keep this much)
    command: str             # what the figures say was run


STEPS = (
    Step("nvml_contract", ("nvml_contract",), ("nvml",), 60, 20,
         f"{PY} -m pytest -q -p no:cacheprovider tests/unit/test_backend_contract.py"),
    Step("pytest_gpu", ("pytest_gpu",), ("nvml", "cuda"), 150, 30,
         f"{PY} -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests"),
    Step("burn", tuple(f"burn_tflops_{p}" for p in BURN_PRECISIONS), ("cuda",), 90, 30,
         f"{PY} bench/gpu_validate.py --only burn  # run_burn, n={BURN_SIZE}, "
         f"{BURN_S_PER_PRECISION:g} s per precision"),
    Step("burn_vs_plain", ("burn_vs_plain_matmul",), ("cuda",), 60, 20,
         f"{PY} bench/gpu_validate.py --only burn_vs_plain  # BurnEngine vs torch.matmul, "
         f"{VS_PLAIN_PRECISION} n={BURN_SIZE}, {VS_PLAIN_PAIRS} x {VS_PLAIN_BLOCK_S:g} s pairs"),
    Step("bandwidth", ("hbm_gbps", "pcie_h2d_gbps", "pcie_d2h_gbps"), ("nvml", "cuda"), 90, 25,
         "node-agent accept --only hbm_bandwidth,pcie_bandwidth --json"),
    Step("sdc_sm_coverage", ("sdc_sm_coverage",), ("cuda",), 60, 15,
         f"{PY} bench/gpu_validate.py --only sdc_sm_coverage  # {SDC_MODULE}"),
    Step("sdc_overhead", ("sdc_probe_overhead_pct",), ("cuda",), 90, 30,
         f"{PY} bench/gpu_validate.py --only sdc_overhead  # {SDC_MODULE}"),
    Step("accept_delivery", ("accept_delivery_s",), ("nvml", "cuda"), 180, 60,
         "node-agent accept --suite <delivery, durations shortened> --json"),
    Step("daemon", ("daemon_rss_mb", "daemon_cpu_pct"), ("nvml",), 90, 75,
         f"node-agent daemon for {DAEMON_WINDOW_S:g} s on real NVML (psutil: RSS, own CPU time)"),
)
STEP_BY_NAME = {s.name: s for s in STEPS}


# -- figures -----------------------------------------------------------------------------------


def figure(name: str, value: float | None, reason: str | None = None, command: str = "",
           detail: str | None = None, **extra: Any) -> dict[str, Any]:
    """One figure; a null value must carry its reason, a number none."""
    if value is not None and not isinstance(value, int):
        value = float(f"{float(value):.6g}")
    elif value is None and not reason:
        reason = "no value was measured and no reason was given (a bug in bench/gpu_validate.py)"
    out = {"value": value, "unit": UNITS[name], "reason": reason if value is None else None,
           "command": command}
    if detail:
        out["detail"] = detail
    out.update(extra)
    return out


def check_figures(figures: dict[str, Any]) -> list[str]:
    """What is wrong with a figures mapping (empty when every figure is well formed)."""
    problems = [f"missing figure {n}" for n in UNITS if n not in figures]
    for name, f in figures.items():
        if name not in UNITS:
            problems.append(f"unknown figure {name}")
            continue
        for key in ("value", "unit", "reason", "command"):
            if key not in f:
                problems.append(f"{name}: no {key!r}")
        value, reason = f.get("value"), f.get("reason")
        if value is None and not (isinstance(reason, str) and reason.strip()):
            problems.append(f"{name}: null without a reason")
        if value is not None and not isinstance(value, (int, float)):
            problems.append(f"{name}: value {value!r} is not a number")
        if value is not None and reason is not None:
            problems.append(f"{name}: a value and a reason")
    return problems


# -- the parent: probe, run each step in its box, write the figures -----------------------------


@dataclass
class StepOutcome:
    name: str
    outcome: str           # ok | failed | timeout | not-run
    seconds: float
    box_s: float | None
    note: str = ""


#: the working tree's agent, importable without installing it (see source_overlay)
_OVERLAY: Path | None = None


def source_overlay(work: Path) -> Path:
    """A directory whose ``node_agent`` is this working tree's, laid out as an install lays it.

    pyproject.toml ships suites/ and graders/ as the packages ``node_agent.suites`` and
    ``node_agent.graders``; in the tree they sit beside node_agent/, so the agent run straight
    from the tree (PYTHONPATH, as on the GPU machine, where nothing is pip-installed) would not
    find them. The overlay is symbolic links only: node_agent/'s entries and those two."""
    pkg = work / "src" / "node_agent"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (REPO / "node_agent").iterdir():
        if entry.name != "__pycache__" and not (pkg / entry.name).is_symlink():
            (pkg / entry.name).symlink_to(entry)
    for name in ("suites", "graders"):
        if not (pkg / name).is_symlink():
            (pkg / name).symlink_to(REPO / name)
    return pkg.parent


def _child_env() -> dict[str, str]:
    """The steps' environment: this tree's agent first on the path (the overlay, else the tree
    itself last), unbuffered output, CUDA numbering GPUs as NVML does."""
    env = dict(os.environ)
    parts = [str(_OVERLAY)] if _OVERLAY else []
    parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # NVML's order (the agent's convention)
    return env


def run_child(argv: list[str], timeout_s: float, log_path: Path,
              env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``argv`` in its own process group with output to ``log_path``; on the deadline the
    whole group is killed (SIGTERM, then SIGKILL after 5 s), and whatever of the group is still
    there when the leader exits on its own (burn workers, a forkserver, a test's helpers) too.
    The steps start their own subprocesses in this group, never in a new session, so that this
    reaches them. Returns (exit code or None when timed out, the last line it printed)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env or _child_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(proc)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished step
    return code, _last_line(log_path)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            if sig == signal.SIGTERM:  # the leader is gone; make sure its group is too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4000))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_step_child(step: Step, box_s: float, work: Path,
                   argv: list[str] | None = None) -> tuple[dict[str, Any], StepOutcome]:
    """Run one step in a child within ``box_s``; its figures, every one filled or explained."""
    result_path = work / f"{step.name}.result.json"
    log_path = work / f"{step.name}.log"
    result_path.unlink(missing_ok=True)
    argv = argv or [sys.executable, str(Path(__file__).resolve()), "--run-step", step.name,
                    "--result", str(result_path), "--box-s", f"{box_s:.1f}"]
    t0 = time.monotonic()
    code, last = run_child(argv, box_s, log_path)
    seconds = time.monotonic() - t0
    got: dict[str, Any] = {}
    error = None
    if result_path.exists():
        try:
            data = json.loads(result_path.read_text())
            got, error = data.get("figures", {}), data.get("error")
        except (OSError, ValueError) as err:
            error = f"unreadable result file: {err}"
    if code is None:
        why, outcome = (f"timed out after {box_s:.0f} s (the step's time box) and was killed; "
                        f"last output: {last or 'none'}"), "timeout"
    elif error:
        why, outcome = f"step failed: {error}", "failed"
    elif code != 0:
        why, outcome = f"step failed (exit {code}): {last or 'no output'}", "failed"
    else:
        why, outcome = f"the step reported no value for it (last output: {last or 'none'})", "ok"
    figures = {}
    for name in step.figures:
        f = got.get(name)
        if isinstance(f, dict) and (f.get("value") is not None or f.get("reason")):
            figures[name] = figure(name, f.get("value"), f.get("reason"),
                                   f.get("command") or step.command, f.get("detail"),
                                   **({"counts": f["counts"]} if "counts" in f else {}))
        else:
            figures[name] = figure(name, None, why, step.command)
    note = "" if outcome == "ok" else why
    return figures, StepOutcome(step.name, outcome, round(seconds, 1), round(box_s, 1), note)


def time_box(step: Step, later: list[Step], left_s: float) -> float | None:
    """The step's time box: its own ``timeout_s``, cut so that the steps after it keep their
    ``min_s`` of the ``left_s`` seconds left (each step, this one too, also keeps KILL_GRACE_S
    for being killed at its box); None when less than its own ``min_s`` remains."""
    box = min(step.timeout_s,
              left_s - sum(s.min_s for s in later) - KILL_GRACE_S * (len(later) + 1))
    return box if box >= step.min_s else None


def unmet_reason(step: Step, env: dict[str, Any]) -> str | None:
    """Why ``step`` cannot run on this host (None: it can)."""
    if step.name in ("sdc_sm_coverage", "sdc_overhead") \
            and not (REPO / "node_agent" / "sdc" / "validation.py").exists():
        return f"{SDC_MODULE} not available"
    for need in step.needs:
        why = env.get(need)
        if why:
            return f"no GPU here: {why}"
    return None


def probe(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(needs -> reason or None, machine) from a child, so a hung driver cannot hang us."""
    path = work / "probe.result.json"
    code, last = run_child([sys.executable, str(Path(__file__).resolve()), "--run-step", "probe",
                            "--result", str(path), "--box-s", str(PROBE_TIMEOUT_S)],
                           PROBE_TIMEOUT_S, work / "probe.log")
    try:
        data = json.loads(path.read_text())
        return data["needs"], data["machine"]
    except (OSError, ValueError, KeyError):
        why = ("the environment probe timed out" if code is None
               else f"the environment probe failed (exit {code}): {last or 'no output'}")
        return {"nvml": why, "cuda": why}, {"error": why}


def run_all(out_dir: Path, budget_s: float, only: list[str] | None = None,
            ignore_needs: bool = False) -> dict[str, Any]:
    """Probe, run the steps, write figures.json, figures.md and log.txt; returns the document."""
    started = time.monotonic()
    deadline = started + budget_s
    date = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-validate-"))
    global _OVERLAY
    _OVERLAY = source_overlay(work)
    say(f"gpu-validate: probing the host (budget {budget_s:g} s; output in {out_dir})")
    needs, machine = probe(work)
    say(f"  machine: {machine_line(machine)}")
    for need, why in needs.items():
        if why:
            say(f"  {need}: {why}")
    if ignore_needs:  # a check of the harness: every step runs and says how it fails here
        say("  --ignore-needs: running every step regardless")
        needs = {}
    steps = [s for s in STEPS if only is None or s.name in only]
    figures: dict[str, Any] = {}
    outcomes: list[StepOutcome] = []
    for i, step in enumerate(steps):
        why = unmet_reason(step, needs)
        now = time.monotonic()
        later = [s for s in steps[i + 1:] if unmet_reason(s, needs) is None]
        box = time_box(step, later, deadline - now)
        if why is None and box is None:
            why = (f"not run: {deadline - now:.0f} s were left of the run's {budget_s:g} s "
                   f"budget, too little for this step's {step.min_s:g} s and the "
                   f"{sum(s.min_s for s in later):g} s the steps after it need")
        if why is not None:
            figures.update({n: figure(n, None, why, step.command) for n in step.figures})
            outcomes.append(StepOutcome(step.name, "not-run", 0.0, None, why))
            say(f"[{now - started:5.0f} s] {step.name}: not run: {why}")
            continue
        say(f"[{now - started:5.0f} s] {step.name}: running (time box {box:.0f} s)")
        got, outcome = run_step_child(step, box, work)
        figures.update(got)
        outcomes.append(outcome)
        shown = ", ".join(_short(n, got[n]) for n in step.figures)
        say(f"[{time.monotonic() - started:5.0f} s] {step.name}: {outcome.outcome} in "
            f"{outcome.seconds:.0f} s: {shown}")
    for name in UNITS:  # steps left out with --only
        figures.setdefault(name, figure(name, None, "not selected (--only)", ""))
    doc = {"schema": SCHEMA, "date": date.isoformat().replace("+00:00", "Z"),
           "machine": machine, "command": "make gpu-validate",
           "budget_s": budget_s, "duration_s": round(time.monotonic() - started, 1),
           "figures": {n: figures[n] for n in UNITS},
           "steps": [vars(o) for o in outcomes]}
    problems = check_figures(doc["figures"])
    if problems:  # never expected; said loudly rather than written silently
        raise SystemExit("gpu-validate: malformed figures: " + "; ".join(problems))
    write_outputs(out_dir, doc, work, [o.name for o in outcomes])
    shutil.rmtree(work, ignore_errors=True)
    return doc


def _short(name: str, f: dict[str, Any]) -> str:
    return (f"{name}={f['value']:g} {f['unit']}" if f["value"] is not None
            else f"{name}=null ({f['reason'][:120]})")


def say(text: str) -> None:
    print(text, flush=True)


def write_outputs(out_dir: Path, doc: dict[str, Any], work: Path, step_names: list[str]) -> None:
    tmp = out_dir / "figures.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out_dir / "figures.json")
    (out_dir / "figures.md").write_text(render_markdown(doc))
    with open(out_dir / "log.txt", "w") as log:
        for name in ["probe", *step_names]:
            path = work / f"{name}.log"
            if not path.exists():
                continue
            data = path.read_bytes()
            cut = len(data) > LOG_TAIL_BYTES
            log.write(f"===== {name}" + (f" (last {LOG_TAIL_BYTES} bytes)" if cut else "")
                      + " =====\n")
            log.write(data[-LOG_TAIL_BYTES:].decode(errors="replace") + "\n")
    report = work / "accept_delivery.report.json"
    if report.exists():
        shutil.copyfile(report, out_dir / "accept-delivery-report.json")


def machine_line(machine: dict[str, Any]) -> str:
    if machine.get("error"):
        return f"unknown ({machine['error']})"
    gpu = machine.get("gpu") or f"no GPU ({machine.get('gpu_reason', 'nvidia-smi: unknown')})"
    count = machine.get("gpu_count")
    parts = [f"{gpu}" + (f" x {count}" if count and count > 1 else ""),
             f"driver {machine.get('driver') or 'none'}", f"CUDA {machine.get('cuda') or 'none'}",
             f"torch {machine.get('torch') or 'none'}", f"Python {machine.get('python')}",
             f"host {machine.get('hostname')}"]
    return ", ".join(parts)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: dict[str, Any]) -> str:
    """figures.md: the machine, the date, the commands and one row per figure."""
    lines = [
        "### GPU proof (`make gpu-validate`)", "",
        f"- machine: {machine_line(doc['machine'])}",
        f"- date: {doc['date']}; {doc['duration_s']:g} s in all (budget {doc['budget_s']:g} s)",
        "- command: `make gpu-validate` (scripts/gpu-validate, then bench/gpu_validate.py); "
        "on the lent GPU machine see README.md, \"The GPU proof\"", "",
        "| figure | value | unit | measured with | note |", "|---|---|---|---|---|",
    ]
    for name, f in doc["figures"].items():
        value = f"{f['value']:g}" if f["value"] is not None else "null"
        note = f["reason"] if f["value"] is None else f.get("detail", "")
        lines.append(f"| `{name}` | {value} | {_cell(f['unit'])} | `{_cell(f['command'])}` | "
                     f"{_cell(note)} |")
    lines += ["", "| step | outcome | seconds | time box (s) |", "|---|---|---|---|"]
    for s in doc["steps"]:
        box = f"{s['box_s']:g}" if s["box_s"] is not None else "-"
        lines.append(f"| {s['name']} | {s['outcome']} | {s['seconds']:g} | {box} |")
    return "\n".join(lines) + "\n"


DOC_BEGIN, DOC_END = "<!-- gpu-validate:begin -->", "<!-- gpu-validate:end -->"


def fill_doc(path: Path, markdown: str) -> bool:
    """Replace the text between DOC_BEGIN and DOC_END in ``path`` (False: no markers there)."""
    text = path.read_text()
    start, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if start < 0 or end < start:
        return False
    path.write_text(text[:start + len(DOC_BEGIN)] + "\n" + markdown + text[end:])
    return True


# -- the children: one function per step -------------------------------------------------------


def step_probe(box_s: float) -> dict[str, Any]:
    """needs: {"nvml": reason or None, "cuda": reason or None}; machine: what nvidia-smi,
    NVML and torch say (name, driver, CUDA)."""
    import platform

    machine: dict[str, Any] = {"hostname": socket.gethostname(),
                               "python": platform.python_version()}
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
            needs["cuda"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                             "CUDA device")
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
        q = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
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


def _pytest_figure(name: str, command: str, args: list[str], box_s: float,
                   note: Callable[[dict[str, str]], str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                f"--junitxml={junit}", *args]
        try:
            proc = subprocess.run(argv, cwd=REPO, timeout=max(5.0, box_s - 10))
        except subprocess.TimeoutExpired:
            return figure(name, None, f"pytest did not finish within {box_s - 10:.0f} s",
                          command)
        if not junit.exists():
            return figure(name, None, f"pytest exited {proc.returncode} without a report",
                          command)
        counts = pytest_counts(junit)
        cases = _case_outcomes(junit)
    detail = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
              f"{counts['skipped']} skipped of {counts['tests']} (pytest exit {proc.returncode})")
    bad = [f"{n}: {o}" for n, o in cases.items() if o.startswith("failed")]
    if bad:
        detail += "; " + "; ".join(bad[:5])
    if note:
        detail += note(cases)
    return figure(name, counts["passed"], None, command, detail, counts=counts)


def step_nvml_contract(box_s: float) -> dict[str, Any]:
    def note(cases: dict[str, str]) -> str:
        real = cases.get("test_nvml_satisfies_the_backend_contract_on_a_gpu_host")
        return f"; the real-NVML contract test: {real or 'not collected'}"

    step = STEP_BY_NAME["nvml_contract"]
    return {"nvml_contract": _pytest_figure("nvml_contract", step.command,
                                            ["tests/unit/test_backend_contract.py"], box_s, note)}


def step_pytest_gpu(box_s: float) -> dict[str, Any]:
    step = STEP_BY_NAME["pytest_gpu"]
    return {"pytest_gpu": _pytest_figure("pytest_gpu", step.command,
                                         ["-m", "gpu", "--continue-on-collection-errors",
                                          "tests"], box_s)}


def burn_figures(spec: Any, size: int = BURN_SIZE, seconds_each: float = BURN_S_PER_PRECISION,
                 deadline_s: float = 80.0, precisions: tuple[str, ...] = BURN_PRECISIONS,
                 command: str = "") -> dict[str, Any]:
    """burn_tflops_<precision>: the median 1-s sample of node_agent.compute.burn.run_burn on
    ``spec``'s device (every product in 8 verified, as the gpu_burn check runs it)."""
    from node_agent.compute.burn import BurnPlan, run_burn

    plan = BurnPlan(size=size, duration_s=seconds_each * len(precisions), precisions=precisions,
                    sample_s=min(1.0, seconds_each / 4), verify_every=8, stall_s=30.0,
                    startup_timeout_s=max(10.0, deadline_s / 2))
    out = run_burn([spec], plan, backend=None, sample_interval_s=1.0, deadline_s=deadline_s)
    worker = out.workers[spec.index]
    figures = {}
    for p in precisions:
        name = f"burn_tflops_{p}"
        samples = worker.samples_of(p)
        if p in out.skipped:
            figures[name] = figure(name, None, f"not run: {out.skipped[p]}", command)
        elif worker.failure:
            figures[name] = figure(name, None, f"{worker.failure}: {worker.failure_detail}",
                                   command)
        elif not samples:
            figures[name] = figure(name, None, "the burn produced no sample of this precision",
                                   command)
        else:
            wrong = sum(s.wrong for s in samples)
            tflops = [s.tflops for s in samples]
            detail = (f"median of {len(samples)} samples (min {min(tflops):.4g}, max "
                      f"{max(tflops):.4g}), n={size}, {sum(s.verified for s in samples)} "
                      f"products verified (Freivalds), {wrong} wrong elements; "
                      f"{worker.info.get('cuda_name') or worker.info.get('device')}")
            figures[name] = figure(name, worker.median_tflops(p), None, command, detail)
    return figures


def step_burn(box_s: float) -> dict[str, Any]:
    from node_agent.compute.devices import ComputeSpec

    return burn_figures(ComputeSpec(0), deadline_s=box_s - 10,
                        command=STEP_BY_NAME["burn"].command)


def burn_vs_plain(device: str = "cuda:0", precision: str = VS_PLAIN_PRECISION,
                  size: int = BURN_SIZE, block_s: float = VS_PLAIN_BLOCK_S,
                  pairs: int = VS_PLAIN_PAIRS, command: str = "") -> dict[str, Any]:
    """burn_vs_plain_matmul: the burn engine's TFLOP/s over a bare torch.matmul loop's, on the
    same inputs (the engine's own A and B) and numerics, alternating blocks in one process
    (the order flips every pair, so drift of clocks and temperature hits both sides alike);
    the median of the pairs' ratios."""
    import torch

    from node_agent.compute.burn import BurnEngine, BurnPlan, numerics
    from node_agent.compute.devices import ComputeDevice, ComputeSpec

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cdev = ComputeDevice(ComputeSpec(dev.index or 0), dev, torch.matmul)
    engine = BurnEngine(cdev, BurnPlan(size=size, precisions=(precision,),
                                       sample_s=min(1.0, block_s), verify_every=8))
    skipped = engine.prepare()
    if precision in skipped:
        return {"burn_vs_plain_matmul": figure("burn_vs_plain_matmul", None,
                                               f"not run: {skipped[precision]}", command)}
    job = engine.jobs[precision]

    def engine_block() -> float:
        sent: list[tuple] = []
        t0 = time.monotonic()
        engine.run_phase(precision, t0 + block_s, t0, sent.append)
        samples = [m for m in sent if m[0] == "sample"]
        return sum(m[4] for m in samples) / sum(m[5] for m in samples) / 1e12

    def plain_block() -> float:
        m, k = job.a.shape
        n = job.b.shape[1]
        with numerics(precision):
            job.matmul(job.a, job.b)  # untimed: kernel choice, as the engine warms up
            cdev.synchronize()
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < block_s:
                for _ in range(8):  # a few launches between synchronisations, as the engine
                    torch.matmul(job.a, job.b)
                count += 8
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
    ratios = [a / b for a, b in zip(ours, plain, strict=True)]
    detail = (f"{precision} n={size}: burn engine median {statistics.median(ours):.4g} TFLOP/s, "
              f"plain matmul median {statistics.median(plain):.4g} TFLOP/s; per-pair ratios "
              f"{', '.join(f'{r:.3f}' for r in ratios)} ({pairs} pairs of {block_s:g} s, order "
              f"alternating; the engine verifies 1 product in 8); device {cdev.device}")
    return {"burn_vs_plain_matmul": figure("burn_vs_plain_matmul", statistics.median(ratios),
                                           None, command, detail)}


def step_burn_vs_plain(box_s: float) -> dict[str, Any]:
    return burn_vs_plain(command=STEP_BY_NAME["burn_vs_plain"].command)


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
    for name, check, metric in (("hbm_gbps", "hbm_bandwidth", "copy_gbps"),
                                ("pcie_h2d_gbps", "pcie_bandwidth", "h2d_gbps"),
                                ("pcie_d2h_gbps", "pcie_bandwidth", "d2h_gbps")):
        r = _result(report, check, metric)
        if r is None:
            figures[name] = figure(name, None, f"the report has no {check} {metric} result "
                                               "for gpu:0", command)
        elif r.get("value") is None:
            figures[name] = figure(name, None, f"{check} {r['status']}: {r['detail']}", command)
        else:
            ev = r.get("evidence", {})
            detail = (f"{check} {metric} ({r['status']}): p90 of {ev.get('reps')} copies, "
                      f"median {ev.get('median_gbps')}, {ev.get('size_bytes')} B; {r['detail']}")
            figures[name] = figure(name, r["value"], None, command, detail)
    return figures


def step_bandwidth(box_s: float) -> dict[str, Any]:
    command = STEP_BY_NAME["bandwidth"].command
    with tempfile.TemporaryDirectory() as tmp:
        proc = _agent(["accept", "--only", "hbm_bandwidth,pcie_bandwidth", "--json", "--out",
                       str(Path(tmp) / "reports")], box_s - 10, Path(tmp))
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        why = f"node-agent accept exited {proc.returncode}: {_tail(proc.stderr)}"
        return {n: figure(n, None, why, command) for n in ("hbm_gbps", "pcie_h2d_gbps",
                                                            "pcie_d2h_gbps")}
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
    detail = (f"{cov.sms_reached} of {cov.sm_count} SMs ran at least one tile of "
              f"{cov.blocks} blocks ({cov.method})" + (f"; {cov.why}" if cov.why else ""))
    return {name: figure(name, cov.value, None, command, detail)}


def step_sdc_overhead(box_s: float) -> dict[str, Any]:
    """sdc_probe_overhead_pct: measure_training_overhead() (a small transformer trained in
    alternating blocks without and with SdcProbe.step() at the default 0.1 % budget)."""
    name = "sdc_probe_overhead_pct"
    command = f"{PY} -c 'from {SDC_MODULE} import measure_training_overhead as m; print(m())'"
    fn, why = _validation("measure_training_overhead")
    if fn is None:
        return {name: figure(name, None, why, command)}
    o = fn()
    detail = (f"median over {o.pairs} off/on pairs of {o.steps_per_block} steps: "
              f"{o.step_ms_off:.3f} ms/step without, {o.step_ms_on:.3f} ms with; the probe's own "
              f"cost {o.probe_share_percent:.3f} % of the time it ran ({o.probes_run} probes, "
              f"budget {o.budget_fraction:g}); verdicts {o.verdicts}; {o.device}")
    return {name: figure(name, o.percent, None, command, detail)}


def delivery_suite(path: Path) -> dict[str, Any]:
    """The shipped delivery suite with DELIVERY_OVERRIDES merged in, written to ``path``."""
    import yaml

    suite = yaml.safe_load((REPO / "suites" / "delivery.yaml").read_text())
    for check in suite["checks"]:
        extra = DELIVERY_OVERRIDES.get(check["check"])
        if extra:
            check["params"] = {**(check.get("params") or {}), **extra}
    suite["description"] = ("the delivery suite with durations shortened for "
                            "bench/gpu_validate.py: " + json.dumps(DELIVERY_OVERRIDES))
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return suite


def step_accept_delivery(box_s: float) -> dict[str, Any]:
    command = STEP_BY_NAME["accept_delivery"].command
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "delivery-gpu-validate.yaml"
        delivery_suite(suite)
        t0 = time.monotonic()
        try:
            proc = _agent(["accept", "--suite", str(suite), "--json", "--out",
                           str(Path(tmp) / "reports")], box_s - 10, Path(tmp))
        except subprocess.TimeoutExpired:
            return {"accept_delivery_s": figure("accept_delivery_s", None, "node-agent accept "
                                                f"did not finish within {box_s - 10:.0f} s",
                                                command)}
        seconds = time.monotonic() - t0
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return {"accept_delivery_s": figure(
            "accept_delivery_s", None, f"node-agent accept exited {proc.returncode} without a "
            f"report: {_tail(proc.stderr)}", command)}
    (Path(os.environ.get("GPU_VALIDATE_WORK", tempfile.gettempdir()))
     / "accept_delivery.report.json").write_text(json.dumps(report, indent=1))
    statuses: dict[str, int] = {}
    for r in report["results"]:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    not_clean = sorted({f"{r['check']} {r['status']}" for r in report["results"]
                        if r["status"] in ("fail", "error")})
    detail = (f"grade {report['grade']['level']} (exit {proc.returncode}); "
              + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
              + (f"; {', '.join(not_clean)}" if not_clean else "")
              + f"; durations shortened: {json.dumps(DELIVERY_OVERRIDES)}")
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


def daemon_figures(box_s: float, window_s: float = DAEMON_WINDOW_S,
                   simulate: str | None = None, command: str = "") -> dict[str, Any]:
    """daemon_rss_mb (the largest RSS seen, sampled every second) and daemon_cpu_pct (its own
    CPU time over the window; the checks it runs in child processes are excluded, as in
    bench/bench_daemon.py) of ``node-agent daemon`` with the shipped periodic suite."""
    import psutil

    names = ("daemon_rss_mb", "daemon_cpu_pct")
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        config = Path(tmp) / "config.yaml"
        config.write_text(f"state_dir: {Path(tmp) / 'state'}\ndaemon:\n"
                          f"  listen: 127.0.0.1:{port}\n")
        argv = [sys.executable, "-m", "node_agent.commands.main", "daemon", "--config",
                str(config), "--log-level", "WARNING"]
        if simulate:
            argv += ["--simulate", simulate]
        log = Path(tmp) / "daemon.log"
        with open(log, "wb") as err:
            # in this step's process group (run_child cleans it up), not a session of its own
            proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.DEVNULL, stderr=err)
        try:
            t_start = time.monotonic()
            while "node_agent_up" not in (text := _metrics(port)):
                if proc.poll() is not None or time.monotonic() - t_start > 30:
                    why = (f"the daemon exited {proc.returncode}" if proc.poll() is not None
                           else "the daemon did not serve /metrics within 30 s")
                    return {n: figure(n, None, f"{why}: {_tail(log.read_text())}", command)
                            for n in names}
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
    note = (f"over {elapsed:.0f} s after a {started_s:.1f} s start"
            + (f" (shortened from {window_s:g} s to fit the box)" if window < window_s else "")
            + f"; {len(rss)} samples; /metrics had {gpu_lines} node_agent_gpu_ lines"
            + (", SIMULATED" if sim else ", real NVML" if gpu_lines
               else ", not simulated but no GPU on /metrics (no driver?)")
            + ("" if alive else "; the daemon had exited by the end"))
    return {
        "daemon_rss_mb": figure("daemon_rss_mb", max(rss), None, command,
                                f"max RSS; median {statistics.median(rss):.1f} MiB; {note}"),
        "daemon_cpu_pct": figure("daemon_cpu_pct", 100.0 * own / elapsed, None, command,
                                 f"own CPU time {own:.2f} s (children excluded); {note}"),
    }


def step_daemon(box_s: float) -> dict[str, Any]:
    return daemon_figures(box_s, command=STEP_BY_NAME["daemon"].command)


STEP_FUNCTIONS: dict[str, Callable[[float], dict[str, Any]]] = {
    "probe": step_probe, "nvml_contract": step_nvml_contract, "pytest_gpu": step_pytest_gpu,
    "burn": step_burn, "burn_vs_plain": step_burn_vs_plain, "bandwidth": step_bandwidth,
    "sdc_sm_coverage": step_sdc_sm_coverage, "sdc_overhead": step_sdc_overhead,
    "accept_delivery": step_accept_delivery, "daemon": step_daemon,
}


def child_main(name: str, result: Path, box_s: float) -> int:
    """Run one step; write {"figures": ...} (or the probe's document), or {"error": ...}."""
    os.environ["GPU_VALIDATE_WORK"] = str(result.parent)
    try:
        data = STEP_FUNCTIONS[name](box_s)
        if name != "probe":
            data = {"figures": data}
        code = 0
    except BaseException as err:  # noqa: BLE001 - the parent records it as the reason
        traceback.print_exc()
        data, code = {"error": f"{type(err).__name__}: {err}"}, 1
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, result)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "out" / "gpu-validate"),
                    help="where figures.json, figures.md and log.txt go")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"the steps' whole time budget (default {DEFAULT_BUDGET_S:g} s)")
    ap.add_argument("--only", help=f"steps to run: {','.join(STEP_BY_NAME)}")
    ap.add_argument("--doc", help="also fill the section between the gpu-validate markers of "
                                  "this Markdown file (e.g. docs/benchmarks.md)")
    ap.add_argument("--from", dest="from_json", metavar="FIGURES_JSON",
                    help="measure nothing: print the table of a figures.json (one fetched from "
                         "the GPU machine) and, with --doc, fill that file from it")
    ap.add_argument("--ignore-needs", action="store_true",
                    help="run every step even where the probe found no GPU (a check of the "
                         "harness itself: the figures then say how each step fails)")
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--box-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_step:
        return child_main(args.run_step, Path(args.result), args.box_s)
    if args.from_json:
        try:
            doc = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as err:
            ap.error(f"--from {args.from_json}: cannot read it as JSON: {err}")
        problems = check_figures(doc.get("figures", {})) if isinstance(doc, dict) else ["?"]
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or problems:
            ap.error(f"--from {args.from_json}: not a {SCHEMA} document"
                     + (f" ({'; '.join(problems[:3])})" if problems else ""))
        print(render_markdown(doc), end="")
        if args.doc and not fill_doc(Path(args.doc), render_markdown(doc)):
            ap.error(f"--doc {args.doc}: no {DOC_BEGIN} ... {DOC_END} markers in it")
        return 0
    only = None
    if args.only:
        only = [s for s in args.only.split(",") if s]
        unknown = [s for s in only if s not in STEP_BY_NAME]
        if unknown:
            ap.error(f"--only: unknown step(s) {', '.join(unknown)}; "
                     f"steps: {', '.join(STEP_BY_NAME)}")
    doc = run_all(Path(args.out), args.budget_s, only, args.ignore_needs)
    filled = sum(1 for f in doc["figures"].values() if f["value"] is not None)
    say(f"gpu-validate: {filled} of {len(doc['figures'])} figures measured in "
        f"{doc['duration_s']:g} s; {args.out}/figures.json, figures.md, log.txt")
    if filled == 0:
        reasons = sorted({f["reason"] for f in doc["figures"].values()})
        say("  every figure is null; reasons: " + " | ".join(reasons[:4]))
    if args.doc:
        if fill_doc(Path(args.doc), render_markdown(doc)):
            say(f"  filled the GPU proof section of {args.doc}")
        else:
            say(f"  {args.doc} has no {DOC_BEGIN} ... {DOC_END} markers: left alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
