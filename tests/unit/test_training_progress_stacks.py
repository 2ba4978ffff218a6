"""The stack signal when py-spy cannot read a process, concurrent sampling (within a deadline,
a call budget shared fairly per uid, nonblocking), what a stack is blocked in, and the origin
rule.

Frame lists are py-spy's own: tests/data/py_spy holds `py-spy dump --json` of real hung
processes (a gloo all_reduce, a DataLoader whose worker stopped, a queue.get whose producer
died; see its README), and the hand-made lists below copy their shape (qualified method names,
full and short file names, ``module`` set on native frames only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node_agent.training.blocking import classify
from node_agent.training.signals import Signal
from node_agent.training.stacks import main_thread, sample_stacks
from node_agent.training.verdict import likely_origin

PY_SPY_DATA = Path(__file__).resolve().parents[1] / "data" / "py_spy"
SITE = "/opt/venv/lib/python3.11/site-packages/"
STDLIB = "/usr/lib/python3.11/"


def _fake_py_spy(tmp_path, stderr: str, code: int = 1) -> str:
    path = tmp_path / "py-spy"
    path.write_text(
        f"#!{sys.executable}\nimport sys\nsys.stderr.write({stderr!r})\nsys.exit({code})\n"
    )
    path.chmod(0o755)
    return str(path)


def _frames(*names):
    return [
        {"name": n, "filename": f"/x/{n}.py", "short_filename": f"{n}.py", "line": 1} for n in names
    ]


def _dump(name: str) -> list[dict]:
    """The main thread's frames of a real py-spy dump, innermost first."""
    return main_thread(json.loads((PY_SPY_DATA / name).read_text()))["frames"]


def _py(name: str, path: str, line: int = 1) -> dict:
    """A Python frame as py-spy prints it; ``path`` under site-packages, the stdlib or the job."""
    short = (
        path.split("site-packages/")[-1]
        if "site-packages/" in path
        else path.rsplit("python3.11/", 1)[-1]
        if path.startswith(STDLIB)
        else path.rsplit("/", 1)[-1]
    )
    return {
        "name": name,
        "filename": path,
        "module": None,
        "short_filename": short,
        "line": line,
        "locals": None,
        "is_entry": False,
        "is_shim_entry": False,
    }


def _native(name: str, lib: str) -> dict:
    """A native frame of ``py-spy dump --native``: module and file are the shared object."""
    return {
        "name": name,
        "filename": lib,
        "module": lib,
        "short_filename": lib.rsplit("/", 1)[-1],
        "line": 0,
        "locals": None,
        "is_entry": True,
        "is_shim_entry": True,
    }


JOB = "/home/u/job/train.py"
LIBTORCH = SITE + "torch/lib/libtorch_cpu.so"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


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
    assert all(not s.available and "pip install 'py-spy" in s.detail for s in stacks.values())


def test_identical_samples_say_hang_and_name_the_innermost_frame():
    calls = {1: 0, 2: 0}
    waiting = _dump("gloo_all_reduce_waiting.json")

    def dump(_py_spy, pid, _timeout):
        calls[pid] += 1
        if pid == 1:
            return waiting
        return _frames(f"step_{calls[pid]}", "train")  # pid 2 moves on

    stacks = sample_stacks("py-spy", [1, 2], 3, 0.0, time.monotonic() + 30, dump=dump)
    assert calls == {1: 3, 2: 3}  # every process sampled in every round
    assert stacks[1].hang and stacks[1].figures["in_collective"]
    assert (
        stacks[1]
        .figures["stuck_in"]
        .startswith("all_reduce (torch/distributed/distributed_c10d.py:")
    )
    assert stacks[1].figures["blocked_in"]["kind"] == "collective"
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


# -- what a stack is blocked in, on real py-spy dumps -------------------------------------------


@pytest.mark.parametrize(
    "name, kind, frame, via",
    [
        (
            "gloo_all_reduce_waiting.json",
            "collective",
            "all_reduce (torch/distributed/distributed_c10d.py:",
            "torch.distributed",
        ),
        (
            "gloo_all_reduce_waiting_native.json",
            "collective",
            "c10d::Work::wait (libtorch_cpu.so",
            "native c10d/gloo/NCCL frame",
        ),
        # selectors.select <- multiprocessing wait <- Queue.get <- DataLoader: not a collective
        (
            "dataloader_worker_stuck.json",
            "data_loader",
            "_MultiProcessingDataLoaderIter._try_get_data (torch/utils/data/dataloader.py:",
            "torch.utils.data",
        ),
        # Condition.wait <- Queue.get <- the job's next_batch: the job's own code
        ("queue_get_producer_died.json", "other", "next_batch (qget.py:", "the job's own code"),
    ],
)
def test_real_dumps_are_classified_by_what_the_frames_are(name, kind, frame, via):
    blocked = classify(_dump(name))
    assert (blocked.kind, blocked.via) == (kind, via)
    assert blocked.frame.startswith(frame)


def test_a_wait_frame_of_the_standard_library_is_not_a_collective():
    # the bug: any frame named like "wait" counted as a collective
    for name in ("dataloader_worker_stuck.json", "queue_get_producer_died.json"):
        frames = _dump(name)
        assert any("wait" in f["name"].lower() for f in frames)
        assert not classify(frames).waits_on_peers


@pytest.mark.parametrize(
    "frames, kind, via",
    [
        (
            [_py("synchronize", SITE + "torch/cuda/__init__.py"), _py("train_step", JOB)],
            "device",
            "torch.cuda synchronise",
        ),
        (
            [_py("Stream.wait_stream", SITE + "torch/cuda/streams.py"), _py("train_step", JOB)],
            "other",
            "the job's own code",
        ),  # ordering streams does not block the host
        (
            [
                _py("all_reduce", SITE + "deepspeed/comm/torch.py"),
                _py("log_wrapper", SITE + "deepspeed/comm/comm.py"),
                _py("step", JOB),
            ],
            "collective",
            "DeepSpeed comm",
        ),
        (
            [_py("_reduce", SITE + "megatron/core/tensor_parallel/mappings.py"), _py("fwd", JOB)],
            "collective",
            "Megatron-Core communication",
        ),
        (
            [_py("_communicate", SITE + "megatron/core/pipeline_parallel/p2p_communication.py")],
            "collective",
            "Megatron-Core communication",
        ),
        (
            [
                _py(
                    "DistributedDataParallel.finish_grad_sync",
                    SITE + "megatron/core/distributed/distributed_data_parallel.py",
                ),
                _py("step", JOB),
            ],
            "collective",
            "Megatron-Core DDP grad/param sync",
        ),
        (
            [_py("_store_based_barrier", SITE + "torch/distributed/distributed_c10d.py")],
            "collective",
            "torch.distributed",
        ),
        (
            [
                _py(
                    "FSDPParamGroup.wait_for_unshard",
                    SITE + "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py",
                )
            ],
            "collective",
            "torch.distributed",
        ),
        (
            [
                _py(
                    "LocalElasticAgent._monitor_workers",
                    SITE + "torch/distributed/elastic/agent/server/local_elastic_agent.py",
                )
            ],
            "launcher",
            "torch.distributed.elastic / torchrun",
        ),
        (
            [_py("_save", SITE + "torch/serialization.py"), _py("save_checkpoint", JOB)],
            "checkpoint",
            "torch.save/load, safetensors",
        ),
        (
            [_py("_write_files_from_queue", SITE + "torch/distributed/checkpoint/filesystem.py")],
            "checkpoint",
            "torch.distributed.checkpoint",
        ),
        (
            [
                _py("Condition.wait", STDLIB + "threading.py"),
                _py("Queue.get", STDLIB + "queue.py"),
                _py("Prefetcher.next", SITE + "mylib/prefetch.py"),
                _py("step", JOB),
            ],
            "other",
            "library code (mylib)",
        ),
        (
            [
                _native("0x7f4e6dca3f16", LIBC),
                _native("cudaStreamSynchronize", SITE + "nvidia/cuda_runtime/lib/libcudart.so.12"),
                _py("train_step", JOB),
            ],
            "device",
            "native CUDA synchronise",
        ),
        (
            [
                _native("pthread_cond_wait", LIBC),
                _native(
                    "c10d::ProcessGroupNCCL::WorkNCCL::wait", SITE + "torch/lib/libtorch_cuda.so"
                ),
                _py("train_step", JOB),
            ],
            "collective",
            "native c10d/gloo/NCCL frame",
        ),
        (
            [_native("at::native::addmm_out", LIBTORCH), _py("forward", JOB)],
            "other",
            "the job's own code",
        ),  # a native compute frame is passed over
        (
            [_py("Thread.join", STDLIB + "threading.py")],
            "other",
            "only standard-library or C frames",
        ),
        ([], "unknown", "no frames"),
    ],
)
def test_frames_classified_by_module_and_function(frames, kind, via):
    blocked = classify(frames)
    assert (blocked.kind, blocked.via) == (kind, via)


def test_a_stuck_stack_of_the_jobs_own_code_is_refined_by_native_frames():
    user = [_py("train_step", JOB, 42), _py("<module>", JOB, 90)]
    native = [_native("pthread_cond_wait", LIBC), _native("c10d::Work::wait", LIBTORCH), *user]
    asked = []

    def native_dump(_py_spy, pid, _timeout):
        asked.append(pid)
        return native if pid == 1 else "Error: unwinding failed"

    stacks = sample_stacks(
        "py-spy",
        [1, 2, 3],
        3,
        0.0,
        time.monotonic() + 30,
        dump=lambda _s, pid, _t: user if pid != 3 else _frames(f"{time.time()}"),
        native_dump=native_dump,
    )
    assert sorted(asked) == [1, 2]  # only stuck stacks reading "own code"; 3 moves
    one = stacks[1].figures
    assert one["in_collective"] and one["blocked_in"]["kind"] == "collective"
    assert one["blocked_in"]["via"] == "native c10d/gloo/NCCL frame (native frames)"
    assert one["stuck_in"] == "train_step (train.py:42)"  # the Python frame stays the headline
    two = stacks[2].figures
    assert not two["in_collective"] and two["blocked_in"]["kind"] == "other"
    assert "native frames unavailable: Error: unwinding failed" == two["native_sample"]


def test_a_stack_already_in_a_collective_is_not_sampled_again():
    waiting = _dump("gloo_all_reduce_waiting.json")
    asked = []
    sample_stacks(
        "py-spy",
        [1],
        2,
        0.0,
        time.monotonic() + 30,
        dump=lambda *a: waiting,
        native_dump=lambda _s, pid, _t: asked.append(pid) or [],
    )
    assert asked == []


def _signal(kind: str) -> Signal:
    return Signal(
        "stack",
        True,
        True,
        "",
        {"blocked_in": {"kind": kind}, "in_collective": kind in ("collective", "device")},
    )


def test_the_rank_in_a_data_loader_is_the_origin_when_its_peers_wait_in_the_collective():
    # the case: before, the DataLoader's multiprocessing wait read as a collective and
    # every rank was "inside", so no origin was named
    waiting = sample_stacks(
        "py-spy",
        [1],
        2,
        0.0,
        time.monotonic() + 30,
        dump=lambda *a: _dump("gloo_all_reduce_waiting.json"),
    )[1]
    loader = sample_stacks(
        "py-spy",
        [2],
        2,
        0.0,
        time.monotonic() + 30,
        dump=lambda *a: _dump("dataloader_worker_stuck.json"),
    )[2]
    assert likely_origin([(1, True, waiting), (2, True, loader)]) == {1: False, 2: True}


def test_a_rank_blocked_on_the_gpu_counts_as_waiting_on_its_peers():
    members = [
        (1, True, _signal("device")),
        (2, True, _signal("device")),
        (3, True, _signal("checkpoint")),
    ]
    assert likely_origin(members) == {1: False, 2: False, 3: True}


def test_the_launcher_or_an_empty_stack_is_never_named_the_origin():
    assert (
        likely_origin(
            [
                (1, True, _signal("collective")),
                (2, True, _signal("launcher")),
                (3, True, _signal("unknown")),
            ]
        )
        == {}
    )
    assert likely_origin(
        [
            (1, True, _signal("collective")),
            (2, True, _signal("launcher")),
            (3, True, _signal("data_loader")),
        ]
    ) == {1: False, 2: False, 3: True}


# -- a deadline, a budget and fairness inside the sampling (issue 29) ---------------------------


class _Clock:
    """A monotonic clock that moves only when a fake py-spy call takes its time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_call_gets_only_what_is_left_of_the_deadline_and_sampling_stops_there():
    clock, timeouts = _Clock(), []

    def slow_dump(_py_spy, _pid, timeout):  # a process py-spy waits on until its timeout
        timeouts.append(timeout)
        clock.t += timeout
        return _frames("sleep", "main")

    stacks = sample_stacks(
        "py-spy", [7], 3, 0.0, 12.0, dump=slow_dump, clock=clock, sleep=lambda s: None
    )
    assert timeouts == [10.0, 2.0]  # the cap, then what was left; no call past the deadline
    assert stacks[7].figures["samples"] == 2
    assert "cut short" in stacks[7].detail


def test_one_uids_many_processes_cannot_take_the_calls_another_uids_hang_needs():
    calls = {}

    def dump(_py_spy, pid, _timeout):
        calls[pid] = calls.get(pid, 0) + 1
        return _frames("wait", "main")

    many = list(range(1, 81))  # uid 1000's 80 processes come first
    uids = {**{pid: 1000 for pid in many}, 500: 2000}
    stacks = sample_stacks(
        "py-spy",
        [*many, 500],
        3,
        0.0,
        time.monotonic() + 30,
        dump=dump,
        uids=uids,
        max_calls=64,
        sleep=lambda s: None,
    )
    assert calls[500] == 3 and stacks[500].hang  # the other uid's process is fully sampled
    assert sum(calls.values()) <= 64
    skipped = [pid for pid, s in stacks.items() if s.figures.get("not_sampled") == "budget"]
    assert len(skipped) == 60 and all(uids[pid] == 1000 for pid in skipped)
    assert "uid 1000's share" in stacks[80].detail and stacks[80].figures["uid"] == 1000


def test_a_uid_whose_processes_keep_py_spy_waiting_holds_only_its_own_lanes():
    import threading

    others_done = threading.Event()
    seen_b = []

    def dump(_py_spy, pid, _timeout):
        if pid in (1, 2):  # uid A: py-spy waits on these until uid B's sampling is done
            return _frames("sleep") if others_done.wait(20) else "uid A never let B run"
        seen_b.append(pid)
        if len(seen_b) == 3:
            others_done.set()
        return _frames("sleep")

    stacks = sample_stacks(
        "py-spy",
        [1, 2, 3],
        3,
        0.0,
        time.monotonic() + 60,
        dump=dump,
        uids={1: "A", 2: "A", 3: "B"},
        workers=2,
        sleep=lambda s: None,
    )
    assert others_done.is_set() and stacks[3].figures["samples"] == 3
    assert stacks[1].available and stacks[2].available


def _recording_py_spy(tmp_path, fail_nonblocking: bool = False) -> tuple[str, Path]:
    """A py-spy stand-in that logs its argv and prints one stuck "own code" stack as JSON."""
    log, path = tmp_path / "argv.log", tmp_path / "py-spy"
    dump = [{"thread_name": "MainThread", "frames": [_py("train_step", JOB, 42)]}]
    path.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"if {fail_nonblocking!r} and '--nonblocking' in sys.argv:\n"
        "    sys.stderr.write('Error: failed to copy PyThreadState\\n'); sys.exit(1)\n"
        f"print(json.dumps({dump!r}))\n"
    )
    path.chmod(0o755)
    return str(path), log


def test_samples_do_not_stop_the_process_and_only_the_native_sample_does(tmp_path):
    py_spy, log = _recording_py_spy(tmp_path)
    stack = sample_stacks(py_spy, [os.getpid()], 2, 0.0, time.monotonic() + 30)[os.getpid()]
    assert stack.hang
    argvs = log.read_text().splitlines()
    assert [("--nonblocking" in a, "--native" in a) for a in argvs] == [
        (True, False),
        (True, False),
        (False, True),
    ]  # py-spy refuses --native --nonblocking


def test_a_failed_nonblocking_sample_of_a_live_process_is_taken_again_stopping_it(tmp_path):
    py_spy, log = _recording_py_spy(tmp_path, fail_nonblocking=True)
    stack = sample_stacks(py_spy, [os.getpid()], 2, 0.0, time.monotonic() + 30)[os.getpid()]
    assert stack.available and stack.figures["samples"] == 2
    assert sum("--nonblocking" not in a for a in log.read_text().splitlines()) >= 2
