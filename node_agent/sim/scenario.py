"""Simulation scenarios (``--simulate scenario.yaml``): a node and the faults injected into it.

Faults sit at the hardware boundary (what NVML reports, what the kernel log prints, what a
compute device returns); everything above it is the agent's real code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.gpu.base import RECOVERY_ACTIONS, THROTTLE_REASONS
from node_agent.yamlfile import ConfigError, load_yaml

_GPU = {"type": "integer", "minimum": 0}
_HCA_NAME = r"^[A-Za-z0-9_]+$"
_HCA = {"type": "string", "pattern": _HCA_NAME}


def _fault(kind: str, props: dict[str, Any], required: tuple[str, ...] = ("gpu",)) -> dict:
    return {
        "type": "object", "additionalProperties": False,
        "required": ["kind", *required],
        "properties": {"kind": {"const": kind}, "gpu": _GPU, **props},
    }


def _hca_fault(kind: str, props: dict[str, Any], required: tuple[str, ...] = ("hca",)) -> dict:
    """A fault on an RDMA device named in the scenario's ``hcas`` (key ``hca``, not ``gpu``)."""
    return {
        "type": "object", "additionalProperties": False,
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
    "missing_gpu": _fault("missing_gpu", {}),
    "gpu_lost": _fault("gpu_lost", {}),
    "temperature": _fault("temperature", {"celsius": {"type": "number"}}, ("gpu", "celsius")),
    "pcie_width": _fault("pcie_width", {"lanes": {"type": "integer", "minimum": 1}},
                         ("gpu", "lanes")),
    "throttle": _fault("throttle", {"reasons": {"type": "array", "minItems": 1,
                                                "items": {"enum": list(THROTTLE_REASONS)}}},
                       ("gpu", "reasons")),
    "nvlink_down": _fault("nvlink_down", {"link": {"type": "integer", "minimum": 0}},
                          ("gpu", "link")),
    "recovery_action": _fault("recovery_action", {"action": {"enum": list(RECOVERY_ACTIONS)}},
                              ("gpu", "action")),
    "persistence_off": _fault("persistence_off", {}),
    "driver_hang": _fault("driver_hang", {}),
    "slow": _fault("slow", {"factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
                   ("gpu", "factor")),
    # one defective SM (``sm``, default: every SM) corrupting a share ``rate`` of the tiles it
    # computes (default 1.0: every time); see docs/sdc.md
    "sdc": _fault("sdc", {"sm": {"type": "integer", "minimum": 0},
                          "rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}),
    # a kernel spinning on a peer that never arrives (hung collective): busy, but no work done
    "spin": _fault("spin", {}),
    # RDMA (node_agent.sim.tools builds the HCAs' sysfs and an ib_write_bw stand-in from these)
    "hca_port_down": _hca_fault("hca_port_down", {}),
    "hca_rate": _hca_fault("hca_rate", {"gbps": {"type": "number", "exclusiveMinimum": 0}},
                           ("hca", "gbps")),
    "hca_slow": _hca_fault("hca_slow", {"factor": {"type": "number", "exclusiveMinimum": 0,
                                                   "maximum": 1}}, ("hca", "factor")),
    "hca_flap": _hca_fault("hca_flap", {"count": {"type": "integer", "minimum": 1}},
                           ("hca", "count")),
}

SCENARIO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["sku"],
    "properties": {
        "sku": {"type": "string"},
        "gpus": {"type": "integer", "minimum": 0, "maximum": 64},
        "hostname": {"type": "string"},
        "driver": {"type": "string"},
        "cuda": {"type": "string"},
        "hcas": {"type": "array", "items": _HCA, "uniqueItems": True},
        # what the simulated NVML lists as compute processes (nvmlDeviceGetComputeRunningProcesses)
        "compute_processes": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["gpu", "pid"],
            "properties": {"gpu": _GPU, "pid": {"type": "integer", "minimum": 1},
                           "used_memory_mib": {"type": "integer", "minimum": 0}}}},
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

    def faults_on(self, gpu: int, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.gpu == gpu and f.kind == kind]

    def has(self, gpu: int, kind: str) -> bool:
        return bool(self.faults_on(gpu, kind))

    def processes_on(self, gpu: int) -> list[ComputeProcess]:
        return [p for p in self.compute_processes if p.gpu == gpu]

    def hca_faults(self, hca: str, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.hca == hca and f.kind == kind]


def load_scenario(path: str | Path, known_skus: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario file; ConfigError (exit 2) on any problem."""
    from node_agent.yamlfile import validate

    data = load_yaml(path, SCENARIO_SCHEMA, what="scenario file")
    source = str(path)
    if known_skus is not None and data["sku"] not in known_skus:
        raise ConfigError(f"{source}: key 'sku': {data['sku']!r} is not a SKU file under "
                          f"graders/skus/; expected one of: {', '.join(sorted(known_skus))}")
    gpus = data.get("gpus")
    if gpus is None:
        gpus = known_skus[data["sku"]].gpus_per_node if known_skus else 8
    hcas = tuple(data.get("hcas", []))
    faults = []
    for i, raw in enumerate(data.get("faults") or []):
        validate(raw, FAULT_SCHEMAS[raw["kind"]], f"{source}: faults[{i}]")
        if "gpu" in raw and raw["gpu"] >= gpus:
            raise ConfigError(f"{source}: faults[{i}]: key 'gpu': {raw['gpu']} is out of range "
                              f"for a node of {gpus} GPUs (0..{gpus - 1})")
        if "hca" in raw and raw["hca"] not in hcas:
            raise ConfigError(f"{source}: faults[{i}]: key 'hca': {raw['hca']!r} is not one of "
                              f"the scenario's hcas ({', '.join(hcas) or 'none listed'}); add it "
                              "to 'hcas'")
        params = {k: v for k, v in raw.items() if k not in ("kind", "gpu", "hca")}
        faults.append(Fault(kind=raw["kind"], gpu=raw.get("gpu"), params=params,
                            hca=raw.get("hca")))
    processes = []
    for i, raw in enumerate(data.get("compute_processes") or []):
        if raw["gpu"] >= gpus:
            raise ConfigError(f"{source}: compute_processes[{i}]: key 'gpu': {raw['gpu']} is out "
                              f"of range for a node of {gpus} GPUs (0..{gpus - 1})")
        processes.append(ComputeProcess(gpu=raw["gpu"], pid=raw["pid"],
                                        used_memory_mib=raw.get("used_memory_mib")))
    optional = {k: data[k] for k in ("hostname", "driver", "cuda") if k in data}
    return Scenario(sku=data["sku"], gpus=gpus, source=source, hcas=hcas,
                    faults=tuple(faults), compute_processes=tuple(processes), **optional)
