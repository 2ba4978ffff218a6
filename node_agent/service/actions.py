"""The daemon's remediation: grade changes become actions through the configured adapter.

One thread owns the store (SQLite connections stay on the thread that opened them) and the
adapter; grade changes are queued to it, so a slow scheduler never delays the XID watch. Only
the latest grade matters: when several changes queue up while an action runs, the thread acts
on the newest. On start it completes, once, any action a crash left half done (the journal).
All the guards of ``remediation.executor.Remediator`` apply; the daemon adds none and skips none. A
hung training job (``training-hang``, from the periodic ``training_progress`` check) is a
``restart-job`` through the adapter like any other step; evidence before it includes the stacks
of the GPU processes, as under ``check --act``.

A failed action (a webhook or slurmctld outage) is retried while the grade that asked for it
stands: after ``daemon.retry_initial_s`` (30 s), doubling up to ``daemon.retry_max_s`` (600 s),
for as long as no newer grade arrives. Each retry is the same step under the same idempotency
key, a new journal row per attempt (``remediation/executor.py``), with the guards asked again.
An action refused because the agent's own state was unavailable is retried the same way (the
disk may have been freed). A newer grade ends the retries of the old one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from node_agent.config import Config
from node_agent.environment import Environment
from node_agent.model import Grade, Result, utc_iso
from node_agent.report.build import build_report
from node_agent.report.terminal import printable

if TYPE_CHECKING:
    from node_agent.remediation.executor import Outcome
    from node_agent.remediation.store import Store

log = logging.getLogger("node_agent.service.daemon.actions")

_STOP = object()
_Item = tuple[Grade, list[Result], Environment]  # a grade change, with its results and node


class DaemonRemediation:
    """Callable as the daemon's ``on_grade`` hook; ``record`` counts actions for /metrics."""

    def __init__(self, config: Config, record: Callable[[str, str], None]) -> None:
        from node_agent.remediation.host import open_configured_adapter

        self._config = config
        self._record = record
        # ConfigError (exit 2) before anything runs
        self.adapter = open_configured_adapter(config, None)
        #: the scheduler's name for this node (remediation.host.node_name), set by ``start``
        #: from the environment's host name
        self.node = ""
        #: this node's remediation state as the store last said (None: not read yet, or the
        #: store unavailable); /metrics exports whether the agent holds the node drained
        self.state: str | None = None
        self._queue: queue.Queue[_Item | object] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="remediation", daemon=True)

    def start(self, env: Environment) -> None:
        from node_agent.remediation.host import node_name

        self._env = env
        self.node = node_name(self._config, host=env.inventory.host.hostname)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def __call__(self, grade: Grade, results: list[Result], env: Environment) -> None:
        self._queue.put((grade, results, env))

    def _loop(self) -> None:
        from node_agent.remediation.store import open_store

        store = open_store(self._config.state_dir)
        item: _Item | None = None
        failures = 0
        retry_at: float | None = None
        try:
            self._act(store, None)  # crash recovery first
            self._read_state(store)
            while True:
                timeout = None if retry_at is None else max(0.0, retry_at - time.monotonic())
                try:
                    new = self._queue.get(timeout=timeout)
                except queue.Empty:
                    new = None  # the retry of the standing grade is due
                while new is not None and new is not _STOP and not self._queue.empty():
                    new = self._queue.get()  # act on the newest grade only
                if new is _STOP:
                    return
                if new is not None:
                    item, failures = cast(_Item, new), 0
                if store.unavailable is not None:
                    # a full disk may have been freed, a lock released: look again (a store
                    # that is still unavailable refuses the actions, recorded as refused)
                    store.close()
                    store = open_store(self._config.state_dir)
                outcome = self._act(store, item, retry=new is None)
                self._read_state(store)
                if outcome is None or outcome.wants_retry:
                    failures += 1
                    delay = self.retry_delay_s(failures)
                    retry_at = time.monotonic() + delay
                    log.warning(
                        "remediation: an action did not go through; retrying in %.0f s "
                        "while the grade stands (attempt %d)",
                        delay,
                        failures + 1,
                    )
                else:
                    retry_at = None
        finally:
            store.close()

    def _read_state(self, store: Store) -> None:
        try:
            self.state = (
                None if store.unavailable is not None else store.node_record(self.node).state
            )
        except Exception:  # noqa: BLE001 - a store that fails here is unavailable for metrics too
            self.state = None

    def retry_delay_s(self, failures: int) -> float:
        """Seconds before the next try after ``failures`` failed ones: initial, doubling, capped."""
        initial = self._config.daemon.retry_initial_s
        cap = self._config.daemon.retry_max_s
        return float(min(cap, initial * 2 ** min(failures - 1, 30)))

    def _act(self, store: Store, item: _Item | None, retry: bool = False) -> Outcome | None:
        from node_agent.remediation.host import open_remediator
        from node_agent.resources import suites_dir
        from node_agent.runner import run_suite
        from node_agent.suite import load_suite

        env = item[2] if item else self._env

        def retest() -> Grade:
            quick = load_suite("quick", suites_dir(self._config))
            return env.grader.grade(run_suite(quick, env), quick.mode)

        remediator = open_remediator(
            env, self._config, store, self.adapter, self.node, retest=retest
        )
        try:
            if item is None:
                outcome = remediator.recover()
            else:
                grade, results, _ = item
                report = build_report(env, "daemon", "service", utc_iso(), results, grade)
                outcome = remediator.remediate(report, record_run=not retry)
        except Exception:  # noqa: BLE001 - the daemon outlives a remediation bug; logged loudly
            log.exception("remediation failed; the action stays in the journal for retry")
            self._record("remediate", "failed")
            return None
        for rec in outcome.records:
            self._record(str(rec.action), str(rec.outcome))
            # a detail or note can quote what a user wrote (a job name, a heartbeat's text)
            log.warning(
                "action %s via %s: %s (%s)",
                printable(rec.action),
                printable(rec.adapter),
                printable(rec.outcome),
                printable(rec.detail),
            )
        for note in outcome.notes:
            if note:
                log.info("remediation: %s", printable(note))
        return outcome
