"""PCIe Advanced Error Reporting counters per device, and where each device sits.

Since Linux 4.19 every AER-capable function has three files under
``/sys/bus/pci/devices/<bdf>/`` (``Documentation/ABI/testing/sysfs-bus-pci-devices-aer``):
``aer_dev_correctable``, ``aer_dev_fatal`` and ``aer_dev_nonfatal``, one ``<bit name> <count>``
line per error bit (``RxErr 0``, ``BadTLP 0`` ... ``DLP 0``, ``CmpltTO 0`` ...) and a last line
``TOTAL_ERR_COR``/``TOTAL_ERR_FATAL``/``TOTAL_ERR_NONFATAL <count>``: errors the kernel received
for the device since boot. The files are absent where the kernel has no ``CONFIG_PCIEAER`` or
the firmware kept AER for itself (no OS-native control, ``_OSC``).

``/sys/bus/pci/devices/<bdf>`` links into the device tree (``/sys/devices/pci0000:00/
0000:00:01.0/0000:01:00.0``), so the directory above a device is the bridge directly upstream
of it; ``/sys/class/infiniband/<hca>/device`` links to an RDMA device's PCI function.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.gpu.pci import normalise_bus_id

PCI_DEVICES = Path("bus/pci/devices")
INFINIBAND = Path("class/infiniband")
BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
#: file -> the line holding its total
AER_FILES = {
    "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL"),
    "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
    "correctable": ("aer_dev_correctable", "TOTAL_ERR_COR"),
}


@dataclass(frozen=True)
class AerCounts:
    """One device's AER totals since boot (None: that file could not be read), and the
    nonzero error bits of each."""

    fatal: int | None
    nonfatal: int | None
    correctable: int | None
    bits: dict[str, dict[str, int]] = field(default_factory=dict)

    def get(self, severity: str) -> int | None:
        return {"fatal": self.fatal, "nonfatal": self.nonfatal, "correctable": self.correctable}[
            severity
        ]


@dataclass(frozen=True)
class PciFunction:
    bdf: str  # 0000:18:00.0
    upstream: str | None  # the bridge directly above it, None under a root complex
    aer: AerCounts | None  # None: the device has no AER files


def parse_aer_file(text: str, total_key: str) -> tuple[int, dict[str, int]]:
    """One ``aer_dev_*`` file -> (total, the nonzero bits). The ``TOTAL_*`` line is the total;
    without it (a file cut short) the bits are summed. ValueError on text that is not one.

    >>> parse_aer_file("RxErr 2\\nBadTLP 0\\nTOTAL_ERR_COR 2\\n", "TOTAL_ERR_COR")
    (2, {'RxErr': 2})
    """
    total = None
    bits: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"not an AER counter line: {line!r}")
        if parts[0] == total_key:
            total = int(parts[1])
        elif int(parts[1]):
            bits[parts[0]] = int(parts[1])
    if total is None:
        total = sum(bits.values())
    return total, bits


def _counts(device: Path) -> AerCounts | None:
    values: dict[str, int | None] = {}
    bits: dict[str, dict[str, int]] = {}
    found = False
    for severity, (name, total_key) in AER_FILES.items():
        try:
            text = (device / name).read_text()
        except FileNotFoundError:
            values[severity] = None
            continue
        except PermissionError:
            raise
        except OSError:
            values[severity] = None
            found = True
            continue
        found = True
        try:
            values[severity], nonzero = parse_aer_file(text, total_key)
        except ValueError:
            values[severity] = None
            continue
        if nonzero:
            bits[severity] = nonzero
    if not found:
        return None
    return AerCounts(
        fatal=values["fatal"],
        nonfatal=values["nonfatal"],
        correctable=values["correctable"],
        bits=bits,
    )


def read_functions(sys_root: Path = Path("/sys")) -> list[PciFunction]:
    """Every PCI function under ``sys_root`` with its upstream bridge and AER counts.
    OSError when the bus cannot be listed; PermissionError when AER files cannot be read."""
    base = sys_root / PCI_DEVICES
    out = []
    for name in sorted(os.listdir(base)):
        if not BDF.match(name):
            continue
        device = base / name
        parent = os.path.basename(os.path.dirname(os.path.realpath(device)))
        upstream = normalise_bus_id(parent) if BDF.match(parent) else None
        out.append(PciFunction(bdf=normalise_bus_id(name), upstream=upstream, aer=_counts(device)))
    return out


def read_hca_functions(sys_root: Path = Path("/sys")) -> dict[str, str]:
    """PCI function -> RDMA device name, from ``/sys/class/infiniband/<hca>/device``."""
    base = sys_root / INFINIBAND
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        try:
            target = os.path.basename(os.path.realpath(base / name / "device"))
        except OSError:
            continue
        if BDF.match(target):
            out[normalise_bus_id(target)] = name
    return out
