"""The first command on a fresh machine: ``node-agent accept`` on a host with no GPU and no torch
exits 0, every GPU check skipped with its reason; no check crashes importing torch.

torch is an extra (``.[torch]``) that the default install (``make accept`` on a host without
``nvidia-smi``) leaves out, but the tests' environment has it. So the child agent runs with torch
made unimportable for it alone: ``python -P`` (the working directory is not on ``sys.path``)
with a ``PYTHONPATH`` entry first whose ``torch/__init__.py`` raises ``ModuleNotFoundError:
No module named 'torch'``, exactly what an environment without torch raises. The test proves
the stand-in works (``import torch`` fails in the child) before it believes the verdict.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from node_agent.config import load_config
from node_agent.proc import python_code_argv, python_module_argv
from node_agent.resources import suites_dir
from node_agent.suite import load_suite
from tests.integration.test_cli_no_gpu import GPUS_ON_BUS, HAS_DRIVER

pytestmark = pytest.mark.skipif(
    HAS_DRIVER or bool(GPUS_ON_BUS),
    reason="this host has a working NVIDIA driver (GPU checks run, not skip)"
    if HAS_DRIVER
    else f"this host has NVIDIA GPUs on its PCI bus ({len(GPUS_ON_BUS)}): without torch the "
    "delivery suite is an ERROR there, by design",
)

#: the delivery suite's checks that compute on a GPU with torch
TORCH_CHECKS = {
    "gpu_burn",
    "thermal_power",
    "hbm_bandwidth",
    "pcie_bandwidth",
    "sdc",
    "nccl_allreduce",
}
#: what an environment without torch raises on ``import torch``
NO_TORCH = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"


@pytest.fixture
def without_torch(tmp_path) -> dict[str, str]:
    """An environment whose ``python -P`` cannot import torch."""
    stub = tmp_path / "no-torch" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(NO_TORCH)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), *filter(None, [env.get("PYTHONPATH")])])
    probe = subprocess.run(
        python_code_argv("import torch"),
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr, probe.stderr
    return env


def test_accept_without_torch_exits_0_with_every_gpu_check_skipped(tmp_path, without_torch):
    # storage is left out: it is fio on a real disk for a minute, has nothing to do with torch,
    # and has its own tests (test_storage_fio.py)
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "kernel_log": {"path": str(kernel_log)},
            }
        )
    )
    checks = [
        c.check
        for c in load_suite("delivery", suites_dir(load_config(config))).checks
        if c.check != "storage"
    ]
    assert TORCH_CHECKS <= set(checks)
    run = subprocess.run(
        [
            *python_module_argv("node_agent.commands.main"),
            "accept",
            "--json",
            "--only",
            ",".join(checks),
            "--config",
            str(config),
            "--out",
            str(tmp_path / "out"),
        ],
        env=without_torch,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(run.stdout)
    by_check: dict[str, list[dict]] = {}
    for r in report["results"]:
        by_check.setdefault(r["check"], []).append(r)
    assert set(by_check) == set(checks)
    assert not [r for r in report["results"] if r["status"] == "error"]
    # the host's own checks read the host, GPU or not (a pass, or a skip for what it lacks)
    host_checks = {
        "inventory",
        "rdma",
        "hca_ports",
        "host_memory",
        "host_power",
        "pcie_aer",
        "nvme_health",
        "host_cpu",
        "kernel_distress",
        "software_drift",
    }
    for check in checks:
        if check in host_checks:
            assert all(r["status"] in ("pass", "skip") for r in by_check[check]), by_check[check]
            continue
        assert all(r["status"] == "skip" for r in by_check[check]), by_check[check]
        assert all(r["detail"] for r in by_check[check])
    sdc = by_check["sdc"][0]
    assert "no NVIDIA" in sdc["detail"] and sdc["evidence"]["sm_coverage"] == 0.0
    assert report["grade"]["level"] == "HEALTHY"


def test_sdc_no_coverage_evidence_is_the_coverage_modules_none_ran():
    # sdc spells NONE_RAN's evidence out so a GPU-less host never imports torch for it
    pytest.importorskip("torch", reason="sdc.coverage needs torch to compare against")
    from node_agent.checks.sdc import NO_COVERAGE_EVIDENCE
    from node_agent.sdc.coverage import NONE_RAN

    assert NO_COVERAGE_EVIDENCE == NONE_RAN.evidence()
