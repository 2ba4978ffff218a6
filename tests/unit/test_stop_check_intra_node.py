"""stop-check's intra-node phase on a GPU node: a GPU every copy of which is slow is timed again
and named only if it is slow again.

There is no GPU here: the devices are stand-ins on the CPU that say they are not simulated (so
their copies are graded), and the copies' seconds come from a table instead of a clock; the
copies themselves, the byte check, the signed message's schema and the naming are the real
code."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("torch", reason="torch is not installed: the stop-check phases need it")

from node_agent.stopcheck import phases  # noqa: E402
from node_agent.stopcheck.signed import check  # noqa: E402

GPUS = 4
FAST_S, SLOW_S = 0.001, 0.01  # a tenth of the speed: far below half the node's median pair


class _OneRank:
    """The exchange of a job of one rank: its own message, checked against the phase's schema
    as every rank checks every message it receives."""

    def gather(self, phase, mine, schema):
        check(mine, schema)
        return [mine]


def _side() -> types.SimpleNamespace:
    gpus = [
        types.SimpleNamespace(
            spec=types.SimpleNamespace(index=i),
            device="cpu",
            simulated=False,
            synchronize=lambda: None,
        )
        for i in range(GPUS)
    ]
    return types.SimpleNamespace(
        devices=gpus,
        node="node0",
        nodes={0: "node0"},
        place=types.SimpleNamespace(rank=0, world_size=1),
        exchange=_OneRank(),
    )


def _intra_node(monkeypatch, slow_gpu: int, timings_slow: int) -> phases.PhaseOutcome:
    """The phase with every copy to or from ``slow_gpu`` slow in its first ``timings_slow``
    timings (each pair is timed once, and again if its GPU was named)."""
    real_copy = phases._timed_copy
    timed: dict[tuple[int, int], int] = {}

    def copy(src, dst, size):
        _, bad = real_copy(src, dst, size)
        pair = (src.spec.index, dst.spec.index)
        timed[pair] = timed.get(pair, 0) + 1
        slow = slow_gpu in pair and timed[pair] <= timings_slow
        return (SLOW_S if slow else FAST_S), bad

    monkeypatch.setattr(phases, "_timed_copy", copy)
    monkeypatch.setattr(phases, "INTRA_NODE_BYTES", 1 << 16)
    return phases.phase_intra_node(_side())


def test_a_gpu_slow_in_every_copy_and_again_when_retimed_is_named(monkeypatch):
    outcome = _intra_node(monkeypatch, slow_gpu=2, timings_slow=2)
    (suspect,) = outcome.suspects
    assert (suspect.node, suspect.gpu) == ("node0", 2)
    assert set(suspect.evidence["pairs_gbps"]) == set(suspect.evidence["pairs_gbps_first"])
    assert len(suspect.evidence["pairs_gbps"]) == 2 * (GPUS - 1)
    assert len(outcome.figures["node0"]["pairs_retimed"]) == 2 * (GPUS - 1)


def test_a_gpu_slow_only_in_its_first_timing_is_not_named(monkeypatch):
    outcome = _intra_node(monkeypatch, slow_gpu=2, timings_slow=1)
    assert outcome.suspects == []
    # the first timing and the second are both in the figures, for the operator
    figures = outcome.figures["node0"]
    assert figures["pairs"]["2->0"] < figures["pairs_retimed"]["2->0"]


def test_a_node_whose_copies_are_alike_is_timed_once(monkeypatch):
    outcome = _intra_node(monkeypatch, slow_gpu=-1, timings_slow=0)
    assert outcome.suspects == [] and outcome.figures["node0"]["pairs_retimed"] == {}
    assert outcome.figures["node0"]["copies"] == GPUS * (GPUS - 1)
