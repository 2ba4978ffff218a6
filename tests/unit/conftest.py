"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest
import yaml

from node_agent.config import load_config
from node_agent.environment import open_environment


@pytest.fixture
def node(tmp_path):
    """``node(gpus=8, faults=(), **scenario)`` -> an opened simulated Environment (H100 SXM5).
    Every node of one test shares its state dir (``tmp_path/state``: runs see each other's
    state) and its SDC spool (``tmp_path/spool``)."""
    config_path = tmp_path / "config.yaml"
    config_path.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "spool")})
    )
    envs = []

    def make(gpus=8, faults=(), **extra):
        path = tmp_path / f"scenario-{len(envs)}.yaml"
        path.write_text(
            yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": gpus, "faults": list(faults), **extra})
        )
        env = open_environment(load_config(config_path), str(path))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()
