"""The daemon's check child: a check spec in as JSON, the model's results out, exit status only
"ran" or "crashed" (node_agent/service/check_child.py)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from node_agent.config import config_from_dict
from node_agent.model import Status
from node_agent.service.check_child import ChildSpec, run_in_child


@pytest.fixture
def node(tmp_path):
    scenario = tmp_path / "node.yaml"
    scenario.write_text(
        yaml.safe_dump(
            {
                "sku": "h100-sxm5-80gb",
                "gpus": 4,
                "faults": [{"kind": "row_remap_pending", "gpu": 2}],
            }
        )
    )
    config = config_from_dict({"state_dir": str(tmp_path / "state")})
    return ChildSpec(
        check="nvml_health",
        timeout_s=60,
        config=config.data,
        reopen_args=("--simulate", str(scenario)),
    )


def test_child_runs_the_check_and_returns_its_results_as_the_models_json(node):
    results = run_in_child(node)
    assert {r.check for r in results} == {"nvml_health"}
    assert not [r for r in results if r.status is Status.ERROR and r.target == "node"]
    assert any(r.target == "gpu:2" and r.status is not Status.PASS for r in results), [
        (r.target, r.metric, r.status) for r in results
    ]


def test_a_child_that_cannot_run_the_spec_is_one_error_result_naming_why(node):
    bad = ChildSpec(**{**vars(node), "config": {"daemon": {"listen": ["not", "a", "string"]}}})
    (result,) = run_in_child(bad)
    assert result.status is Status.ERROR and result.metric == "ran"
    assert "in a child process failed" in result.detail and "exited 2" in result.detail


def test_a_wedged_child_is_killed_after_its_timeout_and_the_caller_goes_on(node):
    """A child that does not answer in time (a driver call that never returns) is killed; the
    caller gets an error result instead of waiting."""
    wedged = ChildSpec(**{**vars(node), "timeout_s": 0.05})
    start = time.monotonic()
    (result,) = run_in_child(wedged, grace_s=0.0)
    assert time.monotonic() - start < 30
    assert result.status is Status.ERROR and "did not finish" in result.detail


@pytest.mark.parametrize(
    "spec, why",
    [
        ({"timeout_s": 5}, "no 'check'"),
        ({"check": "xid", "timeout_s": "soon"}, "'timeout_s' must be a number"),
        ({"check": "xid", "timeout_s": 5, "mode": "later"}, "'mode' must be"),
        ({"check": "xid", "timeout_s": 5, "reopen_args": ["--simulate", "rel.yaml"]}, "absolute"),
        ([], "JSON object"),
    ],
)
def test_a_bad_spec_is_refused_with_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match=why):
        ChildSpec.from_json(json.dumps(spec))


def test_a_spec_survives_its_json_round_trip(node):
    assert ChildSpec.from_json(node.to_json()) == node
