"""``daemon --keep-socket``'s keeper, with a stand-in daemon: signals reach the daemon whenever
they come, the socket is passed as systemd passes it, and a crash is followed by a new daemon.

The keeper runs in a child Python (it installs signal handlers and forks); the daemon is a few
lines that report what they received on stderr (tests/integration/test_daemon_nvhcd.py runs the
real daemon under the keeper).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from waiting import wait_for  # tests/waiting.py

DAEMON = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    passed = os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS") == "1"
    listening = passed and socket.socket(fileno=3).getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGHUP, lambda *_: print("daemon reload", file=sys.stderr, flush=True))
    # announced only once it can take a reload: a SIGHUP before that ends it, as SIG_DFL does
    print(f"daemon {os.getpid()} socket={bool(listening)}", file=sys.stderr, flush=True)
    while not stop:
        time.sleep(0.02)
    """
)

#: the keeper; with a delay, its forked child waits before it execs, as on a busy node
KEEPER = textwrap.dedent(
    """
    import os, sys, time
    from node_agent.service import socket_keeper
    delay = float(sys.argv[3])
    real_fork = os.fork
    def slow_fork():
        pid = real_fork()
        if pid == 0:
            time.sleep(delay)
        return pid
    os.fork = slow_fork
    sys.exit(socket_keeper.keep_socket_and_run(
        sys.argv[1], None, [sys.executable, sys.argv[2]], first_restart_s=0.1))
    """
)


def keeper(tmp_path: Path, delay_s: float = 0.0) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "run").mkdir(mode=0o755)
    (tmp_path / "daemon.py").write_text(DAEMON)
    sock = tmp_path / "run" / "nvhcd.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", KEEPER, str(sock), str(tmp_path / "daemon.py"), str(delay_s)],
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, sock


#: each keeper's stderr, line by line, read in a thread: select() on the pipe missed a line the
#: buffered reader had already taken in with the one before it
_READERS: dict[int, queue.Queue[str]] = {}


def lines(proc: subprocess.Popen, count: int, within_s: float = 10.0) -> list[str]:
    """The next ``count`` lines the daemon wrote (a daemon the keeper left behind may hold the
    pipe open after the keeper is gone: the wait is bounded)."""
    if proc.pid not in _READERS:
        q: queue.Queue[str] = queue.Queue()
        _READERS[proc.pid] = q
        threading.Thread(target=lambda: [q.put(x) for x in proc.stderr], daemon=True).start()
    got: list[str] = []
    deadline = time.monotonic() + within_s
    while len(got) < count:
        try:
            line = _READERS[proc.pid].get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no line from the daemon within {within_s} s (keeper: {proc.poll()}): {got}"
            ) from None
        if line.startswith("daemon"):
            got.append(line.strip())
    return got


def test_the_daemon_gets_the_socket_and_a_reload_reaches_it_without_stopping_the_keeper(tmp_path):
    proc, sock = keeper(tmp_path)
    try:
        (started,) = lines(proc, 1)
        assert started.endswith("socket=True") and sock.exists()
        proc.send_signal(signal.SIGHUP)  # the daemon's "reload": was fatal to the keeper
        assert lines(proc, 1) == ["daemon reload"]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
        subprocess.run(["pkill", "-f", str(tmp_path / "daemon.py")], check=False)
    assert proc.returncode == 0 and not sock.exists()


def test_a_stop_sent_before_the_new_daemon_execs_still_stops_it(tmp_path):
    """A SIGTERM while the forked child has not exec'd the daemon yet ran the keeper's handler
    in the child, and was lost: the daemon never stopped, the keeper waited for it forever."""
    proc, sock = keeper(tmp_path, delay_s=0.5)
    assert wait_for(sock.exists, 10), "the keeper never bound its socket"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # within the child's half second before exec
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        subprocess.run(["pkill", "-f", str(tmp_path / "daemon.py")], check=False)
        raise AssertionError("the keeper did not stop: its daemon never got the SIGTERM") from None
    assert not sock.exists()
