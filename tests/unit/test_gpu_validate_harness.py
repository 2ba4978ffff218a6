"""The GPU proof's harness (bench/gpu_validate.py) keeps its promises without a GPU: a step that
hangs is killed with everything it started and its figures say so, a step that breaks records
its error as the figures' reason, every null has a reason, the budget leaves the later steps
their minimum, and the agent runs from a copy of the work tree with nothing installed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from node_agent.proc import python_module_argv

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "gpu_validate", REPO / "bench" / "gpu_validate.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gv = _load()
steps = sys.modules["gpu_validate_steps"]  # the measuring half, imported by gv


def _step(name="hang", figures=("hbm_gbps", "pcie_h2d_gbps"), timeout_s=30, min_s=5):
    return gv.Step(name, figures, (), timeout_s, min_s, "the step's command")


def test_a_hung_step_is_killed_with_its_children_and_its_figures_say_it_timed_out(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(p.pid))
        print("started the GPU work", flush=True)
        time.sleep(120)
    """)
    # 10 s: time enough for the child to start its own child and say so on a loaded machine
    figures, outcome = gv.run_step_child(_step(), 10.0, tmp_path, [sys.executable, "-c", code])
    assert outcome.outcome == "timeout"
    for name in ("hbm_gbps", "pcie_h2d_gbps"):
        assert figures[name]["value"] is None
        assert figures[name]["reason"].startswith("timed out after 10 s (the step's time box)")
        assert "started the GPU work" in figures[name]["reason"]
        assert figures[name]["command"] == "the step's command"
    assert _gone(int(pid_file.read_text())), "the step's own child outlived its time box"


def _gone(pid: int, wait_s: float = 15.0) -> bool:
    """Whether ``pid`` is gone (or a zombie awaiting its reaper) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_step_that_raises_records_its_error_as_the_reason(tmp_path):
    figures, outcome = gv.run_step_child(_step(name="no_such_step"), 60.0, tmp_path)
    assert outcome.outcome == "failed"
    assert figures["hbm_gbps"]["value"] is None
    assert figures["hbm_gbps"]["reason"] == "step failed: KeyError: 'no_such_step'"


def test_a_step_that_exits_without_figures_is_explained_by_its_last_words(tmp_path):
    argv = [
        sys.executable,
        "-c",
        "print('CUDA error: an illegal memory access'); raise SystemExit(3)",
    ]
    figures, outcome = gv.run_step_child(_step(), 60.0, tmp_path, argv)
    assert outcome.outcome == "failed"
    assert figures["pcie_h2d_gbps"]["reason"] == (
        "step failed (exit 3): CUDA error: an illegal memory access"
    )


def test_a_figure_the_step_left_out_gets_a_reason_and_one_it_gave_is_kept(tmp_path):
    payload = tmp_path / "payload.json"
    payload.write_text(
        json.dumps({"figures": {"hbm_gbps": {"value": 2950.5, "detail": "p90 of 10 copies"}}})
    )
    result = tmp_path / "partial.result.json"  # where run_step_child looks for a step's figures
    argv = [
        sys.executable,
        "-c",
        f"import shutil; shutil.copyfile({str(payload)!r}, {str(result)!r})",
    ]
    figures, outcome = gv.run_step_child(_step(name="partial"), 60.0, tmp_path, argv)
    assert outcome.outcome == "ok"
    assert figures["hbm_gbps"]["value"] == 2950.5 and figures["hbm_gbps"]["reason"] is None
    assert figures["hbm_gbps"]["unit"] == "GB/s"
    assert figures["pcie_h2d_gbps"]["value"] is None
    assert figures["pcie_h2d_gbps"]["reason"].startswith("the step reported no value for it")


def test_every_null_has_a_reason_and_check_figures_finds_one_that_has_none():
    assert gv.figure("hbm_gbps", None)["reason"]  # never written without one
    figures = {n: gv.figure(n, 1.0) for n in gv.UNITS}
    assert gv.check_figures(figures) == []
    figures["daemon_rss_mb"] = {"value": None, "unit": "MiB", "reason": " ", "command": "x"}
    del figures["burn_tflops_fp8"]
    assert gv.check_figures(figures) == [
        "missing figure burn_tflops_fp8",
        "daemon_rss_mb: null without a reason",
    ]


def test_the_budget_leaves_later_steps_their_minimum():
    first = _step(timeout_s=150, min_s=30)
    second, third = _step(timeout_s=90, min_s=60), _step(timeout_s=90, min_s=75)
    grace = gv.KILL_GRACE_S
    assert gv.time_box(first, [second, third], 510) == 150
    # 200 s left: the later steps keep 60 + 75 s, every step its kill grace
    assert gv.time_box(first, [second, third], 200) == 200 - 60 - 75 - 3 * grace
    assert gv.time_box(first, [second, third], 160) is None  # under its own 30 s
    assert gv.time_box(third, [], 200) == 90  # its own timeout_s caps it


def test_the_steps_fit_a_ten_minute_command_limit():
    """A batch job or remote command of 10 minutes holds the run: the steps' floors must fit
    the budget, and the budget must leave a minute for the wheel install and the writing."""
    floors = sum(s.min_s + gv.KILL_GRACE_S for s in gv.STEPS)
    assert floors + gv.PROBE_TIMEOUT_S <= gv.DEFAULT_BUDGET_S
    assert gv.DEFAULT_BUDGET_S <= 9 * 60 - 30
    filled = [f for s in gv.STEPS for f in s.figures]
    assert sorted(filled) == sorted(gv.UNITS)  # each figure from exactly one step


def test_markdown_has_machine_date_and_one_row_per_figure_with_pipes_escaped(tmp_path):
    figures = {n: gv.figure(n, None, "no GPU here: a | b", "cmd") for n in gv.UNITS}
    figures["hbm_gbps"] = gv.figure("hbm_gbps", 2951.25, None, "node-agent accept", "p90")
    doc = {
        "date": "2026-11-23T17:00:00Z",
        "duration_s": 3.0,
        "budget_s": 510.0,
        "machine": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "driver": "580.159.04",
            "cuda": "13.0",
            "torch": "2.11.0+cu130",
            "python": "3.12.3",
            "hostname": "gpu",
        },
        "figures": figures,
        "steps": [{"name": "bandwidth", "outcome": "ok", "seconds": 21.5, "box_s": 90.0}],
    }
    md = gv.render_markdown(doc)
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0" in md
    assert "2026-11-23T17:00:00Z" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(gv.UNITS)
    assert "| `hbm_gbps` | 2951.25 | GB/s | `node-agent accept` | p90 |" in rows
    assert "no GPU here: a \\| b" in md
    target = tmp_path / "benchmarks.md"
    target.write_text(f"# Benchmarks\n{gv.DOC_BEGIN}\nold\n{gv.DOC_END}\ntail\n")
    assert gv.fill_doc(target, md)
    text = target.read_text()
    assert "old" not in text and "2951.25" in text and text.endswith(f"{gv.DOC_END}\ntail\n")
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not gv.fill_doc(plain, md) and plain.read_text() == "no markers\n"


def test_pytest_counts_come_from_the_junit_report(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent("""
        import pytest
        def test_ok(): assert True
        def test_also_ok(): assert 1 + 1 == 2
        def test_broken(): assert False, "NVML said no"
        @pytest.mark.skip(reason="no GPU")
        def test_skipped(): pass
    """)
    )
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-o",
            "addopts=",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert steps.pytest_counts(junit) == {
        "tests": 4,
        "failed": 1,
        "errors": 0,
        "skipped": 1,
        "passed": 2,
    }
    outcomes = steps._case_outcomes(junit)
    assert outcomes["test_ok"] == "passed"
    assert outcomes["test_skipped"].startswith("skipped: no GPU")
    assert outcomes["test_broken"].startswith("failed: AssertionError: NVML said no")


def test_a_test_module_that_fails_to_collect_makes_the_pytest_figure_null(tmp_path):
    """The GPU host's tests/unit/test_hardware_model.py could not be imported, and the figure
    still read "39 tests passed": a module that is not collected is a failed figure."""
    (tmp_path / "test_fine.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_broken_import.py").write_text(
        "import no_such_module_here  # noqa: F401\n\ndef test_never_runs():\n    pass\n"
    )
    args = ["-o", "addopts=", "--continue-on-collection-errors", str(tmp_path)]  # as the step
    got = steps._pytest_figure("pytest_gpu", "cmd", args, 120)
    assert got["value"] is None, got
    assert got["reason"].startswith("1 test module(s) could not be collected (")
    assert "test_broken_import" in got["reason"] and "so their tests never ran" in got["reason"]
    assert got["counts"]["errors"] == 1 and got["counts"]["passed"] == 1
    (tmp_path / "test_broken_import.py").unlink()
    got = steps._pytest_figure("pytest_gpu", "cmd", args, 120)
    assert got["value"] == 1 and got["reason"] is None


def test_the_shortened_delivery_suite_is_a_valid_suite_with_the_overrides(tmp_path):
    from node_agent.suite import load_suite

    steps.delivery_suite(tmp_path / "delivery.yaml")
    suite = load_suite(str(tmp_path / "delivery.yaml"), REPO / "suites")
    shipped = load_suite("delivery", REPO / "suites")
    assert [c.check for c in suite.checks] == [c.check for c in shipped.checks]
    params = {c.check: c.params for c in suite.checks}
    assert params["gpu_burn"]["duration_s"] == 30 and params["gpu_burn"]["size"] == 8192
    assert params["dcgm_diag"]["level"] == 1
    assert params["sdc"]["duration_s"] == 15


def _gpu_wheels():
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("gpu_wheels", str(REPO / "scripts" / "gpu-wheels"))
    spec = importlib.util.spec_from_loader("gpu_wheels", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_gpu_wheels_leaves_out_what_the_host_has_and_reads_markers_for_its_python(tmp_path):
    """Offline: which distributions a host's ``pip list --format=freeze`` names, and markers
    evaluated for the host's Python, not this one's."""
    wheels = _gpu_wheels()
    have = tmp_path / "host-packages.txt"
    have.write_text(
        "# python3 -m pip list --format=freeze\nPyYAML==6.0.2\ntorch==2.11.0\n"
        "prometheus_client==0.21.0\n-e git+https://example.invalid/x#egg=x\n"
        "requests @ file:///wheels/requests-2.32.3-py3-none-any.whl\n\n"
    )
    assert wheels.host_has(have) == {"pyyaml", "torch", "prometheus-client", "requests"}
    old, new = wheels.marker_env("3.10", "x86_64"), wheels.marker_env("3.12", "x86_64")
    assert wheels.marker_applies('python_version < "3.11"', old)
    assert not wheels.marker_applies('python_version < "3.11"', new)
    assert not wheels.marker_applies('extra == "format"', new)
    assert {"torch", "ruff"} <= wheels.NOT_NEEDED  # the host's own CUDA torch; lint only
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu-wheels"),
            str(tmp_path),
            "--python-version",
            "twelve",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "expected 3.X" in proc.stderr


def test_the_sdc_overhead_figure_is_null_with_the_reason_when_no_probe_ran(monkeypatch):
    """Two identical loops differ by noise alone: that is no overhead figure. With probes, the
    figure says how many ran, each pair's overhead and the budget."""
    from types import SimpleNamespace

    asked = {}

    def fake(probes_run, share):
        def measure(**kwargs):
            asked.update(kwargs)
            return SimpleNamespace(
                percent=5.66,
                pairs=2,
                steps_per_block=10,
                step_ms_off=11.4,
                step_ms_on=12.0,
                probe_share_percent=share,
                probes_run=probes_run,
                budget_fraction=0.001,
                device="cuda:0",
                verdicts={"pass": probes_run} if probes_run else {},
                within_budget=share <= 0.1,
                pair_percents=[5.5, 5.8],
                probe_cost_ms=share * 24,
                on_s=24.0,
            )

        return measure

    monkeypatch.setattr(steps, "_validation", lambda name: (fake(0, 0.0), None))
    got = steps.step_sdc_overhead(60)["sdc_probe_overhead_pct"]
    assert got["value"] is None and got["reason"].startswith("no probe ran: 0 probes in 24.0 s")
    assert asked["pairs"] == steps.SDC_OVERHEAD_PAIRS and asked["block_s"] <= 60 / 16
    # a GPU-bound model: a launch-bound one measures the host's jitter, not the probe
    assert asked["d_model"] == 2048 and asked["layers"] == 6
    monkeypatch.setattr(steps, "_validation", lambda name: (fake(3, 0.087), None))
    got = steps.step_sdc_overhead(100)["sdc_probe_overhead_pct"]
    assert got["value"] == 5.66 and asked["block_s"] == steps.SDC_OVERHEAD_BLOCK_S
    assert "3 probes in 24.0 s" in got["detail"] and "within its 0.1 % budget" in got["detail"]
    assert "per-pair overheads +5.50 %, +5.80 %" in got["detail"]
    monkeypatch.setattr(steps, "_validation", lambda name: (fake(4, 0.116), None))
    assert (
        "OVER its 0.1 % budget" in steps.step_sdc_overhead(60)["sdc_probe_overhead_pct"]["detail"]
    )


def test_burn_vs_plain_shares_a_short_box_so_that_every_precision_is_measured():
    """The H200's full run left fp32 and fp8 unmeasured: 2 s blocks did not fit what the box
    had left. Each precision now gets an equal share, in shorter blocks down to a minimum."""
    todo = list(steps.VS_PLAIN_PRECISIONS)
    pairs = steps.VS_PLAIN_PAIRS
    assert steps._vs_plain_block(1.0, pairs, None, 0.0, todo) == 1.0  # no deadline: as given
    assert steps._vs_plain_block(1.0, pairs, 75.0, 10.0, todo) == 1.0  # room for all five
    blocks = []
    used = 10.0
    for p in list(todo):  # a 40 s box: 30 s left for five precisions after the set-up
        block = steps._vs_plain_block(1.0, pairs, 40.0, used, todo)
        todo.remove(p)
        assert block is not None and steps.VS_PLAIN_MIN_BLOCK_S <= block < 1.0, (p, block)
        blocks.append(block)
        used += 2 * pairs * block + steps.VS_PLAIN_SLACK_S
    assert used <= 40.0 + 1e-9, (used, blocks)
    assert steps._vs_plain_block(1.0, pairs, 12.0, 10.0, ["fp8"]) is None  # under the minimum


# -- the work tree without an install, as a GPU host without a package index runs it ----------


def _bare_python(root: Path) -> Path:
    """A Python that has the agent's dependencies but no install of node_agent: a fresh venv
    whose only link to this one is a ``.pth`` line naming this interpreter's site-packages.
    A path named in a ``.pth`` file is added to ``sys.path`` but its own ``.pth`` files are
    not run, so the editable install's finder (``__editable__...pth``, which maps
    ``node_agent.graders`` to ``graders/``) is absent, in this Python and in every child it
    starts with ``sys.executable``: what a GPU host with torch, pytest and the wheels has."""
    import site
    import sysconfig

    venv = root / "bare-venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    ours = dict.fromkeys(
        [
            sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"],
            *site.getsitepackages(),
        ]
    )
    (Path(purelib) / "agent-dependencies.pth").write_text(
        "".join(f"{p}\n" for p in ours if Path(p).is_dir())
    )
    return python


def _copy_of_the_tree(dest: Path) -> Path:
    """This tree's source files (``git ls-files``: tracked, and new files not ignored) copied
    to ``dest``: no build output, no egg-info, nothing an install leaves behind."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


#: the readers of the module's one ``bare_tree`` copy: on one xdist worker, so it is made once
BARE_TREE = pytest.mark.xdist_group("gpu_validate_bare_tree")


@pytest.fixture(scope="module")
def bare_tree(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the copy is made of `git ls-files`")
    root = tmp_path_factory.mktemp("bare")
    return _bare_python(root), _copy_of_the_tree(root / "tree")


def _bare_env(tree: Path) -> dict[str, str]:
    """What the harness gives its steps (``_child_env``), pointed at the copy."""
    env = {k: v for k, v in gv._child_env().items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(tree)}


def _bare_pytest(bare_tree: tuple[Path, Path], *args: str) -> subprocess.CompletedProcess:
    """``pytest -q args...`` as the bare Python runs it in the copy of the tree."""
    python, tree = bare_tree
    return subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tree,
        env=_bare_env(tree),
        capture_output=True,
        text=True,
        timeout=300,
    )


#: what the steps import, and what the agent's own children import (the checks, the CLI)
STEP_IMPORTS = (
    "node_agent.gpu",
    "node_agent.compute.burn",
    "node_agent.compute.devices",
    "node_agent.commands.main",
    "node_agent.suite",
    "node_agent.environment",
    "node_agent.sim.nvml_state",
    "node_agent.sdc.validation",
    "gpu_validate_steps",
)


def test_the_harness_puts_the_work_tree_first_on_its_steps_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere{os.pathsep}{REPO}")
    assert gv._child_env()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]


@BARE_TREE
def test_the_work_tree_runs_without_an_install_of_node_agent(bare_tree):
    """The GPU host's failure, replayed: its python3 had torch and pytest but no install of
    node_agent, so ``node_agent.graders`` (a package only pyproject's package-dir makes) did
    not exist and every step that loads a SKU failed. From a copy of the tree and a Python
    without the install, every module the steps use imports, the shipped data is found
    beside the package, and it is the copy's, not this checkout's."""
    python, tree = bare_tree
    code = textwrap.dedent(f"""
        import importlib, importlib.util, json, sys
        sys.path.insert(0, {str(tree / "bench")!r})
        import node_agent
        from node_agent import resources
        from node_agent.config import config_from_dict
        for name in {STEP_IMPORTS!r}:
            if name == "node_agent.sdc.validation" and importlib.util.find_spec("torch") is None:
                continue
            importlib.import_module(name)
        cfg = config_from_dict({{}})
        print(json.dumps({{
            "node_agent": node_agent.__file__,
            "graders_package": importlib.util.find_spec("node_agent.graders") is not None,
            "editable_finders": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
            "graders": str(resources.graders_dir(cfg)),
            "suites": str(resources.suites_dir(cfg)),
            "skus": str(resources._shipped("node_agent.graders.skus")),
            "shipped": str(resources.shipped_graders_dir()),
        }}))
    """)
    proc = subprocess.run(
        [str(python), "-c", code],
        cwd="/",
        env=_bare_env(tree),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["node_agent"] == str(tree / "node_agent" / "__init__.py")
    assert not seen["graders_package"] and not seen["editable_finders"], seen  # truly bare
    assert seen["graders"] == str(tree / "graders") and seen["suites"] == str(tree / "suites")
    assert seen["skus"] == str(tree / "graders" / "skus")
    assert seen["shipped"] == str(tree / "graders")


@BARE_TREE
def test_pytest_gpu_collects_every_test_from_the_bare_work_tree(bare_tree):
    """``pytest -m gpu`` as the pytest_gpu step runs it: a collection error (the GPU host's
    tests/unit/test_hardware_model.py) is a failed figure, so there must be none."""
    proc = _bare_pytest(bare_tree, "-m", "gpu", "--collect-only", "tests")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " error" not in out.lower(), out[-4000:]
    collected = re.search(r"(\d+)/\d+ tests collected", out)
    assert collected and int(collected.group(1)) >= 20, out[-2000:]
    assert "tests/unit/test_backend_contract.py::test_nvml_satisfies_the_backend_contract" in out


@BARE_TREE
def test_the_simulator_contract_and_the_agent_cli_run_from_the_bare_work_tree(bare_tree, tmp_path):
    """The nvml_contract step's simulator tests (six of them failed on the GPU host), and the
    agent's CLI with its checks, each run by the agent in a child ``python -P -m`` in ``/``
    (they find node_agent through PYTHONPATH alone)."""
    python, tree = bare_tree
    contract = _bare_pytest(bare_tree, "tests/unit/test_backend_contract.py", "-k", "simulator")
    assert contract.returncode == 0, (contract.stdout + contract.stderr)[-4000:]
    assert re.search(r"\b[4-9]\d* passed|\b\d{2,} passed", contract.stdout), contract.stdout
    config = tmp_path / "config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    run = subprocess.run(
        [
            *python_module_argv("node_agent.commands.main", python=str(python)),
            "check",
            "--simulate",
            str(tree / "scenarios" / "healthy-h100.yaml"),
            "--json",
            "--config",
            str(config),
        ],
        cwd="/",
        env=_bare_env(tree),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["grade"]["level"] == "HEALTHY", report["grade"]
    assert not [r for r in report["results"] if r["status"] == "error"], report["results"]


def test_burn_vs_plain_runs_the_engine_and_the_plain_loop_on_the_same_device():
    """On the CPU at a tiny size (the harness, not the figure: CPU ratios mean nothing)."""
    pytest.importorskip("torch")
    got = steps.burn_vs_plain(
        device="cpu", precision="fp32", size=64, block_s=0.05, pairs=2, command="c"
    )["burn_vs_plain_matmul"]
    assert got["value"] is not None and got["value"] > 0, got
    assert got["reason"] is None and got["unit"] == "ratio"
    assert "2 pairs of 0.05 s" in got["detail"] and "device cpu" in got["detail"]
