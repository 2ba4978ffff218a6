"""A test's own graders directory for ``training_progress``: its thresholds are
``graders/training.yaml``'s, never a suite's (docs/thresholds.md), so a test that judges faster
than the shipped numbers writes them where an operator would."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from node_agent.checks.training_progress import TRAINING_SCHEMA

GRADERS = Path(__file__).resolve().parents[1] / "graders"


def split_thresholds(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(how to run: the suite's params, how to judge: graders/training.yaml's keys)."""
    judging = {k: v for k, v in params.items() if k in TRAINING_SCHEMA["properties"]}
    return {k: v for k, v in params.items() if k not in judging}, judging


def use_training_thresholds(home: Path, thresholds: dict[str, Any]) -> None:
    """Point the config the ``agent`` fixture gives its runs (``home/agent-config.yaml``, its
    other keys kept) at a copy of the shipped graders whose training.yaml holds only
    ``thresholds`` (the rest are the shipped file's: ``load_topic`` merges key by key). Nothing
    is written when there are none and no earlier call wrote a directory; after one, none
    resets to the shipped numbers."""
    graders = home / "graders"
    if not thresholds and not graders.exists():
        return
    if not graders.exists():
        shutil.copytree(GRADERS, graders, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    (graders / "training.yaml").write_text(yaml.safe_dump(thresholds))
    path = home / "agent-config.yaml"  # kept: what a fixture wrote there (slurm_job's cgroups)
    config = yaml.safe_load(path.read_text()) if path.exists() else None
    config = {"state_dir": str(home / "state"), **(config or {}), "graders_dir": str(graders)}
    path.write_text(yaml.safe_dump(config))
