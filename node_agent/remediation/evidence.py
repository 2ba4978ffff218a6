"""Evidence collected before a disruptive action, so the people who repair the node know what
the agent saw: ``<state_dir>/evidence/<timestamp>-<action>/`` with

* ``report.json`` — the report that led to the action (when there is one);
* ``kernel-log.txt`` — the last lines of the kernel log (:mod:`node_agent.kernel_log`);
* ``stacks.txt`` — ``py-spy dump --nonblocking --pid`` of each GPU process when py-spy is
  installed and the pids are known (``nvidia-smi --query-compute-apps=pid``), else a line
  saying why not;
* ``notes.txt`` — what was collected and what was skipped, and why.

Collecting evidence never stops the action, and never holds it up for long: the stacks are
taken all at once (one py-spy per process, without stopping it: a process blocked in
``vfork()`` cannot be stopped and would keep a stopping py-spy waiting), under one deadline,
:data:`EVIDENCE_DEADLINE_S` from the start, which the drain does not wait past. The Slurm
health check wrapper (``packaging/slurm/node-agent-healthcheck``) gives the whole ``check --act``
50 s; a stack not taken by then, or a process beyond :data:`MAX_STACKS`, is a note saying so.
Every failure becomes a note. The directory is
0700 and its files 0600, created with ``O_EXCL|O_NOFOLLOW``: the kernel log it copies may be
unreadable to users (``dmesg_restrict``), and the stacks show their code.

Before a replace request, the driver's own evidence (:class:`BugReportCollector`): NVIDIA's RMA
process asks for ``nvidia-bug-report.sh`` output taken while the fault is present, and after a
drain and a reboot that state is gone. It runs as ``nvidia-bug-report.sh --safe-mode
--output-file <state_dir>/bug-reports/nvidia-bug-report-<journal row id>.log`` (the script
appends ``.gz`` when gzip is there), time-boxed (:data:`BUG_REPORT_TIMEOUT_S`), its file size
capped (:data:`BUG_REPORT_MAX_BYTES`: ``prlimit --fsize`` where util-linux has it, and cut to the
cap after), the newest :data:`BUG_REPORTS_KEPT` kept. A missing script, a run that hangs or
fails, each is a note; none of them stops the replace request.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from node_agent import proc
from node_agent.atomic_file import private_dir, write_text
from node_agent.kernel_log import KernelLog
from node_agent.model import Report, utc_stamp
from node_agent.report import json_report
from node_agent.training.stacks import PY_SPY_MISSING, find_py_spy

KERNEL_LOG_TAIL_LINES = 300
#: the whole collection, from the executor's start (GPU pids included) to the last stack: the
#: Slurm wrapper's 50 s hold the quick suite (seconds on a healthy node), this and the drain
EVIDENCE_DEADLINE_S = 12.0
PY_SPY_TIMEOUT_S = 5.0  # one nonblocking dump (tens of ms; bench_hang.py)
NVIDIA_SMI_TIMEOUT_S = 5.0
MAX_STACKS = 32  # GPU processes whose stacks are taken (8 GPUs x a few each)
#: the most of one process's stack dump kept (a user names its own frames: 32 MB seen)
MAX_STACK_BYTES = 1 << 20
JOIN_MARGIN_S = 1.0  # past the deadline, what a py-spy's kill may take
#: the driver's bug-report script (ships with the NVIDIA driver, in /usr/bin)
NVIDIA_BUG_REPORT = "nvidia-bug-report.sh"
#: ``--safe-mode`` skips the parts that can hang on a sick GPU; on an 8-GPU node it takes a
#: minute or two. The replace request waits for it, once per fault
BUG_REPORT_TIMEOUT_S = 180.0
#: a compressed report is a few MB; the cap keeps a runaway one from filling the state disk
BUG_REPORT_MAX_BYTES = 256 * 1024 * 1024
BUG_REPORTS_KEPT = 3  # the newest few; older ones are removed
BUG_REPORT_DIR = "bug-reports"


def gpu_pids(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[list[int], str | None]:
    """PIDs of compute processes on the GPUs (``nvidia-smi --query-compute-apps=pid``)."""
    if proc.which("nvidia-smi") is None:
        return [], "nvidia-smi is not installed, so GPU process ids are unknown"
    result = proc.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader,nounits"],
        timeout_s=timeout_s,
    )
    if not result.ok:
        return [], f"cannot list GPU processes: {result.describe_failure()}"
    pids = sorted({int(tok) for tok in result.stdout.split() if tok.strip().isdigit()})
    return pids, None


def collect(
    state_dir: Path,
    action: str,
    now: float,
    report: Report | None,
    kernel_log: KernelLog | None,
    pids: Sequence[int] | None,
    pids_note: str | None = None,
    *,
    deadline: float | None = None,
    py_spy: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Path | None, list[str]]:
    """Write the evidence directory; returns (its path or None, notes). Never raises.

    ``deadline`` (monotonic seconds; default :data:`EVIDENCE_DEADLINE_S` from now) bounds the
    stacks; ``py_spy`` defaults to :func:`~node_agent.training.stacks.find_py_spy`."""
    if deadline is None:
        deadline = clock() + EVIDENCE_DEADLINE_S
    stamp = utc_stamp(now)
    directory = state_dir / "evidence" / f"{stamp}-{action}"
    notes: list[str] = []
    try:
        private_dir(state_dir / "evidence")
        n = 1
        base = directory
        while True:
            try:
                directory.mkdir(mode=0o700)
                break
            except FileExistsError:
                n += 1
                directory = base.with_name(f"{base.name}-{n}")
    except OSError as err:
        return None, [f"cannot create evidence directory {directory}: {err.strerror or err}"]

    if report is not None:
        _write(directory / "report.json", json_report.dumps(report) + "\n", notes)
    else:
        notes.append("no report: the action was requested by an operator")

    if kernel_log is None:
        notes.append("kernel log: not opened for this command")
    elif kernel_log.unavailable_reason:
        notes.append(f"kernel log: {kernel_log.unavailable_reason}")
    else:
        try:
            records = kernel_log.read()[-KERNEL_LOG_TAIL_LINES:]
            _write(directory / "kernel-log.txt", "".join(f"{r.text}\n" for r in records), notes)
            notes.append(f"kernel log: last {len(records)} lines from {kernel_log.source}")
        except OSError as err:
            notes.append(f"kernel log: cannot read {kernel_log.source}: {err}")

    stacks, summary = _stacks(pids, pids_note, py_spy or find_py_spy(), deadline, clock)
    _write(directory / "stacks.txt", stacks, notes)
    notes.append(f"stacks: {summary}")
    _write(directory / "notes.txt", "".join(f"{n}\n" for n in notes), notes)
    return directory, notes


def _stacks(
    pids: Sequence[int] | None,
    pids_note: str | None,
    py_spy: str | None,
    deadline: float,
    clock: Callable[[], float],
) -> tuple[str, str]:
    """stacks.txt and its one-line summary: every pid's dump taken at once, by ``deadline``."""
    if not pids:
        why = f"skipped: {pids_note or 'no GPU processes known'}"
        return why + "\n", why
    if py_spy is None:
        why = f"skipped: {PY_SPY_MISSING}; GPU pids were {', '.join(map(str, pids))}"
        return why + "\n", why
    wanted, beyond = list(pids)[:MAX_STACKS], list(pids)[MAX_STACKS:]
    got: dict[int, str] = {}

    def dump(pid: int) -> None:
        left = deadline - clock()
        if left <= 0.1:
            return
        result = proc.run(
            [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
            timeout_s=min(PY_SPY_TIMEOUT_S, left),
            max_output_bytes=MAX_STACK_BYTES,
        )
        got[pid] = (
            result.stdout
            if result.ok
            else result.stdout + f"\n[cut at {MAX_STACK_BYTES} bytes]\n"
            if result.cut
            else f"failed: {result.describe_failure()}\n"
        )

    threads = [
        threading.Thread(target=dump, args=(pid,), name=f"evidence-{pid}", daemon=True)
        for pid in wanted
    ]
    for t in threads:
        t.start()
    for t in threads:  # a daemon thread left behind never keeps the agent from exiting
        t.join(max(0.0, deadline + JOIN_MARGIN_S - clock()))
    parts = [f"py-spy dump --nonblocking of GPU processes {', '.join(map(str, pids))}\n"]
    late = [pid for pid in wanted if pid not in got]
    for pid in wanted:
        parts.append(f"=== pid {pid} ===\n")
        parts.append(
            got.get(pid)
            or "not collected: the evidence deadline came first (the "
            "action does not wait for evidence)\n"
        )
    for pid in beyond:
        parts.append(
            f"=== pid {pid} ===\nnot collected: only the first {MAX_STACKS} GPU "
            "processes' stacks are taken\n"
        )
    failed = [pid for pid in wanted if got.get(pid, "").startswith("failed:")]
    summary = f"{len(wanted) - len(late) - len(failed)} of {len(pids)} GPU process(es)"
    if late:
        summary += (
            "; not collected by the evidence deadline (the action does not wait "
            "for evidence): pid " + ", ".join(map(str, late))
        )
    if failed:
        summary += "; py-spy failed for pid " + ", ".join(map(str, failed))
    if beyond:
        summary += f"; {len(beyond)} beyond the first {MAX_STACKS} not collected"
    return "".join(parts), summary


def _write(path: Path, text: str, notes: list[str]) -> None:
    try:
        write_text(path, text)
    except OSError as err:
        notes.append(f"cannot write {path}: {err.strerror or err}")


@dataclass(frozen=True)
class BugReport:
    """What a bug-report run left: its file (None: none written) and one line for people."""

    path: Path | None
    note: str


class BugReportCollector:
    """``nvidia-bug-report.sh --safe-mode`` into the state directory, bounded in time and size.

    ``program``: the script (default: :data:`NVIDIA_BUG_REPORT` found on PATH); ``unavailable``:
    why no report is taken in this run (a simulated node: the script would describe this host,
    not the node under test). Everything it depends on is a parameter; the defaults are the
    module's constants."""

    def __init__(
        self,
        program: str | None = None,
        *,
        timeout_s: float = BUG_REPORT_TIMEOUT_S,
        max_bytes: int = BUG_REPORT_MAX_BYTES,
        keep: int = BUG_REPORTS_KEPT,
        unavailable: str | None = None,
        run: Callable[..., proc.ProcResult] = proc.run,
    ) -> None:
        self.program, self.timeout_s, self.max_bytes = program, timeout_s, max_bytes
        self.keep, self.unavailable, self._run = max(1, keep), unavailable, run

    def _program(self) -> str | None:
        if self.program is not None:
            return self.program if os.access(self.program, os.X_OK) else None
        return proc.which(NVIDIA_BUG_REPORT)

    def describe(self, state_dir: Path | None) -> str:
        """What :meth:`collect` would do (a dry run says it)."""
        if self.unavailable:
            return f"no driver bug report ({self.unavailable})"
        program = self._program()
        if program is None:
            return f"no driver bug report ({self._absent()})"
        where = state_dir / BUG_REPORT_DIR if state_dir is not None else "the state directory"
        return (
            f"{program} --safe-mode into {where}/nvidia-bug-report-<journal id>.log.gz "
            f"(within {self.timeout_s:g} s, at most {self.max_bytes} bytes)"
        )

    def _absent(self) -> str:
        name = self.program or NVIDIA_BUG_REPORT
        return (
            f"{name} is not installed or not executable (it ships with the NVIDIA driver); "
            "take it by hand before the node is repaired if the vendor asks for it"
        )

    def collect(self, state_dir: Path, row_id: int) -> BugReport:
        """Run the script for journal row ``row_id``; never raises."""
        if self.unavailable:
            return BugReport(None, f"no driver bug report ({self.unavailable})")
        program = self._program()
        if program is None:
            return BugReport(None, f"no driver bug report: {self._absent()}")
        try:
            directory = private_dir(state_dir / BUG_REPORT_DIR)
        except OSError as err:
            return BugReport(
                None, f"no driver bug report: cannot make {state_dir}/{BUG_REPORT_DIR}: {err}"
            )
        base = directory / f"nvidia-bug-report-{row_id}.log"
        argv = [program, "--safe-mode", "--output-file", str(base)]
        prlimit = proc.which("prlimit")
        if prlimit is not None:  # the kernel stops a write past the cap (RLIMIT_FSIZE)
            argv = [prlimit, f"--fsize={self.max_bytes}", "--", *argv]
        result = self._run(argv, timeout_s=self.timeout_s, cwd=str(directory))
        found = [p for p in (base.with_name(base.name + ".gz"), base) if p.is_file()]
        path = found[0] if found else None
        if path is not None:
            path = self._capped(path)
        self._prune(directory)
        if result.ok and path is not None:
            return BugReport(path, f"driver bug report in {path}")
        why = result.describe_failure() if not result.ok else "it wrote no file"
        if path is not None:
            return BugReport(
                path, f"driver bug report incomplete ({why}); partial output in {path}"
            )
        return BugReport(None, f"no driver bug report: {why}")

    def _capped(self, path: Path) -> Path:
        try:
            if path.stat().st_size > self.max_bytes:
                os.truncate(path, self.max_bytes)
            os.chmod(path, 0o600)
        except OSError:
            pass  # what is there is kept; the note names it
        return path

    def _prune(self, directory: Path) -> None:
        """Keep the newest ``keep`` reports (by modification time)."""
        try:
            reports = sorted(
                (p for p in directory.glob("nvidia-bug-report-*.log*") if p.is_file()),
                key=lambda p: p.stat().st_mtime,
                reverse=True,
            )
        except OSError:
            return
        for old in reports[self.keep :]:
            try:
                old.unlink()
            except OSError:
                pass
