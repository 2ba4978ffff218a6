"""Root's ``node-agent daemon`` as a process of its own, for tests that need the real command
(its signals, its exit, its files as another user finds them)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def agent_daemon(
    config: str | Path, scenario: str | Path, suite: str | Path, log_path: Path, **popen: Any
) -> Iterator[subprocess.Popen]:
    """``node-agent daemon --config --simulate --suite`` from the checkout, stdout and stderr
    in ``log_path``; terminated (SIGTERM, then waited for) when the block ends."""
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node_agent.commands.main",
                "daemon",
                "--config",
                str(config),
                "--simulate",
                str(scenario),
                "--suite",
                str(suite),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            **popen,
        )
        try:
            yield daemon
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)


@contextlib.contextmanager
def graded_daemon(config: str | Path, scenario: str | Path, suite: str | Path) -> Iterator[Any]:
    """Root's :class:`~node_agent.service.daemon.Daemon` run in this process on a thread,
    yielded once every scheduled check has a result; stopped when the block ends."""
    import threading
    import time

    from node_agent.service.daemon import Daemon

    daemon = Daemon(str(config), str(scenario), suite=str(suite))
    thread = threading.Thread(target=daemon.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (daemon.view and daemon.view.complete) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.view and daemon.view.complete, "the daemon did not grade"
        yield daemon
    finally:
        daemon.stop()
        thread.join(10)


@contextlib.contextmanager
def unstarted_daemon(directory: Path) -> Iterator[Any]:
    """Root's :class:`~node_agent.service.daemon.Daemon` on a healthy simulated two-GPU H100,
    its files in ``directory``, never run: the test records results into it itself. Its
    environment is closed when the block ends."""
    import yaml

    from node_agent.service.daemon import Daemon

    scenario, config = directory / "scenario.yaml", directory / "config.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2, "faults": []}))
    config.write_text(
        yaml.safe_dump(
            {"state_dir": str(directory / "state"), "spool_dir": str(directory / "spool")}
        )
    )
    daemon = Daemon(str(config), str(scenario))
    try:
        yield daemon
    finally:
        daemon.env.close()
