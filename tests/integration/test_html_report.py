"""The HTML report in a real browser: headless Chromium (Debian package `chromium`) loads the
page, dumps its DOM, takes a screenshot (kept under $NODE_AGENT_ARTIFACTS when set) and logs
console messages, which must be none — a script error or a fetch the page's Content-Security-
Policy blocked would show there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
from synthetic_reports import synthetic_report  # tests/synthetic_reports.py

from node_agent.report.html import write_html

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium not installed (Debian package `chromium`; "
    "scripts/install-test-system-deps installs it)",
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


@dataclass
class Page:
    dom: str
    console: list[str]
    elements: list[tuple[str, dict[str, str]]]

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a
            for t, a in self.elements
            if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))


def chromium(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def load(path: Path, tmp_path: Path, screenshot: str | None = None) -> Page:
    """The page as Chromium loaded it: its DOM and console; with ``screenshot`` (a file name),
    the same load also takes a screenshot of it into ``tmp_path`` (one browser start, not two:
    the report page has no script, so its DOM does not depend on the window's size)."""
    extra = ["--dump-dom"]
    png = tmp_path / screenshot if screenshot else None
    if png is not None:
        extra += [f"--screenshot={png}", "--window-size=1300,2000", "--hide-scrollbars"]
    proc = chromium(path.resolve().as_uri(), tmp_path, *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if png is not None:
        keep_screenshot(png, proc)
    parser = _Collect()
    parser.feed(proc.stdout)
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    return Page(dom=proc.stdout, console=console, elements=parser.elements)


def keep_screenshot(png: Path, proc: subprocess.CompletedProcess) -> None:
    """The screenshot is a PNG, copied under $NODE_AGENT_ARTIFACTS when set."""
    assert png.exists(), proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artefacts = os.environ.get("NODE_AGENT_ARTIFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(artefacts) / png.name)


@needs_chromium
def test_console_check_catches_script_errors_and_blocked_fetches(tmp_path):
    """The no-console-errors assertions below could not fail if this detector saw nothing."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<html><head><meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; script-src 'unsafe-inline'\"></head><body>"
        "<script>throw new Error('planted')</script>"
        '<img src="http://127.0.0.1:9/x.png"></body></html>'
    )
    page = load(bad, tmp_path)
    assert any("Uncaught" in ln and "planted" in ln for ln in page.console), page.console
    assert any("Content Security Policy" in ln for ln in page.console), page.console


@needs_chromium
def test_fault_node_html_in_chromium_shows_fault_and_highlights_the_faulty_gpu(
    agent, scenario, tmp_path
):
    html = tmp_path / "fault.html"
    run = agent(
        "accept",
        "--simulate",
        scenario([{"kind": "xid", "gpu": 5, "code": 64}]),
        "--only",
        "inventory,nvml_health,xid",
        "--out",
        str(tmp_path / "reports"),
        "--html",
        str(html),
    )
    assert run.code == 4, run.stderr
    assert f"html: {html}" in run.stderr
    page = load(html, tmp_path, screenshot="fault-node-report.png")
    assert page.console == []
    (verdict,) = page.find("section", id="verdict")
    assert verdict["data-level"] == "FAULT" and verdict["data-action"] == "replace"
    assert ">FAULT<" in page.dom and "Xid 64" in page.dom
    rows = {a["data-gpu"]: a for a in page.find("tr") if "data-gpu" in a}
    assert sorted(rows) == [str(i) for i in range(8)]
    assert "flagged" in rows["5"]["class"].split() and rows["5"]["data-level"] == "FAULT"
    assert not [g for g, a in rows.items() if g != "5" and "flagged" in a["class"].split()]
    (xid_cell,) = [a for a in page.find("td", data_check="xid") if a.get("data-status") == "fail"]
    assert xid_cell["class"] == "s-fail"
    assert page.find("details", data_check="xid")[0].get("open") is not None


@needs_chromium
def test_report_with_burn_traces_draws_plots_with_thresholds_and_bandwidth_bars(tmp_path):
    report = synthetic_report(
        "node-traces", seed=7, trace_points=90, gpu_factors={3: 0.88}, faults={3: "slow"}
    )
    html = write_html(report, tmp_path / "traces.html")
    page = load(html, tmp_path, screenshot="burn-traces-report.png")
    assert page.console == []
    burn = page.find("div", **{"data_target": "gpu:3"})
    assert burn and "flagged" in burn[0]["class"].split()
    assert len([a for a in page.find("div") if a.get("data-target", "").startswith("gpu:")]) == 8
    assert sum(1 for t, _ in page.elements if t == "svg") >= 8 + 5
    for check in (
        "gpu_burn",
        "hbm_bandwidth",
        "pcie_bandwidth",
        "nccl_allreduce",
        "rdma",
        "storage",
    ):
        assert page.find("div", data_check=check), check
    text = html.read_text()
    assert "power limit" in text and "slowdown" in text and "minimum 2500" in text


def test_report_text_is_escaped_not_markup(tmp_path):
    report = synthetic_report("<script>alert(1)</script>", faults={2: "xid64"})
    report.results[0].detail = "<img src=x onerror=alert(2)> & done"
    report.results[0].evidence = {"stdout": "</pre><script>alert(3)</script>"}
    text = write_html(report, tmp_path / "x.html").read_text()
    assert "<script" not in text.lower() and "<img src=x" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;img src=x onerror=alert(2)&gt; &amp; done" in text


def test_html_page_loads_nothing_from_the_network(tmp_path):
    text = write_html(synthetic_report("n", trace_points=10), tmp_path / "x.html").read_text()
    assert "default-src 'none'" in text
    lowered = text.lower()
    for fetch in (
        'src="http',
        "src='http",
        'href="http',
        "href='http",
        "url(http",
        "url('http",
        "@import",
        '<link rel="stylesheet',
    ):
        assert fetch not in lowered, fetch


def test_html_without_matplotlib_is_a_usage_error_naming_the_extra(scenario, tmp_path):
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from node_agent.commands.main import main\n"
        "sys.exit(main())\n"
    )
    out = tmp_path / "reports"
    config = tmp_path / "config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            blocker,
            "accept",
            "--simulate",
            scenario(),
            "--only",
            "xid",
            "--out",
            str(out),
            "--html",
            str(tmp_path / "r.html"),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'node-agent[report]'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists(), "nothing runs when an output cannot be written"
