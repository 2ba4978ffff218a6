"""The check-child protocol (node_agent/checking/child.py): a typed request in as JSON, naming
the node as a ``NodeSpec`` rather than a command line, the model's results out, and an exit
status that says ran (0), refused (2: the request is invalid, nothing ran) or crashed."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml

from node_agent import proc
from node_agent.checking.child import (
    CHILD_MODULE,
    HOST,
    MAX_REQUEST_BYTES,
    REFUSED,
    ChildSpec,
    NodeSpec,
    run_in_child,
)
from node_agent.config import config_from_dict
from node_agent.model import Status


@pytest.fixture
def scenario(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "sku": "h100-sxm5-80gb",
                "gpus": 4,
                "faults": [{"kind": "row_remap_pending", "gpu": 2}],
            }
        )
    )
    return path


@pytest.fixture
def node(tmp_path, scenario):
    config = config_from_dict({"state_dir": str(tmp_path / "state")})
    return ChildSpec(
        check="nvml_health",
        timeout_s=60,
        config=config.data,
        node=NodeSpec.scenario(scenario),
    )


def child(request: str | bytes) -> subprocess.CompletedProcess[bytes]:
    """The real child, handed ``request`` on stdin as its caller would."""
    return subprocess.run(
        proc.python_module_argv(CHILD_MODULE),
        input=request.encode() if isinstance(request, str) else request,
        capture_output=True,
        cwd=proc.CHILD_CWD,
        timeout=120,
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
    assert "refused the request, nothing ran" in result.detail


def test_a_wedged_child_is_killed_after_its_timeout_and_the_caller_goes_on(node):
    """A child that does not answer in time (a driver call that never returns) is killed; the
    caller gets an error result instead of waiting."""
    wedged = ChildSpec(**{**vars(node), "timeout_s": 0.05})
    start = time.monotonic()
    (result,) = run_in_child(wedged, grace_s=0.0)
    assert time.monotonic() - start < 30
    assert result.status is Status.ERROR and "did not finish" in result.detail


HOST_NODE = {"kind": "host"}


@pytest.mark.parametrize(
    "spec, why",
    [
        ({"timeout_s": 5, "node": HOST_NODE}, "no 'check'"),
        ({"check": "xid", "timeout_s": "soon", "node": HOST_NODE}, "'timeout_s' must be a number"),
        ({"check": "xid", "timeout_s": float("nan"), "node": HOST_NODE}, "'timeout_s' must be"),
        ({"check": "xid", "timeout_s": 0, "node": HOST_NODE}, "'timeout_s' must be"),
        ({"check": "xid", "timeout_s": 5, "mode": "later", "node": HOST_NODE}, "'mode' must be"),
        ({"check": "xid", "timeout_s": 5}, "names no 'node'"),
        ({"check": "xid", "timeout_s": 5, "node": "host"}, "'node' must be an object"),
        ({"check": "xid", "timeout_s": 5, "node": {"kind": "rack"}}, "'kind' must be one of"),
        ({"check": "xid", "timeout_s": 5, "node": {"kind": "scenario"}}, "absolute path"),
        (
            {"check": "xid", "timeout_s": 5, "node": {"kind": "scenario", "path": "rel.yaml"}},
            "absolute path",
        ),
        (
            {"check": "xid", "timeout_s": 5, "node": {"kind": "host", "path": "/n.yaml"}},
            "takes no 'path'",
        ),
        (
            {"check": "xid", "timeout_s": 5, "node": {"kind": "scenario", "path": "/a\u0000b"}},
            "not a usable file name",
        ),
        (
            {"check": "xid", "timeout_s": 5, "node": {"kind": "host", "shell": "rm -rf /"}},
            "unknown key.*'shell'",
        ),
        (
            {"check": "xid", "timeout_s": 5, "node": HOST_NODE, "reopen_args": ["--simulate"]},
            "unknown key.*'reopen_args'",
        ),
        ([], "JSON object"),
    ],
)
def test_a_bad_spec_is_refused_with_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match=why):
        ChildSpec.from_json(json.dumps(spec))


def test_a_spec_survives_its_json_round_trip(node):
    assert ChildSpec.from_json(node.to_json()) == node
    on_host = ChildSpec(check="xid", timeout_s=5, params={"a": [1]}, params_from_suite="periodic")
    assert on_host.node == HOST and ChildSpec.from_json(on_host.to_json()) == on_host


def test_the_node_travels_as_a_typed_spec_never_as_arguments(node, scenario):
    wire = json.loads(node.to_json())
    assert wire["node"] == {"kind": "scenario", "path": str(scenario)}
    assert "reopen_args" not in wire and "--simulate" not in node.to_json()


@pytest.mark.parametrize(
    "request_text, why",
    [
        ('{"check": "xid", "timeout_s": 5, "node": {"kind": "rack"}}', "'kind' must be one of"),
        (
            '{"check": "xid", "timeout_s": 5, "node": {"kind": "scenario", "path": "n.yaml"}}',
            "absolute path",
        ),
        ('{"check": "xid", "timeout_s": 5, "node": {"kind": "host"}, "argv": []}', "unknown key"),
        ("not json", "Expecting value"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_the_child_refuses_a_hostile_request_with_exit_2_and_runs_nothing(request_text, why):
    done = child(request_text)
    assert done.returncode == REFUSED, done.stderr.decode()
    last = done.stderr.decode().strip().splitlines()[-1]
    assert "refused the request, nothing ran" in last
    assert re.search(why, last), last
    assert done.stdout == b""


def test_the_child_refuses_an_oversized_request_unparsed():
    done = child(b" " * (MAX_REQUEST_BYTES + 1))
    assert done.returncode == REFUSED
    assert f"larger than {MAX_REQUEST_BYTES} bytes" in done.stderr.decode()


def test_the_child_refuses_a_scenario_that_does_not_exist(tmp_path):
    missing = ChildSpec(check="xid", timeout_s=5, node=NodeSpec.scenario(tmp_path / "gone.yaml"))
    done = child(missing.to_json())
    assert done.returncode == REFUSED, done.stderr.decode()
    assert "gone.yaml" in done.stderr.decode().strip().splitlines()[-1]
