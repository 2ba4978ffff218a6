"""``node-agent daemon``: the agent's in-service life on one node.

Threads, each with one job:
- main: signals (SIGTERM stops, SIGHUP reloads the config), systemd watchdog pings, noticing a
  changed simulation scenario, reopening NVML after the driver went away;
- checks: runs ``suites/periodic.yaml`` by each check's ``every_s`` cadence, one check at a
  time (never two heavy checks at once), each bounded by its timeout (``runner.run_check``);
- watchers: the event-driven part of a check (its ``SERVICE.watcher``; the xid check's follows
  NVML events and the kernel log), each finding graded the moment it is handed back;
- HTTP: ``/metrics`` (Prometheus) and ``/healthz`` on loopback.
After each check run its numeric results named in ``graders/trends.yaml`` go into the counter
history (``<state_dir>/history.db``) and their trends are graded as ``trends`` results
(``service.trend_watch``, docs/trends.md): WARNs, never an action, except one NVLink whose
counters keep growing for an hour (ERROR, graders/trends.yaml ``persist``).
Every change of results is re-graded at once; a changed grade goes to the log, and to
``on_grade`` (the remediation hook) once every scheduled check has a result, or at once when it
is ERROR or worse: a partial grade that passes never resumes a node. Nothing here exits on a
check's failure: a check that raises or hangs is an ``error`` result and a rising
``node_agent_check_errors_total``, and the failed findings of its last run on what it could
not read stay, dated (a reading that fails is no evidence the fault went away); one that does so
``daemon.failures_warn_after`` runs in a row is a WARN of its own (a source wedged in NVML or
DCGM), and each check's result age is a metric.

The grade is the node's state (:mod:`node_agent.service.node_state`): the latest results of
every scheduled check (a run of one check never replaces another's), the sticky findings and
the grade, kept in ``<state_dir>/daemon-state.json`` and read back at start. Until every
scheduled check has a result (stored ones of this boot count) the daemon answers the stored
ERROR/FAULT or UNKNOWN (:func:`~node_agent.service.node_state.answered`): in NVRx's answer,
``/healthz`` and ``node_agent_grade_unknown``.

The daemon names no check: what a check does in service it declares beside its ``run()``
(``SERVICE``, :mod:`node_agent.checking.behaviour`): which results stay part of the grade for
the daemon's life and how two of them fold into one (the xid check's findings), the
Prometheus collector of its own (one per factory, registered at start, fed each run's
results), and the watcher of an event-driven check (one per factory, built for every
registered check and started with the daemon, its findings kept as the check's sticky
results). Checks listed in ``daemon.subprocess_checks`` run in a child process
(:mod:`node_agent.service.check_child`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from node_agent import proc
from node_agent.atomic_file import ensure_spool_dirs, private_dir
from node_agent.checking.behaviour import (
    PLAIN,
    CheckMetrics,
    Handover,
    MetricsFactory,
    NodeLabels,
    ServiceBehaviour,
    Sighting,
    WatchContext,
    Watcher,
    WatcherFactory,
    behaviour,
)
from node_agent.checking.child import ChildSpec, run_in_child
from node_agent.checking.registry import REGISTRY
from node_agent.config import Config, load_config
from node_agent.environment import Environment, open_environment
from node_agent.model import Action, Grade, Level, Reason, Result, Status, utc_iso
from node_agent.peers import held_by_another
from node_agent.report.terminal import printable
from node_agent.resources import graders_dir, shipped_graders_dir, suites_dir
from node_agent.runner import FORKSERVER_CHECKS, run_check
from node_agent.service.metrics import (
    CheckStats,
    DaemonCollector,
    MetricsServer,
    Snapshot,
    nvlink_domain_of,
)
from node_agent.service.node_state import (
    CheckResults,
    NodeView,
    StateFile,
    Stored,
    ViewReason,
    answered,
    owners,
)
from node_agent.service.sd_notify import Notifier
from node_agent.service.trend_watch import TrendWatch, trends_file
from node_agent.suite import CheckSpec, Suite, load_suite
from node_agent.yamlfile import ConfigError

if TYPE_CHECKING:
    from node_agent.service.actions import DaemonRemediation
    from node_agent.service.nvhcd import NvhcdServer

log = logging.getLogger("node_agent.service.daemon")

#: called with (new grade, all current results, environment) when the grade changes
GradeHook = Callable[[Grade, list[Result], Environment], None]


#: beyond a rotation of the schedule, before a result is stale: a check child's kill grace
STALE_GRACE_S = 60.0
#: how often the daemon tries again to listen on daemon.listen while it cannot
HTTP_RETRY_S = 30.0


@dataclass
class _Scheduled:
    spec: CheckSpec
    every_s: float
    next_due: float


class Daemon:
    """One daemon; ``run()`` blocks until ``stop()`` (or SIGTERM) and returns an exit code."""

    def __init__(
        self,
        config_path: str | None,
        simulate: str | None = None,
        *,
        suite: str | None = None,
        listen: str | None = None,
        notifier: Notifier | None = None,
        on_grade: GradeHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._config_path = config_path
        self._simulate = simulate
        self._suite_name = suite
        self._listen_override = listen
        self._notifier = notifier or Notifier()
        self._on_grade = on_grade
        self._clock = clock
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake_checks = threading.Event()
        # state (under _lock)
        self.config: Config = load_config(config_path)
        self.env: Environment = open_environment(self.config, simulate)
        self.suite: Suite = self._load_suite(self.config)
        self._schedule = self._make_schedule(self.suite)
        #: each scheduled check's latest results (a run replaces its own check's, no other's)
        self._results: dict[str, CheckResults] = {}
        #: findings about the daemon itself (the NVRx service not served), by source
        self._own: dict[str, list[Result]] = {}
        self._stats: dict[str, CheckStats] = {}
        #: results that stay part of the grade for the daemon's life (a check's SERVICE.sticky),
        #: one per (check, key), folded by the check's SERVICE.fold
        self._sticky: dict[tuple[str, Hashable], Result] = {}
        self._actions: Counter[tuple[str, str]] = Counter()
        self.grade: Grade = Grade(level=Level.HEALTHY, action=Action.NONE, reasons=())
        self._graded_at: float | None = None  # time.time() of the last grading, None before any
        #: what the daemon answers for the node (NVRx, /healthz); None before the first grading
        self.view: NodeView | None = None
        #: the grade last handed to ``on_grade`` (level and reasons), None before any
        self._handed: tuple[Level, tuple[Reason, ...]] | None = None
        #: scheduled checks whose result is too old to stand for the node now (the last view's)
        self._stale: frozenset[str] = frozenset()
        #: the check the checks thread runs now, and since when (its clock); None between runs
        self._in_flight: tuple[str, float, float] | None = None
        self._nvhcd: NvhcdServer | None = None  # NVRx's health-check service (daemon.nvhcd)
        self.last_tick = clock()
        self._scenario_mtime = self._mtime(simulate)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(DaemonCollector(self.snapshot))
        #: the checks' own collectors, one per factory (checking/behaviour.py)
        self._check_metrics: dict[MetricsFactory, CheckMetrics] = {}
        #: the checks' watchers, one per factory, started with the daemon (checking/behaviour.py)
        self._watchers: dict[WatcherFactory, Watcher] = {}
        self._checks_thread: threading.Thread | None = None  # started by run()
        self._broken_hooks: set[str] = set()
        for check in REGISTRY:
            self._metrics_of(check)
            self._watcher_of(check)
        self._server: MetricsServer | None = None
        self._http_note: str | None = None  # why /metrics is not served, while it is not
        self.listen_address: tuple[str, int] | None = None
        self._remediation: DaemonRemediation | None = None
        if on_grade is None and self.config.daemon.act:
            from node_agent.service.actions import DaemonRemediation

            self._remediation = DaemonRemediation(self.config, self.record_action)
            self._on_grade = self._remediation
        # counter history and trends, in wall-clock time (a test advances simulated days)
        self._trends = TrendWatch.open(
            trends_file(graders_dir(self.config), shipped_graders_dir()),
            self.config.state_dir,
            wall_clock,
        )
        self._stored_grade = self._restore()

    # -- set-up ---------------------------------------------------------------------------------
    def _restore(self) -> Grade | None:
        """Read the stored state back: this boot's results of checks still scheduled, and the
        sticky findings; returns the stored grade (the answer's stand-in until complete)."""
        self._state = StateFile(self.config.state_dir)
        self._state_kept = True
        #: the latest graded state waiting to be written by the "state" thread (a write
        #: fsyncs: never on the path from a finding to the grade)
        self._pending: tuple[dict[str, CheckResults], list[Result], Grade] | None = None
        self._dirty = threading.Event()
        try:
            private_dir(self.config.state_dir)
        except OSError as err:
            log.error("state dir %s: %s; the node's state is not kept", self.config.state_dir, err)
            self._state_kept = False  # never written into a directory that is not the agent's
            return None
        stored: Stored = self._state.load()
        scheduled = {c.check for c in self.suite.checks}
        self._results = {k: v for k, v in stored.checks.items() if k in scheduled}
        for result in stored.sticky:
            self._stick(result, live=True)
        if stored.checks or stored.grade is not None:
            log.info(
                "daemon state read back from %s: %d check(s) with results of this boot, %d "
                "sticky finding(s), stored grade %s",
                self._state.path,
                len(self._results),
                len(stored.sticky),
                stored.grade.level.name if stored.grade else "none",
            )
        return stored.grade

    def _load_suite(self, config: Config) -> Suite:
        name = self._suite_name or config.daemon.suite
        return load_suite(name, suites_dir(config))

    def _make_schedule(self, suite: Suite) -> list[_Scheduled]:
        now = self._clock()
        default = self.config.daemon.default_every_s
        return [_Scheduled(spec, float(spec.every_s or default), now) for spec in suite.checks]

    @staticmethod
    def _mtime(path: str | None) -> float | None:
        try:
            return os.stat(path).st_mtime if path else None
        except OSError:
            return None

    def _start_http(self) -> None:
        host, _, port = (self._listen_override or self.config.daemon.listen).rpartition(":")

        def metrics() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)

        def healthz() -> tuple[int, str, bytes]:
            healthy, text = self.healthz()
            return 200 if healthy else 503, "text/plain; charset=utf-8", text.encode()

        try:
            self._server = MetricsServer(
                (host, int(port)), {"/metrics": metrics, "/healthz": healthz}
            )
        except OSError as err:
            # the watch, NVRx's answer and remediation go on without it: a daemon that exited
            # here would leave NVRx no socket (healthy to it), so whoever held the port first
            # would have switched the agent off
            why = err.strerror or str(err)
            if err.errno == errno.EADDRINUSE:
                holder = held_by_another(int(port)) or "another of root's programs holds it"
                why += f" ({holder})"
            note = (
                f"/metrics and /healthz are NOT served on {host}:{port}: {why}; retried every "
                f"{HTTP_RETRY_S:g} s, or choose another daemon.listen"
            )
            if self._http_note != note:
                log.error("%s", printable(note))
            self._http_note = note
            self._own_warnings("daemon", "metrics_unserved", [note], listen=f"{host}:{port}")
            return
        self.listen_address = self._server.server_address[:2]
        threading.Thread(target=self._server.serve_forever, name="http", daemon=True).start()
        if self._http_note is not None:
            log.warning("/metrics and /healthz are served on %s:%s again", host, port)
            self._http_note = None
            self._own_warnings("daemon", "metrics_unserved", [])

    # -- running --------------------------------------------------------------------------------
    def run(self, install_signals: bool = True) -> int:
        if install_signals:  # before anything answers: a stop sent once it does is never lost
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
            signal.signal(signal.SIGHUP, lambda *_: self._reload.set())
        # first: NVRx treats a missing socket as healthy; until the first grading the service
        # answers "not graded yet" (success false), and its own trouble is graded at start
        self._start_nvhcd()
        # the spools training jobs write to: one sticky directory per kind, apart from the
        # private state dir (docs/security.md); a problem is logged, the daemon goes on
        for note in ensure_spool_dirs(self.config.spool_dir):
            log.warning("spool: %s", note)
        in_process = {c.check for c in self.suite.checks} - set(
            self.config.daemon.subprocess_checks
        )
        if in_process & FORKSERVER_CHECKS:
            # before any other thread runs: never from a working directory others may write to
            proc.start_forkserver_in_child_cwd()
        self._start_http()
        next_http_retry = self._clock() + HTTP_RETRY_S
        if self._remediation is not None:
            self._remediation.start(self.env)
        self._regrade("start (stored state read back)")
        threading.Thread(target=self._save_loop, name="state", daemon=True).start()
        for watcher in self._watchers.values():
            watcher.start()
        self._checks_thread = threading.Thread(target=self._checks_loop, name="checks", daemon=True)
        self._checks_thread.start()
        host, port = self.listen_address or ("", 0)
        log.info(
            "node-agent daemon up: %s, suite %s (%d checks), metrics %s%s",
            self.env.inventory.host.hostname,
            self.suite.name,
            len(self.suite.checks),
            f"on http://{host}:{port}/metrics" if port else "NOT served (see above)",
            " (SIMULATED)" if self.env.simulated else "",
        )
        self._notifier.ready(f"watching {len(self.env.inventory.gpus)} GPU(s)")
        interval = min(0.25, self._notifier.watchdog_interval_s or 0.25)
        next_nvml_retry = self._clock() + self.config.daemon.nvml_retry_s
        was_blocked: str | None = None
        while not self._stop.wait(interval):
            self.last_tick = self._clock()
            self._notifier.watchdog()
            if self._reload.is_set():
                self._reload.clear()
                self.reload_config()
            if self._simulate and self._mtime(self._simulate) != self._scenario_mtime:
                self._reopen("the scenario file changed")
            elif (
                not self._simulate
                and self.env.gpu.unavailable_reason
                and self.last_tick >= next_nvml_retry
            ):
                next_nvml_retry = self.last_tick + self.config.daemon.nvml_retry_s
                self._reopen("retrying NVML", only_if_gpus=True)
            if self._server is None and self.last_tick >= next_http_retry:
                next_http_retry = self.last_tick + HTTP_RETRY_S
                self._start_http()
                if self._server is not None:
                    self._regrade("/metrics served again")
            with self._lock:
                stale = self._stale_checks() != self._stale
                blocked = self._blocked_by()
            if blocked != was_blocked:
                self._log_block(blocked, was_blocked)
                was_blocked = blocked
            if stale:
                self._regrade("a check's result went stale, or was renewed")
        self._shutdown()
        return 0

    def _log_block(self, blocked: str | None, was: str | None) -> None:
        if was is not None:
            log.warning("check %s ended its overlong run: the checks behind it run again", was)
        if blocked is not None:
            log.warning(
                "check %s has run past its timeout: the checks due behind it are late, and "
                "until its child is killed the node is answered from what is known (its "
                "ERROR/FAULT, else UNKNOWN)",
                blocked,
            )

    def stop(self) -> None:
        self._stop.set()
        self._wake_checks.set()
        self._dirty.set()

    def _shutdown(self) -> None:
        self._notifier.stopping()
        log.info("node-agent daemon stopping")
        for watcher in self._watchers.values():
            watcher.stop(timeout_s=1.5)
        if self._nvhcd is not None:
            self._nvhcd.stop()
        if self._remediation is not None:
            self._remediation.stop(timeout_s=1.5)
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        self._save_pending()
        with self._lock:
            self.env.close()
            self._trends.close()

    def healthz(self) -> tuple[bool, str]:
        """Healthy while the main loop ticks; the answered grade (UNKNOWN until every check has
        a result) is in the body, not the status code (a FAULT node's agent works as intended)."""
        age = self._clock() - self.last_tick
        if age > 10:
            return False, f"stalled: main loop last ticked {age:.0f} s ago\n"
        checks = self._checks_thread
        if checks is not None and not checks.is_alive() and not self._stop.is_set():
            return False, "stalled: the checks thread has died (see the log); restart the agent\n"
        view = self.view
        if view is None or view.unknown:
            missing = len(view.missing) if view else len(self.suite.checks)
            return (
                True,
                f"ok UNKNOWN ({missing} scheduled check(s) have no result yet, or none recent)\n",
            )
        return True, f"ok {view.level}\n"

    # -- configuration and environment ----------------------------------------------------------
    def reload_config(self) -> bool:
        """SIGHUP: a new config that does not load is refused and the old one kept."""
        self._notifier.reloading()
        try:
            config = load_config(self._config_path)
            suite = self._load_suite(config)
            env = open_environment(config, self._simulate)
        except ConfigError as err:
            log.error(
                "CONFIG RELOAD REFUSED, keeping the running configuration: %s", printable(err)
            )
            self._notifier.ready("config reload refused")
            return False
        with self._lock:
            scheduled = {c.check for c in suite.checks}
            dropped = {c.check for c in self.suite.checks} - scheduled
            old, self.env, self.config, self.suite = self.env, env, config, suite
            self._schedule = self._make_schedule(suite)
            self._results = {k: v for k, v in self._results.items() if k in scheduled}
            if self.view is None or not self.view.stored_grade:
                # the grade answered now stands in until the new schedule's checks have run;
                # a stored grade that is standing in already stays
                self._stored_grade = self.grade if self.view and not self.view.unknown else None
            for check in dropped & self._stats.keys():
                self._stats[check].scheduled = False
        for check in sorted(dropped):
            metrics = self._metrics_of(check)
            if metrics is not None:
                metrics.forget(check)
        old.close()
        log.info("configuration reloaded from %s", config.source)
        self._notifier.ready("config reloaded")
        self._regrade("config reload")
        self._wake_checks.set()
        return True

    def _reopen(self, why: str, only_if_gpus: bool = False) -> None:
        self._scenario_mtime = self._mtime(self._simulate)
        try:
            env = open_environment(self.config, self._simulate)
        except ConfigError as err:
            log.error(
                "%s, but the new environment does not load (kept the old one): %s",
                why,
                printable(err),
            )
            return
        if only_if_gpus and env.gpu.unavailable_reason:
            env.close()
            return
        with self._lock:
            old, self.env = self.env, env
            for item in self._schedule:  # re-examine the node at once
                item.next_due = self._clock()
        old.close()
        log.warning(
            "%s: environment reopened (%s, %d GPU(s))",
            why,
            env.inventory.host.gpu_backend,
            len(env.inventory.gpus),
        )
        self._wake_checks.set()

    # -- checks ---------------------------------------------------------------------------------
    def _checks_loop(self) -> None:
        handover = Handover()
        while not self._stop.is_set():
            with self._lock:
                due = min(self._schedule, key=lambda s: s.next_due, default=None)
                env = self.env
            if due is None:
                self._wake_checks.wait(5)
                self._wake_checks.clear()
                continue
            delay = due.next_due - self._clock()
            if delay > 0:
                self._wake_checks.wait(delay)
                self._wake_checks.clear()
                continue
            due.next_due = self._clock() + due.every_s
            started = time.time()
            t0 = self._clock()
            with self._lock:
                self._in_flight = (due.spec.check, t0, due.spec.timeout_s)
            try:
                if due.spec.check in self.config.daemon.subprocess_checks:
                    results = self._run_in_subprocess(due.spec)
                else:
                    results = run_check(due.spec, env, "service", handover)
            except Exception as err:  # noqa: BLE001 - run_check itself must not kill the loop
                log.exception("running %s failed", due.spec.check)
                results = [
                    Result(
                        check=due.spec.check,
                        target="node",
                        metric="crashed",
                        status=Status.ERROR,
                        detail=f"{type(err).__name__}: {err}",
                    )
                ]
            with self._lock:
                self._in_flight = None
                current = any(item is due for item in self._schedule)
            if not current:  # a reload made a new schedule while it ran: it runs again anew
                continue
            try:
                self._record(due.spec.check, results, started, self._clock() - t0)
            except Exception:  # noqa: BLE001 - one run's grading must not end the watching
                log.exception("grading the results of %s failed; the checks go on", due.spec.check)

    def _run_in_subprocess(self, spec: CheckSpec) -> list[Result]:
        """Run a check in a child process (``daemon.subprocess_checks``; check_child.py).

        Compute checks import torch (hundreds of MB resident); the daemon stays small by never
        importing it, and a check wedged in the driver takes only the child with it. The child
        runs in / as python -P (never importing from the daemon's working directory, which
        others may write to): every path it gets is absolute, the config's own included."""
        with self._lock:
            config, node = self.config, self.env.node.spec
        return run_in_child(
            ChildSpec(
                check=spec.check,
                timeout_s=spec.timeout_s,
                params=spec.params,
                mode="service",
                config=proc.absolute_config(config.data),
                node=node,
            )
        )

    def _record(self, check: str, results: list[Result], started: float, duration: float) -> None:
        worst = max((r.status for r in results), key=lambda s: s.severity, default=None)
        # the counter history (SQLite; outside the lock, which the watchers and /metrics need)
        try:
            self._trends.update(results, _sku_limits(self.env))
        except Exception:  # noqa: BLE001 - trends must never stop the checks
            log.exception("recording the trends of %s failed", printable(check))
        failed = any(r.status is Status.ERROR for r in results)
        with self._lock:
            stats = self._stats.setdefault(check, CheckStats())
            stats.scheduled = True
            stats.runs += 1
            stats.errors += failed
            stats.failing_runs = stats.failing_runs + 1 if failed else 0
            stats.last_run_unix = started + duration
            stats.last_duration_s = duration
            stats.worst_status = worst.value if worst else None
            # a sticky result (the check's SERVICE.sticky) is kept apart, folded with the one
            # kept under its key; the others are this run's until the next
            kept = [r for r in results if not self._stick(r)]
            kept += _unread_findings(self._results.get(check), kept)
            if stats.failing_runs >= self.config.daemon.failures_warn_after:
                kept.append(_repeated_failure(check, stats.failing_runs, results))
            self._results[check] = CheckResults(kept, started + duration)
            metrics = self._metrics_of(check)
        if metrics is not None:
            metrics.observe(results)
        if worst is Status.ERROR:
            log.warning(
                "check %s could not run: %s",
                printable(check),
                printable("; ".join(r.detail for r in results if r.status is Status.ERROR)[:500]),
            )
        self._regrade(f"check {check}")

    def _stick(self, result: Result, live: bool = False) -> bool:
        """Keep ``result`` if its check calls it sticky (under the lock); True when it is.
        ``live``: a watcher's own fold of the same finding, which always replaces what is
        kept (its count grows with every line it folds)."""
        hooks = self._hooks(result.check)
        key = hooks.sticky_key(result)
        if key is None:
            return False
        kept = self._sticky.get((result.check, key))
        self._sticky[(result.check, key)] = (
            result if kept is None or live else hooks.fold(kept, result)
        )
        return True

    def _metrics_of(self, check: str) -> CheckMetrics | None:
        """The check's own collector (its SERVICE.metrics), built and registered on first use;
        checks that share a factory share the collector."""
        factory = self._hooks(check).metrics
        if factory is None:
            return None
        collector = self._check_metrics.get(factory)
        if collector is None:
            collector = self._check_metrics[factory] = factory(self._labels)
            self._registry.register(collector)
        return collector

    def _watcher_of(self, check: str) -> None:
        """Build the check's watcher (its SERVICE.watcher), once per factory, and register it as
        a collector; it starts with the daemon. One that cannot be built is logged, never fatal."""
        factory = self._hooks(check).watcher
        if factory is None or factory in self._watchers:
            return
        context = WatchContext(lambda: self.env, self._labels, self._on_sighting)
        try:
            watcher = factory(context)
        except Exception as err:  # noqa: BLE001 - a broken watcher must not stop the daemon
            log.error("check %s: its watcher cannot be built: %s", check, printable(str(err)))
            return
        self._watchers[factory] = watcher
        self._registry.register(watcher)

    def _hooks(self, check: str) -> ServiceBehaviour:
        """The check's SERVICE; PLAIN for a name the registry lacks or a module that does not
        import (its runs report that themselves), logged once."""
        if check not in REGISTRY:
            return PLAIN
        try:
            return behaviour(check)
        except Exception as err:  # noqa: BLE001 - a broken check module must not stop the daemon
            if check not in self._broken_hooks:
                self._broken_hooks.add(check)
                log.error(
                    "check %s: its service behaviour cannot be read: %s", check, printable(err)
                )
            return PLAIN

    def _labels(self) -> NodeLabels:
        with self._lock:
            return NodeLabels(
                self.env.inventory.host.hostname,
                {g.index: g.uuid for g in self.env.inventory.gpus},
            )

    # -- watchers -------------------------------------------------------------------------------
    def _on_sighting(self, sighting: Sighting) -> None:
        """One folded finding from a check's watcher: a first line, a new variant or burst, or a
        count update (at most once a minute). It is kept as its check's sticky result under the
        same key as that check's own findings, replacing what is kept there (the watcher's fold
        only grows), and graded at once."""
        result = sighting.result
        with self._lock:
            env = self.env
            first = (result.check, self._hooks(result.check).sticky_key(result)) not in self._sticky
            kept = self._stick(result, live=True)
        if not kept:
            log.error(
                "check %s: its watcher reported a finding its SERVICE.sticky does not keep, so it "
                "is not graded: %s",
                printable(result.check),
                printable(result.detail[:300]),
            )
            return
        if first:
            alone = env.grader.grade([result], "service")
            name = next((r.name for r in alone.reasons if r.name), None)
            log.warning(
                "%s: %s%s",
                printable(sighting.headline),
                alone.level.name,
                f" ({printable(name)})" if name else "",
            )
        self._regrade(f"{sighting.headline} ({sighting.why})")

    # -- grading --------------------------------------------------------------------------------
    def current_results(self) -> list[Result]:
        with self._lock:
            return (
                [r for entry in self._results.values() for r in entry.results]
                + list(self._sticky.values())
                + self._trends.results()
                + [r for rs in self._own.values() for r in rs]
            )

    def _regrade(self, why: str) -> None:
        with self._lock:
            results = self.current_results()
            grade = self.env.grader.grade(results, "service")
            changed = (grade.level, grade.reasons) != (self.grade.level, self.grade.reasons)
            previous, self.grade = self.grade, grade
            self._graded_at = time.time()
            env = self.env
            self.view = self._make_view(grade, results)
            self._pending = (dict(self._results), list(self._sticky.values()), grade)
            # remediation acts on a grade over every scheduled check, or on an ERROR/FAULT
            # found before then: a partial grade that passes would resume a node drained for a
            # finding whose check has not run again yet
            handed = (grade.level, grade.reasons)
            hand = (self.view.complete or grade.level >= Level.ERROR) and handed != self._handed
            if hand:
                self._handed = handed
        self._dirty.set()
        if changed and grade.level != previous.level:
            # reasons quote what users wrote (a heartbeat's job, its pause reason, a process's
            # name): every such text is escaped, one line per reason (docs/security.md)
            log.warning(
                "grade %s -> %s after %s%s",
                previous.level.name,
                grade.level.name,
                printable(why),
                "".join(
                    f"\n  {r.level.name} {printable(r.target)}: {printable(r.message)}"
                    for r in grade.reasons[:10]
                ),
            )
        if hand and self._on_grade is not None:
            try:
                self._on_grade(grade, results, env)
            except Exception:  # noqa: BLE001 - remediation trouble must not stop the watch
                log.exception("acting on grade %s failed", grade.level.name)

    def _save_loop(self) -> None:
        """The "state" thread: write the latest graded state whenever there is a newer one."""
        while not self._stop.is_set():
            self._dirty.wait()
            self._save_pending()

    def _save_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            self._dirty.clear()
        if pending is not None and self._state_kept:
            self._state.save(*pending)

    def _make_view(self, grade: Grade, results: list[Result]) -> NodeView:
        """What the daemon answers for the node (under the lock): the grade once every scheduled
        check has a result, else the grade's ERROR/FAULT, the stored one's, or UNKNOWN."""
        scheduled = [c.check for c in self.suite.checks]
        self._stale = self._stale_checks()
        missing = tuple(c for c in scheduled if c not in self._results or c in self._stale)
        if not missing and self._stored_grade is not None:
            log.info("the node's state is known: every scheduled check has a result")
            self._stored_grade = None
        level, reasons, stored = answered(grade, not missing, self._stored_grade)
        uids = owners(results)
        return NodeView(
            level,
            tuple(
                ViewReason(
                    r.rule,
                    r.level.name,
                    r.target,
                    r.message,
                    owner_uid=next(iter(uids[r.target]))
                    if len(uids.get(r.target, ())) == 1
                    else None,
                    about_users=r.entity.kind == "job" or r.target in uids,
                    catalog=r.catalog,
                    code=r.code,
                    name=r.name,
                )
                for r in reasons
            ),
            graded_at=self._graded_at or time.time(),
            complete=not missing,
            missing=missing,
            finished={k: v.finished_unix for k, v in self._results.items()},
            restored=frozenset(k for k, v in self._results.items() if v.restored),
            stored_grade=stored,
            suite=self.suite.name,
        )

    def _stale_checks(self) -> frozenset[str]:
        """Scheduled checks whose latest result does not stand for the node now: older than any
        rotation of the schedule can make it (twice the check's interval, every check's timeout
        in turn, and a child's kill grace: the checks loop has stalled), or, while a check runs
        past its timeout (:meth:`_blocked_by`), that check and every check due behind it (a
        child wedged in the driver holds up the NVML reads until its kill grace ends)."""
        now = time.time()
        rotation = sum(item.spec.timeout_s for item in self._schedule) + STALE_GRACE_S
        blocked = self._blocked_by()
        return frozenset(
            item.spec.check
            for item in self._schedule
            if (kept := self._results.get(item.spec.check)) is not None
            and (
                now - kept.finished_unix > 2 * item.every_s + rotation
                or (blocked is not None and item.spec.check == blocked)
                or (blocked is not None and item.next_due <= self._clock())
            )
        )

    def _blocked_by(self) -> str | None:
        """The check running now if it has run past its own timeout: a check ends within it
        (each keeps to its deadline), so one still running is wedged, and only its child's
        kill grace is left. How long a run takes within the timeout varies too much to judge
        sooner (a stack sample of a stalled job takes 27 s where the last run took 0.2 s)."""
        if self._in_flight is None:
            return None
        check, since, timeout_s = self._in_flight
        return check if self._clock() - since > timeout_s else None

    # -- NVRx's node health check (docs/daemon.md) ----------------------------------------------
    def _start_nvhcd(self) -> None:
        """Serve NVRx's RunHealthCheck on ``daemon.nvhcd.socket`` from the node's view. A service
        that cannot start, or that the job's users cannot reach, is a WARN of its own."""
        settings = self.config.daemon.nvhcd
        path = settings.socket
        if not path:
            return
        from node_agent.service.nvhcd import HealthAnswerer, NvhcdServer

        server = NvhcdServer(
            HealthAnswerer(lambda: self.view),
            path,
            group=settings.group,
            max_per_uid=settings.max_per_uid,
            call_s=settings.call_s,
        )
        try:
            notes = server.start()
        except (OSError, KeyError, ImportError, RuntimeError) as err:
            log.error(
                "NVRx node health check NOT served on %s: %s", printable(path), printable(err)
            )
            notes = [f"NVRx's node health check is NOT served on {path}: {err}"]
        else:
            self._nvhcd = server
            log.info(
                "NVRx node health check served on unix://%s%s",
                printable(path),
                " (held across restarts)" if server.held_across_restarts else "",
            )
        for note in notes:
            log.warning("%s", printable(note))
        self._own_warnings(
            "nvhcd",
            "nvhcd_unreachable",
            [
                f"{note}; NVRx treats a missing or unreachable service as healthy, so its "
                "restarts do not ask this node (docs/daemon.md)"
                for note in notes
            ],
            socket=path,
        )

    def _own_warnings(self, check: str, metric: str, details: list[str], **evidence: str) -> None:
        """The daemon's findings about itself from one source (``check``), replacing the last."""
        with self._lock:
            self._own[check] = [
                Result(check, "node", metric, Status.WARN, detail, evidence=evidence)
                for detail in details
            ]

    def record_action(self, action: str, outcome: str) -> None:
        with self._lock:
            self._actions[(action, outcome)] += 1

    # -- metrics --------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                hostname=self.env.inventory.host.hostname,
                # the level answered (NVRx, /healthz): a stored ERROR/FAULT stands in for a
                # partial grade until every scheduled check has run
                level=(
                    Level[self.view.level]
                    if self.view is not None and not self.view.unknown
                    else self.grade.level
                ),
                checks={k: CheckStats(**vars(v)) for k, v in self._stats.items()},
                actions=dict(self._actions),
                simulated=self.env.simulated,
                remediation_state=(
                    self._remediation.state if self._remediation is not None else None
                ),
                unknown=self.view is None or self.view.unknown,
                result_unix={k: v.finished_unix for k, v in self._results.items()},
                intervals={item.spec.check: item.every_s for item in self._schedule},
                nvhcd_served=(
                    None if not self.config.daemon.nvhcd.socket else self._nvhcd is not None
                ),
                nvlink_domain=nvlink_domain_of(self.env.inventory),
            )


def _unread_findings(previous: CheckResults | None, results: list[Result]) -> list[Result]:
    """The failed findings of a check's previous run that this run could not read again: on a
    target this run errored on (or on any, when it errored on ``node``: the whole check), and
    not measured anew. A reading that fails is no evidence the fault went away: a row-remap
    failure whose NVML call starts to fail stays FAULT, and says since when it was not read."""
    errored = {r.target for r in results if r.status is Status.ERROR}
    if previous is None or not errored:
        return []
    measured = {(r.target, r.metric) for r in results if r.status is not Status.ERROR}
    return [
        r
        if "unread_since" in r.evidence
        else replace(
            r,
            detail=f"{r.detail} (as last read at {utc_iso(previous.finished_unix)}: the check "
            "could not read it since)",
            evidence={**r.evidence, "unread_since": utc_iso(previous.finished_unix)},
        )
        for r in previous.results
        if r.status is Status.FAIL
        and (r.target in errored or "node" in errored)
        and (r.target, r.metric) not in measured
    ]


def _repeated_failure(check: str, runs: int, results: list[Result]) -> Result:
    """The WARN of a check that timed out or failed ``runs`` runs in a row: the source it reads
    (NVML, DCGM, a tool) may be wedged, and its own results say nothing new meanwhile."""
    what = "; ".join(r.detail for r in results if r.status is Status.ERROR)[:300]
    return Result(
        check=check,
        target="node",
        metric="repeated_failure",
        status=Status.WARN,
        detail=f"check {check} timed out or failed {runs} runs in a row (latest: {what}); the "
        "source it reads (NVML, DCGM, a tool) may be hung: see the daemon's log",
        value=runs,
        evidence={"failing_runs": runs},
    )


def _sku_limits(env: Environment) -> dict[str, object] | None:
    """The SKU's limits and performance minima, where trends.yaml's ``threshold_sku`` looks."""
    sku = env.sku
    return None if sku is None else {**sku.section("performance"), **sku.section("limits")}
