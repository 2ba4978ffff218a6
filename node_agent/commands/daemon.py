"""``node-agent daemon``: the background service (see :mod:`node_agent.service.daemon`)."""

from __future__ import annotations

import argparse
import logging
import os
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


#: glibc's mallopt() parameter M_ARENA_MAX (malloc.h)
_M_ARENA_MAX = -8
#: malloc arenas the daemon's threads share (glibc gives each new thread its own, up to 8 per
#: core, and each keeps the memory it once held); the daemon's threads allocate little
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas before any thread starts (docs/daemon.md, Memory); whether it
    was done. Not on another C library, nor where the environment sets MALLOC_ARENA_MAX (the
    operator's choice stands); a failure only leaves glibc's default."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        import ctypes

        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (ValueError, OSError, AttributeError):
        return False


def cmd_daemon(args: argparse.Namespace) -> int:
    limit_malloc_arenas()
    try:
        from node_agent.service.daemon import Daemon
    except ImportError as err:
        raise UsageError(missing_core_message(err.name)) from err

    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.keep_socket:
        return _keep_socket(args)
    return Daemon(args.config, args.simulate, suite=args.suite, listen=args.listen).run()


def _keep_socket(args: argparse.Namespace) -> int:
    from node_agent.config import load_config
    from node_agent.proc import python_module_argv
    from node_agent.service.socket_keeper import keep_socket_and_run

    nvhcd = load_config(args.config).daemon.nvhcd
    if nvhcd.socket is None:
        raise UsageError("--keep-socket holds daemon.nvhcd.socket, which the config does not set")
    argv = ["daemon", "--log-level", args.log_level]
    for flag, value in (
        ("--config", args.config),
        ("--simulate", args.simulate),
        ("--suite", args.suite),
        ("--listen", args.listen),
    ):
        if value is not None:
            argv += [flag, value]
    try:
        return keep_socket_and_run(
            nvhcd.socket, nvhcd.group, python_module_argv("node_agent.commands.main", *argv)
        )
    except (OSError, KeyError) as err:
        raise UsageError(f"cannot hold {nvhcd.socket}: {err}") from err
