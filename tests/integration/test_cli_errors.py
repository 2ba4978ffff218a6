"""Bad input gets exit 2 and one clear line on stderr naming file, key and expectation."""

from __future__ import annotations

import pytest


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {stderr!r}"
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    "text, must_name",
    [
        ("adapter: {name: slurm\n", "not valid YAML"),
        ("adapter: {nmae: slurm}\n", "adapter.nmae"),
        ("safety: {max_restarts: two}\n", "safety.max_restarts"),
        ("adapter: {name: pagerduty}\n", "adapter.name"),
        ("node: {sku: no-such-sku}\n", "node.sku"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_key(
    agent, tmp_path, scenario, text, must_name
):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    run = agent(
        "accept", "--config", str(config), "--simulate", scenario(), "--out", str(tmp_path / "out")
    )
    assert run.code == 2
    line = one_line(run.stderr)
    assert str(config) in line and must_name in line
    assert not (tmp_path / "out").exists(), "nothing ran"


def test_missing_config_file_exits_2(agent, tmp_path):
    run = agent("check", "--config", str(tmp_path / "nope.yaml"))
    assert run.code == 2
    assert "not found" in one_line(run.stderr)


def test_missing_scenario_file_exits_2(agent, tmp_path):
    run = agent("accept", "--simulate", str(tmp_path / "absent.yaml"))
    assert run.code == 2
    assert "scenario file not found" in one_line(run.stderr)


@pytest.mark.parametrize(
    "faults, must_name",
    [
        ([{"kind": "meteor", "gpu": 1}], "faults.0.kind"),
        ([{"kind": "xid", "gpu": 1}], "code"),
        ([{"kind": "xid", "gpu": 9, "code": 79}], "out of range"),
        ([{"kind": "pcie_width", "gpu": 1, "lanes": "eight"}], "lanes"),
    ],
)
def test_bad_scenario_exits_2_naming_the_fault(agent, scenario, faults, must_name):
    run = agent("accept", "--simulate", scenario(faults))
    assert run.code == 2
    assert must_name in one_line(run.stderr)


def test_unknown_suite_exits_2_listing_known_suites(agent):
    run = agent("accept", "--suite", "nightly")
    assert run.code == 2
    line = one_line(run.stderr)
    assert "delivery" in line and "quick" in line


def test_only_with_a_check_not_in_the_suite_exits_2(agent, scenario):
    run = agent("accept", "--only", "gpu_teleport", "--simulate", scenario())
    assert run.code == 2 and "gpu_teleport" in one_line(run.stderr)


def test_unknown_subcommand_is_a_usage_error(agent):
    assert agent("frobnicate").code == 2
