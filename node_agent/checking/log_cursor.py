"""Where a kernel-log reader stopped: a cursor file per check in the state dir.

A check that reads the kernel log ``since: last_run`` keeps the sequence number of the last
record it read, with the boot it was read in and the log's source: after a reboot, or from
another source, the cursor does not apply and the log is read since boot (over-reporting rather
than hiding). An unreadable or corrupt cursor is the same as none; one that cannot be written
costs the next run a read since boot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from node_agent import atomic_file
from node_agent.model import Result, Status

if TYPE_CHECKING:
    from node_agent.checking.context import CheckContext
    from node_agent.kernel_log import LogRecord

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), or ``unknown``."""
    try:
        return path.read_text().strip()
    except OSError:
        return "unknown"


def load(path: Path | None, source: str) -> int | None:
    """The sequence number read last in this boot from ``source``, or None (read since boot)."""
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("boot_id") == boot_id() and data.get("source") == source:
            return int(data["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def save(path: Path | None, source: str, seq: int) -> None:
    """Remember ``seq`` as read (written whole through a private temp file and a rename)."""
    if path is None:
        return
    try:
        atomic_file.write_text(
            path, json.dumps({"boot_id": boot_id(), "source": source, "seq": seq})
        )
    except OSError:
        pass


def read_log(ctx: CheckContext) -> tuple[list[LogRecord] | None, Result | None]:
    """The check's kernel log (``ctx.kernel_log``) read whole; None when it could not be, with
    the result that says why: a skip where the node has no kernel log to read, an ERROR where
    reading it failed."""
    log = ctx.kernel_log
    if log.unavailable_reason:
        return None, ctx.skip(log.unavailable_reason, metric="kernel_log")
    try:
        return log.read(), None
    except OSError as err:
        return None, ctx.result(
            "node",
            "kernel_log",
            Status.ERROR,
            f"cannot read the kernel log ({log.source}): {err}",
            error=str(err),
        )
