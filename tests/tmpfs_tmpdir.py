"""The test run's temporary files on a tmpfs, where the host has room for them there.

Every test, and every process a test starts (the agent's simulated PCI tree, its NVRx socket
directory, torch's rendezvous files, fio's files), makes and removes files under ``TMPDIR``:
tens of thousands in ``make test``. On ext4, ``/tmp`` after such churn makes each new inode
cost a scan past the inodes freed in the last minutes (``recently_deleted`` in
``find_inode_bit``, seen with ``perf``): a simulated ``check`` spent about 0.9 CPU-s in the
kernel instead of 0.1. A directory on ``/dev/shm`` has no such cost. It is made like ``/tmp``
(sticky, writable by every user, so that the unprivileged users of the trust tests reach what
they are given), only where ``/dev/shm`` is a tmpfs with room to spare, and never where the
caller chose ``TMPDIR`` itself; removed when the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TMPFS = Path("/dev/shm")
#: the room a run needs there at most, with a margin (the image test's wheels, fio's files)
ROOM_BYTES = 4 << 30


def _is_tmpfs_with_room(path: Path) -> bool:
    try:
        with open("/proc/self/mountinfo") as mounts:
            fstype = {
                line.split(" - ")[0].split()[4]: line.split(" - ")[1].split()[0]
                for line in mounts
                if " - " in line
            }.get(str(path))
        room = os.statvfs(path)
    except OSError:
        return False
    return fstype == "tmpfs" and room.f_bavail * room.f_frsize >= ROOM_BYTES


def use_tmpfs() -> Path | None:
    """Point ``TMPDIR`` (this process's and every child's) at a new directory on the tmpfs, and
    return it; None, changing nothing, where ``TMPDIR`` is set or there is no such tmpfs."""
    if os.environ.get("TMPDIR") or not _is_tmpfs_with_room(TMPFS):
        return None
    run = Path(tempfile.mkdtemp(prefix="t", dir=TMPFS))  # short: sockets are made under it
    run.chmod(0o1777)
    os.environ["TMPDIR"] = str(run)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return run


def remove(run: Path) -> None:
    shutil.rmtree(run, ignore_errors=True)
