"""Run ``node-agent`` processes as forks of one interpreter that imported the agent once.

Every test that runs ``node-agent`` would otherwise start an interpreter that imports the
agent (a third of a simulated ``check``'s CPU) and, for the compute checks and the stop-check
ranks, torch (several CPU-seconds on a small CI machine), hundreds of times in ``make test``.
Here one Python process (the *zygote*) imports torch, every command and every registered check
once, then forks one child per invocation; each child is a real process of its own (its pid,
environment, working directory, stdout and stderr), runs ``node_agent.commands.main.main(argv)``
exactly as the ``node-agent`` console script does, and exits with its code as the
interpreter's shutdown would (its threads waited for, its exit handlers run, its output
flushed; :data:`ZYGOTE`'s ``finish`` says what is left out and why). Nothing in the zygote
runs torch before it forks (no thread pool, no process group): the children start
torch.distributed themselves.

What this does not prove: how the console script starts (what an import prints before the
agent sets its log level, what the dynamic loader reads from the environment at exec, such as
``LD_LIBRARY_PATH``), and how a launcher (torchrun, srun, Slurm's scripts, the image) starts
it. The tests of those start real ``node-agent`` processes instead: tests/integration/
test_image.py, test_slurm_scripts.py, test_nvml_fake.py, the bare work tree's in
tests/unit/test_gpu_validate_harness.py, and the security tests' own ``run_agent``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

#: the zygote: imports, then reads JSON lists of invocations on stdin, one list a line; for each
#: it forks one child per invocation, waits for them all and prints ``{"<index>": exit code}``
ZYGOTE = r"""
import atexit, gc, importlib, json, os, sys, threading


def finish(run):
    # What the interpreter does when a script ends (Py_FinalizeEx): the exit status of its
    # SystemExit or uncaught exception, then it waits for the non-daemon threads, runs the exit
    # handlers and flushes stdout and stderr. What it would do next, dismantle every module and
    # object, is left out: those pages are the zygote's, so each child would copy them all to
    # decrement their reference counts (0.2 user + 0.2 system CPU-s a run).
    try:
        code = run()
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


try:  # imported once, for every child; a host without torch runs the agent without it
    import torch.distributed  # noqa: F401
except ImportError:
    pass
from node_agent.checking.registry import REGISTRY
from node_agent.commands.main import _COMMANDS, command, main
for name in _COMMANDS:
    command(name)  # each subcommand's module imported too
for module in REGISTRY.values():
    importlib.import_module(module)  # and each check's
gc.freeze()  # what is loaded stays shared: no child's collection walks or copies it
for line in sys.stdin:
    pids = {}
    for i, job in enumerate(json.loads(line)):
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(out, fd)
                os.close(out)
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            sys.argv = [job["argv0"], *job["argv"]]
            finish(lambda: main(job["argv"]))
        pids[pid] = i
    codes = {i: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, i in pids.items()}
    print(json.dumps(codes), flush=True)
"""


@dataclass(frozen=True)
class Invocation:
    """One ``node-agent ARGV`` with its own environment, run in ``cwd``."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    argv0: str = "node-agent"  # sys.argv[0]: the console script's, or "-c" as run_agent's


class Zygote:
    """One zygote (see :data:`ZYGOTE`), kept for many batches of invocations: the tests that
    each run ``node-agent`` share its imports. Close it when done (the session's fixture); on a
    timeout it is killed with every child."""

    def __init__(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.batches = 0
        self.lock = threading.Lock()  # one batch at a time: a test's threads may each run one
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp,
            start_new_session=True,  # its own process group: killed with its children
        )

    def run(self, invocations: list[Invocation], timeout: float) -> list[tuple[int, str, str]]:
        """Run every invocation at once, each a fork of the zygote; (exit code, stdout,
        stderr) per invocation, in order. ``subprocess.TimeoutExpired`` after ``timeout``,
        the zygote and its children killed."""
        with self.lock:
            return self._run(invocations, timeout)

    def _run(self, invocations: list[Invocation], timeout: float) -> list[tuple[int, str, str]]:
        self.batches += 1
        base = self.tmp / f"batch-{self.batches}"
        base.mkdir()
        jobs = [
            {
                "argv": inv.argv,
                "argv0": inv.argv0,
                "env": inv.env,
                "cwd": str(inv.cwd),
                "stdout": str(base / f"{i}.out"),
                "stderr": str(base / f"{i}.err"),
            }
            for i, inv in enumerate(invocations)
        ]
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(jobs) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, timeout)
        assert line.strip(), f"the zygote ended (exit {self.proc.poll()}): see its stderr"
        codes = json.loads(line)
        return [
            (
                int(codes[str(i)]),
                (base / f"{i}.out").read_text(),
                (base / f"{i}.err").read_text(),
            )
            for i in range(len(invocations))
        ]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """A line of ``proc``'s stdout, or its group killed and TimeoutExpired after ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.stdout.readline()
