"""``node-agent stop-check``: one rank per node of a stopped job; name the bad machine.

Run it over the job's nodes between attempts (torchrun, ``srun``, a Kubernetes indexed Job):
each rank joins the others, runs the phases (docs/stop_check.md) and grades its own node from
its share; rank 0 writes ``stop-check.json`` with the suspects and, with ``--topology``, the
parallel groups to evict. ``--act`` drains a suspect through the normal remediation and its
guards, like any other grade.

Ranks believe each other only under the job's key (``--key-file``,
:mod:`node_agent.stopcheck.signed`): a rank that cannot verify a peer stops every rank it can
with exit 2 and one line, and nothing is written, named or drained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node_agent import __version__, atomic_file
from node_agent.commands import act
from node_agent.commands.reporting import EXIT_FOR_LEVEL, EXIT_USAGE, execute
from node_agent.config import Config, load_config
from node_agent.environment import Environment, open_environment, report_dir, stand_in_hostname
from node_agent.model import Report, Result, Status, utc_iso
from node_agent.report import json_report
from node_agent.report.build import build_report
from node_agent.report.terminal import printable, render_summary
from node_agent.resources import suites_dir
from node_agent.stopcheck import localise, phases, ranks, signed
from node_agent.suite import Suite, load_suite
from node_agent.yamlfile import ConfigError

#: each parallel group's name -> its nodes (``node_agent.fleet.topology.load_topology``)
Topology = dict[str, list[str]]

SCHEMA = "node-agent.stop-check/1"
CHECK = "stop_check"
DEFAULT_ROUNDS = 8
PHASE_ORDER = ("self", "intra_node", "neighbours", "alignment", "replay")


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser(
        "stop-check",
        help="one rank per node of a stopped job: find the bad "
        "machine before it restarts (docs/stop_check.md)",
    )
    common(p)
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where rank 0 writes stop-check.json and each "
        "rank its node's report (default: <state_dir>/reports)",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="also the dual-phase replay, for intermittent corruption",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="R",
        help=f"replay rounds (default {DEFAULT_ROUNDS})",
    )
    p.add_argument(
        "--topology",
        metavar="FILE",
        help="parallel groups (the fleet topology "
        "format): suspects are widened to their groups in 'evict'",
    )
    p.add_argument(
        "--join-timeout-s",
        type=float,
        default=120.0,
        metavar="S",
        help="how long rank 0 waits for every rank to join (default 120)",
    )
    p.add_argument(
        "--phase-timeout-s",
        type=float,
        default=300.0,
        metavar="S",
        help="a collective that takes longer fails its phase (default 300)",
    )
    p.add_argument(
        "--key-file",
        metavar="PATH",
        help="the job's key (required): 64 hex characters, mode 0600, owned by you or root; "
        "every message between ranks is signed with it",
    )
    p.add_argument("--json", action="store_true", help="print this node's report alone")
    act.add_act_options(p)


def _scenario_for(pattern: str | None, rank: int) -> str | None:
    if pattern is None:
        return None
    path = pattern.replace("{rank}", str(rank))
    if not Path(path).is_file():
        raise ConfigError(
            f"--simulate {pattern}: no scenario for rank {rank} ({path} does not exist)"
        )
    return path


def cmd_stop_check(args: argparse.Namespace) -> int:
    if not args.key_file:
        raise ConfigError(
            "stop-check needs --key-file PATH, the job's key that every rank holds "
            "(umask 077; openssl rand -hex 32 > PATH; see docs/stop_check.md)"
        )
    key = signed.load_key(args.key_file)
    place = ranks.place_from_env()
    # torch's C++ side logs a page of stack frames for a store connection refused, timed out or
    # closed (a stranger's store going away); the rank's one line on stderr says what happened
    if not os.environ.get("NODE_AGENT_DEBUG"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if args.rounds < 1:
        raise ConfigError("--rounds must be at least 1")
    config = load_config(args.config)
    topology = None
    if args.topology:
        from node_agent.fleet.analysis import load_topology

        topology = load_topology(args.topology)
    simulate = _scenario_for(args.simulate, place.rank)
    quick = load_suite("quick", suites_dir(config))
    acting = act.prepare(args, config)
    env = open_environment(config, simulate)
    try:
        return _run(args, place, key, config, env, quick, acting, topology)
    except signed.PeerUnverified as err:
        print(
            f"node-agent stop-check: rank {place.rank} stops: {printable(str(err))[:300]}; "
            "nothing named or drained",
            file=sys.stderr,
        )
        return EXIT_USAGE
    finally:
        env.close()


def _node_name(config: Config, env: Environment) -> str:
    """The scheduler's name for this node: ``node.name``, ``$NODE_AGENT_NODE_NAME``, else the
    node's own (a stand-in's, or this host's short hostname)."""
    from node_agent.config import configured_node_name

    return configured_node_name(config) or str(env.hostname)


def _devices(env: Environment) -> tuple[list[Any], str | None]:
    from node_agent.compute.devices import ComputeUnavailable, open_device

    indices = [g.index for g in env.inventory.gpus]
    if not indices:
        return [], "no GPU on this node"
    try:
        return [open_device(s) for s in env.ports.compute.specs(indices)], None
    except ComputeUnavailable as err:
        return [], str(err)


def _run(
    args: argparse.Namespace,
    place: ranks.Place,
    key: bytes,
    config: Config,
    env: Environment,
    quick: Suite,
    acting: act.Acting | None,
    topology: Topology | None,
) -> int:
    started = utc_iso()
    node = _node_name(config, env)
    devices, no_compute = _devices(env)
    import torch

    from node_agent.stopcheck.reference import deterministic

    deterministic()
    backend = "nccl" if devices and not devices[0].simulated else "gloo"
    try:
        store = ranks.open_store(place, args.join_timeout_s)
        joined = ranks.join(store, place, node, key, args.join_timeout_s)
    except (RuntimeError, OSError) as err:
        first = printable(str(err)).strip().splitlines()[:1] or [type(err).__name__]
        print(
            f"node-agent stop-check: rank {place.rank} could not verify rank 0 at "
            f"{place.master_addr}:{place.master_port} ({first[0][:160]}): nothing named",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if joined.missing:
        return _not_all_joined(args, env, place, joined, topology, started)
    ranks.init_group(joined.store, place, key, joined.session, backend, args.phase_timeout_s)
    stack = _stack(env, torch.__version__)
    where = devices[0].device if backend == "nccl" else "cpu"
    side = phases.NodeSide(
        place,
        node,
        joined.nodes,
        signed.Exchange(key, joined.session, place.rank, place.world_size, where),
        devices,
        stack,
        quick_report=lambda: execute(quick, env),
        slow_link=env.node.inter_node_speed,
        backend=backend,
    )
    try:
        outcomes = _phases(args, side, no_compute)
    except signed.PeerUnverified:
        import torch.distributed as dist

        dist.destroy_process_group()
        raise
    suspects = [s for o in outcomes.values() for s in o.suspects]
    if place.rank == 0:
        path = _write_summary(args, env, place, joined.nodes, outcomes, suspects, topology, started)
        print(f"stop-check: {len(suspects)} suspect(s); {path}", file=sys.stderr)
    report = _node_report(env, node, outcomes, started, no_compute)
    act.act_on_report(acting, env, report)
    out_dir, note = report_dir(env, args.out)
    path = json_report.write(report, out_dir)
    _leave(side)
    if note:
        print(f"node-agent: note: {note}", file=sys.stderr)
    print(
        json_report.dumps(report)
        if args.json
        else render_summary(report, colour=sys.stdout.isatty())
    )
    print(f"report: {path}", file=sys.stderr)
    return EXIT_FOR_LEVEL[report.grade.level]


def _not_all_joined(
    args: argparse.Namespace,
    env: Environment,
    place: ranks.Place,
    joined: ranks.Joined,
    topology: Topology | None,
    started: str,
) -> int:
    """Some ranks never joined: rank 0 names them (their nodes where known) and every rank
    stops with exit 2, before any collective could hang on them."""
    names = ", ".join(f"rank {r}" for r in joined.missing)
    if place.rank != 0:
        print(f"node-agent stop-check: {names} did not join; rank 0 names them", file=sys.stderr)
        return EXIT_USAGE
    suspects = [
        localise.Suspect(
            _missing_node(args.simulate, r, env),
            "join",
            evidence={"rank": r, "did_not_join": True, "waited_s": args.join_timeout_s},
        )
        for r in joined.missing
    ]
    path = _write_summary(
        args,
        env,
        place,
        joined.nodes,
        {},
        suspects,
        topology,
        started,
        note=f"{names} did not join",
    )
    print(
        f"node-agent stop-check: {names} did not join within {args.join_timeout_s:g} s; "
        f"named as suspects in {path}",
        file=sys.stderr,
    )
    return EXIT_USAGE


def _missing_node(pattern: str | None, rank: int, env: Environment) -> str:
    """A rank that never joined, by its node's name where it can be known (its scenario when
    simulated), else ``rank:N``."""
    if pattern:
        try:
            return stand_in_hostname(env.config, pattern.replace("{rank}", str(rank)))
        except ConfigError:
            pass
    return f"rank:{rank}"


def _leave(side: phases.NodeSide) -> None:
    """Wait for every rank to have written its report before any exits: a launcher (torchrun)
    stops the other ranks when one exits non-zero, as a node graded ERROR does."""
    import torch.distributed as dist

    try:
        dist.barrier()
    except Exception as err:  # noqa: BLE001 - a rank already gone: nothing left to wait for
        print(
            f"node-agent stop-check: rank {side.place.rank}: the final barrier failed "
            f"({type(err).__name__}); leaving",
            file=sys.stderr,
        )
    dist.destroy_process_group()


def _stack(env: Any, torch_version: str) -> str:
    names = sorted({g.name for g in env.inventory.gpus})
    host = env.inventory.host
    return (
        f"{env.sku.id if env.sku else 'unknown-sku'}|{','.join(names)}|driver "
        f"{host.driver}|cuda {host.cuda}|torch {torch_version}"
    )


def _phases(
    args: argparse.Namespace, side: phases.NodeSide, no_compute: str | None
) -> dict[str, phases.PhaseOutcome]:
    out: dict[str, phases.PhaseOutcome] = {}
    # whether every node can compute decides the compute phases for all ranks alike
    can = side.exchange.gather("can", {"no_compute": no_compute}, {"no_compute": signed.Maybe(str)})
    cannot = {side.nodes[r]: c["no_compute"] for r, c in enumerate(can) if c["no_compute"]}
    Phase = Callable[[phases.NodeSide], phases.PhaseOutcome]
    plan: list[tuple[str, Phase]] = [("self", phases.phase_self)]
    compute: list[tuple[str, Phase]] = [
        ("intra_node", phases.phase_intra_node),
        ("neighbours", phases.phase_neighbours),
        ("alignment", phases.phase_alignment),
    ]
    if args.replay:
        compute.append(("replay", lambda s: phases.phase_replay(s, args.rounds)))
    for name, fn in plan + compute:
        if cannot and name in ("intra_node", "alignment", "replay"):
            out[name] = phases.PhaseOutcome(
                name,
                skipped="no compute on "
                + "; ".join(f"{n}: {why}" for n, why in sorted(cannot.items())),
            )
            continue
        out[name] = phases.run_phase(name, fn, side)
        if out[name].error:
            break
    if not args.replay:
        out["replay"] = phases.PhaseOutcome("replay", skipped="not asked (--replay)")
    return out


def _write_summary(
    args: argparse.Namespace,
    env: Environment,
    place: ranks.Place,
    nodes: dict[int, str],
    outcomes: dict[str, phases.PhaseOutcome],
    suspects: list[localise.Suspect],
    topology: Topology | None,
    started: str,
    note: str | None = None,
) -> Path:
    out_dir, _ = report_dir(env, args.out)
    data = {
        "schema": SCHEMA,
        "agent_version": __version__,
        "started_at": started,
        "finished_at": utc_iso(),
        "world_size": place.world_size,
        "nodes": {str(r): n for r, n in sorted(nodes.items())},
        "phases": {name: o.to_dict() for name, o in outcomes.items()},
        "suspects": [s.to_dict() for s in suspects],
        "evict": localise.evict(suspects, topology),
    }
    if note:
        data["note"] = note
    path = out_dir / "stop-check.json"
    atomic_file.write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def _node_report(
    env: Any,
    node: str,
    outcomes: dict[str, phases.PhaseOutcome],
    started: str,
    no_compute: str | None = None,
) -> Report:
    """This node's share as a report the normal grading and remediation act on. A node whose
    GPUs could not compute (``no_compute``: why) was compared with nothing: a WARN says so, so
    that it is never HEALTHY on the strength of phases it did not run."""
    results: list[Result] = []
    self_phase = outcomes.get("self")
    if self_phase is not None and self_phase.report is not None:
        results.extend(self_phase.report.results)
    for name in PHASE_ORDER:
        results.extend(_phase_results(name, outcomes.get(name), node))
    if no_compute is not None:
        results.append(
            Result(
                CHECK,
                "node",
                f"{CHECK}_compute",
                Status.WARN,
                f"this node's GPUs could not compute here ({no_compute}), so its GPUs were "
                "compared with no other node's; the compute phases were skipped on every node",
            )
        )
    grade = env.grader.grade(results, "service")
    return build_report(env, "stop-check", "service", started, results, grade)


def _phase_results(name: str, outcome: phases.PhaseOutcome | None, node: str) -> list[Result]:
    """One phase's results for this node: skipped, broken, a fail per suspect here, or a pass."""
    metric = f"{CHECK}_{name}"
    if outcome is None:
        why = "not run: an earlier phase broke the job's process group"
        return [Result(CHECK, "node", metric, Status.SKIP, why)]
    took = outcome.duration_s
    if outcome.error:
        why = f"the {name} phase broke: {outcome.error}"
        return [Result(CHECK, "node", metric, Status.ERROR, why, duration_s=took)]
    if outcome.skipped:
        return [Result(CHECK, "node", metric, Status.SKIP, outcome.skipped, duration_s=took)]
    if name == "self":  # the quick suite's own results grade this node already
        return []
    mine = [s for s in outcome.suspects if s.node == node]
    unresolved = _unresolved_wrong_data(outcome, node)
    if not mine and unresolved:
        return [
            Result(
                CHECK,
                "node",
                metric,
                Status.WARN,
                f"data between {', '.join(unresolved)} arrived wrong, and a second pairing "
                "could not tell which end spoilt it (fewer than three ranks, or it did not "
                "recur): neither end is evicted; run stop-check again, or the delivery suite's "
                "RDMA and SDC checks on both",
                evidence={
                    "wrong_elements": {k: outcome.figures["wrong_elements"][k] for k in unresolved}
                },
                duration_s=took,
            )
        ]
    if not mine:
        others = sorted({s.node for s in outcome.suspects})
        said = f"the {name} phase named no fault here" + (
            f" (it named {', '.join(others)})" if others else ""
        )
        return [Result(CHECK, "node", metric, Status.PASS, said, duration_s=took)]
    return [
        Result(
            CHECK,
            f"gpu:{s.gpu}" if s.gpu is not None else "node",
            metric,
            Status.FAIL,
            _sentence(name, s),
            evidence=s.to_dict(),
            duration_s=took,
        )
        for s in mine
    ]


def _unresolved_wrong_data(outcome: phases.PhaseOutcome, node: str) -> list[str]:
    """The transfers touching ``node`` whose data arrived wrong (``"a->b"``) and neither end of
    which the phase named: the data was spoilt, by one of the two, and nobody can say which."""
    named = {s.node for s in outcome.suspects}
    return [
        pair
        for pair in sorted(outcome.figures.get("wrong_elements") or {})
        if node in pair.split("->") and not named & set(pair.split("->"))
    ]


def _sentence(phase: str, s: localise.Suspect) -> str:
    where = f"gpu {s.gpu}" if s.gpu is not None else "this node"
    return {
        "intra_node": f"{where}: a copy between this node's GPUs came out wrong or slow",
        "neighbours": "both of this node's ring-neighbour links are slow (or its data arrived "
        "wrong), while its neighbours' other links are not",
        "alignment": f"{where} computed the reference step differently from the majority of "
        "like GPUs in the job (silent data corruption suspected)",
        "replay": "this node sits where disagreeing groups of the replay cross (intermittent "
        f"corruption suspected; named in rounds {s.evidence.get('rounds_named')})",
    }.get(phase, f"named by the {phase} phase")
