"""How stop-check names a machine from what the ranks shared (node_agent.stopcheck.localise)."""

from __future__ import annotations

from node_agent.stopcheck.localise import (
    GpuHash,
    GroupResult,
    Suspect,
    cross,
    evict,
    grid,
    odd_hashes,
    ring_pairs,
    slow_nodes,
    undecided_stacks,
)

STACK = "h100-sxm5-80gb|driver 580|torch 2.13"


def hashes(
    bad: dict[tuple[str, int], str], nodes: int = 6, gpus: int = 8, stack: str = STACK
) -> list[GpuHash]:
    return [
        GpuHash(f"n{n}", g, bad.get((f"n{n}", g), "good"), stack)
        for n in range(nodes)
        for g in range(gpus)
    ]


def test_the_gpu_that_disagrees_with_its_stacks_majority_is_named_down_to_the_gpu():
    suspects = odd_hashes(hashes({("n4", 1): "flipped"}))
    assert [(s.node, s.gpu, s.phase) for s in suspects] == [("n4", 1, "alignment")]
    assert suspects[0].evidence["agreeing_gpus"] == 47


def test_gpus_of_another_stack_are_not_held_to_this_stacks_bits():
    mixed = hashes({}, nodes=3) + hashes({}, nodes=1, stack="a100|driver 535")
    mixed[-1] = GpuHash("n0", 7, "other-bits", "a100|driver 535")
    assert [(s.node, s.gpu) for s in odd_hashes(mixed)] == [("n0", 7)]


def test_no_majority_names_nobody_and_says_the_stack_is_undecided():
    split = [GpuHash("n0", 0, "a", STACK), GpuHash("n1", 0, "b", STACK)]
    assert odd_hashes(split) == []
    assert undecided_stacks(split) == [STACK]


def test_a_slow_link_names_the_node_between_two_slow_pairs_not_its_neighbours():
    nodes = [f"n{i}" for i in range(6)]
    gbps = {p: 10.0 for p in ring_pairs(6)}
    gbps[(2, 3)] = gbps[(3, 4)] = 2.0
    assert [s.node for s in slow_nodes(gbps, nodes)] == ["n3"]


def test_two_nodes_cannot_be_told_apart_by_their_one_pair():
    assert ring_pairs(2) == [(0, 1)]
    assert slow_nodes({(0, 1): 0.1}, ["a", "b"]) == []


def test_the_grid_puts_every_rank_in_one_row_and_one_column():
    for n in range(2, 40):
        rows, cols = grid(n)
        assert sorted(r for row in rows for r in row) == list(range(n))
        assert sorted(r for col in cols for r in col) == list(range(n))
        assert len(rows) <= len(cols) + 1 and max(map(len, rows)) <= len(cols)


def test_the_replay_names_where_the_disagreeing_row_and_column_cross():
    rows, cols = grid(6)  # rows [0,1,2] [3,4,5], columns [0,3] [1,4] [2,5]

    def results(groups, bad_rank):
        return [
            GroupResult(tuple(g), "x" if bad_rank in g else "ok", "y" if bad_rank in g else "ok")
            for g in groups
        ]

    assert cross(results(rows, 2), results(cols, 2)) == {2}
    assert cross(results(rows, 99), results(cols, 99)) == set()


def test_a_unanimous_group_that_differs_from_the_other_groups_disagrees():
    rows = [
        GroupResult((0, 1), "ok", "ok"),
        GroupResult((2, 3), "off", "off"),
        GroupResult((4, 5), "ok", "ok"),
    ]
    cols = [GroupResult((0, 2, 4), "ok", "ok"), GroupResult((1, 3, 5), "off", "ok")]
    assert cross(rows, cols) == {3}


def test_evict_widens_a_suspect_to_its_parallel_groups():
    topology = {"pp0": ["n0", "n1", "n2"], "pp1": ["n3", "n4", "n5"]}
    assert evict([Suspect("n4", "alignment", gpu=1)], topology) == ["n3", "n4", "n5"]
    assert evict([Suspect("n4", "alignment")], None) == ["n4"]
