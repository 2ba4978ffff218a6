"""Installed memory: the kernel's memory blocks, else ``/proc/meminfo`` MemTotal.

``/sys/devices/system/memory/memoryN/`` is one block of ``block_size_bytes`` (hex) per section
of physical RAM the kernel found, online or not (Linux ``Documentation/admin-guide/mm/
memory-hotplug.rst``): their total is the installed RAM to a block, struct-page array and
firmware reservations included. MemTotal leaves those out (about 1.6 % for the page array
alone: 64 bytes per 4 KiB page), so it is the fallback, read with that allowance.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from node_agent.host.paths import read_text

GIB = 1 << 30
_BLOCK = re.compile(r"^memory\d+$")


@dataclass(frozen=True)
class InstalledMemory:
    gib: float
    source: str  # "memory_blocks" or "meminfo"
    blocks: int | None = None
    block_bytes: int | None = None


def read_installed(
    sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")
) -> InstalledMemory | None:
    """The node's installed memory, or None when neither source can be read."""
    base = sys_root / "devices/system/memory"
    size_text = read_text(base / "block_size_bytes")
    if size_text:
        try:
            block = int(size_text, 16)
            count = sum(1 for n in os.listdir(base) if _BLOCK.match(n))
        except (ValueError, OSError):
            count = 0
        if count and block > 0:
            return InstalledMemory(
                gib=round(count * block / GIB, 2),
                source="memory_blocks",
                blocks=count,
                block_bytes=block,
            )
    meminfo = read_text(proc_root / "meminfo")
    for line in (meminfo or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemTotal:" and fields[1].isdigit():
            return InstalledMemory(gib=round(int(fields[1]) * 1024 / GIB, 2), source="meminfo")
    return None
