"""The ``node-agent`` command: parse arguments, call the library, print, exit with the contract's
code (0 healthy/warn, 3 ERROR, 4 FAULT, 2 usage or configuration error, 1 the agent failed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from . import __version__
from .config import load_config
from .environment import Environment, open_environment, report_dir
from .model import Level, Report, ReportFormatError, utc_now
from .report import json_report
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

    grade = sub.add_parser("grade", help="re-grade a saved report with the current rules")
    _common(grade)
    grade.add_argument("report", metavar="REPORT.json")
    grade.add_argument("--json", action="store_true", help="print the re-graded report as JSON")
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
    env = open_environment(config, args.simulate)
    try:
        out_dir, note = report_dir(env, args.out)
        report = execute(suite, env, progress=ProgressPrinter() if sys.stderr.isatty() else None)
        path = json_report.write(report, out_dir)
    finally:
        env.close()
    if note:
        print(f"node-agent: note: {note}", file=sys.stderr)
    if args.json:
        print(json_report.dumps(report))
    else:
        print(render_summary(report, colour=sys.stdout.isatty(), verbose=args.verbose))
    print(f"report: {path}", file=sys.stderr)
    return EXIT_FOR_LEVEL[report.grade.level]


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
    saved = json_report.read(args.report)
    regraded = grader.grade(saved.results, saved.mode)
    if regraded.level != saved.grade.level:
        print(f"node-agent: note: the saved grade was {saved.grade.level.name}; with the current "
              f"rules it is {regraded.level.name}", file=sys.stderr)
    saved.grade = regraded
    if args.json:
        print(json_report.dumps(saved))
    else:
        print(render_summary(saved, colour=sys.stdout.isatty()))
    return EXIT_FOR_LEVEL[regraded.level]


COMMANDS = {"inventory": cmd_inventory, "accept": cmd_run_suite, "check": cmd_run_suite,
            "grade": cmd_grade}

if __name__ == "__main__":
    sys.exit(main())
