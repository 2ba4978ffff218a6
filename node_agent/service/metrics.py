"""Prometheus metrics of the daemon: one collector that renders the daemon's state each scrape.

Here are only the node-wide series: the grade, each check's status, runs and run times, the
remediation actions and whether the agent has the node drained. What a check measures is
exported by the check's own collector, declared beside its ``run()`` (``SERVICE.metrics``,
checking/behaviour.py: GPU readings, throughput figures, HCA port counters, SDC verdicts,
training processes), and the xid check's watcher is the collector of the Xid counter; the daemon
registers them beside this one.

Naming follows Prometheus' conventions (base units in names, ``_total`` for counters,
``_timestamp_seconds``) and dcgm-exporter's labels (``gpu``, ``UUID``-like ``uuid``,
``hostname``) so dashboards can join ours with theirs. Nothing is registered at import: the
daemon builds a fresh ``CollectorRegistry`` and registers one :class:`DaemonCollector`.

:class:`MetricsServer` serves it (and ``/healthz``). Anyone who can reach the port can connect
(any local user on loopback, the cluster network where an operator listens wider), so idle
connections must cost nothing and never block a scrape: one thread multiplexes every connection
with a selector (no thread or slot per connection), a connection that has not sent its request
line and headers within ``REQUEST_S`` is closed, none stays longer than ``CONNECTION_S``, one
peer holds at most ``MAX_PER_PEER`` and all peers ``MAX_CONNECTIONS``; past a cap the *oldest*
connection still waiting for its request is closed, so the newest (a scrape sends its request
at once) is always served. A peer is a uid where the other end is on this host (the kernel's
socket diagnostics say who owns it: :func:`~node_agent.peers.tcp_peer_uid`), since a
local user has all of 127/8 to connect from; a remote peer is its address. Errors of a client are logged at debug level.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_agent.model import Level, Status
from node_agent.peers import tcp_peer_uid
from node_agent.remediation.states import NodeState

STATUSES = [s.value for s in Status]
#: remediation states in which the agent has the node drained: every state but in-service
DRAINED_STATES = tuple(s.value for s in NodeState if s is not NodeState.IN_SERVICE)

#: a client must send its request line and headers within this (a scrape sends them at once)
REQUEST_S = 1.0
#: the longest a connection may stay open, a slow reader of the answer included (Prometheus'
#: own default scrape timeout is 10 s; a scrape is answered in milliseconds)
CONNECTION_S = 5.0
#: open connections of one peer (a local uid, or a remote address), and of all peers; past
#: either the oldest one that is still waiting for its request is closed
MAX_PER_PEER = 64
MAX_CONNECTIONS = 512
#: connections accepted in one turn of the loop before the open ones are read again
ACCEPT_BATCH = 16
#: the longest request head (request line and headers) read; a longer one is answered 431
MAX_REQUEST_BYTES = 8192

log = logging.getLogger("node_agent.service.metrics")

#: a route's answer: (HTTP status, Content-Type, body)
Answer = tuple[int, str, bytes]


class MetricsServer:
    """A small HTTP/1.0 server for ``GET`` routes that idle or slow clients cannot starve.

    ``routes`` maps a path (query string ignored) to a function returning an :data:`Answer`;
    it is called on the server's one thread, so it must be quick (a scrape renders in
    milliseconds). ``serve_forever()`` runs until ``shutdown()``; ``server_close()`` closes the
    socket. ``served`` counts answered requests, ``dropped`` connections closed unanswered (a
    timeout, a cap, a malformed request). The interface is ``socketserver``'s, which the daemon
    used before: ``server_address``, ``serve_forever``, ``shutdown``, ``server_close``."""

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Callable[[], Answer]],
        *,
        request_s: float = REQUEST_S,
        connection_s: float = CONNECTION_S,
        max_per_peer: int = MAX_PER_PEER,
        max_connections: int = MAX_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
        peer_of: Callable[[socket.socket], int | None] = tcp_peer_uid,
    ) -> None:
        host, port = address
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.routes = dict(routes)
        self.request_s, self.connection_s = request_s, connection_s
        self.max_per_peer, self.max_connections = max_per_peer, max_connections
        self.served = self.dropped = 0
        self._clock = clock
        self._peer_of = peer_of
        self._conns: dict[socket.socket, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()  # until serve_forever runs

    # -- the loop -----------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        try:
            while not self._stop.is_set():
                ready = self._selector.select(self._wait(poll_interval))
                # the requests that arrived are read before new connections are let in: a
                # newcomer may close an old connection, never one whose request is here
                accept = False
                for key, events in ready:
                    sock = key.fileobj
                    if sock is self.socket:
                        accept = True
                    elif sock is self._wake_r:
                        self._drain_wake()
                    elif sock in self._conns:
                        conn = self._conns[sock]
                        if events & selectors.EVENT_READ and conn.out is None:
                            self._read(conn)
                        elif events & selectors.EVENT_WRITE and conn.out is not None:
                            self._write(conn)
                if accept:
                    self._accept()
                self._expire()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` (from another thread) and wait for it to return."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(5.0)

    def server_close(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in (self.socket, self._wake_r, self._wake_w):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._selector.close()

    def _wait(self, poll_interval: float) -> float:
        if not self._conns:
            return poll_interval
        soonest = min(c.deadline(self.request_s, self.connection_s) for c in self._conns.values())
        return max(0.0, min(poll_interval, soonest - self._clock()))

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(64)
        except OSError:
            pass

    # -- connections --------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then the open connections get their turn
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE and kin: the listening socket stays, log once
                log.debug("http: accept failed: %s", err)
                return
            sock.setblocking(False)
            uid = self._peer_of(sock)
            peer = f"uid {uid}" if uid is not None else str(addr[0])
            conn = _Conn(sock, peer, self._clock())
            self._make_room(peer)
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)
            self._read(conn)  # a scrape's request is usually here already: answer it now

    def _make_room(self, peer: str) -> None:
        """Close the oldest connection still waiting for its request, of ``peer`` when it is at
        its cap, of anyone when all are at theirs."""
        mine = [c for c in self._conns.values() if c.peer == peer]
        for pool, cap in (
            (mine, self.max_per_peer),
            (list(self._conns.values()), self.max_connections),
        ):
            while len(pool) >= cap:
                waiting = [c for c in pool if c.out is None] or pool
                oldest = min(waiting, key=lambda c: c.opened)
                pool.remove(oldest)
                self._drop(oldest, "a connection cap")

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "closed by the client")
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            end = conn.inbox.find(b"\n\n")
        if end < 0:
            if len(conn.inbox) > MAX_REQUEST_BYTES:
                self._answer(conn, (431, "text/plain", b"request header too large\n"), True)
            return
        method, answer = self._route(conn.inbox[:end])
        self._answer(conn, answer, False, with_body=method != "HEAD")

    def _route(self, head: bytes) -> tuple[str, Answer]:
        """(method, answer) for a request head."""
        line = head.split(b"\n", 1)[0].decode("latin-1").strip()
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "", (400, "text/plain", b"bad request\n")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return method, (405, "text/plain", b"only GET\n")
        path = target.split("?")[0]
        route = self.routes.get(path)
        if route is None:
            return method, (
                404,
                "text/plain",
                b"not found: try " + ", ".join(sorted(self.routes)).encode() + b"\n",
            )
        try:
            return method, route()
        except Exception:  # noqa: BLE001 - a broken route answers 500, the server goes on
            log.exception("http: %s failed", path)
            return method, (500, "text/plain", b"internal error\n")

    def _answer(self, conn: _Conn, answer: Answer, dropped: bool, with_body: bool = True) -> None:
        code, ctype, body = answer
        reason = _REASONS.get(code, "")
        head = (
            f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        conn.out = memoryview(head + body if with_body else head)
        conn.inbox = b""
        if dropped:
            self.dropped += 1
        else:
            self.served += 1
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            log.debug("http: writing to %s failed: %s", conn.peer, err)
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _expire(self) -> None:
        now = self._clock()
        for conn in list(self._conns.values()):
            if now >= conn.deadline(self.request_s, self.connection_s):
                self._drop(conn, "a timeout")

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.out is None:
            self.dropped += 1
        log.debug("http: connection from %s closed unanswered: %s", conn.peer, why)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


class _Conn:
    """One client connection: what it sent so far, then what is left to send it."""

    __slots__ = ("sock", "peer", "opened", "inbox", "out")

    def __init__(self, sock: socket.socket, peer: str, opened: float) -> None:
        self.sock, self.peer, self.opened = sock, peer, opened
        self.inbox = b""
        self.out: memoryview | None = None  # set once the request is answered

    def deadline(self, request_s: float, connection_s: float) -> float:
        return self.opened + (request_s if self.out is None else connection_s)


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class CheckStats:
    runs: int = 0
    errors: int = 0  # runs that produced an ``error`` result (crash, timeout...)
    last_run_unix: float | None = None
    last_duration_s: float | None = None
    worst_status: str | None = None
    #: runs in a row that produced an ``error`` result (0 after a run that did not)
    failing_runs: int = 0
    #: False once a reload took the check off the schedule: its gauges leave the scrape (no stale
    #: status shown as current), its counters stay
    scheduled: bool = True


@dataclass
class Snapshot:
    """What one scrape renders; built under the daemon's lock, then read without it."""

    hostname: str
    level: Level
    checks: dict[str, CheckStats]
    actions: dict[tuple[str, str], int] = field(default_factory=dict)  # (action, outcome)
    simulated: bool = False
    #: the node's remediation state from the agent's store (remediation/plan.py STATES), when
    #: the daemon can read it; None: drained-by-agent is inferred from ``actions``
    remediation_state: str | None = None
    #: True while some scheduled check has no result and no stored ERROR/FAULT stands: the
    #: daemon answers UNKNOWN (service/node_state.py)
    unknown: bool = False
    #: check -> when its latest result was made (Unix time; a stored one's included)
    result_unix: dict[str, float] = field(default_factory=dict)
    #: check -> its cadence (seconds), for each scheduled check
    intervals: dict[str, float] = field(default_factory=dict)
    #: whether NVRx's service is served (None: not configured)
    nvhcd_served: bool | None = None
    #: the scrape's time (Unix), for the result ages
    now_unix: float = field(default_factory=time.time)
    #: the node's NVLink domain (ClusterUUID, CliqueID), None where it is not multi-node
    #: NVLink: :func:`nvlink_domain_of` the environment's inventory
    nvlink_domain: tuple[str, int] | None = None


class DaemonCollector(Collector):
    """``collect()`` renders a fresh :class:`Snapshot` from ``snapshot`` at every scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        host = [s.hostname]

        up = GaugeMetricFamily(
            "node_agent_up",
            "1 while the node-agent daemon is running",
            labels=["hostname", "simulated"],
        )
        up.add_metric([s.hostname, str(s.simulated).lower()], 1)
        yield up

        level = GaugeMetricFamily(
            "node_agent_health_level",
            "The node's grade: 0 HEALTHY, 1 WARN, 2 ERROR (restart), 3 FAULT (replace)",
            labels=["hostname"],
        )
        level.add_metric(host, int(s.level))
        yield level
        grade = GaugeMetricFamily(
            "node_agent_health", "1 for the node's current grade", labels=["hostname", "level"]
        )
        for lv in Level:
            grade.add_metric([s.hostname, lv.name], 1 if lv == s.level else 0)
        yield grade

        status = GaugeMetricFamily(
            "node_agent_check_status",
            "1 for the worst status of the check's latest run",
            labels=["hostname", "check", "status"],
        )
        last = _check_gauge(
            "node_agent_check_last_run_timestamp_seconds",
            "When the check last finished (Unix time)",
        )
        duration = _check_gauge(
            "node_agent_check_duration_seconds", "How long the check's latest run took"
        )
        runs = CounterMetricFamily(
            "node_agent_check_runs", "Runs of the check", labels=["hostname", "check"]
        )
        errors = CounterMetricFamily(
            "node_agent_check_errors",
            "Runs of the check that could not complete (crash, timeout, tool failure)",
            labels=["hostname", "check"],
        )
        for name, st in sorted(s.checks.items()):
            if st.scheduled:
                for value in STATUSES:
                    status.add_metric(
                        [s.hostname, name, value], 1 if st.worst_status == value else 0
                    )
                if st.last_run_unix is not None:
                    last.add_metric([s.hostname, name], st.last_run_unix)
                if st.last_duration_s is not None:
                    duration.add_metric([s.hostname, name], st.last_duration_s)
            runs.add_metric([s.hostname, name], st.runs)
            errors.add_metric([s.hostname, name], st.errors)
        yield from (status, last, duration, runs, errors)
        yield from _state_series(s)

        actions = CounterMetricFamily(
            "node_agent_actions",
            "Remediation actions by kind and outcome",
            labels=["hostname", "action", "outcome"],
        )
        for (action, outcome), count in sorted(s.actions.items()):
            actions.add_metric([s.hostname, action, outcome], count)
        yield actions

        yield from _drained(s)
        yield from _nvlink_domain(s)


def _check_gauge(name: str, documentation: str) -> GaugeMetricFamily:
    """A gauge with one series per check (labels hostname, check)."""
    return GaugeMetricFamily(name, documentation, labels=["hostname", "check"])


def _state_series(s: Snapshot) -> Iterator[Metric]:
    """Whether the daemon knows the node's state, each check's result age, the NVRx service."""
    unknown = GaugeMetricFamily(
        "node_agent_grade_unknown",
        "1 while some scheduled check has no result yet and no stored ERROR/FAULT stands "
        "(the daemon answers UNKNOWN)",
        labels=["hostname"],
    )
    unknown.add_metric([s.hostname], int(s.unknown))
    yield unknown
    age = _check_gauge(
        "node_agent_check_result_age_seconds",
        "Age of the check's latest result (a stalled check loop shows as a growing age)",
    )
    failing = _check_gauge(
        "node_agent_check_failing_runs",
        "Runs in a row of the check that timed out or failed (0 after one that did not)",
    )
    for name, at in sorted(s.result_unix.items()):
        st = s.checks.get(name)
        if st is not None and not st.scheduled:
            continue
        age.add_metric([s.hostname, name], max(0.0, s.now_unix - at))
    for name, st in sorted(s.checks.items()):
        if st.scheduled:
            failing.add_metric([s.hostname, name], st.failing_runs)
    interval = _check_gauge(
        "node_agent_check_interval_seconds",
        "The check's cadence in the daemon's schedule (every_s)",
    )
    for name, every_s in sorted(s.intervals.items()):
        interval.add_metric([s.hostname, name], every_s)
    yield from (age, failing, interval)
    if s.nvhcd_served is not None:
        served = GaugeMetricFamily(
            "node_agent_nvhcd_served",
            "1 while NVRx's node health-check service answers on its socket",
            labels=["hostname"],
        )
        served.add_metric([s.hostname], int(s.nvhcd_served))
        yield served


def drained_by_agent(s: Snapshot) -> tuple[int, str]:
    """(1 when the agent has this node drained, else 0; where that was read).

    From the remediation state when the daemon hands it over (``state``: every state but
    ``in-service`` follows the agent's own drain); else from the actions this daemon counted
    (``actions``): more drains done than resumes done since the daemon started. The second
    forgets a drain made before the daemon (re)started, e.g. by a reboot it asked for, or by
    ``node-agent check --act`` outside the daemon."""
    if s.remediation_state is not None:
        return int(s.remediation_state in DRAINED_STATES), "state"
    drains = s.actions.get(("drain", "done"), 0)
    resumes = s.actions.get(("resume", "done"), 0)
    return int(drains > resumes), "actions"


def _drained(s: Snapshot) -> Iterator[Metric]:
    drained = GaugeMetricFamily(
        "node_agent_drained_by_agent",
        "1 while the agent has this "
        "node drained (source: state = the remediation store, actions "
        "= drains minus resumes this daemon counted)",
        labels=["hostname", "source"],
    )
    value, source = drained_by_agent(s)
    drained.add_metric([s.hostname, source], value)
    yield drained


def nvlink_domain_of(inventory: object) -> tuple[str, int] | None:
    """(ClusterUUID, CliqueID) of an inventory's ``nvlink_domain`` (``Inventory.nvlink_domain``,
    a pair, or an object with ``cluster_uuid`` and ``clique_id``); None where it has none (not
    multi-node NVLink, or an inventory without the field)."""
    domain = getattr(inventory, "nvlink_domain", None)
    if isinstance(domain, tuple) and len(domain) == 2:
        uuid, clique = domain
    else:
        uuid = getattr(domain, "cluster_uuid", None)
        clique = getattr(domain, "clique_id", None)
    if not isinstance(uuid, str) or not uuid or isinstance(clique, bool):
        return None
    if not isinstance(clique, int):
        return None
    return uuid, clique


def _nvlink_domain(s: Snapshot) -> Iterator[Metric]:
    """The node's NVLink domain as labels: the fleet's rules group the trays of one domain
    (packaging/prometheus/, ``fleet:node_agent_nvlink_domain_bad:ratio``). No series on a node
    that is not multi-node NVLink."""
    if s.nvlink_domain is None:
        return
    info = GaugeMetricFamily(
        "node_agent_nvlink_domain_info",
        "1 for the NVLink domain this node is a tray of (the fabric's ClusterUUID and CliqueID)",
        labels=["hostname", "cluster_uuid", "clique_id"],
    )
    uuid, clique = s.nvlink_domain
    info.add_metric([s.hostname, uuid, str(clique)], 1)
    yield info
