"""The hang origin from real stacks: real gloo ranks hung for real, sampled by the real py-spy.

Two jobs of two ranks each. In both, rank 0 waits in ``dist.all_reduce`` for rank 1, and rank
1 never comes: in job A it is blocked in a DataLoader whose worker stopped answering (the
main process waits in ``multiprocessing.connection.wait``), in job B in its own code's
``queue.Queue.get`` whose producer thread died (``threading.Condition.wait``). Both are "wait"
frames of the standard library; neither is a collective, so rank 1 is the likely origin.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from node_agent.peers import free_loopback_port
from node_agent.training.stacks import dump_once, find_py_spy, sample_stacks
from node_agent.training.verdict import likely_origin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: no gloo ranks to hang",
)

RANK = r"""
import os, queue, sys, threading, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class StoppedStorage(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i >= 2:
            time.sleep(3600)  # the storage behind the loader stopped answering
        return torch.ones(4)


def next_batch(q):
    return q.get()  # the prefetch thread that fills q has died


dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(16))  # waits for rank 1, which never comes
elif sys.argv[1] == "dataloader":
    loader = iter(DataLoader(StoppedStorage(), batch_size=1, num_workers=1))
    next(loader), next(loader)
    next(loader)
else:
    q = queue.Queue()
    threading.Thread(target=lambda: None).start()
    next_batch(q)
"""


def _job(tmp_path, mode: str) -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_loopback_port())
    return [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            start_new_session=True,
        )
        for r in range(2)
    ]


def _until_blocked(
    py_spy: str, procs: list[subprocess.Popen], where: dict[int, str], timeout_s: float = 90
) -> None:
    """Wait until each rank's main thread shows its blocking frame (torch imports take
    seconds); skip when py-spy cannot read the processes here."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {}
        for rank, p in enumerate(procs):
            assert p.poll() is None, f"rank {rank} exited with {p.returncode}"
            got = dump_once(py_spy, p.pid, 10)
            if isinstance(got, str):
                if "permission" in got.lower() or "ptrace" in got.lower():
                    pytest.skip(f"py-spy cannot read the ranks here: {got}")
                seen[rank] = ""
                continue
            seen[rank] = " ".join(f["name"] for f in got)
        if all(where[r] in seen[r] for r in where):
            return
        time.sleep(0.5)
    pytest.fail(f"ranks did not reach their blocking frames in {timeout_s} s: {seen}")


@pytest.fixture
def jobs(tmp_path):
    started: list[subprocess.Popen] = []

    def start(mode: str) -> list[subprocess.Popen]:
        (tmp_path / mode).mkdir()
        procs = _job(tmp_path / mode, mode)
        started.extend(procs)
        return procs

    yield start
    for p in started:
        try:
            os.killpg(p.pid, 9)  # each rank leads its own session: its DataLoader worker too
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


@pytest.mark.parametrize(
    "mode, blocked_frame, kind",
    [
        ("dataloader", "_MultiProcessingDataLoaderIter._try_get_data", "data_loader"),
        ("queue", "next_batch", "other"),
    ],
)
def test_rank_blocked_outside_the_collective_is_named_the_origin(jobs, mode, blocked_frame, kind):
    py_spy = find_py_spy()
    if py_spy is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    procs = jobs(mode)
    _until_blocked(py_spy, procs, {0: "all_reduce", 1: blocked_frame})
    pids = [p.pid for p in procs]
    stacks = sample_stacks(py_spy, pids, 3, 0.5, time.monotonic() + 60)
    waiting, stopped = stacks[pids[0]], stacks[pids[1]]
    assert waiting.hang and stopped.hang, (waiting.detail, stopped.detail)
    assert waiting.figures["blocked_in"]["kind"] == "collective"
    assert waiting.figures["in_collective"] is True
    assert stopped.figures["blocked_in"]["kind"] == kind
    assert blocked_frame in stopped.figures["blocked_in"]["frame"]
    assert stopped.figures["in_collective"] is False
    # a stdlib "wait" frame is innermost on the stopped rank: what used to read as a collective
    assert (
        "wait" in stopped.figures["frames"][0].lower()
        or "select" in stopped.figures["frames"][0].lower()
    )
    assert likely_origin([(pids[0], True, waiting), (pids[1], True, stopped)]) == {
        pids[0]: False,
        pids[1]: True,
    }
