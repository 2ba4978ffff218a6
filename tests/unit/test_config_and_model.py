"""Configuration defaults and validation; the report's JSON round trip and schema check."""

from __future__ import annotations

import json

import pytest

from node_agent.config import load_config
from node_agent.model import (
    Action,
    Grade,
    HostInfo,
    Level,
    Reason,
    Report,
    ReportFormatError,
    Result,
    Status,
)
from node_agent.yamlfile import ConfigError


def test_empty_config_file_means_all_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    config = load_config(path)
    assert config.get("adapter.name") == "log"
    assert config.get("safety.max_drained_fraction") == 0.1


def test_partial_section_keeps_other_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("adapter: {name: slurm}\n")
    config = load_config(path)
    assert config.get("adapter.name") == "slurm"
    assert config.get("adapter.webhook.retries") == 3


@pytest.mark.parametrize("text, fragment", [
    ("state_dir: [a, b]\n", "key 'state_dir': expected string"),
    ("daemon: {listen: 'localhost'}\n", "daemon.listen"),
    ("safety: {max_drained_fraction: 1.5}\n", "safety.max_drained_fraction"),
    ("node: {name: 'bad name; rm -rf /'}\n", "node.name"),
    ("- just\n- a list\n", "expected object"),
])
def test_invalid_values_name_the_key(tmp_path, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_yaml_syntax_error_gives_line_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("adapter:\n  name: slurm\n   dry_run: true\n")
    with pytest.raises(ConfigError, match=r"line \d+"):
        load_config(path)


def make_report() -> Report:
    return Report(
        host=HostInfo(hostname="n1", kernel="6.1", driver="570.86.15", cuda="12.8"),
        gpus=[], suite="quick", mode="service", started_at="2026-11-21T00:00:00Z",
        finished_at="2026-11-21T00:00:05Z",
        results=[Result("xid", "gpu:5", "xid", Status.FAIL, "Xid 79", value=79,
                        evidence={"count": 1})],
        grade=Grade(Level.FAULT, Action.REPLACE,
                    (Reason("xid", Level.FAULT, "gpu:5", "Xid 79"),)))


def test_report_round_trips_through_json():
    report = make_report()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == "node-agent.report/1"
    assert Report.from_dict(data).to_dict() == report.to_dict()


def test_report_of_another_schema_is_refused_with_both_versions():
    data = make_report().to_dict() | {"schema": "node-agent.report/2"}
    with pytest.raises(ReportFormatError, match="report/2.*report/1"):
        Report.from_dict(data)


def test_report_with_a_malformed_result_is_a_clear_error():
    data = make_report().to_dict()
    data["results"][0]["status"] = "fine"
    with pytest.raises(ReportFormatError):
        Report.from_dict(data)
