"""Prometheus metrics of the daemon: one collector that renders the daemon's state each scrape.

Naming follows Prometheus' conventions (base units in names, ``_total`` for counters,
``_timestamp_seconds``) and dcgm-exporter's labels (``gpu``, ``UUID``-like ``uuid``,
``hostname``) so dashboards can join ours with theirs. Nothing is registered at import: the
daemon builds a fresh ``CollectorRegistry`` and registers one :class:`DaemonCollector`.

:class:`MetricsServer` serves it (and ``/healthz``): any local user can connect, so it holds
no connection longer than ``CONNECTION_S`` (a socket timeout per read and a hard limit per
connection), serves at most ``MAX_CONNECTIONS`` at once (the rest are closed at once, not
queued in threads), and logs a client's errors at debug level instead of printing tracebacks.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_agent.model import Level, Result, Status

#: result metric of nvml_health -> (Prometheus name, help); values are the readings
GPU_READINGS: dict[str, tuple[str, str]] = {
    "temperature": ("node_agent_gpu_temperature_celsius", "GPU core temperature (nvidia-smi "
                    "temperature.gpu)"),
    "memory_temperature": ("node_agent_gpu_memory_temperature_celsius",
                           "HBM temperature where the GPU reports it"),
    "power": ("node_agent_gpu_power_usage_watts", "GPU power draw (nvidia-smi power.draw)"),
    "ecc_dbe_volatile": ("node_agent_gpu_ecc_dbe_volatile_errors",
                         "Uncorrectable (double-bit) ECC errors since the driver loaded"),
    "ecc_sbe_volatile": ("node_agent_gpu_ecc_sbe_volatile_errors",
                         "Corrected (single-bit) ECC errors since the driver loaded"),
    "pcie_replay": ("node_agent_gpu_pcie_replay_errors", "PCIe replay counter"),
}
STATUSES = [s.value for s in Status]

#: the check whose per-process results become the training metrics (docs/training_hangs.md)
TRAINING_CHECK = "training_progress"
#: its per-process result metrics -> 1 when the result is a hang suspicion
TRAINING_METRICS = {"training_progress": 0, "training_straggler": 0, "training_hang": 1}
#: label values from training processes' heartbeats are untrusted text: Prometheus escapes
#: them, but a job id of megabytes would bloat every scrape, so they are cut to this length
MAX_LABEL_CHARS = 128
#: connections served at once: a scrape takes milliseconds, Prometheus opens one at a time
MAX_CONNECTIONS = 8
#: the longest a connection may stay open, and the socket timeout of each read in it (a scrape
#: is answered in milliseconds; Prometheus' own default scrape timeout is 10 s)
CONNECTION_S = 5.0

log = logging.getLogger("node_agent.service.metrics")

#: a route's answer: (HTTP status, Content-Type, body)
Answer = tuple[int, str, bytes]


class MetricsServer(ThreadingHTTPServer):
    """An HTTP server with bounded threads and connections that cannot be held open.

    ``routes`` maps a path (query string ignored) to a function returning an :data:`Answer`.
    Connections beyond ``max_connections`` are closed on arrival (``refused`` counts them);
    each socket read times out after ``connection_s`` and each connection is shut down after
    ``connection_s`` in all, whatever its client does; errors are logged at debug level."""

    daemon_threads = True
    request_queue_size = 128  # accept a burst at once (to close it), not leave it to SYN retries

    def __init__(self, address: tuple[str, int], routes: Mapping[str, Callable[[], Answer]],
                 max_connections: int = MAX_CONNECTIONS,
                 connection_s: float = CONNECTION_S) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        self.connection_s = connection_s
        super().__init__(address, _handler(routes, connection_s))

    def process_request(self, request, client_address) -> None:  # socketserver's name
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        limit = threading.Timer(self.connection_s, _cut, (request,))
        limit.daemon = True
        limit.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            limit.cancel()
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("http: connection from %s ended with an error", client_address,
                  exc_info=True)


def _cut(sock: socket.socket) -> None:
    """Wake a read blocked on a client that dribbles: shut the connection down."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _handler(routes: Mapping[str, Callable[[], Answer]], timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler: the socket's timeout for every read

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            route = routes.get(self.path.split("?")[0])
            code, ctype, body = route() if route else (
                404, "text/plain", b"not found: try " + ", ".join(sorted(routes)).encode()
                + b"\n")
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("http: " + fmt, *args)

    return Handler


@dataclass
class CheckStats:
    runs: int = 0
    errors: int = 0                 # runs that produced an ``error`` result (crash, timeout...)
    last_run_unix: float | None = None
    last_duration_s: float | None = None
    worst_status: str | None = None


@dataclass
class Snapshot:
    """What one scrape renders; built under the daemon's lock, then read without it."""

    hostname: str
    level: Level
    checks: dict[str, CheckStats]
    results: list[Result]                                  # current results, all checks
    gpu_uuids: dict[int, str]
    xid_counts: dict[tuple[int | None, int], int]          # (gpu index, code) -> occurrences
    sdc_outcomes: dict[tuple[str, str], int] = field(default_factory=dict)  # (target, outcome)
    actions: dict[tuple[str, str], int] = field(default_factory=dict)       # (action, outcome)
    simulated: bool = False
    hang_suspicions: int = 0     # HangTracker.total: processes seen going from not hung to hung


class DaemonCollector(Collector):
    """``collect()`` renders a fresh :class:`Snapshot` from ``snapshot`` at every scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        host = [s.hostname]

        up = GaugeMetricFamily("node_agent_up", "1 while the node-agent daemon is running",
                               labels=["hostname", "simulated"])
        up.add_metric([s.hostname, str(s.simulated).lower()], 1)
        yield up

        level = GaugeMetricFamily("node_agent_health_level", "The node's grade: 0 HEALTHY, "
                                  "1 WARN, 2 ERROR (restart), 3 FAULT (replace)",
                                  labels=["hostname"])
        level.add_metric(host, int(s.level))
        yield level
        grade = GaugeMetricFamily("node_agent_health", "1 for the node's current grade",
                                  labels=["hostname", "level"])
        for lv in Level:
            grade.add_metric([s.hostname, lv.name], 1 if lv == s.level else 0)
        yield grade

        status = GaugeMetricFamily("node_agent_check_status", "1 for the worst status of the "
                                   "check's latest run", labels=["hostname", "check", "status"])
        last = GaugeMetricFamily("node_agent_check_last_run_timestamp_seconds",
                                 "When the check last finished (Unix time)",
                                 labels=["hostname", "check"])
        duration = GaugeMetricFamily("node_agent_check_duration_seconds",
                                     "How long the check's latest run took",
                                     labels=["hostname", "check"])
        runs = CounterMetricFamily("node_agent_check_runs", "Runs of the check",
                                   labels=["hostname", "check"])
        errors = CounterMetricFamily("node_agent_check_errors", "Runs of the check that could "
                                     "not complete (crash, timeout, tool failure)",
                                     labels=["hostname", "check"])
        for name, st in sorted(s.checks.items()):
            for value in STATUSES:
                status.add_metric([s.hostname, name, value], 1 if st.worst_status == value else 0)
            if st.last_run_unix is not None:
                last.add_metric([s.hostname, name], st.last_run_unix)
            if st.last_duration_s is not None:
                duration.add_metric([s.hostname, name], st.last_duration_s)
            runs.add_metric([s.hostname, name], st.runs)
            errors.add_metric([s.hostname, name], st.errors)
        yield from (status, last, duration, runs, errors)

        yield from _gpu_readings(s)

        xids = CounterMetricFamily("node_agent_gpu_xid_errors", "XID errors seen by the "
                                   "daemon's watch, per code: occurrences (kernel-log lines, "
                                   "else NVML events), not reports; a flood's count is brought "
                                   "up to date at least once a minute",
                                   labels=["hostname", "gpu", "uuid", "code"])
        for (gpu, code), count in sorted(s.xid_counts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            gpu_label = "" if gpu is None else str(gpu)
            xids.add_metric([s.hostname, gpu_label, s.gpu_uuids.get(gpu, "") if gpu is not None
                             else "", str(code)], count)
        yield xids

        sdc = CounterMetricFamily("node_agent_sdc_probes", "SDC probe verdicts by outcome",
                                  labels=["hostname", "gpu", "outcome"])
        for (target, outcome), count in sorted(s.sdc_outcomes.items()):
            sdc.add_metric([s.hostname, target.removeprefix("gpu:"), outcome], count)
        yield sdc

        actions = CounterMetricFamily("node_agent_actions", "Remediation actions by kind and "
                                      "outcome", labels=["hostname", "action", "outcome"])
        for (action, outcome), count in sorted(s.actions.items()):
            actions.add_metric([s.hostname, action, outcome], count)
        yield actions

        yield from _training(s)


def _label(value: object) -> str:
    return "" if value is None else str(value)[:MAX_LABEL_CHARS]


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _process_key(r: Result) -> tuple[str, str]:
    """(job, pid) of a per-process ``training_progress`` result; the target when both are
    missing, so two unidentified processes are never one."""
    job, pid = r.evidence.get("job"), r.evidence.get("pid")
    if job is None and pid is None:
        return (r.target, "")
    return (_label(job), _label(pid))


class HangTracker:
    """Counts hang suspicions: a training process (job, pid) going from not hung to hung.

    The daemon feeds it every run of ``training_progress``; a process hung across many runs
    counts once, one that recovers and hangs again counts twice. A run that could not complete
    (only ``error`` results) says nothing about the processes and leaves the state as it was.
    """

    def __init__(self) -> None:
        self.total = 0
        self._hung: set[tuple[str, str]] = set()

    def update(self, check: str, results: list[Result]) -> None:
        if check != TRAINING_CHECK:
            return
        if results and all(r.status is Status.ERROR for r in results):
            return
        hung = {_process_key(r) for r in results if r.metric == "training_hang"}
        self.total += len(hung - self._hung)
        self._hung = hung


def _training(s: Snapshot) -> Iterator[Metric]:
    """Per training process (labels job, rank, pid): heartbeat age, step time, hang suspected;
    and the daemon's count of hang suspicions. A process with several results (a straggler
    also reports its progress) is one series: hung if any says so, the first known figures."""
    labels = ["hostname", "job", "rank", "pid"]
    age = GaugeMetricFamily("node_agent_training_heartbeat_age_seconds", "Seconds since the "
                            "training process's last heartbeat (node_agent.heartbeat)",
                            labels=labels)
    step = GaugeMetricFamily("node_agent_training_step_time_seconds", "The training "
                             "process's recent mean step time, from its heartbeats",
                             labels=labels)
    hang = GaugeMetricFamily("node_agent_training_hang_suspected", "1 while training_progress "
                             "calls the process hung, 0 while it steps", labels=labels)
    processes: dict[tuple[str, str, str], dict[str, float | None]] = {}
    for r in s.results:
        if r.check != TRAINING_CHECK or r.metric not in TRAINING_METRICS:
            continue
        ev = r.evidence
        key = (_label(ev.get("job")), _label(ev.get("rank")), _label(ev.get("pid")))
        p = processes.setdefault(key, {"hang": 0, "age": None, "step": None})
        p["hang"] = max(p["hang"] or 0, TRAINING_METRICS[r.metric])
        p["age"] = p["age"] if p["age"] is not None else _number(ev.get("heartbeat_age_s"))
        p["step"] = p["step"] if p["step"] is not None else _number(ev.get("step_time_s"))
    for key, p in sorted(processes.items()):
        values = [s.hostname, *key]
        hang.add_metric(values, p["hang"])
        if p["age"] is not None:
            age.add_metric(values, p["age"])
        if p["step"] is not None:
            step.add_metric(values, p["step"])
    total = CounterMetricFamily("node_agent_training_hang_suspicions", "Training processes "
                                "the daemon saw go from stepping (or unseen) to hung",
                                labels=["hostname"])
    total.add_metric([s.hostname], s.hang_suspicions)
    yield from (age, step, hang, total)


def _gpu_readings(s: Snapshot) -> Iterator[Metric]:
    families = {metric: GaugeMetricFamily(name, help_, labels=["hostname", "gpu", "uuid"])
                for metric, (name, help_) in GPU_READINGS.items()}
    remap = {kind: GaugeMetricFamily(f"node_agent_gpu_row_remap_{kind}",
                                     f"1 when the GPU reports a row remap {kind}",
                                     labels=["hostname", "gpu", "uuid"])
             for kind in ("pending", "failure")}
    remap_state: dict[int, dict[str, int]] = {}
    for r in s.results:
        if not r.target.startswith("gpu:"):
            continue
        index = int(r.target[4:])
        labels = [s.hostname, str(index), s.gpu_uuids.get(index, "")]
        if r.metric in families and isinstance(r.value, (int, float)) \
                and not isinstance(r.value, bool):
            families[r.metric].add_metric(labels, float(r.value))
        elif r.metric == "row_remap":
            remap_state.setdefault(index, {"pending": 0, "failure": 0})
        elif r.metric in ("row_remap_pending", "row_remap_failure"):
            remap_state.setdefault(index, {"pending": 0, "failure": 0})[r.metric[10:]] = 1
    for index, state in sorted(remap_state.items()):
        for kind, value in state.items():
            remap[kind].add_metric([s.hostname, str(index), s.gpu_uuids.get(index, "")], value)
    yield from families.values()
    yield from remap.values()
