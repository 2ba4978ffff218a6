"""The HTML report: one self-contained page a person reads to sign a node off or to see why it
was drained.

Top to bottom: the verdict and action with its reasons in plain words; a GPU x check matrix
coloured by the worst status of each cell (a GPU named by a reason is highlighted); per-GPU plots
over the burn (TFLOP/s, temperature, power, SM clock) with the power limit and slowdown
temperature drawn in; bandwidth bars against their minima; the inventory; every result with its
evidence folded.

The page fetches nothing: CSS is inline, plots are inline SVG drawn by matplotlib (the
``report`` extra, imported only when a page is written), and a Content-Security-Policy forbids
every load. Everything from the report is escaped: a report is data from a node, not markup.
"""

from __future__ import annotations

import html
import io
import json
import math
from pathlib import Path
from typing import Any, TypeGuard

from node_agent import atomic_file
from node_agent.extras import missing_message
from node_agent.model import Level, Report, Result, Status, Target
from node_agent.yamlfile import ConfigError


def matplotlib_missing() -> str:
    """The one-line error when matplotlib is missing: the command that installs it here."""
    return missing_message("matplotlib", "report", "writing an HTML report") + " (or drop --html)"


class MissingExtraError(ConfigError):
    """An optional dependency the requested output needs is not installed (exit 2)."""


def require_matplotlib() -> None:
    """Raise MissingExtraError (with the pip command) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtraError(matplotlib_missing()) from None


# -- status and level vocabulary -------------------------------------------------------------

STATUS_COLOUR = {
    "pass": "#2e7d32",
    "warn": "#f9a825",
    "fail": "#c62828",
    "error": "#6a1b9a",
    "skip": "#9e9e9e",
}
LEVEL_WORDS = {
    Level.HEALTHY: "The node is fit for service.",
    Level.WARN: "The node may stay in service; the findings below deserve a look.",
    Level.ERROR: "A recoverable problem: drain the node, restart it (GPU reset or reboot) and "
    "re-test.",
    Level.FAULT: "A hardware fault: drain the node and replace the faulty part.",
}
ACTION_WORDS = {
    "none": "no action",
    "restart": "drain, restart, re-test",
    "drain": "drain",
    "replace": "drain and replace",
}

CSS = """
:root { --pass:#2e7d32; --warn:#f9a825; --fail:#c62828; --error:#6a1b9a; --skip:#9e9e9e; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 0 auto; max-width: 1280px; padding: 16px 24px 48px; color: #212121; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px;
  border-bottom: 1px solid #ddd; padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #555; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
         background: #eee; margin-left: 6px; }
.verdict { border-radius: 8px; padding: 14px 18px; margin: 12px 0; color: #fff; }
.verdict .level { font-size: 30px; font-weight: 700; letter-spacing: 1px; }
.verdict .action { font-size: 16px; margin-left: 14px; }
.verdict.level-HEALTHY { background: var(--pass); } .verdict.level-WARN { background: #f57f17; }
.verdict.level-ERROR { background: var(--error); } .verdict.level-FAULT { background: var(--fail); }
.verdict ul { margin: 8px 0 0; padding-left: 20px; } .verdict li { margin: 2px 0; }
.rule { opacity: .8; font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; font-weight: 600; }
.matrix td { text-align: center; min-width: 84px; font-size: 12px; }
.matrix td.s-pass { background: #c8e6c9; } .matrix td.s-warn { background: #fff59d; }
.matrix td.s-fail { background: #ef9a9a; font-weight: 700; }
.matrix td.s-error { background: #ce93d8; font-weight: 700; }
.matrix td.s-skip { background: #eeeeee; color: #757575; } .matrix td.s-none { color: #bbb; }
.matrix tr.flagged th { background: #ffcdd2; }
.matrix tr.flagged.level-WARN th { background: #fff9c4; }
.matrix tr.flagged td, .matrix tr.flagged th { border-top: 2px solid #b71c1c;
  border-bottom: 2px solid #b71c1c; }
.matrix tr.flagged.level-WARN td, .matrix tr.flagged.level-WARN th { border-color: #f9a825; }
.st { display: inline-block; min-width: 44px; padding: 0 6px; border-radius: 4px; color: #fff;
      font-size: 12px; text-align: center; }
.st-pass { background: var(--pass); } .st-warn { background: var(--warn); color: #212121; }
.st-fail { background: var(--fail); } .st-error { background: var(--error); }
.st-skip { background: var(--skip); }
.plot { margin: 6px 0 14px; } .plot svg { max-width: 100%; height: auto; }
.plot.flagged { outline: 3px solid #c62828; outline-offset: 2px; }
.results td.detail { max-width: 640px; } details pre { max-height: 360px; overflow: auto;
  background: #fafafa; border: 1px solid #eee; padding: 6px; font-size: 12px; margin: 4px 0; }
summary { cursor: pointer; color: #1565c0; }
.note { color: #555; font-style: italic; }
"""


def esc(value: Any) -> str:
    """Text from a report, safe inside HTML text and attribute values."""
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    """A complete page around ``body``; the CSP forbids any load (the page is self-contained)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n{body}\n"
        "</body></html>\n"
    )


# -- plotting --------------------------------------------------------------------------------


class Plotter:
    """Matplotlib figures to inline SVG, without pyplot's global state or a GUI backend."""

    def __init__(self) -> None:
        require_matplotlib()
        import matplotlib
        from matplotlib.figure import Figure

        self._matplotlib = matplotlib
        self._figure_cls = Figure
        self._count = 0

    def figure(self, width_in: float, height_in: float, **kwargs: Any) -> Any:
        return self._figure_cls(figsize=(width_in, height_in), layout="constrained", **kwargs)

    def svg(self, fig: Any) -> str:
        """The figure as an ``<svg>`` element (XML prolog and DOCTYPE removed)."""
        self._count += 1
        # text as <text> (small, selectable); report text is never parsed as mathtext; the hash
        # salt makes element ids deterministic and distinct between the page's figures
        buf = io.StringIO()
        with self._matplotlib.rc_context(
            {
                "svg.fonttype": "none",
                "text.parse_math": False,
                "svg.hashsalt": f"node-agent-{self._count}",
            }
        ):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        text = buf.getvalue()
        start = text.find("<svg")
        return text[start:] if start >= 0 else text


def _number(value: object) -> TypeGuard[float]:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(evidence: dict[str, Any], key: str) -> list[float] | None:
    """The numbers of a trace series, ``None`` readings as gaps (NaN: matplotlib leaves them
    out); None when there is no number at all or a value is not a number."""
    values = evidence.get(key)
    if not isinstance(values, list) or not values:
        return None
    if not all(v is None or _number(v) for v in values) or all(v is None for v in values):
        return None
    return [math.nan if v is None else float(v) for v in values]


# -- the page's parts ------------------------------------------------------------------------


def _gpu_index(target: str) -> int | None:
    return Target.parse(target).gpu_index


def _target_levels(report: Report) -> dict[str, Level]:
    """The worst grade reason per target."""
    levels: dict[str, Level] = {}
    for reason in report.grade.reasons:
        if reason.level > levels.get(reason.target, Level.HEALTHY):
            levels[reason.target] = reason.level
    return levels


def _verdict(report: Report) -> str:
    g = report.grade
    counts = {s: sum(1 for r in report.results if r.status is s) for s in Status}
    reasons = "".join(
        f'<li class="reason level-{r.level.name}" data-target="{esc(r.target)}">'
        f"<b>{esc(r.level.name)}</b> on <b>{esc(r.target)}</b>: {esc(r.message)} "
        f'<span class="rule">[rule {esc(r.rule)}]</span></li>'
        for r in g.reasons
        if r.level > Level.HEALTHY
    )
    return (
        f'<section id="verdict" class="verdict level-{g.level.name}" '
        f'data-level="{g.level.name}" data-action="{esc(g.action.value)}">'
        f'<span class="level">{g.level.name}</span>'
        f'<span class="action">action: {esc(g.action.value)} '
        f"({esc(ACTION_WORDS.get(g.action.value, g.action.value))})</span>"
        f"<div>{esc(LEVEL_WORDS[g.level])}</div>"
        + (f"<ul>{reasons}</ul>" if reasons else "")
        + "</section>"
        f'<p class="meta">{len(report.results)} results: '
        + ", ".join(
            f"{counts[s]} {s.value}"
            for s in (Status.PASS, Status.WARN, Status.FAIL, Status.ERROR, Status.SKIP)
        )
        + "</p>"
    )


def _worst(results: list[Result]) -> Status:
    """The status a cell shows when several results share it (``Status.severity``: a finding
    outranks a check that broke)."""
    return max((r.status for r in results), key=lambda status: status.severity)


def _matrix(report: Report, levels: dict[str, Level]) -> str:
    by_cell: dict[tuple[str, str], list[Result]] = {}
    checks: list[str] = []
    for r in report.results:
        by_cell.setdefault((r.target, r.check), []).append(r)
        if r.check not in checks:
            checks.append(r.check)
    gpu_indices = sorted(
        {g.index for g in report.gpus}
        | {i for r in report.results if (i := _gpu_index(r.target)) is not None}
        | {i for t in levels if (i := _gpu_index(t)) is not None}
    )
    others = sorted(
        {r.target for r in report.results if _gpu_index(r.target) is None}
        | {t for t in levels if _gpu_index(t) is None}
    )
    gpu_checks = [c for c in checks if any((f"gpu:{i}", c) in by_cell for i in gpu_indices)]
    other_checks = [c for c in checks if any((t, c) in by_cell for t in others)]
    out = []
    if gpu_indices:
        out.append(
            _matrix_table(
                "gpu-matrix", [f"gpu:{i}" for i in gpu_indices], gpu_checks, by_cell, levels, report
            )
        )
    if others:
        out.append("<h3>Node, disks and network adapters</h3>")
        out.append(_matrix_table("node-matrix", others, other_checks, by_cell, levels, report))
    return "".join(out) or '<p class="note">No results.</p>'


def _matrix_table(
    table_id: str,
    targets: list[str],
    checks: list[str],
    by_cell: dict[tuple[str, str], list[Result]],
    levels: dict[str, Level],
    report: Report,
) -> str:
    names = {f"gpu:{g.index}": g.name for g in report.gpus}
    head = "".join(f"<th>{esc(c)}</th>" for c in checks)
    rows = []
    for target in targets:
        level = levels.get(target, Level.HEALTHY)
        flagged = level > Level.HEALTHY
        gpu = _gpu_index(target)
        attrs = (
            f' data-target="{esc(target)}" data-level="{level.name}"'
            + (f' data-gpu="{gpu}"' if gpu is not None else "")
            + f' class="{"gpu-row" if gpu is not None else "target-row"}'
            + (f" flagged level-{level.name}" if flagged else "")
            + '"'
        )
        label = esc(target) + (
            f'<br><span class="meta">{esc(names[target])}</span>' if target in names else ""
        )
        cells = []
        for check in checks:
            results = by_cell.get((target, check))
            if not results:
                cells.append('<td class="s-none">&mdash;</td>')
                continue
            worst = _worst(results)
            bad = [r for r in results if r.status not in (Status.PASS, Status.SKIP)]
            title = "; ".join(
                f"{r.metric}: {r.status.value}: {r.detail}" for r in (bad or results)
            )[:600]
            note = f"{len(bad)} of {len(results)}" if bad else f"{len(results)}"
            cells.append(
                f'<td class="s-{worst.value}" data-check="{esc(check)}" '
                f'data-status="{worst.value}" title="{esc(title)}">'
                f'{worst.value}<br><span class="meta">{note}</span></td>'
            )
        rows.append(f"<tr{attrs}><th>{label}</th>{''.join(cells)}</tr>")
    return (
        f'<table id="{table_id}" class="matrix"><thead><tr><th>target</th>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


_TRACE_PANELS = (  # (evidence key, axis label, threshold key in the trace, threshold label)
    ("tflops", "TFLOP/s", None, None),
    ("temp_c", "temperature (°C)", "slowdown_temp_c", "slowdown"),
    ("power_w", "power (W)", "power_limit_w", "power limit"),
    ("sm_clock_mhz", "SM clock (MHz)", None, None),
)


def _burn_plots(report: Report, plotter: Plotter, levels: dict[str, Level]) -> str:
    traces: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[float]] = {}
    minimum: float | None = None
    for r in report.results:
        if (
            r.check == "thermal_power"
            and r.metric == "load_trace"
            and _gpu_index(r.target) is not None
        ):
            traces[r.target] = r.evidence
        elif r.check == "gpu_burn" and r.metric == "tflops_bf16":
            s = _series(r.evidence, "samples")
            if s:
                samples[r.target] = s
            if _number(r.evidence.get("minimum")):
                minimum = float(r.evidence["minimum"])
    if not traces and not samples:
        return '<p class="note">No burn traces in this report (the load checks did not run).</p>'
    out = []
    for target in sorted(traces, key=lambda t: _gpu_index(t) or 0):
        ev = traces[target]
        t_s = _series(ev, "t_s")
        fig = plotter.figure(12, 2.3)
        axes = fig.subplots(1, 4)
        drawn = False
        for ax, panel in zip(axes, _TRACE_PANELS, strict=True):
            drawn = _trace_panel(ax, ev, panel, t_s, minimum) or drawn
        level = levels.get(target, Level.HEALTHY)
        fig.suptitle(f"{target} over the burn", fontsize=10)
        if drawn:
            out.append(
                f'<div class="plot{" flagged" if level > Level.HEALTHY else ""}" '
                f'data-target="{esc(target)}">{plotter.svg(fig)}</div>'
            )
    if samples and not traces:
        out.append(_samples_plot(samples, levels, minimum, plotter))
    return "".join(out)


def _trace_panel(
    ax: Any,
    ev: dict[str, Any],
    panel: tuple[str, str, str | None, str | None],
    t_s: list[float] | None,
    minimum: float | None,
) -> bool:
    """One panel of a GPU's burn trace (``_TRACE_PANELS``) with its limit; whether it drew a
    series ("not recorded" otherwise)."""
    key, label, limit_key, limit_label = panel
    ys = _series(ev, key)
    ax.set_title(label, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if ys is None:
        ax.text(
            0.5,
            0.5,
            "not recorded",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
            color="#757575",
        )
        return False
    xs = t_s if t_s and len(t_s) == len(ys) else list(range(len(ys)))
    ax.plot(xs, ys, color="#1565c0", linewidth=1.2)
    limit = ev.get(limit_key) if limit_key else (minimum if key == "tflops" else None)
    if _number(limit):
        ax.axhline(float(limit), color="#c62828", linestyle="--", linewidth=1)
        ax.annotate(
            limit_label or "minimum",
            xy=(0.01, float(limit)),
            xycoords=("axes fraction", "data"),
            fontsize=7,
            color="#c62828",
            va="bottom",
        )
    ax.set_xlabel("time (s)" if xs is t_s else "sample", fontsize=8)
    return True


def _samples_plot(
    samples: dict[str, list[float]],
    levels: dict[str, Level],
    minimum: float | None,
    plotter: Plotter,
) -> str:
    """The bf16 TFLOP/s samples of every GPU in one plot (when no thermal trace was recorded)."""
    fig = plotter.figure(8, 3)
    ax = fig.subplots()
    for target in sorted(samples, key=lambda t: _gpu_index(t) or 0):
        ax.plot(
            samples[target],
            linewidth=1.2,
            label=target,
            color="#c62828" if levels.get(target, Level.HEALTHY) > Level.HEALTHY else None,
        )
    if minimum is not None:
        ax.axhline(minimum, color="#c62828", linestyle="--", linewidth=1)
    ax.set_title("bf16 TFLOP/s samples per GPU (no thermal trace recorded)", fontsize=10)
    ax.set_xlabel("sample", fontsize=8)
    ax.legend(fontsize=7, ncols=4)
    ax.grid(alpha=0.3)
    return f'<div class="plot">{plotter.svg(fig)}</div>'


#: (section title, check, metrics) of the bar charts, in the order people read them
BAR_GROUPS = (
    (
        "GPU burn (TFLOP/s)",
        "gpu_burn",
        ("tflops_bf16", "tflops_fp16", "tflops_tf32", "tflops_fp32", "tflops_fp8"),
    ),
    ("HBM bandwidth", "hbm_bandwidth", ("copy_gbps",)),
    (
        "PCIe bandwidth",
        "pcie_bandwidth",
        ("h2d_gbps", "d2h_gbps", "h2d_gbps_concurrent", "d2h_gbps_concurrent"),
    ),
    ("NCCL all-reduce", "nccl_allreduce", ("busbw_peak_gbps",)),
    ("RDMA", "rdma", ("write_bw_gbps", "port_rate_gbps")),
    ("Storage", "storage", ("write_bw_mbps", "read_bw_mbps", "randread_iops")),
)


def _bars(report: Report, plotter: Plotter) -> str:
    out = []
    for title, check, metrics in BAR_GROUPS:
        panels = []
        for metric in metrics:
            rows = [
                r
                for r in report.results
                if r.check == check
                and r.metric == metric
                and _number(r.value)
                and r.status is not Status.SKIP
            ]
            if rows:
                rows.sort(
                    key=lambda r: (
                        _gpu_index(r.target) is None,
                        _gpu_index(r.target) or 0,
                        r.target,
                    )
                )
                panels.append((metric, rows))
        if not panels:
            continue
        n_rows = max(len(rows) for _, rows in panels)
        fig = plotter.figure(min(12, 3.2 * len(panels)), 0.9 + 0.24 * n_rows)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (metric, rows) in zip(axes, panels, strict=True):
            labels = [r.target for r in rows]
            values = [float(r.value) for r in rows if _number(r.value)]  # every row (above)
            colours = [STATUS_COLOUR.get(r.status.value, "#757575") for r in rows]
            ys = list(range(len(rows)))
            ax.barh(ys, values, color=colours, height=0.7)
            ax.set_yticks(ys, labels, fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=7)
            unit = rows[0].unit
            ax.set_title(f"{metric} ({unit})" if unit else metric, fontsize=9)
            minima = [
                (y, float(r.evidence["minimum"]))
                for y, r in zip(ys, rows, strict=True)
                if _number(r.evidence.get("minimum"))
            ]
            for y, m in minima:
                ax.plot([m, m], [y - 0.45, y + 0.45], color="#212121", linewidth=1.6)
            if minima:
                ax.annotate(
                    f"minimum {minima[0][1]:g}",
                    xy=(minima[0][1], -0.6),
                    fontsize=7,
                    ha="center",
                    va="bottom",
                    annotation_clip=False,
                )
            ax.grid(axis="x", alpha=0.3)
        out.append(
            f'<h3>{esc(title)}</h3><div class="plot" data-check="{esc(check)}">'
            f"{plotter.svg(fig)}</div>"
        )
    if not out:
        return '<p class="note">No bandwidth or throughput figures in this report.</p>'
    return (
        '<p class="meta">Bars are coloured by status; a black tick marks the minimum the '
        "check applied, where it had one.</p>" + "".join(out)
    )


def _inventory(report: Report) -> str:
    h = report.host
    host_rows = [
        ("hostname", h.hostname),
        ("kernel", h.kernel),
        ("driver", h.driver),
        ("CUDA", h.cuda),
        ("GPU backend", h.gpu_backend),
        ("SKU", report.sku),
        ("suite", f"{report.suite} ({report.mode})"),
        ("started", report.started_at),
        ("finished", report.finished_at),
        ("agent", report.agent_version),
        ("simulated", "yes" if report.simulated else "no"),
    ]
    host = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v if v is not None else 'n/a')}</td></tr>"
        for k, v in host_rows
    )
    cols = ("index", "name", "uuid", "pci_bus_id", "serial", "vbios", "memory_total_mib", "sku")
    gpus = "".join(
        "<tr>"
        + "".join(
            f"<td>{esc(getattr(g, c) if getattr(g, c) is not None else 'n/a')}</td>" for c in cols
        )
        + "</tr>"
        for g in report.gpus
    )
    gpu_table = (
        f'<table id="gpus"><thead><tr>{"".join(f"<th>{c}</th>" for c in cols)}</tr>'
        f"</thead><tbody>{gpus}</tbody></table>"
        if report.gpus
        else '<p class="note">No GPUs in the inventory.</p>'
    )
    return f'<table id="host">{host}</table><h3>GPUs</h3>{gpu_table}'


EVIDENCE_MAX_CHARS = 20000


def _evidence(evidence: dict[str, Any]) -> str:
    if not evidence:
        return ""
    text = json.dumps(evidence, indent=1, default=str, ensure_ascii=False)
    if len(text) > EVIDENCE_MAX_CHARS:
        text = (
            text[:EVIDENCE_MAX_CHARS]
            + f"\n... ({len(text) - EVIDENCE_MAX_CHARS} more characters in the JSON report)"
        )
    return (
        f"<details><summary>evidence ({len(evidence)} keys)</summary>"
        f"<pre>{esc(text)}</pre></details>"
    )


def _value(r: Result) -> str:
    if r.value is None or r.value == "":
        return ""
    if isinstance(r.value, float):
        return f"{r.value:.4g} {r.unit}".strip()
    return f"{r.value} {r.unit}".strip()


def _results(report: Report) -> str:
    order: list[str] = []
    for r in report.results:
        if r.check not in order:
            order.append(r.check)
    out = []
    for check in order:
        rows = [r for r in report.results if r.check == check]
        worst = _worst(rows)
        body = "".join(
            f'<tr class="result s-{r.status.value}"><td><span class="st st-{r.status.value}">'
            f"{r.status.value}</span></td><td>{esc(r.target)}</td><td>{esc(r.metric)}</td>"
            f'<td>{esc(_value(r))}</td><td class="detail">{esc(r.detail)}{_evidence(r.evidence)}'
            f"</td></tr>"
            for r in rows
        )
        open_attr = " open" if worst in (Status.FAIL, Status.ERROR) else ""
        out.append(
            f'<details class="check" data-check="{esc(check)}"{open_attr}><summary>'
            f"<b>{esc(check)}</b> — {len(rows)} result(s), worst "
            f'<span class="st st-{worst.value}">{worst.value}</span></summary>'
            f'<table class="results"><thead><tr><th>status</th><th>target</th><th>metric</th>'
            f"<th>value</th><th>detail and evidence</th></tr></thead><tbody>{body}</tbody></table>"
            "</details>"
        )
    return "".join(out)


def _actions(report: Report) -> str:
    if not report.actions:
        return ""
    rows = "".join(
        f"<tr><td>{esc(a.action)}</td><td>{esc(a.adapter)}</td><td>{esc(a.outcome)}"
        f"</td><td>{esc(a.detail)}</td><td>{esc(a.at)}</td></tr>"
        for a in report.actions
    )
    return (
        "<h2>Actions taken</h2><table><thead><tr><th>action</th><th>adapter</th>"
        "<th>outcome</th><th>detail</th><th>at</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def render_html(report: Report) -> str:
    """The whole page as a string (matplotlib required; MissingExtraError otherwise)."""
    plotter = Plotter()
    levels = _target_levels(report)
    title = f"node-agent {report.suite}: {report.host.hostname} — {report.grade.level.name}"
    sim = '<span class="badge">SIMULATED</span>' if report.simulated else ""
    parts = [
        f"<h1>{esc(report.host.hostname)} — {esc(report.suite)} suite{sim}</h1>",
        f'<p class="meta">{len(report.gpus)} GPU(s), SKU {esc(report.sku or "unknown")}, '
        f"driver {esc(report.host.driver or 'n/a')}, finished {esc(report.finished_at)}</p>",
        _verdict(report),
        _actions(report),
        '<h2>GPU × check</h2><p class="meta">Each cell shows the worst status of that check on '
        "that GPU (and how many results); a GPU named by a grade reason is outlined. Hover a "
        "cell for the details.</p>",
        _matrix(report, levels),
        "<h2>Over the burn</h2>",
        _burn_plots(report, plotter, levels),
        "<h2>Bandwidth and throughput against minima</h2>",
        _bars(report, plotter),
        "<h2>Inventory</h2>",
        _inventory(report),
        "<h2>All results</h2>",
        _results(report),
        f'<p class="meta">Written by node-agent {esc(report.agent_version)}; the JSON report is '
        "the record.</p>",
    ]
    return page(title, "\n".join(parts))


def write_html(report: Report, path: str | Path) -> Path:
    """Write the report's page to ``path`` (atomically); return the path."""
    return write_text_atomic(render_html(report), path)


def write_text_atomic(text: str, path: str | Path) -> Path:
    path = Path(path)
    try:
        atomic_file.write_text(path, text)
    except OSError as err:
        raise ConfigError(f"{path}: cannot write: {err.strerror or err}") from err
    return path
