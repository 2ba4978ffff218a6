"""Each judging threshold has one home (docs/thresholds.md):

- ``graders/rules.yaml``: which finding makes which grade, no numbers;
- ``graders/skus/<sku>.yaml``: numbers that depend on the hardware model;
- ``graders/<topic>.yaml``: judging numbers that do not;
- ``suites/*.yaml`` params: how to run (durations, sizes, repetitions, timeouts), never how to
  judge;
- code: no default for a number one of those files holds.

The naming convention that makes a key a judging threshold: its name ends in ``_min``, ``_max``,
``_below`` or ``_above`` (``JUDGING_SUFFIXES``), or it is one of the judging params named before
the convention (``NAMED_JUDGING``). Each rule is shown failing on a planted violation."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.checking import thresholds
from node_agent.checking.context import CheckContext
from node_agent.checking.host_checks import HOST_SCHEMA
from node_agent.checking.registry import REGISTRY
from node_agent.checking.siblings import PERFORMANCE_SCHEMA, load_thresholds
from node_agent.checks import (
    cloud_maintenance,
    kernel_distress,
    storage,
    thermal_power,
    training_progress,
)
from node_agent.commands.main import main
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.hardware.sku import load_sku
from node_agent.model import Status
from node_agent.suite import load_suite
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
GRADERS = REPO / "graders"
SUITES = REPO / "suites"
HEALTHY = str(REPO / "scenarios" / "healthy-h100.yaml")

#: a key whose name ends so is a judging threshold, wherever it is written
JUDGING_SUFFIXES = ("_min", "_max", "_below", "_above")
#: judging params named before the convention, by check (a suite may not carry them either)
NAMED_JUDGING: dict[str, frozenset[str]] = {
    "training_progress": frozenset(
        {
            "stall_after_s",
            "hang_after_s",
            "hang_step_multiple",
            "agree",
            "confirm_s",
            "straggler_ratio",
            "straggler_for_s",
            "log_silence_s",
        }
    ),
    "cloud_maintenance": frozenset({"lead_time_s"}),
    "hca_ports": frozenset({"ports", "min_rate_gbps"}),
    "kernel_distress": frozenset({"nvme_repeat", "mce_corrected_warn", "pstore_max_age_h"}),
}
#: every name that is a judging threshold outside the suffix convention
NAMED = frozenset().union(*NAMED_JUDGING.values())

#: Checks whose ``Params`` still accept a judging threshold, so an operator's suite could
#: carry one (none of the shipped suites does). Each moves to a graders file when its module is
#: next changed (docs/thresholds.md, "Not yet in one home"); the list may only shrink: a check
#: that no longer takes the key fails this test until its line goes.
PARAMS_STILL_JUDGING: dict[str, frozenset[str]] = {}
#: Keys written in two kinds of file today, and why (the same may-only-shrink rule).
KNOWN_SECOND_HOMES: dict[str, frozenset[str]] = {}


def is_judging(key: str, check: str | None = None) -> bool:
    """Whether ``key`` names a judging threshold (of ``check``, for its named params)."""
    named = NAMED_JUDGING.get(check, frozenset()) if check is not None else NAMED
    return key.endswith(JUDGING_SUFFIXES) or key in named


def leaf_keys(data: Any) -> Iterator[str]:
    """Every mapping key in ``data``, however deep (lists walked through)."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            yield str(key)
            yield from leaf_keys(value)
    elif isinstance(data, list):
        for item in data:
            yield from leaf_keys(item)


# -- suites say how to run, never how to judge -----------------------------------------------------


def judging_params_in_suite(suite: Mapping[str, Any]) -> list[str]:
    """``check.key`` for each judging threshold a suite's entries carry (the stand-in overlay
    ``simulated`` included)."""
    found = []
    for entry in suite.get("checks") or []:
        params = dict(entry.get("params") or {})
        params.update(params.pop("simulated", None) or {})
        found += [f"{entry['check']}.{k}" for k in sorted(params) if is_judging(k, entry["check"])]
    return found


@pytest.mark.parametrize("path", sorted(SUITES.glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_suite_carries_a_judging_threshold(path):
    assert judging_params_in_suite(yaml.safe_load(path.read_text())) == []


def test_a_judging_threshold_planted_in_a_suite_is_found():
    suite = yaml.safe_load((SUITES / "periodic.yaml").read_text())
    suite["checks"].append({"check": "storage", "params": {"read_bw_mbps_min": 500}})
    suite["checks"].append(
        {"check": "training_progress", "params": {"simulated": {"straggler_ratio": 3}}}
    )
    assert judging_params_in_suite(suite) == [
        "storage.read_bw_mbps_min",
        "training_progress.straggler_ratio",
    ]


def _suite(tmp_path: Path, params: dict[str, object]) -> Path:
    path = tmp_path / "mine.yaml"
    suite = {"name": "mine", "mode": "delivery", "checks": [{"check": "storage", "params": params}]}
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.fixture
def umask() -> Iterator[None]:
    """``main`` sets the agent's umask; the test process gets its own back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def test_a_suite_carrying_a_storage_minimum_is_refused_naming_its_home(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_suite(str(_suite(tmp_path, {"read_bw_mbps_min": 500})), SUITES)
    assert "read_bw_mbps_min judges" in str(err.value)
    assert "graders/storage.yaml" in str(err.value)


@pytest.mark.parametrize(
    ("check", "key", "home"),
    [
        ("training_progress", "hang_after_s", "graders/training.yaml"),
        ("training_progress", "log_silence_s", "graders/training.yaml"),
        ("cloud_maintenance", "lead_time_s", "graders/cloud.yaml"),
        ("kernel_distress", "nvme_repeat", "graders/kernel.yaml"),
    ],
)
def test_a_suite_carrying_a_moved_threshold_is_refused_naming_its_home(tmp_path, check, key, home):
    path = tmp_path / "mine.yaml"
    entry = {"check": check, "params": {key: 3}}
    path.write_text(yaml.safe_dump({"name": "mine", "mode": "service", "checks": [entry]}))
    with pytest.raises(ConfigError) as err:
        load_suite(str(path), SUITES)
    assert f"{key} judges" in str(err.value) and home in str(err.value)


def test_the_cli_exits_2_on_a_suite_with_a_storage_minimum_and_runs_nothing(
    tmp_path, capsys, umask
):
    suite = _suite(tmp_path, {"size": "16M", "write_bw_mbps_min": 1})
    out = tmp_path / "reports"
    code = main(["check", "--simulate", HEALTHY, "--suite", str(suite), "--out", str(out)])
    assert code == 2
    assert "graders/storage.yaml" in capsys.readouterr().err
    assert not out.exists()


# -- each threshold key has one kind of home ----------------------------------------------------


def params_judging(check_params: Mapping[str, type[Any] | None]) -> dict[str, set[str]]:
    """check -> the judging thresholds its ``Params`` accept (what a suite could carry)."""
    out: dict[str, set[str]] = {}
    for check, params in check_params.items():
        if params is None or not dataclasses.is_dataclass(params):
            continue
        names = {f.name for f in dataclasses.fields(params) if is_judging(f.name, check)}
        if names:
            out[check] = names
    return out


def registered_params() -> dict[str, type[Any] | None]:
    return {
        name: getattr(importlib.import_module(module), "Params", None)
        for name, module in REGISTRY.items()
    }


def homes(graders: Path, check_params: Mapping[str, type[Any] | None]) -> dict[str, set[str]]:
    """Each judging threshold key -> the kinds of file that hold it: ``sku``
    (graders/skus/*.yaml), ``topic`` (graders/*.yaml but rules.yaml) and ``suite params`` (a
    key some check's ``Params`` accepts)."""
    found: dict[str, set[str]] = {}

    def add(kind: str, keys: Iterator[str] | set[str]) -> None:
        for key in keys:
            if is_judging(key):
                found.setdefault(key, set()).add(kind)

    for path in sorted((graders / "skus").glob("*.yaml")):
        add("sku", leaf_keys(yaml.safe_load(path.read_text())))
    for path in sorted(graders.glob("*.yaml")):
        if path.name != "rules.yaml":
            add("topic", leaf_keys(yaml.safe_load(path.read_text())))
    for names in params_judging(check_params).values():
        add("suite params", names)
    return found


def second_homes(graders: Path, check_params: Mapping[str, type[Any] | None]) -> dict[str, set]:
    return {k: kinds for k, kinds in homes(graders, check_params).items() if len(kinds) > 1}


def test_each_threshold_key_is_read_from_one_kind_of_file():
    assert second_homes(GRADERS, registered_params()) == {
        k: set(v) for k, v in KNOWN_SECOND_HOMES.items()
    }


def test_a_threshold_planted_in_a_second_kind_of_file_is_found(tmp_path):
    graders = tmp_path / "graders"
    shutil.copytree(GRADERS, graders, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    sku = graders / "skus" / "h100-sxm5-80gb.yaml"
    data = yaml.safe_load(sku.read_text())
    data["limits"]["percent_used_max"] = 80  # host.yaml's nvme wear line, now also a SKU's
    sku.write_text(yaml.safe_dump(data))
    found = second_homes(graders, registered_params())
    assert found["percent_used_max"] == {"sku", "topic"}


def test_rules_yaml_holds_no_threshold():
    rules = yaml.safe_load((GRADERS / "rules.yaml").read_text())
    assert [k for k in leaf_keys(rules) if is_judging(k)] == []


def test_only_the_listed_checks_still_take_a_judging_threshold_as_a_param():
    assert params_judging(registered_params()) == {
        k: set(v) for k, v in PARAMS_STILL_JUDGING.items()
    }


def test_a_judging_param_planted_in_a_checks_params_is_found():
    @dataclasses.dataclass(frozen=True)
    class Params:
        size: str = "64M"
        read_bw_mbps_min: float | None = None

    assert params_judging({"storage": Params}) == {"storage": {"read_bw_mbps_min"}}


# -- code holds no copy of a YAML threshold ---------------------------------------------------------


def silent_sku_defaults(root: Path) -> list[str]:
    """``file:line`` of each ``X.limit(key, default)`` call: a SKU limit with a code default is
    a second home for the number."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "limit"
                and len(node.args) + len(node.keywords) > 1
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_code_defaults_a_sku_limit():
    assert silent_sku_defaults(REPO / "node_agent") == []


def test_a_planted_code_default_for_a_sku_limit_is_found(tmp_path):
    (tmp_path / "check.py").write_text(
        "def judge(sku):\n    return sku.limit('power_reached_fraction_min', 0.75)\n"
    )
    assert silent_sku_defaults(tmp_path) == ["check.py:2"]


#: topic file -> its schema: code reads each key without a default, so the shipped file holds all
TOPIC_SCHEMAS = {
    "cloud": cloud_maintenance.CLOUD_SCHEMA,
    "host": HOST_SCHEMA,
    "kernel": kernel_distress.KERNEL_SCHEMA,
    "performance": PERFORMANCE_SCHEMA,
    "storage": storage.STORAGE_SCHEMA,
    "thermal_power": thermal_power.THERMAL_SCHEMA,
    "training": training_progress.TRAINING_SCHEMA,
}


def missing_keys(schema: Mapping[str, Any], data: Any, where: str = "") -> list[str]:
    """Each property ``schema`` names that ``data`` lacks, dotted (sections walked)."""
    out = []
    for key, sub in (schema.get("properties") or {}).items():
        if not isinstance(data, Mapping) or key not in data:
            out.append(f"{where}{key}")
        elif sub.get("type") == "object":
            out += missing_keys(sub, data[key], f"{where}{key}.")
    return out


@pytest.mark.parametrize("topic", sorted(TOPIC_SCHEMAS))
def test_the_shipped_topic_file_holds_every_key_its_code_reads(topic):
    data = yaml.safe_load((GRADERS / f"{topic}.yaml").read_text())
    assert missing_keys(TOPIC_SCHEMAS[topic], data) == []


def test_a_key_missing_from_a_topic_file_is_found():
    data = yaml.safe_load((GRADERS / "host.yaml").read_text())
    del data["nvme"]["percent_used_max"]
    assert missing_keys(HOST_SCHEMA, data) == ["nvme.percent_used_max"]


# -- reading a topic file ---------------------------------------------------------------------------


def _config(graders: Path | None = None):
    return config_from_dict({} if graders is None else {"graders_dir": str(graders)})


def test_an_operators_keys_replace_the_shipped_ones_one_by_one(tmp_path):
    (tmp_path / "host.yaml").write_text("nvme: {percent_used_max: 80}\n")
    data = thresholds.load_topic(_config(tmp_path), "host", HOST_SCHEMA, "host grading file")
    shipped = yaml.safe_load((GRADERS / "host.yaml").read_text())
    assert data["nvme"]["percent_used_max"] == 80
    assert data["memory"] == shipped["memory"]


def test_an_operators_directory_without_the_file_reads_the_shipped_one(tmp_path):
    th = load_thresholds(_config(tmp_path))
    assert (th.warn_below, th.error_below, th.min_gpus) == (0.92, 0.80, 3)


def test_a_bad_key_in_an_operators_topic_file_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "performance.yaml").write_text("siblings: {warn_belw: 0.9}\n")
    with pytest.raises(ConfigError, match="warn_belw"):
        load_thresholds(_config(tmp_path))


def test_a_sku_file_still_setting_a_thermal_limit_is_an_error_naming_its_new_home(tmp_path):
    sku = yaml.safe_load((GRADERS / "skus" / "h100-sxm5-80gb.yaml").read_text())
    sku["limits"]["power_reached_fraction_min"] = 0.7
    path = tmp_path / "h100-sxm5-80gb.yaml"
    path.write_text(yaml.safe_dump(sku))
    ctx = CheckContext(
        check="thermal_power",
        gpu=AbsentGpuBackend("no GPU in this test"),
        kernel_log=None,
        config=_config(),
        inventory=None,
        sku=load_sku(path),
        expected_gpus=None,
    )
    (result,) = thermal_power.run(ctx)
    assert result.status is Status.ERROR
    assert "limits.power_reached_fraction_min" in result.detail
    assert "graders/thermal_power.yaml" in result.detail


# -- the table a check author reads ----------------------------------------------------------------


def checks_missing_from_the_table(doc: str, checks: list[str]) -> list[str]:
    """The checks that no row of docs/thresholds.md's per-check table names (as `name`)."""
    table = doc.split("## Each check's thresholds", 1)[-1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return [c for c in checks if not any(f"`{c}`" in row for row in rows)]


def test_docs_thresholds_table_names_every_registered_check():
    doc = (REPO / "docs" / "thresholds.md").read_text()
    assert checks_missing_from_the_table(doc, sorted(REGISTRY)) == []


def test_a_check_left_out_of_the_docs_table_is_found():
    doc = (REPO / "docs" / "thresholds.md").read_text().replace("| `rdma` |", "| rdma |")
    assert checks_missing_from_the_table(doc, sorted(REGISTRY)) == ["rdma"]
