"""Simulated HCAs (node_agent.sim.tools): the sysfs tree and the ib_write_bw stand-in are read
by the rdma check's real discovery, subprocess and parser code."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checks import rdma
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.hardware.sku import load_skus
from node_agent.host import infiniband
from node_agent.model import Status
from node_agent.parsers.perftest import parse_bw_table
from node_agent.sim import tools as sim_tools
from node_agent.sim.node import stand_in_ports
from node_agent.sim.scenario import load_scenario
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
SKUS = load_skus(REPO / "graders")


def _scenario(tmp_path, faults=(), hcas=("mlx5_0", "mlx5_1"), sku="h100-sxm5-80gb"):
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump({"sku": sku, "gpus": 8, "hcas": list(hcas), "faults": list(faults)})
    )
    return load_scenario(path, SKUS)


def _ctx(scenario, **params):
    return CheckContext(
        check="rdma",
        gpu=AbsentGpuBackend("no GPU"),
        kernel_log=None,
        config=config_from_dict({}),
        inventory=None,
        sku=SKUS[scenario.sku],
        expected_gpus=None,
        ports=stand_in_ports(scenario, SKUS[scenario.sku], AbsentGpuBackend("no GPU")),
        params={"server_start_s": 0, **params},
    )


@pytest.mark.parametrize(
    "sku, rate", [("h100-sxm5-80gb", 400.0), ("h200-sxm-141gb", 400.0), ("a100-sxm4-80gb", 200.0)]
)
def test_simulated_hca_rate_follows_the_sku(sku, rate):
    assert sim_tools.healthy_rate_gbps(SKUS[sku]) == rate


def test_sysfs_tree_is_read_by_the_real_discovery(tmp_path):
    sim = sim_tools.rdma_tools(_scenario(tmp_path), SKUS["h100-sxm5-80gb"], tmp_path / "w")
    ports = infiniband.discover(sim.sysfs_root)
    assert [(p.device, p.state, p.phys_state, p.rate_text, p.link_layer) for p in ports] == [
        (d, "ACTIVE", "LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand") for d in ("mlx5_0", "mlx5_1")
    ]
    assert ports[0].counters == {"link_downed": 0, "symbol_error": 0, "port_rcv_errors": 0}


@pytest.mark.parametrize("flags, unit", [(["--report_gbits"], "Gb/sec"), ([], "MiB/sec")])
def test_stand_in_prints_perftest_table_the_real_parser_reads(tmp_path, flags, unit):
    sim = sim_tools.rdma_tools(_scenario(tmp_path), SKUS["h100-sxm5-80gb"], tmp_path / "w")
    res = proc.run(
        [str(sim.ib_write_bw), "-d", "mlx5_1", "-i", "1", *flags, "-D", "5", "127.0.0.1"], 30
    )
    assert res.ok, res.describe_failure()
    (row,) = parse_bw_table(res.stdout)
    assert row.unit_reported == unit and row.msg_size_bytes == 65536
    assert row.bw_avg_gbps == pytest.approx(388.72, rel=1e-3) and row.bw_peak_gbps is None
    assert "Device         : mlx5_1" in res.stdout


def test_stand_in_refuses_an_unknown_device_like_perftest(tmp_path):
    sim = sim_tools.rdma_tools(_scenario(tmp_path), SKUS["h100-sxm5-80gb"], tmp_path / "w")
    res = proc.run([str(sim.ib_write_bw), "-d", "mlx5_9", "--report_gbits"], 30)
    assert res.returncode == 1 and "mlx5_9 not found" in res.stderr


def test_rdma_check_under_simulation_uses_the_simulated_tree(tmp_path):
    results = rdma.run(
        _ctx(_scenario(tmp_path, [{"kind": "hca_slow", "hca": "mlx5_0", "factor": 0.5}]))
    )
    bw = {r.target: r for r in results if r.metric == "write_bw_gbps"}
    assert bw["hca:mlx5_1"].status is Status.PASS and bw["hca:mlx5_1"].evidence["source"] == "table"
    assert bw["hca:mlx5_0"].status is Status.FAIL and bw["hca:mlx5_0"].value == pytest.approx(
        194.36, abs=0.01
    )


def test_simulated_flapping_link_counts_link_downed(tmp_path):
    results = rdma.run(
        _ctx(
            _scenario(tmp_path, [{"kind": "hca_flap", "hca": "mlx5_1", "count": 3}]), perftest=False
        )
    )
    (noisy,) = [r for r in results if r.metric == "link_errors" and r.status is Status.WARN]
    assert noisy.target == "hca:mlx5_1" and noisy.evidence["link_downed"] == 3


def test_simulated_node_without_hcas_skips_saying_so(tmp_path):
    (result,) = rdma.run(_ctx(_scenario(tmp_path, hcas=())))
    assert result.status is Status.SKIP and "lists no hcas" in result.detail


def test_hca_fault_on_an_hca_the_scenario_lacks_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="'mlx5_7' is not one of the scenario's hcas"):
        _scenario(tmp_path, [{"kind": "hca_port_down", "hca": "mlx5_7"}])


def test_hca_fault_keys_on_hca_not_gpu(tmp_path):
    with pytest.raises(ConfigError):
        _scenario(tmp_path, [{"kind": "hca_rate", "gpu": 0, "gbps": 200}])
    scenario = _scenario(tmp_path, [{"kind": "hca_rate", "hca": "mlx5_0", "gbps": 200}])
    (fault,) = scenario.faults
    assert (fault.gpu, fault.hca, fault.params) == (None, "mlx5_0", {"gbps": 200})


def test_sysfs_tree_links_each_hca_to_its_pci_function(tmp_path):
    sim = sim_tools.rdma_tools(_scenario(tmp_path), SKUS["h100-sxm5-80gb"], tmp_path / "w")
    links = {d.name: (d / "device").resolve().name for d in sim.sysfs_root.iterdir()}
    assert links == {"mlx5_0": "0000:0c:00.0", "mlx5_1": "0000:0c:00.1"}
    pci = {d.bus_id for d in sim_tools.simulated_pci(_scenario(tmp_path)) if d.vendor == 0x15B3}
    assert pci == set(links.values())  # the same functions the simulated PCI bus shows


def test_every_error_counter_is_written_zero_on_a_healthy_port(tmp_path):
    sim = sim_tools.rdma_tools(_scenario(tmp_path), SKUS["h100-sxm5-80gb"], tmp_path / "w")
    port = sim.sysfs_root / "mlx5_0" / "ports" / "1"
    for name in sim_tools.PORT_COUNTERS:
        assert (port / "counters" / name).read_text() == "0\n"
    for name in sim_tools.HW_COUNTERS:
        assert (port / "hw_counters" / name).read_text() == "0\n"


def test_hca_errors_counter_grows_with_the_simulated_uptime(tmp_path):
    scenario = _scenario(
        tmp_path,
        [{"kind": "hca_errors", "hca": "mlx5_1", "counter": "symbol_error", "per_hour": 3600}],
    )
    boot = sim_tools.simulated_boot_time(scenario)
    early = sim_tools.rdma_tools(scenario, SKUS["h100-sxm5-80gb"], tmp_path / "a", now=boot + 3660)
    late = sim_tools.rdma_tools(scenario, SKUS["h100-sxm5-80gb"], tmp_path / "b", now=boot + 7200)

    def read(sim):
        return int(
            (sim.sysfs_root / "mlx5_1" / "ports" / "1" / "counters" / "symbol_error").read_text()
        )

    assert (read(early), read(late)) == (3660, 7200)  # 3600/h: one a second since boot
    assert (early.uptime_s, late.uptime_s) == (3660, 7200)
    assert (
        early.sysfs_root / "mlx5_0" / "ports" / "1" / "counters" / "symbol_error"
    ).read_text() == "0\n"


def test_the_simulated_node_booted_an_hour_before_its_scenario_file(tmp_path):
    scenario = _scenario(tmp_path)
    written = Path(scenario.source).stat().st_mtime
    assert sim_tools.simulated_boot_time(scenario, now=written + 10) == written - 3600
