"""The configuration's typed sections: every key has one, parsed once with its type."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from node_agent.config import DEFAULTS, Config, Safety, config_from_dict


def _leaves(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            out.extend(_leaves(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _typed(config: Config, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _raw(config: Config, dotted: str) -> Any:
    node: Any = config.data
    for part in dotted.split("."):
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return value


@pytest.mark.parametrize("dotted", [k for k, _ in _leaves(DEFAULTS)])
def test_every_configuration_key_has_a_typed_field_with_its_default(dotted):
    config = config_from_dict({})
    assert _plain(_typed(config, dotted)) == _raw(config, dotted)


def test_whole_numbers_given_for_a_float_setting_read_as_float():
    config = config_from_dict(
        {
            "node": {"expected_memory_gib": 512},
            "host": {"timeout_s": 7},
            "daemon": {"xid_poll_s": 1, "nvhcd": {"call_s": 9}},
            "safety": {"restart_window_h": 12, "max_restarts": 4},
        }
    )
    assert config.node.expected_memory_gib == 512.0
    assert isinstance(config.node.expected_memory_gib, float)
    assert isinstance(config.host.timeout_s, float)
    assert isinstance(config.daemon.xid_poll_s, float)
    assert isinstance(config.daemon.nvhcd.call_s, float)
    assert isinstance(config.safety.restart_window_h, float)
    assert config.safety.max_restarts == 4 and isinstance(config.safety.max_restarts, int)


def test_lists_read_as_tuples_and_null_stays_none():
    config = config_from_dict(
        {
            "storage": {"paths": ["/scratch", "/data"]},
            "fleet": {"report_owner_uids": [0, 1001]},
            "training": {"slurm_cgroup_roots": ["/sys/fs/cgroup/system.slice"]},
        }
    )
    assert config.storage.paths == ("/scratch", "/data")
    assert config.fleet.report_owner_uids == (0, 1001)
    assert config.training.slurm_cgroup_roots == ("/sys/fs/cgroup/system.slice",)
    assert config_from_dict({}).training.slurm_cgroup_roots is None
    assert config_from_dict({}).node.expected_gpus is None


def test_sections_are_frozen():
    config = config_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.node.expected_gpus = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.node = config.node  # type: ignore[misc]


def test_safety_defaults_are_the_configuration_defaults():
    assert config_from_dict({}).safety == Safety()
    assert DEFAULTS["safety"] == dataclasses.asdict(Safety())


def test_software_as_dict_names_every_component_in_order():
    software = config_from_dict({"node": {"software": {"driver": "550.54.15"}}}).node.software
    assert software.as_dict() == {
        "driver": "550.54.15",
        "cuda": None,
        "nccl": None,
        "vbios": None,
        "kernel": None,
    }


def test_directories_read_as_paths(tmp_path):
    config = config_from_dict({"state_dir": str(tmp_path), "suites_dir": str(tmp_path / "s")})
    assert config.state_dir == tmp_path
    assert config.suites_dir == tmp_path / "s"
    assert config.graders_dir is None
