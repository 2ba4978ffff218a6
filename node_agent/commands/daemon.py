"""``node-agent daemon``: the background service (see :mod:`node_agent.service.daemon`)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from node_agent.commands.reporting import UsageError

#: import name -> the core requirement (pyproject.toml) that provides it
_CORE = {
    "prometheus_client": "prometheus-client>=0.19",
    "requests": "requests>=2.31",
    "yaml": "pyyaml>=6.0",
    "jsonschema": "jsonschema>=4.17",
    "psutil": "psutil>=5.9",
    "pynvml": "nvidia-ml-py>=12.535",
}


def missing_core_message(name: str | None) -> str:
    """The error for a core dependency the daemon imports but this environment lacks.

    The default install has them all (pyproject.toml ``dependencies``), so this means a broken
    or hand-made environment: name the command that repairs it for this interpreter."""
    top = (name or "").split(".")[0]
    requirement = _CORE.get(top, top or "node-agent")
    return (
        f"the daemon needs {top or 'a module'}, a core dependency of node-agent that this "
        f"environment lacks (a broken install): {shlex.quote(sys.executable)} -m pip "
        f"install {shlex.quote(requirement)}"
    )


def cmd_daemon(args: argparse.Namespace) -> int:
    try:
        from node_agent.service.daemon import Daemon
    except ImportError as err:
        raise UsageError(missing_core_message(err.name)) from err

    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return Daemon(args.config, args.simulate, suite=args.suite, listen=args.listen).run()
