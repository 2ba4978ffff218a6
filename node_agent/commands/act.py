"""The remediation side of the ``node-agent`` command: ``act``, ``status``, ``set-healthy``,
``breaker reset``, ``optout`` and ``--act``/``--adapter``/``--dry-run`` on ``accept``/``check``.

``commands.main`` only wires these in; the logic lives in
:mod:`node_agent.remediation.executor` and friends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from node_agent.commands.reporting import EXIT_AGENT_FAILED, EXIT_OK, EXIT_USAGE
from node_agent.config import Config, load_config
from node_agent.environment import Environment
from node_agent.model import ActionOutcome, Grade, Report, utc_iso
from node_agent.remediation.executor import Outcome
from node_agent.remediation.guards import sanitise_operator_text
from node_agent.remediation.host import (
    node_name,
    open_configured_adapter,
    open_remediator,
)
from node_agent.remediation.plan import (
    REMEDIATION_ACTIONS,
    REMEDIATIONS_CODE,
    NodeState,
    Safety,
    remediation_window_start,
    restart_window_start,
)
from node_agent.remediation.store import NodeRecord, StateUnavailable, Store, open_store
from node_agent.report.terminal import printable
from node_agent.schedulers import ADAPTER_NAMES, SchedulerAdapter
from node_agent.yamlfile import ConfigError

OPERATOR_ACTIONS = ("drain", "resume", "restart", "replace")


def add_act_options(parser: argparse.ArgumentParser) -> None:
    """``--act``, ``--adapter``, ``--dry-run`` for ``accept`` and ``check``."""
    parser.add_argument(
        "--act",
        action="store_true",
        help="after grading, remediate through the scheduler adapter "
        "(drain/restart/replace, with the safety guards)",
    )
    _adapter_options(parser)


def _adapter_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter",
        choices=ADAPTER_NAMES,
        metavar="NAME",
        help=f"scheduler adapter ({', '.join(ADAPTER_NAMES)}; default: "
        "adapter.name from the config)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="record what would be done (outcome dry-run), change nothing",
    )


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], object],
) -> None:
    """Add ``act``, ``status``, ``set-healthy``, ``breaker`` and ``optout`` to the parser."""
    act = sub.add_parser("act", help="drain/resume/restart/replace this node now (operator)")
    common(act)
    act.add_argument("action", choices=OPERATOR_ACTIONS)
    act.add_argument(
        "--reason",
        metavar="TEXT",
        help="why (printable, one line, "
        "at most 160 characters; stored after the node-agent: prefix)",
    )
    _adapter_options(act)

    status = sub.add_parser("status", help="remediation state, last grade, journal, breaker")
    common(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--limit", type=int, default=10, help="journal rows to show")

    healthy = sub.add_parser(
        "set-healthy", help="after a repair: clear the node's remediation state and restart counts"
    )
    common(healthy)
    healthy.add_argument("--reason", metavar="TEXT", help="what was repaired")

    breaker = sub.add_parser("breaker", help="the circuit breaker of automatic actions")
    common(breaker)
    breaker.add_argument("op", choices=("reset",), help="reset: close it, automatic actions resume")

    optout = sub.add_parser("optout", help="opt this node out of automatic actions (on|off)")
    common(optout)
    optout.add_argument("switch", choices=("on", "off"))
    optout.add_argument("--reason", metavar="TEXT")


# -- accept/check --act ----------------------------------------------------------------------
@dataclass
class Acting:
    config: Config
    adapter: SchedulerAdapter
    store: Store
    dry_run: bool


def prepare(args: argparse.Namespace, config: Config) -> Acting | None:
    """Before the suite runs: open the adapter and store for ``--act`` (ConfigError: exit 2)."""
    if not getattr(args, "act", False):
        if getattr(args, "dry_run", False) or getattr(args, "adapter", None):
            raise ConfigError(
                "--adapter and --dry-run apply only with --act "
                "(add --act to remediate after grading)"
            )
        return None
    adapter = open_configured_adapter(config, args.adapter)
    return Acting(
        config,
        adapter,
        open_store(config.state_dir),
        bool(args.dry_run) or config.adapter.dry_run,
    )


def act_on_report(acting: Acting | None, env: Environment, report: Report) -> None:
    """Remediate after grading; the ActionRecords go into ``report.actions`` before it is
    written. Retests run the quick suite against the same environment."""
    if acting is None:
        return
    from node_agent.resources import suites_dir
    from node_agent.runner import run_suite
    from node_agent.suite import load_suite

    def retest() -> Grade:
        quick = load_suite("quick", suites_dir(acting.config))
        return env.grader.grade(run_suite(quick, env), quick.mode)

    try:
        remediator = open_remediator(
            env,
            acting.config,
            acting.store,
            acting.adapter,
            report.host.hostname,
            dry_run=acting.dry_run,
            retest=retest,
        )
        outcome = remediator.remediate(report)
    finally:
        acting.store.close()
    report.actions.extend(outcome.records)
    for note in outcome.notes:
        if note:
            print(f"node-agent: remediation: {note}", file=sys.stderr)


# -- commands ---------------------------------------------------------------------------------
def cmd_act(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    node = _node_name(config, args.simulate)
    adapter = open_configured_adapter(config, args.adapter)
    text = sanitise_operator_text(args.reason)
    store = open_store(config.state_dir)
    try:
        remediator = open_remediator(
            None,
            config,
            store,
            adapter,
            node,
            simulated=bool(args.simulate),
            dry_run=bool(args.dry_run),
        )
        outcome = remediator.act(args.action, text)
    finally:
        store.close()
    for rec in outcome.records:
        print(printable(f"{rec.action}: {rec.outcome}: {rec.detail}"))
    return _exit_for(outcome)


def _node_name(config: Config, simulate: str | None) -> str:
    """The node an operator's command is about: ``node.name`` (or ``NODE_AGENT_NODE_NAME``),
    else the simulated node's host name (its scenario's) under ``--simulate``, else this
    host's short name. These commands open no environment, so the scenario is read here."""
    if not simulate:
        return node_name(config)
    from node_agent.environment import load_data
    from node_agent.sim.scenario import load_scenario

    _, skus = load_data(config)
    return node_name(config, host=str(load_scenario(simulate, skus).hostname))


def cmd_status(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    node = _node_name(config, args.simulate)
    store = open_store(config.state_dir)
    try:
        try:
            data = status_data(store, node, config, args.limit)
        except StateUnavailable as err:  # not even a read-only look: say so, in one line
            print(
                f"node-agent: state unavailable: {err}; automatic actions are refused",
                file=sys.stderr,
            )
            return EXIT_AGENT_FAILED
    finally:
        store.close()
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    rec, last, br = data["remediation"], data["last_run"], data["breaker"]
    out = _print_escaped  # what follows may hold text a training job wrote
    out(
        f"node {node}: {rec['state']} since {_iso(rec['since'])}"
        + (
            f"  ({rec['fault_code']} {rec['target']}, by {rec['trigger']})"
            if rec["fault_code"]
            else ""
        )
    )
    if last:
        why = ", ".join(f"{r['rule']} {r['target']}" for r in last["reasons"][:3])
        out(
            f"last grade: {last['level']} ({last['suite']} at {_iso(last['at'])})"
            + (f": {why}" if why else "")
        )
    else:
        out("last grade: none recorded (runs are recorded with --act)")
    out(
        "breaker: "
        + (
            f"OPEN since {_iso(br['opened_at'])}: {br['reason']}; reset with "
            "`node-agent breaker reset`"
            if br["open"]
            else "closed"
        )
    )
    out(f"opt-out: {data['opt_out'] or 'no'}")
    hist = data["history"]
    out(
        f"remediations in 7 days: {hist['remediations_7d']} of "
        f"safety.max_remediations_7d={hist['max_remediations_7d']}"
        + (" (HELD for an operator: no further restart)" if hist["held"] else "")
    )
    if hist["hold"]:
        out(f"hold: {hist['hold']}")
    restarts = ", ".join(
        f"{code} {n} of {hist['restart_limits'].get(code, '?')}"
        for code, n in hist["restarts_per_code"].items()
    )
    out(f"restarts per fault code in {hist['restart_window_h']:g} h: {restarts or 'none'}")
    out(f"journal (last {len(data['journal'])}):")
    for row in data["journal"]:
        out(
            f"  #{row['id']:<4} {_iso(row['updated_at'])}  {row['action']:<9} "
            f"{row['state']:<8} {row['trigger']:<8} {row['fault_code'] or '-'} "
            f"{row['target'] or '-'}  {row['detail'][:120]}"
        )
    out(
        f"state: {data['database'] or 'none readable'}"
        + (
            f" (UNAVAILABLE: {data['unavailable']}; automatic actions are refused)"
            if data["unavailable"]
            else ""
        )
    )
    return EXIT_OK


def status_data(
    store: Store, node: str, config: Config, limit: int = 10, now: float | None = None
) -> dict[str, Any]:
    last = store.last_run(node)
    br = store.breaker()
    record = store.node_record(node)
    return {
        "node": node,
        "remediation": record.to_dict(),
        "history": _history(store, record, config.safety, time.time() if now is None else now),
        "last_run": last.__dict__ if last else None,
        "breaker": br.__dict__,
        "opt_out": ("config safety.opt_out" if config.safety.opt_out else store.opted_out(node)),
        "journal": [r.to_dict() for r in store.journal_tail(node, limit)],
        "database": str(store.path) if store.path else None,
        "unavailable": store.unavailable,
        "notes": store.notes,
    }


def cmd_set_healthy(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    node = _node_name(config, args.simulate)
    text = sanitise_operator_text(args.reason) or "set-healthy by an operator"
    store = open_store(config.state_dir)
    try:
        before = store.node_record(node)
        store.clear_node(node, time.time(), text)
    except StateUnavailable as err:
        return _unavailable("set-healthy", err)
    finally:
        store.close()
    from node_agent.checks.sdc_spool import clear_standing

    try:
        sdc = clear_standing(config.state_dir)
    except OSError as err:
        sdc = 0
        print(
            f"node-agent: WARNING: cannot clear the standing SDC faults in "
            f"{config.state_dir}: {err.strerror or err}",
            file=sys.stderr,
        )
    print(
        f"node {node}: {before.state} -> in-service; restart counts and fault history "
        f"cleared ({text})" + (f"; {sdc} standing SDC finding(s) cleared" if sdc else "")
    )
    if before.state is not NodeState.IN_SERVICE:
        print(
            "the node may still be drained in the scheduler: run `node-agent act resume` "
            "to return it to service"
        )
    return EXIT_OK


def cmd_breaker(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    store = open_store(config.state_dir)
    try:
        before = store.reset_breaker(time.time())
    except StateUnavailable as err:
        return _unavailable("breaker reset", err)
    finally:
        store.close()
    print(
        "breaker reset: "
        + (
            f"was open since {_iso(before.opened_at)} ({before.reason}); "
            if before.open
            else "was already closed; "
        )
        + "automatic actions are allowed again"
    )
    return EXIT_OK


def cmd_optout(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    node = _node_name(config, args.simulate)
    store = open_store(config.state_dir)
    try:
        store.set_opt_out(
            node, args.switch == "on", time.time(), sanitise_operator_text(args.reason)
        )
    except StateUnavailable as err:
        return _unavailable(f"optout {args.switch}", err)
    finally:
        store.close()
    print(f"node {node}: automatic actions " + ("off (opted out)" if args.switch == "on" else "on"))
    return EXIT_OK


def _history(store: Store, record: NodeRecord, safety: Safety, now: float) -> dict[str, Any]:
    """What the escalation and the 7-day hold count: the automatic restarts of the node in 7
    days, the restarts per fault code in ``safety.restart_window_h`` with each code's limit
    (``restarts_before_fault`` on the code's newest graded reason in the window, else
    ``safety.max_restarts``), and the hold, if the node is held for an operator."""
    since = restart_window_start(record, safety, now)
    per_code = store.done_by_code(record.node, REMEDIATION_ACTIONS, since)
    limits: dict[str, int] = {code: safety.max_restarts for code in per_code}
    for run in store.runs_since(record.node, since):  # oldest first: the newest reason wins
        for reason in run.reasons:
            code, rbf = reason.get("code"), reason.get("restarts_before_fault")
            key = f"{reason.get('rule')}-{code}"
            if isinstance(code, int) and isinstance(rbf, int) and key in limits:
                limits[key] = rbf
    held = record.state is NodeState.NEEDS_OPERATOR
    hold = None
    if held:
        why = (
            "restarted too often in 7 days"
            if record.fault_code == REMEDIATIONS_CODE
            else "restarts spent on a software cause"
        )
        hold = (
            f"needs-operator since {_iso(record.since)}: {why} ({record.fault_code} "
            f"{record.target}); fix the cause, then `node-agent set-healthy` and "
            "`node-agent act resume`"
        )
    return {
        "remediations_7d": store.count_done(
            record.node, REMEDIATION_ACTIONS, remediation_window_start(record, now), trigger="auto"
        ),
        "max_remediations_7d": safety.max_remediations_7d,
        "restarts_per_code": per_code,
        "restart_limits": limits,
        "restart_window_h": safety.restart_window_h,
        "held": held and record.fault_code == REMEDIATIONS_CODE,
        "hold": hold,
    }


# -- helpers ----------------------------------------------------------------------------------
def _print_escaped(text: str = "") -> None:
    """One line for the terminal: targets, reasons and details may hold text a training job
    wrote (a job id, a spool file name); its control characters are escaped."""
    sys.stdout.write(printable(text) + "\n")


def _unavailable(what: str, err: StateUnavailable) -> int:
    print(
        f"node-agent: {what} not done: state unavailable: {err}; fix the state directory "
        "(disk space, permissions, mount) and run it again",
        file=sys.stderr,
    )
    return EXIT_AGENT_FAILED


def _exit_for(outcome: Outcome) -> int:
    worst = outcome.worst
    if worst is ActionOutcome.FAILED:
        return EXIT_AGENT_FAILED
    return EXIT_USAGE if worst is ActionOutcome.REFUSED else EXIT_OK


def _iso(epoch: float | None) -> str:
    """A time for ``status``: ISO-8601 UTC, or ``-`` for none."""
    return "-" if epoch is None else utc_iso(epoch)
