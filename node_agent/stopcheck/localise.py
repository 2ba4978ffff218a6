"""From what the ranks shared to the suspects: pure functions, no torch, no network.

Each phase of ``node-agent stop-check`` (docs/stop_check.md) ends in one of these:

- :func:`odd_hashes`: the bitwise-alignment phase. Every GPU of every node ran the same
  deterministic reference step; within one group of like GPUs (same SKU and software stack) the
  majority's hash is right and every GPU that disagrees is a suspect, named down to the GPU.
- :func:`slow_nodes`: the neighbours phase. Node i exchanged data with i-1 and i+1 along a ring;
  a node whose two pairs are both slow is the suspect, not its neighbours (each of them has only
  one slow pair).
- :func:`grid` and :func:`cross`: the dual-phase replay. Nodes sit in a grid; their results are
  reduced along rows, then along columns, and compared bit for bit across groups; the suspects are
  where a disagreeing row crosses a disagreeing column (ByteRobust, SOSP 2025, section 5).
- :func:`evict`: the suspects widened to their parallel groups (the fleet topology format,
  NVLink domains among them: node_agent/fleet/topology.py), as ByteRobust over-evicts by
  parallel group rather than diagnose slowly.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Suspect:
    """A machine a phase names: ``node`` (its hostname), ``gpu`` where known, the ``phase`` that
    named it and the ``evidence`` for it."""

    node: str
    phase: str
    evidence: dict[str, Any] = field(default_factory=dict)
    gpu: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "phase": self.phase, "evidence": self.evidence}
        if self.gpu is not None:
            out["gpu"] = self.gpu
        return out


@dataclass(frozen=True)
class GpuHash:
    """One GPU's hash of the reference step, and what makes its bits comparable with another's."""

    node: str
    gpu: int
    digest: str
    stack: str  # SKU and software: only GPUs of one stack must agree bit for bit


def odd_hashes(hashes: Iterable[GpuHash], phase: str = "alignment") -> list[Suspect]:
    """The GPUs whose hash differs from their stack's majority.

    A stack with no strict majority (two GPUs that disagree, or a three-way split) names nobody:
    which side is right cannot be told, and a guess could evict a good machine. The evidence
    says so instead (see :func:`undecided_stacks`).
    """
    by_stack: dict[str, list[GpuHash]] = {}
    for h in hashes:
        by_stack.setdefault(h.stack, []).append(h)
    out: list[Suspect] = []
    for stack, members in sorted(by_stack.items()):
        majority = _strict_majority([m.digest for m in members])
        if majority is None:
            continue
        for m in members:
            if m.digest != majority:
                out.append(
                    Suspect(
                        m.node,
                        phase,
                        gpu=m.gpu,
                        evidence={
                            "hash": m.digest,
                            "majority_hash": majority,
                            "stack": stack,
                            "agreeing_gpus": sum(1 for x in members if x.digest == majority),
                            "gpus": len(members),
                        },
                    )
                )
    return out


def undecided_stacks(hashes: Iterable[GpuHash]) -> list[str]:
    """Stacks whose GPUs disagree with no strict majority: nobody is named, a person looks."""
    by_stack: dict[str, list[str]] = {}
    for h in hashes:
        by_stack.setdefault(h.stack, []).append(h.digest)
    return sorted(s for s, d in by_stack.items() if len(set(d)) > 1 and _strict_majority(d) is None)


def _strict_majority(values: Sequence[str]) -> str | None:
    if not values:
        return None
    value, count = Counter(values).most_common(1)[0]
    return value if count * 2 > len(values) else None


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """The neighbour pairs of a ring of ``n`` ranks: (i, i+1 mod n); a pair once for n = 2."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def slow_nodes(
    pair_gbps: Mapping[tuple[int, int], float],
    nodes: Sequence[str],
    slow_below: float = 0.5,
    phase: str = "neighbours",
) -> list[Suspect]:
    """Nodes whose every neighbour pair is slow: below ``slow_below`` x the median pair.

    A slow link slows both pairs it is part of; each neighbour then has one slow pair and one
    normal one, so only the node in the middle is named. With two nodes (one pair) nobody can be
    told apart and nobody is named: the evidence says the pair is slow.
    """
    if len(pair_gbps) < 3:
        return []
    median = statistics.median(pair_gbps.values())
    slow = {p for p, v in pair_gbps.items() if v < slow_below * median}
    out: list[Suspect] = []
    for rank, node in enumerate(nodes):
        mine = {p: v for p, v in pair_gbps.items() if rank in p}
        if mine and all(p in slow for p in mine):
            out.append(
                Suspect(
                    node,
                    phase,
                    evidence={
                        "pairs_gbps": {
                            f"{nodes[a]}<->{nodes[b]}": round(v, 3)
                            for (a, b), v in sorted(mine.items())
                        },
                        "median_pair_gbps": round(median, 3),
                        "slow_below": slow_below,
                    },
                )
            )
    return out


def grid(n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows and columns of a near-square grid of ranks 0..n-1 (row-major; the last row may be
    short). Every rank is in exactly one row and one column; with ``c = ceil(sqrt(n))`` columns
    there are O(sqrt n) groups of O(sqrt n) ranks each.

    >>> grid(6)
    ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    """
    if n < 1:
        return [], []
    cols = math.ceil(math.sqrt(n))
    rows = [list(range(r, min(r + cols, n))) for r in range(0, n, cols)]
    columns = [[r for r in range(c, n, cols)] for c in range(cols) if c < n]
    return rows, columns


@dataclass(frozen=True)
class GroupResult:
    """A group's reduced result for one round: the digests of its elementwise minimum and maximum
    over the members' outputs. Equal min and max means every member produced the same bits."""

    members: tuple[int, ...]
    min_digest: str
    max_digest: str

    @property
    def unanimous(self) -> bool:
        return self.min_digest == self.max_digest


def disagreeing(groups: Sequence[GroupResult]) -> list[GroupResult]:
    """Groups whose members disagree among themselves, or whose (unanimous) result differs from
    the majority of unanimous groups' results."""
    unanimous = [g.min_digest for g in groups if g.unanimous]
    majority = _strict_majority(unanimous) if unanimous else None
    return [
        g for g in groups if not g.unanimous or (majority is not None and g.min_digest != majority)
    ]


def cross(rows: Sequence[GroupResult], columns: Sequence[GroupResult]) -> set[int]:
    """Ranks where a disagreeing row crosses a disagreeing column (one round)."""
    bad_rows = disagreeing(rows)
    bad_cols = disagreeing(columns)
    in_rows = {r for g in bad_rows for r in g.members}
    in_cols = {r for g in bad_cols for r in g.members}
    return in_rows & in_cols


def evict(suspects: Iterable[Suspect], topology: Mapping[str, Sequence[str]] | None) -> list[str]:
    """The nodes to take out: every suspect, widened to every parallel group it belongs to.

    An NVLink domain is such a group (``nvlink:<cluster_uuid>/<clique_id>``): a job laid out
    over a GB200/GB300 NVL72 rack cannot run on part of it, so one bad tray takes its domain's
    trays out with it."""
    named = {s.node for s in suspects}
    out = set(named)
    for members in (topology or {}).values():
        if named & set(members):
            out.update(members)
    return sorted(out)
