"""Each configuration key is declared once, in its section (``node_agent/config.py``): the
defaults, the schema's bounds and the operator's page (docs/configuration.md) all follow it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.config import DEFAULTS, SCHEMA, Config, Safety, config_from_dict
from node_agent.yamlfile import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def _rules(schema: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, rule in schema["properties"].items():
        if rule.get("type") == "object":
            out.update(_rules(rule, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = rule
    return out


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    *outer, last = dotted.split(".")
    data: dict[str, Any] = {last: value}
    for name in reversed(outer):
        data = {name: data}
    return data


def test_the_configuration_page_lists_every_key_with_its_default():
    (block,) = re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    documented = _leaves(yaml.safe_load(block))
    declared = _leaves(DEFAULTS)
    assert sorted(set(declared) - set(documented)) == [], "keys missing from the page"
    assert sorted(set(documented) - set(declared)) == [], "keys the agent does not have"
    wrong = {k: (v, declared[k]) for k, v in documented.items() if v != declared[k]}
    assert wrong == {}, "defaults on the page that differ from the declaration"


def test_every_key_has_a_rule_and_every_rule_a_default():
    assert set(_rules(SCHEMA)) == set(_leaves(DEFAULTS))


def test_every_default_keeps_its_own_rule():
    config = config_from_dict(DEFAULTS)
    assert config.data == DEFAULTS


@pytest.mark.parametrize("dotted", sorted(_leaves(DEFAULTS)))
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(dotted):
    with pytest.raises(ConfigError) as err:
        config_from_dict(_nested(dotted, {"a": "mapping"}))
    message = str(err.value)
    assert f"key '{dotted}'" in message
    assert "expected" in message or "is not one of" in message


BOUNDED = [
    (dotted, bound, limit, "items" in rule)
    for dotted, rule in sorted(_rules(SCHEMA).items())
    for bound, limit in (rule.get("items") or rule).items()
    if bound in ("minimum", "exclusiveMinimum", "maximum")
]


@pytest.mark.parametrize("dotted, bound, limit, in_list", BOUNDED)
def test_a_number_past_its_declared_bound_is_refused_naming_the_key(dotted, bound, limit, in_list):
    past = {"minimum": limit - 1, "exclusiveMinimum": limit, "maximum": limit + 1}[bound]
    with pytest.raises(ConfigError) as err:
        config_from_dict(_nested(dotted, [past] if in_list else past))
    where = f"{dotted}.0" if in_list else dotted
    assert f"key '{where}'" in str(err.value) and str(past) in str(err.value)


def test_a_negative_timeout_is_refused_saying_what_was_expected():
    with pytest.raises(ConfigError, match=r"key 'adapter.slurm.timeout_s': -1 is less than or"):
        config_from_dict({"adapter": {"slurm": {"timeout_s": -1}}})


def test_bounds_are_the_declared_ones():
    rules = _rules(SCHEMA)
    assert rules["daemon.nvhcd.max_per_uid"] == {"type": "integer", "minimum": 1, "maximum": 64}
    assert rules["node.expected_memory_gib"] == {"type": ["number", "null"], "exclusiveMinimum": 0}
    assert rules["fleet.report_owner_uids"] == {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
    }
    assert rules["adapter.name"] == {"enum": ["log", "slurm", "kubernetes", "webhook"]}


def test_sections_are_parsed_from_the_data_and_never_given_beside_it():
    config = config_from_dict({"safety": {"opt_out": True}})
    with pytest.raises(TypeError, match="safety"):
        Config(config.data, config.source, safety=Safety())
    rebuilt = Config(config.data, config.source)
    assert rebuilt == config and rebuilt.safety.opt_out is True
