"""Data that arrived wrong between two nodes, with neither end named by the second pairing (two
ranks, or corruption that did not recur), is a WARN on both ends: never evicted on a guess,
never a passing phase (the verification of the fifth round found it graded HEALTHY)."""

from __future__ import annotations

from node_agent import resources
from node_agent.commands.stop_check import _phase_results
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.model import Level, Status
from node_agent.stopcheck.localise import Suspect
from node_agent.stopcheck.phases import PhaseOutcome

GRADER = load_grader(resources.graders_dir(config_from_dict({})))
WRONG = {"pairs_gbps": {}, "wrong_elements": {"node0->node1": 16}}


def test_both_ends_of_wrong_data_nobody_could_place_are_warn_and_the_others_pass():
    outcome = PhaseOutcome("neighbours", suspects=[], figures=WRONG)
    for node in ("node0", "node1"):
        (result,) = _phase_results("neighbours", outcome, node)
        assert result.status is Status.WARN and "node0->node1" in result.detail
        (reason,) = GRADER.grade([result], "service").reasons
        assert (reason.rule, reason.level) == ("stop-check-neighbours-unresolved", Level.WARN)
    (other,) = _phase_results("neighbours", outcome, "node2")
    assert other.status is Status.PASS


def test_when_the_sender_is_named_its_receiver_is_not_warned():
    sender = Suspect("node0", "neighbours", evidence={"end": "sender"})
    outcome = PhaseOutcome("neighbours", suspects=[sender], figures=WRONG)
    assert [r.status for r in _phase_results("neighbours", outcome, "node0")] == [Status.FAIL]
    assert [r.status for r in _phase_results("neighbours", outcome, "node1")] == [Status.PASS]
