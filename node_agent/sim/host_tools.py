"""What a simulated node's host shows: EDAC, memory blocks, CPUs, the PCI tree's AER counters,
NVMe controllers with an ``nvme`` stand-in, and a BMC with an ``ipmitool`` stand-in.

DESIGN.md ("The simulator") puts faults at the hardware boundary. The simulated host is an
HGX-class server (the model, not a measurement of one):

* memory: two sockets, 8 channels each, 2 DIMMs per channel of 64 GiB (2,048 GiB), labelled
  ``CPU0_DIMM_A1`` ... ``CPU1_DIMM_H2``, under EDAC controllers ``mc0``/``mc1`` (reset an hour
  ago); memory blocks of 16 GiB (a real x86 host's are 2 GiB: fewer to write);
* 224 CPUs online (2 x 56 cores x 2 threads); ``thermal_throttle`` counters on the first CPU
  of each socket only (a real host has them on every CPU: fewer to write);
* the scenario's GPUs and HCAs each behind a PCIe bridge of its own (an HCA is a ConnectX card
  on bus 0x40 + 2n here), every function with AER counters at zero (``/sys/bus/pci/devices`` links into a ``/sys/devices/pci0000:00`` tree, and
  ``/sys/class/infiniband/<hca>/device`` to the HCA's function);
* two NVMe controllers, ``nvme0`` holding ``/`` and ``nvme1`` holding ``/raid``;
* six power supplies ``PS1``..``PS6`` and a redundancy sensor, as ``ipmitool sdr type "Power
  Supply"`` prints them; no Power Unit sensor, and an empty event log (``sel elist``).

Faults (``node_agent.sim.scenario``): ``edac_ue``/``edac_ce`` {dimm, count} on a DIMM's
counters, ``memory_missing`` {gib} (memory blocks and the DIMMs that held them gone),
``cpu_throttle`` {count} (CPU 0's core and package counters), ``aer`` {gpu|hca, severity,
count, bridge} (the function's, or with ``bridge: true`` its upstream bridge's, counter),
``nvme_critical_warning`` {disk, warning} (the SMART critical-warning byte, default 0x04:
reliability degraded), ``psu_failed`` {psu} ("Failure detected" asserted).

The host checks read what :func:`build` writes exactly as they read the real host; nothing here
is imported on the real-hardware path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.gpu.pci import normalise_bus_id
from node_agent.hardware.sku import Sku
from node_agent.host.paths import HostPaths, format_cpu_list
from node_agent.kernel_log import LogRecord
from node_agent.sim.gpu_model import pci_bus_id
from node_agent.sim.scenario import Fault, Scenario
from node_agent.sim.tools import simulated_pci, write_executable

GIB = 1 << 30
DIMM_GIB = 64
SOCKETS = 2
CHANNELS = "ABCDEFGH"
DIMMS_PER_CHANNEL = 2
#: larger than a real x86 host's 2 GiB blocks, to keep the simulated tree small
MEMORY_BLOCK_BYTES = 16 * GIB
CPUS = 224
PSUS = tuple(f"PS{n}" for n in range(1, 7))
NVME = {"nvme0": "/", "nvme1": "/raid"}
SECONDS_SINCE_RESET = 3600
#: the parts :func:`build` can write
PARTS = ("edac", "memory", "cpu", "pci", "nvme", "ipmi")


@dataclass(frozen=True)
class SimDimm:
    mc: int
    slot: int
    label: str


def dimms() -> list[SimDimm]:
    out = []
    for socket in range(SOCKETS):
        slot = 0
        for channel in CHANNELS:
            for n in range(1, DIMMS_PER_CHANNEL + 1):
                out.append(SimDimm(mc=socket, slot=slot, label=f"CPU{socket}_DIMM_{channel}{n}"))
                slot += 1
    return out


def expected_memory_gib() -> float:
    """What the simulated host is built with: its declared memory."""
    return float(len(dimms()) * DIMM_GIB)


def missing_parts(scenario: Scenario) -> list[str]:
    """What the scenario's faults name that the simulated host does not have (a DIMM, an NVMe
    controller, a power supply), one sentence each; empty when every named part exists. The
    node refuses such a scenario when it opens (``node_agent.sim.node``), so no check ever
    meets a fault on a part that is not there."""
    population = dimms()
    labels = {d.label for d in population}
    out = [
        f"fault {kind} names DIMM {f.params['dimm']!r}, which the simulated node does not "
        f"have (its DIMMs: {population[0].label} ... {population[-1].label})"
        for kind in ("edac_ue", "edac_ce")
        for f in _faults(scenario, kind)
        if f.params["dimm"] not in labels
    ]
    out += [
        f"fault nvme_critical_warning names disk {f.params['disk']!r}, which the simulated "
        f"node does not have (its NVMe controllers: {', '.join(NVME)})"
        for f in _faults(scenario, "nvme_critical_warning")
        if f.params["disk"] not in NVME
    ]
    out += [
        f"fault psu_failed names {f.params['psu']!r}, which the simulated node does not "
        f"have (its supplies: {', '.join(PSUS)})"
        for f in _faults(scenario, "psu_failed")
        if f.params["psu"] not in PSUS
    ]
    return out


def _faults(scenario: Scenario, kind: str) -> list[Fault]:
    return [f for f in scenario.faults if f.kind == kind]


def _missing_dimms(scenario: Scenario) -> int:
    gib = sum(float(f.params["gib"]) for f in _faults(scenario, "memory_missing"))
    return min(len(dimms()), int(gib // DIMM_GIB))


def write_edac(scenario: Scenario, sys_root: Path) -> None:
    population = dimms()
    labels = {d.label for d in population}
    counts: dict[str, dict[str, int]] = {d.label: {"ce": 0, "ue": 0} for d in population}
    for kind, key in (("edac_ue", "ue"), ("edac_ce", "ce")):
        for fault in _faults(scenario, kind):
            label = fault.params["dimm"]
            if label in labels:  # a DIMM the node lacks is refused when the node opens
                counts[label][key] += int(fault.params.get("count", 1))
    gone = {d.label for d in population[len(population) - _missing_dimms(scenario) :]}
    base = sys_root / "devices/system/edac/mc"
    for socket in range(SOCKETS):
        mc = base / f"mc{socket}"
        mine = [d for d in population if d.mc == socket and d.label not in gone]
        mc.mkdir(parents=True)
        values = {
            "mc_name": f"Intel_10nm Socket#{socket} IMC#0",
            "size_mb": len(mine) * DIMM_GIB * 1024,
            "seconds_since_reset": SECONDS_SINCE_RESET,
            "ce_count": sum(counts[d.label]["ce"] for d in mine),
            "ue_count": sum(counts[d.label]["ue"] for d in mine),
            "ce_noinfo_count": 0,
            "ue_noinfo_count": 0,
        }
        for name, value in values.items():
            (mc / name).write_text(f"{value}\n")
        for dimm in mine:
            path = mc / f"dimm{dimm.slot}"
            path.mkdir()
            for name, value in (
                ("dimm_label", dimm.label),
                ("size", DIMM_GIB * 1024),
                ("dimm_location", f"channel {dimm.slot // 2} slot {dimm.slot % 2}"),
                ("dimm_ce_count", counts[dimm.label]["ce"]),
                ("dimm_ue_count", counts[dimm.label]["ue"]),
            ):
                (path / name).write_text(f"{value}\n")


def write_memory(scenario: Scenario, sys_root: Path) -> None:
    base = sys_root / "devices/system/memory"
    base.mkdir(parents=True)
    (base / "block_size_bytes").write_text(f"{MEMORY_BLOCK_BYTES:x}\n")
    missing = sum(float(f.params["gib"]) for f in _faults(scenario, "memory_missing"))
    blocks = max(0, int((expected_memory_gib() - missing) * GIB // MEMORY_BLOCK_BYTES))
    for n in range(blocks):
        (base / f"memory{n}").mkdir()


def write_cpus(scenario: Scenario, sys_root: Path) -> None:
    base = sys_root / "devices/system/cpu"
    base.mkdir(parents=True)
    every = format_cpu_list(list(range(CPUS)))
    (base / "online").write_text(every + "\n")
    (base / "present").write_text(every + "\n")
    throttles = sum(int(f.params["count"]) for f in _faults(scenario, "cpu_throttle"))
    for cpu in range(0, CPUS, CPUS // SOCKETS):
        tt = base / f"cpu{cpu}" / "thermal_throttle"
        tt.mkdir(parents=True)
        count = throttles if cpu == 0 else 0
        (tt / "core_throttle_count").write_text(f"{count}\n")
        (tt / "package_throttle_count").write_text(f"{count}\n")


_COR_BITS = (
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
)
_UNCOR_BITS = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)
#: the error bit a simulated AER fault of each severity sets (a GPU link's typical ones)
_FAULT_BIT = {"correctable": "BadTLP", "nonfatal": "CmpltTO", "fatal": "DLP"}


def _aer_text(bits: tuple[str, ...], total: str, hit: str | None, count: int) -> str:
    lines = [f"{b} {count if b == hit else 0}" for b in bits]
    return "\n".join(lines + [f"{total} {count if hit else 0}"]) + "\n"


def write_pci(scenario: Scenario, sku: Sku | None, sys_root: Path) -> None:
    # the GPUs and NVSwitches as the simulated PCI bus has them; each HCA a card of its own
    # (as on HGX boards: one ConnectX per PCIe switch port), on bus 0x40 + 2n
    hca_bdf = {name: f"0000:{0x40 + 2 * n:02x}:00.0" for n, name in enumerate(scenario.hcas)}
    functions = [f for f in simulated_pci(scenario, sku) if f.class_code >> 8 != 0x0207]
    taken = {f.bus_id for f in functions} | set(hca_bdf.values())
    # the bridge directly upstream of each GPU and HCA: bus - 1
    upstream: dict[str, str] = {}
    for bdf in [f.bus_id for f in functions if f.class_code >> 8 in (0x0300, 0x0302)] + list(
        hca_bdf.values()
    ):
        bus = int(bdf[5:7], 16)
        bridge = f"{bdf[:4]}:{bus - 1:02x}:00.0"
        if bus > 0 and bridge not in taken:
            upstream[bdf] = bridge
            taken.add(bridge)
    # AER counts per function from the scenario
    counts: dict[str, dict[str, int]] = {}
    for fault in _faults(scenario, "aer"):
        if fault.hca is not None:
            bdf = hca_bdf[fault.hca]
        elif fault.gpu is not None:
            bdf = normalise_bus_id(pci_bus_id(fault.gpu))
        else:
            continue  # the schema gives every aer fault a gpu or an hca
        if fault.params.get("bridge"):
            bdf = upstream.get(bdf, bdf)
        severity = fault.params["severity"]
        counts.setdefault(bdf, {})[severity] = counts.get(bdf, {}).get(severity, 0) + int(
            fault.params.get("count", 1)
        )
    root = sys_root / "devices" / "pci0000:00"
    links = sys_root / "bus/pci/devices"
    links.mkdir(parents=True)
    bridges = sorted(set(upstream.values()))
    places: dict[str, Path] = {b: root / b for b in bridges}
    for bdf in [f.bus_id for f in functions] + list(hca_bdf.values()):
        parent = upstream.get(bdf)
        places[bdf] = (root / parent / bdf) if parent else root / bdf
    for bdf, path in sorted(places.items(), key=lambda item: len(item[1].parts)):
        path.mkdir(parents=True, exist_ok=True)
        mine = counts.get(bdf, {})
        for severity, (name, total, bits) in {
            "correctable": ("aer_dev_correctable", "TOTAL_ERR_COR", _COR_BITS),
            "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL", _UNCOR_BITS),
            "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL", _UNCOR_BITS),
        }.items():
            hit = _FAULT_BIT[severity] if severity in mine else None
            (path / name).write_text(_aer_text(bits, total, hit, mine.get(severity, 0)))
        os.symlink(path, links / bdf)
    ib = sys_root / "class/infiniband"
    for name, bdf in hca_bdf.items():
        (ib / name).mkdir(parents=True)
        os.symlink(places[bdf], ib / name / "device")


def _smart_log(scenario: Scenario, disk: str) -> dict[str, Any]:
    warning = 0
    for fault in _faults(scenario, "nvme_critical_warning"):
        if fault.params["disk"] == disk:
            warning |= int(fault.params.get("warning", 0x04))
    # nvme-cli 2.4+ JSON (node_agent.parsers.nvme): a healthy data-center drive, lightly worn
    return {
        "critical_warning": warning,
        "temperature": 310,
        "avail_spare": 100,
        "spare_thresh": 10,
        "percent_used": 3,
        "endurance_grp_critical_warning_summary": 0,
        "data_units_read": 91231456,
        "data_units_written": 120345678,
        "host_read_commands": 1843211456,
        "host_write_commands": 2211045678,
        "controller_busy_time": 4512,
        "power_cycles": 41,
        "power_on_hours": 8760,
        "unsafe_shutdowns": 7,
        "media_errors": 4 if warning & 0x04 else 0,
        "num_err_log_entries": 0,
        "warning_temp_time": 0,
        "critical_comp_time": 0,
    }


def write_nvme(scenario: Scenario, paths: HostPaths, bindir: Path) -> str:
    mounts = [
        "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
        "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
    ]
    for n, (name, mount) in enumerate(NVME.items()):
        ctrl = paths.sys / "class/nvme" / name
        (ctrl / f"{name}n1").mkdir(parents=True)
        (ctrl / "model").write_text("SAMSUNG MZWLR3T8HBLS-00007\n")
        (ctrl / "serial").write_text(f"S6EXNA0T70{n:04d}\n")
        (ctrl / "firmware_rev").write_text("MPPA5B5Q\n")
        paths.dev.mkdir(parents=True, exist_ok=True)
        (paths.dev / name).write_text("")
        device = f"/dev/{name}n1p2" if mount == "/" else f"/dev/{name}n1"
        mounts.append(f"{device} {mount} {'ext4' if mount == '/' else 'xfs'} rw,relatime 0 0")
    (paths.proc / "self").mkdir(parents=True, exist_ok=True)
    (paths.proc / "self/mounts").write_text("\n".join(mounts) + "\n")
    logs = {name: _smart_log(scenario, name) for name in NVME}
    tool = write_executable(bindir, "nvme", NVME_SOURCE.replace("@LOGS@", repr(json.dumps(logs))))
    return str(tool)


def write_ipmitool(scenario: Scenario, paths: HostPaths, bindir: Path) -> str:
    failed = {f.params["psu"] for f in _faults(scenario, "psu_failed")} & set(PSUS)
    paths.dev.mkdir(parents=True, exist_ok=True)
    (paths.dev / "ipmi0").write_text("")
    rows = []
    for n, psu in enumerate(PSUS, start=1):
        states = "Presence detected" + (", Failure detected" if psu in failed else "")
        rows.append(f"{psu + ' Status':<16} | {0x63 + n:02X}h | ok  | 10.{n} | {states}")
    redundancy = "Redundancy Degraded" if failed else "Fully Redundant"
    rows.append(f"{'PS Redundancy':<16} | 6Ah | ok  | 20.1 | {redundancy}")
    rows.append(f"{'PSU Power In':<16} | 6Bh | ok  | 10.1 | {1850 if not failed else 2210} Watts")
    tool = write_executable(
        bindir, "ipmitool", IPMITOOL_SOURCE.replace("@ROWS@", repr("\n".join(rows)))
    )
    return str(tool)


def build(
    scenario: Scenario, sku: Sku | None, workdir: Path, parts: tuple[str, ...] = PARTS
) -> HostPaths:
    """Write the simulated host's ``parts`` under ``workdir`` (the caller owns and removes it);
    the returned paths point the host readers at them. A fault naming a part the host
    lacks writes nothing (the node refused it when it opened: :func:`missing_parts`)."""
    paths = HostPaths(
        sys=workdir / "sys", proc=workdir / "proc", dev=workdir / "dev", stand_in=True
    )
    paths.sys.mkdir(parents=True)
    paths.proc.mkdir(parents=True)
    ipmitool = nvme = "ipmitool-not-written"
    if "edac" in parts:
        write_edac(scenario, paths.sys)
    if "memory" in parts:
        write_memory(scenario, paths.sys)
    if "cpu" in parts:
        write_cpus(scenario, paths.sys)
    if "pci" in parts:
        write_pci(scenario, sku, paths.sys)
    if "nvme" in parts:
        nvme = write_nvme(scenario, paths, workdir / "bin")
    if "ipmi" in parts:
        ipmitool = write_ipmitool(scenario, paths, workdir / "bin")
    return HostPaths(
        sys=paths.sys, proc=paths.proc, dev=paths.dev, ipmitool=ipmitool, nvme=nvme, stand_in=True
    )


NVME_SOURCE = r'''"""nvme stand-in of a simulated node (written by node_agent.sim.host_tools; not nvme-cli)."""
import json
import os
import sys

LOGS = json.loads(@LOGS@)
args = sys.argv[1:]
if len(args) >= 2 and args[0] == "smart-log":
    name = os.path.basename(args[1])
    if name not in LOGS:
        print(f"Failed to open {args[1]}: No such file or directory", file=sys.stderr)
        sys.exit(1)
    if "-o" in args and args[args.index("-o") + 1:args.index("-o") + 2] == ["json"]:
        print(json.dumps(LOGS[name], indent=2))
        sys.exit(0)
    print(f"Smart Log for NVME device:{name} namespace-id:ffffffff")
    for key, value in LOGS[name].items():
        print(f"{key:<36}: {value}")
    sys.exit(0)
print("usage: nvme <command> [<device>] [<args>]", file=sys.stderr)
sys.exit(1)
'''

IPMITOOL_SOURCE = r'''"""ipmitool stand-in of a simulated node (written by node_agent.sim.host_tools; not ipmitool)."""
import sys

ROWS = @ROWS@
args = sys.argv[1:]
if args == ["sdr", "type", "Power Supply"]:
    print(ROWS)
    sys.exit(0)
if args == ["-v", "sdr", "type", "Power Unit"]:
    sys.exit(0)  # this board's supplies report redundancy under Power Supply only
if args == ["sel", "elist"]:
    print("SEL has no entries")
    sys.exit(0)
if args == ["sel", "time", "get"]:
    print("01/01/2026 00:00:00")
    sys.exit(0)
print("Invalid command", file=sys.stderr)
sys.exit(1)
'''


# --- the kernel's records, pstore and software ---------------------------------------------------

#: a corrected memory-controller error and the Skylake-SP fatal one (status bits: VAL|EN|
#: MISCV|ADDRV and, for the fatal one, UC|PCC): the forms arch/x86/kernel/cpu/mce/core.c prints
MCE_CORRECTED = "mce: [Hardware Error]: CPU {cpu}: Machine Check: 0 Bank 7: 8c00004000010090"
MCE_FATAL = (
    "mce: [Hardware Error]: CPU {cpu}: Machine Check Exception: 5 Bank 4: be00000000800400",
    "mce: [Hardware Error]: Machine check: Processor context corrupt",
    "Kernel panic - not syncing: Fatal machine check",
)
MCE_LOGGED = "mce: [Hardware Error]: Machine check events logged"


def mce_records(scenario: Scenario, start_seq: int = 1) -> list[LogRecord]:
    """The kernel-log records the scenario's ``mce`` faults print (kmsg records of the
    kernel's facility, as /dev/kmsg gives them): ``count`` corrected bank records and the
    notice, or with ``fatal: true`` the exception, the context-corrupt line and the panic."""
    lines: list[str] = []
    for f in scenario.faults:
        if f.kind != "mce":
            continue
        count = int(f.params.get("count", 1))
        if f.params.get("fatal"):
            for _ in range(count):
                lines.extend(line.format(cpu=3) for line in MCE_FATAL)
        else:
            lines.extend(MCE_CORRECTED.format(cpu=i % 8) for i in range(count))
            lines.append(MCE_LOGGED)
    return [
        LogRecord(start_seq + i, line, boot_s=100.0 + i, facility=0) for i, line in enumerate(lines)
    ]


def write_pstore(scenario: Scenario, root: Path) -> None:
    """The scenario's ``pstore_panic`` faults as the files pstore keeps (efi backend), under
    ``root``: one dump of a soft lockup's panic per ``count``."""
    n = 0
    for f in scenario.faults:
        if f.kind != "pstore_panic":
            continue
        for _ in range(int(f.params.get("count", 1))):
            n += 1
            Path(root, f"dmesg-efi-17{n:08d}01001").write_text(
                f"Panic#{n} Part1\n<4>[ 8821.100000] watchdog: BUG: soft lockup - CPU#5 stuck "
                f"for 22s! [kworker/5:1:311]\n<0>[ 8849.200000] Kernel panic - not syncing: "
                "softlockup: hung tasks\n"
            )


def software_facts(scenario: Scenario) -> dict[str, Any]:
    """The host software the scenario declares (``software_drift``): a modelled node is healthy
    unless a ``software`` fault says otherwise; a captured node's services and bridges were not
    recorded (None: a skip), nor its kernel and NCCL unless a fault names them."""
    healthy = not scenario.captured
    out: dict[str, Any] = {
        "peermem": True if healthy else None,
        "fabricmanager": True if healthy else None,
        "acs": [] if healthy else None,
    }
    if not healthy:
        out.update({"kernel": None, "nccl": None})
    for fault in scenario.faults:
        if fault.kind == "software":
            out.update(fault.params)
    return out
