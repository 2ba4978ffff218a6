"""What a simulated node's PCI bus, RDMA hardware and tools show: sysfs trees and an
``ib_write_bw``.

The PCI bus (:func:`simulated_pci`, :func:`write_pci_sysfs`): a ``/sys/bus/pci/devices`` tree
with the scenario's GPUs as 3D controllers (vendor 0x10de, class 0x030200) bound to ``nvidia``
— none bound with ``driver: not_loaded``/``not_installed``, a ``pci_only`` GPU with its
``driver`` or none; a ``missing_gpu`` is not on the bus — plus devices the reader must not
count as GPUs: an NVSwitch function per two GPUs on an 8-GPU NVLink baseboard (vendor 0x10de, class
0x068000) and a ConnectX function per HCA (vendor 0x15b3, class 0x020700). Device ids are not
modelled (0x0000). :mod:`node_agent.gpu.pci` reads the tree as it reads the real one.

DESIGN.md ("The simulator") puts faults at the hardware boundary: what sysfs holds and what the
external tools print. For a scenario's ``hcas``, :func:`rdma_tools` writes, under a directory
the caller owns (and removes):

* ``sys/class/infiniband/<hca>/ports/1/{state,phys_state,rate,link_layer}``, the error
  counters of ``counters/`` (``link_downed``, ``symbol_error``, ``port_rcv_errors``,
  ``link_error_recovery``, ``excessive_buffer_overrun_errors``,
  ``local_link_integrity_errors``, ``port_xmit_discards``) and ``hw_counters/``
  (``local_ack_timeout_err``, ``rnr_nak_retry_err``) in the kernel's format (``4: ACTIVE``,
  ``5: LinkUp``, ``400 Gb/sec (4X NDR)``, ``InfiniBand``, zero counters on a healthy port), and
  each HCA's ``device`` link to its PCI function (``0000:0c:00.<n>``, as :func:`simulated_pci`
  puts it on the bus, and as the kernel-log lines of a scenario name it);
* ``bin/ib_write_bw``, a small Python script that answers like perftest's: ``--help``, and
  server and client runs that print the real tool's header and bandwidth table (the layout of
  ``tests/data/perftest/ib_write_bw_gbits.txt``, captured on ConnectX-7 NDR), in ``Gb/sec``
  with ``--report_gbits`` and ``MiB/sec`` without.

The ``rdma`` check then runs its real code on them: sysfs discovery, the subprocess, the table
parser and the grading. Faults (``node_agent.sim.scenario``): ``hca_port_down`` (DOWN/Polling, no
bandwidth test), ``hca_rate`` (the link trained at ``gbps``), ``hca_slow`` (bandwidth times
``factor``), ``hca_flap`` (``link_downed`` = ``count``: that many down-up cycles since boot),
``hca_errors`` (``counter`` grows at ``per_hour`` since boot).

The simulated node booted an hour before its scenario file was last written
(:func:`simulated_boot_time`), so its uptime, and a counter growing at ``per_hour``, advance
from one run to the next as a real node's do: the ``hca_ports`` check sees rates and new flaps
between runs. The mlx5 driver's kernel lines come through the ``kernel_log`` fault kind, with
the HCA's bus id written into the line (``mlx5_core 0000:0c:00.0: ...`` for the first HCA).

Nothing here is imported by the real-hardware path; only checks running under ``--simulate``
call it.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from node_agent.gpu.pci import NVIDIA_VENDOR_ID, PciBus, normalise_bus_id, read_bus
from node_agent.hardware.sku import Sku
from node_agent.sim.gpu_model import pci_bus_id
from node_agent.sim.scenario import HW_COUNTERS, PORT_COUNTERS, Scenario

#: InfiniBand 4X link rates (Gb/s) and the names sysfs prints after them (IBTA; kernel
#: ``ib_rate_to_mbps``): what ``/sys/class/infiniband/*/ports/*/rate`` reads.
IB_4X_RATES = {
    40: "4X QDR",
    56: "4X FDR",
    100: "4X EDR",
    200: "4X HDR",
    400: "4X NDR",
    800: "4X XDR",
}
#: ib_write_bw average / line rate on a healthy port: 388.72 Gb/s on a 400 Gb/s NDR port
#: (tests/data/perftest/ib_write_bw_gbits.txt, ConnectX-7, 64 KiB messages).
WRITE_BW_EFFICIENCY = 388.72 / 400


@dataclass(frozen=True)
class SimHca:
    """One simulated HCA's port 1 as sysfs would show it, and what ib_write_bw would measure."""

    name: str
    active: bool
    rate_gbps: float
    write_bw_gbps: float
    counters: dict[str, int] = field(default_factory=dict)
    link_layer: str = "InfiniBand"
    hw_counters: dict[str, int] = field(default_factory=dict)
    bus_id: str = ""  # its PCI function (the ``device`` link), e.g. 0000:0c:00.0

    @property
    def state(self) -> str:
        return "4: ACTIVE" if self.active else "1: DOWN"

    @property
    def phys_state(self) -> str:
        return "5: LinkUp" if self.active else "2: Polling"

    @property
    def rate_text(self) -> str:
        name = IB_4X_RATES.get(int(self.rate_gbps)) if self.rate_gbps.is_integer() else None
        return f"{self.rate_gbps:g} Gb/sec ({name or '4X'})"


@dataclass(frozen=True)
class SimRdma:
    """Where :func:`rdma_tools` put the tree and the tool."""

    sysfs_root: Path  # what the rdma check reads instead of /sys/class/infiniband
    ib_write_bw: Path
    hcas: tuple[SimHca, ...]
    uptime_s: float = 3600.0  # seconds since the simulated node booted


def healthy_rate_gbps(sku: Sku | None) -> float:
    """The line rate of the SKU's HCAs: the lowest 4X rate whose healthy ib_write_bw clears the
    SKU's ``rdma_port_gbps_min`` (H100/H200: 400 NDR; A100: 200 HDR); 400 without a minimum.

    >>> healthy_rate_gbps(None)
    400.0
    """
    minimum = sku.minimum("rdma_port_gbps_min") if sku else None
    if minimum is None:
        return 400.0
    for rate in sorted(IB_4X_RATES):
        if rate * WRITE_BW_EFFICIENCY >= minimum:
            return float(rate)
    return float(max(IB_4X_RATES))


#: the simulated node's uptime when its scenario file was written
BOOTED_BEFORE_SCENARIO_S = 3600.0


def hca_bus_id(index: int) -> str:
    """The PCI function of the scenario's ``index``-th HCA (one ConnectX function each)."""
    return f"0000:0c:00.{index}"


def simulated_boot_time(scenario: Scenario, now: float | None = None) -> float:
    """When the simulated node booted: an hour before its scenario file was last written (the
    same in every run of one scenario), or an hour ago where the file cannot be read."""
    now = time.time() if now is None else now
    try:
        written = os.stat(scenario.source).st_mtime
    except OSError:
        written = now
    return min(written, now) - BOOTED_BEFORE_SCENARIO_S


def simulated_hcas(
    scenario: Scenario, sku: Sku | None, uptime_s: float = BOOTED_BEFORE_SCENARIO_S
) -> tuple[SimHca, ...]:
    """The scenario's ``hcas`` with its RDMA faults applied, ``uptime_s`` after boot."""
    out = []
    healthy = healthy_rate_gbps(sku)
    for index, name in enumerate(scenario.hcas):
        rate = healthy
        for fault in scenario.hca_faults(name, "hca_rate"):
            rate = float(fault.params["gbps"])
        bw = rate * WRITE_BW_EFFICIENCY
        for fault in scenario.hca_faults(name, "hca_slow"):
            bw *= float(fault.params["factor"])
        counters = dict.fromkeys(PORT_COUNTERS, 0)
        hw_counters = dict.fromkeys(HW_COUNTERS, 0)
        counters["link_downed"] = sum(
            int(f.params["count"]) for f in scenario.hca_faults(name, "hca_flap")
        )
        for fault in scenario.hca_faults(name, "hca_errors"):
            into = hw_counters if fault.params["counter"] in HW_COUNTERS else counters
            into[fault.params["counter"]] += int(float(fault.params["per_hour"]) * uptime_s / 3600)
        out.append(
            SimHca(
                name=name,
                active=not scenario.hca_faults(name, "hca_port_down"),
                rate_gbps=rate,
                write_bw_gbps=round(bw, 2),
                counters=counters,
                hw_counters=hw_counters,
                bus_id=hca_bus_id(index),
            )
        )
    return tuple(out)


def write_sysfs(hcas: tuple[SimHca, ...], root: Path) -> Path:
    """``root``/<hca>/ports/1/... for each HCA, as ``/sys/class/infiniband`` lays it out."""
    root.mkdir(parents=True, exist_ok=True)
    for hca in hcas:
        port = root / hca.name / "ports" / "1"
        (port / "counters").mkdir(parents=True)
        for name, text in (
            ("state", hca.state),
            ("phys_state", hca.phys_state),
            ("rate", hca.rate_text),
            ("link_layer", hca.link_layer),
        ):
            (port / name).write_text(text + "\n")
        for name, value in hca.counters.items():
            (port / "counters" / name).write_text(f"{value}\n")
        if hca.hw_counters:
            (port / "hw_counters").mkdir()
            for name, value in hca.hw_counters.items():
                (port / "hw_counters" / name).write_text(f"{value}\n")
        if hca.bus_id:  # /sys/class/infiniband/<hca>/device -> ../../../<pci function>
            function = root.parent.parent / "devices" / hca.bus_id
            function.mkdir(parents=True, exist_ok=True)
            os.symlink(function, root / hca.name / "device")
    return root


@dataclass(frozen=True)
class SimPciDevice:
    """One PCI function as ``/sys/bus/pci/devices/<bus_id>/`` shows it."""

    bus_id: str  # 0000:18:00.0
    vendor: int
    class_code: int
    driver: str | None
    device: int = 0x0000
    physfn: str | None = None  # an SR-IOV virtual function's parent function


_MELLANOX_VENDOR_ID = 0x15B3
_GPU_CLASS = 0x030200  # 3D controller, as data-center GPUs enumerate
_NVSWITCH_CLASS = 0x068000  # bridge (other)
_INFINIBAND_CLASS = 0x020700  # network controller, InfiniBand


def simulated_pci(scenario: Scenario, sku: Sku | None = None) -> tuple[SimPciDevice, ...]:
    """The scenario's PCI functions (module docstring); a capture's, as it recorded them."""
    if scenario.captured:
        return captured_pci(scenario)
    devices = []
    for index in range(scenario.gpus):
        if scenario.has(index, "missing_gpu"):
            continue
        only = scenario.faults_on(index, "pci_only")
        if scenario.driver_down:
            driver = None
        elif only:
            driver = only[-1].params.get("driver")
        else:
            driver = "nvidia"
        devices.append(
            SimPciDevice(
                bus_id=normalise_bus_id(pci_bus_id(index)),
                vendor=NVIDIA_VENDOR_ID,
                class_code=_GPU_CLASS,
                driver=driver,
            )
        )
    links = int(sku.section("nvlink").get("links", 0)) if sku else 0
    if links and scenario.gpus >= 8:  # HGX baseboards carry their NVSwitches
        for n in range(scenario.gpus // 2):
            devices.append(
                SimPciDevice(
                    bus_id=f"0000:{0x05 + n:02x}:00.0",
                    vendor=NVIDIA_VENDOR_ID,
                    class_code=_NVSWITCH_CLASS,
                    driver=None if scenario.driver_down else "nvidia-nvswitch",
                )
            )
    devices.extend(_hca_devices(scenario))
    return tuple(devices)


def _hca_devices(scenario: Scenario) -> list[SimPciDevice]:
    """The PCI functions of the scenario's HCAs (mlx5_core bound), one per HCA."""
    return [
        SimPciDevice(
            bus_id=hca_bus_id(n),
            vendor=_MELLANOX_VENDOR_ID,
            class_code=_INFINIBAND_CLASS,
            driver="mlx5_core",
        )
        for n in range(len(scenario.hcas))
    ]


def captured_pci(scenario: Scenario) -> tuple[SimPciDevice, ...]:
    """A capture's ``pci`` entries (bdf, vendor, device, class, bound driver), as sysfs
    showed them on the captured node; the HCAs of its ``hcas`` as for any scenario."""
    devices, seen = [], set()
    for entry in scenario.pci:
        bus_id = normalise_bus_id(entry["bdf"])
        if bus_id in seen:  # sysfs has one directory per function
            continue
        seen.add(bus_id)
        device = entry.get("device")
        physfn = entry.get("physfn")
        devices.append(
            SimPciDevice(
                bus_id=bus_id,
                vendor=int(entry["vendor"], 16),
                class_code=int(entry["class"], 16),
                driver=entry.get("driver"),
                device=0 if device is None else int(device, 16),
                physfn=None if physfn is None else normalise_bus_id(physfn),
            )
        )
    devices.extend(_hca_devices(scenario))
    return tuple(devices)


def write_pci_sysfs(devices: tuple[SimPciDevice, ...], root: Path) -> Path:
    """``root``/<bus_id>/{vendor,device,class} and a ``driver`` link (and ``physfn`` for a
    virtual function), as ``/sys/bus/pci/devices`` lays them out."""
    root.mkdir(parents=True, exist_ok=True)
    drivers = root.parent / "drivers"
    for dev in devices:
        path = root / dev.bus_id
        path.mkdir()
        (path / "vendor").write_text(f"0x{dev.vendor:04x}\n")
        (path / "device").write_text(f"0x{dev.device:04x}\n")
        (path / "class").write_text(f"0x{dev.class_code:06x}\n")
        if dev.driver:
            (drivers / dev.driver).mkdir(parents=True, exist_ok=True)
            os.symlink(drivers / dev.driver, path / "driver")
        if dev.physfn:
            os.symlink(root / dev.physfn, path / "physfn")
    return root


def stand_in_pci_bus(scenario: Scenario, sku: Sku | None = None) -> PciBus:
    """The NVIDIA GPUs on the stand-in node's PCI bus: the tree :func:`write_pci_sysfs` writes
    for the scenario, read by the real reader (in a temporary directory, removed before this
    returns)."""
    with tempfile.TemporaryDirectory(prefix="node-agent-pci-") as tmp:
        tree = write_pci_sysfs(simulated_pci(scenario, sku), Path(tmp) / "devices")
        bus = read_bus(tree)
    return replace(bus, root="simulated PCI bus")


def write_executable(bindir: Path, name: str, source: str) -> Path:
    """A Python script ``bindir/name`` run by this interpreter, executable by its owner."""
    bindir.mkdir(parents=True, exist_ok=True)
    path = bindir / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def rdma_tools(
    scenario: Scenario, sku: Sku | None, workdir: Path, now: float | None = None
) -> SimRdma:
    """Write the simulated HCAs' sysfs tree and ``ib_write_bw`` under ``workdir``, as they
    read at ``now`` (Unix seconds; default: the present)."""
    now = time.time() if now is None else now
    uptime = now - simulated_boot_time(scenario, now)
    hcas = simulated_hcas(scenario, sku, uptime)
    root = write_sysfs(hcas, workdir / "sys" / "class" / "infiniband")
    figures = {
        h.name: {"active": h.active, "bw_gbps": h.write_bw_gbps, "link_layer": h.link_layer}
        for h in hcas
    }
    tool = write_executable(
        workdir / "bin",
        "ib_write_bw",
        IB_WRITE_BW_SOURCE.replace("@FIGURES@", repr(json.dumps(figures))),
    )
    return SimRdma(sysfs_root=root, ib_write_bw=tool, hcas=hcas, uptime_s=uptime)


# The stand-in. It answers at once: the duration (-D) is stated in its table, not spent.
IB_WRITE_BW_SOURCE = r'''"""ib_write_bw stand-in of a simulated node (written by node_agent.sim.tools; not perftest)."""
import json
import sys

FIGURES = json.loads(@FIGURES@)
VALUED = {"-d", "--ib-dev", "-i", "--ib-port", "-D", "--duration", "-p", "--port", "-x",
          "--gid-index", "-s", "--size", "-m", "--mtu", "-q", "--qp"}
DASHES = "-" * 87

args = sys.argv[1:]
if "-h" in args or "--help" in args:
    print("Usage:\n  ib_write_bw            start a server and wait for connection\n"
          "  ib_write_bw <host>     connect to server at <host>\n\nOptions:\n"
          "  -d, --ib-dev=<dev>  Use IB device <dev>\n"
          "  -i, --ib-port=<port>  Use port <port> of IB device (default 1)\n"
          "  -D, --duration  Run test for a customized period of seconds.\n"
          "  -p, --port=<port>  Listen on/connect to port <port> (default 18515)\n"
          "  --report_gbits  Report Max/Average BW of test in Gbit/sec (instead of MiB/sec)")
    sys.exit(0)
opts, host, i = {}, None, 0
while i < len(args):
    a = args[i]
    if a.startswith("--") and "=" in a:
        key, value = a.split("=", 1)
        opts[key] = value
    elif a in VALUED:
        opts[a] = args[i + 1] if i + 1 < len(args) else ""
        i += 1
    elif a.startswith("-"):
        opts[a] = True
    else:
        host = a
    i += 1
dev = opts.get("-d") or opts.get("--ib-dev")
if dev is None:
    dev = sorted(FIGURES)[0] if FIGURES else None
if dev not in FIGURES:
    print(f" IB device {dev} not found", file=sys.stderr)
    print(" Unable to find the Infiniband/RoCE device", file=sys.stderr)
    sys.exit(1)
fig = FIGURES[dev]
port = opts.get("-i") or opts.get("--ib-port") or "1"
if not fig["active"]:
    print(f" Port number {port} state is Down", file=sys.stderr)
    print(" Couldn't set the link layer", file=sys.stderr)
    sys.exit(1)
duration = float(opts.get("-D") or opts.get("--duration") or 5)
gbps = float(fig["bw_gbps"])
size = 65536
msg_rate_mpps = gbps * 1e9 / 8 / size / 1e6
iterations = int(msg_rate_mpps * 1e6 * duration)
if "--report_gbits" in opts:
    unit, value = "Gb/sec", gbps
else:
    unit, value = "MiB/sec", gbps * 1e9 / 8 / 1048576
link = "IB" if fig["link_layer"] == "InfiniBand" else "Ethernet"
out = []
if host is None:
    out += ["", "************************************", "* Waiting for client to connect... *",
            "************************************"]
out += [DASHES,
        "                    RDMA_Write BW Test",
        f" Dual-port       : OFF\t\tDevice         : {dev}",
        " Number of qps   : 1\t\tTransport type : IB",
        " Connection type : RC\t\tUsing SRQ      : OFF",
        " PCIe relax order: ON",
        " ibv_wr* API     : ON",
        " TX depth        : 128",
        " CQ Moderation   : 1",
        " Mtu             : 4096[B]",
        f" Link type       : {link}",
        " Max inline data : 0[B]",
        " rdma_cm QPs\t : OFF",
        " Data ex. method : Ethernet",
        DASHES,
        " local address: LID 0x17 QPN 0x0128 PSN 0x8f2e1c RKey 0x1fff00 VAddr 0x007f1c2a3b4000",
        " remote address: LID 0x17 QPN 0x0129 PSN 0x3e4c2d RKey 0x1fff01 VAddr 0x007f8a9b5c6000",
        DASHES,
        f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]",
        f" {size:<10d} {iterations:<16d} 0.00               {value:.2f} \t\t   {msg_rate_mpps:.6f}",
        DASHES]
print("\n".join(out))
'''
