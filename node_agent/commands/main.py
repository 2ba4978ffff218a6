"""The ``node-agent`` command: parse arguments, call the library, print, exit with the contract's
code (0 healthy/warn, 3 ERROR, 4 FAULT, 2 usage or configuration error, 1 the agent failed)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import NoReturn

from node_agent import __version__
from node_agent.commands.reporting import EXIT_AGENT_FAILED, EXIT_USAGE, UsageError
from node_agent.model import ReportFormatError
from node_agent.report.terminal import printable
from node_agent.yamlfile import ConfigError


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="YAML configuration (default /etc/node-agent/config.yaml if present)",
    )
    parser.add_argument(
        "--simulate",
        metavar="SCENARIO",
        help="run against a simulated node described by a scenario YAML file",
    )


_Sub = argparse._SubParsersAction  # the subcommands of the ``node-agent`` parser


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2, as the command's other errors are; what
    the caller typed is printed with its control characters escaped."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {printable(message)} (`{self.prog} --help`)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``node-agent`` parser; where ``only`` names a command, that command's alone.

    Each command's module imports what it runs (remediation, fleet analysis, the simulator's
    capture, stop-check's ranks, report writers): a process that runs one command parses its
    arguments without importing the others'. The daemon, a long-lived process, keeps its memory
    for its own work (docs/daemon.md); a short one (``check`` from Slurm's HealthCheckProgram,
    hundreds of them in the tests) saves their imports' time. An unknown first word builds the
    whole parser, whose error lists every command."""
    parser: argparse.ArgumentParser = _Parser(
        prog="node-agent",
        description="Decide whether this GPU node is fit for service; grade it "
        "HEALTHY, WARN, ERROR (restart) or FAULT (replace).",
    )
    parser.add_argument("--version", action="version", version=f"node-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    every = dict.fromkeys(add for add, _, _ in _COMMANDS.values())
    adders = [_COMMANDS[only][0]] if only in _COMMANDS else list(every)
    for add in adders:
        add(sub)
    return parser


def _module_parser(module: str) -> Callable[[_Sub[argparse.ArgumentParser]], None]:
    """The adder of a command whose module makes its own subparser (``add_parser``)."""

    def add(sub: _Sub[argparse.ArgumentParser]) -> None:
        import_module(f"node_agent.commands.{module}").add_parser(sub, _common)

    return add


def _add_act_commands(sub: _Sub[argparse.ArgumentParser]) -> None:
    import_module("node_agent.commands.act").add_commands(sub, _common)


#: the one-line help of the subcommands made here
_HELP = {
    "inventory": "host, driver and GPU inventory",
    "grade": "re-grade saved reports with the current rules, or "
    "with --rules DIR and a diff of the grades that changed",
    "daemon": "run in the background: XID watch, periodic checks, "
    "Prometheus metrics, remediation (systemd Type=notify)",
    "fleet": "cross-node outliers, stragglers and hung jobs over "
    "many reports (exit 3 on suspects or hung jobs)",
}


def _command(
    sub: _Sub[argparse.ArgumentParser], name: str, help: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand with the options every command takes (:func:`_common`)."""
    p = sub.add_parser(name, help=help or _HELP[name])
    _common(p)
    return p


def _add_inventory(sub: _Sub[argparse.ArgumentParser]) -> None:
    inv = _command(sub, "inventory")
    inv.add_argument("--json", action="store_true", help="print the inventory as JSON")


def _add_suite_commands(sub: _Sub[argparse.ArgumentParser]) -> None:
    """``accept`` and ``check``: run a suite, report, and act on the grade if asked."""
    from node_agent.commands import act
    from node_agent.report.outputs import add_output_arguments

    for name, default_suite, helptext in (
        ("accept", "delivery", "run the delivery (acceptance) suite"),
        ("check", "quick", "run the quick suite (Slurm HealthCheckProgram)"),
    ):
        p = _command(sub, name, help=helptext)
        p.add_argument(
            "--suite",
            default=default_suite,
            metavar="NAME|PATH",
            help=f"suite name or YAML path (default {default_suite})",
        )
        p.add_argument("--json", action="store_true", help="print the report alone on stdout")
        p.add_argument(
            "--verbose", "-v", action="store_true", help="list passing results too in the summary"
        )
        p.add_argument(
            "--out",
            metavar="DIR",
            help="directory for the JSON report (default: <state_dir>/reports, or a temp dir)",
        )
        if name == "accept":
            p.add_argument("--only", metavar="CHECK,...", help="run only these checks")
        add_output_arguments(p)
        act.add_act_options(p)


def _add_grade(sub: _Sub[argparse.ArgumentParser]) -> None:
    from node_agent.report.outputs import add_output_arguments

    grade = _command(sub, "grade")
    grade.add_argument(
        "report", metavar="REPORT.json", nargs="+", help="saved report(s), or directories of them"
    )
    grade.add_argument("--json", action="store_true", help="print the re-graded report as JSON")
    grade.add_argument(
        "--rules",
        metavar="DIR",
        help="graders directory (rules.yaml, xid.yaml) "
        "to re-grade with; prints the grades that changed",
    )
    add_output_arguments(grade)


def _add_daemon(sub: _Sub[argparse.ArgumentParser]) -> None:
    daemon = _command(sub, "daemon")
    daemon.add_argument(
        "--suite", metavar="NAME|PATH", help="periodic suite (default: daemon.suite, i.e. periodic)"
    )
    daemon.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="metrics address (default: daemon.listen, 127.0.0.1:9847)",
    )
    daemon.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    daemon.add_argument(
        "--keep-socket",
        action="store_true",
        help="hold daemon.nvhcd.socket and restart the daemon under it when it exits, so NVRx's "
        "calls wait for it (a container; under systemd the socket unit does this)",
    )


def _add_fleet(sub: _Sub[argparse.ArgumentParser]) -> None:
    from node_agent.commands.fleet import add_options as add_fleet_options

    fleet = _command(sub, "fleet")
    fleet.add_argument("reports", metavar="REPORT.json|DIR", nargs="+")
    fleet.add_argument("--json", action="store_true", help="print the analysis as JSON")
    fleet.add_argument(
        "--html",
        metavar="PATH",
        help="also write an HTML page of the distributions with the outliers marked",
    )
    fleet.add_argument(
        "--topology",
        metavar="FILE",
        help="YAML mapping parallel groups to node names (NVLink domains under "
        "nvlink_domains, or the JSON fleet --json printed); flags whole groups",
    )
    add_fleet_options(fleet)


def main(argv: Sequence[str] | None = None) -> int:
    # what the agent creates is private unless it says otherwise (reports, evidence, state),
    # also where the scheduler starts it with a loose umask (Slurm's HealthCheckProgram)
    os.umask(0o077)
    words = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=words[0] if words else None).parse_args(words)
    try:
        return command(args.command)(args)
    except (ConfigError, ReportFormatError, UsageError) as err:
        print(f"node-agent: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("node-agent: interrupted", file=sys.stderr)
        return EXIT_AGENT_FAILED
    except Exception as err:  # noqa: BLE001 - the contract's exit 1, one line unless debugging
        if os.environ.get("NODE_AGENT_DEBUG"):
            raise
        print(
            f"node-agent: internal error: {type(err).__name__}: {err} "
            "(set NODE_AGENT_DEBUG=1 for a traceback and report it)",
            file=sys.stderr,
        )
        return EXIT_AGENT_FAILED


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs subcommand ``name``, its module imported only now."""
    _, module, function = _COMMANDS[name]
    run: Callable[[argparse.Namespace], int] = getattr(
        import_module(f"node_agent.commands.{module}"), function
    )
    return run


#: command -> (the function that adds its subparser, one for several commands where they share
#: it; its module under node_agent.commands; the function there that runs it)
_COMMANDS: dict[str, tuple[Callable[[_Sub[argparse.ArgumentParser]], None], str, str]] = {
    "inventory": (_add_inventory, "inventory", "cmd_inventory"),
    "accept": (_add_suite_commands, "accept", "cmd_run_suite"),
    "check": (_add_suite_commands, "accept", "cmd_run_suite"),
    "grade": (_add_grade, "grade", "cmd_grade"),
    "daemon": (_add_daemon, "daemon", "cmd_daemon"),
    "fleet": (_add_fleet, "fleet", "cmd_fleet"),
    "act": (_add_act_commands, "act", "cmd_act"),
    "status": (_add_act_commands, "act", "cmd_status"),
    "set-healthy": (_add_act_commands, "act", "cmd_set_healthy"),
    "breaker": (_add_act_commands, "act", "cmd_breaker"),
    "optout": (_add_act_commands, "act", "cmd_optout"),
    "sdc": (_module_parser("sdc"), "sdc", "run"),
    "hang-check": (_module_parser("hang_check"), "hang_check", "run"),
    "capture": (_module_parser("capture"), "capture", "run"),
    "stop-check": (_module_parser("stop_check"), "stop_check", "cmd_stop_check"),
}


if __name__ == "__main__":
    sys.exit(main())
