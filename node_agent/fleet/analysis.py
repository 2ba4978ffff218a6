"""Cross-node outliers: many nodes' reports in, a ranked list of suspect GPUs and nodes out.

A node that passes every absolute minimum but is 12% slower than its siblings in the fleet sets
the pace of every synchronous job it joins; only a comparison across nodes finds it. For each
SKU and each (check, metric, target kind) the fleet's figures are pooled — every GPU of every
node for per-GPU metrics, every node for node-level ones — and a figure is a suspect when it
lies on the bad side of the median by more than ``deviation_mads`` robust standard deviations
(``graders/fleet.yaml`` documents the statistic and its defaults).

The reports are read by :mod:`node_agent.fleet.reports` (each parsed once, its figures kept; an
unreadable file listed with the reason, one not believed skipped), and the trays of each NVLink
domain graded as one unit by :mod:`node_agent.fleet.domains`.

Training jobs span nodes, so the fleet also sees what one node cannot: a rank of a job that is
``straggler_ratio`` times slower than the median of the job's other ranks on all nodes
(a *fleet straggler*), and every hung rank grouped by job, with the ranks ``training_progress``
marked as the likely origin — which node started a job-wide hang.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from node_agent.fleet.domains import (
    DEFAULT_BAD_SHARE,
    NvlinkDomain,
    domain_groups,
    group_domains,
)
from node_agent.fleet.reports import HUNG, STEPPING, NodeFigures, TrainingRow, read_all
from node_agent.fleet.reports import expand_paths as expand_paths
from node_agent.fleet.topology import load_topology as load_topology
from node_agent.yamlfile import load_yaml

#: exit codes of ``node-agent fleet`` (the contract's 2 for usage errors, 1 for agent failures)

FLEET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["thresholds", "units"],
    "properties": {
        "thresholds": {
            "type": "object",
            "additionalProperties": False,
            "required": ["deviation_mads", "relative_floor", "min_samples"],
            "properties": {
                "deviation_mads": {"type": "number", "exclusiveMinimum": 0},
                "relative_floor": {"type": "number", "minimum": 0},
                "min_samples": {"type": "integer", "minimum": 3},
            },
        },
        "units": {
            "type": "object",
            "additionalProperties": {"enum": ["low", "high", "both", "ignore"]},
        },
        "metrics": {
            "type": "object",
            "additionalProperties": {"enum": ["low", "high", "both", "ignore"]},
        },
        "training": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "straggler_ratio": {"type": "number", "exclusiveMinimum": 1},
                "min_nodes": {"type": "integer", "minimum": 2},
            },
        },
    },
}

#: scaled MAD: 1.4826 x MAD estimates the standard deviation of a normal distribution
MAD_SCALE = 1.4826


@dataclass(frozen=True)
class FleetRules:
    """Thresholds and the bad side of each unit/metric, from ``graders/fleet.yaml``."""

    deviation_mads: float = 3.5
    relative_floor: float = 0.02
    min_samples: int = 8
    units: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    straggler_ratio: float = 2.0  # a rank this many times the job's median step time
    straggler_min_nodes: int = 2  # a job on fewer nodes is left to the node's own check

    def direction(self, metric: str, unit: str) -> str | None:
        """``low``/``high``/``both`` — the side on which a figure is bad — or None: not compared."""
        side = self.metrics.get(metric) or self.units.get(unit)
        return None if side in (None, "ignore") else side


def load_fleet_rules(graders_dir: Path) -> FleetRules:
    """``graders_dir/fleet.yaml`` validated (ConfigError naming the file and key otherwise)."""
    data = load_yaml(graders_dir / "fleet.yaml", FLEET_SCHEMA, what="fleet rules")
    t = data["thresholds"]
    training = data.get("training") or {}
    return FleetRules(
        deviation_mads=float(t["deviation_mads"]),
        relative_floor=float(t["relative_floor"]),
        min_samples=int(t["min_samples"]),
        units=dict(data["units"]),
        metrics=dict(data.get("metrics") or {}),
        straggler_ratio=float(training.get("straggler_ratio", 2.0)),
        straggler_min_nodes=int(training.get("min_nodes", 2)),
    )


# -- statistics ------------------------------------------------------------------------------

_np: ModuleType | None
try:  # numpy is optional (the `report` extra); the pure-Python path gives the same numbers
    import numpy
except ImportError:  # pragma: no cover - exercised where numpy is absent
    _np = None
else:
    _np = numpy


def _median(values: Sequence[float]) -> float:
    if _np is not None:
        return float(_np.median(_np.asarray(values, dtype=float)))
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


@dataclass
class MetricGroup:
    """The pooled figures of one (SKU, check, metric, target kind) and their robust statistics."""

    sku: str
    check: str
    metric: str
    kind: str  # gpu | node | disk | hca ... (the target's prefix)
    unit: str
    direction: str
    values: array[float] = field(default_factory=lambda: array("d"))
    nodes: array[int] = field(default_factory=lambda: array("i"))
    targets: list[str] = field(default_factory=list)
    median: float = math.nan
    mad: float = math.nan
    scale: float = math.nan

    @property
    def scope(self) -> str:
        return "gpu" if self.kind == "gpu" else "node"

    @property
    def n(self) -> int:
        return len(self.values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sku": self.sku,
            "check": self.check,
            "metric": self.metric,
            "kind": self.kind,
            "scope": self.scope,
            "unit": self.unit,
            "bad_side": self.direction,
            "n": self.n,
            "median": _round(self.median),
            "mad": _round(self.mad),
            "scale": _round(self.scale),
        }


@dataclass(frozen=True)
class Suspect:
    """One figure on the bad side of its fleet median, beyond the threshold."""

    node: str
    target: str
    sku: str
    check: str
    metric: str
    unit: str
    value: float
    median: float
    deviation_mads: float  # (value - median) / scale; negative is below the median
    ratio: float  # value / median
    scope: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "target": self.target,
            "sku": self.sku,
            "check": self.check,
            "metric": self.metric,
            "unit": self.unit,
            "value": self.value,
            "median": _round(self.median),
            "deviation_mads": _round(self.deviation_mads, 2),
            "ratio": _round(self.ratio, 4),
            "scope": self.scope,
            "report": self.path,
        }


@dataclass(frozen=True)
class FleetStraggler:
    """A rank of a multi-node job whose step time is ``straggler_ratio`` times (or more) the
    median of the job's other ranks across the fleet."""

    node: str
    job: str
    rank: int | None
    pid: int | None
    target: str
    step_time_s: float
    job_median_s: float  # median step time of the job's other ranks, on all nodes
    ratio: float  # step_time_s / job_median_s
    ranks: int  # ranks of the job compared (this one included)
    nodes: int  # nodes they run on
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "job": self.job,
            "rank": self.rank,
            "pid": self.pid,
            "target": self.target,
            "step_time_s": _round(self.step_time_s),
            "job_median_step_time_s": _round(self.job_median_s),
            "ratio": _round(self.ratio, 2),
            "ranks_compared": self.ranks,
            "nodes": self.nodes,
            "report": self.path,
        }


@dataclass
class HungNode:
    """The hung ranks of one job on one node; ``origin``: those marked ``likely_origin``."""

    node: str
    ranks: list[str]  # "3", or "pid:4711" when the rank is unknown
    origin: list[str]
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "hung": self.ranks,
            "likely_origin": self.origin,
            "report": self.path,
        }


@dataclass(frozen=True)
class JobHang:
    """Every hung rank of one job across the fleet, node by node."""

    job: str
    nodes: list[HungNode]

    @property
    def origin_nodes(self) -> list[str]:
        """Nodes holding a rank marked ``likely_origin``: where the job-wide hang began."""
        return [n.node for n in self.nodes if n.origin]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "hung_ranks": sum(len(n.ranks) for n in self.nodes),
            "origin_nodes": self.origin_nodes,
            "nodes": [n.to_dict() for n in self.nodes],
        }


def _round(x: float, digits: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


@dataclass
class FleetAnalysis:
    rules: FleetRules
    reports: int
    nodes: list[NodeFigures]
    unreadable: list[tuple[str, str]]
    superseded: list[str]
    groups: list[MetricGroup]
    suspects: list[Suspect]
    topology: dict[str, list[str]] | None = None
    stragglers: list[FleetStraggler] = field(default_factory=list)
    hung_jobs: list[JobHang] = field(default_factory=list)
    jobs_compared: int = 0  # training jobs on at least straggler_min_nodes nodes
    #: (path, why) of report files not believed: a symlink, not a regular file, another owner
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: NVLink domains of the reports that name one, escalated first (fleet/domains.py)
    domains: list[NvlinkDomain] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """Anything to act on: a suspect figure, a hung job or an escalated NVLink domain.
        Fleet stragglers are listed but, like a straggler on one node (WARN), do not change
        the exit code; nor does a domain's bad tray under the share (its own grade acts)."""
        return bool(self.suspects or self.hung_jobs or any(d.escalated for d in self.domains))

    @property
    def suspect_nodes(self) -> list[str]:
        """Nodes with at least one suspect figure, worst deviation first."""
        seen: dict[str, None] = {}
        for s in self.suspects:
            seen.setdefault(s.node)
        return list(seen)

    def flagged_groups(self) -> list[dict[str, Any]]:
        """Topology groups that contain a suspect node: the group is flagged as a whole. The
        NVLink domains the reports name are such groups too (a slow tray slows every job laid
        out over its domain), unless the topology file lists them already."""
        groups = {**domain_groups(self.domains), **(self.topology or {})}
        bad = set(self.suspect_nodes)
        out = []
        for group, members in groups.items():
            hit = [n for n in members if n in bad]
            if hit:
                out.append({"group": group, "nodes": members, "suspect_nodes": hit})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "node-agent.fleet/1",
            "thresholds": {
                "deviation_mads": self.rules.deviation_mads,
                "relative_floor": self.rules.relative_floor,
                "min_samples": self.rules.min_samples,
                "straggler_ratio": self.rules.straggler_ratio,
                "straggler_min_nodes": self.rules.straggler_min_nodes,
            },
            "reports": self.reports,
            "nodes": len(self.nodes),
            "skus": sorted({n.sku for n in self.nodes}),
            "unreadable": [{"path": p, "error": e} for p, e in self.unreadable],
            "skipped": [{"path": p, "why": w} for p, w in self.skipped],
            "superseded": self.superseded,
            "suspects": [s.to_dict() for s in self.suspects],
            "suspect_nodes": self.suspect_nodes,
            "flagged_groups": self.flagged_groups(),
            "metrics": [g.to_dict() for g in self.groups],
            "training_jobs_compared": self.jobs_compared,
            "stragglers": [s.to_dict() for s in self.stragglers],
            "hung_jobs": [j.to_dict() for j in self.hung_jobs],
            "nvlink_domains": [d.to_dict() for d in self.domains],
        }


def _newest_per_host(figures: list[NodeFigures]) -> tuple[list[NodeFigures], list[str]]:
    """One report per hostname — the one that finished last; the others are superseded."""
    newest: dict[str, NodeFigures] = {}
    superseded: list[str] = []
    for f in figures:
        kept = newest.get(f.hostname)
        if kept is None:
            newest[f.hostname] = f
        elif (f.finished_at, f.path) > (kept.finished_at, kept.path):
            superseded.append(kept.path)
            newest[f.hostname] = f
        else:
            superseded.append(f.path)
    return list(newest.values()), superseded


def pool(nodes: list[NodeFigures], rules: FleetRules) -> list[MetricGroup]:
    """Pool every comparable figure by (SKU, check, metric, target kind)."""
    groups: dict[tuple[str, str, str, str], MetricGroup] = {}
    for index, node in enumerate(nodes):
        for check, target, metric, unit, value in node.rows:
            kind = target.split(":", 1)[0]
            key = (node.sku, check, metric, kind)
            group = groups.get(key)
            if group is None:
                side = rules.direction(metric, unit)
                if side is None:
                    continue
                group = groups[key] = MetricGroup(node.sku, check, metric, kind, unit, side)
            group.values.append(value)
            group.nodes.append(index)
            group.targets.append(target)
    return [groups[k] for k in sorted(groups)]


def find_outliers(group: MetricGroup, rules: FleetRules, nodes: list[NodeFigures]) -> list[Suspect]:
    """Fill in the group's median/MAD/scale and return its figures beyond the threshold."""
    if group.n < rules.min_samples:
        return []
    values = group.values
    median = _median(values)
    if _np is not None:
        arr = _np.frombuffer(values, dtype=float)
        mad = float(_np.median(_np.abs(arr - median)))
    else:
        arr = None
        mad = _median([abs(v - median) for v in values])
    scale = max(MAD_SCALE * mad, rules.relative_floor * abs(median))
    group.median, group.mad, group.scale = median, mad, scale
    if scale <= 0:
        return []  # every figure identical (and zero): nothing stands out
    limit = rules.deviation_mads
    if _np is not None and arr is not None:
        dev = (arr - median) / scale
        if group.direction == "low":
            hits = _np.nonzero(dev <= -limit)[0].tolist()
        elif group.direction == "high":
            hits = _np.nonzero(dev >= limit)[0].tolist()
        else:
            hits = _np.nonzero(_np.abs(dev) >= limit)[0].tolist()
    else:

        def bad(d: float) -> bool:
            return (
                d <= -limit
                if group.direction == "low"
                else d >= limit
                if group.direction == "high"
                else abs(d) >= limit
            )

        hits = [i for i, v in enumerate(values) if bad((v - median) / scale)]
    out = []
    for i in hits:
        node = nodes[group.nodes[i]]
        value = values[i]
        out.append(
            Suspect(
                node=node.hostname,
                target=group.targets[i],
                sku=group.sku,
                check=group.check,
                metric=group.metric,
                unit=group.unit,
                value=value,
                median=median,
                deviation_mads=(value - median) / scale,
                ratio=value / median if median else math.inf,
                scope=group.scope,
                path=node.path,
            )
        )
    return out


def _job_key(job: str, node: str) -> str:
    """The job's fleet-wide name. A ``ppid:`` job is named after a launcher's pid, which means
    something on its own node only, so it is never pooled with another node's."""
    return f"{job}@{node}" if job.startswith("ppid:") else job


def _median_without(ordered: Sequence[float], i: int) -> float:
    """Median of ``ordered`` (sorted) without its ``i``-th item, in constant time."""
    m = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2.0


def find_stragglers(
    nodes: list[NodeFigures], rules: FleetRules
) -> tuple[list[FleetStraggler], int]:
    """(ranks at least ``straggler_ratio`` times their job's median step time, jobs compared).

    Only jobs whose stepping ranks are on at least ``straggler_min_nodes`` nodes are compared
    (within one node, ``training_progress`` already compares them). Each rank is compared with
    the median of the job's *other* ranks, so with two ranks each is compared with the other.
    Hung ranks are left out: their step time is from before the hang.
    """
    # job -> (node index, pid or target) -> (step time, row)
    jobs: dict[str, dict[tuple[int, Any], tuple[float, TrainingRow]]] = {}
    for index, node in enumerate(nodes):
        for row in node.training:
            if row.metric in STEPPING and row.step_time_s is not None:
                ranks = jobs.setdefault(_job_key(row.job, node.hostname), {})
                # a straggler also reports its progress: one entry per process
                key = (index, row.pid if row.pid is not None else row.target)
                ranks.setdefault(key, (row.step_time_s, row))
    out: list[FleetStraggler] = []
    compared = 0
    for job, ranks in sorted(jobs.items()):
        on = {index for index, _ in ranks}
        if len(on) < rules.straggler_min_nodes:
            continue
        compared += 1
        entries = sorted(
            ((step, index, row) for (index, _), (step, row) in ranks.items()), key=lambda e: e[0]
        )
        ordered = [e[0] for e in entries]
        for i, (step, index, row) in enumerate(entries):
            median = _median_without(ordered, i)
            if median > 0 and step >= rules.straggler_ratio * median:
                node = nodes[index]
                out.append(
                    FleetStraggler(
                        node=node.hostname,
                        job=job,
                        rank=row.rank,
                        pid=row.pid,
                        target=row.target,
                        step_time_s=step,
                        job_median_s=median,
                        ratio=step / median,
                        ranks=len(entries),
                        nodes=len(on),
                        path=node.path,
                    )
                )
    out.sort(key=lambda s: (-s.ratio, s.job, s.node, str(s.rank)))
    return out, compared


def group_hangs(nodes: list[NodeFigures]) -> list[JobHang]:
    """Every ``training_hang`` of the fleet grouped by job, node by node; the nodes with a
    ``likely_origin`` rank first, then by name."""
    jobs: dict[str, dict[str, HungNode]] = {}
    for node in nodes:
        for row in node.training:
            if row.metric != HUNG:
                continue
            by_node = jobs.setdefault(_job_key(row.job, node.hostname), {})
            entry = by_node.get(node.hostname)
            if entry is None:
                entry = by_node[node.hostname] = HungNode(node.hostname, [], [], node.path)
            name = str(row.rank) if row.rank is not None else f"pid:{row.pid}"
            if name not in entry.ranks:
                entry.ranks.append(name)
                if row.likely_origin:
                    entry.origin.append(name)
    return [
        JobHang(job, sorted(by_node.values(), key=lambda n: (not n.origin, n.node)))
        for job, by_node in sorted(jobs.items())
    ]


def analyse_figures(
    figures: list[NodeFigures],
    rules: FleetRules,
    unreadable: list[tuple[str, str]] | None = None,
    topology: dict[str, list[str]] | None = None,
    reports: int | None = None,
    bad_share: float = DEFAULT_BAD_SHARE,
) -> FleetAnalysis:
    """Outliers of already-read figures (the pure part of :func:`analyse`); ``bad_share``:
    the share of an NVLink domain's trays graded ERROR or FAULT that escalates its rack."""
    nodes, superseded = _newest_per_host(figures)
    groups = pool(nodes, rules)
    suspects = [s for g in groups for s in find_outliers(g, rules, nodes)]
    suspects.sort(key=lambda s: (-abs(s.deviation_mads), s.node, s.target, s.metric))
    stragglers, compared = find_stragglers(nodes, rules)
    return FleetAnalysis(
        rules=rules,
        reports=len(figures) if reports is None else reports,
        nodes=nodes,
        unreadable=list(unreadable or []),
        superseded=superseded,
        groups=groups,
        suspects=suspects,
        topology=topology,
        stragglers=stragglers,
        hung_jobs=group_hangs(nodes),
        jobs_compared=compared,
        domains=group_domains(((n.hostname, n.level, n.path, n.tray) for n in nodes), bad_share),
    )


def analyse(
    inputs: Iterable[str | Path],
    rules: FleetRules,
    topology: dict[str, list[str]] | None = None,
    workers: int | None = None,
    owners: frozenset[int] | None = None,
    bad_share: float = DEFAULT_BAD_SHARE,
) -> FleetAnalysis:
    """Read reports (files, or directories of ``*.json``) and find the fleet's outliers.

    ``owners``: believe only report files owned by these uids (``node-agent fleet`` run as
    root passes ``fleet.report_owner_uids``); the others are listed in ``skipped``.
    ``bad_share``: the share of an NVLink domain's trays graded ERROR or FAULT that
    escalates its rack (fleet/domains.py).

    Example::

        analysis = analyse(["/var/lib/node-agent/fleet"], load_fleet_rules(graders))
        for s in analysis.suspects:
            print(s.node, s.target, s.metric, s.ratio)
    """
    paths = expand_paths(inputs)
    figures, unreadable, skipped = read_all(paths, workers=workers, owners=owners)
    analysis = analyse_figures(
        figures, rules, unreadable, topology, reports=len(paths), bad_share=bad_share
    )
    analysis.skipped = skipped
    return analysis


# -- output ----------------------------------------------------------------------------------
