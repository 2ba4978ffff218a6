"""The daemon's trend watch: records each check run's numeric results into the counter history
and grades the trends of the series that run touched (docs/trends.md).

What it gives the daemon is results of the check ``trends``: one WARN (metric ``trend``) per
series whose trend warns, one WARN (metric ``history``) while the history cannot be used or was
found corrupt, and one node-level ``trends`` PASS saying how many series are watched, so that
"no trend" is a statement, not a silence. Graded by rules ``trend-*`` (WARN, never an action).

A series kept per part (``each``: one NVLink of a GPU) with a ``persist`` rule is also judged
on every reading by a :class:`~node_agent.grading.trends.WindowTracker` (which windows its
counter grew in): a WARN, or a ``fail`` when the growth persists, with the rule's metric
(``nvlink_link_errors``; rules ``nvlink-link-*``). A per-part series is written to the history
from its first reading above zero: a link that never erred has no trend to keep, and an NVL72
tray has 72 links of 3 counters each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node_agent.grading.trends import (
    Sampled,
    TrendSpecs,
    WindowTracker,
    evaluate,
    load_trend_specs,
    persistence_result,
    trend_result,
)
from node_agent.model import Result, Status
from node_agent.service.history import History, Sample, open_history

log = logging.getLogger("node_agent.service.trend_watch")

TRENDS_FILE = "trends.yaml"
#: a series' trend is graded at most this often (seconds of the clock): the fit reads the
#: series from SQLite and costs about a millisecond; checks run every 10 s, and a trend over
#: days moves little in an hour
EVALUATE_EVERY_S = 3600.0


def trends_file(graders: Path, shipped: Path) -> Path:
    """``trends.yaml`` of the configured graders directory, else the shipped one (an operator's
    older directory may not have it)."""
    own = graders / TRENDS_FILE
    return own if own.exists() else shipped / TRENDS_FILE


class TrendWatch:
    """Record, evaluate, and hand back the ``trends`` results. One thread calls :meth:`update`
    (the daemon's checks thread, outside the daemon's lock: SQLite may wait on the disk); any
    thread may call :meth:`results`, which reads the list the last update published."""

    def __init__(
        self,
        specs: TrendSpecs,
        history: History,
        clock: Callable[[], float] = time.time,
        evaluate_every_s: float = EVALUATE_EVERY_S,
    ) -> None:
        self.specs = specs
        self.history = history
        self._clock = clock
        self._every_s = evaluate_every_s
        self._evaluated: dict[tuple[str, str, str], float] = {}
        self._warns: dict[tuple[str, str, str], Result] = {}
        self._trackers: dict[tuple[str, str, str], WindowTracker] = {}
        self._persisting: dict[tuple[str, str, str], Result] = {}
        self._nonzero: set[tuple[str, str, str]] = set()
        self._published: tuple[Result, ...] = ()
        self._publish()

    @classmethod
    def open(
        cls, trends_path: Path, state_dir: Path, clock: Callable[[], float] = time.time
    ) -> TrendWatch:
        """Specs from ``trends_path`` (ConfigError when it is wrong), history under
        ``state_dir`` (never raises: an unusable history is a WARN)."""
        return cls(load_trend_specs(trends_path), open_history(state_dir, clock), clock)

    def update(self, results: list[Result], sku_limits: dict[str, Any] | None) -> None:
        """Record the samples in ``results`` and re-grade the series they belong to."""
        samples = self.specs.samples(results)
        if not samples:
            return
        try:
            self._update(samples, sku_limits)
        finally:
            self._publish()

    def _update(self, samples: list[Sampled], sku_limits: dict[str, Any] | None) -> None:
        now = self._clock()
        self._persistence(samples, now)
        kept = [s for s in samples if self._keeps(s)]
        self.history.record(
            Sample(s.spec.check, s.target, s.spec.key(s.part), s.spec.kind, s.value) for s in kept
        )
        for spec, target, _, part, _ in kept:
            key = (spec.name, target, part)
            if now - self._evaluated.get(key, float("-inf")) < self._every_s:
                continue
            self._evaluated[key] = now
            points = self.history.points(spec.check, target, spec.key(part))
            trend = evaluate(spec, target, points, now, spec.threshold_for(sku_limits), part)
            if trend is not None and trend.warn:
                if key not in self._warns:
                    log.warning("trend: %s", trend.message())
                self._warns[key] = trend_result(trend, points)
            else:
                self._warns.pop(key, None)

    def _keeps(self, s: Sampled) -> bool:
        """Whether the history records ``s``: always, except a per-part series that has not
        yet read above zero."""
        if not s.part:
            return True
        key = (s.spec.name, s.target, s.part)
        if s.value > 0:
            self._nonzero.add(key)
        return key in self._nonzero

    def _persistence(self, samples: list[Sampled], now: float) -> None:
        """Feed each per-part series with a persist rule its reading; keep its result."""
        for s in samples:
            if s.spec.persist is None:
                continue
            key = (s.spec.name, s.target, s.part)
            tracker = self._trackers.setdefault(key, WindowTracker(s.spec.persist))
            tracker.add(now, s.value)
            result = persistence_result(s, tracker.counts(now), s.value)
            if result is None:
                self._persisting.pop(key, None)
                continue
            if key not in self._persisting or self._persisting[key].status != result.status:
                log.warning("link errors: %s", result.detail)
            self._persisting[key] = result

    def results(self) -> list[Result]:
        """The current ``trends`` results (never empty: the watch says what it watches)."""
        return list(self._published)

    def _publish(self) -> None:
        out = list(self._warns.values()) + list(self._persisting.values())
        problem = self.history.problem or self.history.notice
        if problem:
            out.append(
                Result(
                    check="trends",
                    target="node",
                    metric="history",
                    status=Status.WARN,
                    detail=f"counter history: {problem}; trends "
                    + ("are not graded" if self.history.problem else "start over"),
                    evidence={"path": str(self.history.path)},
                )
            )
        watched = len(self._evaluated)
        out.append(
            Result(
                check="trends",
                target="node",
                metric="trends",
                status=Status.PASS,
                detail=f"{watched} series watched, {len(self._warns)} trending "
                f"towards their thresholds",
                value=len(self._warns),
                unit="series",
                evidence={"series": watched},
            )
        )
        self._published = tuple(out)  # one assignment: readers see the old list or the new

    def close(self) -> None:
        self.history.close()
