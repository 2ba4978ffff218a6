"""The daemon grades a counter rising over simulated days as a trend WARN (issue 28).

The real daemon (in this process, on a thread) runs nvml_health against the simulator, whose
``counter_series`` fault makes GPU 3's corrected-ECC counter read one value per check run; the
test's wall clock advances six simulated hours after each run, so eight runs are two days of
history in a few seconds. GPUs are simulated because none can run here; the history, the fit,
the rules and the grade are the real code.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import yaml
from waiting import wait_for  # tests/waiting.py

from node_agent import resources
from node_agent.model import Level, Status
from node_agent.peers import free_loopback_port
from node_agent.service.daemon import Daemon
from node_agent.service.history import DB_NAME

H = 3600.0
T0 = 1_760_000_000.0
STEP = 20  # errors per 6 h: 80 a day
THRESHOLD = 1000  # the H100 SKU's ecc_sbe_volatile_max


class WallClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def daemon_on(tmp_path):
    started: list[Daemon] = []

    def start(faults, clock, graders=None) -> Daemon:
        scenario = tmp_path / "scenario.yaml"
        scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults}))
        config = tmp_path / "config.yaml"
        settings = {
            "state_dir": str(tmp_path / "state"),
            "spool_dir": str(tmp_path / "spool"),
            "daemon": {"listen": f"127.0.0.1:{free_loopback_port()}"},
        }
        if graders is not None:
            settings["graders_dir"] = str(graders)
        config.write_text(yaml.safe_dump(settings))
        suite = tmp_path / "periodic.yaml"
        suite.write_text(
            yaml.safe_dump(
                {
                    "name": "trends",
                    "mode": "service",
                    "checks": [{"check": "nvml_health", "timeout_s": 10, "every_s": 0.5}],
                }
            )
        )
        daemon = Daemon(str(config), str(scenario), suite=str(suite), wall_clock=clock)
        threading.Thread(target=lambda: daemon.run(install_signals=False), daemon=True).start()
        started.append(daemon)
        return daemon

    yield start
    for d in started:
        d.stop()


def runs(daemon: Daemon) -> int:
    stats = daemon.snapshot().checks.get("nvml_health")
    return stats.runs if stats else 0


def drive(daemon: Daemon, clock: WallClock, n: int, step_s: float = 6 * H, start: int = 0) -> None:
    """Let the daemon run nvml_health up to ``n`` times (from run ``start + 1``), ``step_s``
    simulated seconds apart (six hours unless given)."""
    for i in range(start, n):
        assert wait_for(lambda n=i + 1: runs(daemon) >= n, 15), f"run {i + 1} did not happen"
        clock.now += step_s


def test_counter_rising_over_simulated_days_grades_trend_warn_with_its_forecast(
    daemon_on, tmp_path
):
    clock = WallClock()
    values = [STEP * i for i in range(60)]
    daemon = daemon_on(
        [
            {
                "kind": "counter_series",
                "gpu": 3,
                "counter": "ecc_sbe_volatile",
                "values": values,
                "every_h": 6,
            }
        ],
        clock,
    )
    drive(daemon, clock, 8)
    reason = wait_for(
        lambda: next((r for r in daemon.grade.reasons if r.rule == "trend-forecast"), None), 5
    )
    assert reason is not None, daemon.grade.reasons
    assert reason.target == "gpu:3" and reason.level is Level.WARN
    assert daemon.grade.level is Level.WARN and daemon.grade.action == "none"
    (trend,) = [r for r in daemon.current_results() if r.metric == "trend"]
    # the counter reaches 1000 at run 50, i.e. 300 simulated hours after the first run
    last = trend.evidence["points"][-1][0]
    true_days = (T0 + 50 * 6 * H - last) / 86400
    assert trend.evidence["threshold"] == THRESHOLD
    assert trend.value == pytest.approx(true_days, rel=0.2)
    assert trend.evidence["slope_per_day"] == pytest.approx(4 * STEP, rel=0.2)
    assert len(trend.evidence["points"]) >= 6
    assert "crosses its threshold 1000 errors in about" in trend.detail
    history = tmp_path / "state" / DB_NAME
    assert history.exists() and (os.stat(history).st_mode & 0o777) == 0o600


def test_counter_reset_by_a_reboot_gives_no_trend(daemon_on):
    clock = WallClock()
    values = [0, 200, 400, 600, 0, 0, 0, 0, 0]  # 800 a day, then a reboot: back to 0 and flat
    daemon = daemon_on(
        [
            {
                "kind": "counter_series",
                "gpu": 1,
                "counter": "ecc_sbe_volatile",
                "values": values,
                "every_h": 6,
            }
        ],
        clock,
    )
    drive(daemon, clock, len(values))
    assert wait_for(lambda: runs(daemon) >= len(values), 5)
    assert not [r for r in daemon.current_results() if r.metric == "trend"]
    (watched,) = [r for r in daemon.current_results() if r.metric == "trends"]
    assert watched.value == 0 and watched.evidence["series"] >= 8
    assert daemon.grade.level is Level.HEALTHY, daemon.grade.reasons


def test_unusable_history_is_a_warn_and_the_daemon_goes_on(daemon_on, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / DB_NAME).mkdir()  # what should be the history is a directory
    clock = WallClock()
    daemon = daemon_on([], clock)
    drive(daemon, clock, 2)
    reason = wait_for(
        lambda: next((r for r in daemon.grade.reasons if r.rule == "trend-history"), None), 5
    )
    assert reason is not None and daemon.grade.level is Level.WARN
    assert runs(daemon) >= 2  # the checks go on


def test_one_nvlink_growing_in_k_of_n_windows_warns_then_persisting_grades_error(
    daemon_on, tmp_path
):
    """GPU 3's NVLink 5 gains a replay at every nvml_health run, one run per simulated window.
    The graders directory is the shipped one with the persistence rule made short (k 3 of n 6
    windows, two runs of 6) so the test needs a dozen runs, not an hour of one-minute windows:
    k, n and the window are the trends file's to set."""
    graders = tmp_path / "graders"
    shutil.copytree(resources.shipped_graders_dir(), graders)
    trends = yaml.safe_load((graders / "trends.yaml").read_text())
    for series in trends["series"]:
        if "persist" in series:
            series["persist"].update({"window_s": 600, "k": 3, "n": 6, "spans": 2})
    (graders / "trends.yaml").write_text(yaml.safe_dump(trends))
    clock = WallClock()
    fault = {
        "kind": "counter_series",
        "gpu": 3,
        "counter": "nvlink_replay",
        "link": 5,
        "values": list(range(40)),
        "every_h": 600 / H,
    }
    daemon = daemon_on([fault], clock, graders)
    drive(daemon, clock, 4, step_s=600)
    warn = wait_for(lambda: link_results(daemon), 5)
    assert warn and warn[0].status is Status.WARN, warn
    drive(daemon, clock, 12, step_s=600, start=4)
    reason = wait_for(
        lambda: next(
            (r for r in daemon.grade.reasons if r.rule == "nvlink-link-errors-persist"), None
        ),
        5,
    )
    assert reason is not None, daemon.grade.reasons
    assert reason.target == "gpu:3" and daemon.grade.level is Level.ERROR
    (error,) = link_results(daemon)
    assert error.status is Status.FAIL
    assert error.evidence["link"] == "5" and error.evidence["series"] == "nvlink_replay"
    assert "gpu:3 link 5" in error.detail


def link_results(daemon: Daemon) -> list:
    return [r for r in daemon.current_results() if r.metric == "nvlink_link_errors"]
