"""The fleet page (``node-agent fleet --html``): ranked suspects, then each metric's distribution
across the fleet with its median, the flagging threshold and the outliers marked."""

from __future__ import annotations

from pathlib import Path

from node_agent.fleet.analysis import FleetAnalysis, MetricGroup
from node_agent.fleet.domains import NvlinkDomain
from node_agent.report.html import Plotter, esc, page, write_text_atomic

#: at most this many distributions are drawn (the metrics with suspects come first)
MAX_PLOTS = 40
#: suspects named on a plot (all are in the table)
MAX_LABELS = 6


def _histogram(group: MetricGroup, analysis: FleetAnalysis, plotter: Plotter) -> str:
    suspects = [
        s
        for s in analysis.suspects
        if (s.sku, s.check, s.metric) == (group.sku, group.check, group.metric)
        and s.scope == group.scope
        and s.target.split(":", 1)[0] == group.kind
    ]
    fig = plotter.figure(9, 2.6)
    ax = fig.subplots()
    values = list(group.values)
    ax.hist(values, bins=min(80, max(10, len(values) // 20)), color="#90a4ae")
    ax.axvline(group.median, color="#1565c0", linewidth=1.5, label="median")
    limit = analysis.rules.deviation_mads * group.scale
    if group.scale == group.scale and group.scale > 0:  # not NaN: the group was judged
        if group.direction in ("low", "both"):
            ax.axvline(
                group.median - limit,
                color="#c62828",
                linestyle="--",
                linewidth=1,
                label=f"threshold ({analysis.rules.deviation_mads:g} MADs)",
            )
        if group.direction in ("high", "both"):
            ax.axvline(
                group.median + limit,
                color="#c62828",
                linestyle="--",
                linewidth=1,
                label=None
                if group.direction == "both"
                else f"threshold ({analysis.rules.deviation_mads:g} MADs)",
            )
    if suspects:
        ax.plot(
            [s.value for s in suspects],
            [0] * len(suspects),
            "v",
            color="#c62828",
            markersize=8,
            clip_on=False,
            label=f"suspects ({len(suspects)})",
        )
        for s in suspects[:MAX_LABELS]:
            ax.annotate(
                f"{s.node} {s.target}",
                xy=(s.value, 0),
                xytext=(0, 14),
                textcoords="offset points",
                rotation=60,
                fontsize=7,
                color="#b71c1c",
            )
    ax.set_title(
        f"{group.sku}: {group.check}/{group.metric} per {group.kind} "
        f"(n={group.n}, bad side: {group.direction})",
        fontsize=9,
    )
    ax.set_xlabel(group.unit or "value", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return (
        f'<div class="plot{" flagged" if suspects else ""}" '
        f'data-metric="{esc(group.check + "/" + group.metric)}">{plotter.svg(fig)}</div>'
    )


def _training_html(a: FleetAnalysis) -> str:
    """Fleet stragglers and hung jobs (with the likely-origin nodes); empty when there are none."""
    parts = []
    if a.stragglers:
        rows = "".join(
            f'<tr class="straggler" data-node="{esc(s.node)}" data-job="{esc(s.job)}">'
            f"<td>{esc(s.node)}</td><td>{esc(s.job)}</td>"
            f"<td>{'?' if s.rank is None else s.rank}</td><td>{s.step_time_s:.4g} s</td>"
            f"<td>{s.job_median_s:.4g} s</td><td>{s.ratio:.2f}x</td></tr>"
            for s in a.stragglers
        )
        parts.append(
            f"<h2>Fleet stragglers (&ge; {a.rules.straggler_ratio:g}x their job's median step "
            'time)</h2><table id="stragglers"><thead><tr><th>node</th><th>job</th><th>rank</th>'
            "<th>step time</th><th>job median</th><th>ratio</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
    if a.hung_jobs:
        rows = "".join(
            f'<tr class="hung{" origin" if n.origin else ""}" data-job="{esc(j.job)}" '
            f'data-node="{esc(n.node)}"><td>{esc(j.job)}</td><td>{esc(n.node)}</td>'
            f"<td>{esc(', '.join(n.ranks))}</td><td>{esc(', '.join(n.origin))}</td></tr>"
            for j in a.hung_jobs
            for n in j.nodes
        )
        parts.append(
            '<h2>Hung jobs</h2><table id="hung-jobs"><thead><tr><th>job</th>'
            "<th>node</th><th>hung ranks</th><th>likely origin</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
    return "\n".join(parts)


#: a rack's tray grid: one cell per tray, coloured by its grade (the page's verdict colours)
DOMAIN_CSS = """
.rack { display: grid; grid-template-columns: repeat(auto-fill, minmax(112px, 1fr)); gap: 4px;
  max-width: 820px; margin: 6px 0 14px; }
.tray { border-radius: 4px; padding: 4px 6px; color: #fff; font-size: 12px; min-height: 44px; }
.tray.level-HEALTHY { background: var(--pass); } .tray.level-WARN { background: #f57f17; }
.tray.level-ERROR { background: var(--error); } .tray.level-FAULT { background: var(--fail); }
.tray .gpus { font-size: 11px; opacity: .9; }
.domain.escalated h3 { color: var(--fail); }
"""


def _rack_html(d: NvlinkDomain) -> str:
    """One NVLink domain: its verdict and the grid of its trays, each coloured by its grade
    and naming its bad GPUs."""
    cells = "".join(
        f'<div class="tray level-{esc(t.level)}" data-node="{esc(t.node)}" '
        f'data-level="{esc(t.level)}" title="{esc(t.path)}"><b>{esc(t.node)}</b> '
        f"{esc(t.level)}"
        + (
            '<div class="gpus">'
            + esc(", ".join(f"gpu {g.index} {g.level}: {g.why}" for g in t.bad_gpus))
            + "</div>"
            if t.bad_gpus
            else ""
        )
        + "</div>"
        for t in d.trays
    )
    return (
        f'<section class="domain{" escalated" if d.escalated else ""}" '
        f'data-domain="{esc(d.name)}" data-escalated="{str(d.escalated).lower()}">'
        f"<h3>{esc(d.name)}: {len(d.bad_trays)} of {len(d.trays)} trays ERROR or FAULT</h3>"
        f'<p class="meta">{esc(d.verdict)}</p><div class="rack">{cells}</div></section>'
    )


def _domains_html(a: FleetAnalysis) -> str:
    """Each NVLink domain as a rack of its trays; empty when no report names a domain."""
    if not a.domains:
        return ""
    return f"<style>{DOMAIN_CSS}</style><h2>NVLink domains (racks), escalated first</h2>" + "".join(
        _rack_html(d) for d in a.domains
    )


def _verdict_html(a: FleetAnalysis) -> str:
    """The page's head: how many suspect nodes and figures, and what was read."""
    return (
        f'<section id="verdict" class="verdict level-{"ERROR" if a.suspects else "HEALTHY"}"'
        f' data-suspects="{len(a.suspects)}"><span class="level">'
        f'{len(a.suspect_nodes)} suspect node(s)</span><span class="action">'
        f"{len(a.suspects)} figure(s) beyond {a.rules.deviation_mads:g} MADs "
        f"(floor {a.rules.relative_floor:.0%} of the median)</span>"
        f"<div>{a.reports} report(s), {len(a.nodes)} node(s), {len(a.unreadable)} unreadable, "
        f"{len(a.skipped)} skipped (not believed), {len(a.superseded)} superseded.</div>"
        "</section>"
    )


def render_fleet_html(analysis: FleetAnalysis) -> str:
    plotter = Plotter()
    a = analysis
    state = "suspects" if a.suspects else "clean"
    head = _verdict_html(a)
    rows = "".join(
        f'<tr class="suspect" data-node="{esc(s.node)}" data-target="{esc(s.target)}">'
        f"<td>{esc(s.node)}</td><td>{esc(s.target)}</td><td>{esc(s.check)}/{esc(s.metric)}</td>"
        f"<td>{s.value:.4g} {esc(s.unit)}</td><td>{s.median:.4g}</td>"
        f"<td>{s.deviation_mads:+.1f}</td><td>{s.ratio:.3f}</td><td>{esc(s.path)}</td></tr>"
        for s in a.suspects
    )
    table = (
        '<table id="suspects"><thead><tr><th>node</th><th>target</th><th>metric</th>'
        "<th>value</th><th>fleet median</th><th>deviation (MADs)</th><th>ratio</th>"
        f"<th>report</th></tr></thead><tbody>{rows}</tbody></table>"
        if a.suspects
        else "<p>No suspects: every compared figure is within the threshold.</p>"
    )
    groups_html = "".join(
        f"<li><b>{esc(g['group'])}</b>: suspect node(s) {esc(', '.join(g['suspect_nodes']))} "
        f"of {len(g['nodes'])}</li>"
        for g in a.flagged_groups()
    )
    judged = sorted(
        a.groups,
        key=lambda g: (
            not any((s.sku, s.check, s.metric) == (g.sku, g.check, g.metric) for s in a.suspects),
            g.sku,
            g.check,
            g.metric,
        ),
    )
    plots = "".join(_histogram(g, a, plotter) for g in judged[:MAX_PLOTS] if g.n)
    stats = "".join(
        f"<tr><td>{esc(g.sku)}</td><td>{esc(g.check)}/{esc(g.metric)}</td><td>{esc(g.kind)}</td>"
        f"<td>{g.n}</td><td>{g.median:.4g}</td><td>{g.mad:.3g}</td><td>{g.scale:.3g}</td>"
        f"<td>{esc(g.direction)}</td></tr>"
        for g in a.groups
    )
    unreadable = "".join(f"<li>{esc(err)}</li>" for _, err in a.unreadable)
    body = "\n".join(
        [
            "<h1>node-agent fleet</h1>",
            head,
            "<h2>Suspects, worst first</h2>",
            table,
            _training_html(a),
            _domains_html(a),
            (
                f'<h2>Parallel groups flagged as a whole</h2><ul id="groups">{groups_html}</ul>'
                if groups_html
                else ""
            ),
            '<h2>Distributions</h2><p class="meta">Blue: fleet median; red dashes: the threshold; '
            "red triangles: suspects.</p>",
            plots,
            '<h2>Statistics per metric</h2><table id="stats"><thead><tr><th>SKU</th><th>metric</th>'
            "<th>kind</th><th>n</th><th>median</th><th>MAD</th><th>scale</th><th>bad side</th></tr>"
            f"</thead><tbody>{stats}</tbody></table>",
            (
                f'<h2>Unreadable files</h2><ul id="unreadable">{unreadable}</ul>'
                if unreadable
                else ""
            ),
        ]
    )
    return page(f"node-agent fleet: {state}", body)


def write_fleet_html(analysis: FleetAnalysis, path: str | Path) -> Path:
    """Write the fleet page to ``path`` (atomically); return the path."""
    return write_text_atomic(render_fleet_html(analysis), path)
