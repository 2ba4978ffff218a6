"""`node-agent fleet` grades an NVLink domain (a GB200 NVL72 rack of 18 trays) as one unit.

The trays' reports are synthetic (tests/synthetic_reports.py: the real model objects, with the
``inventory.nvlink_domain`` and per-GPU ``fabric`` the fabric check writes); no GPU runs here.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from synthetic_reports import RACK_UUID, rack_reports, synthetic_report, tray_report

from node_agent.commands import fleet as fleet_command
from node_agent.commands.main import main
from node_agent.fleet.analysis import analyse, load_fleet_rules
from node_agent.fleet.domains import DEFAULT_BAD_SHARE, tray_facts
from node_agent.fleet.topology import load_topology
from node_agent.stopcheck.localise import Suspect, evict
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
GRADERS = REPO / "graders"
RULES = load_fleet_rules(GRADERS)
DOMAIN = f"nvlink:{RACK_UUID}/2"


def write(directory: Path, reports: dict[str, dict[str, Any]]) -> Path:
    for name, data in reports.items():
        (directory / f"report-{name}.json").write_text(json.dumps(data, indent=2))
    return directory


def fleet_json(directory: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    out = io.StringIO()
    code = fleet_command.run([str(directory)], GRADERS, as_json=True, out=out, err=io.StringIO())
    text = io.StringIO()
    fleet_command.run([str(directory)], GRADERS, out=text, err=io.StringIO())
    return code, json.loads(out.getvalue()), text.getvalue()


def test_healthy_rack_of_18_trays_is_one_domain_not_escalated(tmp_path):
    code, data, text = fleet_json(write(tmp_path, rack_reports(0)))
    (domain,) = data["nvlink_domains"]
    assert domain["name"] == DOMAIN and domain["trays"] == 18
    assert domain["bad_trays"] == [] and domain["escalated"] is False
    assert domain["level"] == "HEALTHY" and domain["action"] == "per-tray"
    assert code == fleet_command.EXIT_NO_SUSPECTS
    assert f"{DOMAIN} (18 trays, HEALTHY): all 18 trays healthy or WARN" in text


def test_two_bad_trays_of_18_are_named_with_their_gpus_but_do_not_escalate_the_rack(tmp_path):
    code, data, text = fleet_json(write(tmp_path, rack_reports(2)))
    (domain,) = data["nvlink_domains"]
    assert domain["bad_trays"] == ["tray01", "tray02"]
    assert domain["escalated"] is False and domain["action"] == "per-tray"
    assert domain["bad_tray_share"] == pytest.approx(2 / 18, abs=1e-4)
    grades = {t["node"]: t for t in domain["tray_grades"]}
    assert grades["tray01"]["level"] == "FAULT"
    assert grades["tray01"]["bad_gpus"] == [{"gpu": 0, "level": "FAULT", "why": "xid"}]
    assert grades["tray02"]["level"] == "ERROR"
    assert [g["gpu"] for g in grades["tray02"]["bad_gpus"]] == [3]
    assert grades["tray03"]["bad"] is False and grades["tray03"]["bad_gpus"] == []
    assert code == fleet_command.EXIT_NO_SUSPECTS, "each bad tray acts on its own grade"
    assert "2 of 18 trays ERROR or FAULT (11%, under 25%)" in text
    assert "tray01: FAULT; gpu 0 FAULT (xid)" in text


def test_nine_bad_trays_of_18_escalate_the_rack_and_drain_its_trays_together(tmp_path):
    code, data, text = fleet_json(write(tmp_path, rack_reports(9)))
    (domain,) = data["nvlink_domains"]
    assert len(domain["bad_trays"]) == 9 and domain["escalated"] is True
    assert domain["action"] == "drain-domain" and domain["level"] == "FAULT"
    assert domain["nodes"] == [f"tray{i:02d}" for i in range(1, 19)]
    assert code == fleet_command.EXIT_SUSPECTS
    assert "escalate the rack: 9 of 18 trays ERROR or FAULT (50%" in text
    assert "drain the domain's 18 trays together" in text


@pytest.mark.parametrize(("bad", "escalated"), [(4, False), (5, True)])
def test_the_default_share_escalates_at_five_of_18_trays(tmp_path, bad, escalated):
    assert DEFAULT_BAD_SHARE == 0.25
    (domain,) = analyse([write(tmp_path, rack_reports(bad))], RULES).domains
    assert domain.escalated is escalated


def test_a_slow_tray_flags_its_nvlink_domain_as_a_whole(tmp_path):
    reports = rack_reports(0)
    reports["tray05"] = tray_report("tray05", seed=4, gpu_factors={2: 0.85})
    analysis = analyse([write(tmp_path, reports)], RULES)
    assert {s.node for s in analysis.suspects} == {"tray05"}
    (group,) = analysis.flagged_groups()
    assert group["group"] == DOMAIN and group["suspect_nodes"] == ["tray05"]
    assert len(group["nodes"]) == 18


def test_the_share_is_a_flag_two_bad_trays_escalate_at_a_tenth(tmp_path):
    write(tmp_path, rack_reports(2))
    out = io.StringIO()
    code = fleet_command.run(
        [str(tmp_path)], GRADERS, as_json=True, domain_bad_share=0.1, out=out, err=io.StringIO()
    )
    (domain,) = json.loads(out.getvalue())["nvlink_domains"]
    assert domain["escalated"] is True and domain["threshold"] == 0.1
    assert code == fleet_command.EXIT_SUSPECTS


@pytest.mark.parametrize("share", [0.0, -0.25, 1.5])
def test_a_share_outside_0_to_1_is_a_clear_error(tmp_path, share):
    write(tmp_path, rack_reports(0, trays=2))
    with pytest.raises(ConfigError, match=r"--domain-bad-share must be in \(0, 1\]"):
        fleet_command.run([str(tmp_path)], GRADERS, domain_bad_share=share, out=io.StringIO())


def test_nodes_without_a_domain_are_left_out_of_every_domain(tmp_path):
    reports = rack_reports(0, trays=4)
    reports["h100-a"] = synthetic_report("h100-a", seed=90).to_dict()  # a report before the field
    reports["pcie-b"] = tray_report("pcie-b", cluster_uuid=None, faults={0: "xid64"})
    analysis = analyse([write(tmp_path, reports)], RULES)
    (domain,) = analysis.domains
    assert [t.node for t in domain.trays] == ["tray01", "tray02", "tray03", "tray04"]
    assert len(analysis.nodes) == 6


def test_each_clique_of_a_cluster_is_its_own_domain(tmp_path):
    reports = rack_reports(0, trays=3, clique_id=2)
    reports |= {f"b{k}": v for k, v in rack_reports(3, trays=3, clique_id=7).items()}
    for name, data in reports.items():
        data["host"]["hostname"] = name  # type: ignore[index]
    domains = analyse([write(tmp_path, reports)], RULES).domains
    assert [(d.clique_id, len(d.trays), d.escalated) for d in domains] == [
        (7, 3, True),
        (2, 3, False),
    ], "escalated first"


def test_a_gpu_in_another_clique_is_a_bad_gpu_of_its_tray():
    data = tray_report("tray05", fabric={1: {"clique_id": 3}, 2: {"state": "in_progress"}})
    facts = tray_facts(data)
    assert facts is not None and (facts.cluster_uuid, facts.clique_id) == (RACK_UUID, 2)
    assert [(g.index, g.level) for g in facts.bad_gpus] == [(1, "ERROR"), (2, "ERROR")]
    assert "clique 3" in facts.bad_gpus[0].why and "in_progress" in facts.bad_gpus[1].why


@pytest.mark.parametrize(
    "domain",
    [None, {}, {"cluster_uuid": "", "clique_id": 2}, {"cluster_uuid": "c", "clique_id": "2"}],
)
def test_a_report_without_a_usable_domain_is_not_in_one(domain):
    data = tray_report("t")
    data["inventory"]["nvlink_domain"] = domain  # type: ignore[index]
    assert tray_facts(data) is None


def test_main_takes_the_share_from_the_command_line(tmp_path, capsys):
    """The flag reaches the command through the real parser (commands/main.py)."""
    write(tmp_path, rack_reports(2))
    assert "--domain-bad-share" in _fleet_help(capsys)
    assert main(["fleet", str(tmp_path), "--json", "--domain-bad-share", "0.1"]) == 3
    assert json.loads(capsys.readouterr().out)["nvlink_domains"][0]["escalated"] is True


def _fleet_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main(["fleet", "--help"])
    return capsys.readouterr().out


# -- the domains as parallel groups: stop-check --topology and fleet --topology -------------------


def test_topology_file_lists_nvlink_domains_as_groups(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(
        "dp-0: [a, b]\n"
        "nvlink_domains:\n"
        f"  - {{cluster_uuid: {RACK_UUID}, clique_id: 2, nodes: [tray01, tray02, tray03]}}\n"
    )
    assert load_topology(path) == {"dp-0": ["a", "b"], DOMAIN: ["tray01", "tray02", "tray03"]}


def test_an_eviction_widens_to_the_whole_nvlink_domain(tmp_path):
    (tmp_path / "r").mkdir()
    write(tmp_path / "r", rack_reports(0))
    out = io.StringIO()
    fleet_command.run([str(tmp_path / "r")], GRADERS, as_json=True, out=out, err=io.StringIO())
    (tmp_path / "fleet.json").write_text(out.getvalue())
    topology = load_topology(tmp_path / "fleet.json")
    assert list(topology) == [DOMAIN]
    evicted = evict([Suspect("tray07", "alignment", gpu=2)], topology)
    assert evicted == [f"tray{i:02d}" for i in range(1, 19)]
    assert evict([Suspect("elsewhere", "neighbours")], topology) == ["elsewhere"]


def test_stop_check_reads_topology_files_with_the_domains():
    """commands/stop_check.py loads --topology through node_agent.fleet.analysis."""
    from node_agent.fleet import analysis, topology

    assert analysis.load_topology is topology.load_topology


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("nvlink_domains:\n  - {cluster_uuid: c, clique_id: 2}\n", "nodes"),
        ("nvlink_domains:\n  - {cluster_uuid: c, clique_id: two, nodes: [a]}\n", "integer"),
        ("nvlink_domains:\n  - {cluster_uuid: c, clique_id: 2, nodes: []}\n", "nodes"),
        (
            "nvlink_domains:\n  - {cluster_uuid: c, clique_id: 2, nodes: [a]}\n"
            "  - {cluster_uuid: c, clique_id: 2, nodes: [b]}\n",
            "nvlink:c/2 is listed twice",
        ),
        ('{"schema": "node-agent.fleet/1", "nvlink_domains": []}', "names no NVLink domain"),
    ],
)
def test_a_bad_domain_in_a_topology_file_is_a_clear_error(tmp_path, text, error):
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_topology(path)


def test_html_shows_the_rack_as_a_grid_of_its_trays_coloured_by_grade(tmp_path):
    pytest.importorskip("matplotlib", reason="the fleet page draws with matplotlib (report extra)")
    reports = rack_reports(9)
    reports["tray18"]["host"]["hostname"] = "<img src=x onerror=alert(1)>"  # type: ignore[index]
    write(tmp_path, reports)
    page = tmp_path / "fleet.html"
    fleet_command.run(
        [str(tmp_path)], GRADERS, html=str(page), out=io.StringIO(), err=io.StringIO()
    )
    html = page.read_text()
    assert f'data-domain="{DOMAIN}" data-escalated="true"' in html
    assert html.count('<div class="tray level-FAULT"') == 5
    assert html.count('<div class="tray level-ERROR"') == 4
    assert html.count('<div class="tray level-HEALTHY"') == 9
    assert "gpu 0 FAULT: xid" in html and "9 of 18 trays ERROR or FAULT" in html
    assert "<img src=x" not in html and "&lt;img src=x" in html
