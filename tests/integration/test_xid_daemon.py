"""The daemon's XID watch under a flood, run for real: ``Daemon`` on a thread in this process
against the simulator, whose kernel log carries raw driver lines (``kind: kernel_log``).

A flood of one code must make one reason and a handful of calls into the daemon, not one per
line; a Fatal line arriving after thousands of Nonfatal ones must still turn the grade to ERROR.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import yaml

from node_agent.service.daemon import Daemon

NONFATAL_149 = ("NVRM: Xid (PCI:{bus}): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
                "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)")
FATAL_149 = ("NVRM: Xid (PCI:{bus}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 08 "
             "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")
FLOOD = 3000


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def flood(gpu: int, n: int, line: str = NONFATAL_149):
    return [{"kind": "kernel_log", "gpu": gpu, "line": f"[{1000 + i * 0.01:.6f}] {line}"}
            for i in range(n)]


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    """A running daemon on a simulated GB200 tray; ``.write(faults)`` changes its scenario and
    ``.calls`` counts the watch's calls into the daemon."""
    scenario = tmp_path / "scenario.yaml"
    config = tmp_path / "config.yaml"
    suite = tmp_path / "periodic.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def write(faults=()):
        tmp = scenario.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"sku": "gb200-186gb", "gpus": 4, "faults": list(faults)}))
        os.replace(tmp, scenario)

    write()
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"),
                                      "spool_dir": str(tmp_path / "spool"),
                                      "daemon": {"listen": f"127.0.0.1:{port}", "xid_poll_s": 0.2}}))
    suite.write_text(yaml.safe_dump({
        "name": "test-periodic", "mode": "service",
        "checks": [{"check": "xid", "timeout_s": 20, "every_s": 2, "params": {"since": "boot"}}]}))
    calls: list[object] = []
    original = Daemon._on_xid

    def counting(self, sighting):
        calls.append(sighting)
        original(self, sighting)

    monkeypatch.setattr(Daemon, "_on_xid", counting)
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
    assert wait_for(lambda: daemon.grade.level.name == "ERROR", 10), daemon.grade
    (reason,) = xid_reasons(daemon)
    assert reason.target == "gpu:1" and "NETIR_LINK_EVT Fatal -> RESET_GPU" in reason.message
