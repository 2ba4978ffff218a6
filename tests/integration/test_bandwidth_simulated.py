"""hbm_bandwidth and pcie_bandwidth through the real `node-agent accept` on a simulated node.

The checks run their real code on CPU stand-ins at the suite's `simulated` sizes; a `slow` GPU's
clock runs slow at the compute boundary (node_agent.compute.devices), and the PCIe link comes from the
simulated NVML. Grading is the real graders/ rules.
"""

from __future__ import annotations

import pytest

from node_agent.gpu import open_backend

ONLY = ("--only", "hbm_bandwidth,pcie_bandwidth")
METRICS = {"hbm_bandwidth": {"copy_gbps"},
           "pcie_bandwidth": {"h2d_gbps", "d2h_gbps", "h2d_gbps_concurrent",
                              "d2h_gbps_concurrent", "pcie_link_under_load"}}


def results(report, check, metric=None):
    return [r for r in report["results"]
            if r["check"] == check and (metric is None or r["metric"] == metric)]


def test_healthy_node_measures_every_gpu_and_grades_healthy(agent, scenario):
    run = agent("accept", "--simulate", scenario(), *ONLY, "--json", timeout=240)
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"] == {"level": "HEALTHY", "action": "none", "reasons": []}
    for check, metrics in METRICS.items():
        found = results(report, check)
        assert {r["metric"] for r in found} == metrics
        for metric in metrics:
            assert sorted(r["target"] for r in results(report, check, metric)) == \
                [f"gpu:{i}" for i in range(8)], (check, metric)
    for r in report["results"]:
        assert r["status"] == "pass", r
        if r["unit"] == "GB/s":
            assert r["value"] > 0
            assert r["evidence"]["siblings_median"] > 0
    copy = results(report, "hbm_bandwidth", "copy_gbps")[0]["evidence"]
    assert copy["bytes_per_copy"] == 2 * copy["size_bytes"]
    assert copy["max_gbps"] >= copy["median_gbps"]
    h2d = results(report, "pcie_bandwidth", "h2d_gbps")[0]["evidence"]
    assert h2d["pinned"] is False and "not pinned" in h2d["note"]
    assert h2d["link_under_load"] == "Gen5 x16"
    together = results(report, "pcie_bandwidth", "h2d_gbps_concurrent")[0]
    assert together["evidence"]["gpus_together"] == 8
    assert "not graded" in together["detail"]


def test_slow_gpu_grades_warn_or_worse_naming_gpu_and_both_figures(agent, scenario):
    run = agent("accept", "--simulate", scenario([{"kind": "slow", "gpu": 3, "factor": 0.5}]),
                *ONLY, "--json", timeout=240)
    report = run.json()
    assert report["grade"]["level"] in ("WARN", "ERROR", "FAULT")
    assert {r["target"] for r in report["grade"]["reasons"]} == {"gpu:3"}
    fired = {r["rule"]: r for r in report["grade"]["reasons"]}
    assert {"memory-bandwidth-low", "pcie-bandwidth-low"} <= set(fired)
    copy = {r["target"]: r for r in results(report, "hbm_bandwidth", "copy_gbps")}
    slow = copy["gpu:3"]
    message = fired["memory-bandwidth-low"]["message"]
    assert f"{slow['value']:.4g} GB/s" in message
    assert f"siblings' median {slow['evidence']['siblings_median']:.4g} GB/s" in message
    assert slow["evidence"]["ratio_to_siblings"] < 0.8
    assert all(r["status"] == "pass" for t, r in copy.items() if t != "gpu:3")


def test_pcie_link_trained_narrow_under_load_is_fault(agent, scenario):
    run = agent("accept", "--simulate", scenario([{"kind": "pcie_width", "gpu": 4, "lanes": 8}]),
                "--only", "pcie_bandwidth", "--json", timeout=240)
    assert run.code == 4, run.stderr
    report = run.json()
    (reason,) = [r for r in report["grade"]["reasons"]
                 if r["rule"] == "pcie-link-degraded-under-load"]
    assert reason["target"] == "gpu:4" and "x8 of x16" in reason["message"]
    (link,) = [r for r in results(report, "pcie_bandwidth", "pcie_link_under_load")
               if r["target"] == "gpu:4"]
    assert link["evidence"]["copies_in_flight"] >= 1


_backend = open_backend()
_HAS_DRIVER = _backend.unavailable_reason is None
_backend.close()


@pytest.mark.skipif(_HAS_DRIVER, reason="this host has a working NVIDIA driver")
def test_without_gpus_or_simulation_both_checks_skip_with_the_reason(agent):
    run = agent("accept", *ONLY, "--json", timeout=120)
    assert run.code == 0, run.stderr
    report = run.json()
    assert {r["check"] for r in report["results"]} == set(METRICS)
    assert all(r["status"] == "skip" and "no NVIDIA driver" in r["detail"]
               for r in report["results"])
    assert report["grade"]["level"] == "HEALTHY"
