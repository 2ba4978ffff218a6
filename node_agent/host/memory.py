"""Installed memory: the kernel's memory blocks, else ``/proc/meminfo`` MemTotal.

``/sys/devices/system/memory/memoryN/`` is one block of ``block_size_bytes`` (hex) per section
of physical RAM the kernel found, online or not (Linux ``Documentation/admin-guide/mm/
memory-hotplug.rst``): their total is the installed RAM to a block, struct-page array and
firmware reservations included. MemTotal leaves those out (about 1.6 % for the page array
alone: 64 bytes per 4 KiB page), so it is the fallback, read with that allowance.

On a Grace host (GB200, GB300; ``gpu_nodes=True``) only blocks of NUMA nodes that have CPUs are
the host's RAM: the NVIDIA driver may hot-add each GPU's memory as a CPU-less NUMA node (with
CDMM off, the default before R580), and those blocks come and go with the driver. They are
counted apart (``gpu_node_gib``). Elsewhere a CPU-less node is RAM too (a CXL expander, HBM in
flat mode) and counts. A block names its node by a ``nodeN`` entry; where the kernel shows no
NUMA nodes every block counts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from node_agent.host.paths import read_text

GIB = 1 << 30
_BLOCK = re.compile(r"^memory\d+$")
_NODE = re.compile(r"^node\d+$")


@dataclass(frozen=True)
class InstalledMemory:
    gib: float
    source: str  # "memory_blocks" or "meminfo"
    blocks: int | None = None
    block_bytes: int | None = None
    #: memory in CPU-less NUMA nodes (a GPU's memory the driver onlined), not counted in ``gib``
    gpu_node_gib: float = 0.0


def read_installed(
    sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc"), gpu_nodes: bool = False
) -> InstalledMemory | None:
    """The node's installed memory, or None when neither source can be read. ``gpu_nodes``:
    CPU-less NUMA nodes are the GPUs' memory (a Grace host), counted apart."""
    base = sys_root / "devices/system/memory"
    size_text = read_text(base / "block_size_bytes")
    if size_text:
        cpuless = _cpuless_nodes(sys_root / "devices/system/node") if gpu_nodes else set()
        count = elsewhere = 0
        try:
            block = int(size_text, 16)
            for name in os.listdir(base):
                if _BLOCK.match(name):
                    if cpuless and _node_of(base / name) in cpuless:
                        elsewhere += 1
                    else:
                        count += 1
        except (ValueError, OSError):
            count = 0
        if count and block > 0:
            return InstalledMemory(
                gib=round(count * block / GIB, 2),
                source="memory_blocks",
                blocks=count,
                block_bytes=block,
                gpu_node_gib=round(elsewhere * block / GIB, 2),
            )
    meminfo = read_text(proc_root / "meminfo")
    for line in (meminfo or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemTotal:" and fields[1].isdigit():
            return InstalledMemory(gib=round(int(fields[1]) * 1024 / GIB, 2), source="meminfo")
    return None


def _cpuless_nodes(nodes: Path) -> set[str]:
    """``nodeN`` names of NUMA nodes with no CPU (empty ``cpulist``)."""
    try:
        names = [n for n in os.listdir(nodes) if _NODE.match(n)]
    except OSError:
        return set()
    return {n for n in names if read_text(nodes / n / "cpulist") == ""}


def _node_of(block: Path) -> str | None:
    try:
        return next((n for n in os.listdir(block) if _NODE.match(n)), None)
    except OSError:
        return None
