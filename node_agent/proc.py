"""The one way the agent runs external programs: an argv list, a timeout, a typed result.

Never ``shell=True``. Each program runs in a process group of its own (a new session). At its
deadline the whole group is killed, and when the program exits on its own, whatever it left
running in its group (a child that outlived its parent) is killed too: nothing a tool starts
escapes the timeout. (A grandchild that made a session of its own is outside the group; its
pipes are then closed after a short grace instead of waited on.) Its output is kept up to
``max_output_bytes`` a stream: a program that prints more is killed there (``cut``), so what
another user's process makes a tool print cannot fill the agent's memory.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
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
    cut: bool = False  # it printed more than max_output_bytes and was killed there

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.cut

    def describe_failure(self) -> str:
        """One line for an operator: what ran and how it failed, with the stderr tail."""
        cmd = " ".join(self.argv)
        if self.not_found:
            return f"{self.argv[0]}: command not found"
        if self.timed_out:
            return f"`{cmd}` did not finish within {self.duration_s:.0f} s and was killed"
        if self.cut:
            return f"`{cmd}` printed more than the agent reads of a program and was killed"
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


#: the most of one stream (stdout, stderr) kept of a program; the program is killed past it
MAX_OUTPUT_BYTES = 256 << 20


def run(
    argv: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    input_text: str | None = None,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> ProcResult:
    """Run ``argv`` with a timeout and at most ``max_output_bytes`` of each stream kept; never
    raises for the program's own failures."""
    argv = tuple(str(a) for a in argv)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError:
        return ProcResult(argv, None, "", "", 0.0, not_found=True)
    except OSError as err:
        return ProcResult(argv, None, "", str(err), 0.0)
    if proc.stdin is not None:
        _feed(proc.stdin, (input_text or "").encode())
    out, errout, ended = _read(proc, start + timeout_s, max_output_bytes)
    if ended != "eof":
        kill_group(proc)
    if ended == "timeout":  # what it wrote before the kill; pipes held by a stray are let go
        more_out, more_err, _ = _read(proc, time.monotonic() + _DRAIN_S, max_output_bytes)
        out, errout = (out + more_out)[:max_output_bytes], (errout + more_err)[:max_output_bytes]
    _close(proc)
    code = None
    if ended == "eof":  # both pipes closed; the program itself may still run past its deadline
        try:
            code = proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()
            ended = "timeout"
    # it exited; a child it left behind in its group would run on unbounded: end it now
    _kill_pgid(proc.pid)
    return ProcResult(
        argv,
        code,
        out.decode(errors="replace"),
        errout.decode(errors="replace"),
        time.monotonic() - start,
        timed_out=ended == "timeout",
        cut=ended == "cut",
    )


def _feed(stdin: Any, data: bytes) -> None:
    """Write the program's input from a thread of its own (a large input must not wait on a
    program that prints before it reads), then close it."""

    def write() -> None:
        try:
            stdin.write(data)
        except OSError:
            pass  # it exited without reading: its output says why
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    threading.Thread(target=write, name="proc-input", daemon=True).start()


def _read(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """stdout and stderr until both end (``eof``), ``deadline`` passes (``timeout``) or one
    passes ``cap`` bytes (``cut``)."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for pipe in kept:
            if pipe is not None and not pipe.closed:
                sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "timeout"
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]  # type: ignore[index]
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "cut"
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), "eof"


def _close(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


#: after a kill, how long to read what is left in the pipes before closing them
_DRAIN_S = 2.0


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
