"""Where the declarative data lives: the shipped ``suites/`` and ``graders/`` or an override.

An operator tunes suites, rules, the XID catalog and per-SKU baselines by pointing
``suites_dir``/``graders_dir`` at a directory; otherwise the shipped copies are used.

"Shipped" has two layouts. An install (a wheel, or ``pip install -e .``) maps the top-level
``suites/`` and ``graders/`` of the source tree to the packages ``node_agent.suites`` and
``node_agent.graders`` (pyproject.toml, ``package-dir``). A source tree used without any install
(``PYTHONPATH`` set to it, as on a GPU host that reaches no package index) has no such
packages: there the two directories sit beside ``node_agent/`` itself, and are found there.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from node_agent.config import Config
from node_agent.yamlfile import ConfigError

#: the source tree's root when node_agent is imported from one (the directory holding it)
_TREE = Path(__file__).resolve().parent.parent


def _shipped(package: str) -> Path:
    """The directory of a shipped data package (``node_agent.suites``, ``node_agent.graders``,
    ``node_agent.graders.skus``): the installed package, else its source directory beside
    ``node_agent/`` (``graders/skus``). FileNotFoundError names both places when neither is."""
    try:
        return Path(str(importlib.resources.files(package)))
    except ModuleNotFoundError as err:
        if err.name != package and not package.startswith(f"{err.name}."):
            raise  # something the package imports is missing, not the package itself
    prefix = "node_agent."
    if not package.startswith(prefix):
        raise ModuleNotFoundError(f"no module named {package!r}", name=package)
    source = _TREE.joinpath(*package[len(prefix) :].split("."))
    if not source.is_dir():
        raise FileNotFoundError(
            f"{package} is not installed and {source} is not a directory: install node-agent "
            f"(pip install .) or run it from a complete source tree"
        )
    return source


def shipped_suites_dir() -> Path:
    """The suites that ship with the agent, whatever ``suites_dir`` says."""
    return _shipped("node_agent.suites")


def shipped_graders_dir() -> Path:
    """The graders that ship with the agent, whatever ``graders_dir`` says (for a file an
    operator's older directory lacks)."""
    return _shipped("node_agent.graders")


def suites_dir(config: Config) -> Path:
    return _dir(config.suites_dir, "node_agent.suites", "suites_dir", config)


def graders_dir(config: Config) -> Path:
    return _dir(config.graders_dir, "node_agent.graders", "graders_dir", config)


def _dir(override: Path | None, package: str, key: str, config: Config) -> Path:
    if override is None:
        return _shipped(package)
    if not override.is_dir():
        raise ConfigError(f"{config.source}: key '{key}': {str(override)!r} is not a directory")
    return override
