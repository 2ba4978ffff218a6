"""`node-agent fleet` on reports that `node-agent check --simulate` wrote for GB200 NVL72 trays.

Each scenario is one simulated tray (no GPU runs here: the stand-in answers NVML's fabric calls
as the scenario says); its report is copied under 18 tray names to make a rack, as trays of one
rack report the same domain. The domain's grade then comes from real reports end to end: the
fabric check's findings, the grade, the inventory's ``nvlink_domain`` and ``fabric``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from node_agent.commands import fleet as fleet_command

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"
GRADERS = REPO / "graders"
TRAYS = {
    "healthy": "healthy-gb200-186gb.yaml",
    "degraded": "gb200-fabric-degraded.yaml",  # WARN: a GPU at degraded bandwidth
    "unhealthy": "gb200-fabric-unhealthy.yaml",  # ERROR: GPU 1 unhealthy, GPU 3 incomplete
    "wrong_clique": "gb200-wrong-clique.yaml",  # ERROR: GPU 0 in clique 5
    "gb300": "healthy-gb300-288gb.yaml",  # another rack's domain
}


@pytest.fixture(scope="module")
def trays(module_agent: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each scenario's report, from ``node-agent check --simulate`` (the quick suite)."""
    out = str(tmp_path_factory.mktemp("reports"))
    reports = {}
    for kind, name in TRAYS.items():
        run = module_agent("check", "--simulate", str(SCENARIOS / name), "--json", "--out", out)
        assert run.code in (0, 1, 2, 3), run.stderr
        reports[kind] = run.json()
    domain = (reports["healthy"].get("inventory") or {}).get("nvlink_domain")
    assert domain is not None, "a GB200 tray's report names its NVLink domain (inventory)"
    return reports


def rack(trays: dict[str, dict[str, Any]], kinds: list[str], directory: Path) -> Path:
    for i, kind in enumerate(kinds):
        data = json.loads(json.dumps(trays[kind]))
        data["host"]["hostname"] = f"tray{i + 1:02d}"
        (directory / f"report-tray{i + 1:02d}.json").write_text(json.dumps(data, indent=2))
    return directory


def fleet(directory: Path) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    code = fleet_command.run([str(directory)], GRADERS, as_json=True, out=out, err=io.StringIO())
    return code, json.loads(out.getvalue())


def test_simulated_rack_with_two_bad_trays_names_them_and_their_gpus(trays, tmp_path):
    kinds = ["healthy"] * 15 + ["degraded", "unhealthy", "wrong_clique", "gb300"]
    code, data = fleet(rack(trays, kinds, tmp_path))
    gb200, gb300 = data["nvlink_domains"]
    assert gb200["trays"] == 18 and gb200["clique_id"] == 2
    assert gb200["bad_trays"] == ["tray17", "tray18"] and gb200["escalated"] is False
    grades = {t["node"]: t for t in gb200["tray_grades"]}
    assert grades["tray16"]["level"] == "WARN" and grades["tray16"]["bad"] is False
    assert [g["gpu"] for g in grades["tray17"]["bad_gpus"]] == [1, 3]
    assert [g["gpu"] for g in grades["tray18"]["bad_gpus"]] == [0]
    assert (gb300["trays"], gb300["clique_id"], gb300["escalated"]) == (1, 7, False)
    assert code == fleet_command.EXIT_NO_SUSPECTS


def test_simulated_rack_with_nine_bad_trays_is_escalated(trays, tmp_path):
    kinds = ["healthy"] * 9 + ["unhealthy", "wrong_clique"] * 4 + ["unhealthy"]
    code, data = fleet(rack(trays, kinds, tmp_path))
    (domain,) = data["nvlink_domains"]
    assert len(domain["bad_trays"]) == 9 and domain["escalated"] is True
    assert domain["action"] == "drain-domain"
    assert code == fleet_command.EXIT_SUSPECTS


def test_simulated_healthy_rack_is_not_escalated(trays, tmp_path):
    code, data = fleet(rack(trays, ["healthy"] * 18, tmp_path))
    (domain,) = data["nvlink_domains"]
    assert domain["bad_trays"] == [] and domain["level"] == "HEALTHY"
    assert code == fleet_command.EXIT_NO_SUSPECTS
