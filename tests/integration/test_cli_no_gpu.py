"""On a host without an NVIDIA driver and without NVIDIA GPUs on its PCI bus, GPU checks are
skipped with the reason, never passed. (GPUs on the bus without a driver are an ERROR: the
simulated ``driver: not_loaded`` tests in test_cli_simulated.py.)"""

from __future__ import annotations

import pytest

from node_agent.gpu import open_backend
from node_agent.gpu.pci import read_bus

_backend = open_backend()
HAS_DRIVER = _backend.unavailable_reason is None
_backend.close()
GPUS_ON_BUS = read_bus().host_gpus
pytestmark = pytest.mark.skipif(
    HAS_DRIVER or bool(GPUS_ON_BUS),
    reason="this host has a working NVIDIA driver"
    if HAS_DRIVER
    else f"this host has NVIDIA GPUs on its PCI bus ({len(GPUS_ON_BUS)})",
)


def test_inventory_json_has_empty_gpu_list(agent):
    run = agent("inventory", "--json")
    assert run.code == 0, run.stderr
    data = run.json()
    assert data["gpus"] == [] and data["unreadable_gpus"] == []
    assert data["host"]["hostname"]
    assert "no NVIDIA driver" in data["unavailable_reason"]
    assert data["pci"]["unreadable"] is not None or data["pci"]["gpus"] == []


def test_inventory_check_reads_the_host_and_says_why_there_are_no_gpus(agent):
    # issue 19: the host part was read, so the inventory is not a skip; the GPU part says why
    run = agent("accept", "--json", "--only", "inventory")
    assert run.code == 0, run.stderr
    results = run.json()["results"]
    assert [r["metric"] for r in results] == ["host", "gpus"]
    host, gpus = results
    assert host["status"] == "pass"
    assert gpus["status"] == "pass" and gpus["value"] == 0
    assert "no NVIDIA driver" in gpus["detail"] and "no NVIDIA GPU on the PCI bus" in gpus["detail"]


GPU_CHECKS = ("nvml_health", "xid", "nccl_allreduce")


def test_accept_skips_every_gpu_check_with_the_reason(agent):
    # storage (a real disk) is left out only to keep CI short; it has its own fio tests
    run = agent("accept", "--json", "--only", ",".join(("inventory", *GPU_CHECKS)))
    assert run.code == 0, run.stderr
    report = run.json()
    gpu_results = [r for r in report["results"] if r["check"] in GPU_CHECKS]
    assert {r["check"] for r in gpu_results} == set(GPU_CHECKS)
    assert all(r["status"] == "skip" for r in gpu_results)
    assert all("no NVIDIA driver" in r["detail"] for r in gpu_results)
    assert all(
        "no NVIDIA GPU on the PCI bus" in r["detail"]
        for r in gpu_results
        if r["check"] != "nccl_allreduce"
    )
    assert report["grade"]["level"] == "HEALTHY"
