"""The stack signal when py-spy cannot read a process, concurrent sampling, and the origin rule."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from node_agent.training.signals import Signal
from node_agent.training.stacks import sample_stacks
from node_agent.training.verdict import likely_origin


def _fake_py_spy(tmp_path, stderr: str, code: int = 1) -> str:
    path = tmp_path / "py-spy"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write({stderr!r})\n"
                    f"sys.exit({code})\n")
    path.chmod(0o755)
    return str(path)


def _frames(*names):
    return [{"name": n, "filename": f"/x/{n}.py", "short_filename": f"{n}.py", "line": 1}
            for n in names]


def test_py_spy_without_ptrace_permission_marks_stack_unavailable_with_the_fix(tmp_path):
    py_spy = _fake_py_spy(tmp_path, "Error: Permission Denied (os error 13)\n")
    stack = sample_stacks(py_spy, [os.getpid()], 3, 0.0, time.monotonic() + 30)[os.getpid()]
    assert stack.available is False
    assert "Permission Denied" in stack.detail and "CAP_SYS_PTRACE" in stack.detail


def test_process_that_exits_mid_sample_marks_stack_unavailable(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    py_spy = _fake_py_spy(tmp_path, "Error: No such process\n")
    stack = sample_stacks(py_spy, [gone.pid], 3, 0.0, time.monotonic() + 30)[gone.pid]
    assert stack.available is False and stack.figures == {"samples_taken": 0}
    assert stack.detail == f"process {gone.pid} exited during stack sampling"


def test_py_spy_printing_no_json_is_unavailable_not_a_crash(tmp_path):
    py_spy = _fake_py_spy(tmp_path, "", code=0)
    stack = sample_stacks(py_spy, [os.getpid()], 2, 0.0, time.monotonic() + 30)[os.getpid()]
    assert stack.available is False and "no JSON" in stack.detail


def test_no_py_spy_marks_every_process_unavailable_with_how_to_install():
    stacks = sample_stacks(None, [1, 2], 3, 0.0, time.monotonic() + 30)
    assert all(not s.available and "pip install py-spy" in s.detail for s in stacks.values())


def test_identical_samples_say_hang_and_name_the_innermost_frame():
    calls = {1: 0, 2: 0}

    def dump(_py_spy, pid, _timeout):
        calls[pid] += 1
        if pid == 1:
            return _frames("wait", "all_reduce", "train")
        return _frames(f"step_{calls[pid]}", "train")  # pid 2 moves on

    stacks = sample_stacks("py-spy", [1, 2], 3, 0.0, time.monotonic() + 30, dump=dump)
    assert calls == {1: 3, 2: 3}  # every process sampled in every round
    assert stacks[1].hang and stacks[1].figures["in_collective"]
    assert stacks[1].figures["stuck_in"] == "wait (wait.py:1)"
    assert not stacks[2].hang and stacks[2].figures["stuck_in"] is None


def test_a_failing_process_stops_being_sampled_while_the_others_go_on():
    def dump(_py_spy, pid, _timeout):
        return "process 2 exited during stack sampling" if pid == 2 else _frames("sleep")

    stacks = sample_stacks("py-spy", [1, 2], 3, 0.0, time.monotonic() + 30, dump=dump)
    assert stacks[1].hang and stacks[1].figures["samples"] == 3
    assert not stacks[2].available and "exited" in stacks[2].detail


def _stack(inside: bool) -> Signal:
    return Signal("stack", True, True, "", {"in_collective": inside})


def test_only_a_rank_outside_the_collective_among_hung_peers_is_the_likely_origin():
    members = [(1, True, _stack(True)), (2, True, _stack(True)), (3, True, _stack(False))]
    assert likely_origin(members) == {1: False, 2: False, 3: True}
    # all inside: nobody stands out
    assert likely_origin([(1, True, _stack(True)), (2, True, _stack(True))]) == {}
    # one hung process alone: nothing to compare it with
    assert likely_origin([(4, True, _stack(False))]) == {}
    # a progressing peer is not part of the comparison
    assert likely_origin([(1, True, _stack(True)), (5, False, _stack(False))]) == {}
