"""Issue 16's attacks on the root agent, each replayed by a real unprivileged user.

The attacker is a user made with ``useradd`` (``conftest.py``); the agent runs as root, as
the real ``node-agent`` command (a child of the test) against a simulated node, or through
its library functions where the command adds nothing. Each test asserts the safe outcome:
nothing a training user writes makes the agent act, hang, crash, or write where it should
not (docs/security.md). The simulator stands in for the GPUs (none here) and says so in the
reports; everything from the spool reader to the adapters is the real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from agent_daemon import agent_daemon  # tests/agent_daemon.py

REPO = Path(__file__).resolve().parents[2]

FORGE_VERDICTS = """
import sys
from node_agent.sdc.spool import Verdict, write_verdict
for i in range(int(sys.argv[2])):
    write_verdict(sys.argv[1], Verdict(
        probe="exact_gemm", device=f"cuda:{i}", shape=(128, 128, 128), dtype="bf16",
        status=sys.argv[3], mismatched_elements=1, detail="forged by a training user",
        duration_s=0.01, timestamp=1.0e9))
"""
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"


def run_agent(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real ``node-agent`` command, as root."""
    argv = [sys.executable, "-m", "node_agent.commands.main", *args]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def spool(base: Path, kind: str) -> Path:
    """A spool directory the way the agent makes it: sticky and writable by everyone."""
    d = base / "spool" / kind
    d.mkdir(parents=True, exist_ok=True)
    (base / "spool").chmod(0o755)
    d.chmod(0o1777)
    return d


def node(base: Path, name: str = "node.yaml", **extra) -> str:
    return write_yaml(base / name, {"sku": "h100-sxm5-80gb", "gpus": 8, **extra})


def config(base: Path, **extra) -> str:
    return write_yaml(
        base / "config.yaml",
        {"state_dir": str(base / "state"), "spool_dir": str(base / "spool"), **extra},
    )


def suite(base: Path, *checks: dict, name: str = "attack") -> str:
    return write_yaml(
        base / f"{name}.yaml", {"name": name, "mode": "service", "checks": list(checks)}
    )


def private_tmp(base: Path) -> dict[str, str]:
    """TMPDIR for an agent run whose report may land in a temp dir (a full or unusable state
    dir): under the test's directory, so nothing is left in /tmp."""
    tmp = base / "tmp"
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o1777)
    return {"TMPDIR": str(tmp)}


def report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode in (0, 3, 4), done.stderr[-3000:]
    return json.loads(done.stdout)


def results(rep: dict, metric: str | None = None) -> list[dict]:
    return [r for r in rep["results"] if metric is None or r["metric"] == metric]


# -- attack 2: a FIFO, a /dev/zero symlink, junk in a spool -----------------------------------

MAKE_JUNK = r"""
import json, os, sys
sdc, hb, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
for d in (sdc, hb):
    os.mkfifo(os.path.join(d, "1-fifo-confirmed.json"))
    os.symlink("/dev/zero", os.path.join(d, "2-zero-confirmed.json"))
    with open(os.path.join(d, "3-deep.json"), "w") as f:
        f.write("[" * 30000 + "]" * 30000)
    with open(os.path.join(d, "4-big.json"), "w") as f:
        f.write(json.dumps({"pad": "x" * 70000}))
    with open(os.path.join(d, "5-own.json"), "w") as f:
        f.write("{}")
    os.link(os.path.join(d, "5-own.json"), os.path.join(d, "6-hardlink.json"))
verdict = {"schema": "node-agent.sdc-verdict/1", "probe": "exact_gemm", "device": "cuda:0",
           "shape": [128, 128, 128], "dtype": "bf16", "status": "confirmed",
           "mismatched_elements": "many", "detail": "d", "duration_s": 0.1, "timestamp": 1.0}
with open(os.path.join(sdc, "7-string-for-number.json"), "w") as f:
    json.dump(verdict, f)
beat = {"schema": "node-agent.heartbeat/1", "pid": pid, "step": 1, "step_at": 1.0,
        "step_time_s": "fast"}
with open(os.path.join(hb, f"{pid}.json"), "w") as f:
    json.dump(beat, f)
print("planted")
"""

HOLD_LEASE = r"""
import fcntl, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"{}")
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # any other open() now waits 45 s for us
print("leased", flush=True)
time.sleep(120)
"""


def test_fifo_devzero_symlink_lease_and_junk_in_the_spools_are_skipped_once_never_hang(
    user, shared_dir
):
    sdc, hb = spool(shared_dir, "sdc"), spool(shared_dir, "heartbeat")
    victim = user.popen(SLEEPER)  # the attacker's own process, named by its broken heartbeat
    user.py(MAKE_JUNK, str(sdc), str(hb), str(victim.pid))
    user.popen(HOLD_LEASE, str(sdc / "8-leased.json"))
    cfg, scen = config(shared_dir), node(shared_dir)
    checks = suite(
        shared_dir,
        {"check": "sdc_spool", "timeout_s": 20, "params": {"spool_dir": str(sdc)}},
        {
            "check": "training_progress",
            "timeout_s": 20,
            "params": {"stack_samples": 1, "spool_dir": str(hb)},
        },
    )
    first = report(
        run_agent("check", "--suite", checks, "--simulate", scen, "--config", cfg, "--json")
    )
    assert first["grade"]["level"] in ("HEALTHY", "WARN"), first["grade"]
    assert not [r for r in first["results"] if r["status"] == "error"], first["results"]
    unreadable = {
        Path(r["evidence"]["file"]).name: r["detail"]
        for r in results(first, "sdc_spool_unreadable")
    }
    assert set(unreadable) == {
        "1-fifo-confirmed.json",
        "2-zero-confirmed.json",
        "3-deep.json",
        "4-big.json",
        "5-own.json",
        "6-hardlink.json",
        "7-string-for-number.json",
        "8-leased.json",
    }
    assert "FIFO" in unreadable["1-fifo-confirmed.json"]
    assert "symbolic link" in unreadable["2-zero-confirmed.json"]
    assert "levels deep" in unreadable["3-deep.json"]
    assert "bytes" in unreadable["4-big.json"]
    assert "hard links" in unreadable["6-hardlink.json"]
    assert "mismatched_elements" in unreadable["7-string-for-number.json"]
    assert "without waiting" in unreadable["8-leased.json"]
    skipped = {
        Path(r["evidence"]["file"]).name
        for r in results(first, "training_discovery")
        if "file" in r["evidence"]
    }
    assert skipped == {
        "1-fifo-confirmed.json",
        "2-zero-confirmed.json",
        "3-deep.json",
        "4-big.json",
        "5-own.json",
        "6-hardlink.json",
        f"{victim.pid}.json",
    }
    # the victim process is still watched (NVML-less here: it is simply not a training process)
    # and nothing of the junk is reported a second time
    second = report(
        run_agent("check", "--suite", checks, "--simulate", scen, "--config", cfg, "--json")
    )
    assert not results(second, "sdc_spool_unreadable")
    assert not [r for r in results(second, "training_discovery") if "file" in r["evidence"]]
    assert not [r for r in second["results"] if r["status"] == "error"]


# -- attack 1: a forged SDC verdict -> drain and replace ----------------------------------------


def test_forged_confirmed_sdc_verdicts_for_every_gpu_are_warns_naming_the_writer_never_an_action(
    user, shared_dir
):
    sdc = spool(shared_dir, "sdc")
    user.py(FORGE_VERDICTS, str(sdc), "8", "confirmed")
    assert {f.stat().st_uid for f in sdc.iterdir()} == {user.uid}
    cfg, scen = config(shared_dir), node(shared_dir)
    checks = suite(
        shared_dir, {"check": "sdc_spool", "timeout_s": 60, "params": {"spool_dir": str(sdc)}}
    )
    first = report(
        run_agent(
            "check", "--suite", checks, "--simulate", scen, "--config", cfg, "--json", "--act"
        )
    )
    assert first["grade"]["level"] == "WARN", first["grade"]
    forged = results(first, "sdc_report_unverified")
    assert sorted(r["target"] for r in forged) == [f"gpu:{i}" for i in range(8)]
    assert all(f"written by uid {user.uid}" in r["detail"] for r in forged)
    assert not [a for a in first["actions"] if a["outcome"] == "done"], first["actions"]
    # nothing stands: the next run is clean, and the agent never acted
    second = report(
        run_agent(
            "check", "--suite", checks, "--simulate", scen, "--config", cfg, "--json", "--act"
        )
    )
    assert second["grade"]["level"] == "HEALTHY" and second["actions"] == []
    status = json.loads(run_agent("status", "--json", "--config", cfg, "--simulate", scen).stdout)
    assert status["journal"] == [] and status["remediation"]["state"] == "in-service"


def test_a_users_report_about_its_own_gpu_is_only_a_reason_for_the_agent_to_probe(user, shared_dir):
    sdc = spool(shared_dir, "sdc")
    job = user.popen(SLEEPER)  # the user's process that NVML lists on gpu:3
    user.py(FORGE_VERDICTS, str(sdc), "4", "confirmed")  # cuda:0..3
    cfg = config(shared_dir)
    checks = suite(
        shared_dir, {"check": "sdc_spool", "timeout_s": 120, "params": {"spool_dir": str(sdc)}}
    )
    on_gpu3 = [{"gpu": 3, "pid": job.pid}]
    healthy = node(shared_dir, "healthy.yaml", compute_processes=on_gpu3)
    rep = report(
        run_agent(
            "check", "--suite", checks, "--simulate", healthy, "--config", cfg, "--json", "--act"
        )
    )
    assert rep["grade"]["level"] == "WARN" and rep["actions"] == []
    (probed,) = results(rep, "sdc_reported")
    assert probed["target"] == "gpu:3" and "did not confirm it" in probed["detail"]
    assert f"uid {user.uid} (pid {job.pid}" in probed["detail"]
    assert len(results(rep, "sdc_report_unverified")) == 3  # cuda:0..2: nothing of its there
    # on a GPU that really corrupts, the agent's own probe confirms: FAULT, and only then acts
    user.py(FORGE_VERDICTS, str(sdc), "4", "confirmed")
    sick = node(
        shared_dir, "sick.yaml", compute_processes=on_gpu3, faults=[{"kind": "sdc", "gpu": 3}]
    )
    rep = report(
        run_agent(
            "check", "--suite", checks, "--simulate", sick, "--config", cfg, "--json", "--act"
        )
    )
    assert rep["grade"]["level"] == "FAULT"
    (fault,) = results(rep, "sdc_confirmed")
    assert fault["evidence"]["source"] == "agent probe" and fault["target"] == "gpu:3"


# -- attack 5: locking node-agent.db-shm; state readable by everyone ----------------------------

LOCK_SHM = r"""
import fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except PermissionError as err:
    print("denied", err.strerror)
    sys.exit(0)
fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 8, 120)  # the WAL write lock's byte
print("locked")
"""


def test_nobody_else_can_open_the_databases_shm_file_to_lock_it(user, shared_dir):
    from node_agent.remediation.store import open_store

    state = shared_dir / "state"
    store = open_store(state)  # the daemon holds the database open: -wal and -shm exist
    try:
        store.set_opt_out("sim-node", False, 1.0)
        shm = state / "node-agent.db-shm"
        assert shm.exists() and (state.stat().st_mode & 0o777) == 0o700
        out = user.py(LOCK_SHM, str(shm)).stdout
        assert out.startswith("denied"), out
        cfg, scen = config(shared_dir), node(shared_dir)
        done = run_agent("optout", "on", "--config", cfg, "--simulate", scen, timeout=60)
        assert done.returncode == 0, done.stderr
    finally:
        store.close()


def test_a_state_dir_an_older_agent_left_open_is_made_private_again(user, shared_dir):
    from node_agent.remediation.store import open_store

    state = shared_dir / "state"
    open_store(state).close()
    state.chmod(0o755)
    (state / "node-agent.db").chmod(0o644)
    store = open_store(state)
    try:
        assert (state.stat().st_mode & 0o777) == 0o700
        assert {
            (f.name, f.stat().st_mode & 0o777)
            for f in state.iterdir()
            if f.name.startswith("node-agent.db")
        } <= {("node-agent.db", 0o600), ("node-agent.db-wal", 0o600), ("node-agent.db-shm", 0o600)}
        assert user.py(LOCK_SHM, str(state / "node-agent.db-shm")).stdout.startswith("denied")
    finally:
        store.close()


READ_ALL = r"""
import os, sys
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        print("READ", path)
    except OSError as err:
        print("denied", path, err.strerror)
"""


def test_reports_evidence_journal_and_actions_log_are_private(user, shared_dir):
    cfg = config(shared_dir, safety={"max_drained_fraction": 1.0})
    xid64 = node(shared_dir, "xid64.yaml", faults=[{"kind": "xid", "gpu": 5, "code": 64}])
    rep = report(run_agent("check", "--act", "--json", "--config", cfg, "--simulate", xid64))
    assert [a["outcome"] for a in rep["actions"]] == ["done", "done"]  # drain, replace (log)
    state = shared_dir / "state"
    made = [p for p in state.rglob("*") if p.is_file()]
    names = {p.name for p in made}
    assert {"node-agent.db", "actions.log", "kernel-log.txt", "report.json"} <= names
    assert any(n.startswith("report-") for n in names)
    lines = user.py(READ_ALL, *map(str, made)).stdout.splitlines()
    assert len(lines) == len(made) and all(line.startswith("denied") for line in lines), lines
    assert (state.stat().st_mode & 0o777) == 0o700
    for d in [p for p in state.rglob("*") if p.is_dir()]:
        assert d.stat().st_mode & 0o077 == 0, d


DELETE = r"""
import os, sys
try:
    os.unlink(sys.argv[1])
    print("deleted")
except OSError as err:
    print("denied", err.strerror)
with open(os.path.join(os.path.dirname(sys.argv[1]), "mine.json"), "w") as f:
    f.write("{}")
print("wrote")
"""


def test_spool_dirs_are_sticky_so_one_user_cannot_remove_anothers_reports(user, shared_dir):
    from node_agent.atomic_file import ensure_spool_dirs

    root = shared_dir / "spool"
    assert ensure_spool_dirs(root) == [
        f"made spool {root / 'heartbeat'} (mode 1777)",
        f"made spool {root / 'sdc'} (mode 1777)",
    ]
    for kind in ("heartbeat", "sdc"):
        assert (root / kind).stat().st_mode & 0o7777 == 0o1777
    theirs = root / "heartbeat" / "4242.json"
    theirs.write_text("{}")
    assert user.py(DELETE, str(theirs)).stdout.split("\n")[:2] == [
        "denied Operation not permitted",
        "wrote",
    ]
    # a spool an operator opened up without the sticky bit gets it back
    (root / "sdc").chmod(0o777)
    assert "added it" in ensure_spool_dirs(root)[0]
    assert (root / "sdc").stat().st_mode & 0o7777 == 0o1777


# -- attack 3: symlinks in a fixed /tmp report directory -> root's file overwritten ------------

PLANT_REPORT_LINKS = r"""
import datetime, os, sys, time
tmp, victim = sys.argv[1], sys.argv[2]
d = os.path.join(tmp, "node-agent-reports")  # where the agent used to fall back to
os.makedirs(d, exist_ok=True)
os.chmod(d, 0o777)
now = time.time()
for s in range(-5, 300):  # the temp names of the next five minutes of reports
    t = datetime.datetime.fromtimestamp(now + s, datetime.timezone.utc)
    stamp = t.strftime("%Y%m%dT%H%M%SZ")
    for name in (f".report-sim-node-attack-{stamp}.json.tmp", f"report-sim-node-attack-{stamp}.json"):
        os.symlink(victim, os.path.join(d, name))
print("planted")
"""


def test_an_unusable_state_dir_never_sends_reports_through_another_users_symlinks(user, shared_dir):
    tmp = shared_dir / "tmp"  # stands in for /tmp: TMPDIR points the agent here
    tmp.mkdir()
    tmp.chmod(0o1777)
    victim = shared_dir / "root-owned-file"
    victim.write_text("root's own content\n")
    user.py(PLANT_REPORT_LINKS, str(tmp), str(victim))
    cfg = config(shared_dir, state_dir="/proc/node-agent-state")  # cannot be created
    checks = suite(shared_dir, {"check": "inventory", "timeout_s": 30})
    done = run_agent(
        "check",
        "--suite",
        checks,
        "--simulate",
        node(shared_dir),
        "--config",
        cfg,
        env={"TMPDIR": str(tmp)},
    )
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "root's own content\n"
    written = Path(done.stderr.split("report: ")[1].split()[0])
    assert written.parent.parent == tmp and written.parent.name.startswith("node-agent-reports-")
    st = written.parent.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700) and not written.is_symlink()
    assert "new private directory" in done.stderr


# -- attack 4: a full or read-only disk loses the state: opt-out forgotten, breaker reset --------

FILL = r"""
import sys
with open(sys.argv[1], "wb") as f:
    try:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    except OSError as err:
        print("full:", err.strerror)
"""


@pytest.fixture
def small_fs(shared_dir):
    """A 4 MiB tmpfs, world-writable like /var/tmp, holding the state dir."""
    mnt = shared_dir / "fs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.strip()}): the full and read-only "
            "disk cases need one"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def opted_out_fault(shared_dir: Path, small_fs: Path) -> tuple[str, str]:
    """(config, scenario): a node with an Xid 64 (a row remap that failed) whose state lives on ``small_fs`` and whose
    operator has opted it out of actions ("maintenance")."""
    cfg = config(
        shared_dir, state_dir=str(small_fs / "state"), safety={"max_drained_fraction": 1.0}
    )
    xid64 = node(shared_dir, "xid64.yaml", faults=[{"kind": "xid", "gpu": 5, "code": 64}])
    optout = run_agent(
        "optout", "on", "--reason", "maintenance", "--config", cfg, "--simulate", xid64
    )
    assert optout.returncode == 0, optout.stderr
    return cfg, xid64


def check_act(cfg: str, scenario: str, shared_dir: Path) -> subprocess.CompletedProcess:
    """``node-agent check --act --json`` with a private TMPDIR."""
    return run_agent(
        "check",
        "--act",
        "--json",
        "--config",
        cfg,
        "--simulate",
        scenario,
        env=private_tmp(shared_dir),
    )


def test_a_disk_another_user_filled_keeps_the_opt_out_and_refuses_every_action(
    user, shared_dir, small_fs
):
    cfg, xid64 = opted_out_fault(shared_dir, small_fs)
    db = small_fs / "state" / "node-agent.db"
    before = db.read_bytes()
    assert "full:" in user.py(FILL, str(small_fs / "filler")).stdout
    rep = report(check_act(cfg, xid64, shared_dir))
    assert rep["grade"]["level"] == "FAULT"  # the checks and the report go on
    assert rep["actions"] and {a["outcome"] for a in rep["actions"]} == {"refused"}
    assert all(
        "state unavailable" in a["detail"] or "opted out" in a["detail"] for a in rep["actions"]
    ), rep["actions"]
    assert db.read_bytes() == before and not list(db.parent.glob("*.corrupt-*"))
    assert not (small_fs / "state" / "actions.log").exists()
    (small_fs / "filler").unlink()
    status = json.loads(run_agent("status", "--json", "--config", cfg, "--simulate", xid64).stdout)
    assert status["opt_out"] == "maintenance" and status["journal"] == []


@pytest.mark.parametrize("leftovers", [False, True], ids=["closed-cleanly", "wal-and-shm-left"])
def test_a_read_only_disk_still_shows_status_and_refuses_every_action(
    shared_dir, small_fs, leftovers
):
    import shutil

    from node_agent.remediation.store import open_store

    cfg, xid64 = opted_out_fault(shared_dir, small_fs)
    if leftovers:  # a crash left the -wal and -shm files (SQLite then opens read-only silently)
        scratch = shared_dir / "scratch"
        store = open_store(scratch)
        store.set_opt_out("sim-node", True, 1.0, "maintenance")
        for name in ("node-agent.db", "node-agent.db-wal", "node-agent.db-shm"):
            shutil.copy(scratch / name, small_fs / "state" / name)
        store.close()
    ro = subprocess.run(
        ["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True
    )
    assert ro.returncode == 0, ro.stderr
    status = run_agent("status", "--config", cfg, "--simulate", xid64)
    assert status.returncode == 0, status.stderr
    assert "opt-out: maintenance" in status.stdout and "UNAVAILABLE" in status.stdout
    rep = report(check_act(cfg, xid64, shared_dir))
    assert rep["grade"]["level"] == "FAULT" and rep["actions"]
    assert {a["outcome"] for a in rep["actions"]} == {"refused"}
    assert all("state unavailable" in a["detail"] for a in rep["actions"])
    optout = run_agent("optout", "off", "--config", cfg, "--simulate", xid64)
    assert optout.returncode == 1 and len(optout.stderr.strip().splitlines()) >= 1
    assert "optout off not done: state unavailable" in optout.stderr


# -- attack 6: a failed action is never retried while the grade stays ---------------------------


class Receiver:
    """A webhook receiver on loopback that answers 503 (an outage) until ``up`` is set; it
    records every POST's idempotency key."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.up = threading.Event()
        self.posts: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts.append({**body, "answered": 200 if outer.up.is_set() else 503})
                self.send_response(200 if outer.up.is_set() else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _journal(cfg: str, scen: str) -> list[dict]:
    done = run_agent("status", "--json", "--limit", "50", "--config", cfg, "--simulate", scen)
    return json.loads(done.stdout)["journal"] if done.returncode == 0 else []


def _until(what, check, timeout_s: float = 120.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"{what} did not happen within {timeout_s:g} s")


def test_the_daemon_retries_a_failed_action_while_the_fault_stands_under_one_key(shared_dir):
    receiver = Receiver()
    secret = shared_dir / "secret"
    secret.write_text("s3cret\n")
    cfg = config(
        shared_dir,
        adapter={
            "name": "webhook",
            "webhook": {
                "url": receiver.url,
                "secret_file": str(secret),
                "timeout_s": 2,
                "retries": 0,
            },
        },
        safety={"max_drained_fraction": 1.0},
        daemon={"listen": "127.0.0.1:0", "retry_initial_s": 0.5, "retry_max_s": 2},
    )
    xid64 = node(shared_dir, "xid64.yaml", faults=[{"kind": "xid", "gpu": 5, "code": 64}])
    checks = suite(
        shared_dir, {"check": "nvml_health", "timeout_s": 30, "every_s": 600}, name="periodic-small"
    )
    try:
        with agent_daemon(cfg, xid64, checks, shared_dir / "daemon.log"):
            failed = _until(
                "three failed drains",
                lambda: [
                    r
                    for r in _journal(cfg, xid64)
                    if r["action"] == "drain" and r["state"] == "failed"
                ][2:],
            )
            assert all("HTTP 503" in r["detail"] for r in failed)
            receiver.up.set()  # the outage ends; nothing else changes
            rows = _until(
                "the drain and the replace",
                lambda: (
                    [r for r in _journal(cfg, xid64) if r["state"] == "done"][1:]
                    and _journal(cfg, xid64)
                ),
            )
    finally:
        receiver.close()
    drains = [r for r in rows if r["action"] == "drain"]
    assert len({r["key"] for r in drains}) == 1 and drains[-1]["state"] == "done"
    assert [r["tries"] for r in drains] == list(range(1, len(drains) + 1))
    assert {r["state"] for r in drains[:-1]} == {"failed"}
    posted = [p for p in receiver.posts if p["action"] == "drain"]
    assert len(posted) == len(drains) and len({p["idempotency_key"] for p in posted}) == 1
    assert posted[-1]["answered"] == 200
    assert [r["action"] for r in rows if r["state"] == "done"] == ["drain", "replace"]


# -- attack 7: job identity from the environment; a root-owned heartbeat for another's pid -------

STALE_BEATER = r"""
import sys, time
from node_agent.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], min_interval_s=0, wall=lambda: time.time() - 3600)
hb.beat(5)  # its last step an hour ago: a hung job, by its own heartbeat
print("ready", flush=True)
time.sleep(120)
"""


def test_a_pod_name_in_the_environment_never_makes_another_pod_a_restart_target(user, shared_dir):
    hb = spool(shared_dir, "heartbeat")
    job = user.popen(
        STALE_BEATER,
        str(hb),
        env={
            "KUBERNETES_POD_NAME": "kube-system/cilium-x",
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "RANK": "0",
        },
    )
    cfg = config(shared_dir)
    checks = suite(
        shared_dir,
        {
            "check": "training_progress",
            "timeout_s": 60,
            "params": {
                "spool_dir": str(hb),
                "stack_samples": 1,
            },
        },
    )
    rep = report(
        run_agent(
            "check",
            "--suite",
            checks,
            "--simulate",
            node(shared_dir),
            "--config",
            cfg,
            "--json",
            "--act",
        )
    )
    (hang,) = results(rep, "training_hang")
    assert hang["target"] == "job:unverified:pod:kube-system/cilium-x/rank:0"
    assert hang["evidence"]["process"]["pid"] == job.pid
    assert hang["evidence"]["process"]["pod_uid"] is None
    assert hang["evidence"]["process"]["job_verified"] is False
    # an unverified job's hang is a WARN naming its uid (issue 29, Low 9): no restart-job is
    # even asked for, so none can reach another pod
    assert hang["status"] == "warn"
    assert rep["grade"]["level"] == "WARN" and rep["actions"] == []
    assert not (shared_dir / "state" / "actions.log").exists()  # nothing reached the adapter


def test_a_root_owned_heartbeat_does_not_speak_for_another_users_process(user, shared_dir):
    from node_agent.heartbeat import SCHEMA, process_start_ticks
    from node_agent.training.processes import discover

    hb = spool(shared_dir, "heartbeat")
    victim = user.popen(SLEEPER, env={"RANK": "3"})
    forged = hb / f"{victim.pid}.json"  # written by root (a root job, or a root helper)
    forged.write_text(
        json.dumps(
            {
                "schema": SCHEMA,
                "pid": victim.pid,
                "step": 1,
                "start_ticks": process_start_ticks(victim.pid),
                "step_at": 1.0,
                "job": "slurm:1",
                "rank": 0,
                "log_file": "/etc/shadow",
            }
        )
    )
    found = discover(hb, pids=[victim.pid])
    (p,) = found.processes
    assert (p.uid, p.heartbeat, p.rank, p.log_file) == (user.uid, None, 3, None)
    ((subject, message),) = found.problems
    assert subject == f"pid:{victim.pid}" and "owned by uid 0" in message
    # and the user's own file is believed for the user's own process
    forged.unlink()
    user.py(
        "import json, sys; json.dump(json.loads(sys.argv[2]), open(sys.argv[1], 'w'))",
        str(forged),
        json.dumps({"schema": SCHEMA, "pid": victim.pid, "step": 7, "step_at": 1.0}),
    )
    (p,) = discover(hb, pids=[victim.pid]).processes
    assert p.heartbeat is not None and p.heartbeat["step"] == 7


# -- terminal escapes in what users write --------------------------------------------------------

ESCAPES = r"""
import json, sys
from node_agent.sdc.spool import Verdict, write_verdict
d = sys.argv[1]
write_verdict(d, Verdict(probe="exact_gemm", device="cuda:1", shape=(8, 8, 8), dtype="bf16",
                         status="transient", mismatched_elements=1, duration_s=0.1,
                         timestamp=1.0e9, detail="ok\x1b[2J\x1b]0;owned\x07\rHEALTHY\u202e"))
with open(d + "/evil\x1b[31mname.json", "w") as f:
    f.write("{}")
print("written")
"""


def test_control_characters_a_user_wrote_reach_the_terminal_escaped(user, shared_dir):
    sdc = spool(shared_dir, "sdc")
    user.py(ESCAPES, str(sdc))
    checks = suite(
        shared_dir, {"check": "sdc_spool", "timeout_s": 30, "params": {"spool_dir": str(sdc)}}
    )
    done = run_agent(
        "check", "--suite", checks, "--simulate", node(shared_dir), "--config", config(shared_dir)
    )
    assert done.returncode == 0, done.stderr
    for bad in ("\x1b", "\x07", "\r", "\u202e"):
        assert bad not in done.stdout and bad not in done.stderr, repr(bad)
    assert "\\x1b[2J" in done.stdout and "\\u202e" in done.stdout
    assert "evil\\x1b[31mname.json" in done.stdout


# -- the systemd unit: its capabilities are enough, its exposure is scored -----------------------

UNIT = REPO / "packaging" / "systemd" / "node-agent.service"

PROBE = r"""
import json, os, subprocess, sys
spool_file, pid, stale, py_spy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as err:
        out[name] = f"{type(err).__name__}: {err}"
attempt("read a user's 0600 spool file", lambda: open(spool_file).read())
attempt("read a user's process environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
attempt("remove a user's stale heartbeat", lambda: os.unlink(stale))
def kmsg():
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    os.close(fd)
attempt("open /dev/kmsg", kmsg)
if py_spy:
    def dump():
        r = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip()[-200:])
    attempt("py-spy dump a user's process", dump)
print(json.dumps(out))
"""


def _unit_capabilities() -> list[str]:
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return line.split("=", 1)[1].split()
    raise AssertionError("the unit sets no CapabilityBoundingSet")


def test_the_units_capability_bounding_set_covers_what_the_agent_reads(user, shared_dir):
    import shutil

    from node_agent.training.stacks import find_py_spy

    if shutil.which("setpriv") is None:
        pytest.skip(
            "setpriv (util-linux) is not installed: cannot run with the unit's "
            "capability bounding set"
        )
    hb = spool(shared_dir, "heartbeat")
    job = user.popen(SLEEPER, env={"RANK": "0"})
    mine = hb / "mine.json"
    stale = hb / "stale.json"
    user.py(
        "import sys\nfor p in sys.argv[1:]:\n    open(p, 'w').write('{}')", str(mine), str(stale)
    )
    mine.chmod(0o600)  # as Heartbeat's mkstemp makes them
    assert mine.stat().st_uid == user.uid
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in _unit_capabilities())
    py_spy = find_py_spy(None) or ""

    def probe(bounding: str) -> dict:
        done = subprocess.run(
            [
                "setpriv",
                f"--bounding-set=-all{bounding}",
                "--",
                sys.executable,
                "-c",
                PROBE,
                str(mine),
                str(job.pid),
                str(stale),
                py_spy,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    got = probe("," + caps)
    assert set(got.values()) == {"ok"}, got
    assert len(got) == (5 if py_spy else 4), got
    # the control: with no capability at all, root could do none of it (so the set matters)
    stale.write_text("{}")
    os.chown(stale, user.uid, user.gid)
    bare = probe("")
    assert bare["read a user's 0600 spool file"].startswith("PermissionError")
    assert bare["read a user's process environ"].startswith("PermissionError")
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
        assert bare["open /dev/kmsg"].startswith("PermissionError")  # CAP_SYSLOG needed
    assert bare["remove a user's stale heartbeat"] == "ok"  # the spool is root's: no cap needed
    if py_spy:
        assert bare["py-spy dump a user's process"] != "ok"


def test_systemd_analyze_scores_the_unit_ok(shared_dir):
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "offline" in done.stderr and done.returncode != 0:
        pytest.skip(f"this systemd-analyze cannot score a unit file offline: {done.stderr}")
    line = next(x for x in done.stdout.splitlines() if "Overall exposure level" in x)
    score = float(line.split(":")[1].split()[0])
    assert score < 5.0, line  # "OK" or better; the unit before this work scored 9.6 UNSAFE
