"""`make gpu-validate` on a host without a GPU: exit 0, every figure null with its reason (the
CI-safe path); and the steps' measuring code run for real on the simulated node's CPU
stand-ins (the burn's workers, the agent's bandwidth checks, the daemon under psutil), so what
a GPU host runs is exercised here short of the GPU itself."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.gpu import open_backend

REPO = Path(__file__).resolve().parents[2]
HEALTHY = REPO / "scenarios" / "healthy-h100.yaml"


def _load():
    spec = importlib.util.spec_from_file_location(
        "gpu_validate", REPO / "bench" / "gpu_validate.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module
    spec.loader.exec_module(module)
    return module


gv = _load()
steps = sys.modules["gpu_validate_steps"]  # the measuring half, imported by gv
_backend = open_backend()
HAS_DRIVER = _backend.unavailable_reason is None
_backend.close()


@pytest.mark.skipif(
    HAS_DRIVER,
    reason="this host has an NVIDIA driver: there the run measures "
    "for minutes; run `make gpu-validate` itself",
)
def test_make_gpu_validate_without_a_gpu_exits_0_with_every_figure_null_and_explained(tmp_path):
    out = tmp_path / "gpu-validate"
    env = {**os.environ, "GPU_VALIDATE_PYTHON": sys.executable}
    proc = subprocess.run(
        ["make", "-s", "gpu-validate", f"ARGS=--out {out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"0 of {len(gv.UNITS)} figures measured" in proc.stdout
    doc = json.loads((out / "figures.json").read_text())
    assert doc["schema"] == "node-agent.gpu-validate/1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    assert doc["machine"]["python"] and doc["machine"]["hostname"]
    assert list(doc["figures"]) == list(gv.UNITS)
    for name, f in doc["figures"].items():
        assert {"value", "unit", "reason", "command"} <= set(f), name
        assert f["value"] is None, name
        assert isinstance(f["reason"], str) and f["reason"].strip(), name
        assert f["unit"] == gv.UNITS[name] and f["command"], name
    assert gv.check_figures(doc["figures"]) == []
    assert {s["name"] for s in doc["steps"]} == {s.name for s in gv.STEPS}
    md = (out / "figures.md").read_text()
    assert all(f"| `{name}` | null |" in md for name in gv.UNITS)
    assert (out / "log.txt").exists()


def test_bandwidth_figures_come_from_the_agents_own_checks(tmp_path):
    proc = steps._agent(
        [
            "accept",
            "--simulate",
            str(HEALTHY),
            "--only",
            "hbm_bandwidth,pcie_bandwidth",
            "--json",
            "--out",
            str(tmp_path / "r"),
        ],
        240,
        tmp_path,
    )
    report = json.loads(proc.stdout)
    figures = steps.bandwidth_figures(report, "cmd")
    for name in ("hbm_gbps", "pcie_h2d_gbps", "pcie_d2h_gbps"):
        assert figures[name]["value"] > 0 and figures[name]["reason"] is None, figures[name]
        assert "p90 of" in figures[name]["detail"]
    skipped = {
        "results": [
            {
                "check": "hbm_bandwidth",
                "metric": "copy_gbps",
                "target": "gpu:0",
                "status": "skip",
                "value": None,
                "detail": "torch cannot use CUDA",
            }
        ]
    }
    skipped["results"].append(
        {
            "check": "pcie_bandwidth",
            "metric": "ran",
            "target": "node",
            "status": "skip",
            "value": None,
            "detail": "no NVIDIA driver",
        }
    )
    figures = steps.bandwidth_figures(skipped, "cmd")
    assert figures["hbm_gbps"]["reason"] == "hbm_bandwidth skip: torch cannot use CUDA"
    assert figures["pcie_d2h_gbps"]["reason"] == "pcie_bandwidth skip: no NVIDIA driver"
    figures = steps.bandwidth_figures({"results": []}, "cmd")
    assert figures["pcie_h2d_gbps"]["reason"] == (
        "the report has no pcie_bandwidth h2d_gbps result for gpu:0"
    )


def test_burn_figures_run_the_burn_workers_and_explain_a_precision_the_device_lacks():
    pytest.importorskip("torch")
    from node_agent.compute.devices import ComputeSpec, sim_tflops_for

    spec = ComputeSpec(0, simulated=True, sim_tflops=sim_tflops_for(None))
    figures = steps.burn_figures(
        spec, size=64, seconds_each=1.0, deadline_s=120, precisions=("bf16", "fp8"), command="cmd"
    )
    assert figures["burn_tflops_bf16"]["value"] > 0, figures["burn_tflops_bf16"]
    assert (
        "products verified (Freivalds), 0 wrong elements" in figures["burn_tflops_bf16"]["detail"]
    )
    assert figures["burn_tflops_fp8"]["value"] is None
    assert figures["burn_tflops_fp8"]["reason"].startswith("not run: fp8 GEMMs are not supported")


def test_daemon_figures_measure_a_running_daemon_and_stop_it(tmp_path):
    # a loaded 2-core CI machine can take more than the GPU host's 30 s to start the daemon
    figures = steps.daemon_figures(
        box_s=180, window_s=3, simulate=str(HEALTHY), command="cmd", start_timeout_s=120
    )
    rss, cpu = figures["daemon_rss_mb"], figures["daemon_cpu_pct"]
    assert rss["value"] > 10 and rss["reason"] is None, rss  # a Python process with its imports
    assert cpu["value"] is not None and cpu["value"] >= 0, cpu
    assert "SIMULATED" in rss["detail"] and "node_agent_gpu_" in rss["detail"]
    assert "the daemon had exited" not in rss["detail"]
