"""The one way the agent runs external programs: an argv list, a timeout, a typed result.

Never ``shell=True``. Each program runs in a process group of its own (a new session). At its
deadline the whole group is killed, and when the program exits on its own, whatever it left
running in its group (a child that outlived its parent) is killed too: nothing a tool starts
escapes the timeout. (A grandchild that made a session of its own is outside the group; its
pipes are then closed after a short grace instead of waited on.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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


#: Python 3.10 has no ``-P``. ``-c`` code starts with ``sys.path[0] == ""`` (the working
#: directory), added after ``site`` ran: the code drops it before it imports anything (``sys`` is
#: built in), then runs the module as ``-m`` does.
_DROP_CWD = "import sys; sys.path[:] = [p for p in sys.path if p]\n"
_RUN_MODULE = "import runpy; runpy._run_module_as_main(sys.argv.pop(1))"


def python_module_argv(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -P -m module args...``: a child Python that never imports from its working
    directory. Plain ``-m`` puts the cwd first on ``sys.path``, so a root agent started from a
    directory others can write to would run a planted ``node_agent/`` or ``torch.py`` as root;
    ``-P`` (Python 3.11) leaves it out, and on 3.10 a ``-c`` bootstrap does the same.
    ``PYTHONPATH`` still applies: it is root's own setting. Run such children with
    ``cwd="/"`` (:data:`CHILD_CWD`) and absolute path arguments."""
    if sys.version_info >= (3, 11):
        return [python, "-P", "-m", module, *args]
    return [python, "-c", _DROP_CWD + _RUN_MODULE, module, *args]


def python_code_argv(code: str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -P -c code args...``, on 3.10 as well: code that never imports from the working
    directory."""
    if sys.version_info >= (3, 11):
        return [python, "-P", "-c", code, *args]
    return [python, "-c", _DROP_CWD + code, *args]


#: where the agent's own children run: a directory only root can write to
CHILD_CWD = "/"

#: the configuration keys (dotted) that hold a file or directory path; a relative one means
#: relative to the agent's working directory, which its children (in :data:`CHILD_CWD`) lack
CONFIG_PATH_KEYS = (
    "state_dir",
    "spool_dir",
    "suites_dir",
    "graders_dir",
    "storage.paths",
    "kernel_log.path",
    "adapter.webhook.secret_file",
    "adapter.webhook.ca_file",
    "adapter.webhook.client_cert",
    "adapter.webhook.client_key",
    "adapter.kubernetes.kubeconfig",
    "dcgm.bindings_path",
)
#: keys that name a program: a bare name is looked up on PATH, a name with a slash is a path
CONFIG_PROGRAM_KEYS = ("adapter.slurm.scontrol", "adapter.slurm.squeue")


#: what the forkserver imports once, when it starts, for every worker it forks: without it
#: each burn and PCIe worker imports torch itself (8 workers, 8 imports of several seconds).
#: The forkserver skips a module that does not import (a host without torch).
FORKSERVER_PRELOAD = ["torch", "node_agent.compute.devices"]


def start_forkserver_in_child_cwd() -> None:
    """Start multiprocessing's forkserver (one per process, shared by every ``forkserver``
    context) from :data:`CHILD_CWD`, once, before checks that use it run.

    The forkserver is ``python -c ...``, which puts its working directory first on
    ``sys.path``: started from a directory others can write to, a planted ``multiprocessing/``
    would run as root. Started from ``/`` it imports nothing from there, and the workers it
    forks later take the parent's ``sys.path``, which has no working directory entry. Call it
    before other threads run: ``os.chdir`` is process-wide (the working directory is restored
    at once)."""
    from multiprocessing import forkserver

    # before it starts: a context's set_forkserver_preload once it runs changes nothing
    forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    try:
        here: str | None = os.getcwd()
    except OSError:  # the working directory was removed
        here = None
    if here == CHILD_CWD:
        forkserver.ensure_running()
        return
    os.chdir(CHILD_CWD)
    try:
        forkserver.ensure_running()
    finally:
        if here is not None:
            os.chdir(here)


def absolute_path(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute against this process's working directory, for a child that runs
    in :data:`CHILD_CWD` (``--simulate scenarios/x.yaml`` -> ``/home/op/scenarios/x.yaml``)."""
    return os.path.abspath(os.fspath(path))


def absolute_config(data: Mapping[str, object]) -> dict[str, object]:
    """A copy of a configuration's ``data`` whose relative paths (:data:`CONFIG_PATH_KEYS`,
    and program keys that contain a slash) are made absolute, so a child started in
    :data:`CHILD_CWD` with it reads the same files as this process."""
    import copy

    out = copy.deepcopy(dict(data))

    def fix(value: object, program: bool) -> object:
        if isinstance(value, list):
            return [fix(v, program) for v in value]
        if (
            isinstance(value, str)
            and value
            and not os.path.isabs(value)
            and (not program or "/" in value)
        ):
            return absolute_path(value)
        return value

    for key, program in [(k, False) for k in CONFIG_PATH_KEYS] + [
        (k, True) for k in CONFIG_PROGRAM_KEYS
    ]:
        *parents, last = key.split(".")
        node: object = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            node[last] = fix(node[last], program)
    return out


def run(
    argv: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    input_text: str | None = None,
) -> ProcResult:
    """Run ``argv`` with a timeout; never raises for the program's own failures."""
    argv = tuple(str(a) for a in argv)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError:
        return ProcResult(argv, None, "", "", 0.0, not_found=True)
    except OSError as err:
        return ProcResult(argv, None, "", str(err), 0.0)
    try:
        out, errout = proc.communicate(input=input_text, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, errout = _leftover_output(proc)
        return ProcResult(argv, None, out, errout, time.monotonic() - start, timed_out=True)
    # it exited; a child it left behind in its group would run on unbounded: end it now
    _kill_pgid(proc.pid)
    return ProcResult(argv, proc.returncode, out, errout, time.monotonic() - start)


#: after a kill, how long to read what is left in the pipes before closing them
_DRAIN_S = 2.0


def _leftover_output(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What the killed program wrote; pipes still held open by something outside its group
    are closed after ``_DRAIN_S`` rather than waited on for ever."""
    try:
        out, err = proc.communicate(timeout=_DRAIN_S)
        return out or "", err or ""
    except subprocess.TimeoutExpired as exc:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        proc.wait()
        return _text(exc.output), _text(exc.stderr)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _kill_pgid(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group (the common case)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """Kill a process started with ``start_new_session=True`` and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
