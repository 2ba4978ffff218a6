"""Render a scenario into the state file of the stand-in NVML library (docs/nvml_fake.md).

The stand-in ``libnvidia-ml.so.1`` (``tests/nvml_fake/``, built by ``scripts/build-nvml-fake``)
answers NVML calls from a line-based state file, so the real NVML backend, loaded through the
real nvidia-ml-py, runs against a simulated node. YAML stays in Python: this module reads the
scenario with the same loader as ``--simulate`` (same validation) and writes what the GPUs
report, in NVML's own units (mW, bytes, °C, MHz, bit masks).

What a healthy GPU reports is the simulator's model (:mod:`node_agent.sim.gpu_model`) read through
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
from node_agent.gpu.base import GpuDevice, NotSupported
from node_agent.gpu.nvml_calls import CALLS, FIELDS, Call, model_values
from node_agent.gpu.replay import CaptureFormatError, capture_state_lines
from node_agent.hardware.sku import Sku, load_skus
from node_agent.sim.gpu_model import SimGpuBackend
from node_agent.sim.scenario import Scenario, load_scenario
from node_agent.yamlfile import ConfigError

FORMAT = "nvml-fake-state 1"

# nvmlReturn_t (nvml.h) nvmlInit answers for a scenario's ``driver: not_loaded`` (the kernel
# module is not loaded: NVML_ERROR_DRIVER_NOT_LOADED) and ``not_installed`` (what nvidia-ml-py
# raises where it cannot load libnvidia-ml.so.1: NVML_ERROR_LIBRARY_NOT_FOUND)
DRIVER_DOWN_INIT_ERRORS = {"not_loaded": 9, "not_installed": 12}
# The fault kinds this module turns into NVML answers. All others act elsewhere: compute,
# RDMA, the kernel log (``kernel_log``), the PCI bus (``pci_only``'s bus entry; the GPU itself
# is not enumerated here, as ``missing_gpu``). The fabric faults (``fabric_degraded``,
# ``fabric_incomplete``, ``wrong_clique``) render through the model too, on a SKU with a fabric;
# their parity is tests/integration/test_nvlink_fabric_scenarios.py's (not yet listed here: the
# backend contract's parity cases run on an H100, which has no fabric).
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
        "fabric_degraded",
        "fabric_incomplete",
        "wrong_clique",
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


def _device_lines(dev: GpuDevice, calls: Sequence[Call] = CALLS) -> list[str]:
    """What one simulated GPU reports, as state-file lines (NVML's units): each call of the
    NVML call table with a model (``reading``, ``to_state``) and each modelled field, from
    the simulator's readings (one read per reading; a reading the GPU does not have leaves its
    keys out)."""
    readings: dict[str, Any] = {}

    def read(method: str) -> Any:
        if method not in readings:
            try:
                readings[method] = getattr(dev, method)() if method else None
            except NotSupported:
                readings[method] = NotSupported
        return readings[method]

    out: list[str] = []
    for call in calls:
        reading = read(call.reading)
        if call.to_state is None or reading is NotSupported:
            continue
        for key, value in model_values(call, reading).items():
            values = value if isinstance(value, list) else [value]
            out += [f"{key} {v}" for v in values if v is not None]
    for field in FIELDS:
        reading = read(field.reading)
        value = None if reading is NotSupported else field.to_state(reading)
        if isinstance(value, Mapping):  # a per-link field: {link: value}
            out += [f"field.{field.field_id}.{k} {field.value_type} {v}" for k, v in value.items()]
        elif value is not None:
            out.append(f"field.{field.field_id} {field.value_type} {value}")
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
