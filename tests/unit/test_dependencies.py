"""The default install runs everything the README documents: every third-party module the agent
imports is a core dependency in pyproject.toml, except the three optional groups (torch, the
Kubernetes client, the HTML report's plotting), and each of those is named in
node_agent/extras.py with the command that installs it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from node_agent import extras

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
#: import name -> the extra that provides it; every other third-party import must be core
OPTIONAL_IMPORTS = {
    "torch": "torch",
    "kubernetes": "k8s",
    "matplotlib": "report",
    "numpy": "report",
}
#: used only on a GPU, where present, and never installed by the agent: they come with the GPU
#: node's CUDA stack (triton with torch's CUDA builds); the SDC %smid coverage kernel tries
#: each in turn and says which ran (node_agent/sdc/coverage.py)
GPU_STACK_IMPORTS = {"cupy", "triton"}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the agent's files that import it (imports in functions too)."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "node_agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "node_agent" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_import_outside_the_optional_groups_is_a_core_dependency():
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    providers = metadata.packages_distributions()
    imports = _third_party_imports()
    assert "prometheus_client" in imports and "torch" in imports  # the scan sees the code
    for module, files in sorted(imports.items()):
        if module in OPTIONAL_IMPORTS or module in GPU_STACK_IMPORTS:
            continue
        dists = {_name(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported by {sorted(files)}) is not installed in the test venv"
        assert dists & core, (
            f"{module} (imported by {sorted(files)}) comes from {sorted(dists)}, "
            "which is not a core dependency in pyproject.toml"
        )


def test_daemon_webhook_and_stack_signal_need_no_extra():
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    assert {"prometheus-client", "requests", "py-spy"} <= core
    assert "daemon" not in PYPROJECT["optional-dependencies"]


def test_optional_groups_match_pyproject_and_cover_the_optional_imports():
    declared = {
        extra: tuple(reqs)
        for extra, reqs in PYPROJECT["optional-dependencies"].items()
        if extra != "dev"
    }
    assert declared == extras.EXTRAS
    for module, extra in OPTIONAL_IMPORTS.items():
        assert module in {_name(r) for r in extras.EXTRAS[extra]}, (module, extra)


def test_install_command_targets_the_running_interpreter_and_names_the_extra():
    command = extras.install_command("report")
    assert command.startswith(f"{sys.executable} -m pip install ")
    assert "'node-agent[report]'" in command  # the test venv has node-agent installed (-e .)
    message = extras.missing_message("matplotlib", "report", "writing an HTML report")
    assert message.startswith("writing an HTML report needs matplotlib, which is not installed")
    assert message.endswith(command)
    with pytest.raises(KeyError, match="unknown extra 'daemon'"):
        extras.install_command("daemon")


def test_install_command_names_the_requirements_where_node_agent_is_not_installed(tmp_path):
    """Run from a source tree (PYTHONPATH, as gpu-validate runs it) pip cannot add an extra to a
    node-agent it does not know, so the command names the requirements themselves."""
    code = (
        "import importlib.metadata as m, sys\n"
        "real = m.distribution\n"
        "def fake(name):\n"
        "    if name == 'node-agent': raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.distribution = fake\n"
        "from node_agent import extras\n"
        "print(extras.install_command('report'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert out == f"{sys.executable} -m pip install 'matplotlib>=3.7' 'numpy>=1.24'"
