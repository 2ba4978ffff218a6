"""Simulation scenarios (``--simulate scenario.yaml``): a node and the faults injected into it.

Faults sit at the hardware boundary (what NVML reports, what the kernel log prints, what a
compute device returns); everything above it is the agent's real code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.gpu.base import (
    FABRIC_HEALTH_FLAGS,
    RECOVERY_ACTIONS,
    SRAM_UNITS,
    THROTTLE_REASONS,
    VIRTUALIZATION_MODES,
)
from node_agent.gpu.replay import RESERVED_KEYS
from node_agent.yamlfile import ConfigError, load_yaml

_GPU = {"type": "integer", "minimum": 0}
_HCA_NAME = r"^[A-Za-z0-9_]+$"
_HCA = {"type": "string", "pattern": _HCA_NAME}
_DRIVER_NAME = r"^[A-Za-z0-9_.-]+$"
#: ``driver:`` values that are not a version: the NVIDIA kernel module is not loaded (NVML
#: answers NVML_ERROR_DRIVER_NOT_LOADED: a kernel update without the DKMS build), or no
#: user-space driver is installed (libnvidia-ml.so.1 not found). The GPUs stay on the PCI bus.
DRIVER_DOWN_STATES = ("not_loaded", "not_installed")
#: fault kinds a capture takes on top of its recording: those acting outside NVML (a capture
#: replays NVML as recorded; to change what NVML says, edit the recorded value)
CAPTURE_FAULT_KINDS = frozenset(
    {
        "kernel_log",
        "slow",
        "slow_link",
        "sdc",
        "hca_port_down",
        "hca_rate",
        "hca_slow",
        "hca_flap",
        "hca_errors",
        "software",
        "mce",
        "pstore_panic",
    }
)
_HEX = r"^0x[0-9a-fA-F]+$"
_BDF = {"type": "string", "pattern": r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$"}
#: one recorded NVML answer (docs/capture.md): a value, several (a key NVML repeats, e.g.
#: ``process``), or the NVML error the call returned
_NVML_SCALAR = {"type": ["string", "integer", "number", "boolean"]}
_NVML_VALUE = {
    "anyOf": [
        _NVML_SCALAR,
        {"type": "array", "items": _NVML_SCALAR},
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["error"],
            "properties": {"error": {"type": "string"}, "code": {"type": "integer"}},
        },
    ]
}
_NVML_KEYS = {
    "type": "object",
    "propertyNames": {"pattern": r"^[A-Za-z0-9_.]{1,63}$", "not": {"enum": list(RESERVED_KEYS)}},
    "additionalProperties": _NVML_VALUE,
}


#: The error counters a simulated port has, zero unless an ``hca_errors`` fault says otherwise:
#: ``counters/`` (IBTA PortCounters, drivers/infiniband/core/sysfs.c) and mlx5's
#: ``hw_counters/``, as the stand-in's sysfs tree writes them (:mod:`node_agent.sim.tools`).
PORT_COUNTERS = (
    "link_downed",
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "excessive_buffer_overrun_errors",
    "local_link_integrity_errors",
    "port_xmit_discards",
)
HW_COUNTERS = ("local_ack_timeout_err", "rnr_nak_retry_err")


def _fault(
    kind: str, props: dict[str, Any], required: tuple[str, ...] = ("gpu",)
) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", *required],
        "properties": {"kind": {"const": kind}, "gpu": _GPU, **props},
    }


def _hca_fault(
    kind: str, props: dict[str, Any], required: tuple[str, ...] = ("hca",)
) -> dict[str, Any]:
    """A fault on an RDMA device named in the scenario's ``hcas`` (key ``hca``, not ``gpu``)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", *required],
        "properties": {"kind": {"const": kind}, "hca": _HCA, **props},
    }


#: every fault kind and its fields; "slow" and "sdc" act at the compute boundary
FAULT_SCHEMAS: dict[str, dict[str, Any]] = {
    "xid": _fault("xid", {"code": {"type": "integer", "minimum": 1}}, ("gpu", "code")),
    "row_remap_pending": _fault("row_remap_pending", {}),
    "row_remap_failure": _fault("row_remap_failure", {}),
    "ecc_dbe_volatile": _fault("ecc_dbe_volatile", {"count": {"type": "integer", "minimum": 1}}),
    "ecc_sbe_volatile": _fault("ecc_sbe_volatile", {"count": {"type": "integer", "minimum": 1}}),
    # uncorrectable SRAM errors over the GPU's life (nvmlDeviceGetSramEccErrorStatus), in one
    # unit (default l2), and the driver's flag that they meet NVIDIA's RMA threshold
    "ecc_sram_uncorrectable": _fault(
        "ecc_sram_uncorrectable",
        {"count": {"type": "integer", "minimum": 1}, "unit": {"enum": list(SRAM_UNITS)}},
    ),
    "sram_threshold_exceeded": _fault("sram_threshold_exceeded", {}),
    # NVML reports this memory.total (MiB) for the GPU instead of its SKU's
    "memory_total": _fault(
        "memory_total", {"mib": {"type": "integer", "minimum": 1}}, ("gpu", "mib")
    ),
    # gone from the PCI bus and from NVML (fell off the bus before the driver loaded)
    "missing_gpu": _fault("missing_gpu", {}),
    # on the PCI bus, not enumerated by NVML (the driver failed to initialise it); ``driver``:
    # the kernel driver bound to it (default none; vfio-pci or pci-stub: handed to a VM)
    "pci_only": _fault("pci_only", {"driver": {"type": "string", "pattern": _DRIVER_NAME}}),
    # a raw kernel-log line; ``{bus}`` becomes GPU ``gpu``'s bus id in the kernel's form
    # (0000:ab:00); ``gpu`` may be left out for node-level lines (SXids, fabric manager)
    "kernel_log": _fault("kernel_log", {"line": {"type": "string", "minLength": 1}}, ("line",)),
    "gpu_lost": _fault("gpu_lost", {}),
    "temperature": _fault("temperature", {"celsius": {"type": "number"}}, ("gpu", "celsius")),
    "pcie_width": _fault(
        "pcie_width", {"lanes": {"type": "integer", "minimum": 1}}, ("gpu", "lanes")
    ),
    "throttle": _fault(
        "throttle",
        {"reasons": {"type": "array", "minItems": 1, "items": {"enum": list(THROTTLE_REASONS)}}},
        ("gpu", "reasons"),
    ),
    "nvlink_down": _fault(
        "nvlink_down", {"link": {"type": "integer", "minimum": 0}}, ("gpu", "link")
    ),
    # the NVLink fabric (nvmlDeviceGetGpuFabricInfoV) of a SKU whose nvlink.fabric says it
    # has one: the health mask says ``mask`` (default degraded_bandwidth) is TRUE
    "fabric_degraded": _fault(
        "fabric_degraded",
        {
            "mask": {
                "type": "array",
                "minItems": 1,
                "uniqueItems": True,
                "items": {"enum": [name for name, _ in FABRIC_HEALTH_FLAGS]},
            }
        },
    ),
    # the GPU's registration with the fabric manager never completed (default in_progress)
    # or completed with an error status (``status``: an nvmlReturn_t code)
    "fabric_incomplete": _fault(
        "fabric_incomplete",
        {
            "state": {"enum": ["not_started", "in_progress", "completed"]},
            "status": {"type": "integer", "minimum": 1},
        },
    ),
    # the GPU reports another clique than the tray's (``clique``, default the tray's + 1)
    "wrong_clique": _fault("wrong_clique", {"clique": {"type": "integer", "minimum": 0}}),
    "recovery_action": _fault(
        "recovery_action", {"action": {"enum": list(RECOVERY_ACTIONS)}}, ("gpu", "action")
    ),
    "persistence_off": _fault("persistence_off", {}),
    "driver_hang": _fault("driver_hang", {}),
    "slow": _fault(
        "slow",
        {"factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        ("gpu", "factor"),
    ),
    # one defective SM (``sm``, default: every SM) corrupting a share ``rate`` of the tiles it
    # computes (default 1.0: every time); see docs/sdc.md
    "sdc": _fault(
        "sdc",
        {
            "sm": {"type": "integer", "minimum": 0},
            "rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
    ),
    # a kernel spinning on a peer that never arrives (hung collective): busy, but no work done
    "spin": _fault("spin", {}),
    # the node's inter-node transfers take 1/factor as long (a degraded NIC or cable): acts on
    # stop-check's transfers between nodes (node_agent.stopcheck.phases), the node as a whole
    "slow_link": _fault(
        "slow_link",
        {"factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        ("factor",),
    ),
    # a counter that moves over simulated days (docs/trends.md): the GPU's ``counter`` reads
    # values[0] at its first read, values[1] at the next, ...; the last value stays. ``every_h``
    # is the simulated hours between values (what a test or bench advances its clock by between
    # reads); ``link`` names the NVLink of an nvlink_* counter (default 0; nvlink_effective and
    # nvlink_symbol: NVLink 5's effective and symbol error counts)
    "counter_series": _fault(
        "counter_series",
        {
            "counter": {
                "enum": [
                    "ecc_sbe_volatile",
                    "ecc_sram_uncorrectable",
                    "pcie_replay",
                    "remapped_rows_uncorrectable",
                    "remapped_rows_correctable",
                    "nvlink_replay",
                    "nvlink_recovery",
                    "nvlink_crc",
                    "nvlink_effective",
                    "nvlink_symbol",
                ]
            },
            "values": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            "every_h": {"type": "number", "exclusiveMinimum": 0},
            "link": {"type": "integer", "minimum": 0},
        },
        ("gpu", "counter", "values"),
    ),
    # an HCA port's error counter grows at ``per_hour`` since the simulated node booted
    # (node_agent.sim.tools: an hour before the scenario file was written), so it moves
    # between runs; link_downed growth is down-up cycles (flaps) to the hca_ports check
    "hca_errors": _hca_fault(
        "hca_errors",
        {
            "counter": {"enum": [*PORT_COUNTERS, *HW_COUNTERS]},
            "per_hour": {"type": "number", "exclusiveMinimum": 0},
        },
        ("hca", "counter", "per_hour"),
    ),
    # the kernel's distress (checks/kernel_distress.py): ``count`` machine checks in the kernel
    # log, corrected (the bank records and "Machine check events logged") or, with ``fatal``,
    # the exception, "Processor context corrupt" and the panic line; ``pstore_panic``: panics
    # kept in pstore from before this boot (``count``, default 1)
    "mce": _fault(
        "mce",
        {"count": {"type": "integer", "minimum": 1}, "fatal": {"type": "boolean"}},
        ("count",),
    ),
    "pstore_panic": _fault("pstore_panic", {"count": {"type": "integer", "minimum": 1}}, ()),
    # the simulated node's software where it differs from this host's or from a healthy node
    # (checks/software_drift.py): NCCL and kernel versions; nvidia_peermem loaded and
    # nvidia-fabricmanager running (default true); ``acs``: bridges above GPUs/HCAs with PCIe
    # ACS on (default none)
    "software": _fault(
        "software",
        {
            "nccl": {"type": "string", "minLength": 1},
            "kernel": {"type": "string", "minLength": 1},
            "peermem": {"type": "boolean"},
            "fabricmanager": {"type": "boolean"},
            "acs": {"type": "array", "items": _BDF},
        },
        (),
    ),
    # the host (node_agent.sim.host_tools builds EDAC, memory blocks, CPUs, the PCI tree's AER
    # counters and the nvme/ipmitool stand-ins from these; docs/host_checks.md): errors on a
    # DIMM named by its label (CPU0_DIMM_A1 ... CPU1_DIMM_H2); memory gone; CPU 0's thermal
    # throttle counters; AER errors on a GPU's or an HCA's function (``bridge``: on the bridge
    # directly upstream of it); an NVMe drive's critical-warning byte (default 0x04); a PSU
    # (PS1..PS6) asserting "Failure detected"
    "edac_ue": _fault(
        "edac_ue",
        {
            "dimm": {"type": "string", "pattern": r"^[A-Za-z0-9_#.+-]{1,64}$"},
            "count": {"type": "integer", "minimum": 1},
        },
        ("dimm",),
    ),
    "edac_ce": _fault(
        "edac_ce",
        {
            "dimm": {"type": "string", "pattern": r"^[A-Za-z0-9_#.+-]{1,64}$"},
            "count": {"type": "integer", "minimum": 1},
        },
        ("dimm", "count"),
    ),
    "memory_missing": _fault(
        "memory_missing", {"gib": {"type": "number", "exclusiveMinimum": 0}}, ("gib",)
    ),
    "cpu_throttle": _fault(
        "cpu_throttle", {"count": {"type": "integer", "minimum": 1}}, ("count",)
    ),
    "aer": {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "severity"],
        "oneOf": [{"required": ["gpu"]}, {"required": ["hca"]}],
        "properties": {
            "kind": {"const": "aer"},
            "gpu": _GPU,
            "hca": _HCA,
            "severity": {"enum": ["fatal", "nonfatal", "correctable"]},
            "count": {"type": "integer", "minimum": 1},
            "bridge": {"type": "boolean"},
        },
    },
    "nvme_critical_warning": _fault(
        "nvme_critical_warning",
        {
            "disk": {"type": "string", "pattern": r"^nvme[0-9]+$"},
            "warning": {"type": "integer", "minimum": 1, "maximum": 255},
        },
        ("disk",),
    ),
    "psu_failed": _fault(
        "psu_failed", {"psu": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,32}$"}}, ("psu",)
    ),
    # RDMA (node_agent.sim.tools builds the HCAs' sysfs and an ib_write_bw stand-in from these)
    "hca_port_down": _hca_fault("hca_port_down", {}),
    "hca_rate": _hca_fault(
        "hca_rate", {"gbps": {"type": "number", "exclusiveMinimum": 0}}, ("hca", "gbps")
    ),
    "hca_slow": _hca_fault(
        "hca_slow",
        {"factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        ("hca", "factor"),
    ),
    "hca_flap": _hca_fault(
        "hca_flap", {"count": {"type": "integer", "minimum": 1}}, ("hca", "count")
    ),
}

SCENARIO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["sku"],
    "properties": {
        "sku": {"type": "string"},
        "gpus": {"type": "integer", "minimum": 0, "maximum": 64},
        "hostname": {"type": "string"},
        "driver": {"type": "string", "minLength": 1},  # a version, or a DRIVER_DOWN_STATES
        "cuda": {"type": "string"},
        "hcas": {"type": "array", "items": _HCA, "uniqueItems": True},
        # what the simulated NVML lists as compute processes (nvmlDeviceGetComputeRunningProcesses)
        "compute_processes": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["gpu", "pid"],
                "properties": {
                    "gpu": _GPU,
                    "pid": {"type": "integer", "minimum": 1},
                    "used_memory_mib": {"type": "integer", "minimum": 0},
                },
            },
        },
        # bare metal unless said (nvmlDeviceGetVirtualizationMode of every simulated GPU)
        "virtualization": {"enum": list(VIRTUALIZATION_MODES)},
        # the NVLink domain of a SKU with a multi-node fabric (nvlink.fabric: multi_node):
        # the ClusterUUID and CliqueID its GPUs report (default: from the hostname, clique 1)
        "nvlink_domain": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "cluster_uuid": {
                    "type": "string",
                    "pattern": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                },
                "clique_id": {"type": "integer", "minimum": 0, "maximum": 4294967295},
            },
        },
        # -- a captured node (node-agent capture; docs/capture.md) --
        # where, when and how it was captured, or what it was converted from
        "capture": {"type": "object"},
        # NVML call by call: the stand-in library's state keys, each with its value or error
        "nvml": {
            "type": "object",
            "additionalProperties": False,
            "required": ["gpus"],
            "properties": {"system": _NVML_KEYS, "gpus": {"type": "array", "items": _NVML_KEYS}},
        },
        # the NVIDIA functions on the PCI bus, as sysfs showed them
        "pci": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["bdf", "vendor", "class"],
                "properties": {
                    "bdf": _BDF,
                    "vendor": {"type": "string", "pattern": _HEX},
                    "device": {"type": ["string", "null"], "pattern": _HEX},
                    "class": {"type": "string", "pattern": _HEX},
                    "driver": {"type": ["string", "null"], "pattern": _DRIVER_NAME},
                    "physfn": _BDF,
                },
            },
        },
        # the kernel log's tail, one record a line (kmsg's "prio,seq,usec,flags;" kept)
        "kernel_log": {"type": "array", "items": {"type": "string"}},
        "faults": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["kind"],
                "properties": {"kind": {"enum": sorted(FAULT_SCHEMAS)}},
                # the per-kind schema is checked after the kind is known (clearer messages)
            },
        },
    },
}


@dataclass(frozen=True)
class Fault:
    """One injected fault: on a GPU (``gpu``) or on an RDMA device (``hca``), never both."""

    kind: str
    gpu: int | None
    params: dict[str, Any]
    hca: str | None = None


@dataclass(frozen=True)
class ComputeProcess:
    """A process the simulated NVML lists on a GPU (scenario key ``compute_processes``)."""

    gpu: int
    pid: int
    used_memory_mib: int | None = None


@dataclass(frozen=True)
class Scenario:
    sku: str
    gpus: int
    source: str
    hostname: str = "sim-node"
    driver: str = "570.86.15"
    cuda: str = "12.8"
    hcas: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    compute_processes: tuple[ComputeProcess, ...] = ()
    virtualization: str = "none"
    #: ``nvlink_domain``: the ClusterUUID and CliqueID of a multi-node fabric (empty: defaults)
    nvlink_domain: dict[str, Any] = field(default_factory=dict)
    #: a captured node (docs/capture.md): its provenance, NVML as recorded (the stand-in's
    #: state keys, ``system`` and one mapping per GPU), PCI functions and kernel-log records
    capture: dict[str, Any] | None = None
    nvml: dict[str, Any] | None = None
    pci: tuple[dict[str, Any], ...] = ()
    kernel_log: tuple[str, ...] = ()

    @property
    def captured(self) -> bool:
        """A recorded node: NVML replays as recorded, not from the SKU's model."""
        return self.nvml is not None

    @property
    def driver_down(self) -> str | None:
        """``not_loaded`` / ``not_installed`` when NVML cannot load at all, else None."""
        return self.driver if self.driver in DRIVER_DOWN_STATES else None

    def faults_on(self, gpu: int, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.gpu == gpu and f.kind == kind]

    def has(self, gpu: int, kind: str) -> bool:
        return bool(self.faults_on(gpu, kind))

    def processes_on(self, gpu: int) -> list[ComputeProcess]:
        return [p for p in self.compute_processes if p.gpu == gpu]

    def hca_faults(self, hca: str, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.hca == hca and f.kind == kind]


def _checked_fault(
    raw: dict[str, Any],
    where: str,
    gpus: int,
    hcas: tuple[str, ...],
    earlier: list[Fault],
    *,
    replay: bool,
) -> Fault:
    """One entry of a scenario's ``faults``, validated against the node it acts on (``gpus``,
    ``hcas``, the faults before it; ``replay``: the scenario replays a capture's NVML);
    ConfigError naming ``where`` and the key."""
    from node_agent.yamlfile import validate

    validate(raw, FAULT_SCHEMAS[raw["kind"]], where)
    if replay and raw["kind"] not in CAPTURE_FAULT_KINDS:
        raise ConfigError(
            f"{where}: kind {raw['kind']!r} acts on NVML, which "
            "a capture replays as recorded; edit the recorded value under "
            "'nvml' instead (a capture takes only: "
            f"{', '.join(sorted(CAPTURE_FAULT_KINDS))})"
        )
    if "gpu" in raw and raw["gpu"] >= gpus:
        raise ConfigError(
            f"{where}: key 'gpu': {raw['gpu']} is out of range "
            f"for a node of {gpus} GPUs (0..{gpus - 1})"
        )
    if "hca" in raw and raw["hca"] not in hcas:
        raise ConfigError(
            f"{where}: key 'hca': {raw['hca']!r} is not one of "
            f"the scenario's hcas ({', '.join(hcas) or 'none listed'}); add it "
            "to 'hcas'"
        )
    if raw["kind"] == "kernel_log" and ("\n" in raw["line"] or "\r" in raw["line"]):
        raise ConfigError(
            f"{where}: key 'line': one kernel-log line, "
            "without line breaks; expected one kernel_log fault per line"
        )
    if raw["kind"] == "kernel_log" and "{bus}" in raw["line"] and "gpu" not in raw:
        raise ConfigError(
            f"{where}: key 'line' uses {{bus}} but the fault "
            "names no gpu; add 'gpu: N' (whose bus id replaces {bus}) or "
            "write the bus id into the line"
        )
    if raw["kind"] in ("pci_only", "missing_gpu") and any(
        f.gpu == raw["gpu"] and f.kind in ("pci_only", "missing_gpu") and f.kind != raw["kind"]
        for f in earlier
    ):
        raise ConfigError(
            f"{where}: gpu {raw['gpu']} cannot be both "
            "missing_gpu (gone from the PCI bus) and pci_only (on the bus, "
            "not in NVML); keep one"
        )
    params = {k: v for k, v in raw.items() if k not in ("kind", "gpu", "hca")}
    return Fault(kind=raw["kind"], gpu=raw.get("gpu"), params=params, hca=raw.get("hca"))


def load_scenario(path: str | Path, known_skus: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario file; ConfigError (exit 2) on any problem."""
    data = load_yaml(path, SCENARIO_SCHEMA, what="scenario file")
    source = str(path)
    if known_skus is not None and data["sku"] not in known_skus:
        raise ConfigError(
            f"{source}: key 'sku': {data['sku']!r} is not a SKU file under "
            f"graders/skus/; expected one of: {', '.join(sorted(known_skus))}"
        )
    nvml = data.get("nvml")
    gpus = data.get("gpus")
    if nvml is not None:
        recorded = len(nvml["gpus"])
        if gpus is not None and gpus != recorded:
            raise ConfigError(
                f"{source}: key 'gpus': {gpus}, but nvml.gpus records {recorded} "
                "GPUs (a capture has the GPUs NVML enumerated); drop 'gpus' or "
                "make them agree"
            )
        gpus = recorded
    if gpus is None:
        gpus = known_skus[data["sku"]].gpus_per_node if known_skus else 8
    hcas = tuple(data.get("hcas", []))
    faults: list[Fault] = []
    for i, raw in enumerate(data.get("faults") or []):
        faults.append(
            _checked_fault(
                raw, f"{source}: faults[{i}]", gpus, hcas, faults, replay=nvml is not None
            )
        )
    processes = []
    for i, raw in enumerate(data.get("compute_processes") or []):
        if raw["gpu"] >= gpus:
            raise ConfigError(
                f"{source}: compute_processes[{i}]: key 'gpu': {raw['gpu']} is out "
                f"of range for a node of {gpus} GPUs (0..{gpus - 1})"
            )
        processes.append(
            ComputeProcess(
                gpu=raw["gpu"], pid=raw["pid"], used_memory_mib=raw.get("used_memory_mib")
            )
        )
    for i, line in enumerate(data.get("kernel_log") or []):
        if "\n" in line or "\r" in line:
            raise ConfigError(
                f"{source}: kernel_log[{i}]: one kernel-log record a line, "
                "without line breaks (kmsg writes a break inside a record as "
                "\\x0a)"
            )
    optional = {
        k: data[k]
        for k in ("hostname", "driver", "cuda", "virtualization", "capture", "nvlink_domain")
        if k in data
    }
    return Scenario(
        sku=data["sku"],
        gpus=gpus,
        source=source,
        hcas=hcas,
        faults=tuple(faults),
        compute_processes=tuple(processes),
        nvml=nvml,
        pci=tuple(data.get("pci") or ()),
        kernel_log=tuple(data.get("kernel_log") or ()),
        **optional,
    )
