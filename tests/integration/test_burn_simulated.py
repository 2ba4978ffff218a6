"""gpu_burn and thermal_power through the real `node-agent accept` on a simulated node.

The simulator injects the faults at the hardware boundary (a slow or corrupting compute device,
temperatures and throttle reasons under load); the burn's workers, verification, sibling
grading, telemetry and rules above it are the real code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from delivery_suite import (  # tests/delivery_suite.py
    HEALTHY_DELIVERY,
    PATIENT_AGENT_TIMEOUT_S,
    delivery_suite,
)

from node_agent.gpu import open_backend

ONLY = ("--only", "gpu_burn,thermal_power")


def accept(agent, scenario_path, burn_s=None):
    """``accept`` of the burn and thermal_power as the delivery suite ships them; ``burn_s``
    shortens the stand-in burn whose load thermal_power reads (tests/delivery_suite.py)."""
    suite = delivery_suite(Path(scenario_path).parent, burn_s=burn_s)
    run = agent(
        "accept",
        "--simulate",
        scenario_path,
        "--suite",
        suite,
        *ONLY,
        "--json",
        timeout=PATIENT_AGENT_TIMEOUT_S,
    )
    assert run.code in (0, 3, 4), run.stderr
    return run.json()


def results(report, check=None, metric=None, target=None):
    return [
        r
        for r in report["results"]
        if (check is None or r["check"] == check)
        and (metric is None or r["metric"] == metric)
        and (target is None or r["target"] == target)
    ]


@HEALTHY_DELIVERY
def test_healthy_node_grades_healthy_and_leaves_a_trace_per_gpu(healthy_delivery):
    """Read from the healthy node's whole delivery run (``healthy_delivery``), which burns as
    the suite ships; test_cli_simulated asserts its grade too."""
    assert healthy_delivery.code == 0, healthy_delivery.stderr
    report = healthy_delivery.json()
    assert report["grade"] == {"level": "HEALTHY", "action": "none", "reasons": []}
    assert not [r for r in results(report, "gpu_burn") + results(report, "thermal_power")
                if r["status"] != "pass"]  # fmt: skip
    tflops = [
        r
        for r in results(report, "gpu_burn")
        if r["metric"].startswith("tflops_") and r["target"] != "node"
    ]
    # the simulated suite burns the H100's CPU-capable precisions (fp8 has no CPU GEMM)
    assert {r["metric"] for r in tflops} == {
        "tflops_bf16",
        "tflops_fp16",
        "tflops_tf32",
        "tflops_fp32",
    }
    assert all(
        r["value"] > 0 and r["unit"] == "TFLOP/s" and r["evidence"]["samples"] for r in tflops
    )
    assert len(tflops) == 4 * 8
    traces = results(report, "thermal_power", "load_trace")
    assert sorted(r["target"] for r in traces) == [f"gpu:{i}" for i in range(8)]
    for r in traces:
        trace = r["evidence"]
        assert set(trace) == {
            "t_s",
            "tflops",
            "temp_c",
            "power_w",
            "sm_clock_mhz",
            "mem_temp_c",
            "throttle",
            "power_limit_w",
            "slowdown_temp_c",
        }
        assert trace["t_s"] and any(v is not None for v in trace["tflops"])
        assert trace["power_limit_w"] == 700 and trace["slowdown_temp_c"] == 90


def test_slow_gpu_warns_naming_its_figure_and_the_siblings_median(agent, scenario):
    report = accept(agent, scenario([{"kind": "slow", "gpu": 3, "factor": 0.5}]))
    assert report["grade"]["level"] in ("WARN", "ERROR", "FAULT")
    shortfalls = [
        r
        for r in results(report, "gpu_burn", target="gpu:3")
        if r["metric"].startswith("tflops_") and r["status"] in ("warn", "fail")
    ]
    assert shortfalls, "gpu:3 should be below its siblings in every precision"
    reasons = [
        x
        for x in report["grade"]["reasons"]
        if x["target"] == "gpu:3" and x["rule"].startswith("burn-throughput")
    ]
    assert reasons
    for result in shortfalls:
        figure = f"{result['value']:.4g}"
        median = f"{result['evidence']['siblings_median']:.4g}"
        assert any(figure in x["message"] and median in x["message"] for x in reasons), result
    others = {x["target"] for x in report["grade"]["reasons"] if x["rule"].startswith("burn-")}
    assert others == {"gpu:3"}


def test_sdc_gpu_has_confirmed_wrong_elements_and_grades_fault(agent, scenario):
    report = accept(agent, scenario([{"kind": "sdc", "gpu": 6}]))
    assert report["grade"]["level"] == "FAULT"
    wrong = {r["target"]: r for r in results(report, "gpu_burn", "wrong_elements")}
    assert wrong["gpu:6"]["status"] == "fail" and wrong["gpu:6"]["value"] >= 1
    assert all(r["status"] == "pass" and r["value"] == 0 for t, r in wrong.items() if t != "gpu:6")
    (reason,) = [x for x in report["grade"]["reasons"] if x["level"] == "FAULT"]
    assert reason["target"] == "gpu:6" and reason["rule"] == "burn-wrong-elements-confirmed"
    assert "wrong elements" in reason["message"] and "128x128x128" in reason["message"]


@pytest.mark.parametrize(
    "fault, words, level",
    [
        (
            {"kind": "temperature", "gpu": 0, "celsius": 95},
            ["95 °C", "slowdown threshold 90 °C"],
            "WARN",
        ),
        ({"kind": "throttle", "gpu": 2, "reasons": ["hw_slowdown"]}, ["hw_slowdown"], "ERROR"),
    ],
    ids=["temperature", "hw_slowdown"],
)
def test_heat_or_hw_throttle_under_load_names_the_gpu_and_reason(
    agent, scenario, fault, words, level
):
    # about thermal_power's grading under the burn's load, not the burn: a 1 s stand-in burn
    # (6 s as shipped) loads every GPU and its telemetry shows the fault as the long one does
    report = accept(agent, scenario([fault]), burn_s=1)
    target = f"gpu:{fault['gpu']}"
    assert report["grade"]["level"] == level
    load = [x for x in report["grade"]["reasons"] if x["rule"].startswith("load-")]
    assert {x["target"] for x in load} == {target}
    assert any(all(w in x["message"] for w in words) for x in load), load


def test_thermal_power_runs_its_own_burn_when_gpu_burn_did_not_run(agent, scenario):
    path = scenario(gpus=4)
    suite = delivery_suite(Path(path).parent)
    run = agent(
        "accept",
        "--simulate",
        path,
        "--suite",
        suite,
        "--only",
        "thermal_power",
        "--json",
        timeout=PATIENT_AGENT_TIMEOUT_S,
    )
    assert run.code == 0, run.stderr
    report = run.json()
    traces = results(report, "thermal_power", "load_trace")
    assert len(traces) == 4 and "its own" in traces[0]["detail"]
    assert report["grade"]["level"] == "HEALTHY"


_backend = open_backend()
HAS_DRIVER = _backend.unavailable_reason is None
_backend.close()


@pytest.mark.skipif(HAS_DRIVER, reason="this host has a working NVIDIA driver")
def test_without_gpus_and_without_simulation_both_checks_skip_with_the_reason(agent):
    run = agent("accept", *ONLY, "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert {r["check"] for r in report["results"]} == {"gpu_burn", "thermal_power"}
    assert all(
        r["status"] == "skip" and "no NVIDIA driver" in r["detail"] for r in report["results"]
    )
    assert report["grade"]["level"] == "HEALTHY"
