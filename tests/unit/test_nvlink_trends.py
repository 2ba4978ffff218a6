"""NVLink over time, per link: each link's counters as their own series, and the persistence rule
(grew in k of the last n one-minute windows: WARN; in every one of the last spans runs: ERROR).

Synthetic series through the pure rule (node_agent.grading.trends), then nvml_health-shaped
results through the trend watch with a real history in a temporary state directory and the
shipped trends file and rules.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from node_agent import resources
from node_agent.grading.rules import Grader, load_grader
from node_agent.grading.trends import (
    Persist,
    Point,
    Sampled,
    SeriesSpec,
    evaluate,
    load_trend_specs,
    persistence,
    persistence_result,
    trend_result,
)
from node_agent.model import Level, Result, Status
from node_agent.service.history import Bound, open_history
from node_agent.service.trend_watch import TrendWatch
from node_agent.yamlfile import ConfigError

NVRX = Persist(metric="nvlink_link_errors", window_s=60.0, k=15, n=30, spans=2)
T0 = 1_760_000_040.0  # a minute boundary


@functools.cache
def grader() -> Grader:
    return load_grader(resources.shipped_graders_dir())


def readings(grows: list[bool], start: float = T0, value: float = 0.0) -> list[Point]:
    """One reading a minute (in the middle of its window), the counter up by one where
    ``grows`` says so."""
    points = [Point(start - 30.0, value)]
    for i, up in enumerate(grows):
        value += 1 if up else 0
        points.append(Point(start + 30.0 + 60.0 * i, value))
    return points


def spec() -> SeriesSpec:
    """The shipped per-link replay series: its persistence rule is nvidia-resiliency-ext's."""
    shipped = load_trend_specs(resources.shipped_graders_dir() / "trends.yaml").get("nvlink_replay")
    assert shipped is not None and shipped.each == "per_link"
    assert shipped.persist == NVRX
    return shipped


def grade_of(points: list[Point]) -> Result | None:
    counts = persistence(points, points[-1].at, NVRX)
    return persistence_result(Sampled(spec(), "gpu:3", points[-1].value, "link 5"), counts, 0)


def test_growth_in_15_of_30_one_minute_windows_warns_naming_gpu_and_link() -> None:
    result = grade_of(readings([True, False] * 15))
    assert result is not None and result.status is Status.WARN
    assert result.target == "gpu:3" and result.evidence["link"] == "5"
    assert result.evidence["rising_windows"] == [15, 0]
    assert "gpu:3 link 5" in result.detail and "its peer is not reported" in result.detail
    assert grader().grade([result], "service").level is Level.WARN


def test_growth_in_14_of_30_windows_is_nothing() -> None:
    assert grade_of(readings([True, False] * 14 + [False, False])) is None


def test_growth_persisting_through_two_runs_of_30_windows_is_an_error() -> None:
    result = grade_of(readings([True, False] * 30))
    assert result is not None and result.status is Status.FAIL
    assert result.evidence["rising_windows"] == [15, 15]
    assert "persists" in result.detail
    grade = grader().grade([result], "service")
    assert grade.level is Level.ERROR
    assert [r.rule for r in grade.reasons] == ["nvlink-link-errors-persist"]


def test_a_reset_starts_the_windows_over() -> None:
    before = readings([True, False] * 30)
    after_reset = readings([False] * 2, start=before[-1].at + 30.0, value=0.0)
    assert grade_of(before + after_reset) is None


def test_growth_that_stopped_an_hour_ago_is_nothing() -> None:
    points = readings([True] * 30 + [False] * 60)
    assert grade_of(points) is None


def test_each_link_of_an_nvml_health_result_is_its_own_series_with_its_peer() -> None:
    specs = load_trend_specs(resources.shipped_graders_dir() / "trends.yaml")
    result = Result(
        "nvml_health",
        "gpu:1",
        "nvlink_replay_errors",
        Status.PASS,
        "",
        value=7,
        evidence={"worst_link": 2, "per_link": {"0": 0, "2": 7, "10": 1}},
    )
    got = [(s.spec.name, s.target, s.part, s.value) for s in specs.samples([result])]
    assert got == [
        ("nvlink_replay", "gpu:1", "link 0", 0.0),
        ("nvlink_replay", "gpu:1", "link 2", 7.0),
        ("nvlink_replay", "gpu:1", "link 10", 1.0),
    ]
    (one,) = [s for s in specs.samples([result]) if s.part == "link 2"]
    assert one.spec.key(one.part) == "nvlink_replay_errors:nvlink_replay:link 2"
    result.evidence["peer_by_link"] = {"2": "GPU 0000:1b:00.0"}
    (named,) = [s for s in specs.samples([result]) if s.part == "link 2"]
    assert named.peer == "GPU 0000:1b:00.0"
    warn = persistence_result(named, [15, 0], 7.0)
    assert warn is not None and "link 2 (to GPU 0000:1b:00.0)" in warn.detail
    assert warn.evidence["peer"] == "GPU 0000:1b:00.0"


def nvlink_result(gpu: int, per_link: dict[str, int]) -> Result:
    worst = max(per_link.values())
    return Result(
        "nvml_health",
        f"gpu:{gpu}",
        "nvlink_replay_errors",
        Status.PASS,
        "",
        value=worst,
        evidence={"per_link": per_link},
    )


def test_trend_watch_keeps_links_that_erred_and_grades_the_one_that_keeps_growing(
    tmp_path: Path,
) -> None:
    now = [T0]
    specs = load_trend_specs(resources.shipped_graders_dir() / "trends.yaml")
    history = open_history(tmp_path / "state", lambda: now[0], Bound())
    watch = TrendWatch(specs, history, lambda: now[0])
    link4 = 0
    for minute in range(60):  # link 4 grows every other minute for an hour; link 0 never errs
        link4 += minute % 2
        watch.update([nvlink_result(2, {"0": 0, "4": link4})], None)
        if minute == 30:
            (warn,) = [r for r in watch.results() if r.metric == "nvlink_link_errors"]
            assert warn.status is Status.WARN and warn.evidence["link"] == "4"
        now[0] += 60.0
    (error,) = [r for r in watch.results() if r.metric == "nvlink_link_errors"]
    assert error.status is Status.FAIL and error.target == "gpu:2"
    assert history.points("nvml_health", "gpu:2", "nvlink_replay_errors:nvlink_replay:link 4")
    assert not history.points("nvml_health", "gpu:2", "nvlink_replay_errors:nvlink_replay:link 0")
    assert grader().grade(watch.results(), "service").level is Level.ERROR
    history.close()


@pytest.mark.parametrize(
    ("persist", "expected"),
    [
        ("{metric: x, window_s: 60, k: 31, n: 30}", "persist.k 31 is more than persist.n 30"),
        ("{k: 3}", "metric"),
    ],
)
def test_a_bad_persist_block_is_refused(tmp_path: Path, persist: str, expected: str) -> None:
    path = tmp_path / "trends.yaml"
    path.write_text(
        "series:\n"
        "  - {name: s, check: c, metric: m, kind: counter, threshold: 1, why: w,\n"
        f"     each: per_link, persist: {persist}}}\n"
    )
    with pytest.raises(ConfigError, match=expected):
        load_trend_specs(path)


def test_a_links_forecast_names_the_link() -> None:
    points = [Point(T0 + h * 3600.0, 10.0 * h) for h in range(48)]  # 240 replays a day
    trend = evaluate(spec(), "gpu:1", points, points[-1].at, 1000.0, "link 2")
    assert trend is not None and trend.forecast_warns
    result = trend_result(trend, points)
    assert "nvlink_replay_errors on gpu:1 link 2:" in result.detail
    assert result.evidence["link"] == "2" and result.target == "gpu:1"
