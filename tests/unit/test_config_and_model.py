"""Configuration defaults and validation; the report's JSON round trip and schema check."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert config.adapter.name == "log"
    assert config.safety.max_drained_fraction == 0.1


def test_partial_section_keeps_other_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("adapter: {name: slurm}\n")
    config = load_config(path)
    assert config.adapter.name == "slurm"
    assert config.adapter.webhook.retries == 3


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("state_dir: [a, b]\n", "key 'state_dir': expected string"),
        ("daemon: {listen: 'localhost'}\n", "daemon.listen"),
        ("safety: {max_drained_fraction: 1.5}\n", "safety.max_drained_fraction"),
        ("node: {name: 'bad name; rm -rf /'}\n", "node.name"),
        ("- just\n- a list\n", "expected object"),
    ],
)
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
        gpus=[],
        suite="quick",
        mode="service",
        started_at="2026-11-21T00:00:00Z",
        finished_at="2026-11-21T00:00:05Z",
        results=[
            Result("xid", "gpu:5", "xid", Status.FAIL, "Xid 79", value=79, evidence={"count": 1})
        ],
        grade=Grade(Level.FAULT, Action.REPLACE, (Reason("xid", Level.FAULT, "gpu:5", "Xid 79"),)),
    )


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


# -- SKU files and scenarios: bad input names the file, the key and what was expected ----------

SKU_BASE = "id: {id}\ndisplay_name: X\nmatch: ['NVIDIA X']\ngpus_per_node: 8\n"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            "memory_total_mib_min: 90000\nmemory_total_mib_max: 80000\n",
            "key 'memory_total_mib_max': 80000 is below memory_total_mib_min 90000",
        ),
        ("nvlink: {links: 18, indices: 12}\n", "key 'nvlink.indices': 12 is below nvlink.links 18"),
        ("gpus_per_node_fixed: maybe\n", "gpus_per_node_fixed"),
    ],
)
def test_inconsistent_sku_files_are_refused_naming_the_key(tmp_path, extra, fragment):
    from node_agent.hardware.sku import load_sku

    path = tmp_path / "x-sku.yaml"
    path.write_text(SKU_BASE.format(id="x-sku") + extra)
    with pytest.raises(ConfigError) as err:
        load_sku(path)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_the_shipped_sku_files_load_and_the_new_ids_are_there():
    from node_agent import resources
    from node_agent.config import config_from_dict
    from node_agent.hardware.sku import load_skus

    skus = load_skus(resources.graders_dir(config_from_dict({})))
    assert {
        "h100-pcie-80gb",
        "h100-nvl-94gb",
        "h20-96gb",
        "l40s-48gb",
        "a100-sxm4-40gb",
        "a100-pcie-80gb",
        "b200-sxm-180gb",
        "gb200-186gb",
        "b300-sxm-288gb",
        "gb300-288gb",
    } <= set(skus)
    for sku in skus.values():
        low, high = sku.memory_range
        assert low is not None and high is not None and low < high, sku.id
        # add-in cards fix no count and expect no NVLink of their own; baseboards do both
        links = sku.section("nvlink").get("links")
        assert (links == 0) == (not sku.fixed_gpu_count), sku.id


@pytest.mark.parametrize(
    "fault, fragment",
    [
        ({"kind": "kernel_log", "line": "NVRM: Xid (PCI:{bus}): 79"}, "uses {bus} but"),
        ({"kind": "kernel_log", "gpu": 1, "line": "one\ntwo"}, "without line breaks"),
        ({"kind": "pci_only", "gpu": 1, "driver": "bad driver"}, "faults[0]"),
        ({"kind": "ecc_sram_uncorrectable", "gpu": 1, "unit": "l3"}, "faults[0]"),
    ],
)
def test_bad_new_fault_kinds_are_refused_naming_the_fault(tmp_path, fault, fragment):
    from node_agent.sim.scenario import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"sku": "h100-sxm5-80gb", "gpus": 2, "faults": [fault]}))
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    assert fragment in str(err.value) and str(path) in str(err.value)


def test_a_gpu_cannot_be_both_off_the_bus_and_on_it(tmp_path):
    from node_agent.sim.scenario import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(
        json.dumps(
            {
                "sku": "h100-sxm5-80gb",
                "gpus": 2,
                "faults": [{"kind": "missing_gpu", "gpu": 1}, {"kind": "pci_only", "gpu": 1}],
            }
        )
    )
    with pytest.raises(ConfigError, match="cannot be both missing_gpu"):
        load_scenario(path)


def test_kernel_log_lines_keep_scenario_order_and_take_the_kernels_bus_form(tmp_path):
    from node_agent.hardware.sku import load_sku
    from node_agent.sim.gpu_model import SimGpuBackend
    from node_agent.sim.scenario import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(
        json.dumps(
            {
                "sku": "h100-sxm5-80gb",
                "gpus": 8,
                "faults": [
                    {
                        "kind": "kernel_log",
                        "line": "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, "
                        "Non-fatal, Link 44 egress non-posted PRIV error",
                    },
                    {"kind": "xid", "gpu": 1, "code": 48},
                    {"kind": "kernel_log", "gpu": 5, "line": "NVRM: GPU at PCI:{bus}: GPU-4a1c"},
                ],
            }
        )
    )
    scenario = load_scenario(path)
    sku = load_sku(Path(__file__).resolve().parents[2] / "graders/skus/h100-sxm5-80gb.yaml")
    lines = SimGpuBackend(scenario, sku).kernel_log_lines()
    assert lines[0].startswith("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028")
    assert lines[1].startswith("NVRM: Xid (PCI:0000:2a:00): 48,")
    assert lines[2] == "NVRM: GPU at PCI:0000:ab:00: GPU-4a1c"
