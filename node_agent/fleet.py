"""Cross-node outliers: many nodes' reports in, a ranked list of suspect GPUs and nodes out.

A node that passes every absolute minimum but is 12% slower than its siblings in the fleet sets
the pace of every synchronous job it joins; only a comparison across nodes finds it. For each
SKU and each (check, metric, target kind) the fleet's figures are pooled — every GPU of every
node for per-GPU metrics, every node for node-level ones — and a figure is a suspect when it
lies on the bad side of the median by more than ``deviation_mads`` robust standard deviations
(``graders/fleet.yaml`` documents the statistic and its defaults).

Reading is the cost at fleet scale (10,000 reports), so each report is parsed once, only its
numeric figures are kept (in flat arrays), and files are read by a process pool when there are
many. A file that cannot be read — truncated, not JSON, another schema version — is listed as
unreadable with the reason; the rest are still analysed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import REPORT_SCHEMA, ReportFormatError
from .report import json_report
from .yamlfile import ConfigError, load_yaml

#: exit codes of ``node-agent fleet`` (the contract's 2 for usage errors, 1 for agent failures)
EXIT_NO_SUSPECTS, EXIT_SUSPECTS = 0, 3

FLEET_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["thresholds", "units"],
    "properties": {
        "thresholds": {"type": "object", "additionalProperties": False,
                       "required": ["deviation_mads", "relative_floor", "min_samples"],
                       "properties": {
                           "deviation_mads": {"type": "number", "exclusiveMinimum": 0},
                           "relative_floor": {"type": "number", "minimum": 0},
                           "min_samples": {"type": "integer", "minimum": 3}}},
        "units": {"type": "object", "additionalProperties": {"enum": ["low", "high", "both",
                                                                      "ignore"]}},
        "metrics": {"type": "object", "additionalProperties": {"enum": ["low", "high", "both",
                                                                        "ignore"]}},
    },
}

TOPOLOGY_SCHEMA: dict[str, Any] = {
    "type": "object", "minProperties": 1,
    "additionalProperties": {"type": "array", "items": {"type": "string"}, "minItems": 1},
}

#: scaled MAD: 1.4826 x MAD estimates the standard deviation of a normal distribution
MAD_SCALE = 1.4826
#: above this many files, read them in a process pool (below, the pool costs more than it saves)
PARALLEL_MIN_FILES = 256


@dataclass(frozen=True)
class FleetRules:
    """Thresholds and the bad side of each unit/metric, from ``graders/fleet.yaml``."""

    deviation_mads: float = 3.5
    relative_floor: float = 0.02
    min_samples: int = 8
    units: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)

    def direction(self, metric: str, unit: str) -> str | None:
        """``low``/``high``/``both`` — the side on which a figure is bad — or None: not compared."""
        side = self.metrics.get(metric) or self.units.get(unit)
        return None if side in (None, "ignore") else side


def load_fleet_rules(graders_dir: Path) -> FleetRules:
    """``graders_dir/fleet.yaml`` validated (ConfigError naming the file and key otherwise)."""
    data = load_yaml(graders_dir / "fleet.yaml", FLEET_SCHEMA, what="fleet rules")
    t = data["thresholds"]
    return FleetRules(deviation_mads=float(t["deviation_mads"]),
                      relative_floor=float(t["relative_floor"]), min_samples=int(t["min_samples"]),
                      units=dict(data["units"]), metrics=dict(data.get("metrics") or {}))


def load_topology(path: str | Path) -> dict[str, list[str]]:
    """A topology file: YAML mapping a parallel group's name to the nodes in it."""
    data = load_yaml(path, TOPOLOGY_SCHEMA, what="topology file")
    return {str(group): [str(n) for n in nodes] for group, nodes in data.items()}


# -- reading ---------------------------------------------------------------------------------

@dataclass
class NodeFigures:
    """The numeric figures of one report: rows of (check, target, metric, unit, value)."""

    hostname: str
    sku: str
    finished_at: str
    path: str
    rows: list[tuple[str, str, str, str, float]]


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def read_figures(path: str | Path) -> NodeFigures:
    """The numeric figures of one saved report; ReportFormatError when it cannot be read.

    Results that are skipped or errored carry no measurement and are left out. A file the
    fast path cannot read is handed to :func:`node_agent.report.json_report.read`, so the
    reason given for an unreadable file is the same one ``node-agent grade`` gives.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(_without_evidence(text))
        except ValueError:
            data = json.loads(text)
        if data.get("schema") != REPORT_SCHEMA:
            raise ValueError("schema")
        host = data["host"]
        hostname = host["hostname"]
        if not isinstance(hostname, str):
            raise TypeError("hostname")
        sku = data.get("sku") or "unknown-sku"
        rows = []
        intern = sys.intern
        for r in data["results"]:
            value = r.get("value")
            if r["status"] in ("skip", "error") or not _is_number(value):
                continue
            rows.append((intern(str(r["check"])), intern(str(r["target"])),
                         intern(str(r["metric"])), intern(str(r.get("unit", ""))), float(value)))
        return NodeFigures(hostname=hostname, sku=str(sku),
                           finished_at=str(data.get("finished_at", "")), path=str(path), rows=rows)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        json_report.read(path)  # raises ReportFormatError with the canonical reason
        raise ReportFormatError(f"{path}: report fields missing or malformed") from None


_EVIDENCE_OPEN = '\n      "evidence": {\n'
_EVIDENCE_CLOSE = "\n      }"


def _without_evidence(text: str) -> str:
    """The report's text with each result's evidence emptied, when written by our writer.

    Evidence (traces, argv, tool output) is most of a report's bytes and none of its figures,
    and parsing it is most of fleet's time. The writer indents by 2, so a result's keys sit at
    6 spaces and its evidence object closes at the first line that is 6 spaces and ``}``
    (deeper lines are indented more; a newline inside a JSON string is always escaped). Text in
    another layout comes back unchanged; a cut that does not parse is retried whole.
    """
    parts = []
    pos = 0
    while True:
        start = text.find(_EVIDENCE_OPEN, pos)
        if start < 0:
            break
        end = text.find(_EVIDENCE_CLOSE, start + len(_EVIDENCE_OPEN) - 1)
        if end < 0:
            return text
        parts.append(text[pos:start + len(_EVIDENCE_OPEN) - 1])
        pos = end + 1
    if not parts:
        return text
    parts.append(text[pos:])
    return "".join(parts)


def _read_chunk(paths: Sequence[str]) -> list[NodeFigures | tuple[str, str]]:
    out: list[NodeFigures | tuple[str, str]] = []
    for p in paths:
        try:
            out.append(read_figures(p))
        except ReportFormatError as err:
            out.append((p, str(err)))
    return out


def expand_paths(inputs: Iterable[str | Path]) -> list[Path]:
    """Files as given; a directory stands for its ``*.json`` files (not recursive), sorted.

    ConfigError when an input does not exist (nothing is analysed then).
    """
    paths: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            paths.extend(sorted(q for q in p.glob("*.json") if q.is_file()))
        elif p.exists():
            paths.append(p)
        else:
            raise ConfigError(f"{item}: no such report file or directory")
    return paths


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def read_all(paths: Sequence[Path], workers: int | None = None
             ) -> tuple[list[NodeFigures], list[tuple[str, str]]]:
    """(readable reports' figures, [(path, why unreadable)]) in the order of ``paths``."""
    names = [str(p) for p in paths]
    workers = _cpu_count() if workers is None else workers
    if workers <= 1 or len(names) < PARALLEL_MIN_FILES:
        items = _read_chunk(names)
    else:
        size = max(64, len(names) // (workers * 8))
        chunks = [names[i:i + size] for i in range(0, len(names), size)]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            items = [item for chunk in pool.map(_read_chunk, chunks) for item in chunk]
    good = [i for i in items if isinstance(i, NodeFigures)]
    bad = [i for i in items if not isinstance(i, NodeFigures)]
    return good, bad


# -- statistics ------------------------------------------------------------------------------

try:  # numpy is optional (the `report` extra); the pure-Python path gives the same numbers
    import numpy as _np
except ImportError:  # pragma: no cover - exercised where numpy is absent
    _np = None


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
    values: array = field(default_factory=lambda: array("d"))
    nodes: array = field(default_factory=lambda: array("i"))
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
        return {"sku": self.sku, "check": self.check, "metric": self.metric, "kind": self.kind,
                "scope": self.scope, "unit": self.unit, "bad_side": self.direction, "n": self.n,
                "median": _round(self.median), "mad": _round(self.mad),
                "scale": _round(self.scale)}


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
        return {"node": self.node, "target": self.target, "sku": self.sku, "check": self.check,
                "metric": self.metric, "unit": self.unit, "value": self.value,
                "median": _round(self.median), "deviation_mads": _round(self.deviation_mads, 2),
                "ratio": _round(self.ratio, 4), "scope": self.scope, "report": self.path}


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

    @property
    def suspect_nodes(self) -> list[str]:
        """Nodes with at least one suspect figure, worst deviation first."""
        seen: dict[str, None] = {}
        for s in self.suspects:
            seen.setdefault(s.node)
        return list(seen)

    def flagged_groups(self) -> list[dict[str, Any]]:
        """Topology groups that contain a suspect node: the group is flagged as a whole."""
        if not self.topology:
            return []
        bad = set(self.suspect_nodes)
        out = []
        for group, members in self.topology.items():
            hit = [n for n in members if n in bad]
            if hit:
                out.append({"group": group, "nodes": members, "suspect_nodes": hit})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "node-agent.fleet/1",
            "thresholds": {"deviation_mads": self.rules.deviation_mads,
                           "relative_floor": self.rules.relative_floor,
                           "min_samples": self.rules.min_samples},
            "reports": self.reports, "nodes": len(self.nodes),
            "skus": sorted({n.sku for n in self.nodes}),
            "unreadable": [{"path": p, "error": e} for p, e in self.unreadable],
            "superseded": self.superseded,
            "suspects": [s.to_dict() for s in self.suspects],
            "suspect_nodes": self.suspect_nodes,
            "flagged_groups": self.flagged_groups(),
            "metrics": [g.to_dict() for g in self.groups],
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


def find_outliers(group: MetricGroup, rules: FleetRules, nodes: list[NodeFigures]
                  ) -> list[Suspect]:
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
    if arr is not None:
        dev = (arr - median) / scale
        if group.direction == "low":
            hits = _np.nonzero(dev <= -limit)[0].tolist()
        elif group.direction == "high":
            hits = _np.nonzero(dev >= limit)[0].tolist()
        else:
            hits = _np.nonzero(_np.abs(dev) >= limit)[0].tolist()
    else:
        def bad(d: float) -> bool:
            return (d <= -limit if group.direction == "low" else d >= limit
                    if group.direction == "high" else abs(d) >= limit)
        hits = [i for i, v in enumerate(values) if bad((v - median) / scale)]
    out = []
    for i in hits:
        node = nodes[group.nodes[i]]
        value = values[i]
        out.append(Suspect(node=node.hostname, target=group.targets[i], sku=group.sku,
                           check=group.check, metric=group.metric, unit=group.unit,
                           value=value, median=median,
                           deviation_mads=(value - median) / scale,
                           ratio=value / median if median else math.inf, scope=group.scope,
                           path=node.path))
    return out


def analyse_figures(figures: list[NodeFigures], rules: FleetRules,
                    unreadable: list[tuple[str, str]] | None = None,
                    topology: dict[str, list[str]] | None = None,
                    reports: int | None = None) -> FleetAnalysis:
    """Outliers of already-read figures (the pure part of :func:`analyse`)."""
    nodes, superseded = _newest_per_host(figures)
    groups = pool(nodes, rules)
    suspects = [s for g in groups for s in find_outliers(g, rules, nodes)]
    suspects.sort(key=lambda s: (-abs(s.deviation_mads), s.node, s.target, s.metric))
    return FleetAnalysis(rules=rules, reports=len(figures) if reports is None else reports,
                         nodes=nodes, unreadable=list(unreadable or []), superseded=superseded,
                         groups=groups, suspects=suspects, topology=topology)


def analyse(inputs: Iterable[str | Path], rules: FleetRules,
            topology: dict[str, list[str]] | None = None,
            workers: int | None = None) -> FleetAnalysis:
    """Read reports (files, or directories of ``*.json``) and find the fleet's outliers.

    Example::

        analysis = analyse(["/var/lib/node-agent/fleet"], load_fleet_rules(graders))
        for s in analysis.suspects:
            print(s.node, s.target, s.metric, s.ratio)
    """
    paths = expand_paths(inputs)
    figures, unreadable = read_all(paths, workers=workers)
    return analyse_figures(figures, rules, unreadable, topology, reports=len(paths))


# -- output ----------------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def render_text(analysis: FleetAnalysis, limit: int = 50) -> str:
    """The ranked suspects for people at a shell (worst first), then what could not be read."""
    a = analysis
    skus = sorted({n.sku for n in a.nodes})
    lines = [f"fleet: {a.reports} report(s), {len(a.nodes)} node(s), SKU {', '.join(skus) or '-'}"
             f"; {len(a.unreadable)} unreadable, {len(a.superseded)} superseded by a newer report"
             f"; threshold {a.rules.deviation_mads:g} MADs (floor {a.rules.relative_floor:.0%}"
             " of the median)"]
    if not a.suspects:
        lines.append("no suspects: every compared figure is within the threshold of its fleet "
                     "median")
    else:
        lines.append(f"suspects: {len(a.suspects)} figure(s) on {len(a.suspect_nodes)} node(s), "
                     "worst first")
        rows = [("NODE", "TARGET", "METRIC", "VALUE", "MEDIAN", "DEVIATION", "RATIO")]
        for s in a.suspects[:limit]:
            rows.append((s.node, s.target, f"{s.check}/{s.metric}",
                         f"{_fmt(s.value)} {s.unit}".strip(), _fmt(s.median),
                         f"{s.deviation_mads:+.1f} MADs", f"{s.ratio:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if len(a.suspects) > limit:
            lines.append(f"  ... and {len(a.suspects) - limit} more (--json lists them all)")
    for g in a.flagged_groups():
        lines.append(f"group {g['group']} flagged as a whole ({len(g['nodes'])} nodes): "
                     f"suspect node(s) {', '.join(g['suspect_nodes'])}")
    if a.unreadable:
        lines.append(f"unreadable ({len(a.unreadable)}):")
        for p, err in a.unreadable[:limit]:
            lines.append(f"  {err if err.startswith(p) else p + ': ' + err}")
    return "\n".join(lines)


def run(inputs: Sequence[str], graders_dir: Path, *, as_json: bool = False,
        html: str | None = None, topology: str | None = None,
        out=sys.stdout, err=sys.stderr) -> int:
    """``node-agent fleet``: 0 no suspects, 3 suspects found; ConfigError (exit 2) when no
    report could be read, an input does not exist, or a rules/topology file is invalid."""
    rules = load_fleet_rules(graders_dir)
    groups = load_topology(topology) if topology else None
    if html:
        from .report.html import require_matplotlib
        require_matplotlib()
    if not inputs:
        raise ConfigError("fleet: name report files or a directory of reports")
    analysis = analyse(inputs, rules, topology=groups)
    if not analysis.nodes:
        raise ConfigError(f"fleet: none of {analysis.reports} file(s) is a readable report "
                          f"({len(analysis.unreadable)} unreadable"
                          + (f", first: {analysis.unreadable[0][1]}" if analysis.unreadable
                             else "") + ")")
    if html:
        from .report.fleet_html import write_fleet_html
        path = write_fleet_html(analysis, html)
        print(f"fleet html: {path}", file=err)
    if as_json:
        print(json.dumps(analysis.to_dict(), indent=2), file=out)
    else:
        print(render_text(analysis), file=out)
    return EXIT_SUSPECTS if analysis.suspects else EXIT_NO_SUSPECTS
