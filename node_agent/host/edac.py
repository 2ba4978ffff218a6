"""EDAC: the kernel's memory-controller error counters, per controller and per DIMM.

Layout (Linux ``Documentation/admin-guide/ras.rst``, "EDAC sysfs"): one directory per memory
controller, ``/sys/devices/system/edac/mc/mcN/``, with ``ce_count``/``ue_count`` (corrected and
uncorrected errors since ``seconds_since_reset``), ``ce_noinfo_count``/``ue_noinfo_count``
(errors the driver could not place on a DIMM), and below it one entry per memory module:

* ``dimmM/`` (or ``rankM/``), kernels since 3.x: ``dimm_label`` (the board's silkscreen name
  where the motherboard's labels are loaded, else e.g. ``CPU_SrcID#0_MC#0_Chan#0_DIMM#0``),
  ``dimm_location``, ``size`` (MiB), ``dimm_ce_count``, ``dimm_ue_count``;
* ``csrowM/`` on older drivers: ``ce_count``, ``ue_count``, ``size_mb`` and per channel
  ``chK_ce_count``, ``chK_dimm_label``.

No ``mc`` directory means no EDAC driver for this platform (a VM, a board without one, the
module not loaded): :func:`read_edac` says so with :class:`EdacAbsent`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.host.paths import read_int, read_text

EDAC_MC = Path("devices/system/edac/mc")
_MC = re.compile(r"^mc\d+$")
_DIMM = re.compile(r"^(dimm|rank)\d+$")
_CSROW = re.compile(r"^csrow\d+$")
_CHANNEL_CE = re.compile(r"^ch(\d+)_ce_count$")


class EdacAbsent(Exception):
    """No EDAC memory controller to read; the message says why."""


@dataclass(frozen=True)
class Dimm:
    """One memory module as EDAC shows it (a csrow on older drivers)."""

    name: str  # mc0/dimm3, mc0/csrow1
    label: str  # dimm_label, else the sysfs name
    size_mib: int | None
    ce: int | None
    ue: int | None
    location: str = ""
    channels: dict[str, int | None] = field(default_factory=dict)  # csrow: chK -> CE


@dataclass(frozen=True)
class MemoryController:
    name: str  # mc0
    ce: int | None
    ue: int | None
    ce_noinfo: int | None
    ue_noinfo: int | None
    seconds_since_reset: int | None
    dimms: tuple[Dimm, ...]


def _sorted_dirs(path: Path, pattern: re.Pattern[str]) -> list[Path]:
    names = [n for n in os.listdir(path) if pattern.match(n)]
    return [path / n for n in sorted(names, key=lambda n: int(re.sub(r"\D", "", n) or 0))]


def read_edac(sys_root: Path = Path("/sys")) -> list[MemoryController]:
    """Every EDAC memory controller under ``sys_root``; EdacAbsent when there is none,
    PermissionError when the tree cannot be read."""
    root = sys_root / EDAC_MC
    try:
        controllers = _sorted_dirs(root, _MC)
    except FileNotFoundError:
        raise EdacAbsent(
            f"{root} does not exist: no EDAC driver for this platform (a VM, or "
            "the board's EDAC module, e.g. skx_edac/i10nm_edac/amd64_edac, is not "
            "loaded)"
        ) from None
    except NotADirectoryError:
        raise EdacAbsent(f"{root} is not a directory") from None
    if not controllers:
        raise EdacAbsent(
            f"{root} lists no memory controller (the EDAC core is loaded but no "
            "platform driver registered one)"
        )
    out = []
    for mc in controllers:
        dimms = [_dimm(mc.name, d) for d in _sorted_dirs(mc, _DIMM)]
        if not dimms:
            dimms = [_csrow(mc.name, c) for c in _sorted_dirs(mc, _CSROW)]
        out.append(
            MemoryController(
                name=mc.name,
                ce=read_int(mc / "ce_count"),
                ue=read_int(mc / "ue_count"),
                ce_noinfo=read_int(mc / "ce_noinfo_count"),
                ue_noinfo=read_int(mc / "ue_noinfo_count"),
                seconds_since_reset=read_int(mc / "seconds_since_reset"),
                dimms=tuple(dimms),
            )
        )
    return out


def _dimm(mc: str, path: Path) -> Dimm:
    return Dimm(
        name=f"{mc}/{path.name}",
        label=read_text(path / "dimm_label") or "",
        size_mib=read_int(path / "size"),
        ce=read_int(path / "dimm_ce_count"),
        ue=read_int(path / "dimm_ue_count"),
        location=" ".join((read_text(path / "dimm_location") or "").split()),
    )


def _csrow(mc: str, path: Path) -> Dimm:
    channels: dict[str, int | None] = {}
    labels = []
    for name in sorted(os.listdir(path)):
        match = _CHANNEL_CE.match(name)
        if match:
            channel = f"ch{match.group(1)}"
            channels[channel] = read_int(path / name)
            label = read_text(path / f"{channel}_dimm_label")
            if label:
                labels.append(label)
    return Dimm(
        name=f"{mc}/{path.name}",
        label="+".join(labels),
        size_mib=read_int(path / "size_mb"),
        ce=read_int(path / "ce_count"),
        ue=read_int(path / "ue_count"),
        channels=channels,
    )
