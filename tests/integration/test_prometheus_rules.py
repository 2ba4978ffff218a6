"""The fleet's Prometheus rules and dashboard (packaging/prometheus/), checked by the real promtool.

``promtool check rules`` parses every rule; ``promtool test rules`` runs the unit tests under
``packaging/prometheus/tests/`` against synthetic series. The tests here also hold the files to
what they promise: every rule has a comment, a case that fires it and one that does not; every
series they read is one the daemon exports (rendered by the real collector) or one they record;
every query of the Grafana dashboard parses as PromQL.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.checking.behaviour import NodeLabels, behaviour
from node_agent.checks.xid.watch import XidWatch
from node_agent.model import Level, Result, Status
from node_agent.service.metrics import CheckStats, DaemonCollector, Snapshot

PACKAGING = Path(__file__).resolve().parents[2] / "packaging" / "prometheus"
RULES = PACKAGING / "node-agent.rules.yml"
TESTS = sorted((PACKAGING / "tests").glob("*.yml"))
DASHBOARD = PACKAGING / "grafana-dashboard.json"
#: Grafana's template variables in the dashboard's queries -> what promtool parses instead
VARIABLES = {"$cluster": ".*"}


@pytest.fixture
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus; make test installs it)")
    return path


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=PACKAGING)


def test_shipped_rules_pass_promtool_check(promtool):
    proc = run([promtool, "check", "rules", str(RULES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_every_rule_passes_its_promtool_unit_tests(promtool):
    assert TESTS, "packaging/prometheus/tests/*.yml"
    proc = run([promtool, "test", "rules", *map(str, TESTS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TESTS)


def test_every_rule_has_a_case_that_fires_it_and_one_that_does_not():
    fired: dict[str, int] = {}
    silent: dict[str, int] = {}
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for alert in case.get("alert_rule_test", []):
                seen = fired if alert.get("exp_alerts") else silent
                seen[alert["alertname"]] = seen.get(alert["alertname"], 0) + 1
            for query in case.get("promql_expr_test", []):
                for name in re.findall(r"[a-z]+:[a-z_]+:[a-z]+", query["expr"]):
                    seen = fired if query.get("exp_samples") else silent
                    seen[name] = seen.get(name, 0) + 1
    names = [r.get("alert") or r["record"] for r in rules()]
    assert [n for n in names if n not in fired] == [], "rules no test fires"
    assert [n for n in names if n not in silent] == [], "rules no test keeps silent"


def test_every_rule_says_what_it_finds_in_a_comment():
    lines = RULES.read_text().splitlines()
    bare = []
    for i, line in enumerate(lines):
        if re.match(r"\s*- (alert|record): ", line):
            before = next(p for p in reversed(lines[:i]) if p.strip())
            if not before.strip().startswith("#"):
                bare.append(line.strip())
    assert bare == []


def exported_series() -> set[str]:
    """Every series name the daemon's collectors render (its own, the checks' own and the XID
    watch's), from a state that has them all."""

    def r(check, target, metric, value=1.0, **evidence):
        return Result(check, target, metric, Status.PASS, "", value=value, evidence=evidence)

    snap = Snapshot(
        hostname="n1",
        level=Level.HEALTHY,
        checks={"xid": CheckStats(runs=1, errors=0, last_run_unix=1.0, last_duration_s=0.1)},
        actions={("drain", "done"): 1},
        result_unix={"xid": 1.0},
        intervals={"xid": 30.0},
        nvhcd_served=True,
        nvlink_domain=("9f0c2b6e-5a41-4c7e-8d2a-1b3e5f7a9c0d", 2),
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(lambda: snap))
    labels = NodeLabels("n1", {0: "GPU-0"})
    results = [
        r("nvml_health", "gpu:0", m)
        for m in (
            "temperature",
            "memory_temperature",
            "power",
            "ecc_dbe_volatile",
            "ecc_sbe_volatile",
            "pcie_replay",
        )
    ] + [
        r("nvml_health", "gpu:0", "row_remap", corrected_rows=1, uncorrected_rows=0),
        r("rdma", "hca:mlx5_0", "link_errors", device="mlx5_0", port="1", symbol_error=1),
        r("gpu_burn", "gpu:0", "tflops_bf16"),
        r("hbm_bandwidth", "gpu:0", "copy_gbps"),
        r("pcie_bandwidth", "gpu:0", "h2d_gbps"),
        r("nccl_allreduce", "node", "busbw_peak_gbps"),
        r("sdc", "gpu:0", "sdc_digest"),
        r("training_progress", "job:1/rank:0", "training_progress", pid=1, job="1"),
    ]
    collectors: dict[object, object] = {}
    for check in dict.fromkeys(x.check for x in results):
        factory = behaviour(check).metrics
        assert factory is not None, f"{check} declares no collector"
        if factory not in collectors:
            collectors[factory] = factory(lambda: labels)
            registry.register(collectors[factory])
        collectors[factory].observe([x for x in results if x.check == check])
    watch = XidWatch(lambda: None, lambda: None, lambda s: None, labels=lambda: labels)
    watch.xid_counts[(0, 79)] = 1
    registry.register(watch)
    return {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def series_read(expr: str) -> set[str]:
    """The node-agent series an expression reads (raw or recorded), label values aside."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"(?<![\w:])((?:[a-z]+:)?node_agent_\w*(?::\w+)?)", expr))


def dashboard_exprs() -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", []))
            yield from walk(p.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def test_rules_and_dashboard_read_only_series_the_daemon_exports_or_the_rules_record():
    known = exported_series() | {r["record"] for r in rules() if "record" in r}
    unknown = {}
    for expr in [r["expr"] for r in rules()] + dashboard_exprs():
        for name in series_read(expr) - known:
            unknown.setdefault(name, expr)
    assert unknown == {}


def test_every_dashboard_query_is_valid_promql(promtool, tmp_path):
    """Each query of the dashboard, its template variables replaced, goes through promtool's
    parser as a recording rule (``promtool query`` needs a running server; this needs none)."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    checked = []
    for i, expr in enumerate(exprs):
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"a template variable promtool cannot parse: {expr}"
        checked.append({"record": f"dashboard:query_{i}:check", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": checked}]}))
    proc = run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout
