"""``node-agent sdc [--gpus LIST] [--duration S] [--json]``: the SDC probes standalone.

It runs the ``sdc`` check (``node_agent.checks.sdc``: whole-GPU exact probes, digests,
Freivalds; ``docs/sdc.md``) as a one-check suite named ``sdc`` in
delivery mode, with the parameters of the ``sdc`` entry of the configured delivery suite (so an
operator's shapes and dtypes apply here too), on the chosen GPUs, repeating rounds until
``--duration`` seconds have passed. The report is a normal report (written like ``accept``'s);
the exit code follows the contract: 0 healthy or warn, 4 FAULT (confirmed SDC), 3 ERROR (a
probe could not run), 2 usage errors (``--gpus 9`` on an 8-GPU node, a malformed list).

``commands.main`` only wires the sub-command to :func:`add_parser` and :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from node_agent.config import Config
from node_agent.report.terminal import printable
from node_agent.suite import CheckSpec, Suite, load_suite
from node_agent.yamlfile import ConfigError

DEFAULT_DURATION_S = 60.0
#: the runner abandons the check this long after the duration (goldens, first round, re-runs)
TIMEOUT_MARGIN_S = 300.0


def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("sdc", help="run the silent-data-corruption probes standalone")
    common(p)
    p.add_argument(
        "--gpus", metavar="LIST", help="GPU indices to probe, e.g. 0,6 or 0-3 (default: all GPUs)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        metavar="S",
        help=f"seconds to keep probing, in rounds (default {DEFAULT_DURATION_S:g})",
    )
    p.add_argument("--json", action="store_true", help="print the report alone on stdout")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="directory for the JSON report (default: <state_dir>/reports, or a temp dir)",
    )


def parse_gpu_list(text: str, present: list[int], node_gpus: int) -> list[int]:
    """``"0,6"`` or ``"0-3,6"`` -> sorted indices; ValueError with a clear message when the
    list is malformed or names a GPU the node does not have (``present``: the GPUs visible)."""
    chosen: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if a > b or a < 0:
                    raise ValueError
                chosen.update(range(a, b + 1))
            else:
                if int(part) < 0:
                    raise ValueError
                chosen.add(int(part))
        except ValueError:
            raise ValueError(
                f"--gpus {text!r}: {part!r} is not a GPU index or range; expected "
                "a comma-separated list such as 0,6 or 0-3"
            ) from None
    absent = sorted(chosen - set(present))
    if absent:
        have = ", ".join(map(str, present)) or "none"
        why = (
            ""
            if all(i < node_gpus for i in absent)
            else f"; the node has {node_gpus} GPU(s), indices 0..{node_gpus - 1}"
        )
        raise ValueError(
            f"--gpus {text!r}: GPU {', '.join(map(str, absent))} not present"
            f"{why}; visible GPUs: {have}"
        )
    return sorted(chosen)


def build_suite(
    config: Config, suites_dir: Any, gpus: list[int] | None, duration_s: float
) -> Suite:
    """A one-check suite ``sdc`` from the delivery suite's ``sdc`` entry (or the defaults)."""
    base: CheckSpec | None = None
    try:
        delivery = load_suite("delivery", suites_dir)
        base = next((c for c in delivery.checks if c.check == "sdc"), None)
    except ConfigError:
        base = None  # an operator's suites dir without a delivery suite: the check's defaults
    params: dict[str, Any] = dict(base.params) if base else {}
    simulated = dict(params.get("simulated") or {})
    for p in (params, simulated):
        p["duration_s"] = duration_s
        if gpus is not None:
            p["gpus"] = gpus
    params["simulated"] = simulated
    timeout = duration_s + max(TIMEOUT_MARGIN_S, base.timeout_s if base else 0.0)
    return Suite(
        name="sdc",
        mode="delivery",
        checks=(CheckSpec("sdc", timeout, params),),
        source=f"node-agent sdc (params from {base and 'delivery suite' or 'defaults'})",
        description="SDC probes, standalone",
    )


def run(args: argparse.Namespace) -> int:
    """The ``sdc`` sub-command (called by ``cli.main``, which maps exceptions to exit codes).

    Usage errors raise ``ConfigError`` (exit 2, one line): it is the one usage exception that
    is the same class whether cli runs as ``node_agent.commands.main`` or as ``python -m``'s __main__."""
    from node_agent.commands.reporting import run_and_report
    from node_agent.config import load_config
    from node_agent.environment import open_environment
    from node_agent.report.terminal import ProgressPrinter
    from node_agent.resources import suites_dir

    if not args.duration > 0:
        raise ConfigError(f"--duration {args.duration:g}: expected a positive number of seconds")
    config = load_config(args.config)
    env = open_environment(config, args.simulate)
    try:
        gpus = None
        if args.gpus is not None:
            present = [g.index for g in env.inventory.gpus]
            if not present and not env.simulated:
                why = env.gpu.unavailable_reason or "the GPU backend lists none"
                raise ConfigError(
                    f"--gpus {args.gpus}: no GPUs visible on this host ({why}); "
                    "use --simulate SCENARIO to run the probes on a simulated node"
                )
            node_gpus = env.node.declared_gpus or env.expected_gpus or len(present)
            try:
                gpus = parse_gpu_list(args.gpus, present, max(node_gpus, len(present)))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        suite = build_suite(config, suites_dir(config), gpus, args.duration)
    except BaseException:
        env.close()
        raise
    return run_and_report(
        env,
        suite,
        args.out,
        args.json,
        render_counts,
        progress=ProgressPrinter() if sys.stderr.isatty() else None,
    )


def render_counts(report: Any) -> str:
    """Verdict counts per GPU and the share of its SMs the exact probes reached
    (``sm_coverage``), then the grade and its reasons (plain text)."""
    lines = [
        f"SDC probes on {report.host.hostname}" + ("  (SIMULATED)" if report.simulated else ""),
        f"{'GPU':<8}{'pass':>8}{'transient':>11}{'confirmed':>11}{'error':>7}{'SMs':>6}  result",
    ]
    for r in report.results:
        counts = r.evidence.get("counts")
        if counts is None:
            lines.append(f"{r.target:<8}{'':>43}  {r.status.value}: {r.detail}")
            continue
        cov = r.evidence.get("sm_coverage")
        sms = f"{cov:.0%}" if isinstance(cov, (int, float)) else "-"
        lines.append(
            f"{r.target:<8}{counts['pass']:>8}{counts['transient']:>11}"
            f"{counts['confirmed']:>11}{counts['error']:>7}{sms:>6}  {r.status.value}"
            f" ({r.metric})"
        )
    g = report.grade
    lines.append(f"grade: {g.level.name} (action {g.action.value})")
    lines += [f"  {r.level.name} {r.target} [{r.rule}] {r.message}" for r in g.reasons]
    return "\n".join(printable(line) for line in lines)
