"""Every SKU file is usable as a simulated node's ``sku:``, and its healthy scenario
(``scenarios/healthy-*.yaml``) grades HEALTHY three runs in a row through the real
``node-agent accept --simulate`` with the NVML-level and light checks (inventory, nvml_health,
xid: the checks a SKU baseline changes; the load tests grade against siblings under simulation
and have their own healthy-node tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SKU_IDS = sorted(p.stem for p in (REPO / "graders" / "skus").glob("*.yaml"))


def healthy_scenarios() -> dict[str, Path]:
    """SKU id -> its healthy scenario (``scenarios/healthy-*.yaml`` without faults)."""
    found = {}
    for path in sorted((REPO / "scenarios").glob("healthy-*.yaml")):
        data = yaml.safe_load(path.read_text())
        if not data.get("faults"):
            found.setdefault(data["sku"], path)
    return found


def test_every_sku_file_has_a_healthy_scenario():
    assert sorted(healthy_scenarios()) == SKU_IDS


@pytest.mark.parametrize("sku", SKU_IDS)
def test_healthy_scenario_of_each_sku_grades_healthy_three_runs_in_a_row(agent, sku):
    path = healthy_scenarios()[sku]
    expected_gpus = yaml.safe_load((REPO / "graders" / "skus" / f"{sku}.yaml").read_text())[
        "gpus_per_node"
    ]
    for attempt in range(3):
        run = agent(
            "accept", "--simulate", str(path), "--only", "inventory,nvml_health,xid", "--json"
        )
        assert run.code == 0, (attempt, run.stderr)
        report = run.json()
        findings = [
            (r["check"], r["target"], r["metric"], r["status"], r["detail"])
            for r in report["results"]
            if r["status"] in ("warn", "fail", "error")
        ]
        assert report["grade"] == {"level": "HEALTHY", "action": "none", "reasons": []}, findings
        assert not findings, findings
        assert report["sku"] == sku
        assert len(report["gpus"]) == expected_gpus
        assert {g["sku"] for g in report["gpus"]} == {sku}
