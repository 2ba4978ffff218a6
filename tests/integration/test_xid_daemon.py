"""The xid check's watcher in the daemon under a flood, run for real: ``Daemon`` on a thread in this process
against the simulator, whose kernel log carries raw driver lines (``kind: kernel_log``).

A flood of one code must make one reason and a handful of calls into the daemon, not one per
line, while the Prometheus counter counts every line; a Fatal line arriving after thousands of
Nonfatal ones must still turn the grade to ERROR; an NVSwitch SXid is reported by the watch as a
node-level finding on ``nvswitch:N`` and graded from ``graders/sxid.yaml``.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
import urllib.request

import pytest
import yaml
from agent_daemon import unstarted_daemon  # tests/agent_daemon.py
from waiting import wait_for  # tests/waiting.py

from node_agent.checks.xid import watch as watch_module
from node_agent.service.daemon import Daemon

NONFATAL_149 = (
    "NVRM: Xid (PCI:{bus}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
    "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)"
)
FATAL_149 = (
    "NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
    "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
)
FATAL_SXID = "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
FLOOD = 3000


def flood(gpu: int, n: int, line: str = NONFATAL_149):
    return [
        {"kind": "kernel_log", "gpu": gpu, "line": f"[{1000 + i * 0.01:.6f}] {line}"}
        for i in range(n)
    ]


@pytest.fixture
def daemon(tmp_path, monkeypatch, request):
    """A running daemon on a simulated GB200 tray; ``.write(faults)`` changes its scenario and
    ``.calls`` keeps the watcher's sightings handed to the daemon. Indirect parameters: ``sku``, and
    ``update_s`` for the watch's count updates (default: the watch's own, once a minute)."""
    options = getattr(request, "param", {})
    sku = options.get("sku", "gb200-186gb")
    if "update_s" in options:
        monkeypatch.setattr(
            watch_module,
            "XidWatch",
            functools.partial(watch_module.XidWatch, update_s=options["update_s"]),
        )
    scenario = tmp_path / "scenario.yaml"
    config = tmp_path / "config.yaml"
    suite = tmp_path / "periodic.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def write(faults=()):
        tmp = scenario.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"sku": sku, "gpus": 4, "faults": list(faults)}))
        os.replace(tmp, scenario)

    write()
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"listen": f"127.0.0.1:{port}", "xid_poll_s": 0.2},
            }
        )
    )
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "test-periodic",
                "mode": "service",
                "checks": [
                    {"check": "xid", "timeout_s": 20, "every_s": 2, "params": {"since": "boot"}}
                ],
            }
        )
    )
    calls: list[object] = []
    original = Daemon._on_sighting

    def counting(self, sighting):
        calls.append(sighting)
        original(self, sighting)

    monkeypatch.setattr(Daemon, "_on_sighting", counting)
    d = Daemon(str(config), str(scenario), suite=str(suite))
    thread = threading.Thread(target=lambda: d.run(install_signals=False), daemon=True)
    thread.start()
    assert wait_for(lambda: d.listen_address, 10), "daemon did not start listening"
    d.write, d.calls = write, calls
    yield d
    d.stop()
    thread.join(5)


def xid_reasons(d):
    return [r for r in d.grade.reasons if r.rule == "xid"]


def test_daemon_grades_a_nonfatal_flood_as_one_warn_reason_with_few_calls(daemon):
    daemon.write(flood(gpu=2, n=FLOOD))
    assert wait_for(lambda: xid_reasons(daemon), 15), "the flood was never graded"
    time.sleep(3)  # let the watch and at least one periodic xid check see the whole flood
    reasons = xid_reasons(daemon)
    assert [(r.target, r.level.name) for r in reasons] == [("gpu:2", "WARN")]
    assert daemon.grade.level.name == "WARN"
    assert len(daemon.calls) <= 3, f"{len(daemon.calls)} calls for {FLOOD} lines"
    assert len(daemon.current_results()) < 10


def test_daemon_turns_error_when_a_fatal_line_follows_a_nonfatal_flood(daemon):
    daemon.write(flood(gpu=1, n=FLOOD))
    assert wait_for(lambda: daemon.grade.level.name == "WARN", 15)
    daemon.write(flood(gpu=1, n=FLOOD) + flood(gpu=1, n=1, line=FATAL_149))
    # a bound, not a latency claim (bench/bench_daemon.py measures that): the flood is read
    # line by line on a machine other tests load
    assert wait_for(lambda: daemon.grade.level.name == "ERROR", 30), daemon.grade
    (reason,) = xid_reasons(daemon)
    assert reason.target == "gpu:1" and "NETIR_LINK_EVT Fatal -> RESET_GPU" in reason.message


def scraped_xid_lines(d) -> list[str]:
    """The ``node_agent_gpu_xid_errors_total`` series of the daemon's /metrics."""
    host, port = d.listen_address
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [ln for ln in text.splitlines() if ln.startswith("node_agent_gpu_xid_errors_total{")]


def scraped_xid_count(d, gpu: str, code: str) -> float | None:
    for line in scraped_xid_lines(d):
        if f'gpu="{gpu}"' in line and f'code="{code}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("daemon", [{"update_s": 0.5}], indirect=True)
def test_xid_counter_counts_every_line_of_a_flood_not_the_watch_reports(daemon):
    daemon.write(flood(gpu=2, n=FLOOD))
    # the first report carries the count so far; the rest arrives with the next update
    assert wait_for(lambda: scraped_xid_count(daemon, "2", "149") == FLOOD, 15), scraped_xid_count(
        daemon, "2", "149"
    )
    assert len(daemon.calls) < 10, f"{len(daemon.calls)} calls for {FLOOD} lines"
    (kept,) = [r for r in daemon.current_results() if r.metric == "xid"]
    assert (kept.target, kept.evidence["count"]) == ("gpu:2", FLOOD)
    daemon.write(flood(gpu=2, n=FLOOD) + flood(gpu=2, n=1, line=FATAL_149))
    assert wait_for(lambda: scraped_xid_count(daemon, "2", "149") == FLOOD + 1, 10), (
        scraped_xid_count(daemon, "2", "149")
    )


@pytest.mark.parametrize("daemon", [{"sku": "h100-sxm5-80gb"}], indirect=True)
def test_watch_reports_an_sxid_as_a_node_level_finding_on_its_nvswitch(daemon):
    daemon.write([{"kind": "kernel_log", "line": FATAL_SXID}])
    assert wait_for(lambda: daemon.grade.level.name == "ERROR", 10), daemon.grade
    (reason,) = [r for r in daemon.grade.reasons if r.rule == "sxid"]
    assert reason.target == "nvswitch:1" and "SXid 20034: LTSSM Fault Up" in reason.message
    assert wait_for(lambda: [s for s in daemon.calls if s.result.metric == "sxid"], 5), (
        "the watch never reported the SXid"
    )
    sighting = next(s.result for s in daemon.calls if s.result.metric == "sxid")
    assert (sighting.check, sighting.target, sighting.value) == ("xid", "nvswitch:1", 20034)
    # an NVSwitch is not a GPU: the GPU Xid counter has no series for it
    assert scraped_xid_lines(daemon) == []


def test_kept_xid_result_is_the_one_that_counted_more_lines(tmp_path):
    """The periodic check and the watch file findings under the same (target, code): a later
    result that counted fewer lines (a shorter window) does not replace a fuller one."""
    from node_agent.model import Result, Status

    with unstarted_daemon(tmp_path) as d:

        def xid(count, metric="xid", target="gpu:0", code=79):
            return Result(
                check="xid",
                target=target,
                metric=metric,
                status=Status.FAIL,
                value=code,
                detail=f"{metric} {code} x{count}",
                evidence={"count": count},
            )

        def kept():
            return {
                (r.target, r.metric): r.evidence["count"]
                for r in d.current_results()
                if r.metric in ("xid", "sxid")
            }

        d._record("xid", [xid(50), xid(2, "sxid", "nvswitch:1", 20034)], time.time(), 0.1)
        d._record("xid", [xid(3), xid(1, "sxid", "nvswitch:1", 20034)], time.time(), 0.1)
        assert kept() == {("gpu:0", "xid"): 50, ("nvswitch:1", "sxid"): 2}
        d._record("xid", [xid(60)], time.time(), 0.1)
        assert kept() == {("gpu:0", "xid"): 60, ("nvswitch:1", "sxid"): 2}
        assert [r.rule for r in d.grade.reasons if r.target == "nvswitch:1"] == ["sxid"]
