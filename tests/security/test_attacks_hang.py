"""Issue 29's attacks through the hang check, each replayed by a real unprivileged user.

The attacker is a user made with ``useradd`` (``conftest.py``); the agent runs as root, as the
real ``node-agent check --act`` command and the real daemon, against a simulated node (no GPU
here: the simulator stands in for NVML; the training processes, their heartbeats, ``/proc``,
py-spy and the remediation are real). What a user controls (its processes, their heartbeats) may make the
node WARN at most: never an ERROR, a drain or a reboot, and never keep a drained node from
its resume (docs/security.md, docs/training_hangs.md).

The processes blocked in ``vfork()`` are made with a 12-line C library compiled here with
``cc`` and called through ``ctypes`` (Python has no ``os.vfork``, and a ``ctypes`` call of libc's
``vfork`` would run the interpreter in the child on the parent's memory): the child only sleeps
and ``_exit``\\ s, as vfork(2) allows, and leaves as soon as its parent is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from agent_daemon import agent_daemon  # tests/agent_daemon.py
from test_attacks import config, node, report, results, run_agent, spool, suite

from node_agent.remediation.store import open_store
from node_agent.training.stacks import find_py_spy

REPO = Path(__file__).resolve().parents[2]
ATTACK_PROCESSES = 80

VFORK_C = r"""
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
/* Block the caller in vfork() until its parent dies or `seconds` pass. */
int block_in_vfork(unsigned seconds) {
    pid_t parent = getpid();
    pid_t child = vfork();
    if (child == 0) { while (seconds-- > 0 && getppid() == parent) sleep(1); _exit(0); }
    if (child < 0) return -1;
    int status; waitpid(child, &status, 0); return 0;
}
"""

# the user's launcher: N processes, each with a heartbeat an hour stale, then blocked in vfork
VFORK_LAUNCHER = r"""
import ctypes, os, sys, time
from node_agent.heartbeat import Heartbeat
spool, lib, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
block = ctypes.CDLL(lib).block_in_vfork
r, w = os.pipe()
pids = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        Heartbeat(spool, min_interval_s=0, wall=lambda: time.time() - 3600).beat(5)
        os.write(w, b".")
        os.close(w)
        block(300)
        os._exit(0)
    pids.append(pid)
os.close(w)
got = 0
while got < count:
    chunk = os.read(r, count)
    if not chunk:
        break
    got += len(chunk)
print("ready", *pids, flush=True)
time.sleep(300)
"""

# a user's own idle process whose heartbeat says its last step was an hour ago
STALE_IDLE = r"""
import sys, time
from node_agent.heartbeat import Heartbeat
Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600).beat(5)
print("ready", flush=True)
time.sleep(300)
"""


def periodic_entry(spool_dir: Path) -> dict:
    """The daemon's own ``training_progress`` entry (suites/periodic.yaml: its timeout and
    params), reading the test's spool."""
    periodic = yaml.safe_load((REPO / "suites" / "periodic.yaml").read_text())
    (entry,) = [c for c in periodic["checks"] if c["check"] == "training_progress"]
    return {
        "check": "training_progress",
        "timeout_s": entry["timeout_s"],
        "params": {**entry["params"], "spool_dir": str(spool_dir)},
    }


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "?"


#: the readers of the module's one ``vfork_blocked`` set: on one xdist worker, so it is made once
VFORK_BLOCKED = pytest.mark.xdist_group("attacks_hang_vfork_blocked")


@pytest.fixture(scope="module")
def vfork_blocked(attacker):
    """The attacker's ATTACK_PROCESSES processes, blocked in vfork() with hour-old heartbeats
    (claiming Slurm job 4242, which no slurmd cgroup backs), shared by this module's tests:
    (the spool they wrote, their pids)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc): cannot build the vfork blocker (Debian package gcc)")
    base = Path(tempfile.mkdtemp(prefix="na-security-vfork-", dir="/tmp"))
    base.chmod(0o755)
    src, lib = base / "vfork.c", base / "libvfork.so"
    src.write_text(VFORK_C)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    lib.chmod(0o755)
    hb = spool(base, "heartbeat")
    launcher = attacker.popen(
        VFORK_LAUNCHER,
        str(hb),
        str(lib),
        str(ATTACK_PROCESSES),
        env={"SLURM_JOB_ID": "4242", "RANK": "0"},
    )
    pids = [int(p) for p in launcher.first_line.split()[1:]]
    try:
        deadline = time.monotonic() + 30
        while any(_state(pid) != "D" for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)  # vfork's parent waits uninterruptibly (state D)
        assert all(_state(pid) == "D" for pid in pids), "the processes are not in vfork()"
        yield hb, pids
    finally:
        for pid in pids:  # the test's own processes, by pid: the blocked children first
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        attacker.stop_children()
        shutil.rmtree(base, ignore_errors=True)


@VFORK_BLOCKED
def test_80_processes_blocked_in_vfork_with_stale_heartbeats_are_a_warn_never_a_drain(
    attacker, shared_dir, vfork_blocked
):
    """Issue 29, High 1: a stopping py-spy waits its whole timeout on each such process, so
    the check ran past its 45 s, check-hang graded ERROR, and the node was drained and a
    reboot requested. Now: samples do not stop the process, calls are capped and shared per
    uid within the check's own deadline, and an unverified job's hang is a WARN."""
    hb, pids = vfork_blocked
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.skip("py-spy is not installed: the attack is on the agent's py-spy calls")
    # the attack is real: a py-spy that stops the process waits on it
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([py_spy, "dump", "--pid", str(pids[0])], capture_output=True, timeout=3)

    entry = periodic_entry(hb)
    checks = suite(shared_dir, entry)
    began = time.monotonic()
    done = run_agent(
        "check",
        "--act",
        "--suite",
        checks,
        "--simulate",
        node(shared_dir),
        "--config",
        config(shared_dir),
        "--json",
        timeout=180,
    )
    took_s = time.monotonic() - began
    rep = report(done)
    assert done.returncode == 0, rep["grade"]
    assert took_s < entry["timeout_s"], f"the run took {took_s:.1f} s"
    assert not results(rep, "timeout") and not results(rep, "crashed")
    assert rep["grade"]["level"] == "WARN", rep["grade"]
    assert rep["actions"] == []  # no drain, no reboot, no job restart
    assert not (shared_dir / "state" / "actions.log").exists()
    hangs = results(rep, "training_hang")
    assert {r["evidence"]["pid"] for r in hangs} == set(pids)
    assert all(r["status"] == "warn" and r["evidence"]["verified"] is False for r in hangs)
    assert all(f"uid {attacker.uid}'s" in r["detail"] for r in hangs)
    # what was not sampled, and why, is said: the uid's share of the py-spy calls
    (missed,) = [
        r
        for r in results(rep, "training_discovery")
        if r["evidence"].get("cause") == "stack-sampling"
    ]
    assert f"uid {attacker.uid}:" in missed["detail"]
    assert "share of stack_max_calls" in missed["detail"]
    sampled = [r for r in hangs if r["evidence"]["signals"]["stack"]["available"]]
    assert 0 < len(sampled) <= 64 // entry["params"]["stack_samples"]


@VFORK_BLOCKED
def test_the_daemon_watching_80_vfork_blocked_processes_stays_at_warn_and_never_acts(
    shared_dir, vfork_blocked
):
    """The same attack on the daemon (issue 29: it drained the node and asked for a reboot):
    its training_progress runs every 5 s here, as its periodic suite's entry otherwise; after
    two runs the node is WARN, in service, and the journal is empty."""
    hb, pids = vfork_blocked
    cfg = config(shared_dir, daemon={"listen": "127.0.0.1:0"})
    scen = node(shared_dir)
    checks = suite(shared_dir, {**periodic_entry(hb), "every_s": 5}, name="periodic-hang")
    with agent_daemon(cfg, scen, checks, shared_dir / "daemon.log"):
        time.sleep(1)
        status = _until_status(
            cfg,
            scen,
            lambda st: bool(st.get("last_run")) and _hangs_in(st["last_run"]) >= len(pids),
            log=shared_dir / "daemon.log",
        )
        first = status["last_run"]["at"]
        status = _until_status(
            cfg, scen, lambda st: st["last_run"]["at"] > first, log=shared_dir / "daemon.log"
        )
    assert status["last_run"]["level"] == "WARN", status["last_run"]
    assert status["remediation"]["state"] == "in-service" and status["journal"] == []
    assert not any(r["rule"] == "check-hang" for r in status["last_run"]["reasons"])
    assert "check training_progress did not finish" not in (shared_dir / "daemon.log").read_text()


def _hangs_in(run: dict) -> int:
    """The unverified hangs a stored run names: those it keeps, and (at most) those its store left
    out for room (the ``runs`` table keeps at most 8 KiB of a run's reasons, the cut counted)."""
    kept = sum(r["rule"] == "training-hang-unverified" for r in run["reasons"])
    cut = sum(
        int(r["message"].split()[0]) for r in run["reasons"] if r["rule"] == "runs-reasons-cut"
    )
    return kept + cut if kept else 0


def _until_status(cfg: str, scen: str, ready, timeout_s: float = 90.0, log=None) -> dict:
    deadline = time.monotonic() + timeout_s
    status: dict = {}
    while time.monotonic() < deadline:
        done = run_agent("status", "--json", "--config", cfg, "--simulate", scen)
        if done.returncode == 0:
            status = json.loads(done.stdout)
            if ready(status):
                return status
        time.sleep(1.0)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    pytest.fail(
        f"the daemon's status did not get there within {timeout_s:g} s; last status "
        f"{json.dumps(status.get('last_run'))[:1500]}; daemon log: {tail}"
    )


def test_a_users_idle_process_with_a_stale_heartbeat_is_a_warn_and_never_blocks_a_resume(
    user, shared_dir
):
    """Issue 29, Low 9: the idle process graded the node ERROR, so a node the agent had
    drained for a restart never resumed after its clean re-test. Now its hang is a WARN naming
    the uid, and the re-test resumes the node."""
    hb = spool(shared_dir, "heartbeat")
    idle = user.popen(STALE_IDLE, str(hb), env={"SLURM_JOB_ID": "4242", "RANK": "0"})
    cfg = config(shared_dir)
    checks = suite(
        shared_dir,
        {"check": "xid", "timeout_s": 15, "params": {"since": "boot"}},
        periodic_entry(hb),
    )

    def check_and_act(scenario: str) -> dict:
        argv = ("check", "--act", "--suite", checks, "--config", cfg, "--json", "--simulate")
        return report(run_agent(*argv, scenario))

    # an Xid 119 (GSP RPC timeout, ERROR) on the simulated node: drained, reboot requested
    sick = check_and_act(
        node(shared_dir, "sick.yaml", faults=[{"kind": "xid", "gpu": 2, "code": 119}])
    )
    assert [(a["action"], a["outcome"]) for a in sick["actions"]] == [
        ("drain", "done"),
        ("restart", "done"),
    ]
    # after the reboot (the simulated node boots at once) the re-test is clean but for the
    # user's stale heartbeat
    retest = check_and_act(node(shared_dir))
    (hang,) = results(retest, "training_hang")
    assert hang["evidence"]["pid"] == idle.pid and hang["status"] == "warn"
    assert f"uid {user.uid}'s" in hang["detail"]
    assert hang["target"] == "job:unverified:slurm:4242/rank:0"
    assert retest["grade"]["level"] == "WARN"
    assert [(a["action"], a["outcome"]) for a in retest["actions"]] == [("resume", "done")]
    store = open_store(shared_dir / "state")
    try:
        assert store.node_record(retest["host"]["hostname"]).state == "in-service"
    finally:
        store.close()
