"""Parsing ``scontrol show node -o`` (captured from Slurm 22.05.8, Debian 12, on the test
cluster of tests/slurm_cluster.py) and the reason/node-name sanitising the slurm adapter uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.proc import ProcResult
from node_agent.schedulers import AdapterError, check_node_name, sanitise_reason
from node_agent.schedulers.base import MAX_REASON_LEN, REASON_PREFIX
from node_agent.schedulers.slurm import SlurmAdapter, parse_show_node

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"


def test_show_node_parses_every_node_with_state_and_reason() -> None:
    nodes = {n.name: n for n in parse_show_node((DATA / "show_node_22.05.txt").read_text())}
    assert set(nodes) == {"na-node1", "na-fake1", "na-fake2", "na-fake3"}
    agent = nodes["na-node1"]
    assert agent.state == "IDLE+DRAIN" and agent.drained and agent.drained_by_agent
    # "=" inside the reason and Slurm's "[user@time]" suffix removed
    assert agent.reason == "node-agent: FAULT xid79 gpu:5 msg=GPU has fallen off the bus"
    by_hand = nodes["na-fake1"]
    assert by_hand.drained and not by_hand.drained_by_agent
    assert by_hand.reason == "bad DIMM, ticket 4711"
    failed = nodes["na-fake2"]
    assert failed.state == "UNKNOWN+FAIL" and failed.drained and failed.drained_by_agent
    assert (failed.reason or "").startswith("node-agent: replace:")
    idle = nodes["na-fake3"]
    assert not idle.drained and idle.reason is None


def test_show_node_of_one_node_without_reason() -> None:
    [node] = parse_show_node((DATA / "show_node_one_idle_22.05.txt").read_text())
    assert node.name == "na-fake3" and node.state == "UNKNOWN" and node.reason is None


@pytest.mark.parametrize(
    "state, drained",
    [
        ("IDLE", False),
        ("MIXED", False),
        ("ALLOCATED", False),
        ("DOWN*", False),
        ("IDLE+DRAIN", True),
        ("MIXED+DRAIN", True),
        ("ALLOCATED+DRAIN", True),
        ("DOWN*+DRAIN", True),
        ("IDLE+FAIL", True),
        ("IDLE+DRAIN+REBOOT_REQUESTED", True),
        ("IDLE+NOT_RESPONDING", False),
        ("DOWN+REBOOT_ISSUED", False),
    ],
)
def test_drain_and_fail_flags_mean_drained(state: str, drained: bool) -> None:
    [node] = parse_show_node(f"NodeName=n1 Arch=x86_64 State={state} Partitions=gpu")
    assert node.drained is drained


def test_a_node_line_without_its_state_is_an_error_never_in_service() -> None:
    """A cut or foreign answer: read as in service, it would let a resume be "already" and
    the blast radius count the node as not drained."""
    with pytest.raises(AdapterError, match="without State="):
        parse_show_node("NodeName=gpu-01 Arch=x86_64 CoresPerSocket=32\n")


def test_lines_that_are_not_node_records_are_ignored() -> None:
    assert parse_show_node("Node n1 not found\n\n") == []


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("FAULT xid79 gpu:5", "node-agent: FAULT xid79 gpu:5"),
        ("node-agent: FAULT xid79 gpu:5", "node-agent: FAULT xid79 gpu:5"),
        ('a "quoted" $(x) `y`; z | w', "node-agent: a _quoted_ _(x) _y__ z _ w"),
        ("line1\nline2\r\n\tline3", "node-agent: line1 line2 line3"),
        ("nul\x00esc\x1b é", "node-agent: nul?esc? ?"),
    ],
)
def test_reason_is_printable_ascii_without_quotes_or_newlines(raw: str, expected: str) -> None:
    assert sanitise_reason(raw) == expected


def test_reason_is_capped_and_keeps_its_prefix() -> None:
    text = sanitise_reason("x" * 5000)
    assert len(text) == MAX_REASON_LEN
    assert text.startswith(REASON_PREFIX) and text.endswith("...")


@pytest.mark.parametrize("name", ["gpu-01", "node1.cluster", "a_b", "N0"])
def test_valid_node_names_pass(name: str) -> None:
    assert check_node_name(name) == name


@pytest.mark.parametrize("name", ["", "-h", "a b", "a;b", "../x", "n1\n", "x" * 64, ".hidden"])
def test_unsafe_node_names_are_refused(name: str) -> None:
    with pytest.raises(AdapterError, match="node name"):
        check_node_name(name)


def test_scontrol_argv_is_a_list_with_one_reason_argument() -> None:
    """Injected runner (pure test of the argv the adapter builds; the real scontrol runs in
    tests/integration/test_slurm_adapter.py)."""
    calls: list[tuple[tuple[str, ...], float]] = []

    def runner(argv: list[str], timeout_s: float, env: object = None) -> ProcResult:
        calls.append((tuple(argv), timeout_s))
        out = "NodeName=n1 State=IDLE Partitions=gpu\n" if argv[1] == "show" else ""
        return ProcResult(tuple(argv), 0, out, "", 0.01)

    adapter = SlurmAdapter(scontrol="/usr/bin/scontrol", timeout_s=7, runner=runner)
    adapter.drain("n1", 'FAULT "xid79"\nState=RESUME')
    update = calls[-1][0]
    assert update == (
        "/usr/bin/scontrol",
        "update",
        "NodeName=n1",
        "State=DRAIN",
        "Reason=node-agent: FAULT _xid79_ State=RESUME",
    )
    assert all(timeout == 7 for _, timeout in calls)
