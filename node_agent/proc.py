"""The one way the agent runs external programs: an argv list, a timeout, a typed result.

Never ``shell=True``. A program that outlives its timeout is killed with its whole process
group, so a hung tool leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcResult:
    argv: tuple[str, ...]
    returncode: int | None  # None when it timed out or could not start
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    not_found: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe_failure(self) -> str:
        """One line for an operator: what ran and how it failed, with the stderr tail."""
        cmd = " ".join(self.argv)
        if self.not_found:
            return f"{self.argv[0]}: command not found"
        if self.timed_out:
            return f"`{cmd}` did not finish within {self.duration_s:.0f} s and was killed"
        tail = (self.stderr.strip().splitlines() or [""])[-1][:300]
        return f"`{cmd}` exited {self.returncode}" + (f": {tail}" if tail else "")


def which(program: str) -> str | None:
    return shutil.which(program)


def run(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None, input_text: str | None = None) -> ProcResult:
    """Run ``argv`` with a timeout; never raises for the program's own failures."""
    argv = tuple(str(a) for a in argv)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    except FileNotFoundError:
        return ProcResult(argv, None, "", "", 0.0, not_found=True)
    except OSError as err:
        return ProcResult(argv, None, "", str(err), 0.0)
    try:
        out, err = proc.communicate(input=input_text, timeout=timeout_s)
        return ProcResult(argv, proc.returncode, out, err, time.monotonic() - start)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return ProcResult(argv, None, out or "", err or "", time.monotonic() - start,
                          timed_out=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a process started with ``start_new_session=True`` and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
