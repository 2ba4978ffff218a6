"""stop-check's neighbours phase on real torch.distributed (gloo, four ranks in processes of
their own): data that arrives wrong names the end that spoilt it, never the healthy receiver.

A rank whose send buffer is spoilt stands in for a NIC or GPU that corrupts what it puts on
the wire: its ``torch.full`` writes a wrong value into what it makes (no NIC can be faulted
here). The audit's case: every rank named the receiver, node1, and node0 stayed in service."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("torch", reason="torch is not installed: the stop-check phases need it")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from node_agent.stopcheck import phases  # noqa: E402

RANKS = 4


class _Gather:
    """The phase's exchange without signing (signing has its own tests): all_gather_object."""

    def __init__(self, n: int) -> None:
        self.n = n

    def gather(self, phase, mine, schema):
        out = [None] * self.n
        dist.all_gather_object(out, mine)
        return out


def _rank(rank: int, init: str, spoilt: int | None, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    nodes = [f"node{i}" for i in range(RANKS)]
    side = types.SimpleNamespace(
        place=types.SimpleNamespace(world_size=RANKS, rank=rank),
        backend="gloo",
        devices=[],
        slow_link=1.0,
        nodes=nodes,
        node=nodes[rank],
        exchange=_Gather(RANKS),
    )
    if rank == spoilt:
        real_full = torch.full

        def spoilt_full(size, value, **kw):
            tensor = real_full(size, value, **kw)
            tensor[:16] = -1.0
            return tensor

        torch.full = spoilt_full
    outcome = phases.phase_neighbours(side)
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(outcome.to_dict(), f)
    dist.destroy_process_group()


def neighbours(tmp_path, spoilt: int | None) -> list[dict]:
    mp.spawn(_rank, args=(f"file://{tmp_path}/store", spoilt, str(tmp_path)), nprocs=RANKS)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(RANKS)]


def test_a_sender_that_spoils_its_data_is_named_not_its_healthy_receiver(tmp_path):
    for outcome in neighbours(tmp_path, spoilt=0):
        (suspect,) = outcome["suspects"]
        assert suspect["node"] == "node0" and suspect["evidence"]["end"] == "sender"
        assert suspect["evidence"]["to"] == "node1"
        spoilt = 16 * (phases.NEIGHBOUR_ITERS + 1)  # every exchange, the untimed first too
        assert outcome["figures"]["wrong_elements"] == {"node0->node1": spoilt}
