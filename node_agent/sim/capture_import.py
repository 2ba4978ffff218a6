"""Convert NVML readings taken with nvidia-ml-py on a real host into a capture scenario.

A host where the agent itself could not run a capture can still be read call by call with
nvidia-ml-py (``nvml-readings.json``: each call's value, or ``{"error": "<NVML's string>"}``)
and its kernel log saved (``kernel-log-boot.txt``). This module turns such a directory into a
scenario in the capture format (docs/capture.md), so the host is replayed like any capture:
through ``--simulate`` and through the stand-in NVML library. ``PROVENANCE.md`` beside them
gives the machine and the oracle (what a good operator concludes); both go into the file's
header, and the oracle's grades into ``capture.oracle`` where tests read them.

What the readings did not ask is not invented: a call they lack answers Not Supported in the
replay, and ``capture.not_read`` lists the calls the NVML backend makes that they lack; reading
names with no state key are listed in ``capture.unmapped``. Two facts the readings do not hold
are stated where they are used: the PCI function's class (an NVIDIA data-center GPU enumerates
as a 3D controller, 0x030200) and its bound driver (``nvidia``: NVML answered on that host).

Use::

    python -m node_agent.sim.capture_import ../shared/realworld/gpu-h100-vm \\
        --out scenarios/real/h100-sxm5-vm.yaml

or ``node-agent capture --from-readings DIR OUT.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from node_agent.atomic_file import FOREIGN_MAX_BYTES, ForeignFileRefused, read_foreign
from node_agent.gpu.nvml_calls import ERROR_NAMES
from node_agent.gpu.pci import NVIDIA_VENDOR_ID, normalise_bus_id
from node_agent.gpu.replay import recorded_error
from node_agent.hardware.sku import Sku
from node_agent.sim.capture import FORMAT, CaptureError, build_scenario, dump

READINGS = "nvml-readings.json"
KERNEL_LOG = "kernel-log-boot.txt"
PROVENANCE = "PROVENANCE.md"
#: the most read of each file of a readings directory
MAX_BYTES = FOREIGN_MAX_BYTES
#: what the readings do not hold, and the replay needs (module docstring)
GPU_CLASS = "0x030200"
GPU_DRIVER = "nvidia"
_CODES = {name.lower(): code for code, name in ERROR_NAMES.items()}
# readings name -> state key, for calls answering one value
_SIMPLE = {
    "Name": "name",
    "UUID": "uuid",
    "Serial": "serial",
    "VbiosVersion": "vbios",
    "Temperature": "temperature.gpu",
    "PowerUsage": "power.usage",
    "EnforcedPowerLimit": "power.enforced_limit",
    "PowerManagementLimit": "power.limit",
    "PowerManagementDefaultLimit": "power.default_limit",
    "PersistenceMode": "persistence_mode",
    "RetiredPagesPendingStatus": "retired_pages.pending",
    "CurrPcieLinkGeneration": "pcie.gen",
    "MaxPcieLinkGeneration": "pcie.gen_max",
    "CurrPcieLinkWidth": "pcie.width",
    "MaxPcieLinkWidth": "pcie.width_max",
    "PcieReplayCounter": "pcie.replay_counter",
    "VirtualizationMode": "virtualization_mode",
    "Architecture": "architecture",
    "MinorNumber": "minor_number",
    "SupportedEventTypes": "event_types",
}
_HEX_KEYS = {
    "CurrentClocksEventReasons": "clocks_event_reasons",
    "SupportedClocksEventReasons": "clocks_event_reasons_supported",
}
# readings that answer the same call another reading already gives (older NVML names)
_ALIASES = {
    "CurrentClocksThrottleReasons": "CurrentClocksEventReasons",
    "SupportedClocksThrottleReasons": "SupportedClocksEventReasons",
}
_NUMBERS = {
    "EccMode": "ecc.mode",
    "RemappedRows": "remapped_rows",
    "CudaComputeCapability": "cuda_compute_capability",
}
_CLOCKS = {"gr": "graphics", "sm": "sm", "mem": "mem", "video": "video"}
_THRESHOLDS = ("shutdown", "slowdown", "mem_max", "gpu_max")
_ECC_LOCATIONS = {
    "l1": "l1",
    "l2": "l2",
    "dram": "dram",
    "reg": "register_file",
    "tex": "texture",
    "shm": "texture_shm",
    "cbu": "cbu",
    "sram": "sram",
}
_NVLINK = {
    "state": "state",
    "version": "version",
    "cap_p2p": "cap.0",
    "err_replay": "error.replay",
    "err_recovery": "error.recovery",
    "err_crc_flit": "error.crc_flit",
}
_FIELD_TYPES = ("double", "uint", "ulong", "ulonglong", "slonglong", "sint", "ushort")
#: the NVML backend's calls, as state keys, so ``capture.not_read`` can name what is missing
BACKEND_KEYS = (
    "name",
    "uuid",
    "pci.bus_id",
    "serial",
    "vbios",
    "memory.total",
    "temperature.gpu",
    "temperature.threshold.shutdown",
    "temperature.threshold.slowdown",
    "temperature.threshold.gpu_max",
    "temperature.threshold.mem_max",
    "power.usage",
    "power.enforced_limit",
    "power.default_limit",
    "clock.sm",
    "clock_max.sm",
    "clock.mem",
    "clocks_event_reasons",
    "pcie.gen",
    "pcie.gen_max",
    "pcie.width",
    "pcie.width_max",
    "pcie.replay_counter",
    "ecc.mode",
    "ecc.corrected.volatile",
    "ecc.uncorrected.volatile",
    "ecc.corrected.aggregate",
    "ecc.uncorrected.aggregate",
    "ecc.uncorrected.aggregate.sram",
    "ecc.uncorrected.aggregate.dram",
    "ecc_sram.aggregate",
    "retired_pages.sbe",
    "retired_pages.dbe",
    "retired_pages.pending",
    "remapped_rows",
    "persistence_mode",
    "field.82",
    "field.230",
    "nvlink.0.state",
    "utilization",
    "virtualization_mode",
    "event_types",
)


def _value(reading: Any) -> Any:
    """A reading's value, or its error as a capture records it. A binding failure (the
    readings' ``exception``) or a call the binding lacks (``missing``) is no NVML answer:
    None (not read)."""
    if isinstance(reading, dict):
        if "error" in reading:
            text = str(reading["error"])
            code = _CODES.get(text.lower())
            return recorded_error(code) if code is not None else {"error": text, "code": 999}
        return None
    return reading


def _put(
    keys: dict[str, Any], key: str, reading: Any, convert: Callable[[Any], Any] = lambda v: v
) -> None:
    value = _value(reading)
    if value is None:
        return
    keys[key] = value if isinstance(value, dict) else convert(value)


def _field_ids() -> dict[str, int]:
    import pynvml

    return {
        name: int(getattr(pynvml, name))
        for name in dir(pynvml)
        if name.startswith("NVML_FI_DEV_") and isinstance(getattr(pynvml, name), int)
    }


def convert_gpu(gpu: dict[str, Any], unmapped: set[str]) -> dict[str, Any]:
    """One GPU's readings as state keys."""
    keys: dict[str, Any] = {}
    for name, reading in gpu.items():
        if name in _SIMPLE:
            _put(keys, _SIMPLE[name], reading)
        elif name in _HEX_KEYS:
            _put(keys, _HEX_KEYS[name], reading, lambda v: f"{int(v):#x}")
        elif name in _ALIASES and _ALIASES[name] in gpu:
            continue
        elif name in _ALIASES:
            _put(keys, _HEX_KEYS[_ALIASES[name]], reading, lambda v: f"{int(v):#x}")
        elif name in _NUMBERS:
            _put(keys, _NUMBERS[name], reading, lambda v: " ".join(str(int(x)) for x in v))
        elif name == "PciInfo":
            _pci(keys, reading)
        elif name == "MemoryInfo" and isinstance(reading, dict) and "total" in reading:
            keys["memory.total"] = int(reading["total"])
            keys["memory.used"] = int(reading.get("used", 0))
        elif name == "UtilizationRates" and isinstance(reading, dict) and "gpu" in reading:
            keys["utilization"] = f"{int(reading['gpu'])} {int(reading['memory'])}"
        elif name in ("ClockInfo", "MaxClockInfo") and isinstance(reading, dict):
            prefix = "clock" if name == "ClockInfo" else "clock_max"
            for short, clock in _CLOCKS.items():
                if short in reading:
                    _put(keys, f"{prefix}.{clock}", reading[short], int)
        elif name == "TemperatureThreshold" and isinstance(reading, dict):
            for threshold in _THRESHOLDS:
                if threshold in reading:
                    _put(keys, f"temperature.threshold.{threshold}", reading[threshold], int)
        elif name == "TotalEccErrors" and isinstance(reading, dict):
            for what, count in reading.items():
                _put(keys, "ecc." + what.replace("/", "."), count, int)
        elif name == "MemoryErrorCounter" and isinstance(reading, dict):
            for what, count in reading.items():
                kind, counter, location = (what.split("/") + ["", "", ""])[:3]
                if location in _ECC_LOCATIONS:
                    _put(keys, f"ecc.{kind}.{counter}.{_ECC_LOCATIONS[location]}", count, int)
                else:
                    unmapped.add(f"MemoryErrorCounter/{what}")
        elif name == "RetiredPages" and isinstance(reading, dict):
            for cause in ("sbe", "dbe"):
                if cause in reading:
                    _put(keys, f"retired_pages.{cause}", reading[cause], len)
        elif name == "ComputeRunningProcesses" and isinstance(reading, list):
            procs = [
                f"{int(p['pid'])} {p.get('usedGpuMemory', 'na')}"
                for p in reading
                if isinstance(p, dict) and "pid" in p
            ]
            if procs:
                keys["process"] = procs
        elif name == "nvlink" and isinstance(reading, dict):
            _nvlinks(keys, reading, unmapped)
        elif name == "field_values" and isinstance(reading, dict):
            _fields(keys, reading, unmapped)
        else:
            unmapped.add(name)
    return keys


def _pci(keys: dict[str, Any], reading: Any) -> None:
    value = _value(reading)
    if isinstance(value, dict) and "error" in value:
        keys["pci.bus_id"] = value
    elif isinstance(reading, dict) and "busId" in reading:
        keys["pci.bus_id"] = str(reading["busId"])
        for attr, key in (("pciDeviceId", "pci.device_id"), ("pciSubSystemId", "pci.subsystem_id")):
            if isinstance(reading.get(attr), int):
                keys[key] = reading[attr]


def _nvlinks(keys: dict[str, Any], links: dict[str, Any], unmapped: set[str]) -> None:
    for link in sorted(links, key=lambda k: int(k) if str(k).isdigit() else -1):
        if not str(link).isdigit():
            continue
        for what, reading in (links[link] or {}).items():
            if what in _NVLINK:
                _put(keys, f"nvlink.{link}.{_NVLINK[what]}", reading, int)
            else:
                unmapped.add(f"nvlink/{what}")


def _fields(keys: dict[str, Any], fields: dict[str, Any], unmapped: set[str]) -> None:
    ids = _field_ids()
    converted: dict[int, Any] = {}
    for name, reading in fields.items():
        field_id = ids.get(name)
        if field_id is None or not isinstance(reading, dict):
            unmapped.add(f"field_values/{name}")
            continue
        ret, kind = reading.get("ret"), reading.get("type")
        if ret != 0:
            converted[field_id] = (
                recorded_error(int(ret))
                if isinstance(ret, int)
                else {"error": str(ret), "code": 999}
            )
        elif isinstance(kind, int) and 0 <= kind < len(_FIELD_TYPES):
            converted[field_id] = f"{_FIELD_TYPES[kind]} {reading.get('value')}"
        else:
            unmapped.add(f"field_values/{name}")
    for field_id in sorted(converted):
        keys[f"field.{field_id}"] = converted[field_id]


def _pci_functions(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for gpu in gpus:
        info = gpu.get("PciInfo")
        if not isinstance(info, dict) or "busId" not in info:
            continue
        ids = info.get("pciDeviceId")
        out.append(
            {
                "bdf": normalise_bus_id(str(info["busId"])),
                "vendor": f"0x{(ids & 0xFFFF) if isinstance(ids, int) else NVIDIA_VENDOR_ID:04x}",
                "device": f"0x{ids >> 16:04x}" if isinstance(ids, int) else None,
                "class": GPU_CLASS,
                "driver": GPU_DRIVER,
            }
        )
    return out


def section(text: str, marker: str) -> list[str]:
    """The lines after the line holding ``marker`` up to the next heading or bold title."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if marker in line:
            body: list[str] = []
            for follow in lines[i + 1 :]:
                if follow.startswith("#") or (follow.startswith("**") and body):
                    break
                body.append(follow)
            while body and not body[-1].strip():
                body.pop()
            return body
    raise CaptureError(f"{PROVENANCE}: no section {marker!r}")


def oracle_of(provenance: str) -> dict[str, Any]:
    """The grades PROVENANCE.md's "What a good operator concludes" gives, as data."""
    lines = "\n".join(section(provenance, "What a good operator concludes"))
    declared = re.search(r"`node\.expected_gpus: (\d+)` declared: \*\*([A-Z]+)\*\*", lines)
    undeclared = re.search(r"Nothing declared: at most \*\*([A-Z]+)\*\*", lines)
    if not declared or not undeclared:
        raise CaptureError(
            f"{PROVENANCE}: the operator's conclusions do not state the grade "
            "with node.expected_gpus declared and with nothing declared"
        )
    return {
        "declared": {"node.expected_gpus": int(declared[1]), "grade": declared[2]},
        "undeclared": {"at_most": undeclared[1], "never": ["ERROR", "FAULT"]},
    }


def convert(src: Path, skus: dict[str, Sku], command: str) -> str:
    """The capture scenario's text for the readings directory ``src``."""
    texts = read_directory(src, (READINGS, KERNEL_LOG, PROVENANCE))
    try:
        readings = json.loads(texts[READINGS])
    except ValueError as err:
        raise CaptureError(f"{src / READINGS}: not JSON: {err}") from err
    kernel_log, provenance = texts[KERNEL_LOG].splitlines(), texts[PROVENANCE]
    if not isinstance(readings, dict) or not isinstance(readings.get("gpus"), list):
        raise CaptureError(f"{src / READINGS}: expected an object with a 'gpus' list")
    unmapped: set[str] = set()
    system: dict[str, Any] = {}
    _put(system, "driver_version", readings.get("driver"), str)
    _put(system, "nvml_version", readings.get("nvml"), str)
    _put(system, "cuda_driver_version", readings.get("cuda"), int)
    gpus = [convert_gpu(g, unmapped) for g in readings["gpus"] if isinstance(g, dict)]
    not_read = sorted({k for g in gpus for k in BACKEND_KEYS if k not in g})
    title = provenance.splitlines()[0] if provenance else ""
    date = re.search(r"\d{4}-\d{2}-\d{2}", title)
    record: dict[str, Any] = {
        "format": FORMAT,
        "kind": "converted",
        "source": f"{src.name}/ ({READINGS}, {KERNEL_LOG}, {PROVENANCE})",
        "host": _machine(provenance) or src.name,
        "date": date[0] if date else None,
        "reader": "nvidia-ml-py, call by call (the readings); the kernel log as dmesg printed it",
        "command": command,
        "oracle": oracle_of(provenance),
        "assumed": {
            "pci.class": f"{GPU_CLASS} (3D controller: not in the readings)",
            "pci.driver": f"{GPU_DRIVER} (NVML answered, so the driver was bound)",
        },
        "not_read": not_read,
        "unmapped": sorted(unmapped),
    }
    scenario = build_scenario(
        {"system": system, "gpus": gpus},
        _pci_functions(readings["gpus"]),
        kernel_log,
        skus,
        record,
        _hostname(src),
    )
    header = [
        f"Converted from {record['source']} by node_agent.sim.capture_import; do not edit:",
        f"regenerate with `{command}`.",
        "",
        "The machine (from PROVENANCE.md):",
        *section(provenance, "The machine"),
        "",
        "What a good operator concludes (the oracle, from PROVENANCE.md):",
        *section(provenance, "What a good operator concludes"),
    ]
    return dump(scenario, header)


def read_directory(src: Path, names: Sequence[str]) -> dict[str, str]:
    """The files ``names`` of the directory ``src`` as text. The directory is someone else's
    (a bug report, a support ticket): each file is opened through the directory's fd with
    :func:`atomic_file.read_foreign` (no link followed, regular files only, size-capped), so
    a link to /etc/shadow is refused, never copied into a scenario. CaptureError names what
    was refused or missing."""
    try:
        dir_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise CaptureError(f"{src}: cannot open the directory: {err.strerror or err}") from err
    try:
        return {name: _read_text(src, name, dir_fd) for name in names}
    finally:
        os.close(dir_fd)


def _read_text(src: Path, name: str, dir_fd: int) -> str:
    try:
        return read_foreign(name, dir_fd=dir_fd, max_bytes=MAX_BYTES).decode("utf-8", "replace")
    except ForeignFileRefused as err:
        raise CaptureError(f"{src}: {err}") from err
    except OSError as err:
        raise CaptureError(f"{src / name}: cannot read it: {err.strerror or err}") from err


def _machine(provenance: str) -> str | None:
    """The first line of PROVENANCE.md's machine description, without its list mark."""
    try:
        lines = [line.strip(" -;") for line in section(provenance, "The machine") if line.strip()]
    except CaptureError:
        return None
    return lines[0] if lines else None


def _hostname(src: Path) -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", src.name)[:63] or "converted-node"


def main(argv: Sequence[str] | None = None) -> int:
    from node_agent import resources
    from node_agent.config import config_from_dict
    from node_agent.hardware.sku import load_skus
    from node_agent.sim.capture import write_capture
    from node_agent.yamlfile import ConfigError

    parser = argparse.ArgumentParser(
        prog="python -m node_agent.sim.capture_import",
        description="Convert nvidia-ml-py readings of a real host (nvml-readings.json, "
        "kernel-log-boot.txt, PROVENANCE.md) into a capture scenario.",
    )
    parser.add_argument("src", help="the readings directory")
    parser.add_argument("--out", required=True, help="scenario file to write")
    args = parser.parse_args(argv)
    skus = load_skus(resources.graders_dir(config_from_dict({})))
    command = f"python -m node_agent.sim.capture_import {args.src} --out {args.out}"
    try:
        write_capture(Path(args.out), convert(Path(args.src), skus, command))
    except (CaptureError, ConfigError) as err:
        print(f"capture_import: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
