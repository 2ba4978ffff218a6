"""Issue 29's attacks on the agent's children, scratch files, metrics server and fleet view,
each replayed by a real unprivileged user (``useradd``, ``conftest.py``) against root's agent.

- a ``node_agent/`` package (and ``yaml.py``, ``torch.py``) planted in the directory root
  starts the agent from: the daemon's child checks and the SDC confirmation never import it;
- symlinks sprayed over the storage check's old predictable fio file name: root's fio never
  writes through them;
- idle connections held open against the daemon's HTTP port: every scrape is still answered;
- a forged report in a shared fleet directory: ``node-agent fleet`` as root skips and names it;
- terminal escapes in a job name or a heartbeat's text: escaped in fleet's output and in the
  daemon's log.

The agent runs as root in this process (the daemon on a thread, the storage check, the SDC
confirmation) or as the real ``node-agent`` command; the simulator stands in for the GPUs
(there are none here) and the reports say so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from synthetic_reports import synthetic_report  # tests/synthetic_reports.py

from node_agent.checking.context import CheckContext
from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.model import Result, Status
from node_agent.proc import python_module_argv
from node_agent.report import json_report
from node_agent.service.daemon import Daemon
from node_agent.suite import CheckSpec
from tests.unit.test_metrics import HOLD_IDLE

# what the attacker plants: each module, imported by root, leaves a marker naming itself
PLANTED = {
    "node_agent/__init__.py": "node_agent",
    "node_agent/commands/__init__.py": "node_agent.commands",
    "node_agent/commands/main.py": "node_agent.commands.main",
    "yaml.py": "yaml",
    "torch.py": "torch",
}
PLANT = """
import os, sys
work, marks = sys.argv[1], sys.argv[2]
modules = dict(a.split("=", 1) for a in sys.argv[3:])
for rel, name in modules.items():
    path = os.path.join(work, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"import os\\nopen(os.path.join({marks!r}, {name!r} + '.' + str(os.getuid())), 'w')"
                f".close()\\n")
"""
# n idle connections from n addresses of 127/8, each reopened (from its own address) once the
# server closes it: a cap per source address caps none of them
HOLD_SPREAD = """
import resource, select, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 256), hard))

def connect(i):
    s = socket.socket()
    s.bind((f"127.{1 + i // 65025}.{i // 255 % 255}.{1 + i % 255}", 0))
    s.connect(("127.0.0.1", port))
    return s

socks = {}
for i in range(n):
    socks[connect(i)] = i
print("ready", flush=True)
while True:
    readable, _, _ = select.select(list(socks)[:1000], [], [], 0.1)
    for s in readable:
        i = socks.pop(s)
        s.close()
        try:
            socks[connect(i)] = i
        except OSError:
            pass
"""
# symlinks at every name the storage check used to give fio's file (.node-agent-fio-<pid>.dat)
SPRAY = """
import os, sys
scratch, victim, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for pid in range(first, last):
    os.symlink(victim, os.path.join(scratch, f".node-agent-fio-{pid}.dat"))
print("ready", flush=True)
"""
COPY = "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])"


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def root_dir(base: Path) -> Path:
    """Root's own directory for configs and scenarios (0755, root's)."""
    d = base / "root"
    d.mkdir(exist_ok=True)
    d.chmod(0o755)
    return d


def world_writable(base: Path, name: str, mode: int = 0o1777) -> Path:
    d = base / name
    d.mkdir()
    d.chmod(mode)
    return d


def agent_config(base: Path, **extra) -> str:
    """A config for root's agent: its own state, spool and (empty) kernel log."""
    d = root_dir(base)
    (d / "kern.log").write_text("")
    return write_yaml(
        d / "config.yaml",
        {
            "state_dir": str(d / "state"),
            "spool_dir": str(d / "spool"),
            "kernel_log": {"path": str(d / "kern.log")},
            "daemon": {"act": False},
            **extra,
        },
    )


def scenario(base: Path, gpus: int = 2) -> str:
    return write_yaml(root_dir(base) / f"node-{gpus}.yaml", {"sku": "h100-sxm5-80gb", "gpus": gpus})


def markers(marks: Path) -> list[str]:
    return sorted(p.name for p in marks.iterdir())


# -- High 3: a planted node_agent/ in root's working directory -----------------------------------


@pytest.fixture
def planted(user, shared_dir):
    """(work, marks): ``work`` is a directory anyone may write to (1777, like /tmp or a shared
    project directory) where the user planted its modules; ``marks`` collects their markers."""
    work = world_writable(shared_dir, "work")
    marks = world_writable(shared_dir, "marks")
    user.py(PLANT, str(work), str(marks), *(f"{rel}={name}" for rel, name in PLANTED.items()))
    return work, marks


def test_planted_package_would_run_as_root_under_plain_python_m(planted):
    # the control: what the agent's children did before (python -m in the inherited cwd)
    work, marks = planted
    subprocess.run(
        [sys.executable, "-m", "node_agent.commands.main", "--help"],
        cwd=work,
        capture_output=True,
        timeout=60,
    )
    assert "node_agent.0" in markers(marks), (
        "the planted package was not imported: the control does not reproduce the attack"
    )


def test_daemon_child_check_never_imports_the_planted_package(planted, shared_dir, monkeypatch):
    work, marks = planted
    config, node = agent_config(shared_dir), scenario(shared_dir)
    # root started the daemon from the user's directory, naming its files relatively
    monkeypatch.chdir(work)
    daemon = Daemon(os.path.relpath(config), os.path.relpath(node), suite=None)
    try:
        results = daemon._run_in_subprocess(CheckSpec(check="nvml_health", timeout_s=60))
    finally:
        daemon.env.close()
    assert results and all(r.status is not Status.ERROR for r in results), [
        r.detail for r in results
    ]
    assert {r.check for r in results} == {"nvml_health"}
    assert markers(marks) == []


def test_sdc_confirmation_probe_never_imports_the_planted_package(planted, shared_dir, monkeypatch):
    pytest.importorskip(
        "torch", reason="the confirming probe computes on the CPU with torch under simulation"
    )
    from node_agent.checks import sdc_spool

    work, marks = planted
    config = load_config(agent_config(shared_dir))
    env = open_environment(config, scenario(shared_dir))
    monkeypatch.chdir(work)
    try:
        ctx = env.check_context(
            "sdc_spool",
            "service",
            {"confirm_repeats": 1},
            config=config,
            state_dir=None,
            timeout_s=180,
        )
        outcome = sdc_spool.own_probe(ctx, [0], budget_s=170)
    finally:
        env.close()
    assert outcome["gpu:0"][0] == "clean", outcome
    assert markers(marks) == []


def test_forkserver_of_a_root_command_never_imports_from_its_working_directory(
    user, planted, shared_dir
):
    # root runs `node-agent accept` (a console script: its own directory first on sys.path,
    # no -P) from the user's directory; the burn and PCIe checks start their workers from
    # multiprocessing's forkserver, a `python -c` that would put that directory first
    pytest.importorskip("torch", reason="the simulated PCIe check copies with torch on the CPU")
    work, marks = planted
    user.py(PLANT, str(work), str(marks), "multiprocessing/__init__.py=multiprocessing")
    d = root_dir(shared_dir)
    launcher = d / "node-agent"
    launcher.write_text(
        "import sys\nfrom node_agent.commands.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )  # as pip writes it
    suite = write_yaml(
        d / "pcie.yaml",
        {
            "name": "pcie",
            "mode": "delivery",
            "checks": [
                {
                    "check": "pcie_bandwidth",
                    "timeout_s": 120,
                    "params": {
                        "simulated": {
                            "size_bytes": 65536,
                            "reps": 3,
                            "warmup": 1,
                            "concurrent_s": 0.1,
                        }
                    },
                }
            ],
        },
    )
    done = subprocess.run(
        [
            sys.executable,
            str(launcher),
            "accept",
            "--json",
            "--suite",
            os.path.relpath(suite, work),
            "--simulate",
            scenario(shared_dir, gpus=1),
            "--config",
            agent_config(shared_dir),
            "--out",
            str(d / "out"),
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    assert {r["status"] for r in results} == {"pass"}, [r["detail"] for r in results]
    assert markers(marks) == []


# -- High 4: symlinks sprayed over fio's file name ----------------------------------------------

#: a root-only file larger than fio's file, so fio would write through a link to it, not
#: lay out a new file in its place
PRECIOUS = b"root's precious data\n" * ((8 << 20) // 21 + 1)  # 8 MiB


def make_victim(base: Path) -> Path:
    victim = root_dir(base) / "victim"
    victim.write_bytes(PRECIOUS)
    victim.chmod(0o600)
    return victim


def fio_context(scratch: Path) -> CheckContext:
    """The storage check's context for a short fio run in ``scratch``, on a node without GPUs."""
    from node_agent.config import config_from_dict
    from node_agent.gpu.absent import AbsentGpuBackend

    return CheckContext(
        check="storage",
        gpu=AbsentGpuBackend("no GPU"),
        kernel_log=None,
        config=config_from_dict({"storage": {"paths": [str(scratch)]}}),
        inventory=None,
        sku=None,
        expected_gpus=None,
        params={"size": "4M", "runtime_s": 1, "iodepth": 4},
    )


@pytest.fixture
def followable_symlinks():
    """``fs.protected_symlinks=0`` for the test (restored after); skips where the sysctl
    cannot be written (a container's read-only /proc/sys)."""
    knob = Path("/proc/sys/fs/protected_symlinks")
    try:
        before = knob.read_text().strip()
        knob.write_text("0")
    except OSError as err:
        pytest.skip(
            f"cannot set fs.protected_symlinks=0 here ({err.strerror}): the sticky "
            "directory case needs it"
        )
    try:
        yield
    finally:
        knob.write_text(before)


@pytest.mark.parametrize("mode", [0o1777, 0o777], ids=["sticky-protected_symlinks=0", "non-sticky"])
def test_fio_never_writes_through_sprayed_symlinks(user, shared_dir, mode, request):
    import shutil

    if mode & 0o1000:  # a sticky directory protects links unless the sysctl is off
        request.getfixturevalue("followable_symlinks")

    from node_agent.checks import storage

    if not shutil.which("fio"):
        pytest.skip("fio is not installed (Debian package fio)")
    scratch = world_writable(shared_dir, "scratch", mode)
    victim = make_victim(shared_dir)
    # the old name was .node-agent-fio-<the agent's pid>: this process is the agent here
    user.popen(SPRAY, str(scratch), str(victim), str(os.getpid() - 50), str(os.getpid() + 50))
    link = scratch / f".node-agent-fio-{os.getpid()}.dat"
    # the control: root follows the user's link to the victim (the attack's precondition)
    assert link.read_bytes()[:64] == PRECIOUS[:64]
    results = storage.run(fio_context(scratch))
    assert {r.status for r in results} == {Status.PASS}, [r.detail for r in results]
    assert victim.read_bytes() == PRECIOUS
    assert link.is_symlink()  # the user's links are left as they were
    assert not [p for p in scratch.iterdir() if not p.is_symlink()]  # fio's directory removed


# the user renames root's private directory away and puts its own, with a symlink, at the name
SWAP_DIR = """
import glob, os, sys
scratch, victim = sys.argv[1], sys.argv[2]
(made,) = glob.glob(os.path.join(scratch, ".node-agent-fio-*"))
os.rename(made, os.path.join(scratch, "moved-away"))
os.mkdir(made)
os.symlink(victim, os.path.join(made, "fio.dat"))
"""


def test_fio_never_writes_through_a_directory_swapped_in_after_it_was_made(user, shared_dir):
    # a non-sticky directory lets a user rename root's 0700 directory (renaming needs write
    # access to the parent only) between mkdtemp and fio's open: fio must not go by the name
    import shutil

    from node_agent.checks import storage

    if not shutil.which("fio"):
        pytest.skip("fio is not installed (Debian package fio)")
    scratch = world_writable(shared_dir, "scratch", 0o777)
    victim = make_victim(shared_dir)
    real_run = storage.proc.run

    def swap_then_run(argv, timeout_s, **kw):  # the race, won by the user every time
        user.py(SWAP_DIR, str(scratch), str(victim))
        return real_run(argv, timeout_s, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(storage.proc, "run", swap_then_run)
        results = storage.run(fio_context(scratch))
    assert {r.status for r in results} == {Status.PASS}, [r.detail for r in results]
    assert victim.read_bytes() == PRECIOUS
    swapped = next(scratch.glob(".node-agent-fio-*"))
    assert (swapped / "fio.dat").is_symlink()  # the user's directory is left as it was
    assert list((scratch / "moved-away").iterdir()) == []  # root's, emptied where it went


# -- Medium 5: idle connections against the metrics endpoint ------------------------------------


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


@contextlib.contextmanager
def serving_daemon(shared_dir: Path) -> Iterator[tuple[Daemon, int]]:
    """A root daemon on a stand-in node with one slow check, serving /metrics on a free
    loopback port: (the daemon, its port), stopped on leaving."""
    config = agent_config(shared_dir, daemon={"act": False, "listen": "127.0.0.1:0"})
    suite = write_yaml(
        root_dir(shared_dir) / "suite.yaml",
        {
            "name": "idle",
            "mode": "service",
            "checks": [{"check": "inventory", "timeout_s": 10, "every_s": 60}],
        },
    )
    daemon = Daemon(config, scenario(shared_dir), suite=suite)
    thread = threading.Thread(target=daemon.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while daemon.listen_address is None and time.monotonic() < deadline:
            time.sleep(0.05)
        port = daemon.listen_address[1]
        assert _get(port, "/healthz") == 200
        yield daemon, port
    finally:
        daemon.stop()
        thread.join(10)


def test_64_idle_connections_never_starve_scrapes(user, shared_dir):
    with serving_daemon(shared_dir) as (_daemon, port):
        user.popen(HOLD_IDLE, str(port), "64")
        time.sleep(0.5)  # the 64 are connected and idle
        codes = [_get(port, "/metrics" if i % 2 else "/healthz") for i in range(40)]
        assert codes == [200] * 40


# -- Low 10 and 11: fleet believes only root's reports and escapes what users wrote -------------


def _hang(job: str) -> Result:
    """A hung rank as ``training_progress`` reports it from a user's heartbeat (the job name is
    the user's text)."""
    return Result(
        "training_progress",
        f"job:{job}/rank:0",
        "training_hang",
        Status.FAIL,
        "rank 0 hung",
        value=400.0,
        unit="s",
        evidence={
            "pid": 4242,
            "rank": 0,
            "job": job,
            "step_time_s": 1.0,
            "heartbeat_age_s": 400.0,
            "likely_origin": True,
        },
    )


def run_fleet(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        python_module_argv("node_agent.commands.main", "fleet", str(directory)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )


def test_forged_newer_report_of_a_user_is_skipped_and_named(user, shared_dir):
    fleet_dir = world_writable(shared_dir, "fleet")  # reports collected in a shared place
    genuine = synthetic_report("node7", seed=1)
    genuine.results.append(_hang("slurm:77"))
    json_report.write(genuine, fleet_dir)
    # the user's forgery: node7 again, finished later, its hung job gone
    forged = synthetic_report("node7", seed=2).to_dict()
    forged["finished_at"] = forged["started_at"] = "2099-01-01T00:00:00Z"
    source = root_dir(shared_dir) / "forged.json"
    source.write_text(json.dumps(forged))
    source.chmod(0o644)
    target = fleet_dir / "report-node7-delivery-20990101T000000Z.json"
    user.py(COPY, str(source), str(target))
    assert target.stat().st_uid == user.uid

    done = run_fleet(fleet_dir)
    assert done.returncode == 3, done.stderr  # the hung job is found
    assert "hung job slurm:77" in done.stdout
    assert f"fleet: skipped {target}: owned by uid {user.uid}" in done.stderr
    assert "1 skipped" in done.stdout and str(target) in done.stdout


def test_escapes_in_a_job_name_are_shown_escaped_by_fleet(shared_dir):
    fleet_dir = world_writable(shared_dir, "fleet")
    report = synthetic_report("node8", seed=3)
    report.results.append(_hang("slurm:9\x1b]0;pwned\x07\x1b[2J\x1b[1A"))
    json_report.write(report, fleet_dir)
    done = run_fleet(fleet_dir)
    assert done.returncode == 3, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "hung job slurm:9\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A" in done.stdout


def test_daemon_log_escapes_a_heartbeats_text(shared_dir, caplog):
    # what training_progress reports from a user's heartbeat (its job, its pause reason) is in
    # the result's detail, which the grade change logs
    daemon = Daemon(agent_config(shared_dir), scenario(shared_dir), suite=None)
    text = "job slurm:5 paused: checkpoint\x1b[2J\x1b[Hgrade HEALTHY\u202e\ud800"
    try:
        with caplog.at_level(logging.INFO, logger="node_agent.service.daemon"):
            daemon._record(
                "training_progress",
                [
                    Result(
                        "training_progress",
                        "job:slurm:5/rank:0",
                        "training_straggler",
                        Status.WARN,
                        text,
                        value=3.0,
                        unit="x",
                        evidence={"job": "slurm:5\x1b[31m"},
                    )
                ],
                time.time(),
                0.1,
            )
    finally:
        daemon.env.close()
    logged = caplog.text
    assert "grade HEALTHY -> WARN" in logged
    assert "\x1b" not in logged and "\u202e" not in logged and "\ud800" not in logged
    assert "checkpoint\\x1b[2J\\x1b[Hgrade HEALTHY\\u202e\\ud800" in logged


def test_2000_idle_connections_from_all_of_127_8_never_starve_scrapes(user, shared_dir):
    """Medium (round 3): the cap was per source address, and a local user has all of 127/8:
    2 of 30 scrapes failed. The cap is per uid now (the kernel's socket diagnostics name the
    owner of a local connection's other end)."""
    with serving_daemon(shared_dir) as (daemon, port):
        user.popen(HOLD_SPREAD, str(port), "2000")
        time.sleep(1.0)  # the user holds what the server lets it, reopening the rest
        server = daemon._server
        assert server is not None
        held = [c.peer for c in list(server._conns.values())]
        assert len(held) <= 64 and set(held) <= {f"uid {user.uid}"}, sorted(set(held))[:5]
        codes = [_get(port, "/metrics" if i % 2 else "/healthz") for i in range(30)]
        assert codes == [200] * 30
        assert server.dropped >= 2000 - 64
