"""``node_agent.proc.run``: a program and everything it starts in its process group end by the
deadline; nothing it leaves behind runs on. Real processes (python and sleep)."""

from __future__ import annotations

import os
import sys
import time

from node_agent import proc

# prints the pid of a child that outlives it, then exits at once (the child keeps no pipe open)
ORPHANER = """
import subprocess, sys
child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
print(child.pid, flush=True)
"""
# the same, but the parent then hangs and the child holds stdout open
HANGER = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])
print(child.pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (a zombie counts as gone: it was killed)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_a_child_that_outlives_its_parent_does_not_escape():
    result = proc.run([sys.executable, "-c", ORPHANER], timeout_s=30)
    assert result.ok
    orphan = int(result.stdout.strip())
    assert _gone(orphan), f"pid {orphan} still runs after proc.run returned"


def test_at_the_deadline_the_whole_group_is_killed():
    result = proc.run([sys.executable, "-c", HANGER], timeout_s=5)  # room to start under load
    assert result.timed_out and result.returncode is None
    child = int(result.stdout.strip())
    assert _gone(child)


def test_a_grandchild_in_its_own_session_cannot_hold_run_past_the_deadline():
    code = (
        "import subprocess, time\n"
        "c = subprocess.Popen(['setsid', 'sleep', '30'])\n"  # holds stdout, outside the group
        "print(c.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    result = proc.run([sys.executable, "-c", code], timeout_s=5)  # room to start under load
    stray = int(result.stdout.strip())
    try:
        assert result.timed_out
        # run returned while the stray still held the pipe: it did not wait for it to end
        assert not _gone(stray, wait_s=0)
    finally:
        os.kill(stray, 9)


PLANTED = "open({marker!r}, 'w').write('imported'); raise SystemExit(9)\n"


def test_python_children_never_import_from_their_working_directory(tmp_path):
    """A planted ``node_agent/`` and ``json.py`` in the child's working directory are never
    imported, on Python 3.10 (no ``-P``) as on 3.11 and later."""
    import subprocess

    from node_agent.proc import python_code_argv, python_module_argv

    marker = tmp_path / "planted-code-ran"
    (tmp_path / "node_agent").mkdir()
    (tmp_path / "node_agent" / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    (tmp_path / "json.py").write_text(PLANTED.format(marker=str(marker)))
    for argv in (
        python_module_argv("node_agent.commands.main", "--help"),
        python_code_argv("import json, sys, node_agent; print(sys.argv[1:])", "a", "b"),
    ):
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert not marker.exists(), f"{argv[:3]} imported the planted code"
    assert done.stdout.strip() == "['a', 'b']"


def test_child_config_paths_are_made_absolute_and_program_names_kept(tmp_path, monkeypatch):
    from node_agent.config import DEFAULTS
    from node_agent.proc import absolute_config

    monkeypatch.chdir(tmp_path)
    data = {
        **DEFAULTS,
        "state_dir": "state",
        "storage": {"paths": ["scratch", "/abs"]},
        "kernel_log": {"path": "kern.log"},
        "adapter": {
            **DEFAULTS["adapter"],
            "slurm": {"scontrol": "scontrol", "squeue": "bin/squeue", "timeout_s": 15},
        },
    }
    out = absolute_config(data)
    assert out["state_dir"] == str(tmp_path / "state")
    assert out["storage"]["paths"] == [str(tmp_path / "scratch"), "/abs"]
    assert out["kernel_log"]["path"] == str(tmp_path / "kern.log")
    assert out["adapter"]["slurm"]["scontrol"] == "scontrol"  # looked up on PATH
    assert out["adapter"]["slurm"]["squeue"] == str(tmp_path / "bin/squeue")
    assert out["suites_dir"] is None and data["state_dir"] == "state"  # a copy


FORKSERVER_CWD = """
import multiprocessing, os
from multiprocessing import forkserver
from node_agent.proc import start_forkserver_in_child_cwd
start_forkserver_in_child_cwd()
pid = forkserver._forkserver._forkserver_pid  # the running server (private, read only)
with multiprocessing.get_context("forkserver").Pool(1) as pool:  # it still serves
    worker = pool.apply(os.getpid)
print(os.getcwd(), os.readlink(f"/proc/{pid}/cwd"), worker != os.getpid())
"""


def test_forkserver_starts_from_root_dir_and_the_working_directory_is_restored(tmp_path):
    # a fresh interpreter: the forkserver is one per process, and another test may have
    # started this one's already
    import subprocess

    done = subprocess.run(
        proc.python_code_argv(FORKSERVER_CWD),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path), "/", "True"]


def test_only_proc_spells_the_child_python_flags():
    """``-P`` exists from Python 3.11 only; a child argv built by hand would fail on 3.10."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "node_agent"
    spelled = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if '"-P"' in path.read_text(encoding="utf-8") and path.name != "proc.py"
    ]
    assert spelled == []


FORKSERVER_PRELOAD = """
import multiprocessing
from node_agent.proc import start_forkserver_in_child_cwd
start_forkserver_in_child_cwd()
with multiprocessing.get_context("forkserver").Pool(1) as pool:
    print(pool.apply(eval, ("'torch' in __import__('sys').modules",)))
"""


def test_the_forkserver_has_imported_torch_before_it_forks_a_worker(tmp_path):
    """The burn's and the PCIe check's 8 workers each fork from it: with torch imported once
    there, none imports it again (several seconds of CPU each)."""
    import subprocess

    import pytest

    pytest.importorskip("torch", reason="the load checks' workers need torch: make deps-test")
    done = subprocess.run(
        proc.python_code_argv(FORKSERVER_PRELOAD),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


def test_a_program_that_prints_past_the_cap_is_killed_there_and_is_not_ok():
    """What another user's process makes a tool print (py-spy of a stack with thousand-frame
    names) cannot fill the agent's memory: past the cap the program is killed."""
    endless = [sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('x' * 65536)"]
    result = proc.run(endless, timeout_s=30, max_output_bytes=1 << 20)
    assert result.cut and not result.ok and not result.timed_out
    assert len(result.stdout) == 1 << 20
    assert "printed more than the agent reads" in result.describe_failure()


def test_a_large_input_and_output_pass_whole_under_the_cap():
    data = "y" * (4 << 20)
    echo = [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"]
    result = proc.run(echo, timeout_s=30, input_text=data)
    assert result.ok and result.stdout == data


def test_a_program_that_closes_its_output_and_runs_on_is_still_held_to_its_timeout():
    quiet = [
        sys.executable,
        "-c",
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)",
    ]
    started = time.monotonic()
    result = proc.run(quiet, timeout_s=1.0)
    assert result.timed_out and not result.ok and time.monotonic() - started < 10
