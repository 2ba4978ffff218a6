"""Evidence collected before a disruptive action, so the people who repair the node know what
the agent saw: ``<state_dir>/evidence/<timestamp>-<action>/`` with

* ``report.json`` — the report that led to the action (when there is one);
* ``kernel-log.txt`` — the last lines of the kernel log (:mod:`node_agent.kernel_log`);
* ``stacks.txt`` — ``py-spy dump --pid`` of each GPU process when py-spy is installed and the
  pids are known (``nvidia-smi --query-compute-apps=pid``), else a line saying why not;
* ``notes.txt`` — what was collected and what was skipped.

Collecting evidence never stops the action: every failure becomes a note. The directory is
0700 and its files 0600, created with ``O_EXCL|O_NOFOLLOW``: the kernel log it copies may be
unreadable to users (``dmesg_restrict``), and the stacks show their code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from node_agent import proc
from node_agent.atomic_file import create_private, private_dir
from node_agent.kernel_log import KernelLog
from node_agent.model import Report
from node_agent.report import json_report
from node_agent.training.stacks import PY_SPY_MISSING, find_py_spy

KERNEL_LOG_TAIL_LINES = 300
PY_SPY_TIMEOUT_S = 20.0
NVIDIA_SMI_TIMEOUT_S = 15.0


def gpu_pids(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[list[int], str | None]:
    """PIDs of compute processes on the GPUs (``nvidia-smi --query-compute-apps=pid``)."""
    if proc.which("nvidia-smi") is None:
        return [], "nvidia-smi is not installed, so GPU process ids are unknown"
    result = proc.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader,nounits"],
                      timeout_s=timeout_s)
    if not result.ok:
        return [], f"cannot list GPU processes: {result.describe_failure()}"
    pids = sorted({int(tok) for tok in result.stdout.split() if tok.strip().isdigit()})
    return pids, None


def collect(state_dir: Path, action: str, now: float, report: Report | None,
            kernel_log: KernelLog | None, pids: Sequence[int] | None,
            pids_note: str | None = None) -> tuple[Path | None, list[str]]:
    """Write the evidence directory; returns (its path or None, notes). Never raises."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
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
            _write(directory / "kernel-log.txt",
                   "".join(f"{r.text}\n" for r in records), notes)
            notes.append(f"kernel log: last {len(records)} lines from {kernel_log.source}")
        except OSError as err:
            notes.append(f"kernel log: cannot read {kernel_log.source}: {err}")

    stacks = _stacks(pids, pids_note)
    _write(directory / "stacks.txt", stacks, notes)
    notes.append("stacks: " + stacks.splitlines()[0] if stacks else "stacks: none")
    _write(directory / "notes.txt", "".join(f"{n}\n" for n in notes), notes)
    return directory, notes


def _stacks(pids: Sequence[int] | None, pids_note: str | None) -> str:
    if not pids:
        return f"skipped: {pids_note or 'no GPU processes known'}\n"
    py_spy = find_py_spy()
    if py_spy is None:
        return (f"skipped: {PY_SPY_MISSING}; GPU pids were "
                f"{', '.join(map(str, pids))}\n")
    parts = [f"py-spy dump of GPU processes {', '.join(map(str, pids))}\n"]
    for pid in pids:
        result = proc.run([py_spy, "dump", "--pid", str(pid)], timeout_s=PY_SPY_TIMEOUT_S)
        parts.append(f"=== pid {pid} ===\n")
        parts.append(result.stdout if result.ok else f"failed: {result.describe_failure()}\n")
    return "".join(parts)


def _write(path: Path, text: str, notes: list[str]) -> None:
    try:
        fd = create_private(path)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        notes.append(f"cannot write {path}: {err.strerror or err}")
