"""The HCA port error counters' Prometheus collector, shared by the two checks that read them:
``rdma`` and ``hca_ports``.

Both declare ``metrics=HcaPortErrors`` in their ``SERVICE`` (checking/behaviour.py); the daemon
builds one collector for the factory, so the exposition has the family
``node_agent_hca_port_errors{hca, port, counter}`` once. Each scrape renders the latest run of
each check: the counters of :data:`HCA_COUNTERS` that an ``hca:`` result carries in its
evidence (with ``device`` and ``port``), as sysfs read them, so the fleet's rules see them
rise. Where both checks report one port's counter, the check that reported first since the
daemon started gives the sample. An unreadable counter (None) is no series, never a 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from node_agent.checking.behaviour import LatestResults, add_once, label, number
from node_agent.model import Target

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: HCA port counters (sysfs ``counters/`` names) that the rdma and hca_ports results carry
HCA_COUNTERS = (
    "symbol_error",
    "link_downed",
    "port_rcv_errors",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)


class HcaPortErrors(LatestResults):
    """The port error counters of the latest ``rdma`` and ``hca_ports`` runs. Gauges: they
    read as the hardware reports them and fall back to 0 when the driver reloads."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # the daemon's alone

        node, results = self.latest()
        family = GaugeMetricFamily(
            "node_agent_hca_port_errors",
            "An InfiniBand/RoCE port's error counter as sysfs reads it (counters/<counter>)",
            labels=["hostname", "hca", "port", "counter"],
        )
        seen: set[tuple[str, ...]] = set()
        for r in results:
            if Target.parse(r.target).kind != "hca":
                continue
            device, port = label(r.evidence.get("device")), label(r.evidence.get("port"))
            if not device:
                continue
            for counter in HCA_COUNTERS:
                value = number(r.evidence.get(counter))
                if value is not None:
                    add_once(family, [node.hostname, device, port, counter], value, seen)
        yield family
