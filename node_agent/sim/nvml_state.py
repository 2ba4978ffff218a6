"""Render a scenario into the state file of the stand-in NVML library (docs/nvml_fake.md).

The stand-in ``libnvidia-ml.so.1`` (``tests/nvml_fake/``, built by ``scripts/build-nvml-fake``)
answers NVML calls from a line-based state file, so the real NVML backend, loaded through the
real nvidia-ml-py, runs against a simulated node. YAML stays in Python: this module reads the
scenario with the same loader as ``--simulate`` (same validation) and writes what the GPUs
report, in NVML's own units (mW, bytes, °C, MHz, bit masks).

What a healthy GPU reports is the simulator's model (:mod:`node_agent.gpu.sim`) read through
its idle readings, so both ways of simulating show the same node; NVML-level faults become
what NVML would answer: ``missing_gpu`` and ``pci_only`` GPUs are not enumerated (NVML numbers
the others 0..n-1), ``gpu_lost`` answers NVML_ERROR_GPU_IS_LOST, ``driver_hang`` makes every
call on the GPU hang, ``xid`` is an Xid event, and with ``driver: not_loaded``/``not_installed``
``nvmlInit`` fails as on a host without a loaded driver. Per-function switches (:class:`Switch`) make a function unsupported,
absent (an older driver), fail with a code, or hang. A captured node (``node-agent capture``,
docs/capture.md) is not modelled: its recorded calls are written out as they are.

Use::

    python -m node_agent.sim.nvml_state scenario.yaml --out state.txt [--unsupported FN] ...

or point the library at the scenario itself (``NVML_FAKE_SCENARIO``): it runs this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from node_agent import atomic_file
from node_agent.gpu.base import (
    RECOVERY_ACTIONS,
    SRAM_UNITS,
    THROTTLE_REASONS,
    VIRTUALIZATION_MODES,
    GpuDevice,
    NotSupported,
)
from node_agent.gpu.replay import CaptureFormatError, capture_state_lines
from node_agent.gpu.sim import SimGpuBackend
from node_agent.hardware.sku import Sku, load_skus
from node_agent.sim.scenario import Scenario, load_scenario
from node_agent.yamlfile import ConfigError

FORMAT = "nvml-fake-state 1"

# NVML constants the state file uses (nvml.h; part of the C ABI)
_FI_DEV_MEMORY_TEMP = 82
_FI_DEV_NVLINK_LINK_COUNT = 91
_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
_NVLINK_CAP_P2P_SUPPORTED = 0
_NVLINK_CAP_VALID = 5
# nvmlEventType*: SingleBitEccError, DoubleBitEccError, PState, XidCriticalError, Clock
_EVENT_TYPES = 0x1 | 0x2 | 0x4 | 0x8 | 0x10
_ALL_CLOCK_EVENT_REASONS = (1 << len(THROTTLE_REASONS)) - 1
_MIB = 1024 * 1024
# nvmlReturn_t (nvml.h) nvmlInit answers for a scenario's ``driver: not_loaded`` (the kernel
# module is not loaded: NVML_ERROR_DRIVER_NOT_LOADED) and ``not_installed`` (what nvidia-ml-py
# raises where it cannot load libnvidia-ml.so.1: NVML_ERROR_LIBRARY_NOT_FOUND)
DRIVER_DOWN_INIT_ERRORS = {"not_loaded": 9, "not_installed": 12}
# The fault kinds this module turns into NVML answers. All others act elsewhere: compute,
# RDMA, the kernel log (``kernel_log``), the PCI bus (``pci_only``'s bus entry; the GPU itself
# is not enumerated here, as ``missing_gpu``).
NVML_FAULT_KINDS = frozenset(
    {
        "xid",
        "row_remap_pending",
        "row_remap_failure",
        "ecc_dbe_volatile",
        "ecc_sbe_volatile",
        "ecc_sram_uncorrectable",
        "sram_threshold_exceeded",
        "memory_total",
        "missing_gpu",
        "pci_only",
        "gpu_lost",
        "temperature",
        "pcie_width",
        "throttle",
        "nvlink_down",
        "recovery_action",
        "persistence_off",
        "driver_hang",
        "spin",
    }
)
_FLAG_FAULTS = ("gpu_lost", "driver_hang")  # NVML answers, not readings: rendered as switches


@dataclass(frozen=True)
class Switch:
    """Make one NVML function (or ``*``: every function) behave differently.

    ``kind``: ``unsupported`` (NVML_ERROR_NOT_SUPPORTED), ``absent`` (NVML_ERROR_FUNCTION_NOT_
    FOUND: a driver that predates it), ``error`` (return ``code``) or ``hang`` (the call does not
    return while the state says so). ``function`` is NVML's C name, with or without its ``_vN``
    suffix (``nvmlDeviceGetPciInfo`` covers ``nvmlDeviceGetPciInfo_v3``). ``gpu`` is the
    scenario's GPU index, or None for every call (system calls included).
    """

    kind: str
    function: str
    gpu: int | None = None
    code: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("unsupported", "absent", "error", "hang"):
            raise ValueError(
                f"switch kind {self.kind!r}: expected unsupported, absent, error or hang"
            )
        if (self.kind == "error") != (self.code is not None):
            raise ValueError("an 'error' switch needs a code, and only it")
        if not self.function or any(c.isspace() for c in self.function):
            raise ValueError(f"switch function {self.function!r}: one NVML function name or *")

    def line(self) -> str:
        return (
            f"error {self.function} {self.code}"
            if self.kind == "error"
            else f"{self.kind} {self.function}"
        )


def cuda_version_int(version: str) -> int:
    """``"12.8"`` -> 12080, as nvmlSystemGetCudaDriverVersion reports it (1000*major + 10*minor)."""
    major, _, minor = version.partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


def _reading(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except NotSupported:
        return None


def _device_lines(dev: GpuDevice) -> list[str]:
    """What one simulated GPU reports, as state-file lines (NVML's units)."""
    out: list[str] = []

    def put(key: str, value: Any) -> None:
        if value is not None:
            out.append(f"{key} {value}")

    ident = dev.identity()
    put("name", ident.name)
    put("uuid", ident.uuid)
    put("pci.bus_id", ident.pci_bus_id)
    put("serial", ident.serial)
    put("vbios", ident.vbios)
    if ident.memory_total_mib is not None:
        put("memory.total", ident.memory_total_mib * _MIB)
    put("temperature.gpu", _reading(dev.temperature_c))
    mem_temp = _reading(dev.memory_temperature_c)
    if mem_temp is not None:
        put(f"field.{_FI_DEV_MEMORY_TEMP}", f"uint {mem_temp}")
    thresholds = _reading(dev.temperature_thresholds)
    if thresholds is not None:
        put("temperature.threshold.shutdown", thresholds.shutdown_c)
        put("temperature.threshold.slowdown", thresholds.slowdown_c)
        put("temperature.threshold.gpu_max", thresholds.gpu_max_operating_c)
        put("temperature.threshold.mem_max", thresholds.memory_max_operating_c)
    power = _reading(dev.power)
    if power is not None:

        def mw(watts: float | None) -> int | None:
            return None if watts is None else round(watts * 1000)

        put("power.usage", mw(power.usage_w))
        put("power.enforced_limit", mw(power.enforced_limit_w))
        put("power.limit", mw(power.enforced_limit_w))
        put("power.default_limit", mw(power.default_limit_w))
    clocks = _reading(dev.clocks)
    if clocks is not None:
        put("clock.sm", clocks.sm_mhz)
        put("clock.graphics", clocks.sm_mhz)
        put("clock_max.sm", clocks.sm_max_mhz)
        put("clock_max.graphics", clocks.sm_max_mhz)
        put("clock.mem", clocks.memory_mhz)
    reasons = _reading(dev.throttle_reasons)
    if reasons is not None:
        mask = sum(1 << THROTTLE_REASONS.index(r) for r in reasons)
        put("clocks_event_reasons", f"{mask:#x}")
        put("clocks_event_reasons_supported", f"{_ALL_CLOCK_EVENT_REASONS:#x}")
    pcie = _reading(dev.pcie)
    if pcie is not None:
        put("pcie.gen", pcie.gen_current)
        put("pcie.gen_max", pcie.gen_max)
        put("pcie.width", pcie.width_current)
        put("pcie.width_max", pcie.width_max)
        put("pcie.replay_counter", pcie.replay_count)
    ecc = _reading(dev.ecc)
    if ecc is not None:
        on = int(ecc.enabled)
        put("ecc.mode", f"{on} {on}")
        put("ecc.corrected.volatile", ecc.volatile_sbe)
        put("ecc.uncorrected.volatile", ecc.volatile_dbe)
        put("ecc.corrected.aggregate", ecc.aggregate_sbe)
        put("ecc.uncorrected.aggregate", ecc.aggregate_dbe)
        put("ecc.uncorrected.aggregate.sram", ecc.aggregate_dbe_sram)
        put("ecc.uncorrected.aggregate.dram", ecc.aggregate_dbe_dram)
        if ecc.sram_uncorrectable_aggregate is not None:
            # the simulator keeps one count: all SEC-DED (a real GPU splits parity/SEC-DED)
            put("ecc_sram.aggregate", f"0 {ecc.sram_uncorrectable_aggregate} 0")
            put("ecc_sram.volatile", "0 0 0")
            put(
                "ecc_sram.aggregate_by_unit",
                " ".join(str(ecc.sram_uncorrectable_by_unit.get(u, 0)) for u in SRAM_UNITS),
            )
        if ecc.sram_threshold_exceeded is not None:
            put("ecc_sram.threshold_exceeded", int(ecc.sram_threshold_exceeded))
    pages = _reading(dev.retired_pages)
    if pages is not None:
        put("retired_pages.sbe", pages.sbe)
        put("retired_pages.dbe", pages.dbe)
        put("retired_pages.pending", int(pages.pending))
    remap = _reading(dev.row_remap)
    if remap is not None:
        put(
            "remapped_rows",
            f"{remap.corrected} {remap.uncorrected} {int(remap.pending)} {int(remap.failed)}",
        )
    persistence = _reading(dev.persistence_mode)
    if persistence is not None:
        put("persistence_mode", int(persistence))
    action = _reading(dev.recovery_action)
    if action is not None:
        put(f"field.{_FI_DEV_GET_GPU_RECOVERY_ACTION}", f"uint {RECOVERY_ACTIONS.index(action)}")
    links = _reading(dev.nvlinks) or []
    if links:
        put(f"field.{_FI_DEV_NVLINK_LINK_COUNT}", f"uint {len(links)}")
    for link in links:
        put(f"nvlink.{link.link}.state", int(link.active))
        if link.p2p_supported is not None:
            put(f"nvlink.{link.link}.cap.{_NVLINK_CAP_P2P_SUPPORTED}", int(link.p2p_supported))
        put(f"nvlink.{link.link}.cap.{_NVLINK_CAP_VALID}", 1)
        put(f"nvlink.{link.link}.error.replay", link.replay_errors)
        put(f"nvlink.{link.link}.error.recovery", link.recovery_errors)
        put(f"nvlink.{link.link}.error.crc_flit", link.crc_errors)
    for proc in _reading(dev.compute_processes) or []:
        used = "na" if proc.used_memory_bytes is None else proc.used_memory_bytes
        put("process", f"{proc.pid} {used}")
    util = _reading(dev.utilization)
    if util is not None:
        put("utilization", f"{util.gpu_pct} {util.memory_pct}")
    mode = _reading(dev.virtualization_mode)
    if mode in VIRTUALIZATION_MODES:
        put("virtualization_mode", VIRTUALIZATION_MODES.index(mode))
    put("event_types", f"{_EVENT_TYPES:#x}")
    return out


def render(
    scenario: Scenario,
    sku: Sku,
    switches: Iterable[Switch] = (),
    extra: Mapping[int | None, Sequence[str]] | None = None,
) -> str:
    """The state file for ``scenario`` (a node of ``sku``), with ``switches`` applied.

    ``extra`` appends raw state lines to the global section (key None) or to a GPU's section
    (the scenario's GPU index); for a key given twice the last line wins, so
    ``{1: ["field.230 error 3"]}`` makes GPU 1's recovery action field "not supported".
    """
    switches = tuple(switches)
    extra = dict(extra or {})
    if scenario.captured:
        return _render_capture(scenario, switches, extra)
    for gpu in [s.gpu for s in switches] + list(extra):
        if gpu is not None and not 0 <= gpu < scenario.gpus:
            raise ConfigError(
                f"nvml_state: GPU {gpu} is not one of the scenario's "
                f"{scenario.gpus} GPUs (0..{scenario.gpus - 1})"
            )
    # Readings come from the simulator's model of a GPU that answers; lost and hung GPUs
    # become switches below, and missing ones are simply not enumerated.
    answering = replace(
        scenario, faults=tuple(f for f in scenario.faults if f.kind not in _FLAG_FAULTS)
    )
    backend = SimGpuBackend(answering, sku)
    lines = [
        FORMAT,
        f"# rendered by node_agent.sim.nvml_state from {scenario.source} (sku {sku.id})",
    ]
    if scenario.driver_down:  # NVML does not load: no GPUs, no versions
        lines.append(f"error nvmlInit {DRIVER_DOWN_INIT_ERRORS[scenario.driver_down]}")
    else:
        lines += [
            f"driver_version {scenario.driver}",
            f"nvml_version 12.{scenario.driver}",
            f"cuda_driver_version {cuda_version_int(scenario.cuda)}",
        ]
    lines += [s.line() for s in switches if s.gpu is None]
    lines += extra.get(None, ())
    for nvml_index, dev in enumerate(backend.devices()):
        lines += ["", f"[gpu {nvml_index}]"]
        if nvml_index != dev.index:
            lines.append(f"# scenario GPU {dev.index} (a GPU before it is missing)")
        lines += _device_lines(dev)
        if scenario.has(dev.index, "gpu_lost"):
            lines.append("lost 1")
        if scenario.has(dev.index, "driver_hang"):
            lines.append("hang *")
        lines += [
            f"xid {i} {f.params['code']}"
            for i, f in enumerate(scenario.faults)
            if f.kind == "xid" and f.gpu == dev.index
        ]
        lines += [s.line() for s in switches if s.gpu == dev.index]
        lines += extra.get(dev.index, ())
    backend.close()
    return "\n".join(lines) + "\n"


def _render_capture(
    scenario: Scenario, switches: tuple[Switch, ...], extra: Mapping[int | None, Sequence[str]]
) -> str:
    """A captured node's state file: its recorded NVML keys as they are (docs/capture.md),
    then the switches and extra lines. ``gpu`` numbers are NVML's (a capture has no others)."""
    assert scenario.nvml is not None
    for gpu in [s.gpu for s in switches] + list(extra):
        if gpu is not None and not 0 <= gpu < scenario.gpus:
            raise ConfigError(
                f"nvml_state: GPU {gpu} is not one of the capture's "
                f"{scenario.gpus} GPUs (0..{scenario.gpus - 1})"
            )
    try:
        lines = capture_state_lines(scenario.nvml, scenario.source)
    except CaptureFormatError as err:
        raise ConfigError(f"{scenario.source}: {err}") from err
    system_end = lines.index("") if "" in lines else len(lines)
    global_lines = [s.line() for s in switches if s.gpu is None] + list(extra.get(None, ()))
    lines[system_end:system_end] = global_lines
    out: list[str] = []
    gpu = -1
    for line in lines:
        if line.startswith("[gpu ") and gpu >= 0:
            out += _gpu_additions(gpu, switches, extra)
        if line.startswith("[gpu "):
            gpu += 1
        out.append(line)
    if gpu >= 0:
        out += _gpu_additions(gpu, switches, extra)
    return "\n".join(out) + "\n"


def _gpu_additions(
    gpu: int, switches: tuple[Switch, ...], extra: Mapping[int | None, Sequence[str]]
) -> list[str]:
    return [s.line() for s in switches if s.gpu == gpu] + list(extra.get(gpu, ()))


def write_state(path: str | Path, text: str) -> None:
    """Write the state file whole (``atomic_file``: temporary file + rename): the library never
    reads half."""
    atomic_file.write_text(Path(path), text)


def render_file(
    scenario_path: str | Path,
    out: str | Path,
    switches: Iterable[Switch] = (),
    graders_dir: str | Path | None = None,
) -> Scenario:
    """Load and validate a scenario file (as ``--simulate`` does) and write its state file."""
    if graders_dir is None:
        from node_agent import resources
        from node_agent.config import config_from_dict

        graders_dir = resources.graders_dir(config_from_dict({}))
    skus = load_skus(Path(graders_dir))
    scenario = load_scenario(scenario_path, skus)
    write_state(out, render(scenario, skus[scenario.sku], switches))
    return scenario


def _switch_arg(kind: str) -> Callable[[str], Switch]:
    def parse(text: str) -> Switch:
        gpu_text, sep, rest = text.partition(":")
        gpu = None
        if sep and gpu_text.isdigit():
            gpu, text = int(gpu_text), rest
        code = None
        if kind == "error":
            text, _, code_text = text.partition("=")
            if not code_text.lstrip("-").isdigit():
                raise argparse.ArgumentTypeError(f"{text!r}: expected [GPU:]FUNCTION=CODE")
            code = int(code_text)
        try:
            return Switch(kind, text, gpu, code)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m node_agent.sim.nvml_state",
        description="Render a scenario into the stand-in NVML library's state file "
        "(docs/nvml_fake.md).",
    )
    parser.add_argument("scenario", help="scenario YAML (as for --simulate)")
    parser.add_argument("--out", required=True, help="state file to write (replaced whole)")
    parser.add_argument("--graders-dir", help="graders directory with skus/ (default: shipped)")
    for kind, what in (
        ("unsupported", "NVML_ERROR_NOT_SUPPORTED"),
        ("absent", "NVML_ERROR_FUNCTION_NOT_FOUND"),
        ("hang", "a call that does not return"),
    ):
        parser.add_argument(
            f"--{kind}",
            action="append",
            default=[],
            type=_switch_arg(kind),
            metavar="[GPU:]FUNCTION",
            help=f"{what} from FUNCTION (or *)",
        )
    parser.add_argument(
        "--error",
        action="append",
        default=[],
        type=_switch_arg("error"),
        metavar="[GPU:]FUNCTION=CODE",
        help="FUNCTION returns nvmlReturn_t CODE",
    )
    args = parser.parse_args(argv)
    switches = [*args.unsupported, *args.absent, *args.hang, *args.error]
    try:
        render_file(args.scenario, args.out, switches, args.graders_dir)
    except (ConfigError, OSError) as err:
        print(f"nvml_state: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
