"""The counter history (node_agent.service.history): private, bounded, downsampled, fail-safe;
and the trend watch over it (node_agent.service.trend_watch)."""

from __future__ import annotations

import os
import stat

import pytest

from node_agent.grading.trends import load_trend_specs
from node_agent.model import Result, Status
from node_agent.resources import shipped_graders_dir
from node_agent.service.history import DB_NAME, Bound, Sample, open_history
from node_agent.service.trend_watch import TrendWatch

H = 3600.0
DAY = 86400.0
T0 = 1_750_000_000.0  # a fixed wall-clock start (UNIX seconds)


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def counter(value: float, target: str = "gpu:0") -> Sample:
    return Sample("nvml_health", target, "ecc_sbe_volatile", "counter", value)


def test_history_is_private_and_in_wal_mode(tmp_path):
    state = tmp_path / "state"
    history = open_history(state, Clock())
    history.record([counter(1)])
    assert history.problem is None
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in (DB_NAME, DB_NAME + "-wal"):
        path = state / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    import sqlite3

    with sqlite3.connect(state / DB_NAME) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    history.close()


def test_readings_within_a_five_minute_bucket_share_one_point(tmp_path):
    clock = Clock()
    history = open_history(tmp_path, clock)
    for i in range(30):  # every 10 s for 5 minutes
        history.record([counter(i)])
        clock.now += 10
    points = history.points("nvml_health", "gpu:0", "ecc_sbe_volatile")
    assert len(points) <= 2
    assert points[-1].value == 29  # a counter keeps its bucket's last value
    history.close()


def test_gauge_bucket_keeps_the_mean(tmp_path):
    clock = Clock(T0 - T0 % 300)
    history = open_history(tmp_path, clock)
    for v in (10.0, 20.0, 30.0):
        history.record([Sample("thermal_power", "gpu:0", "margin", "gauge", v)])
        clock.now += 10
    (point,) = history.points("thermal_power", "gpu:0", "margin")
    assert point.value == pytest.approx(20.0)
    history.close()


def test_growth_is_bounded_and_old_points_are_downsampled(tmp_path):
    """Readings every 5 minutes for 20 days under a bound scaled down (raw 6 h, hourly 3 days,
    10 daily points): the series stays within the bound, raw at 5-minute resolution, hourly
    and daily beyond (the shipped bound is the same code with larger numbers; bench/
    bench_history.py measures it over 30 simulated days)."""
    clock = Clock()
    bound = Bound(raw_keep_s=6 * H, hourly_keep_s=3 * DAY, daily_cap=10)
    history = open_history(tmp_path, clock, bound)
    value = 0
    sizes = []
    for step in range(int(20 * DAY / 300)):
        value += step % 7 == 0
        history.record([counter(value)])
        clock.now += 300
        if step % 288 == 0:
            sizes.append(history.point_count())
    points = history.points("nvml_health", "gpu:0", "ecc_sbe_volatile")
    assert len(points) <= bound.max_points == 96 + 97 + 10
    assert max(sizes[12:]) <= bound.max_points  # bounded from the day the tiers are full
    now = clock.now
    recent = [p for p in points if p.at > now - 5 * H]
    hourly = [p for p in points if now - 2 * DAY < p.at < now - 9 * H]
    daily = [p for p in points if p.at < now - 4 * DAY]
    assert len(recent) >= 59  # 5-minute resolution
    gaps = [b.at - a.at for a, b in zip(hourly, hourly[1:], strict=False)]
    assert gaps and max(gaps) <= H + 1 and min(gaps) >= H - 301
    assert 8 <= len(daily) <= 10
    assert points[0].at >= now - (3 + 1 + 10) * DAY - H  # older daily points were capped off
    daily_gaps = [b.at - a.at for a, b in zip(daily, daily[1:], strict=False)]
    assert min(daily_gaps) >= DAY - 301
    assert points == sorted(points, key=lambda p: p.at)
    assert points[-1].value == value  # the counter's value survives downsampling
    history.close()


def test_a_reset_survives_downsampling(tmp_path):
    clock = Clock()
    history = open_history(tmp_path, clock)
    for v in (100, 200, 300, 5, 400):  # a reset, then it climbs past the old value in one hour
        history.record([counter(v)])
        clock.now += 600
    clock.now += 3 * DAY
    history.record([counter(401)])  # compaction moves the first hour into the hourly tier
    points = history.points("nvml_health", "gpu:0", "ecc_sbe_volatile")
    assert any(p.reset for p in points[:-1])
    history.close()


def test_a_corrupt_history_is_moved_aside_and_is_a_warn(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not an SQLite database" * 100)
    history = open_history(tmp_path, Clock())
    assert history.problem is None and "moved it aside" in history.notice
    assert list(tmp_path.glob(DB_NAME + ".corrupt-*"))
    history.record([counter(1)])
    assert len(history.points("nvml_health", "gpu:0", "ecc_sbe_volatile")) == 1
    watch = TrendWatch(load_trend_specs(shipped_graders_dir() / "trends.yaml"), history)
    warn = [r for r in watch.results() if r.metric == "history"]
    assert warn and warn[0].status is Status.WARN and "start over" in warn[0].detail
    history.close()


def test_an_unwritable_history_is_a_warn_and_records_nothing(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / DB_NAME).mkdir()  # not a file: nothing can open it as a database
    history = open_history(state, Clock())
    assert history.problem and DB_NAME in history.problem
    history.record([counter(1)])  # does not raise
    assert history.points("nvml_health", "gpu:0", "ecc_sbe_volatile") == []
    watch = TrendWatch(load_trend_specs(shipped_graders_dir() / "trends.yaml"), history)
    watch.update(
        [Result("nvml_health", "gpu:0", "ecc_sbe_volatile", Status.PASS, "", value=3)], None
    )
    (warn,) = [r for r in watch.results() if r.metric == "history"]
    assert warn.status is Status.WARN and "not graded" in warn.detail


def test_a_history_that_fails_mid_run_becomes_unavailable(tmp_path):
    history = open_history(tmp_path, Clock())
    history.record([counter(1)])
    history._conn.close()  # the disk goes away under it
    history.record([counter(2)])
    assert history.problem and "writing" in history.problem
    assert history.points("nvml_health", "gpu:0", "ecc_sbe_volatile") == []


def test_trend_watch_warns_on_a_rising_counter_and_keeps_the_series(tmp_path):
    clock = Clock()
    watch = TrendWatch(
        load_trend_specs(shipped_graders_dir() / "trends.yaml"),
        open_history(tmp_path, clock),
        clock,
    )
    for i in range(16):  # 80 a day for 4 days; the SKU's line is 1000
        watch.update(
            [Result("nvml_health", "gpu:5", "ecc_sbe_volatile", Status.PASS, "", value=20 * i)],
            {"ecc_sbe_volatile_max": 1000},
        )
        clock.now += 6 * H
    (trend,) = [r for r in watch.results() if r.metric == "trend"]
    assert trend.target == "gpu:5" and trend.status is Status.WARN
    assert trend.evidence["threshold"] == 1000
    assert trend.evidence["slope_per_day"] == pytest.approx(80, rel=0.01)
    assert len(trend.evidence["points"]) == 16
    watch.close()


def test_a_symlink_in_place_of_the_history_is_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.db"
    elsewhere.write_bytes(b"")
    (state / DB_NAME).symlink_to(elsewhere)
    history = open_history(state, Clock())
    assert history.problem and "regular file" in history.problem
    history.record([counter(1)])
    assert elsewhere.read_bytes() == b""  # nothing written through the link
