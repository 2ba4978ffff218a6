"""Where the declarative data lives: the shipped ``suites/`` and ``graders/`` or an override.

An operator tunes suites, rules, the XID catalog and per-SKU baselines by pointing
``suites_dir``/``graders_dir`` at a directory; otherwise the copies inside the wheel are used.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from node_agent.config import Config
from node_agent.yamlfile import ConfigError


def _shipped(package: str) -> Path:
    return Path(str(importlib.resources.files(package)))


def suites_dir(config: Config) -> Path:
    return _dir(config.get("suites_dir"), "node_agent.suites", "suites_dir", config)


def graders_dir(config: Config) -> Path:
    return _dir(config.get("graders_dir"), "node_agent.graders", "graders_dir", config)


def _dir(override: str | None, package: str, key: str, config: Config) -> Path:
    if override is None:
        return _shipped(package)
    path = Path(override)
    if not path.is_dir():
        raise ConfigError(f"{config.source}: key '{key}': {override!r} is not a directory")
    return path
