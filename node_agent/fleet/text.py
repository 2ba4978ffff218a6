"""The fleet analysis as text: suspects, fleet stragglers and hung jobs, worst first."""

from __future__ import annotations

from collections.abc import Sequence

from node_agent.fleet.analysis import FleetAnalysis
from node_agent.report.terminal import printable


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def render_text(analysis: FleetAnalysis, limit: int = 50) -> str:
    """The ranked suspects for people at a shell (worst first), then what could not be read
    and what was not believed. Host names, job names and paths come from report files that
    others may have written: every line is escaped for the terminal (:func:`printable`)."""
    a = analysis
    skus = sorted({n.sku for n in a.nodes})
    lines = [
        f"fleet: {a.reports} report(s), {len(a.nodes)} node(s), SKU {', '.join(skus) or '-'}"
        f"; {len(a.unreadable)} unreadable, {len(a.skipped)} skipped, "
        f"{len(a.superseded)} superseded by a newer report"
        f"; threshold {a.rules.deviation_mads:g} MADs (floor {a.rules.relative_floor:.0%}"
        " of the median)"
    ]
    if not a.suspects:
        lines.append(
            "no suspects: every compared figure is within the threshold of its fleet median"
        )
    else:
        lines.append(
            f"suspects: {len(a.suspects)} figure(s) on {len(a.suspect_nodes)} node(s), worst first"
        )
        rows = [("NODE", "TARGET", "METRIC", "VALUE", "MEDIAN", "DEVIATION", "RATIO")]
        for s in a.suspects[:limit]:
            rows.append(
                (
                    s.node,
                    s.target,
                    f"{s.check}/{s.metric}",
                    f"{_fmt(s.value)} {s.unit}".strip(),
                    _fmt(s.median),
                    f"{s.deviation_mads:+.1f} MADs",
                    f"{s.ratio:.3f}",
                )
            )
        lines.extend(_table(rows))
        if len(a.suspects) > limit:
            lines.append(f"  ... and {len(a.suspects) - limit} more (--json lists them all)")
    lines.extend(_training_text(a, limit))
    lines.extend(_domains_text(a, limit))
    for g in a.flagged_groups():
        lines.append(
            f"group {g['group']} flagged as a whole ({len(g['nodes'])} nodes): "
            f"suspect node(s) {', '.join(g['suspect_nodes'])}"
        )
    if a.unreadable:
        lines.append(f"unreadable ({len(a.unreadable)}):")
        for p, err in a.unreadable[:limit]:
            lines.append(f"  {err if err.startswith(p) else p + ': ' + err}")
    if a.skipped:
        lines.append(f"skipped, not believed ({len(a.skipped)}):")
        for p, why in a.skipped[:limit]:
            lines.append(f"  {p}: {why}")
    return "\n".join(printable(line) for line in lines)


def _table(table: Sequence[Sequence[str]]) -> list[str]:
    rows = [tuple(printable(c) for c in r) for r in table]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def _training_text(a: FleetAnalysis, limit: int) -> list[str]:
    """Fleet stragglers and hung jobs; nothing when no report has a multi-node job or a hang."""
    lines = []
    ratio = a.rules.straggler_ratio
    if a.stragglers:
        lines.append(
            f"fleet stragglers: {len(a.stragglers)} rank(s) at >= {ratio:g}x the median "
            f"step time of their job's other ranks ({a.jobs_compared} job(s) on >= "
            f"{a.rules.straggler_min_nodes} nodes compared)"
        )
        rows = [("NODE", "JOB", "RANK", "STEP TIME", "JOB MEDIAN", "RATIO")]
        for s in a.stragglers[:limit]:
            rows.append(
                (
                    s.node,
                    s.job,
                    "?" if s.rank is None else str(s.rank),
                    f"{s.step_time_s:.4g} s",
                    f"{s.job_median_s:.4g} s",
                    f"{s.ratio:.2f}x",
                )
            )
        lines.extend(_table(rows))
        if len(a.stragglers) > limit:
            lines.append(f"  ... and {len(a.stragglers) - limit} more (--json lists them all)")
    elif a.jobs_compared:
        lines.append(
            f"no fleet stragglers: no rank of the {a.jobs_compared} job(s) on >= "
            f"{a.rules.straggler_min_nodes} nodes is at >= {ratio:g}x its job's median "
            "step time"
        )
    for job in a.hung_jobs[:limit]:
        origin = ", ".join(job.origin_nodes) or "not identified (no stack told)"
        lines.append(
            f"hung job {job.job}: {sum(len(n.ranks) for n in job.nodes)} rank(s) on "
            f"{len(job.nodes)} node(s); likely origin: {origin}"
        )
        for n in job.nodes[:limit]:
            mark = f" (likely origin: rank {', '.join(n.origin)})" if n.origin else ""
            lines.append(f"  {n.node}: rank {', '.join(n.ranks)}{mark}")
    return lines


def _domains_text(a: FleetAnalysis, limit: int) -> list[str]:
    """Each NVLink domain: its verdict, then its bad trays and their bad GPUs; nothing when no
    report names a domain."""
    if not a.domains:
        return []
    escalated = sum(1 for d in a.domains if d.escalated)
    lines = [
        f"NVLink domains: {len(a.domains)}, {escalated} escalated (a rack is escalated at "
        f">= {a.domains[0].threshold:.0%} of its trays ERROR or FAULT)"
    ]
    for d in a.domains[:limit]:
        lines.append(f"  {d.name} ({len(d.trays)} trays, {d.level}): {d.verdict}")
        for t in d.trays:
            if not (t.bad or t.bad_gpus):
                continue
            gpus = ", ".join(f"gpu {g.index} {g.level} ({g.why})" for g in t.bad_gpus)
            lines.append(f"    {t.node}: {t.level}" + (f"; {gpus}" if gpus else ""))
    if len(a.domains) > limit:
        lines.append(f"  ... and {len(a.domains) - limit} more (--json lists them all)")
    return lines
