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
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: the zygote: imports, then reads one JSON list of invocations on stdin, forks one child per
#: invocation, waits for them all and prints ``{"<index>": exit code}``
ZYGOTE = r"""
import json, os, sys
import torch  # noqa: F401 - imported once, for every child
import torch.distributed  # noqa: F401
from node_agent.commands.main import command, main
for name in sys.argv[1:]:
    command(name)  # the subcommand's modules imported too
jobs = json.loads(sys.stdin.readline())
pids = {}
for i, job in enumerate(jobs):
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
        sys.argv = ["node-agent", *job["argv"]]
        sys.exit(main(job["argv"]))
    pids[pid] = i
codes = {}
while pids:
    pid, status = os.wait()
    codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes))
"""


@dataclass(frozen=True)
class Invocation:
    """One ``node-agent ARGV`` with its own environment, run in ``cwd``."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


def run_forked(
    invocations: list[Invocation], tmp: Path, timeout: float, subcommand: str
) -> list[tuple[int, str, str]]:
    """Run every invocation at once, each a fork of one zygote that imported torch and the
    agent's ``subcommand``; returns (exit code, stdout, stderr) per invocation, in order.

    On ``timeout`` the zygote's process group (it and every child) is killed and
    ``subprocess.TimeoutExpired`` raised."""
    tmp.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, inv in enumerate(invocations):
        jobs.append(
            {
                "argv": inv.argv,
                "env": inv.env,
                "cwd": str(inv.cwd),
                "stdout": str(tmp / f"{i}.out"),
                "stderr": str(tmp / f"{i}.err"),
            }
        )
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, subcommand],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp,
        start_new_session=True,  # its own process group: killed with its children on timeout
    )
    try:
        out, _ = zygote.communicate(json.dumps(jobs) + "\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(zygote.pid, signal.SIGKILL)
        zygote.wait()
        raise
    assert zygote.returncode == 0 and out.strip(), f"the zygote failed (exit {zygote.returncode})"
    codes = json.loads(out.strip().splitlines()[-1])
    return [
        (
            int(codes[str(i)]),
            (tmp / f"{i}.out").read_text(),
            (tmp / f"{i}.err").read_text(),
        )
        for i in range(len(invocations))
    ]
