"""Hold NVRx's socket across the daemon's restarts where no systemd does (a container).

NVRx's client takes a missing socket, and any error reaching it, as healthy: every restart of
the daemon would answer its restarts "healthy". systemd's socket unit keeps the socket listening
while the daemon restarts; in a container ``node-agent daemon --keep-socket`` does the same. This
process binds ``daemon.nvhcd.socket`` and runs the daemon as its child, passing the socket as
systemd does (fd 3, ``LISTEN_FDS=1``, ``LISTEN_PID`` the child's), and starts a new daemon when
one exits. A call made meanwhile waits in the socket's backlog (NVRx's client waits up to 60 s by
default) and is answered by the next daemon.

A daemon that exits with a usage or configuration error (exit 2) is not restarted: the keeper
exits with it, so the container's restarts show it. SIGTERM or SIGINT stops the daemon and then
the keeper, with the daemon's exit status; SIGHUP is passed on (the daemon reloads).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from node_agent.service.nvhcd import public_listener
from node_agent.service.sd_notify import LISTEN_FDS_START

log = logging.getLogger(__name__)

#: the exit status of a daemon refused its configuration or arguments: restarting cannot help
USAGE_EXIT = 2
FIRST_RESTART_S = 1.0
LONGEST_RESTART_S = 30.0
#: a daemon that ran this long before it exited restarts after the shortest wait again
STEADY_S = 60.0
#: what the keeper passes on to the daemon (SIGHUP: reload its configuration); the first two
#: also stop the keeper
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOPPING = (signal.SIGTERM, signal.SIGINT)


def keep_socket_and_run(
    path: str | os.PathLike[str],
    group: str | None,
    argv: Sequence[str],
    *,
    first_restart_s: float = FIRST_RESTART_S,
) -> int:
    """Bind ``path`` and run ``argv`` with it until told to stop; the daemon's exit status."""
    stopping: list[int] = []
    child = 0

    def forward(signum: int, _frame: object) -> None:
        if signum in STOPPING:
            stopping.append(signum)
        if child:
            _signal(child, signum)

    for signum in FORWARDED:  # before the socket exists: a stop sent once it does is kept
        signal.signal(signum, forward)
    listener, notes = public_listener(Path(path), group)
    for note in notes:
        log.warning("%s", note)
    wait_s, status = first_restart_s, 0
    try:
        while True:
            started = time.monotonic()
            # held back until the child's pid is known: one sent meanwhile reaches it after
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
            try:
                if stopping:
                    return status
                child = _start(argv, listener.fileno())
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            log.info("daemon started (pid %d), holding %s for it", child, path)
            status = _exit_status(_wait(child))
            child = 0
            if stopping:
                return status
            if status == USAGE_EXIT:
                log.error("the daemon refused its configuration (exit 2): not restarted")
                return status
            if time.monotonic() - started >= STEADY_S:
                wait_s = first_restart_s
            log.warning(
                "the daemon exited (status %d); %s stays held, a new daemon in %.0f s",
                status,
                path,
                wait_s,
            )
            _sleep_unless_stopped(wait_s, stopping)
            if stopping:
                return status
            wait_s = min(wait_s * 2, LONGEST_RESTART_S)
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _start(argv: Sequence[str], fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: the socket as systemd passes it, then the daemon
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        if fd == LISTEN_FDS_START:
            os.set_inheritable(fd, True)
        else:
            os.dup2(fd, LISTEN_FDS_START)
        os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
        os.execv(argv[0], list(argv))
    finally:
        os._exit(127)


def _wait(pid: int) -> int:
    return os.waitpid(pid, 0)[1]  # retried across the signal handler's calls (PEP 475)


def _exit_status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _sleep_unless_stopped(seconds: float, stopping: list[int]) -> None:
    end = time.monotonic() + seconds
    while not stopping and (left := end - time.monotonic()) > 0:
        time.sleep(min(0.1, left))
