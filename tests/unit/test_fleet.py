"""Fleet outliers: median/MAD per metric across many nodes' reports (node_agent.fleet.analysis)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from synthetic_reports import MINIMUM_TFLOPS, synthetic_report  # tests/synthetic_reports.py

from node_agent.commands import fleet as fleet_command
from node_agent.fleet import analysis as fleet
from node_agent.fleet import reports as fleet_reports
from node_agent.fleet.analysis import analyse, analyse_figures, load_fleet_rules, load_topology
from node_agent.fleet.text import render_text
from node_agent.model import Result, Status
from node_agent.report import json_report
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
RULES = load_fleet_rules(REPO / "graders")
SLOW = {41: 3, 250: 0, 477: 7}  # node index -> the GPU at 0.88x throughput


def write_fleet(
    directory: Path,
    nodes: int,
    slow: dict[int, int] | None = None,
    node_factors: dict[int, dict[str, float]] | None = None,
) -> None:
    for i in range(nodes):
        factors = {slow[i]: 0.88} if slow and i in slow else None
        report = synthetic_report(
            f"node{i:04d}",
            seed=1000 + i,
            gpu_factors=factors,
            node_factors=(node_factors or {}).get(i),
        )
        json_report.write(report, directory)


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fleet")
    write_fleet(directory, 500, SLOW)
    (directory / "zz-truncated.json").write_text('{"schema": "node-agent.report/1", "host": {"ho')
    (directory / "zz-old-schema.json").write_text(
        json.dumps({"schema": "node-agent.report/0", "results": []})
    )
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
    assert bf16.scale == pytest.approx(RULES.relative_floor * bf16.median), (
        "1% noise: the 2% relative floor, not the MAD, sets the scale"
    )


def test_node_level_metric_outlier_is_flagged_per_node(tmp_path):
    write_fleet(tmp_path, 60, node_factors={7: {"busbw_peak_gbps": 0.8}})
    result = analyse([tmp_path], RULES)
    assert [(s.node, s.target, s.metric, s.scope) for s in result.suspects] == [
        ("node0007", "node", "busbw_peak_gbps", "node")
    ]


def test_high_side_metric_flags_hot_gpu_but_not_cool_one(tmp_path):
    figures = []
    for i in range(40):
        temp = 72.0 + (i % 5) * 0.2
        if i == 3:
            temp = 90.0  # hot
        if i == 4:
            temp = 50.0  # cool: not a problem
        figures.append(
            fleet.NodeFigures(
                f"n{i}",
                "sku",
                "t",
                f"p{i}",
                [("thermal_power", "gpu:0", "temperature_max_c", "°C", temp)],
            )
        )
    result = analyse_figures(figures, RULES)
    assert [(s.node, round(s.value)) for s in result.suspects] == [("n3", 90)]


def test_skus_are_compared_only_with_themselves(tmp_path):
    figures = [
        fleet.NodeFigures(
            f"a{i}",
            "h100",
            "t",
            "p",
            [("gpu_burn", "gpu:0", "tflops_bf16", "TFLOP/s", 700.0 + i % 3)],
        )
        for i in range(20)
    ]
    figures += [
        fleet.NodeFigures(
            f"b{i}",
            "a100",
            "t",
            "p",
            [("gpu_burn", "gpu:0", "tflops_bf16", "TFLOP/s", 280.0 + i % 3)],
        )
        for i in range(20)
    ]
    assert analyse_figures(figures, RULES).suspects == []


def test_too_few_figures_are_not_judged():
    figures = [
        fleet.NodeFigures(
            f"n{i}", "s", "t", "p", [("gpu_burn", "gpu:0", "tflops_bf16", "TFLOP/s", v)]
        )
        for i, v in enumerate([700, 701, 702, 300])
    ]
    assert analyse_figures(figures, RULES).suspects == []


def test_unlisted_units_and_ignored_metrics_are_not_compared(tmp_path):
    write_fleet(tmp_path, 10)
    result = analyse([tmp_path], RULES)
    metrics = {g.metric for g in result.groups}
    assert "temperature" not in metrics  # idle temperature: ignored in fleet.yaml
    assert "wrong_elements" not in metrics  # a counter with no unit side
    assert {
        "tflops_bf16",
        "copy_gbps",
        "h2d_gbps",
        "busbw_peak_gbps",
        "write_bw_mbps",
        "randread_iops",
        "write_bw_gbps",
    } <= metrics


def test_pure_python_statistics_match_numpy(analysis, fleet_dir, monkeypatch):
    monkeypatch.setattr(fleet, "_np", None)
    plain = analyse([fleet_dir], RULES, workers=1)
    assert [(s.node, s.target, s.metric) for s in plain.suspects] == [
        (s.node, s.target, s.metric) for s in analysis.suspects
    ]
    for a, b in zip(plain.groups, analysis.groups, strict=True):
        assert a.median == pytest.approx(b.median) and a.mad == pytest.approx(b.mad)


def test_process_pool_and_single_process_read_the_same(fleet_dir, analysis):
    single = analyse([fleet_dir], RULES, workers=1)
    assert single.to_dict() == analysis.to_dict()


def test_evidence_cut_keeps_every_figure_of_a_report(tmp_path):
    report = synthetic_report("n1", seed=5, trace_points=30)
    path = json_report.write(report, tmp_path)
    text = path.read_text()
    cut = json.loads(fleet_reports._without_evidence(text))
    full = json.loads(text)
    assert len(fleet_reports._without_evidence(text)) < len(text)
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
    topo.write_text(
        yaml.safe_dump(
            {
                "pp-stage-0": ["node0040", "node0041", "node0042"],
                "pp-stage-1": ["node0100", "node0101"],
            }
        )
    )
    analysis.topology = load_topology(topo)
    try:
        assert analysis.flagged_groups() == [
            {
                "group": "pp-stage-0",
                "nodes": ["node0040", "node0041", "node0042"],
                "suspect_nodes": ["node0041"],
            }
        ]
    finally:
        analysis.topology = None


def test_invalid_topology_file_is_a_configuration_error(tmp_path):
    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"g": "node1"}))
    with pytest.raises(ConfigError, match="topology.yaml.*expected array"):
        load_topology(topo)


def test_invalid_fleet_rules_name_the_file_and_key(tmp_path):
    (tmp_path / "fleet.yaml").write_text(
        yaml.safe_dump(
            {
                "thresholds": {"deviation_mads": 3.5, "relative_floor": 0.02, "min_samples": 8},
                "units": {"GB/s": "lower"},
            }
        )
    )
    with pytest.raises(ConfigError, match=r"fleet.yaml: key 'units.GB/s'"):
        load_fleet_rules(tmp_path)


def test_render_text_lists_suspects_with_median_deviation_and_ratio(analysis):
    text = render_text(analysis)
    assert "suspects: " in text and "2 unreadable" in text
    line = next(ln for ln in text.splitlines() if "tflops_bf16" in ln and "node0041" in ln)
    assert "gpu:3" in line and "MADs" in line and "720" in line and "0.87" in line


# -- training jobs across nodes: fleet stragglers and hung jobs ---------------------------------


def progress(
    job: str,
    rank: int | None,
    pid: int,
    step_time: float | None,
    metric: str = "training_progress",
    likely_origin: bool | None = None,
) -> Result:
    """A per-process ``training_progress`` result in the shape of docs/training_hangs.md."""
    status = {
        "training_progress": Status.PASS,
        "training_straggler": Status.WARN,
        "training_hang": Status.FAIL,
    }[metric]
    hung = metric == "training_hang"
    return Result(
        "training_progress",
        f"job:{job}/rank:{rank}" if rank is not None else f"job:{job}/pid:{pid}",
        metric,
        status,
        f"{metric} of rank {rank}",
        value=400.0 if hung else 1.2,
        unit="s",
        evidence={
            "pid": pid,
            "rank": rank,
            "local_rank": rank,
            "world_size": 16,
            "job": job,
            "step": 1200,
            "step_time_s": step_time,
            "heartbeat_age_s": 400.0 if hung else 1.2,
            "gpus": [0 if rank is None else rank % 8],
            "signals": {"heartbeat": {"available": True, "hang": hung, "detail": "..."}},
            "agreeing": ["heartbeat"] if hung else [],
            "likely_origin": likely_origin,
        },
    )


def write_training_fleet(directory: Path, per_node: dict[str, list[Result]]) -> None:
    """One real report per node (synthetic figures plus the given training results)."""
    for seed, (host, results) in enumerate(per_node.items()):
        report = synthetic_report(host, seed=seed)
        report.results.extend(results)
        json_report.write(report, directory)


def ranks(job: str, first: int | None, step_times: list[float], pid0: int = 100) -> list[Result]:
    """Stepping ranks ``first``, ``first + 1``...; ``first`` None: ranks unknown (pid targets)."""
    return [
        progress(job, None if first is None else first + i, pid0 + i, t)
        for i, t in enumerate(step_times)
    ]


def test_rank_at_2_5x_its_jobs_median_on_another_node_is_a_fleet_straggler(tmp_path):
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:1234", 0, [1.0, 1.02, 0.98, 1.01]),
            "nodeB": ranks("slurm:1234", 4, [0.99, 1.0, 2.5, 1.03]),
        },
    )
    result = analyse([tmp_path], RULES)
    assert [(s.node, s.job, s.rank, s.step_time_s) for s in result.stragglers] == [
        ("nodeB", "slurm:1234", 6, 2.5)
    ]
    s = result.stragglers[0]
    assert s.job_median_s == pytest.approx(1.0)
    assert s.ratio == pytest.approx(2.5)
    assert (s.ranks, s.nodes, result.jobs_compared) == (8, 2, 1)
    line = next(ln for ln in render_text(result).splitlines() if ln.startswith("  nodeB"))
    assert "slurm:1234" in line and "2.5 s" in line and "2.50x" in line
    (entry,) = result.to_dict()["stragglers"]
    assert (entry["node"], entry["rank"], entry["ratio"], entry["job_median_step_time_s"]) == (
        "nodeB",
        6,
        2.5,
        1.0,
    )
    # a straggler is a WARN: listed, exit 0 (when no figure is a suspect)
    assert not result.suspects and not result.found


def test_one_rank_per_node_is_compared_with_the_other_nodes_rank(tmp_path):
    """No peers on its own node (the node's check cannot see it): the fleet can."""
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("torchelastic:abc", 0, [0.4]),
            "nodeB": ranks("torchelastic:abc", 1, [1.0]),
        },
    )
    result = analyse([tmp_path], RULES)
    assert [(s.node, s.rank, round(s.ratio, 2)) for s in result.stragglers] == [("nodeB", 1, 2.5)]


def test_uniform_job_across_nodes_has_no_straggler_and_exits_0(tmp_path):
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:1", 0, [1.0, 1.1, 0.95, 1.05]),
            "nodeB": ranks("slurm:1", 4, [1.02, 0.97, 1.08, 1.0]),
        },
    )
    out = io.StringIO()
    assert (
        fleet_command.run([str(tmp_path)], REPO / "graders", out=out)
        == fleet_command.EXIT_NO_SUSPECTS
    )
    result = analyse([tmp_path], RULES)
    assert result.stragglers == [] and result.jobs_compared == 1
    assert "no fleet stragglers" in out.getvalue()


def test_job_on_one_node_only_is_not_compared_across_the_fleet(tmp_path):
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:1", 0, [1.0, 1.0, 3.0]),  # the node's own check judges these
            "nodeB": ranks("slurm:2", 0, [0.2, 0.2]),
            # a launcher pid names a job on its own node only, even when the numbers match
            "nodeC": ranks("ppid:77", None, [1.0]),
            "nodeD": ranks("ppid:77", None, [3.0]),
        },
    )
    result = analyse([tmp_path], RULES)
    assert result.stragglers == [] and result.jobs_compared == 0


def test_a_hung_ranks_step_time_is_not_compared(tmp_path):
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:5", 0, [1.0, 1.0]),
            "nodeB": [
                progress("slurm:5", 2, 300, 1.0),
                progress("slurm:5", 3, 301, 5.0, metric="training_hang"),
            ],
        },
    )
    assert analyse([tmp_path], RULES).stragglers == []


def test_local_straggler_reporting_progress_too_counts_once(tmp_path):
    """training_progress reports a straggling rank twice (straggler and progress): one rank."""
    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:9", 0, [1.0, 1.0]),
            "nodeB": [
                progress("slurm:9", 2, 200, 1.0),
                progress("slurm:9", 3, 201, 2.4, metric="training_straggler"),
                progress("slurm:9", 3, 201, 2.4),
            ],
        },
    )
    result = analyse([tmp_path], RULES)
    assert [(s.node, s.rank, s.ranks) for s in result.stragglers] == [("nodeB", 3, 4)]


def test_job_wide_hang_is_grouped_by_job_and_names_the_origin_node(tmp_path):
    write_training_fleet(
        tmp_path,
        {
            "nodeA": [
                progress("slurm:77", 0, 10, 1.0, "training_hang", likely_origin=False),
                progress("slurm:77", 1, 11, 1.0, "training_hang", likely_origin=False),
            ],
            "nodeB": [
                progress("slurm:77", 8, 20, 1.0, "training_hang", likely_origin=False),
                progress("slurm:77", 9, 21, 1.0, "training_hang", likely_origin=True),
            ],
            "nodeC": ranks("slurm:78", 0, [1.0])
            + [progress("slurm:78", 1, 31, 1.0, "training_hang", likely_origin=None)],
        },
    )
    result = analyse([tmp_path], RULES)
    by_job = {j.job: j for j in result.hung_jobs}
    assert set(by_job) == {"slurm:77", "slurm:78"}
    hang = by_job["slurm:77"]
    assert hang.origin_nodes == ["nodeB"]
    assert [(n.node, n.ranks, n.origin) for n in hang.nodes] == [
        ("nodeB", ["8", "9"], ["9"]),
        ("nodeA", ["0", "1"], []),
    ], "origin node first"
    assert by_job["slurm:78"].origin_nodes == []
    text = render_text(result)
    assert "hung job slurm:77: 4 rank(s) on 2 node(s); likely origin: nodeB" in text
    assert "  nodeB: rank 8, 9 (likely origin: rank 9)" in text
    data = next(j for j in result.to_dict()["hung_jobs"] if j["job"] == "slurm:77")
    assert data["origin_nodes"] == ["nodeB"] and data["hung_ranks"] == 4
    assert (
        fleet_command.run([str(tmp_path)], REPO / "graders", out=io.StringIO())
        == fleet_command.EXIT_SUSPECTS
    ), "a hung job is something to act on"


def test_evidence_cut_keeps_training_progress_evidence_only(tmp_path):
    report = synthetic_report("n1", seed=5, trace_points=30)
    report.results.append(progress("slurm:1", 0, 10, 0.5, "training_hang", likely_origin=True))
    text = json_report.dumps(report)
    full = json.loads(text)
    cut = json.loads(fleet_reports._without_evidence(text, keep="training_progress"))
    assert [
        r if r["check"] == "training_progress" else {**r, "evidence": {}} for r in full["results"]
    ] == cut["results"]
    assert cut["results"][-1]["evidence"]["likely_origin"] is True


def test_fleet_html_lists_stragglers_and_hung_jobs(tmp_path):
    pytest.importorskip("matplotlib")
    from node_agent.fleet.html import render_fleet_html

    write_training_fleet(
        tmp_path,
        {
            "nodeA": ranks("slurm:1", 0, [1.0])
            + [progress("slurm:2", 0, 50, 1.0, "training_hang", likely_origin=True)],
            "nodeB": ranks("slurm:1", 1, [2.5]),
        },
    )
    page = render_fleet_html(analyse([tmp_path], RULES))
    assert 'class="straggler" data-node="nodeB" data-job="slurm:1"' in page
    assert 'class="hung origin" data-job="slurm:2" data-node="nodeA"' in page


def test_training_thresholds_are_read_from_fleet_yaml(tmp_path):
    assert (RULES.straggler_ratio, RULES.straggler_min_nodes) == (2.0, 2)
    (tmp_path / "fleet.yaml").write_text(
        yaml.safe_dump(
            {
                "thresholds": {"deviation_mads": 3.5, "relative_floor": 0.02, "min_samples": 8},
                "units": {},
                "training": {"straggler_ratio": 1.5, "min_nodes": 3},
            }
        )
    )
    rules = load_fleet_rules(tmp_path)
    assert (rules.straggler_ratio, rules.straggler_min_nodes) == (1.5, 3)


def test_symlink_and_fifo_are_skipped_and_named_not_followed(tmp_path):
    import os

    write_fleet(tmp_path, 3)
    secret = tmp_path.parent / f"{tmp_path.name}-elsewhere.json"
    secret.write_text(next(tmp_path.glob("*.json")).read_text())
    (tmp_path / "zz-link.json").symlink_to(secret)
    fifo = tmp_path.parent / f"{tmp_path.name}-fifo.json"
    os.mkfifo(fifo)  # named on the command line; a plain open would block for ever
    result = analyse([tmp_path, fifo], RULES)
    assert len(result.nodes) == 3
    assert dict(result.skipped) == {
        str(tmp_path / "zz-link.json"): "a symbolic link (fleet reads report files themselves)",
        str(fifo): "not a regular file",
    }
    assert "skipped, not believed (2):" in render_text(result)


def test_report_of_another_owner_is_skipped_when_owners_are_given(tmp_path):
    import os

    write_fleet(tmp_path, 2)
    mine = os.stat(next(tmp_path.glob("*.json"))).st_uid
    assert len(analyse([tmp_path], RULES, owners=frozenset({mine})).nodes) == 2
    others = analyse([tmp_path], RULES, owners=frozenset({mine + 1}))
    assert others.nodes == [] and len(others.skipped) == 2
    assert all(f"owned by uid {mine}" in why for _, why in others.skipped)


def test_fleet_believes_configured_owners_only_as_root():
    from node_agent.config import config_from_dict

    config = config_from_dict({"fleet": {"report_owner_uids": [0, 990]}})
    assert fleet_command.report_owners(config, euid=0) == frozenset({0, 990})
    assert fleet_command.report_owners(config, euid=1000) is None


def test_job_and_host_names_are_escaped_in_the_text_output():
    hung = fleet.TrainingRow(
        "training_hang", "job:x/rank:0", "evil\x1b]0;pwned\x07\x1b[2J", 0, 11, None, True
    )
    node = fleet.NodeFigures(
        "node\x1b[31m1", "h100", "2026-01-01T00:00:00Z", "/r/a.json", [], [hung]
    )
    text = render_text(analyse_figures([node], RULES))
    assert "\x1b" not in text and "\x07" not in text
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J" in text and "node\\x1b[31m1" in text
