"""NVMe controllers from ``/sys/class/nvme``, and which of them hold given paths.

``/sys/class/nvme/nvmeN/`` is one controller (``model``, ``serial``, ``firmware_rev``), with its
namespaces below it (``nvmeNnM``, or ``nvmeNcCnM`` paths under native multipath, whose block
device is ``nvmeNnM``). Which controller holds a path comes from the mount table
(``/proc/self/mounts``): the longest mount point above the path, its device's namespace.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from node_agent.gpu.pci import normalise_bus_id
from node_agent.host.paths import read_text

NVME_CLASS = Path("class/nvme")
CONTROLLER = re.compile(r"^nvme\d+$")
_NAMESPACE = re.compile(r"^nvme(\d+)(?:c\d+)?n(\d+)$")
_BLOCK = re.compile(r"^nvme(\d+)n(\d+)(?:p\d+)?$")


@dataclass(frozen=True)
class NvmeController:
    name: str  # nvme0
    model: str
    serial: str
    firmware: str
    namespaces: tuple[str, ...]  # block devices: nvme0n1


def list_controllers(sys_root: Path = Path("/sys")) -> list[NvmeController]:
    """The NVMe controllers under ``sys_root``; [] when there is no ``/sys/class/nvme``."""
    base = sys_root / NVME_CLASS
    try:
        names = [n for n in os.listdir(base) if CONTROLLER.match(n)]
    except OSError:
        return []
    out = []
    for name in sorted(names, key=lambda n: int(n[4:])):
        ctrl = base / name
        try:
            entries = os.listdir(ctrl)
        except OSError:
            entries = []
        namespaces = sorted(
            {f"nvme{m.group(1)}n{m.group(2)}" for e in entries if (m := _NAMESPACE.match(e))}
        )
        out.append(
            NvmeController(
                name=name,
                model=" ".join((read_text(ctrl / "model") or "").split()),
                serial=(read_text(ctrl / "serial") or "").strip(),
                firmware=(read_text(ctrl / "firmware_rev") or "").strip(),
                namespaces=tuple(namespaces),
            )
        )
    return out


def _unescape(field: str) -> str:
    """Mount table fields escape space, tab, newline and backslash as octal (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def controllers_holding(paths: list[str], proc_root: Path = Path("/proc")) -> dict[str, str]:
    """Which NVMe controller holds each of ``paths`` (path -> ``nvmeN``), by the mount table;
    a path on anything else (tmpfs, NFS, a RAID or LVM device) is left out."""
    table = read_text(proc_root / "self/mounts") or ""
    mounts: list[tuple[str, str]] = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            mounts.append((_unescape(fields[1]), _unescape(fields[0])))
    out: dict[str, str] = {}
    for path in paths:
        target = os.path.normpath(os.path.abspath(path))
        best = None
        for point, device in mounts:
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) >= len(best[0])):
                best = (point, device)
        if best is None:
            continue
        match = _BLOCK.match(os.path.basename(best[1]))
        if match:
            out[path] = f"nvme{match.group(1)}"
    return out


def read_nvme_functions(sys_root: Path = Path("/sys")) -> dict[str, str]:
    """PCI function -> NVMe controller name, from ``/sys/class/nvme/<nvmeN>/device``."""
    base = sys_root / NVME_CLASS
    out: dict[str, str] = {}
    try:
        names = sorted(n for n in os.listdir(base) if CONTROLLER.match(n))
    except OSError:
        return out
    for name in names:
        try:
            target = os.path.basename(os.path.realpath(base / name / "device"))
            out[normalise_bus_id(target)] = name
        except (OSError, ValueError):
            continue
    return out
