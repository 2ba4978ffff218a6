"""A check's latest figures as one Prometheus gauge: the collector the measuring checks
(``gpu_burn``, ``hbm_bandwidth``, ``pcie_bandwidth``, ``nccl_allreduce``) declare as their
``SERVICE`` metrics, described by data rather than written once per check.

A result gives a sample when it is a figure (:func:`~node_agent.checking.behaviour.figure`:
a skip or an error gives none; a failing figure, a slow GPU's, does) and the gauge's
``select`` names its extra label values; the series carries the node's hostname, then
``gpu`` and ``uuid`` for a per-GPU gauge, then the extra labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from node_agent.checking.behaviour import (
    LatestResults,
    MetricsFactory,
    NodeLabels,
    add_once,
    figure,
    gpu_labels,
)
from node_agent.model import Result

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: a result's extra label values in the gauge, or None where the result is not its figure
Select = Callable[[Result], list[str] | None]


def figure_gauge(
    name: str, help_text: str, extra: tuple[str, ...], scale: float, select: Select
) -> MetricsFactory:
    """The factory of a per-GPU gauge ``name{hostname,gpu,uuid,*extra}`` of the latest run's
    figures times ``scale`` (GB/s and TFLOP/s are exported in base units)."""
    return _factory(name, help_text, ("gpu", "uuid", *extra), scale, select, gpu_labels)


def node_gauge(name: str, help_text: str, scale: float, select: Select) -> MetricsFactory:
    """The factory of a gauge ``name{hostname}`` of the latest run's ``node`` figure."""

    def node_only(node: NodeLabels, target: str) -> list[str] | None:
        return [node.hostname] if target == "node" else None

    return _factory(name, help_text, (), scale, select, node_only)


def _factory(
    name: str,
    help_text: str,
    labels: tuple[str, ...],
    scale: float,
    select: Select,
    where: Callable[[NodeLabels, str], list[str] | None],
) -> MetricsFactory:
    class FigureGauge(LatestResults):
        def collect(self) -> Iterator[Metric]:
            from prometheus_client.core import GaugeMetricFamily  # the daemon's alone

            node, results = self.latest()
            family = GaugeMetricFamily(name, help_text, labels=["hostname", *labels])
            seen: set[tuple[str, ...]] = set()
            for r in results:
                value, series, extra = figure(r), where(node, r.target), select(r)
                if value is not None and series is not None and extra is not None:
                    add_once(family, [*series, *extra], value * scale, seen)
            yield family

    FigureGauge.__name__ = FigureGauge.__qualname__ = f"FigureGauge[{name}]"
    return FigureGauge
