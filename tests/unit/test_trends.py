"""Trends (node_agent.grading.trends): the Theil-Sen fit, k of n windows, resets, the forecast,
and the shipped graders/trends.yaml."""

from __future__ import annotations

import random

import pytest

from node_agent.grading.trends import (
    Point,
    SeriesSpec,
    evaluate,
    increase,
    load_trend_specs,
    rising_windows,
    segments,
    theil_sen,
    trend_result,
)
from node_agent.model import Result, Status
from node_agent.resources import shipped_graders_dir
from node_agent.yamlfile import ConfigError

H = 3600.0


def spec(**kw) -> SeriesSpec:
    base = dict(
        name="ecc",
        check="nvml_health",
        metric="ecc_sbe_volatile",
        kind="counter",
        direction="up",
        threshold=1000.0,
        threshold_sku=None,
        unit="errors",
        why="test",
    )
    return SeriesSpec(**{**base, **kw})


def series(values, every_h=6.0, start=0.0) -> list[Point]:
    return [Point(start + i * every_h * H, float(v)) for i, v in enumerate(values)]


def test_theil_sen_recovers_a_line_exactly():
    pts = [Point(t, 3.0 * t + 7.0) for t in range(10)]
    slope, intercept = theil_sen(pts)
    assert slope == pytest.approx(3.0)
    assert intercept == pytest.approx(7.0)


def test_theil_sen_ignores_an_outlier():
    pts = [Point(0, 0), Point(1, 1), Point(2, 2), Point(3, 30), Point(4, 4)]
    slope, _ = theil_sen(pts)
    assert slope == pytest.approx(1.0)


def test_theil_sen_needs_two_times():
    assert theil_sen([Point(5, 1)]) is None
    assert theil_sen([Point(5, 1), Point(5, 2)]) is None


def test_theil_sen_thins_a_long_series_and_keeps_its_slope():
    pts = [Point(float(t), 2.0 * t) for t in range(2000)]
    slope, _ = theil_sen(pts)
    assert slope == pytest.approx(2.0)


def test_k_of_n_counts_windows_the_counter_rose_in():
    # one point every 6 h for 4 days; the counter rises on days 1, 2 and 4 (newest first: 4, 2, 1)
    values = [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 6, 6, 6]
    pts = series(values)
    now = pts[-1].at
    rising = rising_windows(pts, now, 24, 4)
    assert rising == [True, False, True, True]
    trend = evaluate(spec(threshold=1e9), "gpu:0", pts, now, 1e9)
    assert trend.windows_warn and trend.warn


def test_k_of_n_needs_k_windows():
    values = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    pts = series(values)
    trend = evaluate(spec(threshold=1e9), "gpu:0", pts, pts[-1].at, 1e9)
    assert sum(trend.rising) == 2
    assert not trend.windows_warn


def test_reset_starts_a_new_segment_and_gives_no_trend_and_no_negative_rate():
    # rising steadily, then a reboot puts the counter back to 0 and it stays flat
    before = [100 * i for i in range(12)]  # 400 per day for 3 days
    after = [0, 0, 0, 0, 0, 0]
    pts = series(before + after)
    assert len(segments(pts)) == 2
    now = pts[-1].at
    trend = evaluate(spec(threshold=5000.0), "gpu:0", pts, now, 5000.0)
    assert trend.segments == 2 and trend.points == len(after)
    assert trend.slope_per_day == 0.0  # the flat segment: no trend, never negative
    assert not trend.forecast_warns
    assert trend.rising == [False] * 4  # the climb before the reset is not counted
    assert not trend.warn


def test_reset_step_is_no_increase():
    pts = [Point(0, 50), Point(H, 60), Point(2 * H, 5, reset=True), Point(3 * H, 7)]
    assert increase(pts, -1, 10 * H) == 10 + 2  # 50->60 and 5->7; the drop counts nothing


def test_reset_marked_point_splits_even_when_the_value_climbs_past_the_old_one():
    pts = [Point(0, 10), Point(H, 20), Point(2 * H, 30, reset=True), Point(3 * H, 40)]
    assert [len(s) for s in segments(pts)] == [2, 2]


def test_a_counter_never_reports_a_negative_rate_inside_noise():
    # noisy readings that are really a flat counter read at the same value
    pts = series([5, 5, 5, 5, 5, 5, 5, 5])
    trend = evaluate(spec(), "gpu:0", pts, pts[-1].at, 1000.0)
    assert trend.slope_per_day == 0.0 and not trend.warn


def test_forecast_of_a_simulated_rising_counter_is_within_20_percent_of_the_true_crossing():
    rng = random.Random(28)
    rate_per_day, threshold = 37.0, 1000.0
    # a Poisson-like counter: each 6 h adds rate/4 on average, with noise
    values, total = [], 0
    for _ in range(4 * 8):  # 8 days
        total += max(0, round(rng.gauss(rate_per_day / 4, 3)))
        values.append(total)
    pts = series(values)
    now = pts[-1].at
    true_days = (threshold - values[-1]) / rate_per_day
    trend = evaluate(spec(horizon_days=60), "gpu:3", pts, now, threshold)
    assert trend.forecast_warns
    assert trend.crossing_days == pytest.approx(true_days, rel=0.2)
    assert trend.slope_per_day == pytest.approx(rate_per_day, rel=0.2)
    result = trend_result(trend, pts)
    assert result.status is Status.WARN and result.check == "trends"
    assert result.target == "gpu:3" and result.metric == "trend"
    assert "crosses its threshold 1000 errors in about" in result.detail
    assert result.evidence["points"][-1] == [round(now, 1), float(values[-1])]


def test_a_crossing_beyond_the_horizon_does_not_warn():
    pts = series([i for i in range(20)])  # 4 per day; 1000 is ~245 days away
    trend = evaluate(spec(horizon_days=30, k=5, n=5), "gpu:0", pts, pts[-1].at, 1000.0)
    assert trend.crossing_days > 30 and not trend.forecast_warns


def test_too_few_points_or_too_short_a_span_is_no_fit():
    pts = series([0, 100, 200])
    assert evaluate(spec(), "gpu:0", pts, pts[-1].at, 1000.0).slope_per_day is None
    short = series([0, 100, 200, 300, 400], every_h=1)  # 4 h
    assert evaluate(spec(), "gpu:0", short, short[-1].at, 1000.0).slope_per_day is None


def test_a_falling_gauge_forecasts_its_lower_threshold():
    margin = spec(name="margin", kind="gauge", direction="down", threshold=5.0)
    pts = series([25 - 0.5 * i for i in range(12)])  # 2 °C per day from 25 °C
    now = pts[-1].at
    trend = evaluate(margin, "gpu:1", pts, now, 5.0)
    assert trend.slope_per_day == pytest.approx(-2.0)
    assert trend.crossing_days == pytest.approx((19.5 - 5.0) / 2.0)
    assert trend.forecast_warns and trend.rising == []


def test_series_values_from_value_evidence_and_margin():
    rows = Result(
        "nvml_health",
        "gpu:0",
        "row_remap",
        Status.PASS,
        "",
        value=1,
        evidence={"corrected_rows": 9},
    )
    temp = Result(
        "thermal_power",
        "gpu:0",
        "temperature_max_c",
        Status.PASS,
        "",
        value=80,
        evidence={"slowdown_c": 87},
    )
    assert spec(metric="row_remap").value_of(rows) == 1
    assert spec(metric="row_remap", evidence_key="corrected_rows").value_of(rows) == 9
    assert spec(metric="temperature_max_c", margin_from="slowdown_c").value_of(temp) == 7
    skipped = Result("nvml_health", "gpu:0", "row_remap", Status.SKIP, "not available")
    assert spec(metric="row_remap").value_of(skipped) is None


def test_threshold_from_the_sku_else_the_fixed_one():
    s = spec(threshold_sku="ecc_sbe_volatile_max", threshold=50.0)
    assert s.threshold_for({"ecc_sbe_volatile_max": 1000}) == 1000.0
    assert s.threshold_for({}) == 50.0
    assert s.threshold_for(None) == 50.0


def test_shipped_trends_file_loads_and_names_the_issue_series():
    specs = load_trend_specs(shipped_graders_dir() / "trends.yaml")
    names = {s.name for s in specs.series}
    assert {
        "ecc_sbe_volatile",
        "pcie_replay",
        "remapped_rows_uncorrectable",
        "nvlink_recovery",
        "hca_symbol_errors",
        "hca_link_downed",
        "edac_ce",
        "thermal_margin",
        "throughput_bf16",
    } <= names
    assert all(s.why for s in specs.series)
    result = Result(
        "nvml_health",
        "gpu:2",
        "row_remap",
        Status.PASS,
        "",
        value=0,
        evidence={"corrected_rows": 3},
    )
    got = {(s.spec.name, s.target, s.value) for s in specs.samples([result])}
    assert got == {
        ("remapped_rows_uncorrectable", "gpu:2", 0.0),
        ("remapped_rows_correctable", "gpu:2", 3.0),
    }
    port = Result(
        "hca_ports",
        "hca:mlx5_0",
        "error_rates",
        Status.WARN,
        "",
        value=12.0,
        evidence={"symbol_error": 340, "link_downed": 2, "port": 1},
    )
    got = {(s.spec.name, s.target, s.value) for s in specs.samples([port])}
    assert got == {
        ("hca_symbol_errors", "hca:mlx5_0", 340.0),
        ("hca_link_downed", "hca:mlx5_0", 2.0),
    }


def test_a_trends_file_without_a_threshold_is_refused(tmp_path):
    bad = tmp_path / "trends.yaml"
    bad.write_text("series:\n  - {name: x, check: c, metric: m, kind: counter, why: w}\n")
    with pytest.raises(ConfigError, match="no threshold"):
        load_trend_specs(bad)
