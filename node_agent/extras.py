"""The agent's optional dependencies and the command that installs each one.

Everything the README documents runs on the default install (``pyproject.toml``
``dependencies``); three groups stay optional because they are large or serve one output:
``torch`` (the load tests; several GB with CUDA), ``k8s`` (the Kubernetes adapter) and
``report`` (the HTML report's plots). A message about a missing one names the command that
installs it into the environment the agent runs in — the running interpreter's own pip, not
whichever ``pip`` is first on the operator's PATH (after ``make accept`` that is ``.venv``'s).

Standard library only: every wing may import it.
"""

from __future__ import annotations

import shlex
import sys

DISTRIBUTION = "node-agent"

#: extra -> its requirements, as ``pyproject.toml`` [project.optional-dependencies] lists them
#: (tests/unit/test_dependencies.py keeps the two in step)
EXTRAS: dict[str, tuple[str, ...]] = {
    "torch": ("torch>=2.1",),
    "k8s": ("kubernetes>=28.1",),
    "report": ("matplotlib>=3.7", "numpy>=1.24"),
}


def _agent_installed() -> bool:
    """Whether this environment has node-agent's own metadata (pip can then add an extra)."""
    from importlib import metadata  # 20 ms of imports (email's parsers), for a message only

    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return False
    return True


def install_command(extra: str) -> str:
    """The shell command that installs ``extra`` for the running interpreter.

    Where node-agent itself was installed with pip (``make accept`` does), pip adds the extra
    to it: ``/path/python -m pip install 'node-agent[report]'``. Run from a source tree
    without installing (``PYTHONPATH``), pip could not find node-agent, so the requirements
    are named directly.
    """
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    python = shlex.quote(sys.executable or "python3")
    if _agent_installed():
        return f"{python} -m pip install '{DISTRIBUTION}[{extra}]'"
    return f"{python} -m pip install " + " ".join(shlex.quote(r) for r in EXTRAS[extra])


def missing_message(what: str, extra: str, purpose: str) -> str:
    """One line: ``what`` is not installed, what it is for, and the command that installs it,
    e.g. "writing an HTML report needs matplotlib, which is not installed: install the
    `report` extra with /opt/node-agent/bin/python -m pip install 'node-agent[report]'"."""
    return (
        f"{purpose} needs {what}, which is not installed: install the `{extra}` extra with "
        f"{install_command(extra)}"
    )
