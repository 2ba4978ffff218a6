"""stop-check's neighbours phase on real torch.distributed (gloo, four ranks in processes of
their own): data that arrives wrong names the end that spoilt it, never the healthy receiver,
and a node is named slow only when a second timing finds it slow again.

A rank whose send buffer is spoilt stands in for a NIC or GPU that corrupts what it puts on
the wire: its ``torch.full`` writes a wrong value into what it makes (no NIC can be faulted
here). The audit's case: every rank named the receiver, node1, and node0 stayed in service.
A slow node is the simulator's ``slow_link`` (the phase sleeps as a link at that share of its
speed would take); a node slow in the first timing only stands in for a process the host
descheduled while it was timed, which once failed a healthy six-node job in CI."""

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
#: a slow node's link speed: its two pairs of the four are half the pairs, so the median pair lies
#: between slow and fast; a twentieth keeps the slow pairs below half of it even when the host's
#: load slows the fast pairs several times over (at a fifth, one loaded run missed it)
SLOW_LINK = 0.05


class _Gather:
    """The phase's exchange without signing (signing has its own tests): all_gather_object."""

    def __init__(self, n: int) -> None:
        self.n = n

    def gather(self, phase, mine, schema):
        out = [None] * self.n
        dist.all_gather_object(out, mine)
        return out


def _rank(rank: int, init: str, faults: dict[int, str], out: str) -> None:
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
    if faults.get(rank) == "slow":
        side.slow_link = SLOW_LINK
    if faults.get(rank) == "slow once":
        first_timing = phases._timed_ring

        def slow_once(side, *args):
            side.slow_link = SLOW_LINK
            try:
                return first_timing(side, *args)
            finally:
                side.slow_link = 1.0
                phases._timed_ring = first_timing

        phases._timed_ring = slow_once
    if faults.get(rank) == "spoilt":
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


def neighbours(tmp_path, faults: dict[int, str]) -> list[dict]:
    mp.spawn(_rank, args=(f"file://{tmp_path}/store", faults, str(tmp_path)), nprocs=RANKS)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(RANKS)]


def test_a_sender_that_spoils_its_data_is_named_not_its_healthy_receiver(tmp_path):
    for outcome in neighbours(tmp_path, {0: "spoilt"}):
        (suspect,) = outcome["suspects"]
        assert suspect["node"] == "node0" and suspect["evidence"]["end"] == "sender"
        assert suspect["evidence"]["to"] == "node1"
        spoilt = 16 * (phases.NEIGHBOUR_ITERS + 1)  # every exchange, the untimed first too
        assert outcome["figures"]["wrong_elements"] == {"node0->node1": spoilt}


def test_a_node_slow_in_both_timings_is_named_with_both_as_evidence(tmp_path):
    for outcome in neighbours(tmp_path, {2: "slow"}):
        (suspect,) = outcome["suspects"]
        assert suspect["node"] == "node2"
        assert set(suspect["evidence"]["pairs_gbps_retimed"]) == set(
            suspect["evidence"]["pairs_gbps"]
        ) | {
            "node0<->node1",
            "node3<->node0",
        }
        assert outcome["figures"]["slow_once_not_again"] == []


def test_a_node_slow_only_while_first_timed_is_not_named(tmp_path):
    for outcome in neighbours(tmp_path, {2: "slow once"}):
        assert outcome["suspects"] == []
        assert outcome["figures"]["slow_once_not_again"] == ["node2"]
        assert "pairs_gbps_retimed" in outcome["figures"]
