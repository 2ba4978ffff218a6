"""On a host without an NVIDIA driver, GPU checks are skipped with the reason, never passed."""

from __future__ import annotations

import pytest

from node_agent.gpu import open_backend

_backend = open_backend()
HAS_DRIVER = _backend.unavailable_reason is None
_backend.close()
pytestmark = pytest.mark.skipif(HAS_DRIVER, reason="this host has a working NVIDIA driver")


def test_inventory_json_has_empty_gpu_list(agent):
    run = agent("inventory", "--json")
    assert run.code == 0, run.stderr
    data = run.json()
    assert data["gpus"] == []
    assert data["host"]["hostname"]


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
    assert report["grade"]["level"] == "HEALTHY"
