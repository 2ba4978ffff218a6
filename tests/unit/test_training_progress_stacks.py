"""training_progress's stack signal when py-spy cannot read a process, and the origin rule."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from node_agent.checks.training_progress import _likely_origin, sample_stacks


def _fake_py_spy(tmp_path, stderr: str, code: int = 1) -> str:
    path = tmp_path / "py-spy"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write({stderr!r})\n"
                    f"sys.exit({code})\n")
    path.chmod(0o755)
    return str(path)


def test_py_spy_without_ptrace_permission_marks_stack_unavailable_with_the_fix(tmp_path):
    py_spy = _fake_py_spy(tmp_path, "Error: Permission Denied (os error 13)\n")
    stack = sample_stacks(py_spy, os.getpid(), 3, 0.0, time.monotonic() + 30)
    assert stack["available"] is False
    assert "Permission Denied" in stack["reason"] and "CAP_SYS_PTRACE" in stack["reason"]


def test_process_that_exits_mid_sample_marks_stack_unavailable(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    py_spy = _fake_py_spy(tmp_path, "Error: No such process\n")
    stack = sample_stacks(py_spy, gone.pid, 3, 0.0, time.monotonic() + 30)
    assert stack == {"available": False, "samples_taken": 0,
                     "reason": f"process {gone.pid} exited during stack sampling"}


def test_py_spy_printing_no_json_is_unavailable_not_a_crash(tmp_path):
    py_spy = _fake_py_spy(tmp_path, "", code=0)
    stack = sample_stacks(py_spy, os.getpid(), 2, 0.0, time.monotonic() + 30)
    assert stack["available"] is False and "no JSON" in stack["reason"]


def test_only_a_rank_outside_the_collective_among_hung_peers_is_the_likely_origin():
    hung = [{"pid": 1, "job": "j"}, {"pid": 2, "job": "j"}, {"pid": 3, "job": "j"},
            {"pid": 4, "job": "other"}]
    stacks = {1: {"available": True, "in_collective": True},
              2: {"available": True, "in_collective": True},
              3: {"available": True, "in_collective": False},
              4: {"available": True, "in_collective": False}}
    # pid 4 hangs alone in its job: nothing to compare it with, no verdict on it
    assert _likely_origin(hung, stacks) == {1: False, 2: False, 3: True}
    stacks[3]["in_collective"] = True  # all inside: nobody stands out
    assert _likely_origin(hung, stacks) == {}
