"""Fleet outliers: median/MAD per metric across many nodes' reports (node_agent.fleet)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from node_agent import fleet
from node_agent.fleet import analyse, analyse_figures, load_fleet_rules, load_topology
from node_agent.report import json_report
from node_agent.report.synthetic import MINIMUM_TFLOPS, synthetic_report
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
RULES = load_fleet_rules(REPO / "graders")
SLOW = {41: 3, 250: 0, 477: 7}  # node index -> the GPU at 0.88x throughput


def write_fleet(directory: Path, nodes: int, slow: dict[int, int] | None = None,
                node_factors: dict[int, dict[str, float]] | None = None) -> None:
    for i in range(nodes):
        factors = {slow[i]: 0.88} if slow and i in slow else None
        report = synthetic_report(f"node{i:04d}", seed=1000 + i, gpu_factors=factors,
                                  node_factors=(node_factors or {}).get(i))
        json_report.write(report, directory)


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fleet")
    write_fleet(directory, 500, SLOW)
    (directory / "zz-truncated.json").write_text('{"schema": "node-agent.report/1", "host": {"ho')
    (directory / "zz-old-schema.json").write_text(json.dumps({"schema": "node-agent.report/0",
                                                              "results": []}))
    return directory


@pytest.fixture(scope="module")
def analysis(fleet_dir):
    return analyse([fleet_dir], RULES)


def test_500_node_fleet_flags_exactly_the_three_gpus_at_088x(analysis):
    planted = {(f"node{i:04d}", f"gpu:{g}") for i, g in SLOW.items()}
    assert {(s.node, s.target) for s in analysis.suspects} == planted
    bf16 = {(s.node, s.target): s for s in analysis.suspects if s.metric == "tflops_bf16"}
    assert set(bf16) == planted
    for s in bf16.values():
        assert s.ratio == pytest.approx(0.88, abs=0.03)
        assert s.deviation_mads < -RULES.deviation_mads
        assert s.value > MINIMUM_TFLOPS["tflops_bf16"], "planted GPUs pass the absolute minimum"
        assert s.scope == "gpu"


def test_planted_gpus_pass_every_absolute_check_in_their_own_reports(fleet_dir):
    for i in SLOW:
        (path,) = fleet_dir.glob(f"report-node{i:04d}-*.json")
        report = json_report.read(path)
        assert report.grade.level.name == "HEALTHY"


def test_suspects_are_ranked_worst_deviation_first(analysis):
    deviations = [abs(s.deviation_mads) for s in analysis.suspects]
    assert deviations == sorted(deviations, reverse=True)


def test_corrupt_and_other_schema_files_are_listed_unreadable_and_the_rest_analysed(analysis):
    assert analysis.reports == 502
    assert len(analysis.nodes) == 500
    reasons = dict(analysis.unreadable)
    assert set(Path(p).name for p in reasons) == {"zz-truncated.json", "zz-old-schema.json"}
    truncated = next(e for p, e in reasons.items() if p.endswith("zz-truncated.json"))
    old = next(e for p, e in reasons.items() if p.endswith("zz-old-schema.json"))
    assert "truncated" in truncated
    assert "node-agent.report/0" in old


def test_uniform_fleet_flags_nothing(tmp_path):
    write_fleet(tmp_path, 200)
    result = analyse([tmp_path], RULES)
    assert result.suspects == []
    bf16 = next(g for g in result.groups if g.metric == "tflops_bf16")
    assert bf16.n == 200 * 8
    assert bf16.scale == pytest.approx(RULES.relative_floor * bf16.median), \
        "1% noise: the 2% relative floor, not the MAD, sets the scale"


def test_node_level_metric_outlier_is_flagged_per_node(tmp_path):
    write_fleet(tmp_path, 60, node_factors={7: {"busbw_peak_gbps": 0.8}})
    result = analyse([tmp_path], RULES)
    assert [(s.node, s.target, s.metric, s.scope) for s in result.suspects] == [
        ("node0007", "node", "busbw_peak_gbps", "node")]


def test_high_side_metric_flags_hot_gpu_but_not_cool_one(tmp_path):
    figures = []
    for i in range(40):
        temp = 72.0 + (i % 5) * 0.2
        if i == 3:
            temp = 90.0  # hot
        if i == 4:
            temp = 50.0  # cool: not a problem
        figures.append(fleet.NodeFigures(f"n{i}", "sku", "t", f"p{i}",
                                         [("thermal_power", "gpu:0", "temperature_max_c", "°C",
                                           temp)]))
    result = analyse_figures(figures, RULES)
    assert [(s.node, round(s.value)) for s in result.suspects] == [("n3", 90)]


def test_skus_are_compared_only_with_themselves(tmp_path):
    figures = [fleet.NodeFigures(f"a{i}", "h100", "t", "p", [("gpu_burn", "gpu:0", "tflops_bf16",
                                                               "TFLOP/s", 700.0 + i % 3)])
               for i in range(20)]
    figures += [fleet.NodeFigures(f"b{i}", "a100", "t", "p", [("gpu_burn", "gpu:0", "tflops_bf16",
                                                               "TFLOP/s", 280.0 + i % 3)])
                for i in range(20)]
    assert analyse_figures(figures, RULES).suspects == []


def test_too_few_figures_are_not_judged():
    figures = [fleet.NodeFigures(f"n{i}", "s", "t", "p", [("gpu_burn", "gpu:0", "tflops_bf16",
                                                           "TFLOP/s", v)])
               for i, v in enumerate([700, 701, 702, 300])]
    assert analyse_figures(figures, RULES).suspects == []


def test_unlisted_units_and_ignored_metrics_are_not_compared(tmp_path):
    write_fleet(tmp_path, 10)
    result = analyse([tmp_path], RULES)
    metrics = {g.metric for g in result.groups}
    assert "temperature" not in metrics  # idle temperature: ignored in fleet.yaml
    assert "wrong_elements" not in metrics  # a counter with no unit side
    assert {"tflops_bf16", "copy_gbps", "h2d_gbps", "busbw_peak_gbps", "write_bw_mbps",
            "randread_iops", "write_bw_gbps"} <= metrics


def test_pure_python_statistics_match_numpy(analysis, fleet_dir, monkeypatch):
    monkeypatch.setattr(fleet, "_np", None)
    plain = analyse([fleet_dir], RULES, workers=1)
    assert [(s.node, s.target, s.metric) for s in plain.suspects] == \
        [(s.node, s.target, s.metric) for s in analysis.suspects]
    for a, b in zip(plain.groups, analysis.groups, strict=True):
        assert a.median == pytest.approx(b.median) and a.mad == pytest.approx(b.mad)


def test_process_pool_and_single_process_read_the_same(fleet_dir, analysis):
    single = analyse([fleet_dir], RULES, workers=1)
    assert single.to_dict() == analysis.to_dict()


def test_evidence_cut_keeps_every_figure_of_a_report(tmp_path):
    report = synthetic_report("n1", seed=5, trace_points=30)
    path = json_report.write(report, tmp_path)
    text = path.read_text()
    cut = json.loads(fleet._without_evidence(text))
    full = json.loads(text)
    assert len(fleet._without_evidence(text)) < len(text)
    assert [{**r, "evidence": {}} for r in full["results"]] == cut["results"]


def test_a_newer_report_of_the_same_host_supersedes_the_older(tmp_path):
    old = synthetic_report("nodeX", seed=1, gpu_factors={0: 0.5})
    new = synthetic_report("nodeX", seed=1)
    new.started_at, new.finished_at = "2026-11-22T10:00:00Z", "2026-11-22T10:09:00Z"
    json_report.write(old, tmp_path)
    newest = json_report.write(new, tmp_path)
    write_fleet(tmp_path, 30)
    result = analyse([tmp_path], RULES)
    assert len(result.superseded) == 1 and "nodeX" in result.superseded[0]
    assert not [s for s in result.suspects if s.node == "nodeX"]
    assert any(n.path == str(newest) for n in result.nodes)


def test_topology_flags_the_whole_group_holding_a_suspect(analysis, tmp_path):
    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"pp-stage-0": ["node0040", "node0041", "node0042"],
                                    "pp-stage-1": ["node0100", "node0101"]}))
    analysis.topology = load_topology(topo)
    try:
        assert analysis.flagged_groups() == [{"group": "pp-stage-0",
                                              "nodes": ["node0040", "node0041", "node0042"],
                                              "suspect_nodes": ["node0041"]}]
    finally:
        analysis.topology = None


def test_invalid_topology_file_is_a_configuration_error(tmp_path):
    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"g": "node1"}))
    with pytest.raises(ConfigError, match="topology.yaml.*expected array"):
        load_topology(topo)


def test_invalid_fleet_rules_name_the_file_and_key(tmp_path):
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(
        {"thresholds": {"deviation_mads": 3.5, "relative_floor": 0.02, "min_samples": 8},
         "units": {"GB/s": "lower"}}))
    with pytest.raises(ConfigError, match=r"fleet.yaml: key 'units.GB/s'"):
        load_fleet_rules(tmp_path)


def test_render_text_lists_suspects_with_median_deviation_and_ratio(analysis):
    text = fleet.render_text(analysis)
    assert "suspects: " in text and "2 unreadable" in text
    line = next(ln for ln in text.splitlines() if "tflops_bf16" in ln and "node0041" in ln)
    assert "gpu:3" in line and "MADs" in line and "720" in line and "0.87" in line
