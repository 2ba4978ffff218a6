"""The ``training_progress`` check's Prometheus series (docs/training_hangs.md, docs/daemon.md).

``training_progress`` declares ``SERVICE = ServiceBehaviour(metrics=TrainingMetrics)``
(checking/behaviour.py); the daemon builds the collector, feeds it every run of the check and
registers it beside its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from node_agent.checking.behaviour import NodeLabels, label, number
from node_agent.model import Result, Status

if TYPE_CHECKING:
    from prometheus_client.core import Metric

#: per-process result metrics -> 1 when the result is a hang suspicion
_PROCESS_METRICS = {"training_progress": 0, "training_straggler": 0, "training_hang": 1}


class TrainingMetrics:
    """The check's Prometheus series (docs/training_hangs.md).

    Per training process (labels job, rank, pid), from the latest run: heartbeat age, step
    time, hang suspected. A process with several results (a straggler also reports its
    progress) is one series: hung if any says so, the first known figures.

    ``node_agent_training_hang_suspicions_total``: processes (job, pid) seen going from not
    hung to hung. A process hung across many runs counts once, one that recovers and hangs
    again counts twice. A run that could not complete (only ``error`` results) says nothing
    about the processes and leaves the state as it was.
    """

    def __init__(self, labels: Callable[[], NodeLabels]) -> None:
        self._labels = labels
        self._lock = threading.Lock()
        self.total = 0
        self._hung: set[tuple[str, str]] = set()
        self._latest: list[Result] = []

    def observe(self, results: Sequence[Result]) -> None:
        with self._lock:
            self._latest = list(results)
            if results and all(r.status is Status.ERROR for r in results):
                return
            hung = {_process_key(r) for r in results if r.metric == "training_hang"}
            self.total += len(hung - self._hung)
            self._hung = hung

    def forget(self, check: str) -> None:
        """The per-process gauges go; the suspicions counter keeps its total."""
        with self._lock:
            self._latest = []
            self._hung = set()

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )  # the daemon's alone

        hostname = self._labels().hostname
        with self._lock:
            latest, total = list(self._latest), self.total
        names = ["hostname", "job", "rank", "pid"]
        age = GaugeMetricFamily(
            "node_agent_training_heartbeat_age_seconds",
            "Seconds since the training process's last heartbeat (node_agent.heartbeat)",
            labels=names,
        )
        step = GaugeMetricFamily(
            "node_agent_training_step_time_seconds",
            "The training process's recent mean step time, from its heartbeats",
            labels=names,
        )
        hang = GaugeMetricFamily(
            "node_agent_training_hang_suspected",
            "1 while training_progress calls the process hung, 0 while it steps",
            labels=names,
        )
        processes: dict[tuple[str, str, str], dict[str, float | None]] = {}
        for r in latest:
            if r.metric not in _PROCESS_METRICS:
                continue
            ev = r.evidence
            key = (label(ev.get("job")), label(ev.get("rank")), label(ev.get("pid")))
            p = processes.setdefault(key, {"hang": 0, "age": None, "step": None})
            p["hang"] = max(p["hang"] or 0, _PROCESS_METRICS[r.metric])
            p["age"] = p["age"] if p["age"] is not None else number(ev.get("heartbeat_age_s"))
            p["step"] = p["step"] if p["step"] is not None else number(ev.get("step_time_s"))
        for key, p in sorted(processes.items()):
            values = [hostname, *key]
            hang.add_metric(values, p["hang"] or 0)
            if p["age"] is not None:
                age.add_metric(values, p["age"])
            if p["step"] is not None:
                step.add_metric(values, p["step"])
        suspicions = CounterMetricFamily(
            "node_agent_training_hang_suspicions",
            "Training processes the daemon saw go from stepping (or unseen) to hung",
            labels=["hostname"],
        )
        suspicions.add_metric([hostname], total)
        yield from (age, step, hang, suspicions)


def _process_key(r: Result) -> tuple[str, str]:
    """(job, pid) of a per-process result; the target when both are missing, so two
    unidentified processes are never one."""
    job, pid = r.evidence.get("job"), r.evidence.get("pid")
    if job is None and pid is None:
        return (r.target, "")
    return (str(job), str(pid))
