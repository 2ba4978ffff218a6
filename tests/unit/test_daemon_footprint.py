"""The daemon's memory: what it must not import, and glibc's malloc arenas (docs/daemon.md, Memory).

A module stays in memory once imported, so the daemon's resident size is mostly what it imported.
These tests hold it to what its steady state needs, by name, without timing or measuring anything:
the other commands, the fleet and report writers, jsonschema (files are validated without it
while they are valid), torch, numpy and requests stay out of the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from node_agent.commands.daemon import limit_malloc_arenas
from node_agent.peers import free_loopback_port

ROOT = Path(__file__).resolve().parents[2]

#: modules the daemon's process must never hold (each with what it would cost or why)
NEVER = (
    "torch",  # the compute checks import it in their own runs, never in the daemon's
    "numpy",
    "requests",  # only a cloud's metadata service and the webhook adapter need it
    "jsonschema",  # only to word an invalid file's error (yamlfile.conforms)
    "node_agent.commands.act",  # the other commands: remediation CLI, fleet, capture, reports
    "node_agent.commands.accept",
    "node_agent.commands.capture",
    "node_agent.commands.fleet",
    "node_agent.commands.grade",
    "node_agent.commands.stop_check",
    "node_agent.fleet",
    "node_agent.stopcheck",
    "node_agent.sim.capture",
    "node_agent.report.html",
    "concurrent.futures",
)


def _held(modules: list[str]) -> list[str]:
    """The modules of ``modules`` that are, or are inside, one of NEVER."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NEVER))


def _run_python(code: str, timeout: float) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    modules: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return modules


def test_importing_the_daemon_loads_none_of_what_it_never_runs():
    modules = _run_python(
        """
        import json, sys
        from node_agent.commands.main import build_parser, command
        build_parser(only="daemon")
        command("daemon")
        import node_agent.service.daemon
        print(json.dumps(sorted(sys.modules)))
        """,
        timeout=120,
    )
    assert "node_agent.service.daemon" in modules
    assert _held(modules) == []


def test_a_daemon_that_ran_every_periodic_check_still_holds_none_of_them(tmp_path):
    """The real command (``node-agent daemon``) on a simulated H100 node with the shipped
    periodic suite, stopped by SIGTERM once every scheduled check has a result (the grade is
    no longer UNKNOWN): the modules its checks, reloads and scrapes imported are all it holds.
    A simulated node because there is no GPU here; the simulator's own modules are allowed."""
    port = free_loopback_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "spool_dir": str(tmp_path / "spool"),
                "daemon": {"listen": f"127.0.0.1:{port}"},
            }
        )
    )
    modules = _run_python(
        f"""
        import json, os, signal, sys, threading, time, urllib.request
        from node_agent.commands.main import main

        def stop_once_graded():
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                try:
                    url = "http://127.0.0.1:{port}/healthz"
                    body = urllib.request.urlopen(url, timeout=5).read().decode()
                    if body.startswith("ok ") and "UNKNOWN" not in body:
                        urllib.request.urlopen("http://127.0.0.1:{port}/metrics").read()
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            else:
                print("the daemon never graded the node", file=sys.stderr)
                os._exit(3)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=stop_once_graded, daemon=True).start()
        code = main(["daemon", "--config", {str(config)!r}, "--log-level", "ERROR",
                     "--simulate", "scenarios/healthy-h100.yaml"])
        assert code == 0, code
        print(json.dumps(sorted(sys.modules)))
        """,
        timeout=240,
    )
    assert "node_agent.service.trend_watch" in modules  # it ran, and graded trends
    assert _held(modules) == []


@pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="malloc arenas are glibc's; this C library has none to cap",
)
def test_daemon_caps_malloc_arenas_on_glibc_unless_the_operator_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_malloc_arenas() is True
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert limit_malloc_arenas() is False
