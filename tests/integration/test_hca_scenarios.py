"""The hca_ports check through the real `node-agent` command on simulated nodes.

A scenario's ``hcas`` become a sysfs tree (node_agent.sim.tools) that the real check reads,
with its state kept in the test's state directory between runs as the daemon keeps it; the
simulated node booted an hour before its scenario file was written, so counters given a rate
(``hca_errors``) grow from one run to the next. The grade comes from the shipped rules. No RDMA
hardware exists on CI: the sysfs tree is the stand-in.
"""

from __future__ import annotations

import yaml

HCAS = [f"mlx5_{n}" for n in range(8)]  # HGX H100: 8 compute-fabric ports (graders/hca.yaml)


def service_suite(tmp_path) -> str:
    """The check alone, in service mode (what the quick and periodic suites run)."""
    path = tmp_path / "hca-suite.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "hca",
                "description": "hca_ports alone",
                "mode": "service",
                "checks": [{"check": "hca_ports", "timeout_s": 15}],
            }
        )
    )
    return str(path)


def reasons(run):
    return {(r["rule"], r["target"]) for r in run.json()["grade"]["reasons"]}


def test_healthy_node_stays_healthy_three_runs(agent, scenario, tmp_path):
    path = scenario(hcas=HCAS)
    suite = service_suite(tmp_path)
    for _ in range(3):
        run = agent("check", "--simulate", path, "--suite", suite, "--json")
        assert run.code == 0, run.stderr
        report = run.json()
        assert report["grade"]["level"] == "HEALTHY", report["grade"]
        assert {r["status"] for r in report["results"]} == {"pass"}
    ports = [r for r in report["results"] if r["metric"] == "link_state"]
    assert sorted(r["target"] for r in ports) == [f"hca:{h}" for h in HCAS]
    rates = [r for r in report["results"] if r["metric"] == "error_rates"]
    assert all(r["evidence"]["rates_per_hour"] for r in rates)  # later runs rate, not baseline


def test_healthy_node_at_delivery_is_healthy(agent, scenario):
    run = agent("accept", "--simulate", scenario(hcas=HCAS), "--only", "hca_ports", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["grade"]["level"] == "HEALTHY"


def test_port_down_grades_error_naming_the_hca(agent, scenario, tmp_path):
    path = scenario([{"kind": "hca_port_down", "hca": "mlx5_3"}], hcas=HCAS)
    run = agent("check", "--simulate", path, "--suite", service_suite(tmp_path), "--json")
    assert run.code == 3, run.stderr
    assert run.json()["grade"]["level"] == "ERROR"
    assert reasons(run) == {("hca-port-down", "hca:mlx5_3")}


def test_port_at_the_wrong_rate_grades_error(agent, scenario):
    path = scenario([{"kind": "hca_rate", "hca": "mlx5_6", "gbps": 200}], hcas=HCAS)
    run = agent("accept", "--simulate", path, "--only", "hca_ports", "--json")
    assert run.code == 3, run.stderr
    assert reasons(run) == {("hca-port-rate", "hca:mlx5_6")}


def test_flapping_port_grades_warn_naming_the_hca(agent, scenario, tmp_path):
    path = scenario([{"kind": "hca_flap", "hca": "mlx5_1", "count": 3}], hcas=HCAS)
    suite = service_suite(tmp_path)
    for _ in range(2):  # the flaps stay in the 12-hour window: WARN, not a one-run blip
        run = agent("check", "--simulate", path, "--suite", suite, "--json")
        assert run.code == 0, run.stderr
        assert run.json()["grade"]["level"] == "WARN"
        assert reasons(run) == {("hca-port-flapping", "hca:mlx5_1")}


def test_port_that_keeps_flapping_grades_error(agent, scenario, tmp_path):
    path = scenario(
        [{"kind": "hca_errors", "hca": "mlx5_2", "counter": "link_downed", "per_hour": 1_000_000}],
        hcas=HCAS,
    )
    suite = service_suite(tmp_path)
    first = agent("check", "--simulate", path, "--suite", suite, "--json")
    assert first.code == 0, first.stderr
    assert reasons(first) == {("hca-port-flapping", "hca:mlx5_2")}
    second = agent("check", "--simulate", path, "--suite", suite, "--json")
    assert second.code == 3, second.stderr
    assert reasons(second) == {("hca-port-flapping-persistent", "hca:mlx5_2")}


def test_error_counter_growing_fast_grades_error_on_the_next_run(agent, scenario, tmp_path):
    path = scenario(
        [{"kind": "hca_errors", "hca": "mlx5_4", "counter": "symbol_error", "per_hour": 1e9}],
        hcas=HCAS,
    )
    suite = service_suite(tmp_path)
    first = agent("check", "--simulate", path, "--suite", suite, "--json")
    assert first.code == 0 and first.json()["grade"]["level"] == "HEALTHY"  # a baseline
    second = agent("check", "--simulate", path, "--suite", suite, "--json")
    assert second.code == 3, second.stderr
    assert reasons(second) == {("hca-error-rate-high", "hca:mlx5_4")}


def test_mlx5_module_over_temperature_grades_error_naming_the_hca(agent, scenario, tmp_path):
    line = (
        "mlx5_core 0000:0c:00.5: mlx5_port_module_event:1131:(pid 0): Port module "
        "event[error]: module 0, Cable error, High Temperature"
    )
    path = scenario([{"kind": "kernel_log", "line": line}], hcas=HCAS)
    run = agent("check", "--simulate", path, "--suite", service_suite(tmp_path), "--json")
    assert run.code == 3, run.stderr
    assert reasons(run) == {("mlx5-module-temperature", "hca:mlx5_5")}


def test_unknown_counter_in_hca_errors_is_a_usage_error(agent, scenario):
    path = scenario(
        [{"kind": "hca_errors", "hca": "mlx5_0", "counter": "bogus", "per_hour": 1}], hcas=HCAS
    )
    run = agent("accept", "--simulate", path, "--only", "hca_ports", "--json")
    assert run.code == 2
    assert "counter" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_shipped_healthy_h100_with_two_hcas_is_healthy(agent, tmp_path):
    """scenarios/healthy-h100.yaml carries two NDR HCAs, fewer than a DGX's 8: the server's
    build, not a fault (the count is evidence until the check's `ports` param declares it)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scenarios" / "healthy-h100.yaml"
    run = agent("check", "--simulate", str(path), "--suite", service_suite(tmp_path), "--json")
    assert run.code == 0, run.stderr
    assert run.json()["grade"]["level"] == "HEALTHY"
    (count,) = [r for r in run.json()["results"] if r["metric"] == "port_count"]
    assert (count["value"], count["evidence"]["expected"]) == (2, 8)
