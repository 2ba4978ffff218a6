"""The SDC probes' Prometheus counter, shared by the two checks that reach an SDC verdict: ``sdc``
(the agent's own probe) and ``sdc_spool`` (a training job's report, confirmed by a probe).

Both declare ``metrics=SdcVerdicts`` in their ``SERVICE`` (checking/behaviour.py); the daemon
builds one collector for the factory, so their verdicts add up in one family,
``node_agent_sdc_probes_total{gpu, outcome}``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from node_agent.checking.behaviour import NodeLabels
from node_agent.model import Result, Status

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: a GPU result's status -> the outcome label
OUTCOME = {
    Status.PASS: "pass",
    Status.WARN: "transient",
    Status.FAIL: "confirmed",
    Status.ERROR: "error",
    Status.SKIP: "skipped",
}


class SdcVerdicts:
    """Counts the verdicts on each GPU (results whose target is ``gpu:N``) by outcome."""

    def __init__(self, labels: Callable[[], NodeLabels]) -> None:
        self._labels = labels
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()  # (target, outcome) -> verdicts

    def observe(self, results: Sequence[Result]) -> None:
        with self._lock:
            for r in results:
                if r.target.startswith("gpu:"):
                    self.counts[(r.target, OUTCOME[r.status])] += 1

    def forget(self, check: str) -> None:
        """Nothing to drop: a verdict count is a counter, and a counter never goes back."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily  # the daemon's alone

        hostname = self._labels().hostname
        family = CounterMetricFamily(
            "node_agent_sdc_probes",
            "SDC probe verdicts by outcome",
            labels=["hostname", "gpu", "outcome"],
        )
        with self._lock:
            counts = sorted(self.counts.items())
        for (target, outcome), count in counts:
            family.add_metric([hostname, target.removeprefix("gpu:"), outcome], count)
        yield family
