"""Run several ``node-agent`` processes as forks of one interpreter that imported torch once.

A multi-rank test (six stop-check ranks, say) otherwise starts six interpreters that each import
torch, several CPU-seconds apiece on a small CI machine, before the ranks do anything the test
is about. Here one Python process (the *zygote*) imports torch and the agent's commands, then
forks one child per invocation; each child is a real process of its own (its pid, environment,
working directory, stdout and stderr), runs ``node_agent.commands.main.main(argv)`` exactly as
the ``node-agent`` console script does, and exits with its code through the interpreter's
normal shutdown. Nothing in the zygote runs torch before it forks (no thread pool, no process
group): the children start torch.distributed themselves.

What this does not prove: how a launcher starts the console script. Tests of the launchers
(torchrun, srun) and of what torch prints before the agent can set its log level start real
``node-agent`` processes instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: the zygote: imports, then reads JSON lists of invocations on stdin, one list a line; for each
#: it forks one child per invocation, waits for them all and prints ``{"<index>": exit code}``
ZYGOTE = r"""
import gc, json, os, sys
try:  # imported once, for every child; a host without torch runs the agent without it
    import torch.distributed  # noqa: F401
except ImportError:
    pass
from node_agent.commands.main import command, main
for name in sys.argv[1:]:
    command(name)  # the subcommand's modules imported too
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
            sys.exit(main(job["argv"]))
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
    """One zygote (see :data:`ZYGOTE`), kept for several batches of invocations: the tests of
    a module that each run ``node-agent`` share its imports. Close it when done (a
    module-scoped fixture); on a timeout it is killed with every child."""

    def __init__(self, tmp: Path, subcommands: tuple[str, ...]) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.batches = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, *subcommands],
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


def run_forked(
    invocations: list[Invocation], tmp: Path, timeout: float, subcommand: str
) -> list[tuple[int, str, str]]:
    """Run every invocation at once, each a fork of a zygote that imported torch and the
    agent's ``subcommand``, made for them alone; (exit code, stdout, stderr) per invocation."""
    zygote = Zygote(tmp, (subcommand,))
    try:
        return zygote.run(invocations, timeout)
    finally:
        zygote.close()
