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
``burn_vs_plain``             ``burn_vs_plain_matmul_<precision>`` (bf16, fp16, tf32, fp32,
                              fp8): the burn engine against a bare loop of the same kernel,
                              interleaved, as a ratio per precision; ``burn_vs_plain_matmul``
                              the lowest of them
``bandwidth``                 ``hbm_gbps``, ``pcie_h2d_gbps``, ``pcie_d2h_gbps``: the agent's
                              own checks (``node-agent accept --only ...``)
``sdc_sm_coverage``,          from node_agent.sdc.validation (the SDC wing's own measurements:
``sdc_overhead``              %smid coverage, SdcProbe.step() overhead in a training loop)
``accept_delivery``           ``accept_delivery_s``: the delivery suite end to end (durations
                              shortened to fit: gpu_validate_steps.DELIVERY_OVERRIDES)
``daemon``                    ``daemon_rss_mb``, ``daemon_cpu_pct``: ``node-agent daemon`` for
                              60 s on real NVML, measured with psutil
============================  ===============================================================

Every figure is ``{"value": number | null, "unit": str, "reason": str | null, "command": str}``
(optionally ``detail``, a sentence, and ``counts`` for the pytest figures); ``reason`` says why
a value is null and is null otherwise. A step that cannot run here (no driver, no CUDA, a
module missing) is not started and its figures say why; a step that fails or outlives its time
box is killed with its whole process group and its figures carry the error; the run goes on.
The whole run is held to ``--budget-s`` (510 s): each step's box is cut so that the steps after
it keep their minimum, which keeps ``make gpu-validate`` under 9 minutes on one H100 (it fits
a batch job or a remote command limited to 10). The command exits 0 whenever it wrote the
figures, so on a host without a GPU it is a CI-safe no-op that explains every null.

This file is the harness and its own child: ``--run-step NAME --result FILE`` runs one step of
bench/gpu_validate_steps.py and writes its figures as JSON. Both files use only the standard
library at import (the steps import torch and node_agent inside their functions), so the
harness reports even where the agent's dependencies are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the steps beside this file
from gpu_validate_steps import (  # noqa: E402
    REPO,
    SDC_MODULE,
    STEP_BY_NAME,
    STEP_FUNCTIONS,
    STEPS,
    UNITS,
    Step,
    figure,
)

SCHEMA = "node-agent.gpu-validate/1"
#: the steps' whole budget: with the wheel install and the writing it stays under 9 minutes,
#: inside a 10-minute limit on a job or a remote command (``--budget-s`` changes it)
DEFAULT_BUDGET_S = 510.0
PROBE_TIMEOUT_S = 60.0
#: what killing a step past its box may take (SIGTERM, 2 s, SIGKILL, the reaping): counted
#: against the budget for every step, so a run of time-outs still ends inside it
KILL_GRACE_S = 4.0
LOG_TAIL_BYTES = 60_000  # of each step's output kept in log.txt


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
    outcome: str  # ok | failed | timeout | not-run
    seconds: float
    box_s: float | None
    note: str = ""


def _child_env() -> dict[str, str]:
    """The steps' environment: this tree first on ``PYTHONPATH`` (the agent runs from the tree
    as it is, installed or not: ``node_agent.resources`` finds suites/ and graders/ beside the
    package; every child Python inherits it, the agent's own ``python -P -m`` children that
    run in ``/`` included), unbuffered output, CUDA numbering GPUs as NVML does."""
    env = dict(os.environ)
    parts = [str(REPO)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO
    ]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # NVML's order (the agent's convention)
    return env


def run_child(
    argv: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run ``argv`` in its own process group with output to ``log_path``; on the deadline the
    whole group is killed (SIGTERM, then SIGKILL after 5 s), and whatever of the group is still
    there when the leader exits on its own (burn workers, a forkserver, a test's helpers) too.
    The steps start their own subprocesses in this group, never in a new session, so that this
    reaches them. Returns (exit code or None when timed out, the last line it printed)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env or _child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
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


def run_step_child(
    step: Step, box_s: float, work: Path, argv: list[str] | None = None
) -> tuple[dict[str, Any], StepOutcome]:
    """Run one step in a child within ``box_s``; its figures, every one filled or explained."""
    result_path = work / f"{step.name}.result.json"
    log_path = work / f"{step.name}.log"
    result_path.unlink(missing_ok=True)
    argv = argv or [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-step",
        step.name,
        "--result",
        str(result_path),
        "--box-s",
        f"{box_s:.1f}",
    ]
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
        why, outcome = (
            (
                f"timed out after {box_s:.0f} s (the step's time box) and was killed; "
                f"last output: {last or 'none'}"
            ),
            "timeout",
        )
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
            figures[name] = figure(
                name,
                f.get("value"),
                f.get("reason"),
                f.get("command") or step.command,
                f.get("detail"),
                **({"counts": f["counts"]} if "counts" in f else {}),
            )
        else:
            figures[name] = figure(name, None, why, step.command)
    note = "" if outcome == "ok" else why
    return figures, StepOutcome(step.name, outcome, round(seconds, 1), round(box_s, 1), note)


def time_box(step: Step, later: list[Step], left_s: float) -> float | None:
    """The step's time box: its own ``timeout_s``, cut so that the steps after it keep their
    ``min_s`` of the ``left_s`` seconds left (each step, this one too, also keeps KILL_GRACE_S
    for being killed at its box); None when less than its own ``min_s`` remains."""
    box = min(
        step.timeout_s, left_s - sum(s.min_s for s in later) - KILL_GRACE_S * (len(later) + 1)
    )
    return box if box >= step.min_s else None


def unmet_reason(step: Step, env: dict[str, Any]) -> str | None:
    """Why ``step`` cannot run on this host (None: it can)."""
    if (
        step.name in ("sdc_sm_coverage", "sdc_overhead")
        and not (REPO / "node_agent" / "sdc" / "validation.py").exists()
    ):
        return f"{SDC_MODULE} not available"
    for need in step.needs:
        why = env.get(need)
        if why:
            return f"no GPU here: {why}"
    return None


def probe(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(needs -> reason or None, machine) from a child, so a hung driver cannot hang us."""
    path = work / "probe.result.json"
    code, last = run_child(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--run-step",
            "probe",
            "--result",
            str(path),
            "--box-s",
            str(PROBE_TIMEOUT_S),
        ],
        PROBE_TIMEOUT_S,
        work / "probe.log",
    )
    try:
        data = json.loads(path.read_text())
        return data["needs"], data["machine"]
    except (OSError, ValueError, KeyError):
        why = (
            "the environment probe timed out"
            if code is None
            else f"the environment probe failed (exit {code}): {last or 'no output'}"
        )
        return {"nvml": why, "cuda": why}, {"error": why}


def run_all(
    out_dir: Path, budget_s: float, only: list[str] | None = None, ignore_needs: bool = False
) -> dict[str, Any]:
    """Probe, run the steps, write figures.json, figures.md and log.txt; returns the document."""
    started = time.monotonic()
    deadline = started + budget_s
    date = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-validate-"))
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
        later = [s for s in steps[i + 1 :] if unmet_reason(s, needs) is None]
        box = time_box(step, later, deadline - now)
        if why is None and box is None:
            why = (
                f"not run: {deadline - now:.0f} s were left of the run's {budget_s:g} s "
                f"budget, too little for this step's {step.min_s:g} s and the "
                f"{sum(s.min_s for s in later):g} s the steps after it need"
            )
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
        say(
            f"[{time.monotonic() - started:5.0f} s] {step.name}: {outcome.outcome} in "
            f"{outcome.seconds:.0f} s: {shown}"
        )
    for name in UNITS:  # steps left out with --only
        figures.setdefault(name, figure(name, None, "not selected (--only)", ""))
    doc = {
        "schema": SCHEMA,
        "date": date.isoformat().replace("+00:00", "Z"),
        "machine": machine,
        "command": "make gpu-validate",
        "budget_s": budget_s,
        "duration_s": round(time.monotonic() - started, 1),
        "figures": {n: figures[n] for n in UNITS},
        "steps": [vars(o) for o in outcomes],
    }
    problems = check_figures(doc["figures"])
    if problems:  # never expected; said loudly rather than written silently
        raise SystemExit("gpu-validate: malformed figures: " + "; ".join(problems))
    write_outputs(out_dir, doc, work, [o.name for o in outcomes])
    shutil.rmtree(work, ignore_errors=True)
    return doc


def _short(name: str, f: dict[str, Any]) -> str:
    return (
        f"{name}={f['value']:g} {f['unit']}"
        if f["value"] is not None
        else f"{name}=null ({f['reason'][:120]})"
    )


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
            log.write(
                f"===== {name}" + (f" (last {LOG_TAIL_BYTES} bytes)" if cut else "") + " =====\n"
            )
            log.write(data[-LOG_TAIL_BYTES:].decode(errors="replace") + "\n")
    report = work / "accept_delivery.report.json"
    if report.exists():
        shutil.copyfile(report, out_dir / "accept-delivery-report.json")


def machine_line(machine: dict[str, Any]) -> str:
    if machine.get("error"):
        return f"unknown ({machine['error']})"
    gpu = machine.get("gpu") or f"no GPU ({machine.get('gpu_reason', 'nvidia-smi: unknown')})"
    count = machine.get("gpu_count")
    parts = [
        f"{gpu}" + (f" x {count}" if count and count > 1 else ""),
        f"driver {machine.get('driver') or 'none'}",
        f"CUDA {machine.get('cuda') or 'none'}",
        f"torch {machine.get('torch') or 'none'}",
        f"Python {machine.get('python')}",
        f"host {machine.get('hostname')}",
    ]
    return ", ".join(parts)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: dict[str, Any]) -> str:
    """figures.md: the machine, the date, the commands and one row per figure."""
    lines = [
        "### GPU proof (`make gpu-validate`)",
        "",
        f"- machine: {machine_line(doc['machine'])}",
        f"- date: {doc['date']}; {doc['duration_s']:g} s in all (budget {doc['budget_s']:g} s)",
        "- command: `make gpu-validate` (scripts/gpu-validate, then bench/gpu_validate.py) "
        "from the work tree, nothing installed; on a host without network access see "
        'README.md, "The GPU proof"',
        "",
        "| figure | value | unit | measured with | note |",
        "|---|---|---|---|---|",
    ]
    for name, f in doc["figures"].items():
        value = f"{f['value']:g}" if f["value"] is not None else "null"
        note = f["reason"] if f["value"] is None else f.get("detail", "")
        lines.append(
            f"| `{name}` | {value} | {_cell(f['unit'])} | `{_cell(f['command'])}` | {_cell(note)} |"
        )
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
    path.write_text(text[: start + len(DOC_BEGIN)] + "\n" + markdown + text[end:])
    return True


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
    ap.add_argument(
        "--out",
        default=str(REPO / "out" / "gpu-validate"),
        help="where figures.json, figures.md and log.txt go",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"the steps' whole time budget (default {DEFAULT_BUDGET_S:g} s)",
    )
    ap.add_argument("--only", help=f"steps to run: {','.join(STEP_BY_NAME)}")
    ap.add_argument(
        "--doc",
        help="also fill the section between the gpu-validate markers of "
        "this Markdown file (e.g. docs/benchmarks.md)",
    )
    ap.add_argument(
        "--from",
        dest="from_json",
        metavar="FIGURES_JSON",
        help="measure nothing: print the table of a figures.json (one fetched from "
        "a GPU host) and, with --doc, fill that file from it",
    )
    ap.add_argument(
        "--ignore-needs",
        action="store_true",
        help="run every step even where the probe found no GPU (a check of the "
        "harness itself: the figures then say how each step fails)",
    )
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
            ap.error(
                f"--from {args.from_json}: not a {SCHEMA} document"
                + (f" ({'; '.join(problems[:3])})" if problems else "")
            )
        print(render_markdown(doc), end="")
        if args.doc and not fill_doc(Path(args.doc), render_markdown(doc)):
            ap.error(f"--doc {args.doc}: no {DOC_BEGIN} ... {DOC_END} markers in it")
        return 0
    only = None
    if args.only:
        only = [s for s in args.only.split(",") if s]
        unknown = [s for s in only if s not in STEP_BY_NAME]
        if unknown:
            ap.error(
                f"--only: unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_BY_NAME)}"
            )
    doc = run_all(Path(args.out), args.budget_s, only, args.ignore_needs)
    filled = sum(1 for f in doc["figures"].values() if f["value"] is not None)
    say(
        f"gpu-validate: {filled} of {len(doc['figures'])} figures measured in "
        f"{doc['duration_s']:g} s; {args.out}/figures.json, figures.md, log.txt"
    )
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
