"""Trends: what is about to fail, from a counter's history (pure; no SQLite, no clock of its own).

The daemon keeps the numeric results named in ``graders/trends.yaml`` as series over time
(``node_agent.service.history``) and asks this module, after each check run, which series are
on their way to trouble. Two rules, each a WARN with the series as evidence (docs/trends.md):

1. **Forecast.** A robust line through the series since its last reset, the Theil-Sen
   estimator (the median of the slopes between every pair of points: Theil 1950, Sen 1968; up
   to 29 % of the points may be outliers without moving it), gives "rising at X per day,
   crosses its threshold in about N days". A crossing within ``horizon_days`` warns.
2. **Rising in k of the last n windows.** NVIDIA's resiliency extension marks a link bad when
   its error counters rise in k of the last n sampling windows; a counter that
   climbs in most recent windows is a bad part even when its slope is small.
3. **Persistence, per part** (``persist``). A series kept per part of a result (``each``: one
   NVLink of a GPU) whose counter grew in ``k`` of the last ``n`` short windows (NVIDIA's
   resiliency extension flags a GPU after 15 of 30 one-minute windows with NVLink replay or
   recovery growth) is a WARN naming the part; when it did so in each of the last ``spans``
   runs of ``n`` windows (an hour, by default) the growth persists, and it is a ``fail`` (the
   rules grade it ERROR). It is judged on every reading from :class:`WindowTracker`, which
   keeps only which windows rose, not the readings: the history's 5-minute points are too
   coarse for one-minute windows.

A counter that resets (a reboot, a driver reload, a GPU reset: the value drops) starts a new
segment. No fit spans a reset, no rate is ever negative, and the step at a reset counts as no
increase (a counter at 0 after a reboot is not a drop of the part's health, and what it counted
before the reset is not known to be new). A gauge (a thermal margin, a throughput) has no
resets: one segment, and its trend may fall (``direction: down``) towards a lower threshold.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from node_agent.model import Result, Status
from node_agent.yamlfile import ConfigError, load_yaml

DAY_S = 86400.0
#: a segment longer than this is thinned (evenly, keeping its first and last points) before
#: the fit: Theil-Sen is O(n^2) in pairs; 100 points are 4,950 pairs (about a ms in Python)
MAX_FIT_POINTS = 100
#: at most this many of a series' newest points travel as a trend's evidence
EVIDENCE_POINTS = 48


@dataclass(frozen=True)
class Point:
    """One value of a series at ``at`` (UNIX seconds). ``reset``: the counter dropped at or
    before this point since the previous one kept (it starts a new segment)."""

    at: float
    value: float
    reset: bool = False


@dataclass(frozen=True)
class SeriesSpec:
    """One entry of ``graders/trends.yaml``: which results feed a series and when it warns."""

    name: str
    check: str
    metric: str
    kind: str  # counter | gauge
    direction: str  # up: trouble is above the threshold; down: below it
    threshold: float | None
    threshold_sku: str | None  # a SKU ``limits`` key whose value is the threshold
    unit: str
    why: str
    evidence_key: str | None = None  # the value is result.evidence[key], not result.value
    margin_from: str | None = None  # the value is result.evidence[key] - result.value
    horizon_days: float = 30.0
    min_points: int = 4
    min_span_h: float = 12.0
    window_h: float = 24.0
    k: int = 3
    n: int = 4
    each: str | None = None  # an evidence mapping {part: value}: one series per part
    part: str = "link"  # what a key of ``each`` names (in targets' details and metric keys)
    peers: str | None = None  # an evidence mapping {part: peer} naming each part's other end
    persist: Persist | None = None

    def key(self, part: str = "") -> str:
        """The metric a series is kept under in the history: the result's metric, with the
        series' name when the value is not the result's value (two series may read one result),
        and the part (``link 5``) for a series kept per part."""
        plain = self.evidence_key is None and self.margin_from is None and self.each is None
        base = self.metric if plain else f"{self.metric}:{self.name}"
        return f"{base}:{part}" if part else base

    def values_of(self, result: Result) -> list[tuple[str, float]]:
        """(part, value) for each series of this spec in ``result``: one with part ``""``, or
        one per key of the ``each`` mapping (``link 5``); none for a skip or an error."""
        if self.each is None:
            value = self.value_of(result)
            return [] if value is None else [("", value)]
        if result.status in (Status.SKIP, Status.ERROR):
            return []
        mapping = (result.evidence or {}).get(self.each)
        if not isinstance(mapping, dict):
            return []
        return [
            (f"{self.part} {k}", float(v))
            for k, v in sorted(mapping.items(), key=lambda kv: _part_order(kv[0]))
            if _number(v)
        ]

    def value_of(self, result: Result) -> float | None:
        """The series' value in ``result`` (None when it carries none: a skip, a missing key)."""
        if result.status in (Status.SKIP, Status.ERROR):
            return None
        evidence = result.evidence or {}
        raw: Any = evidence.get(self.evidence_key) if self.evidence_key else result.value
        if self.margin_from is not None:
            limit = evidence.get(self.margin_from)
            if not _number(limit) or not _number(raw):
                return None
            raw = float(limit) - float(raw)
        return float(raw) if _number(raw) else None

    def threshold_for(self, sku_limits: dict[str, Any] | None) -> float | None:
        """The SKU's limit where the spec names one and the SKU has it, else the fixed one."""
        if self.threshold_sku and sku_limits and _number(sku_limits.get(self.threshold_sku)):
            return float(sku_limits[self.threshold_sku])
        return self.threshold


@dataclass(frozen=True)
class Persist:
    """The persistence rule of a per-part series (``persist`` in trends.yaml): grew in ``k``
    of the last ``n`` windows of ``window_s`` -> WARN; in each of the last ``spans`` runs of
    ``n`` windows -> persisting (``fail``). Results carry ``metric``."""

    metric: str
    window_s: float = 60.0
    k: int = 15
    n: int = 30
    spans: int = 2


def _part_order(key: object) -> tuple[int, str]:
    text = str(key)
    return (int(text), text) if text.isdigit() else (1 << 30, text)


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


_WINDOWS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "window_h": {"type": "number", "exclusiveMinimum": 0},
        "k": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1},
    },
}
_PERSIST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["metric"],
    "properties": {
        "metric": {"type": "string", "pattern": r"^[a-z0-9_]{1,64}$"},
        "window_s": {"type": "number", "exclusiveMinimum": 0},
        "k": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1},
        "spans": {"type": "integer", "minimum": 1, "maximum": 24},
    },
}
_COMMON = {
    "horizon_days": {"type": "number", "exclusiveMinimum": 0},
    "min_points": {"type": "integer", "minimum": 3},
    "min_span_h": {"type": "number", "minimum": 0},
    "windows": _WINDOWS,
}
TRENDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["series"],
    "properties": {
        "defaults": {"type": "object", "additionalProperties": False, "properties": _COMMON},
        "series": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "check", "metric", "kind", "why"],
                "properties": {
                    "name": {"type": "string", "pattern": r"^[a-z0-9_]{1,64}$"},
                    "check": {"type": "string", "minLength": 1},
                    "metric": {"type": "string", "minLength": 1},
                    "kind": {"enum": ["counter", "gauge"]},
                    "direction": {"enum": ["up", "down"]},
                    "threshold": {"type": "number"},
                    "threshold_sku": {"type": "string", "minLength": 1},
                    "evidence": {"type": "string", "minLength": 1},
                    "margin_from": {"type": "string", "minLength": 1},
                    "unit": {"type": "string"},
                    "why": {"type": "string", "minLength": 1},
                    "each": {"type": "string", "minLength": 1},
                    "part": {"type": "string", "pattern": r"^[a-z]{1,16}$"},
                    "peers": {"type": "string", "minLength": 1},
                    "persist": _PERSIST,
                    **_COMMON,
                },
            },
        },
    },
}


class Sampled(NamedTuple):
    """A series' value in one result: the series is (spec, target, part); ``peer`` is the
    part's other end where the result names it."""

    spec: SeriesSpec
    target: str
    value: float
    part: str = ""
    peer: str | None = None


def _peer(peers: object, part: str) -> str | None:
    if not isinstance(peers, dict) or not part:
        return None
    peer = peers.get(part.rsplit(" ", 1)[-1])
    return str(peer) if peer not in (None, "") else None


@dataclass(frozen=True)
class TrendSpecs:
    """All series of ``graders/trends.yaml``, looked up by (check, metric)."""

    series: tuple[SeriesSpec, ...] = ()
    _by_key: dict[tuple[str, str], list[SeriesSpec]] = field(default_factory=dict, compare=False)

    def samples(self, results: Sequence[Result]) -> list[Sampled]:
        """One :class:`Sampled` for every series value in ``results``."""
        out = []
        for result in results:
            for spec in self._by_key.get((result.check, result.metric), ()):
                peers = (result.evidence or {}).get(spec.peers) if spec.peers else None
                for part, value in spec.values_of(result):
                    peer = _peer(peers, part)
                    out.append(Sampled(spec, result.target, value, part, peer))
        return out

    def get(self, name: str) -> SeriesSpec | None:
        return next((s for s in self.series if s.name == name), None)


def load_trend_specs(path: str | Path) -> TrendSpecs:
    """Read ``trends.yaml``; ConfigError naming the file and key on any problem."""
    data = load_yaml(path, TRENDS_SCHEMA, what="trends file")
    defaults = data.get("defaults") or {}
    specs: list[SeriesSpec] = []
    for i, raw in enumerate(data["series"]):
        where = f"{path}: series[{i}] ({raw['name']})"
        if raw["name"] in {s.name for s in specs}:
            raise ConfigError(f"{where}: the name is used twice; each series needs its own")
        if "evidence" in raw and "margin_from" in raw:
            raise ConfigError(f"{where}: give 'evidence' or 'margin_from', not both")
        if "threshold" not in raw and "threshold_sku" not in raw:
            raise ConfigError(f"{where}: no threshold; give 'threshold' or 'threshold_sku'")
        if "each" in raw and ("evidence" in raw or "margin_from" in raw):
            raise ConfigError(f"{where}: 'each' reads its own mapping; drop 'evidence'")
        if ("persist" in raw or "peers" in raw) and "each" not in raw:
            raise ConfigError(f"{where}: 'persist' and 'peers' need 'each' (a per-part series)")
        persist = _persist(raw.get("persist"), where)
        merged = {**defaults, **raw}
        windows = {**(defaults.get("windows") or {}), **(raw.get("windows") or {})}
        spec = SeriesSpec(
            name=raw["name"],
            check=raw["check"],
            metric=raw["metric"],
            kind=raw["kind"],
            direction=raw.get("direction", "up"),
            threshold=raw.get("threshold"),
            threshold_sku=raw.get("threshold_sku"),
            unit=raw.get("unit", ""),
            why=raw["why"],
            evidence_key=raw.get("evidence"),
            margin_from=raw.get("margin_from"),
            horizon_days=float(merged.get("horizon_days", 30.0)),
            min_points=int(merged.get("min_points", 4)),
            min_span_h=float(merged.get("min_span_h", 12.0)),
            window_h=float(windows.get("window_h", 24.0)),
            k=int(windows.get("k", 3)),
            n=int(windows.get("n", 4)),
            each=raw.get("each"),
            part=raw.get("part", "link"),
            peers=raw.get("peers"),
            persist=persist,
        )
        if spec.k > spec.n:
            raise ConfigError(f"{where}: windows.k {spec.k} is more than windows.n {spec.n}")
        specs.append(spec)
    by_key: dict[tuple[str, str], list[SeriesSpec]] = {}
    for spec in specs:
        by_key.setdefault((spec.check, spec.metric), []).append(spec)
    return TrendSpecs(tuple(specs), by_key)


def _persist(raw: dict[str, Any] | None, where: str) -> Persist | None:
    if raw is None:
        return None
    p = Persist(
        metric=raw["metric"],
        window_s=float(raw.get("window_s", 60.0)),
        k=int(raw.get("k", 15)),
        n=int(raw.get("n", 30)),
        spans=int(raw.get("spans", 2)),
    )
    if p.k > p.n:
        raise ConfigError(f"{where}: persist.k {p.k} is more than persist.n {p.n}")
    return p


# -- the arithmetic ------------------------------------------------------------------------------


def segments(points: Sequence[Point], kind: str = "counter") -> list[list[Point]]:
    """A counter's points split at each reset (a drop, or a point marked ``reset``); a gauge is
    one segment."""
    if kind != "counter":
        return [list(points)] if points else []
    out: list[list[Point]] = []
    for p in points:
        if not out or p.reset or p.value < out[-1][-1].value:
            out.append([p])
        else:
            out[-1].append(p)
    return out


def theil_sen(points: Sequence[Point]) -> tuple[float, float] | None:
    """(slope per second, intercept at t=0) of the Theil-Sen line; None under two distinct
    times. Example: points (0, 0), (1, 1), (2, 2), (3, 30) give slope 1 (the outlier is out)."""
    pts = _thin(points)
    slopes = [
        (b.value - a.value) / (b.at - a.at)
        for i, a in enumerate(pts)
        for b in pts[i + 1 :]
        if b.at != a.at
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    intercept = statistics.median(p.value - slope * p.at for p in pts)
    return slope, intercept


def _thin(points: Sequence[Point]) -> list[Point]:
    if len(points) <= MAX_FIT_POINTS:
        return list(points)
    step = (len(points) - 1) / (MAX_FIT_POINTS - 1)
    return [points[round(i * step)] for i in range(MAX_FIT_POINTS)]


def increase(points: Sequence[Point], start: float, end: float) -> float:
    """How much a counter rose in (start, end]: the sum of its steps up between consecutive
    points, a reset's step counted as none. Never negative."""
    total = 0.0
    for prev, p in zip(points, points[1:], strict=False):
        if start < p.at <= end and not p.reset and p.value > prev.value:
            total += p.value - prev.value
    return total


def rising_windows(points: Sequence[Point], now: float, window_h: float, n: int) -> list[bool]:
    """For each of the last ``n`` windows of ``window_h`` hours ending at ``now`` (newest
    first), whether the counter rose in it."""
    w = window_h * 3600.0
    return [increase(points, now - (i + 1) * w, now - i * w) > 0 for i in range(n)]


@dataclass(frozen=True)
class Trend:
    """A series' trend as graded now. ``warn`` is whether either rule fired."""

    spec: SeriesSpec
    target: str
    slope_per_day: float | None  # over the current segment; None: too few points to fit
    latest: float
    threshold: float | None
    crossing_days: float | None  # None: not heading for the threshold
    rising: list[bool]  # newest window first
    points: int  # in the current segment
    segments: int
    forecast_warns: bool
    windows_warn: bool
    part: str = ""  # the part of a per-part series (``link 5``); "" for a whole result

    @property
    def warn(self) -> bool:
        return self.forecast_warns or self.windows_warn

    def message(self) -> str:
        s = self.spec
        unit = f" {s.unit}" if s.unit else ""
        named = f" ({s.name})" if s.evidence_key or s.margin_from else ""
        part = f" {self.part}" if self.part else ""
        what = f"{s.check} {s.metric}{named} on {self.target}{part}"
        parts = []
        if self.slope_per_day is not None:
            verb = "rising" if self.slope_per_day >= 0 else "falling"
            parts.append(
                f"{verb} at {abs(self.slope_per_day):.3g}{unit} per day "
                f"(Theil-Sen over {self.points} points since the last reset)"
            )
        # a crossing is only forecast against a threshold (trend_of)
        if self.forecast_warns and self.crossing_days is not None and self.threshold is not None:
            past = (
                self.latest >= self.threshold
                if s.direction == "up"
                else self.latest <= self.threshold
            )
            if past:
                parts.append(
                    f"has reached its threshold {self.threshold:g}{unit} "
                    f"(now {self.latest:g}) and goes on"
                )
            else:
                parts.append(
                    f"crosses its threshold {self.threshold:g}{unit} in about "
                    f"{self.crossing_days:.1f} days (now {self.latest:g})"
                )
        if self.windows_warn:
            parts.append(
                f"rose in {sum(self.rising)} of the last {len(self.rising)} "
                f"{s.window_h:g}-hour windows (k={s.k})"
            )
        return f"{what}: " + "; ".join(parts) if parts else f"{what}: no trend"


def evaluate(
    spec: SeriesSpec,
    target: str,
    points: Sequence[Point],
    now: float,
    threshold: float | None,
    part: str = "",
) -> Trend | None:
    """Grade one series' trend at ``now`` (``part``: of a per-part series); None for an empty
    series."""
    if not points:
        return None
    segs = segments(points, spec.kind)
    current = segs[-1]
    latest = current[-1].value
    slope_day = crossing = None
    forecast = False
    span_h = (current[-1].at - current[0].at) / 3600.0
    if len(current) >= spec.min_points and span_h >= spec.min_span_h:
        fit = theil_sen(current)
        if fit is not None:
            slope, intercept = fit
            slope_day = slope * DAY_S
            worsening = slope > 0 if spec.direction == "up" else slope < 0
            if spec.kind == "counter" and slope_day < 0:
                slope_day = 0.0  # a counter inside one segment never falls: no negative rate
            if worsening and threshold is not None:
                t_cross = (threshold - intercept) / slope
                crossing = max(0.0, (t_cross - now) / DAY_S)
                forecast = crossing <= spec.horizon_days
    # k of n: counters only, and inside the current segment (never across a reset)
    rising = rising_windows(current, now, spec.window_h, spec.n) if spec.kind == "counter" else []
    windows = spec.kind == "counter" and sum(rising) >= spec.k
    return Trend(
        spec=spec,
        target=target,
        slope_per_day=slope_day,
        latest=latest,
        threshold=threshold,
        crossing_days=crossing,
        rising=rising,
        points=len(current),
        segments=len(segs),
        forecast_warns=forecast,
        windows_warn=windows,
        part=part,
    )


def trend_result(trend: Trend, points: Sequence[Point]) -> Result:
    """The ``trends`` result of a series that warns (metric ``trend``), the series as
    evidence: its newest points as ``[unix_s, value]`` pairs, the fit and the windows."""
    s = trend.spec
    shown = points[-EVIDENCE_POINTS:]
    return Result(
        check="trends",
        target=trend.target,
        metric="trend",
        status=Status.WARN,
        detail=trend.message() + f" ({s.why})",
        value=None if trend.crossing_days is None else round(trend.crossing_days, 2),
        unit="days" if trend.crossing_days is not None else "",
        evidence={
            "series": s.name,
            "check": s.check,
            "metric": s.metric,
            **({s.part: trend.part.rsplit(" ", 1)[-1]} if trend.part else {}),
            "kind": s.kind,
            "slope_per_day": None if trend.slope_per_day is None else round(trend.slope_per_day, 6),
            "threshold": trend.threshold,
            "crossing_days": None if trend.crossing_days is None else round(trend.crossing_days, 2),
            "latest": trend.latest,
            "rising_windows": trend.rising,
            "window_h": s.window_h,
            "k": s.k,
            "n": s.n,
            "segment_points": trend.points,
            "segments": trend.segments,
            "points": [[round(p.at, 1), p.value] for p in shown],
            "resets_at": [round(p.at, 1) for p in shown if p.reset],
        },
    )


# -- persistence, per part -----------------------------------------------------------------------


class WindowTracker:
    """Which windows of ``persist.window_s`` (aligned to the epoch) a counter grew in, fed one
    reading at a time; a drop (a reset) forgets the windows before it. Holds at most
    ``n * spans`` window numbers, never the readings."""

    def __init__(self, persist: Persist) -> None:
        self.persist = persist
        self.last: float | None = None
        self.rose: set[int] = set()

    def add(self, at: float, value: float, reset: bool = False) -> None:
        window = int(at // self.persist.window_s)
        if self.last is not None:
            if reset or value < self.last:
                self.rose.clear()  # a new segment: growth before a reset is not counted
            elif value > self.last:
                self.rose.add(window)
        self.last = value
        keep = self.persist.n * self.persist.spans
        if len(self.rose) > keep:
            self.rose = {w for w in self.rose if w > window - keep}

    def counts(self, now: float) -> list[int]:
        """Windows that rose in each run of ``n`` windows ending at ``now``, newest first."""
        p = self.persist
        current = int(now // p.window_s)
        return [
            sum(1 for w in self.rose if current - (j + 1) * p.n < w <= current - j * p.n)
            for j in range(p.spans)
        ]


def persistence(points: Sequence[Point], now: float, persist: Persist) -> list[int]:
    """:meth:`WindowTracker.counts` of a series given whole (tests, a replayed history)."""
    tracker = WindowTracker(persist)
    for p in points:
        tracker.add(p.at, p.value, p.reset)
    return tracker.counts(now)


def persistence_result(sampled: Sampled, counts: list[int], latest: float) -> Result | None:
    """The result of a part whose counter grew in ``k`` of the last ``n`` windows: WARN, or
    ``fail`` when it did in every one of the last ``spans`` runs; None otherwise."""
    spec, persist = sampled.spec, sampled.spec.persist
    if persist is None or not counts or counts[0] < persist.k:
        return None
    persists = all(c >= persist.k for c in counts)
    window = f"{persist.window_s:g}-s"
    peer = f" (to {sampled.peer})" if sampled.peer else " (its peer is not reported)"
    what = f"{spec.check} {spec.metric} on {sampled.target} {sampled.part}{peer}"
    detail = (
        f"{what}: grew in {counts[0]} of the last {persist.n} {window} windows "
        f"(k={persist.k}; now {latest:g})"
    )
    if persists:
        detail += (
            f", and in at least {persist.k} of {persist.n} in each of the last "
            f"{persist.spans} runs of {persist.n} windows ({', '.join(map(str, counts))}): "
            f"the growth persists"
        )
    return Result(
        check="trends",
        target=sampled.target,
        metric=persist.metric,
        status=Status.FAIL if persists else Status.WARN,
        detail=f"{detail} ({spec.why})",
        value=counts[0],
        unit="windows",
        evidence={
            "series": spec.name,
            "check": spec.check,
            "metric": spec.metric,
            spec.part: sampled.part.rsplit(" ", 1)[-1],
            "peer": sampled.peer,
            "latest": latest,
            "rising_windows": counts,
            "window_s": persist.window_s,
            "k": persist.k,
            "n": persist.n,
            "spans": persist.spans,
        },
    )
