"""The agent on the stand-in libnvidia-ml.so.1, without --simulate, grades like --simulate.

``node-agent`` runs as a subprocess with ``LD_LIBRARY_PATH=build/nvml-fake`` and
``NVML_FAKE_SCENARIO=<scenario.yaml>``: the real NVML backend, the real nvidia-ml-py and its
ctypes structs, against the C library built from NVIDIA's nvml.h (tests/nvml_fake). Every
NVML-level fault kind of docs/simulation.md must give the same grade level, the same graded
targets and the same exit code as the same scenario under ``--simulate``, and the same GPUs.

XIDs: under ``--simulate`` they are also kernel-log lines; through the stand-in they are NVML
events only (the kernel log is this host's), so the suites here watch NVML events briefly
(``xid`` with ``watch_s``), as the daemon always does.

The PCI bus is this host's too (no NVIDIA GPU on it here), so where a grade rests on the bus
(``pci_only``, ``driver: not_loaded``) only the level and exit code are compared, and the
bus's part of the reasons is named (BUS_SCENARIOS).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from node_agent.sim.nvml_state import NVML_FAULT_KINDS, Switch, render_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

# docs/simulation.md's NVML-level faults on an 8-GPU HGX H100, with the level each must grade
SCENARIOS = {
    "healthy": ([], "HEALTHY"),
    "xid": ([{"kind": "xid", "gpu": 5, "code": 79}], "ERROR"),
    "xid_software": ([{"kind": "xid", "gpu": 1, "code": 13}], "WARN"),
    "row_remap_pending": ([{"kind": "row_remap_pending", "gpu": 2}], "ERROR"),
    "row_remap_failure": ([{"kind": "row_remap_failure", "gpu": 2}], "FAULT"),
    "ecc_dbe_volatile": ([{"kind": "ecc_dbe_volatile", "gpu": 1, "count": 2}], "ERROR"),
    "ecc_sbe_volatile": ([{"kind": "ecc_sbe_volatile", "gpu": 1, "count": 5000}], "WARN"),
    "ecc_sram_uncorrectable": (
        [{"kind": "ecc_sram_uncorrectable", "gpu": 1, "count": 2, "unit": "sm"}],
        "WARN",
    ),
    "sram_threshold_exceeded": (
        [
            {"kind": "ecc_sram_uncorrectable", "gpu": 4, "count": 5},
            {"kind": "sram_threshold_exceeded", "gpu": 4},
        ],
        "FAULT",
    ),
    "memory_total": ([{"kind": "memory_total", "gpu": 6, "mib": 40960}], "WARN"),
    "missing_gpu": ([{"kind": "missing_gpu", "gpu": 7}], "ERROR"),
    "gpu_lost": ([{"kind": "gpu_lost", "gpu": 3}], "ERROR"),
    "driver_hang": ([{"kind": "driver_hang", "gpu": 3}], "ERROR"),
    "temperature": ([{"kind": "temperature", "gpu": 0, "celsius": 95}], "FAULT"),
    "pcie_width": ([{"kind": "pcie_width", "gpu": 4, "lanes": 8}], "ERROR"),
    "throttle": ([{"kind": "throttle", "gpu": 2, "reasons": ["hw_slowdown"]}], "WARN"),
    "nvlink_down": ([{"kind": "nvlink_down", "gpu": 6, "link": 3}], "ERROR"),
    "recovery_action": ([{"kind": "recovery_action", "gpu": 1, "action": "gpu_reset"}], "ERROR"),
    "persistence_off": ([{"kind": "persistence_off", "gpu": 0}], "WARN"),
    "spin": ([{"kind": "spin", "gpu": 4}], "HEALTHY"),
    "faulty_h100": (
        yaml.safe_load((harness.REPO / "scenarios" / "faulty-h100.yaml").read_text())["faults"],
        "FAULT",
    ),
}
# Scenarios whose grade rests on the PCI bus as well as NVML: (scenario keys, level, the rules
# only --simulate's bus gives, the rules only this host's bus gives)
BUS_SCENARIOS = {
    # NVML enumerates 7 GPUs both ways; only the simulated bus shows the 8th by its bus id, so
    # only there is it a GPU the driver did not initialise (restarted first); on this host's bus
    # it is missing altogether
    "pci_only": (
        {"faults": [{"kind": "pci_only", "gpu": 3}]},
        "ERROR",
        {
            ("gpu-not-enumerated", "pci:0000:5d:00.0", "ERROR"),
            ("gpu-count-unconfirmed", "node", "WARN"),
        },
        {("gpu-missing", "node", "ERROR")},
    ),
    # nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED both ways; GPUs on the simulated bus
    # make it driver-not-loaded, a bus without them a broken driver: ERROR either way
    "driver_not_loaded": (
        {"driver": "not_loaded"},
        "ERROR",
        {("driver-not-loaded", "node", "ERROR")},
        {("gpu-driver-broken", "node", "ERROR")},
    ),
}
EXIT = {"HEALTHY": 0, "WARN": 0, "ERROR": 3, "FAULT": 4}
XID_WATCH = {"check": "xid", "timeout_s": 15, "params": {"since": "boot", "watch_s": 0.3}}


def test_every_nvml_level_fault_kind_is_compared():
    """Here on an HGX H100, or (the NVLink fabric's faults, which need a GB200 tray) in
    test_nvlink_fabric_scenarios.py, which grades those scenarios both ways."""
    from test_nvlink_fabric_scenarios import GRADED

    kinds = {f["kind"] for faults, _ in SCENARIOS.values() for f in faults}
    kinds |= {f["kind"] for keys, *_ in BUS_SCENARIOS.values() for f in keys.get("faults", [])}
    for name in GRADED:
        data = yaml.safe_load((harness.REPO / "scenarios" / name).read_text())
        kinds |= {f["kind"] for f in data.get("faults") or []}
    assert NVML_FAULT_KINDS <= kinds, NVML_FAULT_KINDS - kinds


@pytest.fixture(scope="module")
def nvml_fake_lib():
    return harness.build()


@pytest.fixture
def node(nvml_fake_lib, tmp_path):
    """A config, suites that watch NVML Xid events, and a runner for both ways of simulating."""

    class Node:
        config = tmp_path / "config.yaml"
        quick = tmp_path / "quick-events.yaml"
        delivery = tmp_path / "delivery-events.yaml"

        def scenario(self, faults, **keys) -> Path:
            path = tmp_path / "scenario.yaml"
            path.write_text(
                yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": list(faults), **keys})
            )
            return path

        def run(
            self, *args: str, scenario: Path, simulate: bool, timeout: float = 120
        ) -> subprocess.CompletedProcess:
            argv = [
                sys.executable,
                "-m",
                "node_agent.commands.main",
                *args,
                "--config",
                str(self.config),
            ]
            if simulate:
                env = harness.agent_env()
                env.pop("LD_LIBRARY_PATH")
                argv += ["--simulate", str(scenario)]
            else:
                env = harness.agent_env(scenario=scenario)
            return subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
            )

    n = Node()
    # call_timeout_s: the library renders the scenario (a Python start) inside nvmlInit
    n.config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "nvml": {"call_timeout_s": 3}})
    )
    for path, shipped in ((n.quick, "quick"), (n.delivery, "delivery")):
        suite = yaml.safe_load((harness.REPO / "suites" / f"{shipped}.yaml").read_text())
        suite["name"] = f"{shipped}-events"
        suite["checks"] = [XID_WATCH if c["check"] == "xid" else c for c in suite["checks"]]
        path.write_text(yaml.safe_dump(suite))
    return n


def _graded(proc: subprocess.CompletedProcess) -> tuple[int, str, list[tuple[str, str, str]]]:
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    grade = report["grade"]
    reasons = sorted({(r["rule"], r["target"], r["level"]) for r in grade["reasons"]})
    return proc.returncode, grade["level"], reasons


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_on_the_stand_in_library_grades_like_simulate(node, name):
    faults, level = SCENARIOS[name]
    scenario = node.scenario(faults)
    args = ("check", "--suite", str(node.quick), "--json")
    simulated = node.run(*args, scenario=scenario, simulate=True)
    real = node.run(*args, scenario=scenario, simulate=False)
    assert _graded(real) == _graded(simulated), real.stderr
    assert _graded(real)[:2] == (EXIT[level], level)
    report = json.loads(real.stdout)
    assert report["simulated"] is False and report["host"]["gpu_backend"] == "nvml"


@pytest.mark.parametrize("name", sorted(BUS_SCENARIOS))
def test_check_on_the_stand_in_library_grades_a_bus_dependent_fault_at_the_same_level(node, name):
    keys, level, sim_only, nvml_only = BUS_SCENARIOS[name]
    sim_want, real_want = level if isinstance(level, tuple) else (level, level)
    keys = dict(keys)
    scenario = node.scenario(keys.pop("faults", []), **keys)
    args = ("check", "--suite", str(node.quick), "--json")
    sim_rc, sim_level, sim_reasons = _graded(node.run(*args, scenario=scenario, simulate=True))
    real = node.run(*args, scenario=scenario, simulate=False)
    rc, real_level, real_reasons = _graded(real)
    assert (sim_rc, sim_level) == (EXIT[sim_want], sim_want)
    assert (rc, real_level) == (EXIT[real_want], real_want), real.stderr
    assert set(sim_reasons) - set(real_reasons) == sim_only
    assert set(real_reasons) - set(sim_reasons) == nvml_only


@pytest.mark.parametrize(
    "name", ["healthy", "faulty_h100", "gpu_lost", "missing_gpu", "sram_threshold_exceeded"]
)
def test_accept_nvml_checks_on_the_stand_in_library_grade_like_simulate(node, name):
    faults, _ = SCENARIOS[name]
    scenario = node.scenario(faults)
    args = (
        "accept",
        "--suite",
        str(node.delivery),
        "--only",
        "inventory,nvml_health,xid",
        "--json",
        "--out",
        str(node.config.parent / "out"),
    )
    simulated = node.run(*args, scenario=scenario, simulate=True)
    real = node.run(*args, scenario=scenario, simulate=False)
    assert _graded(real) == _graded(simulated), real.stderr
    assert {r["check"] for r in json.loads(real.stdout)["results"]} == {
        "inventory",
        "nvml_health",
        "xid",
    }


# Captures (docs/capture.md) replay both ways too: a simulated node captured through the
# recorder, then graded from the capture with --simulate and through the stand-in. (An Xid's
# NVML event is not replayed, its kernel-log line is: the stand-in's kernel log is this host's,
# so the captured faults here are NVML readings.)
CAPTURED = {
    "healthy": [],
    "hardware": [
        {"kind": "row_remap_failure", "gpu": 2},
        {"kind": "pcie_width", "gpu": 4, "lanes": 8},
        {"kind": "nvlink_down", "gpu": 6, "link": 3},
        {"kind": "temperature", "gpu": 0, "celsius": 95},
    ],
    "recoverable": [
        {"kind": "recovery_action", "gpu": 1, "action": "gpu_reset"},
        {"kind": "persistence_off", "gpu": 0},
    ],
}


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_a_captured_node_grades_alike_through_simulate_and_the_stand_in(node, name):
    source = node.scenario(CAPTURED[name])
    captured = node.config.parent / "captured.yaml"
    run = node.run("capture", str(captured), scenario=source, simulate=True)
    assert run.returncode == 0, run.stderr
    args = ("check", "--suite", str(node.quick), "--json")
    original = node.run(*args, scenario=source, simulate=True)
    simulated = node.run(*args, scenario=captured, simulate=True)
    real = node.run(*args, scenario=captured, simulate=False)
    assert _graded(real) == _graded(simulated) == _graded(original), real.stderr
    level = {"healthy": "HEALTHY", "hardware": "FAULT", "recoverable": "ERROR"}[name]
    assert _graded(real)[:2] == (EXIT[level], level)


def test_check_where_no_gpu_reports_xid_events_skips_the_watch_and_grades_healthy(node):
    scenario = node.scenario([])
    state = node.config.parent / "nvml.state"
    render_file(scenario, state, [Switch("unsupported", "nvmlDeviceRegisterEvents")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "node_agent.commands.main",
            "check",
            "--suite",
            str(node.quick),
            "--json",
            "--config",
            str(node.config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness.agent_env(state=state),
        cwd=node.config.parent,
    )
    assert _graded(proc) == (0, "HEALTHY", []), proc.stderr
    (skip,) = [r for r in json.loads(proc.stdout)["results"] if r["metric"] == "nvml_events"]
    assert skip["status"] == "skip" and "no GPU here reports Xid events" in skip["detail"]


def _gpus(proc: subprocess.CompletedProcess) -> list[tuple]:
    assert proc.returncode == 0, proc.stderr
    inventory = json.loads(proc.stdout)
    return [
        (g["index"], g["uuid"], g["pci_bus_id"], g["name"], g.get("sku")) for g in inventory["gpus"]
    ]


@pytest.mark.parametrize("name", ["healthy", "missing_gpu", "gpu_lost", "faulty_h100"])
def test_inventory_on_the_stand_in_library_lists_the_same_gpus_as_simulate(node, name):
    faults, _ = SCENARIOS[name]
    scenario = node.scenario(faults)
    simulated = node.run("inventory", "--json", scenario=scenario, simulate=True)
    real = node.run("inventory", "--json", scenario=scenario, simulate=False)
    assert _gpus(real) == _gpus(simulated)
    assert len(_gpus(real)) == (7 if name in ("missing_gpu", "gpu_lost") else 8)
    host_real, host_sim = json.loads(real.stdout)["host"], json.loads(simulated.stdout)["host"]
    assert (host_real["driver"], host_real["cuda"]) == (host_sim["driver"], host_sim["cuda"])
    assert host_real["gpu_backend"] == "nvml"


# -- the daemon: faults injected while it runs ----------------------------------------------------


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def _wait(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    return predicate()


def test_daemon_on_the_stand_in_library_sees_an_xid_and_a_lost_gpu_injected_while_running(
    nvml_fake_lib, tmp_path
):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"listen": f"127.0.0.1:{port}", "xid_poll_s": 0.2},
            }
        )
    )
    suite = tmp_path / "periodic.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "mode": "service",
                "checks": [{"check": "nvml_health", "timeout_s": 10, "every_s": 1}],
            }
        )
    )
    scenario, state = tmp_path / "scenario.yaml", tmp_path / "nvml.state"

    def inject(faults):  # what a test does to the node under a running daemon
        scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults}))
        render_file(scenario, state)

    inject([])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node_agent.commands.main",
            "daemon",
            "--config",
            str(config),
            "--suite",
            str(suite),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=harness.agent_env(state=state),
        cwd=tmp_path,
    )
    try:
        assert _wait(
            lambda: _metric(_scrape(port), "node_agent_gpu_temperature_celsius", gpu="3") == 38, 30
        ), _scrape(port) or "daemon not up"
        assert _metric(_scrape(port), "node_agent_health_level") == 0
        inject([{"kind": "xid", "gpu": 5, "code": 79}])
        assert _wait(
            lambda: _metric(_scrape(port), "node_agent_gpu_xid_errors_total", gpu="5", code="79"),
            10,
        ), _scrape(port)
        assert _wait(lambda: _metric(_scrape(port), "node_agent_health_level") == 2, 10)  # ERROR
        inject([{"kind": "xid", "gpu": 5, "code": 79}, {"kind": "gpu_lost", "gpu": 3}])
        assert _wait(
            lambda: (
                _metric(
                    _scrape(port), "node_agent_check_status", check="nvml_health", status="fail"
                )
                == 1
            ),
            10,
        )
        assert (
            _metric(_scrape(port), "node_agent_gpu_xid_errors_total", gpu="5", code="79") == 1
        )  # the Xid came once
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
