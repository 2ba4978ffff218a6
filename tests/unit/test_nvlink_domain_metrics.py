"""The daemon exports its node's NVLink domain as labels (node_agent_nvlink_domain_info), the
series the fleet's per-domain Prometheus rules group trays by (packaging/prometheus/)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.model import Level
from node_agent.service.metrics import DaemonCollector, Snapshot, nvlink_domain_of

UUID = "9f0c2b6e-5a41-4c7e-8d2a-1b3e5f7a9c0d"


def scrape(snap: Snapshot) -> dict[str, list[dict[str, str]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(lambda: snap))
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            assert sample.value == 1 or not sample.name.startswith("node_agent_nvlink")
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def test_a_tray_exports_its_domain_as_labels():
    snap = Snapshot("tray07", Level.HEALTHY, {}, nvlink_domain=(UUID, 2))
    assert scrape(snap)["node_agent_nvlink_domain_info"] == [
        {"hostname": "tray07", "cluster_uuid": UUID, "clique_id": "2"}
    ]


def test_a_node_without_a_domain_exports_no_domain_series():
    assert "node_agent_nvlink_domain_info" not in scrape(Snapshot("hgx01", Level.HEALTHY, {}))


def test_the_domain_is_read_from_the_inventory():
    inventory = SimpleNamespace(nvlink_domain=SimpleNamespace(cluster_uuid=UUID, clique_id=2))
    assert nvlink_domain_of(inventory) == (UUID, 2)
    assert nvlink_domain_of(SimpleNamespace(nvlink_domain=(UUID, 2))) == (UUID, 2)


def test_the_domain_of_a_simulated_gb200_tray_is_exported():
    """The real Inventory of the GB200 scenario (the NVML stand-in answers its fabric)."""
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "healthy-gb200-186gb.yaml"
    env = open_environment(load_config(None), str(scenario))
    try:
        domain = nvlink_domain_of(env.inventory)
    finally:
        env.close()
    assert domain == ("6a1c2e8f-3b4d-4e5f-8a9b-0c1d2e3f4a5b", 2)
    snap = Snapshot("gb200-tray-01", Level.HEALTHY, {}, nvlink_domain=domain)
    assert scrape(snap)["node_agent_nvlink_domain_info"][0]["clique_id"] == "2"


@pytest.mark.parametrize(
    "inventory",
    [
        SimpleNamespace(),  # an inventory from before the field
        SimpleNamespace(nvlink_domain=None),  # not multi-node NVLink
        SimpleNamespace(nvlink_domain=SimpleNamespace(cluster_uuid="", clique_id=2)),
        SimpleNamespace(nvlink_domain=SimpleNamespace(cluster_uuid=UUID, clique_id=None)),
        SimpleNamespace(nvlink_domain=SimpleNamespace(cluster_uuid=UUID, clique_id=True)),
    ],
)
def test_an_inventory_without_a_usable_domain_has_none(inventory):
    assert nvlink_domain_of(inventory) is None
