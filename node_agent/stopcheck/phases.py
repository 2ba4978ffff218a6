"""The phases of a stop-time check, each run by every rank of the job at once, cheapest first.

Every phase is a constant number of collective rounds whatever the node count (the hash and
summary gathers grow with it, in bytes); each ends with the same list of suspects on every rank
(:mod:`node_agent.stopcheck.localise` decides, on data every rank holds). A phase that cannot run
here says why (``skipped``); a phase that broke (a peer vanished, a collective timed out) says
how (``error``) and the phases after it do not run, since the group is no longer whole.

What ranks share is data, signed with the job's key (:class:`~node_agent.stopcheck.signed.Exchange`)
and checked against the phase's schema (:data:`SCHEMAS`), indexed by rank: whose node it is comes
from the signed join, never from the message. A message that cannot be verified is not a broken
phase but :class:`~node_agent.stopcheck.signed.PeerUnverified`, which stops the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from node_agent.model import Level, Report
from node_agent.stopcheck import localise
from node_agent.stopcheck.localise import GpuHash, GroupResult, Suspect
from node_agent.stopcheck.reference import digest, run_step
from node_agent.stopcheck.signed import Exchange, MapOf, PeerUnverified

if TYPE_CHECKING:
    from node_agent.compute.devices import ComputeDevice
    from node_agent.stopcheck.ranks import Place

#: bytes each rank sends its ring neighbour per timed exchange, and the timed exchanges
NEIGHBOUR_BYTES = 8 << 20
NEIGHBOUR_ITERS = 5
#: a neighbour pair is slow below this share of the median pair (a link at half speed or worse)
SLOW_PAIR_SHARE = 0.5
#: a copy between two GPUs of one node is slow below this share of the node's median pair
SLOW_COPY_SHARE = 0.5
INTRA_NODE_BYTES = 64 << 20
SIM_INTRA_NODE_BYTES = 1 << 20
#: seed of the alignment phase's reference step; the replay's rounds use REPLAY_SEED + round
ALIGNMENT_SEED = 0
REPLAY_SEED = 1000


@dataclass
class NodeSide:
    """What one rank knows of its own node."""

    place: Place
    node: str
    nodes: dict[int, str]  # rank -> node name (everyone joined), bound by the signed join
    exchange: Exchange  # every rank's data, signed; indexed by rank, never by a name in it
    devices: list[ComputeDevice]
    stack: str  # SKU and software: GPUs of one stack must agree bit for bit
    quick_report: Callable[[], Report]
    slow_link: float = 1.0  # simulated only: the node's inter-node transfers' speed factor
    backend: str = "gloo"


@dataclass
class PhaseOutcome:
    name: str
    duration_s: float = 0.0
    suspects: list[Suspect] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # per node: what rank 0 records
    skipped: str | None = None
    error: str | None = None
    report: Report | None = None  # phase "self": this node's quick-suite report

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "duration_s": round(self.duration_s, 3),
            "suspects": [s.to_dict() for s in self.suspects],
            "figures": self.figures,
        }
        if self.skipped:
            out["skipped"] = self.skipped
        if self.error:
            out["error"] = self.error
        return out


#: what each phase's message holds (:func:`node_agent.stopcheck.signed.check`); a node's name is
#: never in it: the rank it came from, bound at join, says whose it is
_HASHES = [{"gpu": int, "digest": lambda v: isinstance(v, str) and len(v) == 64}]
_PAIR = r"\d{1,4}->\d{1,4}"
SCHEMAS: dict[str, Any] = {
    "self": {"level": lambda v: v in Level.__members__, "reasons": [str]},
    "intra_node": {
        "pairs": MapOf(float, _PAIR),
        "pairs_retimed": MapOf(float, _PAIR),
        "bad_bytes": MapOf(int, _PAIR),
        "copies": int,
        "bandwidth_graded": bool,
    },
    "neighbours": {"seconds": float, "wrong_elements": int},
    "neighbours-retimed": {"seconds": float},
    "neighbours-again": {"wrong_elements": int},
    "alignment": {"stack": str, "hashes": _HASHES},
    "alignment-rerun": {"hashes": _HASHES},
    "replay": {"row": (int, str, str), "col": (int, str, str)},
}


def run_phase(name: str, fn: Callable[[NodeSide], PhaseOutcome], side: NodeSide) -> PhaseOutcome:
    start = time.monotonic()
    try:
        outcome = fn(side)
    except PeerUnverified:  # not a broken phase: a peer that cannot be believed stops the run
        raise
    except Exception as err:  # a peer gone, a collective timed out: the group is broken
        outcome = PhaseOutcome(name, error=f"{type(err).__name__}: {str(err)[:300]}")
    outcome.duration_s = time.monotonic() - start
    return outcome


# -- 1. self ------------------------------------------------------------------------------------


def phase_self(side: NodeSide) -> PhaseOutcome:
    """Every node runs its quick suite; a node graded ERROR or FAULT is a suspect already."""
    report = side.quick_report()
    mine = {
        "level": report.grade.level.name,
        "reasons": [f"{r.target}: {r.message}" for r in report.grade.reasons][:10],
    }
    shared = side.exchange.gather("self", mine, SCHEMAS["self"])
    suspects = [
        Suspect(side.nodes[r], "self", evidence={"level": s["level"], "reasons": s["reasons"]})
        for r, s in enumerate(shared)
        if Level[s["level"]] >= Level.ERROR
    ]
    return PhaseOutcome(
        "self",
        suspects=suspects,
        report=report,
        figures={side.nodes[r]: {"level": s["level"]} for r, s in enumerate(shared)},
    )


# -- 2. intra-node ------------------------------------------------------------------------------


def _pattern(size: int, src: int, dst: int, device: Any) -> Any:
    import torch

    g = torch.Generator(device="cpu").manual_seed(7919 * (src + 1) + dst)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(device)


def _timed_copy(src: ComputeDevice, dst: ComputeDevice, size: int) -> tuple[float, int]:
    """One copy of a pattern from ``src`` to ``dst``: its seconds, and the bytes that arrived
    wrong."""
    buf = _pattern(size, src.spec.index, dst.spec.index, src.device)
    src.synchronize()
    start = time.perf_counter()
    out = buf.to(dst.device, copy=True)
    dst.synchronize()
    elapsed = max(time.perf_counter() - start, 1e-9)
    return elapsed, int((out.cpu() != buf.cpu()).sum())


def phase_intra_node(side: NodeSide) -> PhaseOutcome:
    """An all-to-all among the node's GPUs, pair by pair: every byte checked, bandwidth compared
    with the node's other pairs (GPUs only: simulated GPUs share the host's memory). A GPU every
    pair of which is slow is timed again, pair by pair, and named only if it is slow again (a
    first copy also pays for setting the pair up, and a host busy elsewhere slows one timing)."""
    devices = side.devices
    mine: dict[str, Any] = {
        "pairs": {},
        "pairs_retimed": {},
        "bad_bytes": {},
        "copies": 0,
        "bandwidth_graded": False,
    }
    if len(devices) >= 2:
        simulated = devices[0].simulated
        size = SIM_INTRA_NODE_BYTES if simulated else INTRA_NODE_BYTES
        for src in devices:
            for dst in devices:
                if src is dst:
                    continue
                elapsed, bad = _timed_copy(src, dst, size)
                key = f"{src.spec.index}->{dst.spec.index}"
                if not simulated:  # simulated GPUs share the host's memory: no link to time
                    mine["pairs"][key] = round(size / elapsed / 1e9, 3)
                mine["copies"] += 1
                if bad:
                    mine["bad_bytes"][key] = bad
        mine["bandwidth_graded"] = not simulated
        slow = {s.gpu for s in _slow_gpus(side.node, mine["pairs"])} if not simulated else set()
        by_index = {dev.spec.index: dev for dev in devices}
        for key in mine["pairs"]:
            a, b = (int(x) for x in key.split("->"))
            if a in slow or b in slow:
                elapsed, _ = _timed_copy(by_index[a], by_index[b], size)
                mine["pairs_retimed"][key] = round(size / elapsed / 1e9, 3)
    shared = side.exchange.gather("intra_node", mine, SCHEMAS["intra_node"])
    suspects: list[Suspect] = []
    for rank, data in enumerate(shared):
        node = side.nodes[rank]
        for key, bad in data["bad_bytes"].items():
            _src_index, dst_index = (int(x) for x in key.split("->"))
            suspects.append(
                Suspect(
                    node,
                    "intra_node",
                    gpu=dst_index,
                    evidence={
                        "pair": key,
                        "wrong_bytes": bad,
                        "note": "the copy's destination is named; its source may be at fault",
                    },
                )
            )
        if data.get("bandwidth_graded") and len(data["pairs"]) >= 2:
            suspects.extend(_slow_twice(node, data["pairs"], data["pairs_retimed"]))
    outcome = PhaseOutcome(
        "intra_node",
        suspects=suspects,
        figures={side.nodes[r]: data for r, data in enumerate(shared)},
    )
    if len(devices) < 2:
        outcome.skipped = (
            (f"{side.node} has {len(devices)} GPU: nothing to exchange within the node")
            if side.place.rank == 0
            else None
        )
    return outcome


def _slow_twice(node: str, pairs: dict[str, float], retimed: dict[str, float]) -> list[Suspect]:
    """The GPUs slow in the first timing that are slow again with their pairs timed anew."""
    first = {s.gpu for s in _slow_gpus(node, pairs)}
    again = _slow_gpus(node, {**pairs, **retimed}) if retimed else []
    out = []
    for s in again:
        if s.gpu in first:
            theirs = {k: v for k, v in pairs.items() if str(s.gpu) in k.split("->")}
            out.append(Suspect(node, s.phase, {"pairs_gbps_first": theirs, **s.evidence}, s.gpu))
    return out


def _slow_gpus(node: str, pairs: dict[str, float]) -> list[Suspect]:
    median = statistics.median(pairs.values())
    slow = {k for k, v in pairs.items() if v < SLOW_COPY_SHARE * median}
    gpus = {int(x) for k in pairs for x in k.split("->")}
    out = []
    for gpu in sorted(gpus):
        theirs = [k for k in pairs if str(gpu) in k.split("->")]
        if theirs and all(k in slow for k in theirs):
            out.append(
                Suspect(
                    node,
                    "intra_node",
                    gpu=gpu,
                    evidence={
                        "pairs_gbps": {k: pairs[k] for k in theirs},
                        "median_pair_gbps": median,
                    },
                )
            )
    return out


# -- 3. neighbours ------------------------------------------------------------------------------


def _timed_ring(side: NodeSide, send: Any, recv: Any, where: Any) -> tuple[float, int]:
    """This rank's median time to send right and receive left at once over the timed exchanges
    (each between barriers; the first, which connects the pair, is not timed), and how many
    elements arrived other than the left neighbour's."""
    import torch
    import torch.distributed as dist

    n, rank = side.place.world_size, side.place.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    times: list[float] = []
    wrong = 0
    for it in range(NEIGHBOUR_ITERS + 1):
        dist.barrier()
        start = time.perf_counter()
        for req in (dist.isend(send, right), dist.irecv(recv, left)):
            if req is not None:  # None: this rank is not in the group (never here)
                req.wait()
        if where != "cpu":
            torch.cuda.synchronize(where)
        elapsed = time.perf_counter() - start
        if side.slow_link < 1.0:  # simulated slow link: the transfer took 1/f as long
            time.sleep(elapsed * (1.0 / side.slow_link - 1.0))
            elapsed /= side.slow_link
        wrong += int((recv != float(left + 1)).sum())
        if it:  # the first exchange connects the pair: not timed
            times.append(elapsed)
    return statistics.median(times), wrong


def _pair_gbps(shared: list[dict[str, Any]], n: int) -> dict[tuple[int, int], float]:
    """Each ring pair's bandwidth, from the slower end's time."""
    seconds = {r: s["seconds"] for r, s in enumerate(shared)}
    return {
        (a, b): NEIGHBOUR_BYTES / max(seconds[a], seconds[b], 1e-9) / 1e9
        for a, b in localise.ring_pairs(n)
    }


def _named_pairs(pair_gbps: dict[tuple[int, int], float], nodes: list[str]) -> dict[str, float]:
    return {f"{nodes[a]}<->{nodes[b]}": round(v, 3) for (a, b), v in sorted(pair_gbps.items())}


def phase_neighbours(side: NodeSide) -> PhaseOutcome:
    """Each rank exchanges with its ring neighbours at once (send right, receive left), timed
    between barriers; a pair's time is the slower end's. A node both of whose pairs are slow is
    the suspect (:func:`localise.slow_nodes`) only if a second timing names it again: one
    timing is also slow when the node's process was merely descheduled, and naming a node on it
    would drain a healthy machine. Every received byte is checked, and data that arrived wrong
    is traced to its sender or its receiver by a second pairing (:func:`_wrong_ends`)."""
    import torch

    n, rank = side.place.world_size, side.place.rank
    where = side.devices[0].device if side.backend == "nccl" and side.devices else "cpu"
    elements = NEIGHBOUR_BYTES // 4
    send = torch.full((elements,), float(rank + 1), device=where)
    recv = torch.empty(elements, device=where)
    nodes = [side.nodes[r] for r in range(n)]
    seconds, wrong = _timed_ring(side, send, recv, where)
    shared = side.exchange.gather(
        "neighbours", {"seconds": seconds, "wrong_elements": wrong}, SCHEMAS["neighbours"]
    )
    pair_gbps = _pair_gbps(shared, n)
    suspects = localise.slow_nodes(pair_gbps, nodes, SLOW_PAIR_SHARE)
    figures: dict[str, Any] = {"pairs_gbps": _named_pairs(pair_gbps, nodes)}
    if suspects:  # every rank holds the same figures, so every rank times again, or none does
        seconds, _ = _timed_ring(side, send, recv, where)
        again = side.exchange.gather(
            "neighbours-retimed", {"seconds": seconds}, SCHEMAS["neighbours-retimed"]
        )
        retimed = _pair_gbps(again, n)
        figures["pairs_gbps_retimed"] = retimed_named = _named_pairs(retimed, nodes)
        slow_again = {s.node for s in localise.slow_nodes(retimed, nodes, SLOW_PAIR_SHARE)}
        figures["slow_once_not_again"] = [s.node for s in suspects if s.node not in slow_again]
        suspects = [
            Suspect(s.node, s.phase, {**s.evidence, "pairs_gbps_retimed": retimed_named}, s.gpu)
            for s in suspects
            if s.node in slow_again
        ]
    arrived_wrong = {r: s["wrong_elements"] for r, s in enumerate(shared) if s["wrong_elements"]}
    if arrived_wrong:
        suspects += _wrong_ends(side, send, recv, where, arrived_wrong)
        figures["wrong_elements"] = {
            f"{side.nodes[(r - 1) % n]}->{side.nodes[r]}": w
            for r, w in sorted(arrived_wrong.items())
        }
    return PhaseOutcome("neighbours", suspects=suspects, figures=figures)


def _wrong_ends(
    side: NodeSide, send: Any, recv: Any, where: Any, wrong: dict[int, int]
) -> list[Suspect]:
    """Which end of a transfer that arrived wrong is at fault: data from rank r-1 that rank r
    received wrong may have been spoilt by the sender, the receiver or the link. Every rank
    sends its buffer again two ahead and receives from two behind (other partners); a sender
    whose second transfer arrives wrong too, or a receiver that gets wrong data again from
    another sender, is named, with both rounds as evidence. Naming the receiver alone had sent
    the healthy node of the pair to be drained while the sender stayed in service. With fewer
    than three ranks, or when the second round is clean, no end can be told apart and none is
    named: the figures say which transfer arrived wrong."""
    import torch
    import torch.distributed as dist

    n, rank = side.place.world_size, side.place.rank
    if n < 3:
        return []
    ahead, behind = (rank + 2) % n, (rank - 2) % n
    again = torch.empty_like(recv)
    for req in (dist.isend(send, ahead), dist.irecv(again, behind)):
        if req is not None:
            req.wait()
    if where != "cpu":
        torch.cuda.synchronize(where)
    mine = {"wrong_elements": int((again != float(behind + 1)).sum())}
    second = side.exchange.gather("neighbours-again", mine, SCHEMAS["neighbours-again"])
    suspects = []
    for receiver, count in sorted(wrong.items()):
        sender = (receiver - 1) % n
        evidence = {
            "wrong_elements_received": count,
            "from": side.nodes[sender],
            "to": side.nodes[receiver],
        }
        for end, again_wrong, role in (
            (sender, second[(sender + 2) % n]["wrong_elements"], "sender"),
            (receiver, second[receiver]["wrong_elements"], "receiver"),
        ):
            if again_wrong:
                suspects.append(
                    Suspect(
                        side.nodes[end],
                        "neighbours",
                        evidence={**evidence, "end": role, "wrong_again": again_wrong},
                    )
                )
    return suspects


# -- 4. bitwise alignment -----------------------------------------------------------------------


def phase_alignment(side: NodeSide) -> PhaseOutcome:
    """Every GPU runs the same reference step; within a stack the majority hash is right. An odd
    GPU runs it again (one more round) and the evidence says whether it repeated."""
    mine = {
        "stack": side.stack,
        "hashes": [
            {"gpu": dev.spec.index, "digest": run_step(dev, ALIGNMENT_SEED).digest}
            for dev in side.devices
        ],
    }
    shared = side.exchange.gather("alignment", mine, SCHEMAS["alignment"])
    everyone = [
        GpuHash(side.nodes[r], h["gpu"], h["digest"], part["stack"])
        for r, part in enumerate(shared)
        for h in part["hashes"]
    ]
    suspects = localise.odd_hashes(everyone)
    mine_odd = {s.gpu for s in suspects if s.node == side.node}
    again = [
        {"gpu": dev.spec.index, "digest": run_step(dev, ALIGNMENT_SEED).digest}
        for dev in side.devices
        if dev.spec.index in mine_odd
    ]
    shared = side.exchange.gather("alignment-rerun", {"hashes": again}, SCHEMAS["alignment-rerun"])
    reruns = {
        (side.nodes[r], h["gpu"]): h["digest"]
        for r, part in enumerate(shared)
        for h in part["hashes"]
    }
    confirmed = []
    for s in suspects:
        rerun = reruns.get((s.node, s.gpu))
        evidence = {
            **s.evidence,
            "rerun_hash": rerun,
            "repeated": rerun is not None and rerun != s.evidence["majority_hash"],
        }
        confirmed.append(Suspect(s.node, s.phase, evidence, s.gpu))
    figures = {
        "gpus": len(everyone),
        "stacks": sorted({h.stack for h in everyone}),
        "undecided_stacks": localise.undecided_stacks(everyone),
    }
    return PhaseOutcome("alignment", suspects=confirmed, figures=figures)


# -- 5. dual-phase replay -----------------------------------------------------------------------


def phase_replay(side: NodeSide, rounds: int) -> PhaseOutcome:
    """R rounds of the reference step; each round the nodes' outputs are reduced (elementwise
    min and max, which are equal exactly when every member produced the same bits) along the rows
    of a grid, then along its columns, and the groups' results compared; the suspects are where a
    disagreeing row and a disagreeing column cross, in any round."""
    import torch
    import torch.distributed as dist

    n, rank = side.place.world_size, side.place.rank
    rows, cols = localise.grid(n)
    row_groups = [dist.new_group(r) for r in rows]
    col_groups = [dist.new_group(c) for c in cols]
    my_row = next(i for i, r in enumerate(rows) if rank in r)
    my_col = next(i for i, c in enumerate(cols) if rank in c)
    named: dict[int, list[int]] = {}
    for rnd in range(rounds):
        outs = [run_step(dev, REPLAY_SEED + rnd).output for dev in side.devices]
        where = side.devices[0].device if side.backend == "nccl" else "cpu"
        tensor = torch.stack([o.to(device=where, dtype=torch.float32) for o in outs])
        mine: dict[str, Any] = {}
        for axis, groups, index in (("row", row_groups, my_row), ("col", col_groups, my_col)):
            low, high = tensor.clone(), tensor.clone()
            dist.all_reduce(low, dist.ReduceOp.MIN, group=groups[index])
            dist.all_reduce(high, dist.ReduceOp.MAX, group=groups[index])
            mine[axis] = [index, digest(low), digest(high)]
        shared = side.exchange.gather("replay", mine, SCHEMAS["replay"])
        row_results = _groups(rows, shared, "row")
        col_results = _groups(cols, shared, "col")
        for r in localise.cross(row_results, col_results):
            named.setdefault(r, []).append(rnd)
    suspects = [
        Suspect(
            side.nodes[r],
            "replay",
            evidence={
                "rounds_named": rnds,
                "rounds": rounds,
                "grid": {"rows": rows, "columns": cols},
            },
        )
        for r, rnds in sorted(named.items())
    ]
    return PhaseOutcome(
        "replay",
        suspects=suspects,
        figures={"rounds": rounds, "rows": len(rows), "columns": len(cols)},
    )


def _groups(members: list[list[int]], shared: list[dict[str, Any]], axis: str) -> list[GroupResult]:
    by_index: dict[int, tuple[str, str]] = {}
    for rank, s in enumerate(shared):
        index, low, high = s[axis]
        if not 0 <= index < len(members) or rank not in members[index]:
            raise PeerUnverified(f"rank {rank}'s replay message names {axis} {index}, not its own")
        by_index.setdefault(index, (low, high))
    return [GroupResult(tuple(m), *by_index[i]) for i, m in enumerate(members)]
