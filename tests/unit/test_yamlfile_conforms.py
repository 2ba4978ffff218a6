"""``yamlfile.conforms`` says "valid" exactly when jsonschema does.

The daemon validates its files without jsonschema (docs/daemon.md, Memory): a file conforms()
finds valid is accepted without asking jsonschema, so a file conforms() passes that jsonschema
refuses would be accepted silently. These tests hold the two to the same verdict on every file
the agent ships (configuration, suites, graders, SKUs, scenarios) and on broken copies of each:
every value swapped for one of another type, every key removed, an unknown key added.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from node_agent import yamlfile
from node_agent.config import load_config
from node_agent.environment import load_data
from node_agent.grading.trends import load_trend_specs
from node_agent.hardware.driver_lines import load_driver_lines
from node_agent.resources import shipped_graders_dir, suites_dir
from node_agent.sim.scenario import load_scenario
from node_agent.suite import load_suite
from node_agent.yamlfile import ConfigError, conforms, validate

ROOT = Path(__file__).resolve().parents[2]
#: values of every JSON type, and the edges of its rules (true is not 1; 2.0 is an integer)
SWAPS = [None, True, False, 0, 1, -1, 2.0, 0.5, "", "x", [], [1, 1], {}, {"zz": 1}]
#: broken copies tried per file at most (spread over the whole file)
MAX_BROKEN = 24


def _shipped_pairs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    """(data, schema) of every validation the agent's loaders make of its shipped files."""
    seen: list[tuple[Any, dict[str, Any]]] = []
    real = yamlfile.conforms
    depth = [0]

    def recording(value: Any, schema: Any) -> bool:
        if depth[0] == 0 and isinstance(schema, dict):
            seen.append((copy.deepcopy(value), schema))
        depth[0] += 1
        try:
            return real(value, schema)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(yamlfile, "conforms", recording)
    config = load_config(ROOT / "packaging/slurm/config.yaml")
    _grader, skus = load_data(config)
    graders = shipped_graders_dir()
    load_trend_specs(graders / "trends.yaml")
    load_driver_lines(graders / "driver_lines.yaml")
    for suite in sorted(suites_dir(config).glob("*.yaml")):
        load_suite(str(suite), suites_dir(config))
    for scenario in sorted((ROOT / "scenarios").rglob("*.yaml")):
        try:
            load_scenario(scenario, skus)
        except ConfigError:
            pass  # a capture's sidecar, not a scenario; its verdict is still compared below
    monkeypatch.undo()
    return seen


def _paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _paths(value, (*path, i))


def _set(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(data)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return out


def _at(data: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        data = data[step]
    return data


def _broken(data: Any) -> Iterator[Any]:
    """Copies of ``data`` with one thing wrong (or, by chance, still right), at no more than
    MAX_BROKEN / 16 places spread over the file."""
    paths = list(_paths(data))
    for path in paths[:: max(1, len(paths) * (len(SWAPS) + 2) // MAX_BROKEN)]:
        for swap in SWAPS:
            yield _set(data, path, copy.deepcopy(swap))
        if path and isinstance(_at(data, path[:-1]), dict):
            without = copy.deepcopy(data)
            del _at(without, path[:-1])[path[-1]]
            yield without
        if isinstance(_at(data, path), dict):
            yield _set(data, path, {**_at(data, path), "zz_unknown": 1})


def _verdicts_agree(data: Any, schema: dict[str, Any], checker: Any = None) -> None:
    checker = checker or jsonschema.Draft202012Validator(schema)
    assert conforms(data, schema) == checker.is_valid(data), data


def test_every_shipped_file_gets_jsonschemas_verdict(monkeypatch):
    pairs = _shipped_pairs(monkeypatch)
    assert len(pairs) >= 30, "the loaders validated fewer files than the repository ships"
    for data, schema in pairs:
        _verdicts_agree(data, schema)


def test_broken_copies_of_shipped_files_get_jsonschemas_verdict(monkeypatch):
    refused = 0
    for data, schema in _shipped_pairs(monkeypatch):
        checker = jsonschema.Draft202012Validator(schema)
        for bad in _broken(data):
            _verdicts_agree(bad, schema, checker)
            refused += not conforms(bad, schema)
    assert refused > 300, "the broken copies were hardly ever invalid: the test tests little"


@pytest.mark.parametrize(
    ("value", "schema", "valid"),
    [
        (True, {"type": "integer"}, False),
        (2.0, {"type": "integer"}, True),
        (True, {"enum": [1]}, False),
        (1.0, {"enum": [1]}, True),
        ([1, True], {"uniqueItems": True}, True),
        ([1, 1.0], {"uniqueItems": True}, False),
        (5, {"oneOf": [{"minimum": 1}, {"maximum": 9}]}, False),
        ({"a1": "x"}, {"patternProperties": {"^a": {"type": "integer"}}}, False),
        ({"b": 1}, {"patternProperties": {"^a": {}}, "additionalProperties": False}, False),
        ("abc", {"minimum": 9, "pattern": "b"}, True),
        ({"K": 1}, {"propertyNames": {"pattern": "^[a-z]+$"}}, False),
    ],
)
def test_edges_of_the_rules_match_jsonschema(value, schema, valid):
    assert conforms(value, schema) is valid
    _verdicts_agree(value, schema)


def test_a_keyword_conforms_does_not_know_goes_to_jsonschema():
    schema = {"$defs": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/n"}}}
    validate({"n": 3}, schema, "ok.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml: key 'n': expected integer"):
        validate({"n": "three"}, schema, "bad.yaml")


def test_an_invalid_file_still_gets_jsonschemas_best_message():
    schema = {"type": "object", "properties": {"every_s": {"type": "number"}}}
    with pytest.raises(ConfigError, match=r"key 'every_s': expected number, found str"):
        validate({"every_s": "often"}, schema, "suite.yaml")
