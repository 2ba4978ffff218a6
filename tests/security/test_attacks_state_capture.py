"""Issue 34's medium and low findings on the agent's own state and on ``capture``, each
replayed by a real unprivileged user (``useradd``, ``conftest.py``) against root's agent (the
real ``node-agent`` command, against a simulated node: no GPU here).

- **The growing ``runs`` table.** The user's stale ``sleep`` processes (each with an hour-old
  heartbeat) make every run of ``training_progress`` a new WARN with a reason per process, and
  root's ``check --act`` (as the daemon) recorded each run whole, for ever.
- **A symlinked ``--from-readings`` directory.** The user hands root a readings directory (a
  bug report) whose kernel log is a link to ``/etc/shadow``, or a FIFO.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from agent_daemon import agent_daemon, graded_daemon  # tests/agent_daemon.py
from test_attacks import config, node, report, results, run_agent, spool, suite

from node_agent.remediation.store import (
    DB_NAME,
    RUN_REASONS_MAX_BYTES,
    RUNS_MAX_ROWS,
    RUNS_PRUNE_EVERY,
    open_store,
)

REPO = Path(__file__).resolve().parents[2]
SHARED_H100 = REPO.parent / "shared" / "realworld" / "gpu-h100-vm"

# the user's load: N processes, each beats one hour-old heartbeat and execs sleep
STALE_SLEEPERS = r"""
import os, sys, time
from node_agent.heartbeat import Heartbeat
pids = []
for _ in range(int(sys.argv[2])):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600).beat(5)
        os.close(w)
        os.execv("/bin/sleep", ["sleep", "300"])
    os.close(w)
    os.read(r, 1)  # the heartbeat is written when the child closes its end (exec closes it)
    os.close(r)
    pids.append(pid)
print(*pids, flush=True)
os.wait()
"""


def test_a_users_stale_sleepers_leave_the_runs_table_bounded(user, shared_dir):
    """200 such processes grew root's runs table about 1 GB a day: each run of the check was
    a WARN with 200 reasons, recorded whole. Now a run keeps its reasons up to a bound, and
    the table is pruned to RUNS_MAX_ROWS when the store opens and as rows are added."""
    hb = spool(shared_dir, "heartbeat")
    sleepers = user.popen(STALE_SLEEPERS, str(hb), "60")
    pids = [int(p) for p in sleepers.first_line.split()]
    try:
        _runs_table_attack(shared_dir, hb, pids)
    finally:
        for pid in pids:  # the user's sleepers, by pid (their launcher is killed by the fixture)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _runs_table_attack(shared_dir: Path, hb: Path, pids: list[int]) -> None:
    # what an agent without the bound left: more rows than the table may keep
    state = shared_dir / "state"
    store = open_store(state)
    store._conn.execute("BEGIN")
    store._conn.executemany(
        "INSERT INTO runs (at, node, suite, mode, level, reasons) VALUES (?,?,?,?,?,?)",
        [
            (time.time() - 86400 + i, "n", "daemon", "service", "WARN", "[]")
            for i in range(RUNS_MAX_ROWS + 50)
        ],
    )
    store._conn.execute("COMMIT")
    store.close()
    entry = {"check": "training_progress", "timeout_s": 60, "params": {"spool_dir": str(hb)}}
    done = run_agent(
        "check",
        "--act",
        "--suite",
        suite(shared_dir, entry),
        "--simulate",
        node(shared_dir),
        "--config",
        config(shared_dir),
        "--json",
        timeout=300,
    )
    rep = report(done)
    hangs = {r["evidence"]["pid"] for r in results(rep, "training_hang")}
    assert hangs == set(pids), sorted(hangs ^ set(pids))[:5]
    assert rep["grade"]["level"] == "WARN" and len(rep["grade"]["reasons"]) >= 60
    conn = sqlite3.connect(state / DB_NAME)
    try:
        (rows,) = conn.execute("SELECT COUNT(*) FROM runs").fetchone()
        newest, size = conn.execute(
            "SELECT reasons, length(reasons) FROM runs ORDER BY id DESC LIMIT 1"
        ).fetchone()
    finally:
        conn.close()
    # pruned at open to leave room for the rows added before the next prune; this run added
    assert rows == RUNS_MAX_ROWS - RUNS_PRUNE_EVERY + 1
    assert size <= RUN_REASONS_MAX_BYTES and "runs-reasons-cut" in newest


def _readings_from(user, dest: Path) -> Path:
    """The user's readings directory: the real H100 host's files, copied by the user."""
    if not SHARED_H100.is_dir():
        pytest.skip(f"the real readings are not here ({SHARED_H100} is absent)")
    dest.mkdir()
    os.chown(dest, user.uid, user.gid)  # the user's own directory, as its home would be
    user.py(
        "import os, shutil, sys\n"
        "for n in ('nvml-readings.json', 'kernel-log-boot.txt', 'PROVENANCE.md'):\n"
        "    shutil.copyfile(os.path.join(sys.argv[1], n), os.path.join(sys.argv[2], n))\n",
        str(SHARED_H100),
        str(dest),
    )
    return dest


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_readings_directory_with_a_link_to_etc_shadow_is_refused(user, shared_dir, kind):
    src = _readings_from(user, shared_dir / "bug-report")
    log = src / "kernel-log-boot.txt"
    make = (
        "os.symlink('/etc/shadow', sys.argv[1])" if kind == "symlink" else "os.mkfifo(sys.argv[1])"
    )
    user.py(f"import os, sys\nos.unlink(sys.argv[1])\n{make}\n", str(log))
    out = shared_dir / "captured.yaml"
    try:
        done = run_agent("capture", "--from-readings", str(src), str(out), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("root's capture blocked on the user's FIFO")
    assert done.returncode == 2, done.stderr[-2000:]
    said = "is a symbolic link" if kind == "symlink" else "is a FIFO, not a regular file"
    assert "kernel-log-boot.txt" in done.stderr and said in done.stderr, done.stderr
    assert not out.exists()
    shadow = Path("/etc/shadow").read_text() if Path("/etc/shadow").exists() else ""
    first = shadow.split(":", 2)[:2]
    assert not first[1:] or ":".join(first) not in done.stderr


# -- Low: the state dir and the spool share a parent that does not exist yet ----------------------

USER_BEATS = r"""
import sys
from node_agent.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], min_interval_s=0)
hb.beat(1)
print(hb.path, flush=True)
"""


def _daemon_until_spool(shared_dir: Path, base: Path) -> str:
    """Root's real daemon, under the systemd unit's umask 077, with state_dir and spool_dir
    side by side in ``base``; stopped once it logged the spool's last directory made (after
    every note on the way to it). Returns its log."""
    cfg = config(
        shared_dir,
        state_dir=str(base / "state"),
        spool_dir=str(base / "spool"),
        daemon={"listen": "127.0.0.1:0"},
    )
    entry = {"check": "training_progress", "timeout_s": 30, "every_s": 300, "params": {}}
    log_path = shared_dir / "daemon.log"
    checks = suite(shared_dir, entry, name="spool-parent")
    with agent_daemon(cfg, node(shared_dir), checks, log_path, umask=0o077) as daemon:
        deadline = time.monotonic() + 90
        last = f"made spool {base / 'spool' / 'sdc'}"
        while last not in log_path.read_text() and time.monotonic() < deadline:
            assert daemon.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.2)
    return log_path.read_text()


def test_a_spool_beside_the_state_dir_in_a_new_parent_is_reachable_by_users(user, shared_dir):
    """The parent was made 0700 (the umask): no user could write a heartbeat, and nothing
    said so. Now the parents the agent makes are 0755 and the state dir alone is 0700."""
    base = shared_dir / "node-agent"
    log = _daemon_until_spool(shared_dir, base)
    assert "cannot reach the spool" not in log
    assert (base.stat().st_mode & 0o777, (base / "state").stat().st_mode & 0o777) == (0o755, 0o700)
    written = Path(user.py(USER_BEATS, str(base / "spool" / "heartbeat")).stdout.strip())
    assert written == base / "spool" / "heartbeat" / str(user.uid) / f"{written.stem}.json"
    assert written.stat().st_uid == user.uid


def test_an_existing_parent_users_cannot_pass_is_named_at_the_daemons_start(user, shared_dir):
    base = shared_dir / "node-agent"
    base.mkdir(mode=0o700)  # what an older agent left
    base.chmod(0o700)
    log = _daemon_until_spool(shared_dir, base)
    assert f"training users cannot reach the spool {base / 'spool'}: {base} is mode 0700" in log
    assert f"chmod o+x {base}" in log
    # the warning is right: the user really cannot write a heartbeat there
    done = user.py(USER_BEATS, str(base / "spool" / "heartbeat"))
    assert f"make {base / 'spool' / 'heartbeat'} writable for this user" in done.stderr
    assert not (base / "spool" / "heartbeat" / str(user.uid)).exists()


def test_a_users_link_at_the_state_dirs_name_leads_root_nowhere(user, shared_dir):
    """state_dir under a sticky, world-writable directory and not made yet: the user plants
    its name as a link to a root directory. Root's agent neither chmods that directory 0700
    nor writes its state into it; it says why and runs on without keeping state."""
    sticky = shared_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = shared_dir / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    (victim / "tool").write_text("root's\n")
    state = sticky / "node-agent-state"
    user.run(["ln", "-s", str(victim), str(state)])
    cfg = config(shared_dir, state_dir=str(state))
    done = run_agent("check", "--json", "--config", cfg, "--simulate", node(shared_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert victim.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in victim.iterdir()) == ["tool"]


def test_the_daemon_writes_no_state_into_a_state_dir_a_user_made(user, shared_dir):
    """The daemon refuses a state_dir another user owns ("the node's state is not kept") and
    then keeps its word: no state file appears there for the user to read or replace."""
    sticky = shared_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    state = sticky / "state"
    user.run(["mkdir", "-m", "0777", str(state)])
    cfg = config(shared_dir, state_dir=str(state), daemon={"listen": "127.0.0.1:0", "act": False})
    checks = suite(shared_dir, {"check": "inventory", "timeout_s": 10, "every_s": 3600})
    with graded_daemon(cfg, node(shared_dir), checks):
        time.sleep(0.5)  # the state thread's turn
    assert list(state.iterdir()) == []
