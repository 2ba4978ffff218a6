"""The PCI-bus reader (node_agent.gpu.pci) on sysfs trees laid out as the kernel lays out
/sys/bus/pci/devices (device directories reached through symlinks, a ``driver`` link, ``physfn``
on a virtual function), and its comparison with what NVML enumerates. The trees are written by
the test (no machine here has NVIDIA GPUs); one test reads this host's real sysfs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_agent.gpu.pci import (
    SYSFS_PCI_DEVICES,
    PciBus,
    PciGpu,
    compare,
    normalise_bus_id,
    read_bus,
)
from node_agent.sim.tools import SimPciDevice, write_pci_sysfs


def kernel_tree(tmp_path: Path, devices: list[tuple[str, str, str, str, str | None]]) -> Path:
    """``/sys/bus/pci/devices/<bdf>`` as symlinks into ``/sys/devices/pci0000:00/<bdf>`` (the
    kernel's layout), each with vendor, device, class and a ``driver`` link."""
    sysfs = tmp_path / "sys"
    bus_dir = sysfs / "bus" / "pci" / "devices"
    bus_dir.mkdir(parents=True)
    for bdf, vendor, device, klass, driver in devices:
        real = sysfs / "devices" / "pci0000:00" / bdf
        real.mkdir(parents=True)
        (real / "vendor").write_text(vendor + "\n")
        (real / "device").write_text(device + "\n")
        (real / "class").write_text(klass + "\n")
        if driver:
            target = sysfs / "bus" / "pci" / "drivers" / driver
            target.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(target, real), real / "driver")
        os.symlink(os.path.relpath(real, bus_dir), bus_dir / bdf)
    return bus_dir


def test_reader_keeps_display_and_3d_nvidia_functions_and_names_their_driver(tmp_path):
    root = kernel_tree(
        tmp_path,
        [
            ("0000:18:00.0", "0x10de", "0x2330", "0x030200", "nvidia"),  # H100 SXM5, 3D
            ("0000:2a:00.0", "0x10de", "0x26b9", "0x030000", None),  # VGA class, no driver
            ("0000:2a:00.1", "0x10de", "0x22ba", "0x040300", "snd_hda_intel"),  # its HDMI audio
            ("0000:05:00.0", "0x10de", "0x22a3", "0x068000", "nvidia-nvswitch"),  # NVSwitch: bridge
            ("0000:0c:00.0", "0x15b3", "0x1021", "0x020700", "mlx5_core"),  # ConnectX-7
            ("0000:ab:00.0", "0x10de", "0x2331", "0x030200", "vfio-pci"),  # handed to a VM
        ],
    )
    bus = read_bus(root)
    assert bus.unreadable is None
    assert [(g.bus_id, g.driver, g.class_code) for g in bus.gpus] == [
        ("0000:18:00.0", "nvidia", 0x030200),
        ("0000:2a:00.0", None, 0x030000),
        ("0000:ab:00.0", "vfio-pci", 0x030200),
    ]
    assert bus.gpus[0].device_id == 0x2330
    assert [g.bus_id for g in bus.host_gpus] == ["0000:18:00.0", "0000:2a:00.0"]
    assert bus.gpus[1].describe() == "0000:2a:00.0 (no driver bound)"


def test_sriov_virtual_functions_are_not_counted_again(tmp_path):
    root = write_pci_sysfs(
        (
            SimPciDevice("0000:3b:00.0", 0x10DE, 0x030200, "nvidia"),
            SimPciDevice("0000:3b:00.4", 0x10DE, 0x030200, "nvidia", physfn="0000:3b:00.0"),
        ),
        tmp_path / "devices",
    )
    assert [g.bus_id for g in read_bus(root).gpus] == ["0000:3b:00.0"]


def test_a_tree_that_cannot_be_listed_says_why_instead_of_raising(tmp_path):
    bus = read_bus(tmp_path / "no-such-dir")
    assert bus.gpus == () and "cannot list" in bus.unreadable


def test_a_device_with_unreadable_files_is_skipped_not_fatal(tmp_path):
    root = tmp_path / "devices"
    (root / "0000:18:00.0").mkdir(parents=True)  # vendor missing: removed while read
    (root / "0000:2a:00.0").mkdir()
    (root / "0000:2a:00.0" / "vendor").write_text("0x10de\n")
    (root / "0000:2a:00.0" / "class").write_text("garbage\n")
    assert read_bus(root).gpus == ()


def test_this_hosts_real_sysfs_reads_without_error():
    if not SYSFS_PCI_DEVICES.is_dir():
        pytest.skip(f"{SYSFS_PCI_DEVICES} does not exist here (no sysfs in this container)")
    bus = read_bus()
    assert bus.unreadable is None
    nvidia = sorted(
        p.name
        for p in SYSFS_PCI_DEVICES.iterdir()
        if (p / "vendor").read_text().strip() == "0x10de"
        and (p / "class").read_text().strip()[:6] in ("0x0300", "0x0302")
    )
    assert [g.bus_id for g in bus.gpus] == [normalise_bus_id(n) for n in nvidia]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML
        ("0000:3b:00.0", "0000:3b:00.0"),  # sysfs
        ("00000008:01:00.0", "0008:01:00.0"),  # Grace: a non-zero domain
        ("10000:01:00.0", "10000:01:00.0"),  # Intel VMD domains are five hex digits
    ],
)
def test_bus_ids_compare_in_one_form(text, expected):
    assert normalise_bus_id(text) == expected


@pytest.mark.parametrize("text", ["", "3b:00.0", "0000:3b:00", "zz:zz:zz.z"])
def test_text_that_is_not_a_pci_address_is_refused(text):
    with pytest.raises(ValueError):
        normalise_bus_id(text)


def _bus(*gpus: tuple[str, str | None]) -> PciBus:
    return PciBus(gpus=tuple(PciGpu(b, None, 0x030200, d) for b, d in gpus), root="t")


def test_compare_names_the_gpu_nvml_does_not_list():
    bus = _bus(("0000:18:00.0", "nvidia"), ("0000:2a:00.0", None), ("0000:ab:00.0", "vfio-pci"))
    found = compare(bus, ["00000000:18:00.0"])
    assert [g.bus_id for g in found.not_enumerated] == ["0000:2a:00.0"]
    assert [g.bus_id for g in found.passthrough] == ["0000:ab:00.0"]


def test_a_vfio_variant_driver_hands_the_gpu_to_a_vm_and_nouveau_holds_it_elsewhere():
    """nvgrace_gpu_vfio_pci (Grace Hopper/Blackwell pass-through) had read as a GPU the driver
    lost, which grades FAULT and a replacement."""
    bus = _bus(
        ("0000:18:00.0", "nvidia"),
        ("0009:01:00.0", "nvgrace_gpu_vfio_pci"),
        ("0000:2a:00.0", "nouveau"),
        ("0000:3a:00.0", None),
    )
    found = compare(bus, ["00000000:18:00.0"])
    assert [g.bus_id for g in found.passthrough] == ["0009:01:00.0"]
    assert [(g.bus_id, g.bound_elsewhere) for g in found.not_enumerated] == [
        ("0000:2a:00.0", True),
        ("0000:3a:00.0", False),
    ]


def test_compare_leaves_a_gpu_to_the_unreadable_one_nvml_lists():
    # NVML enumerates two GPUs but could not read one's identity (gpu_lost): the bus GPU
    # without a match is that one, reported as lost, not also as missing
    bus = _bus(("0000:18:00.0", "nvidia"), ("0000:2a:00.0", "nvidia"))
    assert compare(bus, ["00000000:18:00.0"], unidentified=1).not_enumerated == ()
    assert len(compare(bus, [], unidentified=1).not_enumerated) == 2
