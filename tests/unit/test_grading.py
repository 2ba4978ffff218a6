"""Grading rules as shipped in graders/: each finding gets the level the catalog documents."""

from __future__ import annotations

import shutil

import pytest

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.model import Action, Level, Result, Status
from node_agent.yamlfile import ConfigError


@pytest.fixture(scope="module")
def grader():
    return load_grader(resources.graders_dir(config_from_dict({})))


def res(metric, status="fail", check="nvml_health", target="gpu:0", value=None, detail="d"):
    return Result(check=check, target=target, metric=metric, status=Status(status),
                  detail=detail, value=value)


@pytest.mark.parametrize("code, level", [
    (79, Level.FAULT), (48, Level.FAULT), (64, Level.FAULT),
    (63, Level.ERROR), (94, Level.ERROR), (95, Level.ERROR), (119, Level.ERROR),
    (13, Level.WARN), (31, Level.WARN), (43, Level.WARN),
])
def test_xid_catalog_levels(grader, code, level):
    grade = grader.grade([res("xid", check="xid", value=code, detail=f"Xid {code}")])
    assert grade.level is level
    assert grade.reasons[0].rule == "xid"


def test_unknown_xid_is_not_ignored(grader):
    grade = grader.grade([res("xid", check="xid", value=9999)])
    assert grade.level is Level.ERROR
    assert "not in the XID catalog" in grade.reasons[0].message


@pytest.mark.parametrize("metric, level, action", [
    ("ecc_dbe_volatile", Level.FAULT, Action.REPLACE),
    ("row_remap_failure", Level.FAULT, Action.REPLACE),
    ("row_remap_pending", Level.ERROR, Action.RESTART),
    ("pcie_width", Level.FAULT, Action.REPLACE),
    ("recovery_action", Level.ERROR, Action.RESTART),
])
def test_hardware_findings_map_to_level_and_action(grader, metric, level, action):
    grade = grader.grade([res(metric)])
    assert (grade.level, grade.action) == (level, action)


def test_warn_never_asks_for_an_action(grader):
    grade = grader.grade([res("temperature", status="warn")])
    assert grade.level is Level.WARN and grade.action is Action.NONE


def test_a_check_that_could_not_run_blocks_delivery_but_only_warns_in_service(grader):
    broken = [res("ran", status="error", check="storage", target="node")]
    assert grader.grade(broken, "delivery").level is Level.ERROR
    assert grader.grade(broken, "service").level is Level.WARN


def test_a_hang_is_an_error_in_service_too(grader):
    assert grader.grade([res("timeout", status="error", target="node")], "service").level is Level.ERROR


def test_unclassified_failure_is_error_not_ignored(grader):
    grade = grader.grade([res("something_new")])
    assert grade.level is Level.ERROR and grade.reasons[0].rule == "unclassified-fail"


def test_passes_and_skips_never_make_reasons(grader):
    grade = grader.grade([res("temperature", status="pass"), res("ran", status="skip")])
    assert grade.level is Level.HEALTHY and grade.reasons == ()


def test_worst_reason_decides_and_all_are_kept(grader):
    grade = grader.grade([res("temperature", status="warn", target="gpu:0"),
                          res("row_remap_pending", target="gpu:2"),
                          res("xid", check="xid", value=79, target="gpu:5")])
    assert grade.level is Level.FAULT
    assert [(r.level, r.target) for r in grade.reasons] == [
        (Level.FAULT, "gpu:5"), (Level.ERROR, "gpu:2"), (Level.WARN, "gpu:0")]


def test_operator_can_override_a_level_in_a_copied_graders_dir(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    xid = tmp_path / "graders" / "xid.yaml"
    xid.write_text(xid.read_text().replace('name: "Graphics Engine Exception"\n    level: WARN',
                                           'name: "Graphics Engine Exception"\n    level: ERROR'))
    grader = load_grader(tmp_path / "graders")
    assert grader.grade([res("xid", check="xid", value=13)]).level is Level.ERROR


def test_a_broken_rules_file_is_a_config_error_naming_it(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    (tmp_path / "graders" / "rules.yaml").write_text("rules:\n  - {id: x, level: SEVERE}\nfallback: {}\n")
    with pytest.raises(ConfigError, match="rules.yaml"):
        load_grader(tmp_path / "graders")
