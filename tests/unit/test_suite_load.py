"""Suite files: whole numbers read as seconds (float), bad entries name the key and the choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_agent.suite import DEFAULT_TIMEOUT_S, load_suite
from node_agent.yamlfile import ConfigError

SUITES = Path(__file__).resolve().parents[2] / "suites"


def _write(tmp_path: Path, checks: list[dict[str, object]]) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "mode": "service", "checks": checks}))
    return path


def test_whole_numbers_for_timeout_and_cadence_read_as_float_seconds(tmp_path):
    path = _write(
        tmp_path, [{"check": "inventory", "timeout_s": 10, "every_s": 60}, {"check": "xid"}]
    )
    first, second = load_suite(str(path), SUITES).checks
    assert first.timeout_s == 10.0 and isinstance(first.timeout_s, float)
    assert first.every_s == 60.0 and isinstance(first.every_s, float)
    assert second.timeout_s == DEFAULT_TIMEOUT_S and second.every_s is None


def test_an_unknown_check_names_the_entry_and_the_known_checks(tmp_path):
    path = _write(tmp_path, [{"check": "inventory"}, {"check": "no_such_check"}])
    with pytest.raises(ConfigError) as err:
        load_suite(str(path), SUITES)
    assert "key 'checks.1.check': unknown check 'no_such_check'" in str(err.value)
    assert "inventory" in str(err.value)


def test_an_unknown_suite_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="known suites: .*periodic"):
        load_suite("no-such-suite", SUITES)


def test_only_keeps_the_suites_order_and_refuses_a_check_it_does_not_have():
    suite = load_suite("periodic", SUITES)
    names = [spec.check for spec in suite.checks]
    assert [spec.check for spec in suite.only(names[::-1][:2]).checks] == names[-2:]
    with pytest.raises(ConfigError, match="--only: not_there not in suite 'periodic'"):
        suite.only(["not_there"])
