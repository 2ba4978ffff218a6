"""NVIDIA GPUs on the PCI bus, read from sysfs: what the kernel sees, whether or not NVML works.

NVML lists only the GPUs the NVIDIA driver initialised. The PCI bus lists every GPU the
platform enumerated, so the two compared tell "no driver" from "no GPU" and name a GPU the
driver lost before it could be counted. No ``lspci``: each device under
``/sys/bus/pci/devices/<domain:bus:dev.fn>/`` has ``vendor`` (``0x10de`` for NVIDIA) and
``class`` (``0x030000`` VGA-compatible controller, ``0x030200`` 3D controller: PCI Code and ID
Assignment Specification, base class 03h display controller, sub-classes 00h and 02h), and a
``driver`` link to the kernel driver bound to it (``nvidia``, ``nouveau``, ``vfio-pci``...).
NVSwitches (class 0x0680, bridge) and a GPU's HDMI audio function (0x0403) are not GPUs;
SR-IOV virtual functions (a ``physfn`` link) are slices of a GPU already counted.

``root`` is a parameter everywhere so tests and the simulator pass a tree of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR_ID = 0x10DE
#: PCI base class 03h (display controller), sub-classes 00h (VGA-compatible) and 02h (3D)
GPU_CLASSES = (0x0300, 0x0302)
#: drivers that hold a GPU for a virtual machine: such a GPU is not the host's to use. Beside
#: these, every VFIO variant driver (a name with ``vfio``: ``nvgrace_gpu_vfio_pci`` for Grace
#: Hopper/Blackwell, ``mlx5_vfio_pci``) hands its device to a VM as vfio-pci does.
PASSTHROUGH_DRIVERS = frozenset({"vfio-pci", "pci-stub"})
#: the host's own NVIDIA driver (the proprietary and the open kernel module both bind as it)
NVIDIA_DRIVER = "nvidia"


class PciUnreadable(Exception):
    """The PCI device tree could not be listed (no sysfs in this container, permissions)."""


@dataclass(frozen=True)
class PciGpu:
    """One NVIDIA GPU function on the PCI bus."""

    bus_id: str  # sysfs form, lower case: 0000:3b:00.0
    device_id: int | None  # e.g. 0x2330 (H100 SXM5); None when unreadable
    class_code: int  # e.g. 0x030200
    driver: str | None  # the bound kernel driver, None when no driver claimed the device

    @property
    def passthrough(self) -> bool:
        """Bound to a driver that hands it to a VM: not expected in the host's NVML."""
        return self.driver is not None and (
            self.driver in PASSTHROUGH_DRIVERS or "vfio" in self.driver
        )

    @property
    def bound_elsewhere(self) -> bool:
        """Held by a driver of the host that is not NVIDIA's (``nouveau``): unusable for
        training until it is unbound, and no sign of a failed GPU."""
        return self.driver is not None and self.driver != NVIDIA_DRIVER and not self.passthrough

    def describe(self) -> str:
        """``0000:3b:00.0 (bound to nvidia)`` / ``(no driver bound)``."""
        bound = f"bound to {self.driver}" if self.driver else "no driver bound"
        return f"{self.bus_id} ({bound})"

    def to_dict(self) -> dict[str, object]:
        return {
            "bus_id": self.bus_id,
            "device_id": None if self.device_id is None else f"0x{self.device_id:04x}",
            "class": f"0x{self.class_code:06x}",
            "driver": self.driver,
        }


@dataclass(frozen=True)
class PciBus:
    """The NVIDIA GPUs found under ``root``, or why the tree could not be read."""

    gpus: tuple[PciGpu, ...]
    root: str
    unreadable: str | None = None

    @property
    def host_gpus(self) -> tuple[PciGpu, ...]:
        """The GPUs the host's NVIDIA driver should own (passed-through ones left out)."""
        return tuple(g for g in self.gpus if not g.passthrough)

    def to_dict(self) -> dict[str, object]:
        return {
            "root": self.root,
            "unreadable": self.unreadable,
            "gpus": [g.to_dict() for g in self.gpus],
        }


def normalise_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` (NVML) or ``0000:3b:00.0`` (sysfs) -> ``0000:3b:00.0``.

    Raises ValueError on text that is not a PCI address.

    >>> normalise_bus_id("00000008:01:00.0")
    '0008:01:00.0'
    """
    text = bus_id.strip().lower()
    head, dot, function = text.rpartition(".")
    parts = head.split(":") if dot else []
    if len(parts) != 3:
        raise ValueError(f"not a PCI address (domain:bus:device.function): {bus_id!r}")
    domain, bus, device = (int(p, 16) for p in parts)
    return f"{domain:04x}:{bus:02x}:{device:02x}.{int(function, 16):x}"


def _hex_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def read_bus(root: Path = SYSFS_PCI_DEVICES) -> PciBus:
    """The NVIDIA GPUs under ``root`` (a ``/sys/bus/pci/devices`` tree), in bus order.

    Never raises: a tree that cannot be listed comes back with ``unreadable`` saying why; a
    device that vanishes while being read (hot removal) is left out.
    """
    try:
        entries = sorted(os.listdir(root))
    except OSError as err:
        return PciBus(
            gpus=(), root=str(root), unreadable=f"cannot list {root}: {err.strerror or err}"
        )
    gpus = []
    for name in entries:
        device = root / name
        if _hex_file(device / "vendor") != NVIDIA_VENDOR_ID:
            continue
        class_code = _hex_file(device / "class")
        if class_code is None or class_code >> 8 not in GPU_CLASSES:
            continue
        if (device / "physfn").exists():  # an SR-IOV virtual function of a GPU listed already
            continue
        try:
            driver: str | None = os.path.basename(os.readlink(device / "driver"))
        except OSError:
            driver = None
        try:
            bus_id = normalise_bus_id(name)
        except ValueError:
            continue
        gpus.append(
            PciGpu(
                bus_id=bus_id,
                device_id=_hex_file(device / "device"),
                class_code=class_code,
                driver=driver,
            )
        )
    return PciBus(gpus=tuple(gpus), root=str(root))


def read_functions(
    root: Path = SYSFS_PCI_DEVICES, vendor: int = NVIDIA_VENDOR_ID
) -> list[dict[str, str | None]]:
    """Every PCI function of ``vendor`` under ``root`` as ``node-agent capture`` records it:
    ``bdf``, ``vendor``, ``device``, ``class`` (``0x``-hex text, as sysfs holds them), the
    bound ``driver`` (None when none) and ``physfn`` (an SR-IOV virtual function's parent).
    GPUs, NVSwitches and a GPU's audio function alike: the replayed bus is read by
    :func:`read_bus` as the real one is. Raises :class:`PciUnreadable` when ``root`` cannot be
    listed; a function that vanishes or reads oddly is kept with what could be read."""
    try:
        entries = sorted(os.listdir(root))
    except OSError as err:
        raise PciUnreadable(f"cannot list {root}: {err.strerror or err}") from err
    out: list[dict[str, str | None]] = []
    for name in entries:
        device = root / name
        if _hex_file(device / "vendor") != vendor:
            continue
        try:
            bdf = normalise_bus_id(name)
        except ValueError:
            continue
        entry: dict[str, str | None] = {"bdf": bdf, "vendor": f"0x{vendor:04x}"}
        device_id = _hex_file(device / "device")
        entry["device"] = None if device_id is None else f"0x{device_id:04x}"
        class_code = _hex_file(device / "class")
        if class_code is None:
            continue  # no class, no way to tell what it is: the reader would skip it too
        entry["class"] = f"0x{class_code:06x}"
        try:
            entry["driver"] = os.path.basename(os.readlink(device / "driver"))
        except OSError:
            entry["driver"] = None
        try:
            entry["physfn"] = normalise_bus_id(os.path.basename(os.readlink(device / "physfn")))
        except (OSError, ValueError):
            pass
        out.append(entry)
    return out


@dataclass(frozen=True)
class BusComparison:
    """The PCI bus against the GPUs NVML enumerates."""

    #: on the bus for the host's driver, but NVML does not list them
    not_enumerated: tuple[PciGpu, ...]
    #: handed to a VM (vfio-pci, pci-stub): not expected in NVML
    passthrough: tuple[PciGpu, ...]
    #: NVML lists them but their bus id could not be read (identity unreadable), so some of
    #: ``not_enumerated`` may be these
    unidentified: int


def compare(bus: PciBus, nvml_bus_ids: Iterable[str], unidentified: int = 0) -> BusComparison:
    """Which of the bus's GPUs NVML does not list. ``unidentified``: GPUs NVML enumerates
    whose bus id is unknown (their identity could not be read); when they can account for
    every missing one, nothing is reported missing (they are reported as unreadable)."""
    known = set()
    for bus_id in nvml_bus_ids:
        try:
            known.add(normalise_bus_id(bus_id))
        except ValueError:
            unidentified += 1
    missing = tuple(g for g in bus.host_gpus if g.bus_id not in known)
    if len(missing) <= unidentified:
        missing = ()
    return BusComparison(
        not_enumerated=missing,
        passthrough=tuple(g for g in bus.gpus if g.passthrough),
        unidentified=unidentified,
    )
