"""Which bus ids the xid check believes: on this host's own log, only those the PCI bus in sysfs
shows are NVIDIA functions (GPUs and NVSwitches); a saved log's are taken as printed. Read by the
periodic check and its watcher alike."""

from __future__ import annotations

import os
from pathlib import Path

from node_agent.gpu.pci import NVIDIA_VENDOR_ID, SYSFS_PCI_DEVICES
from node_agent.kernel_log import KernelLog, normalise_bus


def nvidia_buses(log: KernelLog, root: Path | None = None) -> frozenset[str] | None:
    """The bus ids (``0000:3b:00``) of every NVIDIA PCI function on this host (sysfs ``vendor``
    0x10de, any class: GPUs and NVSwitches), when ``log`` is this host's own log and sysfs can be
    listed; None otherwise (a saved log, or no sysfs): then bus ids are taken as printed."""
    if not log.live:
        return None
    root = root if root is not None else SYSFS_PCI_DEVICES
    try:
        names = os.listdir(root)
    except OSError:
        return None
    found = set()
    for name in names:
        try:
            vendor = int((root / name / "vendor").read_text().strip(), 16)
            if vendor == NVIDIA_VENDOR_ID:
                found.add(normalise_bus(name))
        except (OSError, ValueError):
            continue
    return frozenset(found)
