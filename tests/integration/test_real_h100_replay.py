"""The real GPUs the agent ran on, replayed both ways in every test run, graded as their
oracles say: the first (scenarios/real/h100-sxm5-vm.yaml, converted from
../shared/realworld/gpu-h100-vm/: one H100 SXM5 passed through to a VM, every NVLink call Not
Supported, healthy; the agent once graded it FAULT, replace) and an H200 captured by
``node-agent capture`` (../shared/realworld/gpu-h200-vm/capture.yaml, read where it lies: one
H200 passed through to a VM, healthy; its oracle is its PROVENANCE.md's, written out below),
and a second H200, captured by this round's recorder (scenarios/real/h200-sxm-vm.yaml, its oracle in it).

Both ways: ``--simulate`` (the capture's NVML replayed through the real NVML backend in
Python) and the stand-in ``libnvidia-ml.so.1`` serving it (``NVML_FAKE_SCENARIO``: the real
nvidia-ml-py through ctypes). NVML is the one thing not real: no GPU runs here. The oracle is
read from the H100's scenario (``capture.oracle``, written from PROVENANCE.md by the
converter) and is the same for the H200:

* with ``node.expected_gpus: 1`` declared: HEALTHY, alike both ways (level, reasons, exit code);
* with nothing declared: at most WARN, never ERROR or FAULT; a WARN names the setting to declare.

``check`` (the quick suite) and ``accept --only inventory,nvml_health,xid`` (the delivery
suite's host checks; its load tests are simulated on the CPU and have their own tests).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

SCENARIO = harness.REPO / "scenarios" / "real" / "h100-sxm5-vm.yaml"
ORACLE = yaml.safe_load(SCENARIO.read_text())["capture"]["oracle"]
H200_CAPTURE = harness.REPO.parent / "shared" / "realworld" / "gpu-h200-vm" / "capture.yaml"
#: ../shared/realworld/gpu-h200-vm/PROVENANCE.md: "`node.expected_gpus: 1` declared: HEALTHY.
#: Nothing declared: at most WARN, naming what could not be verified. Never ERROR or FAULT."
H200_ORACLE = {
    "declared": {"node.expected_gpus": 1, "grade": "HEALTHY"},
    "undeclared": {"at_most": "WARN", "never": ["ERROR", "FAULT"]},
}
#: another H200, captured with this round's recorder (the fabric and the per-link calls included)
#: and kept in the repository with its oracle (scenarios/real/h200-sxm-vm.yaml)
H200_TODAY = harness.REPO / "scenarios" / "real" / "h200-sxm-vm.yaml"
H200_TODAY_ORACLE = yaml.safe_load(H200_TODAY.read_text())["capture"]["oracle"]
#: name -> (scenario, oracle, the GPU's NVML name)
CAPTURES = {
    "h100": (SCENARIO, ORACLE, "NVIDIA H100 80GB HBM3"),
    "h200": (H200_CAPTURE, H200_ORACLE, "NVIDIA H200"),
    "h200-today": (H200_TODAY, H200_TODAY_ORACLE, "NVIDIA H200"),
}
ORDER = ["HEALTHY", "WARN", "ERROR", "FAULT"]
EXIT = {"HEALTHY": 0, "WARN": 0, "ERROR": 3, "FAULT": 4}
COMMANDS = {
    "check": ("check",),
    "accept": ("accept", "--only", "inventory,nvml_health,xid"),
}


@pytest.fixture(scope="module")
def nvml_fake_lib():
    return harness.build()


@pytest.fixture(params=sorted(CAPTURES))
def capture(request) -> tuple:
    scenario, oracle, name = CAPTURES[request.param]
    if not scenario.is_file():
        pytest.skip(f"the real capture is not here: {scenario}")
    return scenario, oracle, name


def _config(tmp_path: Path, oracle: dict, declared: bool) -> Path:
    log = tmp_path / "kernel.log"  # the host's kernel log is not the captured node's
    log.write_text("")
    node = {"expected_gpus": oracle["declared"]["node.expected_gpus"]} if declared else {}
    path = tmp_path / f"config-{'declared' if declared else 'undeclared'}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "node": node,
                "kernel_log": {"path": str(log)},
                "nvml": {"call_timeout_s": 5},
            }
        )
    )
    return path


def _graded(tmp_path: Path, capture: tuple, command: str, config: Path, simulate: bool) -> tuple:
    scenario, _oracle, gpu_name = capture
    args = [*COMMANDS[command], "--json", "--config", str(config)]
    if command == "accept":
        args += ["--out", str(tmp_path / "out")]
    proc = harness.run_agent(args, scenario, simulate=simulate, cwd=tmp_path)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["gpus"]) == 1 and report["gpus"][0]["name"] == gpu_name
    grade = report["grade"]
    reasons = sorted((r["rule"], r["target"], r["level"]) for r in grade["reasons"])
    return proc.returncode, grade["level"], reasons, grade["reasons"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_real_gpu_with_its_gpu_count_declared_grades_healthy_both_ways(
    nvml_fake_lib, tmp_path, capture, command
):
    oracle = capture[1]
    config = _config(tmp_path, oracle, declared=True)
    simulated = _graded(tmp_path, capture, command, config, simulate=True)
    stand_in = _graded(tmp_path, capture, command, config, simulate=False)
    level = oracle["declared"]["grade"]
    assert simulated[:3] == (EXIT[level], level, []), simulated[3]
    assert stand_in[:3] == simulated[:3], stand_in[3]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_real_gpu_with_nothing_declared_is_at_most_warn_never_error_or_fault(
    nvml_fake_lib, tmp_path, capture, command
):
    oracle = capture[1]
    config = _config(tmp_path, oracle, declared=False)
    graded = []
    for simulate in (True, False):
        code, level, rules, reasons = _graded(tmp_path, capture, command, config, simulate)
        assert level not in oracle["undeclared"]["never"], reasons
        assert ORDER.index(level) <= ORDER.index(oracle["undeclared"]["at_most"]), reasons
        assert code == EXIT[level]
        for reason in reasons:  # what could not be verified, and what to declare
            assert reason["level"] == "WARN" and "node.expected_" in reason["message"], reason
        graded.append((code, level, rules))
    simulated, stand_in = graded
    assert simulated == stand_in  # the capture is that host both ways: the same WARN
    assert simulated[1] == "WARN" and ("gpu-count-unconfirmed", "node", "WARN") in simulated[2]
