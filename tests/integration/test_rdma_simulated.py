"""The rdma check under `node-agent accept --simulate` with a scenario's `hcas`: the simulated
sysfs tree and ib_write_bw stand-in (node_agent.sim.tools) are read by the real check, parser
and grading rules."""

from __future__ import annotations

import pytest

HCAS = ["mlx5_0", "mlx5_1"]


def test_healthy_hcas_pass_with_the_perftest_figures(agent, scenario):
    run = agent("accept", "--simulate", scenario(hcas=HCAS), "--only", "rdma", "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "HEALTHY"
    bw = [r for r in report["results"] if r["metric"] == "write_bw_gbps"]
    assert sorted(r["target"] for r in bw) == ["hca:mlx5_0", "hca:mlx5_1"]
    assert all(
        r["status"] == "pass"
        and r["value"] == pytest.approx(388.72, rel=1e-3)
        and r["evidence"]["source"] == "table"
        for r in bw
    )
    assert all(r["status"] == "pass" for r in report["results"])


@pytest.mark.parametrize(
    "fault, rules, target, words",
    [
        ({"kind": "hca_port_down", "hca": "mlx5_1"}, {"rdma-port-down"}, "hca:mlx5_1", "DOWN"),
        (
            {"kind": "hca_rate", "hca": "mlx5_0", "gbps": 200},
            {"rdma-port-rate-degraded", "rdma-write-bw-low"},
            "hca:mlx5_0",
            "200 Gb/sec (4X HDR)",
        ),
    ],
)
def test_degraded_hca_grades_error_naming_the_hca(agent, scenario, fault, rules, target, words):
    """A port that is down or trained low is the cable's, the switch's or the subnet
    manager's as often as the node's: ERROR (drain, restart), never a replacement at once."""
    run = agent("accept", "--simulate", scenario([fault], hcas=HCAS), "--only", "rdma", "--json")
    assert run.code == 3, run.stderr
    report = run.json()
    assert report["grade"]["level"] == "ERROR"
    assert {r["rule"] for r in report["grade"]["reasons"]} == rules
    assert {r["target"] for r in report["grade"]["reasons"]} == {target}
    assert any(words in r["message"] for r in report["grade"]["reasons"])


def test_slow_hca_grades_error_on_write_bandwidth(agent, scenario):
    run = agent(
        "accept",
        "--simulate",
        scenario([{"kind": "hca_slow", "hca": "mlx5_0", "factor": 0.5}], hcas=HCAS),
        "--only",
        "rdma",
        "--json",
    )
    assert run.code == 3, run.stderr
    (reason,) = run.json()["grade"]["reasons"]
    assert (reason["rule"], reason["target"]) == ("rdma-write-bw-low", "hca:mlx5_0")
    assert "194.4 Gb/s" in reason["message"]


def test_fault_on_an_unlisted_hca_is_a_usage_error(agent, scenario):
    run = agent(
        "accept",
        "--simulate",
        scenario([{"kind": "hca_port_down", "hca": "mlx5_3"}], hcas=HCAS),
        "--json",
    )
    assert run.code == 2
    assert "mlx5_3" in run.stderr and len(run.stderr.strip().splitlines()) == 1
