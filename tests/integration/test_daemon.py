"""The daemon, run for real: its HTTP endpoint, the checks' watchers (the xid check's XID watch),
its cadence and its survival.

Most tests run ``Daemon`` in this process (on a thread, signals not installed) against the
simulator, so they can change the scenario and look at state; the signal and Prometheus tests
run ``node-agent daemon`` as a real subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from agent_daemon import unstarted_daemon  # tests/agent_daemon.py
from waiting import wait_for  # tests/waiting.py

from node_agent.checking import registry
from node_agent.peers import free_loopback_port
from node_agent.service.daemon import Daemon
from node_agent.service.sd_notify import Notifier

PERIODIC = {
    "name": "test-periodic",
    "mode": "service",
    "checks": [
        {"check": "nvml_health", "timeout_s": 10, "every_s": 1},
        {"check": "xid", "timeout_s": 10, "every_s": 2, "params": {"since": "boot"}},
    ],
}


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:  # not listening (yet)
        return 0, ""


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def node(tmp_path):
    """A simulated node: scenario file, config, suite; ``write(faults)`` changes the scenario."""

    class Node:
        scenario = tmp_path / "scenario.yaml"
        config = tmp_path / "config.yaml"
        suite = tmp_path / "periodic.yaml"
        port = free_loopback_port()

        def write(self, faults=()):
            tmp = self.scenario.with_suffix(".tmp")
            tmp.write_text(
                yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": list(faults)})
            )
            os.replace(tmp, self.scenario)

    n = Node()
    n.write()
    n.config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"listen": f"127.0.0.1:{n.port}", "xid_poll_s": 0.2},
            }
        )
    )
    n.suite.write_text(yaml.safe_dump(PERIODIC))
    return n


@pytest.fixture
def running(node):
    """Start a Daemon in this process; yields it; stops it afterwards."""
    started: list[Daemon] = []
    codes: list[int] = []

    def start(**kwargs) -> Daemon:
        daemon = Daemon(str(node.config), str(node.scenario), suite=str(node.suite), **kwargs)
        thread = threading.Thread(
            target=lambda: codes.append(daemon.run(install_signals=False)), daemon=True
        )
        thread.start()
        started.append(daemon)
        assert wait_for(lambda: daemon.listen_address, 10), "daemon did not start listening"
        return daemon

    yield start
    for d in started:
        d.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failure_grading_one_run_neither_ends_the_checks_nor_hides_behind_healthz(
    node, running, monkeypatch
):
    """A run whose grading raises is logged and the checks go on; were the checks thread to
    die all the same, /healthz would say so (503) instead of serving the last grade for ever."""
    daemon = running()
    base = f"http://127.0.0.1:{node.port}"
    real, failed = daemon._record, []

    def record_once_failing(*args, **kwargs):
        if not failed:
            failed.append(args[0])
            raise RuntimeError("a grading bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(daemon, "_record", record_once_failing)
    runs = lambda: metric_value(  # noqa: E731
        get(base + "/metrics")[1], "node_agent_check_runs_total", check="nvml_health"
    )
    assert wait_for(lambda: failed, 30) and wait_for(lambda: (runs() or 0) >= 2, 30)
    assert get(base + "/healthz")[0] == 200
    monkeypatch.setattr(daemon, "_record", lambda *a, **k: (_ for _ in ()).throw(SystemExit))
    assert wait_for(lambda: not daemon._checks_thread.is_alive(), 30)
    status, body = get(base + "/healthz")
    assert status == 503 and "checks thread has died" in body


def test_metrics_and_healthz_answer_on_loopback(node, running):
    daemon = running()
    base = f"http://127.0.0.1:{node.port}"
    status, body = get(base + "/healthz")
    assert status == 200 and body.startswith("ok")
    wait_for(
        lambda: metric_value(
            get(base + "/metrics")[1], "node_agent_check_runs_total", check="nvml_health"
        ),
        10,
    )
    status, text = get(base + "/metrics")
    assert status == 200
    assert metric_value(text, "node_agent_up") == 1
    assert metric_value(text, "node_agent_health_level") == 0
    assert metric_value(text, "node_agent_gpu_temperature_celsius", gpu="3") is not None
    assert metric_value(text, "node_agent_check_status", check="nvml_health", status="pass") == 1
    assert metric_value(text, "node_agent_training_hang_suspicions_total") == 0
    assert daemon.grade.level.name == "HEALTHY"


def test_xid_injected_while_running_is_graded_and_exported_by_the_running_daemon(node, running):
    """The bound is a hang's, not a speed's: bench/bench_daemon.py measures the latency
    (docs/benchmarks.md), which a loaded test machine would only blur."""
    daemon = running()
    base = f"http://127.0.0.1:{node.port}"
    wait_for(lambda: daemon.snapshot().checks.get("xid"), 10)
    node.write([{"kind": "xid", "gpu": 5, "code": 64}])
    injected = time.monotonic()

    def exported():
        text = get(base + "/metrics")[1]
        return (
            metric_value(text, "node_agent_gpu_xid_errors_total", gpu="5", code="64")
            and metric_value(text, "node_agent_health_level") == 3
        )

    assert wait_for(exported, 30, interval_s=0.02), "Xid 64 not in /metrics within 30 s"
    latency = time.monotonic() - injected
    assert daemon.grade.level.name == "FAULT"
    assert any(r.target == "gpu:5" and "64" in r.message for r in daemon.grade.reasons)
    print(f"xid injection -> metric latency {latency:.3f} s")


WATCHED_CHECK = """
import threading
from prometheus_client.core import GaugeMetricFamily
from node_agent.checking.behaviour import ServiceBehaviour, Sighting
from node_agent.model import Result, Status

STOPPED = threading.Event()


class DoorWatch:
    def __init__(self, ctx):
        self.ctx = ctx

    def start(self):
        gpus = len(self.ctx.node().inventory.gpus)
        found = Result("watched", "gpu:3", "door_open", Status.FAIL, f"door open (1 of {gpus})",
                       value=1)
        sighting = Sighting(found, "first", "door open on gpu:3")
        threading.Thread(target=self.ctx.report, args=(sighting,), daemon=True).start()

    def stop(self, timeout_s=2.0):
        STOPPED.set()

    def collect(self):
        family = GaugeMetricFamily("node_agent_test_watched_gpus", "GPUs the watcher saw")
        family.add_metric([], len(self.ctx.node().inventory.gpus))
        yield family


def run(ctx):
    return [ctx.result("node", "door_open", Status.PASS, "closed")]


def sticky(result):
    return result.target if result.status is Status.FAIL else None


SERVICE = ServiceBehaviour(sticky=sticky, watcher=DoorWatch)
"""

UNBUILDABLE_CHECK = """
from node_agent.checking.behaviour import ServiceBehaviour


def run(ctx):
    return []


def watcher(ctx):
    raise RuntimeError("broken on purpose")


SERVICE = ServiceBehaviour(sticky=lambda result: None, watcher=watcher)
"""


def test_a_watcher_a_check_declares_is_started_graded_at_once_and_stopped(
    node, running, monkeypatch, tmp_path, caplog
):
    """The daemon starts the watcher of every registered check (here one no suite schedules)
    with the node it has, grades what it hands back as that check's sticky finding, serves its
    series and stops it at shutdown; a watcher that cannot be built is logged, and the daemon
    runs on. The checks are stand-ins registered for the test, so nothing in the daemon names
    them."""
    (tmp_path / "watched_check.py").write_text(WATCHED_CHECK)
    (tmp_path / "unbuildable_check.py").write_text(UNBUILDABLE_CHECK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "watched", "watched_check")
    monkeypatch.setitem(registry.REGISTRY, "unbuildable", "unbuildable_check")
    with caplog.at_level("ERROR", logger="node_agent.service.daemon"):
        daemon = running()
    assert wait_for(lambda: daemon.grade.level.name == "ERROR", 10), daemon.grade
    assert [(r.rule, r.target) for r in daemon.grade.reasons if r.target == "gpu:3"]
    (kept,) = [r for r in daemon.current_results() if r.check == "watched"]
    assert (kept.metric, kept.detail) == ("door_open", "door open (1 of 8)")
    text = get(f"http://127.0.0.1:{node.port}/metrics")[1]
    assert metric_value(text, "node_agent_test_watched_gpus") == 8
    assert any(
        "unbuildable: its watcher cannot be built: broken on purpose" in r.getMessage()
        for r in caplog.records
    )
    daemon.stop()
    assert wait_for(sys.modules["watched_check"].STOPPED.is_set, 10), "the watcher was not stopped"


def test_check_that_raises_every_time_does_not_stop_the_others(
    node, running, monkeypatch, tmp_path
):
    boom = tmp_path / "boom_check.py"
    boom.write_text("def run(ctx):\n    raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "boom", "boom_check")
    suite = dict(
        PERIODIC, checks=[{"check": "boom", "every_s": 0.2, "timeout_s": 5}, *PERIODIC["checks"]]
    )
    node.suite.write_text(yaml.safe_dump(suite))
    running()
    base = f"http://127.0.0.1:{node.port}"

    def errors_and_others_ran():
        text = get(base + "/metrics")[1]
        errors = metric_value(text, "node_agent_check_errors_total", check="boom") or 0
        others = metric_value(text, "node_agent_check_runs_total", check="nvml_health") or 0
        return errors >= 3 and others >= 2

    assert wait_for(errors_and_others_ran, 15), get(base + "/metrics")[1]
    assert get(base + "/healthz")[0] == 200


def test_check_listed_for_a_child_process_runs_there_and_reports_back(node, running):
    """``daemon.subprocess_checks`` keeps torch out of the daemon; any check can go there."""
    config = yaml.safe_load(node.config.read_text())
    config["daemon"]["subprocess_checks"] = ["nvml_health"]
    node.config.write_text(yaml.safe_dump(config))
    node.write([{"kind": "row_remap_pending", "gpu": 2}])
    daemon = running()
    assert wait_for(lambda: daemon.grade.level.name == "ERROR", 60), daemon.grade
    assert any(r.target == "gpu:2" for r in daemon.grade.reasons)


def test_bad_config_on_reload_is_refused_and_the_old_one_kept(node, running):
    daemon = running()
    node.config.write_text("daemon: {listen: [not, a, string]}\n")
    assert daemon.reload_config() is False
    assert get(f"http://127.0.0.1:{node.port}/healthz")[0] == 200
    assert daemon.config.daemon.xid_poll_s == 0.2


def test_a_reload_that_drops_a_check_takes_its_readings_off_the_scrape(node, running):
    daemon = running()
    base = f"http://127.0.0.1:{node.port}"
    assert wait_for(
        lambda: metric_value(get(base + "/metrics")[1], "node_agent_gpu_temperature_celsius"),
        30,
    ), "nvml_health's temperatures never reached /metrics"
    node.suite.write_text(yaml.safe_dump({**PERIODIC, "checks": PERIODIC["checks"][1:]}))
    assert daemon.reload_config() is True
    text = get(base + "/metrics")[1]
    assert metric_value(text, "node_agent_gpu_temperature_celsius") is None, text
    assert metric_value(text, "node_agent_check_status", check="nvml_health") is None, text
    assert metric_value(text, "node_agent_check_runs_total", check="nvml_health"), "a counter stays"
    assert metric_value(text, "node_agent_check_runs_total", check="xid") is not None


def test_systemd_readiness_and_watchdog_pings_reach_the_notify_socket(node, running, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    try:
        running(notifier=Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}))
        messages = [sock.recv(4096).decode() for _ in range(3)]
    finally:
        sock.close()
    assert messages[0].startswith("READY=1")
    assert "WATCHDOG=1" in messages[1:]


def _start_subprocess(node, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node_agent.commands.main",
            "daemon",
            "--config",
            str(node.config),
            "--simulate",
            str(node.scenario),
            "--suite",
            str(node.suite),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_exits_zero_within_five_seconds(node):
    proc = _start_subprocess(node)
    try:
        assert wait_for(
            lambda: (
                get(f"http://127.0.0.1:{node.port}/healthz", 1)[0] == 200
                if proc.poll() is None
                else True
            ),
            30,
        )
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=5)
    finally:
        proc.kill()
    assert code == 0


FAKE_TRAINING_CHECK = """
from pathlib import Path
from node_agent.model import Status
from node_agent.checks.training_progress import SERVICE  # the real check's daemon behaviour

def run(ctx):
    runs = Path(ctx.params["runs_file"])
    n = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(n))
    evidence = dict(pid=4711, rank=3, local_rank=3, world_size=8, job="slurm:4242", step=7,
                    step_time_s=0.25, heartbeat_age_s=0.5 * n, gpus=[3], signals={},
                    agreeing=[], likely_origin=None)
    if n == 1:
        return [ctx.result("job:slurm:4242/rank:3", "training_progress", Status.PASS, "steps",
                           value=0.5, unit="s", **evidence)]
    return [ctx.result("job:slurm:4242/rank:3", "training_hang", Status.FAIL, "no step",
                       value=0.5 * n, unit="s", **dict(evidence, agreeing=["heartbeat"]))]
"""


def test_hung_training_process_is_exported_and_counted_once(node, running, monkeypatch, tmp_path):
    """The contract of training_progress's results (docs/training_hangs.md), from a stand-in
    check: stepping on the first run, hung on every later one -> one suspicion."""
    (tmp_path / "fake_training_check.py").write_text(FAKE_TRAINING_CHECK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "training_progress", "fake_training_check")
    suite = dict(
        PERIODIC,
        checks=[
            *PERIODIC["checks"],
            {
                "check": "training_progress",
                "every_s": 0.2,
                "timeout_s": 5,
                "params": {"runs_file": str(tmp_path / "runs")},
            },
        ],
    )
    node.suite.write_text(yaml.safe_dump(suite))
    daemon = running()
    base = f"http://127.0.0.1:{node.port}"
    labels = {"job": "slurm:4242", "rank": "3", "pid": "4711"}

    def hung_for_three_runs():
        runs = daemon.snapshot().checks.get("training_progress")
        text = get(base + "/metrics")[1]
        return (
            runs
            and runs.runs >= 4
            and metric_value(text, "node_agent_training_hang_suspected", **labels) == 1
            and text
        )

    text = wait_for(hung_for_three_runs, 30, interval_s=0.1)
    assert text, get(base + "/metrics")[1]
    assert metric_value(text, "node_agent_training_hang_suspicions_total") == 1, (
        "hung across several runs of the check: one suspicion"
    )
    assert metric_value(text, "node_agent_training_step_time_seconds", **labels) == 0.25
    assert metric_value(text, "node_agent_training_heartbeat_age_seconds", **labels) >= 2.0


@pytest.fixture
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus; make test installs it)")
    return path


def test_metrics_pass_promtool_check(node, running, promtool):
    running()
    base = f"http://127.0.0.1:{node.port}"
    wait_for(
        lambda: metric_value(get(base + "/metrics")[1], "node_agent_check_runs_total", check="xid"),
        10,
    )
    text = get(base + "/metrics")[1]
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_server_scrapes_the_daemon(node, running, promtool, tmp_path):
    """A real Prometheus server scrapes /metrics and answers a query for the node's grade."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus server not installed (Debian package prometheus)")
    running()
    prom_port = free_loopback_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "node-agent",
                        "static_configs": [{"targets": [f"127.0.0.1:{node.port}"]}],
                    }
                ],
            }
        )
    )
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        query = (
            f"http://127.0.0.1:{prom_port}/api/v1/query?query="
            "node_agent_health_level%7Bjob%3D%22node-agent%22%7D"
        )

        def scraped():
            if server.poll() is not None:
                return "exited"
            try:
                data = json.loads(get(query, 2)[1])
            except (OSError, ValueError):
                return None
            return data["data"]["result"] if data.get("status") == "success" else None

        result = wait_for(scraped, 30, interval_s=0.5)
        assert result and result != "exited", server.stderr.read() if server.poll() else result
        assert result[0]["value"][1] == "0"
        assert result[0]["metric"]["hostname"] == "sim-node"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _actions_log(node) -> list[dict]:
    path = Path(yaml.safe_load(node.config.read_text())["state_dir"]) / "actions.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _journal_done(node) -> int:
    """Rows the daemon's journal has closed as done (read-only, beside the running daemon)."""
    import sqlite3

    path = Path(yaml.safe_load(node.config.read_text())["state_dir"]) / "node-agent.db"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT COUNT(*) FROM journal WHERE state = 'done'").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def test_fault_is_acted_on_once_even_across_kill_9_and_restart(node):
    """The daemon drains a FAULT node through the (default) log adapter; a SIGKILL and a
    restart neither repeat the actions it finished nor lose the history. (A kill between an
    adapter call and its journal row closing sends that action again on restart, at least once
    by design: docs/remediation.md; so the kill waits for the journal.)"""
    node.write([{"kind": "xid", "gpu": 5, "code": 64}])
    proc = _start_subprocess(node)
    try:
        assert wait_for(lambda: len(_actions_log(node)) >= 2 and _journal_done(node) >= 2, 60), (
            proc.stderr
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        first = _actions_log(node)  # read after the kill: whatever the first daemon finished
        proc = _start_subprocess(node)
        assert wait_for(lambda: get(f"http://127.0.0.1:{node.port}/healthz", 1)[0] == 200, 60)
        text = wait_for(
            lambda: (
                (t := get(f"http://127.0.0.1:{node.port}/metrics")[1])
                and metric_value(t, "node_agent_health_level") == 3
                and t
            ),
            60,
        )
        assert text
        # the drain was the first daemon's: the new one knows it from the store, not its counters
        drained = wait_for(
            lambda: metric_value(
                get(f"http://127.0.0.1:{node.port}/metrics")[1],
                "node_agent_drained_by_agent",
                source="state",
            ),
            30,
        )
        assert drained == 1
        time.sleep(2)  # give a duplicate every chance to appear
    finally:
        proc.kill()
        proc.wait(timeout=10)
    actions = [a.get("action") for a in _actions_log(node)]
    assert actions == [a.get("action") for a in first], actions
    assert actions.count("drain") == 1 and actions.count("replace") == 1


def test_a_check_module_that_does_not_import_leaves_the_daemon_running(tmp_path, monkeypatch):
    """The daemon reads each check's SERVICE from its module; a module that cannot be imported
    is a plain check (its runs report the crash), never a daemon that cannot start."""
    from node_agent.model import Result, Status

    monkeypatch.setitem(registry.REGISTRY, "broken", "node_agent_no_such_module")
    with unstarted_daemon(tmp_path) as d:
        failed = Result("broken", "node", "crashed", Status.ERROR, "ModuleNotFoundError")
        d._record("broken", [failed], time.time(), 0.1)
        assert [r.metric for r in d.current_results() if r.check == "broken"] == ["crashed"]
        assert d.grade.level.name != "HEALTHY"


def test_a_corrupt_state_file_is_set_aside_and_the_grade_is_unknown_until_checks_ran(
    node, running, caplog
):
    state = Path(yaml.safe_load(node.config.read_text())["state_dir"])
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    (state / "daemon-state.json").write_text('{"schema": "node-agent.daemon-state/1", "checks": {')
    slow = {**PERIODIC, "checks": [*PERIODIC["checks"], {"check": "sdc_spool", "every_s": 60}]}
    node.suite.write_text(yaml.safe_dump(slow))
    # the last check is held until the UNKNOWN answer has been seen, then let run
    original = Daemon._make_schedule
    held = []

    def late_last(self, suite):
        schedule = original(self, suite)
        schedule[-1].next_due += 3600
        held.append(schedule[-1])
        return schedule

    with caplog.at_level("ERROR", logger="node_agent.service.node_state"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Daemon, "_make_schedule", late_last)
            daemon = running()
            assert wait_for(lambda: daemon.view is not None, 10)
            assert daemon.view.unknown and "sdc_spool" in daemon.view.missing
            assert get(f"http://127.0.0.1:{node.port}/healthz")[1].startswith("ok UNKNOWN")
            text = get(f"http://127.0.0.1:{node.port}/metrics")[1]
            assert metric_value(text, "node_agent_grade_unknown") == 1
            with daemon._lock:
                held[-1].next_due = daemon._clock()
            daemon._wake_checks.set()
            assert wait_for(lambda: daemon.view.complete, 30), daemon.view.missing
    assert daemon.view.level == "HEALTHY"
    assert get(f"http://127.0.0.1:{node.port}/healthz")[1] == "ok HEALTHY\n"
    assert (
        metric_value(get(f"http://127.0.0.1:{node.port}/metrics")[1], "node_agent_grade_unknown")
        == 0
    )
    (line,) = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert "daemon-state.json" in line and "kept as" in line and "UNKNOWN" in line
    aside = list(state.glob("daemon-state.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text().endswith('"checks": {')


def test_a_check_that_fails_runs_in_a_row_is_a_finding_and_its_result_age_a_metric(tmp_path):
    """A check wedged in NVML or DCGM: each run times out; after daemon.failures_warn_after
    runs in a row the failure is a WARN naming the check, and a run that passes clears it."""
    from node_agent.model import Result, Status

    scenario, config, suite = tmp_path / "s.yaml", tmp_path / "c.yaml", tmp_path / "p.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2, "faults": []}))
    suite.write_text(yaml.safe_dump(PERIODIC))
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"failures_warn_after": 2},
            }
        )
    )
    d = Daemon(str(config), str(scenario), suite=str(suite))
    try:
        hung = Result("nvml_health", "node", "timeout", Status.ERROR, "no answer in 10 s")
        d._record("nvml_health", [hung], time.time() - 30, 10.0)
        assert not [r for r in d.current_results() if r.metric == "repeated_failure"]
        d._record("nvml_health", [hung], time.time() - 10, 10.0)
        (stall,) = [r for r in d.current_results() if r.metric == "repeated_failure"]
        assert stall.status is Status.WARN and "nvml_health" in stall.detail
        assert "2 runs in a row" in stall.detail and "no answer in 10 s" in stall.detail
        assert any("repeated_failure" in r.message for r in d.grade.reasons)
        snap = d.snapshot()
        assert snap.checks["nvml_health"].failing_runs == 2
        assert 0 <= snap.now_unix - snap.result_unix["nvml_health"] < 5
        ok = Result("nvml_health", "gpu:0", "temperature", Status.PASS, "40 C")
        d._record("nvml_health", [ok], time.time(), 0.1)
        assert not [r for r in d.current_results() if r.metric == "repeated_failure"]
        # the state is kept: latest results per check, read back by the next daemon
        d._save_pending()
        again = Daemon(str(config), str(scenario), suite=str(suite))
        try:
            kept = again._results["nvml_health"]
            assert kept.restored and [r.metric for r in kept.results] == ["temperature"]
            assert "xid" not in again._results  # no run, no result
        finally:
            again.env.close()
    finally:
        d.env.close()
