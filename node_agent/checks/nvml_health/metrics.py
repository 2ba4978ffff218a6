"""The ``nvml_health`` check's Prometheus collector: its latest per-GPU readings.

``nvml_health`` declares ``SERVICE = ServiceBehaviour(metrics=NvmlReadings)``
(checking/behaviour.py); the daemon builds the collector, feeds it every run of the check and
registers it beside its own. Each scrape renders the latest run:

- the readings of :data:`GPU_READINGS` (temperatures, power, volatile ECC counts, PCIe
  replays) as they read;
- ``node_agent_gpu_row_remap_pending`` / ``..._failure``: 0 or 1 for each GPU whose row-remap
  state was read;
- ``node_agent_gpu_remapped_rows{cause}``: the rows remapped for correctable and uncorrectable
  errors (the row-remap results' evidence), which the fleet's rules forecast.

Every series carries dcgm-exporter's labels (``hostname``, ``gpu``, ``uuid``). A run that
could not read a GPU takes that GPU's series away until a run reads it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from node_agent.checking.behaviour import LatestResults, add_once, gpu_labels, number

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: result metric -> (Prometheus name, help); the sample is the result's value
GPU_READINGS: dict[str, tuple[str, str]] = {
    "temperature": (
        "node_agent_gpu_temperature_celsius",
        "GPU core temperature (nvidia-smi temperature.gpu)",
    ),
    "memory_temperature": (
        "node_agent_gpu_memory_temperature_celsius",
        "HBM temperature where the GPU reports it",
    ),
    "power": ("node_agent_gpu_power_usage_watts", "GPU power draw (nvidia-smi power.draw)"),
    "ecc_dbe_volatile": (
        "node_agent_gpu_ecc_dbe_volatile_errors",
        "Uncorrectable (double-bit) ECC errors since the driver loaded",
    ),
    "ecc_sbe_volatile": (
        "node_agent_gpu_ecc_sbe_volatile_errors",
        "Corrected (single-bit) ECC errors since the driver loaded",
    ),
    "pcie_replay": ("node_agent_gpu_pcie_replay_errors", "PCIe replay counter"),
}
#: the row-remap results: ``row_remap`` (read, nothing pending), or one of the two states
ROW_REMAP = ("row_remap", "row_remap_pending", "row_remap_failure")
#: remapped rows' cause label -> the row-remap result's evidence key
REMAPPED_ROWS = (("correctable", "corrected_rows"), ("uncorrectable", "uncorrected_rows"))
_LABELS = ["hostname", "gpu", "uuid"]


class NvmlReadings(LatestResults):
    """The readings of the latest ``nvml_health`` run (see the module docstring)."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # the daemon's alone

        node, results = self.latest()
        readings = {
            metric: GaugeMetricFamily(name, help_, labels=_LABELS)
            for metric, (name, help_) in GPU_READINGS.items()
        }
        remap = {
            kind: GaugeMetricFamily(
                f"node_agent_gpu_row_remap_{kind}",
                f"1 when the GPU reports a row remap {kind}",
                labels=_LABELS,
            )
            for kind in ("pending", "failure")
        }
        rows = GaugeMetricFamily(
            "node_agent_gpu_remapped_rows",
            "Rows of the GPU's memory remapped, by cause: correctable or uncorrectable errors "
            "(nvidia-smi -q -d ROW_REMAPPER)",
            labels=[*_LABELS, "cause"],
        )
        remap_state: dict[tuple[str, ...], dict[str, int]] = {}
        seen: set[tuple[str, ...]] = set()
        for r in results:
            gpu = gpu_labels(node, r.target)
            if gpu is None:
                continue
            if r.metric in readings and isinstance(r.value, (int, float)):
                if not isinstance(r.value, bool):
                    add_once(readings[r.metric], gpu, float(r.value), seen)
            elif r.metric in ROW_REMAP:
                state = remap_state.setdefault(tuple(gpu), {"pending": 0, "failure": 0})
                if r.metric != "row_remap":
                    state[r.metric.removeprefix("row_remap_")] = 1
                for cause, key in REMAPPED_ROWS:
                    value = number(r.evidence.get(key))
                    if value is not None:
                        add_once(rows, [*gpu, cause], value, seen)
        for gpu_key, state in sorted(remap_state.items(), key=lambda kv: int(kv[0][1])):
            for kind, flag in state.items():
                remap[kind].add_metric(list(gpu_key), flag)
        yield from readings.values()
        yield from remap.values()
        yield rows
