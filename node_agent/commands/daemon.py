"""``node-agent daemon``: the background service (see :mod:`node_agent.service.daemon`)."""

from __future__ import annotations

import argparse
import logging
import sys

from node_agent.commands.reporting import UsageError


def cmd_daemon(args: argparse.Namespace) -> int:
    try:
        from node_agent.service.daemon import Daemon
    except ImportError as err:
        raise UsageError(f"the daemon needs {err.name}: pip install 'node-agent[daemon]'") from err

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Daemon(args.config, args.simulate, suite=args.suite, listen=args.listen).run()
