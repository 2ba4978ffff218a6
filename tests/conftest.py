"""Shared fixtures: run the real ``node-agent`` entry point, write scenarios and configs."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@pytest.fixture
def agent(tmp_path):
    """Run ``node-agent ARGS`` as a subprocess through its console entry point."""

    def run(*args: str, timeout: float = 120) -> Run:
        argv = [sys.executable, "-c", "import sys; from node_agent.commands.main import main; sys.exit(main())",
                *args]
        if "--config" not in args and args and args[0] in ("accept", "check", "inventory", "grade"):
            config = tmp_path / "agent-config.yaml"
            if not config.exists():
                config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
            argv += ["--config", str(config)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
        return Run(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture
def scenario(tmp_path):
    """Write a scenario file: ``scenario(faults=[...], gpus=8, sku=...)`` -> its path."""
    counter = iter(range(1000))

    def make(faults=(), gpus=8, sku="h100-sxm5-80gb", **extra) -> str:
        path = tmp_path / f"scenario-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump({"sku": sku, "gpus": gpus, "faults": list(faults), **extra}))
        return str(path)

    return make
