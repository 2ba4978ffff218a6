"""The ``node-agent`` command: parse arguments, call the library, print, exit with the contract's
code (0 healthy/warn, 3 ERROR, 4 FAULT, 2 usage or configuration error, 1 the agent failed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from . import __version__, hang_command, remediation_cli, sdc_command
from .config import load_config
from .environment import Environment, open_environment, report_dir
from .model import Level, Report, ReportFormatError, utc_now
from .report import json_report
from .report.outputs import add_output_arguments, check_outputs, write_outputs
from .report.terminal import ProgressPrinter, render_summary
from .resources import suites_dir
from .runner import run_suite
from .suite import load_suite
from .yamlfile import ConfigError

EXIT_OK, EXIT_AGENT_FAILED, EXIT_USAGE, EXIT_ERROR, EXIT_FAULT = 0, 1, 2, 3, 4
EXIT_FOR_LEVEL = {Level.HEALTHY: EXIT_OK, Level.WARN: EXIT_OK, Level.ERROR: EXIT_ERROR,
                  Level.FAULT: EXIT_FAULT}


class UsageError(Exception):
    """Arguments that parse but do not make sense together (exit 2)."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help="YAML configuration (default /etc/node-agent/config.yaml if present)")
    parser.add_argument("--simulate", metavar="SCENARIO",
                        help="run against a simulated node described by a scenario YAML file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="node-agent",
        description="Decide whether this GPU node is fit for service; grade it "
                    "HEALTHY, WARN, ERROR (restart) or FAULT (replace).")
    parser.add_argument("--version", action="version", version=f"node-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inv = sub.add_parser("inventory", help="host, driver and GPU inventory")
    _common(inv)
    inv.add_argument("--json", action="store_true", help="print the inventory as JSON")

    for name, default_suite, helptext in (
            ("accept", "delivery", "run the delivery (acceptance) suite"),
            ("check", "quick", "run the quick suite (Slurm HealthCheckProgram)")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        p.add_argument("--suite", default=default_suite, metavar="NAME|PATH",
                       help=f"suite name or YAML path (default {default_suite})")
        p.add_argument("--json", action="store_true", help="print the report alone on stdout")
        p.add_argument("--verbose", "-v", action="store_true",
                       help="list passing results too in the summary")
        p.add_argument("--out", metavar="DIR", help="directory for the JSON report "
                       "(default: <state_dir>/reports, or a temp dir)")
        if name == "accept":
            p.add_argument("--only", metavar="CHECK,...", help="run only these checks")
        add_output_arguments(p)
        remediation_cli.add_act_options(p)

    grade = sub.add_parser("grade", help="re-grade saved reports with the current rules, or "
                           "with --rules DIR and a diff of the grades that changed")
    _common(grade)
    grade.add_argument("report", metavar="REPORT.json", nargs="+",
                       help="saved report(s), or directories of them")
    grade.add_argument("--json", action="store_true", help="print the re-graded report as JSON")
    grade.add_argument("--rules", metavar="DIR", help="graders directory (rules.yaml, xid.yaml) "
                       "to re-grade with; prints the grades that changed")
    add_output_arguments(grade)

    daemon = sub.add_parser("daemon", help="run in the background: XID watch, periodic checks, "
                            "Prometheus metrics, remediation (systemd Type=notify)")
    _common(daemon)
    daemon.add_argument("--suite", metavar="NAME|PATH",
                        help="periodic suite (default: daemon.suite, i.e. periodic)")
    daemon.add_argument("--listen", metavar="HOST:PORT",
                        help="metrics address (default: daemon.listen, 127.0.0.1:9847)")
    daemon.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    fleet = sub.add_parser("fleet", help="cross-node outliers, stragglers and hung jobs over "
                                         "many reports (exit 3 on suspects or hung jobs)")
    _common(fleet)
    fleet.add_argument("reports", metavar="REPORT.json|DIR", nargs="+")
    fleet.add_argument("--json", action="store_true", help="print the analysis as JSON")
    fleet.add_argument("--html", metavar="PATH", help="also write an HTML page of the "
                       "distributions with the outliers marked")
    fleet.add_argument("--topology", metavar="FILE",
                       help="YAML mapping parallel groups to node names; flags whole groups")
    remediation_cli.add_commands(sub, _common)
    sdc_command.add_parser(sub, _common)
    hang_command.add_parser(sub, _common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ReportFormatError, UsageError) as err:
        print(f"node-agent: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("node-agent: interrupted", file=sys.stderr)
        return EXIT_AGENT_FAILED
    except Exception as err:  # noqa: BLE001 - the contract's exit 1, one line unless debugging
        if os.environ.get("NODE_AGENT_DEBUG"):
            raise
        print(f"node-agent: internal error: {type(err).__name__}: {err} "
              "(set NODE_AGENT_DEBUG=1 for a traceback and report it)", file=sys.stderr)
        return EXIT_AGENT_FAILED


def cmd_inventory(args: argparse.Namespace) -> int:
    env = open_environment(load_config(args.config), args.simulate)
    try:
        inv = env.inventory
        if args.json:
            print(json.dumps(inv.to_dict(), indent=2))
            return EXIT_OK
        host = inv.host
        print(f"host {host.hostname}  kernel {host.kernel}  driver {host.driver or 'n/a'}  "
              f"CUDA {host.cuda or 'n/a'}  backend {host.gpu_backend}"
              f"{'  (SIMULATED)' if env.simulated else ''}")
        if env.gpu.unavailable_reason:
            print(f"no GPUs: {env.gpu.unavailable_reason}")
        print(f"SKU: {inv.sku.id if inv.sku else inv.sku_problem or 'none'}")
        for g in inv.gpus:
            print(f"  gpu:{g.index}  {g.name}  {g.pci_bus_id}  {g.uuid}  serial {g.serial or 'n/a'}"
                  f"  VBIOS {g.vbios or 'n/a'}")
        for index, error in sorted(inv.unreadable.items()):
            print(f"  gpu:{index}  UNREADABLE: {error}")
        return EXIT_OK
    finally:
        env.close()


def cmd_run_suite(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    suite = load_suite(args.suite, suites_dir(config))
    only = getattr(args, "only", None)
    if only:
        suite = suite.only([n.strip() for n in only.split(",") if n.strip()])
    check_outputs(args.html, args.junit)
    acting = remediation_cli.prepare(args, config)
    env = open_environment(config, args.simulate)
    try:
        out_dir, note = report_dir(env, args.out)
        report = execute(suite, env, progress=ProgressPrinter() if sys.stderr.isatty() else None)
        remediation_cli.act_on_report(acting, env, report)
        path = json_report.write(report, out_dir)
    finally:
        env.close()
    code = print_report(report, path, note, args.json,
                        lambda r: render_summary(r, colour=sys.stdout.isatty(),
                                                 verbose=args.verbose))
    write_outputs(report, args.html, args.junit)
    return code


def print_report(report: Report, path, note: str | None, as_json: bool, render) -> int:
    """The end of a run: the note, the report (JSON or ``render(report)``), where it was
    written; returns the contract's exit code for its grade."""
    if note:
        print(f"node-agent: note: {note}", file=sys.stderr)
    print(json_report.dumps(report) if as_json else render(report))
    print(f"report: {path}", file=sys.stderr)
    return EXIT_FOR_LEVEL[report.grade.level]


def run_and_report(env: Environment, suite, out: str | None, as_json: bool, render,
                   progress=None) -> int:
    """Run ``suite`` on ``env`` (closed afterwards), write the report and print it: the whole
    of a command that runs a suite and does not act on it (``sdc``, ``hang-check``)."""
    try:
        out_dir, note = report_dir(env, out)
        report = execute(suite, env, progress=progress)
        path = json_report.write(report, out_dir)
    finally:
        env.close()
    return print_report(report, path, note, as_json, render)


def execute(suite, env: Environment, progress=None) -> Report:
    """Run a suite against an environment and grade it: the whole path to a verdict."""
    started = utc_now()
    results = run_suite(suite, env, progress=progress)
    grade = env.grader.grade(results, suite.mode)
    return Report(host=env.inventory.host, gpus=env.inventory.gpus, suite=suite.name,
                  mode=suite.mode, started_at=started, finished_at=utc_now(), results=results,
                  grade=grade, simulated=env.simulated, agent_version=__version__,
                  sku=env.sku.id if env.sku else None)


def cmd_grade(args: argparse.Namespace) -> int:
    from .environment import load_data

    config = load_config(args.config)
    if args.simulate:
        raise UsageError("grade reads a saved report; --simulate does not apply")
    grader, _ = load_data(config)
    if args.rules or len(args.report) > 1 or os.path.isdir(args.report[0]):
        from . import regrade

        if args.html or args.junit:
            raise UsageError("--html/--junit write one report's page; name a single report")
        grader, label = regrade.rules_grader(args.rules, grader)
        worst, _ = regrade.run(args.report, grader, label, as_json=args.json)
        return EXIT_FOR_LEVEL[worst]
    check_outputs(args.html, args.junit)
    saved = json_report.read(args.report[0])
    regraded = grader.grade(saved.results, saved.mode)
    if regraded.level != saved.grade.level:
        print(f"node-agent: note: the saved grade was {saved.grade.level.name}; with the current "
              f"rules it is {regraded.level.name}", file=sys.stderr)
    saved.grade = regraded
    if args.json:
        print(json_report.dumps(saved))
    else:
        print(render_summary(saved, colour=sys.stdout.isatty()))
    write_outputs(saved, args.html, args.junit)
    return EXIT_FOR_LEVEL[regraded.level]


def cmd_fleet(args: argparse.Namespace) -> int:
    from . import fleet
    from .resources import graders_dir

    if args.simulate:
        raise UsageError("fleet reads saved reports; --simulate does not apply")
    return fleet.run(args.reports, graders_dir(load_config(args.config)), as_json=args.json,
                     html=args.html, topology=args.topology)


def cmd_daemon(args: argparse.Namespace) -> int:
    import logging

    try:
        from .daemon import Daemon
    except ImportError as err:
        raise UsageError(f"the daemon needs {err.name}: pip install 'node-agent[daemon]'") from err

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Daemon(args.config, args.simulate, suite=args.suite, listen=args.listen).run()


COMMANDS = {"inventory": cmd_inventory, "accept": cmd_run_suite, "check": cmd_run_suite,
            "grade": cmd_grade, "daemon": cmd_daemon, "fleet": cmd_fleet,
            "sdc": sdc_command.run, "hang-check": hang_command.run,
            **remediation_cli.COMMANDS}

if __name__ == "__main__":
    sys.exit(main())
