"""`grade --rules`, `fleet` and `--junit` through the real `node-agent` command."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml
from synthetic_reports import synthetic_report  # tests/synthetic_reports.py

from node_agent.report import json_report

REPO = Path(__file__).resolve().parents[2]


def saved_report(agent, scenario, tmp_path, faults, name="reports"):
    out = tmp_path / name
    run = agent(
        "accept",
        "--simulate",
        scenario(faults),
        "--only",
        "inventory,nvml_health,xid",
        "--out",
        str(out),
        "--json",
    )
    (path,) = out.glob("report-*.json")
    return run, path


def rules_with_xid13_as_error(tmp_path):
    rules = tmp_path / "graders-try"
    shutil.copytree(REPO / "graders", rules)
    xid = yaml.safe_load((rules / "xid.yaml").read_text())
    xid["codes"][13]["level"] = "ERROR"
    (rules / "xid.yaml").write_text(yaml.safe_dump(xid))
    return rules


def test_grade_rules_shows_the_grade_a_threshold_change_would_give(agent, scenario, tmp_path):
    run, path = saved_report(agent, scenario, tmp_path, [{"kind": "xid", "gpu": 0, "code": 13}])
    assert run.json()["grade"]["level"] == "WARN"
    rules = rules_with_xid13_as_error(tmp_path)
    regrade = agent("grade", "--rules", str(rules), str(path))
    assert regrade.code == 3, regrade.stderr
    assert "1 changed" in regrade.stdout
    assert "WARN -> ERROR" in regrade.stdout and "+ ERROR   gpu:0" in regrade.stdout
    assert "- WARN    gpu:0" in regrade.stdout
    assert json_report.read(path).grade.level.name == "WARN", "the saved report is not modified"


def test_grade_rules_writes_the_page_of_the_grade_the_new_rules_give(agent, scenario, tmp_path):
    _, path = saved_report(agent, scenario, tmp_path, [{"kind": "xid", "gpu": 0, "code": 13}])
    rules = rules_with_xid13_as_error(tmp_path)
    junit = tmp_path / "j.xml"
    run = agent("grade", "--rules", str(rules), str(path), "--junit", str(junit))
    assert run.code == 3, run.stderr
    assert f"the saved grade was WARN; with the rules in {rules} it is ERROR" in run.stderr
    assert ET.parse(junit).getroot().get("failures") == "1"
    several = agent("grade", str(path), str(path), "--junit", str(junit))
    assert several.code == 2 and "name a single report" in several.stderr


def test_grade_rules_over_a_directory_lists_only_changed_grades_and_unreadable_files(
    agent, scenario, tmp_path
):
    saved_report(agent, scenario, tmp_path, [{"kind": "xid", "gpu": 0, "code": 13}], "week")
    json_report.write(synthetic_report("healthy-node", seed=3), tmp_path / "week")
    (tmp_path / "week" / "broken.json").write_text("{")
    rules = rules_with_xid13_as_error(tmp_path)
    run = agent("grade", "--rules", str(rules), str(tmp_path / "week"), "--json")
    assert run.code == 3, run.stderr
    data = run.json()
    changed = [r for r in data["reports"] if r["changed"]]
    assert len(data["reports"]) == 2 and len(changed) == 1
    assert changed[0]["saved"]["level"] == "WARN" and changed[0]["regraded"]["level"] == "ERROR"
    assert [u["path"].endswith("broken.json") for u in data["unreadable"]] == [True]


def test_grade_rules_with_unchanged_rules_reports_no_change(agent, scenario, tmp_path):
    _, path = saved_report(agent, scenario, tmp_path, [{"kind": "xid", "gpu": 5, "code": 64}])
    run = agent("grade", "--rules", str(REPO / "graders"), str(path))
    assert run.code == 4 and "0 changed" in run.stdout


def test_grade_rules_naming_a_missing_directory_is_a_usage_error(agent, tmp_path):
    path = json_report.write(synthetic_report("n"), tmp_path)
    run = agent("grade", "--rules", str(tmp_path / "nope"), str(path))
    assert run.code == 2 and "rules.yaml" in run.stderr


def test_grade_writes_html_and_junit_of_a_saved_report(agent, tmp_path):
    path = json_report.write(synthetic_report("n", faults={1: "xid64"}), tmp_path)
    run = agent(
        "grade", str(path), "--junit", str(tmp_path / "j.xml"), "--html", str(tmp_path / "r.html")
    )
    assert run.code == 4, run.stderr
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert root.get("failures") == "1"
    assert 'data-level="FAULT"' in (tmp_path / "r.html").read_text()


def test_junit_into_a_missing_directory_fails_before_anything_runs(agent, scenario, tmp_path):
    run = agent("check", "--simulate", scenario(), "--junit", str(tmp_path / "no" / "j.xml"))
    assert run.code == 2 and "does not exist" in run.stderr


def test_fleet_exits_3_with_suspects_and_0_without(agent, tmp_path):
    clean, slow = tmp_path / "clean", tmp_path / "slow"
    clean.mkdir()
    slow.mkdir()
    for i in range(30):
        json_report.write(synthetic_report(f"n{i:02d}", seed=i), clean)
        json_report.write(
            synthetic_report(f"n{i:02d}", seed=i, gpu_factors={4: 0.85} if i == 9 else None), slow
        )
    ok = agent("fleet", str(clean))
    assert ok.code == 0, ok.stderr
    assert "no suspects" in ok.stdout
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({"dp-0": ["n08", "n09"], "dp-1": ["n10", "n11"]}))
    bad = agent(
        "fleet",
        str(slow),
        "--json",
        "--topology",
        str(topo),
        "--html",
        str(tmp_path / "fleet.html"),
    )
    assert bad.code == 3, bad.stderr
    data = bad.json()
    assert {(s["node"], s["target"]) for s in data["suspects"]} == {("n09", "gpu:4")}
    assert [g["group"] for g in data["flagged_groups"]] == ["dp-0"]
    page = (tmp_path / "fleet.html").read_text()
    assert 'data-node="n09"' in page and "<svg" in page


def test_fleet_with_no_readable_report_or_missing_path_is_a_usage_error(agent, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"schema": "node-agent.report/0"}))
    run = agent("fleet", str(tmp_path / "a.json"))
    assert run.code == 2 and "node-agent.report/0" in run.stderr
    missing = agent("fleet", str(tmp_path / "nope"))
    assert missing.code == 2 and "no such report file" in missing.stderr
