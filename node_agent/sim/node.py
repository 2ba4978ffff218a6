"""A scenario's stand-in node, built in one place: its GPUs, kernel log, ports and compute.

:func:`open_stand_in` is what ``open_environment(config, simulate=path)`` calls; it returns a
:class:`node_agent.node.Node` like this host's, whose parts answer from the scenario:

- **GPUs**: a captured node (``node-agent capture``, docs/capture.md) replays its recorded
  NVML through the real NVML backend (:mod:`node_agent.gpu.replay`); any other scenario is the
  model of its SKU (:mod:`node_agent.sim.gpu_model`), faults injected where NVML answers.
- **Kernel log**: the model's lines (boot records, one NVRM line per ``xid`` fault, the
  ``kernel_log`` faults), or the capture's.
- **Ports** (:func:`stand_in_ports`): the host, HCAs, pstore and machine checks written for
  each check from the scenario (:mod:`node_agent.sim.host_tools`, :mod:`node_agent.sim.tools`),
  compute on CPU stand-ins with modelled figures (:class:`ScenarioCompute`).

A fault that names a part the stand-in lacks (a DIMM, an NVMe controller, a power supply) is
refused here, when the node opens (ConfigError, exit 2), so no check ever meets it.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from node_agent.checking.ports import (
    CAPTURE_HOST_UNRECORDED,
    CAPTURE_PSTORE_UNRECORDED,
    STAND_IN_NO_DCGM,
    DeclaredHost,
    Ports,
    PstoreView,
    RdmaView,
    StandInSoftware,
)
from node_agent.compute.copy_model import CopyModel, copy_model
from node_agent.compute.devices import (
    ComputeSource,
    ComputeSpec,
    ComputeUnavailable,
    sim_sm_count,
    sim_tflops_for,
)
from node_agent.gpu.base import GpuBackend, StandInBackend
from node_agent.hardware.sku import Sku
from node_agent.host.paths import HostPaths
from node_agent.kernel_log import KernelLog, LinesKernelLog, UnavailableKernelLog
from node_agent.node import Node
from node_agent.sim import host_tools
from node_agent.sim import tools as sim_tools
from node_agent.sim.scenario import Scenario, load_scenario
from node_agent.suite import STAND_IN_OVERLAY
from node_agent.yamlfile import ConfigError


@dataclass(frozen=True)
class ScenarioCompute:
    """The stand-in's compute (:class:`node_agent.compute.devices.StandInCompute`): a CPU
    device per GPU carrying the scenario's ``slow`` and ``sdc`` faults, and copy rates modelled
    from the SKU and its ``pcie_width`` faults (:mod:`node_agent.compute.copy_model`)."""

    scenario: Scenario
    sku: Sku | None

    def specs(self, gpu_indices: list[int]) -> list[ComputeSpec]:
        """One CPU stand-in spec per GPU; ComputeUnavailable when an ``sdc`` fault names an SM
        the simulated GPU does not have."""
        sms = sim_sm_count(self.sku)
        return [self._spec(index, sms) for index in gpu_indices]

    def _spec(self, index: int, sms: int) -> ComputeSpec:
        slow = self.scenario.faults_on(index, "slow")
        sdc = self.scenario.faults_on(index, "sdc")
        sm = sdc[0].params.get("sm") if sdc else None
        if sm is not None and sm >= sms and self.sku is not None:
            raise ComputeUnavailable(
                f"{self.scenario.source}: the sdc fault on gpu {index} names sm {sm}, but a "
                f"simulated {self.sku.id} has {sms} SMs (0..{sms - 1}, the SKU file's "
                "sm_count); fix the scenario's 'sm'"
            )
        return ComputeSpec(
            index,
            simulated=True,
            slow_factor=float(slow[0].params["factor"]) if slow else 1.0,
            corrupt=bool(sdc),
            sdc_sm=sm,
            sdc_rate=float(sdc[0].params.get("rate", 1.0)) if sdc else 1.0,
            sm_count=sms,
            sim_tflops=sim_tflops_for(self.sku),
        )

    def copy_models(self, specs: Sequence[ComputeSpec]) -> dict[int, CopyModel]:
        """Modelled copy rates of the simulated specs, by GPU index: the link the model
        reports (the SKU's, narrowed by a ``pcie_width`` fault), times the ``slow`` factor."""
        out = {}
        for s in specs:
            if s.simulated:
                narrowed = self.scenario.faults_on(s.index, "pcie_width")
                lanes = int(narrowed[0].params["lanes"]) if narrowed else None
                out[s.index] = copy_model(s.index, s.slow_factor, self.sku, lanes)
        return out


def stand_in_ports(scenario: Scenario, sku: Sku | None, backend: GpuBackend) -> Ports:
    """The ports of a scenario's stand-in node: its host, HCAs, pstore and kernel records
    written for each check from the scenario, compute on CPU stand-ins with modelled figures.

    A captured node (a recorded host replayed, docs/capture.md) replays its GPUs and PCI bus;
    what the capture did not record (host hardware, pstore, most software) is a skip."""
    captured = scenario.captured
    hint = backend.load_hint if isinstance(backend, StandInBackend) else Ports().load_hint
    return Ports(
        host_tree=lambda parts: _host_tree(scenario, sku, parts),
        host_unrecorded=CAPTURE_HOST_UNRECORDED if captured else None,
        rdma_tree=lambda now: _rdma_tree(scenario, sku, now),
        dcgm_absent=STAND_IN_NO_DCGM,
        compute=ComputeSource(stand_in=ScenarioCompute(scenario, sku)),
        declared_host=DeclaredHost(
            memory_gib=host_tools.expected_memory_gib(),
            cpus=host_tools.CPUS,
            declared_by="the stand-in host",
        ),
        extra_kernel_records=lambda start_seq: host_tools.mce_records(scenario, start_seq),
        rasdaemon=False,  # a stand-in's machine checks are its kernel log's (the mce fault)
        pstore_tree=lambda: _pstore_tree(scenario),
        pstore_unrecorded=CAPTURE_PSTORE_UNRECORDED if captured else None,
        software=StandInSoftware(
            values=host_tools.software_facts(scenario),
            hcas=tuple(scenario.hcas),
            virtualized=scenario.virtualization != "none",
        ),
        gpu_count_from="capture" if captured else "scenario",
        pci_bus=lambda: sim_tools.stand_in_pci_bus(scenario, sku),
        bus_ids_as_printed="bus ids taken as printed (a stand-in node)",
        load_hint=hint,
    )


@contextlib.contextmanager
def _host_tree(scenario: Scenario, sku: Sku | None, parts: tuple[str, ...]) -> Iterator[HostPaths]:
    with tempfile.TemporaryDirectory(prefix="node-agent-stand-in-host-") as tmp:
        yield host_tools.build(scenario, sku, Path(tmp), parts)


@contextlib.contextmanager
def _rdma_tree(scenario: Scenario, sku: Sku | None, now: float) -> Iterator[RdmaView]:
    if not scenario.hcas:
        yield RdmaView(
            sysfs_root=Path("/nonexistent"),
            absent="no RDMA device: the stand-in node's scenario lists no hcas",
        )
        return
    with tempfile.TemporaryDirectory(prefix="node-agent-stand-in-rdma-") as tmp:
        built = sim_tools.rdma_tools(scenario, sku, Path(tmp), now=now)
        yield RdmaView(
            sysfs_root=built.sysfs_root,
            ib_write_bw=str(built.ib_write_bw),
            uptime_s=built.uptime_s,
        )


@contextlib.contextmanager
def _pstore_tree(scenario: Scenario) -> Iterator[PstoreView]:
    with tempfile.TemporaryDirectory(prefix="node-agent-stand-in-pstore-") as tmp:
        host_tools.write_pstore(scenario, Path(tmp))
        yield PstoreView(roots=(Path(tmp),), label="the stand-in's pstore")


class StandInReset:
    """A stand-in GPU's reset: nothing to reset, the scenario's faults persist."""

    def reset(self, index: int) -> str:
        return (
            f"simulated GPU reset of gpu:{index} (stand-in: the simulator's injected "
            "faults persist, so the re-test sees them again)"
        )


def open_gpus(scenario: Scenario, sku: Sku | None, call_timeout_s: float = 10.0) -> StandInBackend:
    """A scenario's GPUs: a capture's recorded NVML replayed through the real NVML backend, or
    the model of its SKU."""
    if scenario.nvml is not None:
        from node_agent.gpu.replay import open_replay

        return open_replay(
            scenario.nvml, scenario.kernel_log, scenario.source, call_timeout_s=call_timeout_s
        )
    from node_agent.sim.gpu_model import SimGpuBackend

    if sku is None:
        raise ValueError("a scenario's node needs its SKU")
    return SimGpuBackend(scenario, sku)


def _kernel_log(scenario: Scenario, lines: list[str]) -> KernelLog:
    """A scenario's kernel log; for a capture that holds none because none could be read (a
    conversion from nvidia-smi, a host whose kmsg was not readable: ``capture.kernel_log.
    unavailable``), a log that says so, so the checks that read it skip with that reason
    instead of reading an empty log as a clean one. Lines a fault adds are read as given."""
    missing = ((scenario.capture or {}).get("kernel_log") or {}) if scenario.captured else {}
    if not lines and isinstance(missing, dict) and missing.get("unavailable"):
        return UnavailableKernelLog(f"the capture holds no kernel log: {missing['unavailable']}")
    return LinesKernelLog(lines, source="simulated kernel log")


def _refuse_missing_parts(scenario: Scenario) -> None:
    """ConfigError naming the first fault on a part the simulated host lacks."""
    missing = host_tools.missing_parts(scenario)
    if missing:
        raise ConfigError(
            f"{scenario.source}: {missing[0]}; name one of its parts or remove the fault"
        )


def stand_in_hostname(path: str, skus: dict[str, Sku]) -> str:
    """The host name a scenario file gives its node (ConfigError when it does not load)."""
    return str(load_scenario(path, skus).hostname)


def open_stand_in(
    path: str, skus: dict[str, Sku], configured_sku: str, call_timeout_s: float = 10.0
) -> Node:
    """The stand-in node the scenario file at ``path`` describes; ConfigError (exit 2) when
    the file is invalid or a fault names a part the stand-in lacks. A captured node is matched
    to its SKU as the recorded host was (``configured_sku``: ``node.sku``, else auto)."""
    scenario = load_scenario(path, skus)
    _refuse_missing_parts(scenario)
    gpus = open_gpus(scenario, skus[scenario.sku], call_timeout_s)
    slow = [f for f in scenario.faults if f.kind == "slow_link"]
    return Node(
        gpu=gpus,
        kernel_log=_kernel_log(scenario, gpus.kernel_log_lines()),
        ports_for=lambda sku: stand_in_ports(scenario, sku, gpus),
        hostname=scenario.hostname,
        sku_setting=configured_sku if scenario.captured else scenario.sku,
        # a modelled node's count is its own; a capture's is not
        declared_gpus=None if scenario.captured else scenario.gpus,
        stand_in=True,
        boot_time=time.time(),  # a stand-in node has just booted: its faults persist
        gpu_reset=StandInReset(),
        param_overlay=STAND_IN_OVERLAY,
        inter_node_speed=float(slow[0].params["factor"]) if slow else 1.0,
    )
