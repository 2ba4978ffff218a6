"""Convert what ``nvidia-smi -q`` printed (its text, or ``-q -x`` XML) into a capture scenario.

``nvidia-smi -q`` is what most bug reports and support tickets attach, and what public dumps
of new GPUs are. This module reads either form into the capture format (docs/capture.md), so
the node it describes replays through ``--simulate`` like any capture:

- each reading nvidia-smi printed becomes the NVML call's key it comes from (``Product Name``
  -> ``name``, ``Remapped Rows`` -> ``remapped_rows``, ...); a reading it printed as ``N/A``
  is that call's Not Supported, ``Insufficient Permissions`` its No Permission, ``Unknown
  Error`` its Unknown; a GPU with any ``GPU is lost`` reading is recorded lost;
- what nvidia-smi does not print is not invented, and the file says so under
  ``capture.not_known``: the kernel log (no Xid can be seen: the replay's kernel log is
  unavailable, never clean), the PCI bus beyond the GPUs nvidia-smi listed (a GPU that fell
  off the bus, an NVSwitch), NVLink per link, the supported clock-event reasons, the
  compute capability; ``capture.not_read`` lists the agent's NVML calls without a value;
- facts derived rather than read are under ``capture.assumed`` (the absolute temperature
  thresholds from the T.Limit margins newer drivers print, ECC totals as sums).

The file is someone else's: it is read with ``atomic_file.read_foreign`` (no link, regular,
size-capped) and XML is parsed by the standard library with every entity declaration
refused (no DTD is fetched; a document that declares entities is refused whole).

Use::

    node-agent capture --from-nvidia-smi nvidia-smi-q.xml OUT.yaml
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.parsers import expat

from node_agent.atomic_file import FOREIGN_MAX_BYTES, ForeignFileRefused, read_foreign
from node_agent.gpu.base import FABRIC_HEALTH_SUMMARIES, FABRIC_STATES, GpuFabric
from node_agent.gpu.nvml_calls import ERROR_NAMES, fabric_value
from node_agent.gpu.pci import NVIDIA_VENDOR_ID, normalise_bus_id
from node_agent.gpu.replay import recorded_error
from node_agent.hardware.sku import Sku
from node_agent.sim.capture import FORMAT, CaptureError, build_scenario, dump
from node_agent.sim.capture_import import BACKEND_KEYS, oracle_of, section

#: what a PROVENANCE.md beside the file may add (the machine, the operator's conclusions)
PROVENANCE = "PROVENANCE.md"
#: the most read of the file (``-q -x`` of 8 GPUs is about 300 KiB)
MAX_BYTES = FOREIGN_MAX_BYTES
#: the PCI class nvidia-smi's Base/Sub Classcode give for a data-center GPU (3D controller)
GPU_CLASS = "0x030200"
NOT_KNOWN = {
    "kernel_log": "nvidia-smi prints no kernel log: its Xids and driver messages are not known",
    "pci": "the PCI bus was not read: only the GPUs nvidia-smi listed are on it (a GPU that "
    "fell off the bus, an NVSwitch or a bridge is not known)",
    "nvlink": "nvidia-smi -q prints no NVLink state per link (nvidia-smi nvlink -s does): "
    "links answer Not Supported in the replay",
    "clocks_event_reasons_supported": "which clock-event reasons the GPU supports",
    "cuda_compute_capability": "the compute capability",
}

# nvidia-smi's words for an NVML error (nvidia-smi prints nvmlErrorString or N/A)
_ERRORS = {
    "n/a": 3,
    "[n/a]": 3,
    "not supported": 3,
    "[not supported]": 3,
    "insufficient permissions": 4,
    "[insufficient permissions]": 4,
    "unknown error": 999,
    "[unknown error]": 999,
    "gpu is lost": 15,
    "[gpu is lost]": 15,
}
_ARCHITECTURES = {
    "kepler": 2,
    "maxwell": 3,
    "pascal": 4,
    "volta": 5,
    "turing": 6,
    "ampere": 7,
    "ada lovelace": 8,
    "hopper": 9,
    "blackwell": 10,
}
_VIRTUALIZATION = {"none": 0, "pass-through": 1, "vgpu": 2, "host vgpu": 3, "host vsga": 4}
_RECOVERY = {"none": 0, "reset": 1, "gpu reset": 1, "reboot": 2, "node reboot": 2}
_RECOVERY.update({"drain p2p": 3, "drain and reset": 4})
# (event-reason bit, XML tag suffix, the text's label); NVML's nvmlClocksEventReason* bits
_EVENT_REASONS = (
    (0x1, "gpu_idle", "Idle"),
    (0x2, "applications_clocks_setting", "Applications Clocks Setting"),
    (0x4, "sw_power_cap", "SW Power Cap"),
    (0x8, "hw_slowdown", "HW Slowdown"),
    (0x10, "sync_boost", "Sync Boost"),
    (0x20, "sw_thermal_slowdown", "SW Thermal Slowdown"),
    (0x40, "hw_thermal_slowdown", "HW Slowdown/HW Thermal Slowdown"),
    (0x80, "hw_power_brake_slowdown", "HW Slowdown/HW Power Brake Slowdown"),
    (0x100, "display_clocks_setting", "Display Clock Setting"),
)
Tree = dict[str, Any]  # one section: name -> text, or a nested section


class _Smi:
    """One nvidia-smi print, parsed: ``form`` ("xml" or "text"), the log's own fields
    (``driver``, ``cuda``, ``timestamp``) and one section tree per GPU, with its id."""

    def __init__(self, form: str, head: dict[str, str], gpus: list[tuple[str, Tree]]) -> None:
        self.form, self.head, self.gpus = form, head, gpus

    def get(self, tree: Tree, xml: str, text: str) -> str | None:
        """The reading at ``xml`` (tags) or ``text`` (labels), by this print's form; a path
        may name alternatives with ``|`` (an element renamed between drivers)."""
        for path in (xml if self.form == "xml" else text).split("|"):
            node: Any = tree
            for part in path.split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, str):
                return node.strip()
        return None


# -- reading the two forms -----------------------------------------------------------------------


def parse(data: bytes, source: str) -> _Smi:
    """nvidia-smi's ``-q`` text or ``-q -x`` XML (told apart by the XML declaration or the
    root element). CaptureError when it is neither."""
    text = data.decode("utf-8", "replace")
    start = text.lstrip()[:200]
    if start.startswith("<?xml") or start.startswith("<nvidia_smi_log"):
        return _parse_xml(data, source)
    if "NVSMI LOG" not in start and "Driver Version" not in text[:4096]:
        raise CaptureError(
            f"{source}: not what nvidia-smi -q prints (no 'NVSMI LOG' header) nor its "
            "-q -x XML: give the output of `nvidia-smi -q` or `nvidia-smi -q -x`"
        )
    return _parse_text(text)


def _refuse_entity(*_args: Any) -> None:
    raise CaptureError("the XML declares an entity: refused (nvidia-smi declares none)")


def _refuse_external(
    _context: str, _base: str | None, system_id: str | None, _public: str | None
) -> int:
    raise CaptureError(f"the XML refers to an external entity ({system_id}): refused")


class _Element:
    """One XML element as the expat handlers build it."""

    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs = tag, attrs
        self.text: list[str] = []
        self.children: list[_Element] = []

    def section(self) -> Tree | str:
        """Its children by tag (a repeated tag: the first), or its text when it has none."""
        if not self.children:
            return "".join(self.text).strip()
        out: Tree = {}
        for child in self.children:
            out.setdefault(child.tag, child.section())
        return out


def _parse_xml(data: bytes, source: str) -> _Smi:
    """Parsed with expat through the standard library, every entity declaration refused (a
    billion-laughs document stops at its first declaration) and no external DTD or entity
    loaded (nvidia-smi's DOCTYPE names its DTD by a relative path: never read)."""
    parser = expat.ParserCreate()
    stack: list[_Element] = [_Element("", {})]

    def start(tag: str, attrs: dict[str, str]) -> None:
        if len(stack) > 64:
            raise CaptureError("elements nested more than 64 deep: not nvidia-smi's XML")
        element = _Element(tag, attrs)
        stack[-1].children.append(element)
        stack.append(element)

    def end(_tag: str) -> None:
        stack.pop()

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = lambda text: stack[-1].text.append(text)
    parser.EntityDeclHandler = _refuse_entity
    parser.UnparsedEntityDeclHandler = _refuse_entity
    parser.ExternalEntityRefHandler = _refuse_external
    try:
        parser.Parse(data, True)
    except expat.ExpatError as err:
        raise CaptureError(f"{source}: not well-formed XML: {err}") from err
    except CaptureError as err:
        raise CaptureError(f"{source}: {err}") from err
    root = stack[0].children[0] if stack[0].children else None
    if root is None or root.tag != "nvidia_smi_log":
        raise CaptureError(
            f"{source}: the root element is not <nvidia_smi_log>: not nvidia-smi -q -x output"
        )
    head = {c.tag: "".join(c.text).strip() for c in root.children if c.tag != "gpu"}
    gpus = []
    for gpu in (c for c in root.children if c.tag == "gpu"):
        section = gpu.section()
        gpus.append((gpu.attrs.get("id", ""), section if isinstance(section, dict) else {}))
    return _Smi("xml", head, gpus)


# ``Label<padding>: value`` (nvidia-smi pads every label, so a colon inside a value, as in
# a bus id, never splits it); any other line opens a section
_VALUE = re.compile(r"^( *)(\S.*?)\s+: ?(.*)$")
_SECTION = re.compile(r"^( *)(\S.*?)\s*$")


def _parse_text(text: str) -> _Smi:
    """Indented ``Label : value`` lines; a line without a value opens a section."""
    head: dict[str, str] = {}
    gpus: list[tuple[str, Tree]] = []
    stack: list[tuple[int, Tree]] = []
    for line in text.splitlines():
        m = _VALUE.match(line) or _SECTION.match(line)
        if not m or line.startswith("="):
            continue
        indent, label = len(m[1]), m[2]
        value = m[3] if m.re is _VALUE else None
        if indent == 0 and value is None and label.startswith("GPU "):
            gpus.append((label[4:].strip(), {}))
            stack = [(0, gpus[-1][1])]
            continue
        if indent == 0 and value is not None:
            head[label] = value.strip()
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            continue
        parent = stack[-1][1]
        if value is None:
            parent.setdefault(label, {})
            if isinstance(parent[label], dict):
                stack.append((indent, parent[label]))
        else:
            parent.setdefault(label, value.strip())
    head = {
        "driver_version": head.get("Driver Version", ""),
        "cuda_version": head.get("CUDA Version", ""),
        "timestamp": head.get("Timestamp", ""),
    }
    return _Smi("text", head, gpus)


# -- readings -> NVML state keys -----------------------------------------------------------------


def _error(text: str) -> dict[str, Any] | None:
    code = _ERRORS.get(text.strip().lower())
    return recorded_error(code) if code is not None else None


def _state_value(reading: str, convert: Callable[[str], Any]) -> Any:
    """A printed reading as its key's value: the NVML error it names, its conversion, or
    Unknown where it is printed in no known form (an error is a dict, a value never is)."""
    error = _error(reading)
    if error is not None:
        return error
    try:
        return convert(reading)
    except (ValueError, KeyError):
        return recorded_error(999)


def _number(text: str) -> float:
    """The leading number of a reading (``81559 MiB``, ``35 C``, ``16x``, ``72.79 W``)."""
    m = re.match(r"\s*(-?\d+(?:\.\d+)?)", text)
    if not m:
        raise ValueError(f"no number in {text[:40]!r}")
    return float(m[1])


def _int(text: str) -> int:
    return int(_number(text))


def _hex(text: str) -> int:
    return int(text.strip().lower().removeprefix("0x"), 16)


def _milliwatts(text: str) -> int:
    return round(_number(text) * 1000)


def _named(table: dict[str, int]) -> Callable[[str], int]:
    def convert(text: str) -> int:
        return table[text.strip().lower()]

    return convert


def _enabled(text: str) -> int:
    return {"enabled": 1, "disabled": 0, "yes": 1, "no": 0}[text.strip().lower()]


# (key, XML tags, the text's labels, conversion); a ``|`` separates a driver's older name
_FIELDS: tuple[tuple[str, str, str, Callable[[str], Any]], ...] = (
    ("name", "product_name", "Product Name", str),
    ("uuid", "uuid", "GPU UUID", str),
    ("serial", "serial", "Serial Number", str),
    ("vbios", "vbios_version", "VBIOS Version", str),
    ("minor_number", "minor_number", "Minor Number", _int),
    ("persistence_mode", "persistence_mode", "Persistence Mode", _enabled),
    ("architecture", "product_architecture", "Product Architecture", _named(_ARCHITECTURES)),
    (
        "virtualization_mode",
        "gpu_virtualization_mode/virtualization_mode",
        "GPU Virtualization Mode/Virtualization Mode",
        _named(_VIRTUALIZATION),
    ),
    ("pci.bus_id", "pci/pci_bus_id", "PCI/Bus Id", str),
    ("pci.device_id", "pci/pci_device_id", "PCI/Device Id", _hex),
    ("pci.subsystem_id", "pci/pci_sub_system_id", "PCI/Sub System Id", _hex),
    (
        "pcie.gen",
        "pci/pci_gpu_link_info/pcie_gen/current_link_gen",
        "PCI/GPU Link Info/PCIe Generation/Current",
        _int,
    ),
    (
        "pcie.gen_max",
        "pci/pci_gpu_link_info/pcie_gen/max_link_gen",
        "PCI/GPU Link Info/PCIe Generation/Max",
        _int,
    ),
    (
        "pcie.width",
        "pci/pci_gpu_link_info/link_widths/current_link_width",
        "PCI/GPU Link Info/Link Width/Current",
        _int,
    ),
    (
        "pcie.width_max",
        "pci/pci_gpu_link_info/link_widths/max_link_width",
        "PCI/GPU Link Info/Link Width/Max",
        _int,
    ),
    ("pcie.replay_counter", "pci/replay_counter", "PCI/Replays Since Reset", _int),
    ("memory.total", "fb_memory_usage/total", "FB Memory Usage/Total", lambda t: _int(t) << 20),
    ("temperature.gpu", "temperature/gpu_temp", "Temperature/GPU Current Temp", _int),
    (
        "temperature.threshold.shutdown",
        "temperature/gpu_temp_max_threshold",
        "Temperature/GPU Shutdown Temp",
        _int,
    ),
    (
        "temperature.threshold.slowdown",
        "temperature/gpu_temp_slow_threshold",
        "Temperature/GPU Slowdown Temp",
        _int,
    ),
    (
        "temperature.threshold.gpu_max",
        "temperature/gpu_temp_max_gpu_threshold",
        "Temperature/GPU Max Operating Temp",
        _int,
    ),
    (
        "temperature.threshold.mem_max",
        "temperature/gpu_temp_max_mem_threshold",
        "Temperature/Memory Max Operating Temp",
        _int,
    ),
    (
        "field.82",
        "temperature/memory_temp",
        "Temperature/Memory Current Temp",
        lambda t: f"uint {_int(t)}",
    ),
    (
        "power.usage",
        "gpu_power_readings/instant_power_draw|gpu_power_readings/power_draw"
        "|power_readings/power_draw",
        "GPU Power Readings/Instantaneous Power Draw|GPU Power Readings/Power Draw"
        "|Power Readings/Power Draw",
        _milliwatts,
    ),
    (
        "power.enforced_limit",
        "gpu_power_readings/current_power_limit|power_readings/enforced_power_limit",
        "GPU Power Readings/Current Power Limit|Power Readings/Enforced Power Limit",
        _milliwatts,
    ),
    (
        "power.limit",
        "gpu_power_readings/requested_power_limit|power_readings/power_limit",
        "GPU Power Readings/Requested Power Limit|Power Readings/Power Limit",
        _milliwatts,
    ),
    (
        "power.default_limit",
        "gpu_power_readings/default_power_limit|power_readings/default_power_limit",
        "GPU Power Readings/Default Power Limit|Power Readings/Default Power Limit",
        _milliwatts,
    ),
    ("clock.graphics", "clocks/graphics_clock", "Clocks/Graphics", _int),
    ("clock.sm", "clocks/sm_clock", "Clocks/SM", _int),
    ("clock.mem", "clocks/mem_clock", "Clocks/Memory", _int),
    ("clock.video", "clocks/video_clock", "Clocks/Video", _int),
    ("clock_max.graphics", "max_clocks/graphics_clock", "Max Clocks/Graphics", _int),
    ("clock_max.sm", "max_clocks/sm_clock", "Max Clocks/SM", _int),
    ("clock_max.mem", "max_clocks/mem_clock", "Max Clocks/Memory", _int),
    ("clock_max.video", "max_clocks/video_clock", "Max Clocks/Video", _int),
    (
        "field.230",
        "gpu_recovery_action",
        "GPU Recovery Action",
        lambda t: f"uint {_named(_RECOVERY)(t)}",
    ),
)


def gpu_keys(smi: _Smi, tree: Tree, assumed: dict[str, str]) -> dict[str, Any]:
    """One GPU's state keys from its section; a GPU with any ``GPU is lost`` reading is
    ``{lost: 1}`` (every NVML call on a lost GPU answers so)."""
    keys: dict[str, Any] = {}
    for key, xml, text, convert in _FIELDS:
        reading = smi.get(tree, xml, text)
        if reading is not None:
            keys[key] = _state_value(reading, convert)
    if any(isinstance(v, dict) and v.get("code") == 15 for v in keys.values()):
        return {"lost": 1, **{k: keys[k] for k in ("pci.bus_id",) if isinstance(keys.get(k), str)}}
    _memory(smi, tree, keys, assumed)
    _thresholds_from_tlimit(smi, tree, keys, assumed)
    _event_reasons(smi, tree, keys)
    for key, parts in _JOINED:
        _joined(smi, tree, keys, key, parts)
    _ecc(smi, tree, keys, assumed)
    _retired_pages(smi, tree, keys)
    _fabric(smi, tree, keys)
    return keys


# keys whose value is several readings in one line: (key, ((XML, text, conversion), ...))
_JOINED: tuple[tuple[str, tuple[tuple[str, str, Callable[[str], int]], ...]], ...] = (
    (
        "utilization",
        (
            ("utilization/gpu_util", "Utilization/GPU", _int),
            ("utilization/memory_util", "Utilization/Memory", _int),
        ),
    ),
    (
        "ecc.mode",
        (
            ("ecc_mode/current_ecc", "ECC Mode/Current", _enabled),
            ("ecc_mode/pending_ecc", "ECC Mode/Pending", _enabled),
        ),
    ),
    (
        "remapped_rows",
        (
            ("remapped_rows/remapped_row_corr", "Remapped Rows/Correctable Error", _int),
            ("remapped_rows/remapped_row_unc", "Remapped Rows/Uncorrectable Error", _int),
            ("remapped_rows/remapped_row_pending", "Remapped Rows/Pending", _enabled),
            (
                "remapped_rows/remapped_row_failure",
                "Remapped Rows/Remapping Failure Occurred",
                _enabled,
            ),
        ),
    ),
)


def _joined(
    smi: _Smi,
    tree: Tree,
    keys: dict[str, Any],
    key: str,
    parts: tuple[tuple[str, str, Callable[[str], int]], ...],
) -> None:
    """``key`` as its readings joined by spaces; the first error among them stands for the
    call; nothing when one was not printed."""
    values: list[str] = []
    for xml, text, convert in parts:
        reading = smi.get(tree, xml, text)
        if reading is None:
            return
        value = _state_value(reading, convert)
        if isinstance(value, dict):
            keys[key] = value
            return
        values.append(str(value))
    keys[key] = " ".join(values)


def _readable(smi: _Smi, tree: Tree, xml: str, text: str) -> str | None:
    """A reading that is a value (not absent, not an error)."""
    reading = smi.get(tree, xml, text)
    return None if reading is None or _error(reading) is not None else reading


def _memory(smi: _Smi, tree: Tree, keys: dict[str, Any], assumed: dict[str, str]) -> None:
    """NVML's v1 memory info counts the driver's reservation as used; nvidia-smi prints the
    two apart (the H100 host's NVML and nvidia-smi agree so: 480 MiB reserved, 0 used)."""
    used = _readable(smi, tree, "fb_memory_usage/used", "FB Memory Usage/Used")
    reserved = _readable(smi, tree, "fb_memory_usage/reserved", "FB Memory Usage/Reserved")
    if used is None:
        return
    keys["memory.used"] = (_int(used) + (_int(reserved) if reserved else 0)) << 20
    if reserved:
        keys["memory.reserved"] = _int(reserved) << 20
        assumed["memory.used"] = "FB Memory Usage Used + Reserved (NVML's v1 used counts both)"


def _thresholds_from_tlimit(
    smi: _Smi, tree: Tree, keys: dict[str, Any], assumed: dict[str, str]
) -> None:
    """Drivers from R560 print T.Limit margins instead of absolute thresholds: the GPU's
    margin to its T.Limit (GPU Max Operating) temperature, and each threshold's offset from
    it. T.Limit = current + margin; shutdown = T.Limit - its offset (the H100 host: 35 + 52
    = 87, shutdown 87 + 8 = 95, as NVML answered). The two readings are not of one instant,
    so the result may be a degree off; the memory threshold has no such form."""
    if "temperature.threshold.gpu_max" in keys:
        return
    now = _readable(smi, tree, "temperature/gpu_temp", "Temperature/GPU Current Temp")
    margin = _readable(smi, tree, "temperature/gpu_temp_tlimit", "Temperature/GPU T.Limit Temp")
    if now is None or margin is None:
        return
    tlimit = _int(now) + _int(margin)
    for key, xml, text in (
        ("shutdown", "gpu_temp_max_tlimit_threshold", "GPU Shutdown T.Limit Temp"),
        ("slowdown", "gpu_temp_slow_tlimit_threshold", "GPU Slowdown T.Limit Temp"),
        ("gpu_max", "gpu_temp_max_gpu_tlimit_threshold", "GPU Max Operating T.Limit Temp"),
    ):
        offset = _readable(smi, tree, f"temperature/{xml}", f"Temperature/{text}")
        if offset is not None:
            keys[f"temperature.threshold.{key}"] = tlimit - _int(offset)
    assumed["temperature.threshold"] = (
        "shutdown, slowdown and gpu_max from the T.Limit margins nvidia-smi printed "
        "(current + margin - offset: may be a degree off)"
    )


def _event_reasons(smi: _Smi, tree: Tree, keys: dict[str, Any]) -> None:
    mask, seen = 0, False
    for bit, tag, label in _EVENT_REASONS:
        reading = _readable(
            smi,
            tree,
            f"clocks_event_reasons/clocks_event_reason_{tag}"
            f"|clocks_throttle_reasons/clocks_throttle_reason_{tag}",
            f"Clocks Event Reasons/{label}|Clocks Throttle Reasons/{label}",
        )
        if reading is not None:
            seen = True
            mask |= bit if reading.lower() == "active" else 0
    if seen:
        keys["clocks_event_reasons"] = f"{mask:#x}"


# the ECC counts nvidia-smi prints per counter (volatile, aggregate): XML tag, text label
_ECC_COUNTS = (
    ("sram_correctable", "SRAM Correctable"),
    ("sram_uncorrectable_parity", "SRAM Uncorrectable Parity"),
    ("sram_uncorrectable_secded", "SRAM Uncorrectable SEC-DED"),
    ("sram_uncorrectable", "SRAM Uncorrectable"),  # before R550: one SRAM uncorrectable count
    ("dram_correctable", "DRAM Correctable"),
    ("dram_uncorrectable", "DRAM Uncorrectable"),
)
_SRAM_UNITS = (
    ("sram_l2", "SRAM L2"),
    ("sram_sm", "SRAM SM"),
    ("sram_pcie", "SRAM PCIE"),
    ("sram_microcontroller", "SRAM Microcontroller"),
    ("sram_other", "SRAM Other"),
)


def _ecc(smi: _Smi, tree: Tree, keys: dict[str, Any], assumed: dict[str, str]) -> None:
    """The SRAM and DRAM counts per counter as NVML's per-location counters, their sums as
    its totals, and from R550 the SRAM status (parity, SEC-DED, corrected; by unit)."""
    for counter, label in (("volatile", "Volatile"), ("aggregate", "Aggregate")):
        got: dict[str, int] = {}
        for tag, text in _ECC_COUNTS:
            reading = _readable(
                smi, tree, f"ecc_errors/{counter}/{tag}", f"ECC Errors/{label}/{text}"
            )
            if reading is not None:
                got[tag] = _int(reading)
        if not got:
            continue
        sram_unc = got.get("sram_uncorrectable", 0) + got.get("sram_uncorrectable_parity", 0)
        sram_unc += got.get("sram_uncorrectable_secded", 0)
        for kind, sram, dram in (
            ("corrected", got.get("sram_correctable", 0), got.get("dram_correctable", 0)),
            ("uncorrected", sram_unc, got.get("dram_uncorrectable", 0)),
        ):
            keys[f"ecc.{kind}.{counter}.sram"] = sram
            keys[f"ecc.{kind}.{counter}.dram"] = dram
            keys[f"ecc.{kind}.{counter}"] = sram + dram
        if "sram_uncorrectable_parity" in got:
            keys[f"ecc_sram.{counter}"] = (
                f"{got['sram_uncorrectable_parity']} "
                f"{got.get('sram_uncorrectable_secded', 0)} {got.get('sram_correctable', 0)}"
            )
        assumed["ecc"] = "totals as the sum of the SRAM and DRAM counts nvidia-smi printed"
    units = [
        _readable(
            smi,
            tree,
            f"ecc_errors/aggregate_uncorrectable_sram_sources/{tag}",
            f"ECC Errors/Aggregate Uncorrectable SRAM Sources/{text}",
        )
        for tag, text in _SRAM_UNITS
    ]
    if all(u is not None for u in units):
        keys["ecc_sram.aggregate_by_unit"] = " ".join(str(_int(u or "0")) for u in units)
    exceeded = _readable(
        smi,
        tree,
        "ecc_errors/aggregate/sram_threshold_exceeded",
        "ECC Errors/Aggregate/SRAM Threshold Exceeded",
    )
    if exceeded is not None:
        keys["ecc_sram.threshold_exceeded"] = _enabled(exceeded)


def _retired_pages(smi: _Smi, tree: Tree, keys: dict[str, Any]) -> None:
    """Pages retired for single- and double-bit errors and the pending flag; N/A (Hopper and
    later remap rows instead) is Not Supported."""
    for key, xml, text in (
        (
            "retired_pages.sbe",
            "retired_pages/multiple_single_bit_retirement/retired_count",
            "Retired Pages/Single Bit ECC",
        ),
        (
            "retired_pages.dbe",
            "retired_pages/double_bit_retirement/retired_count",
            "Retired Pages/Double Bit ECC",
        ),
        (
            "retired_pages.pending",
            "retired_pages/pending_blacklist|retired_pages/pending_retirement",
            "Retired Pages/Pending Page Blacklist|Retired Pages/Pending Page Retirement",
        ),
    ):
        reading = smi.get(tree, xml, text)
        if reading is None and smi.form == "xml" and "retired_pages" in tree:
            reading = "N/A"  # the XML leaves an unsupported count's element empty
        if reading is None:
            continue
        error = _error(reading)
        if error is not None:
            keys[key] = error
        elif key.endswith("pending"):
            keys[key] = _enabled(reading)
        else:
            keys[key] = _int(reading)


#: the Fabric section's words for nvmlGpuFabricState_t and the health summary (nvidia-smi -q)
_FABRIC_STATES = {"not supported": 0, "not started": 1, "in progress": 2, "completed": 3}
_FABRIC_SUMMARIES = {"healthy": 1, "unhealthy": 2, "limited capacity": 3}
#: the health mask's two-bit fields as nvidia-smi prints them: (XML tag, text label, shift, the
#: word that means TRUE (1); the other words of a known form are FALSE (2), N/A is 0)
_FABRIC_FLAGS = (
    ("bandwidth", "Bandwidth", 0, "degraded"),
    ("route_recovery_in_progress", "Route Recovery in progress", 2, "true"),
    ("route_unhealthy", "Route Unhealthy", 4, "true"),
    ("access_timeout_recovery", "Access Timeout Recovery", 6, "true"),
)
_FABRIC_FALSE = {"full", "false"}


def _fabric(smi: _Smi, tree: Tree, keys: dict[str, Any]) -> None:
    """The Fabric section (``nvmlDeviceGetGpuFabricInfoV``): state, status, CliqueId,
    ClusterUUID and the health flags, as the state key ``fabric``; a state of N/A or Not
    Supported leaves the key out (the GPU has no fabric)."""

    def read(xml: str, text: str) -> str:
        return (smi.get(tree, f"fabric/{xml}", f"Fabric/{text}") or "").strip()

    state = _FABRIC_STATES.get(read("state", "State").lower(), 0)
    if not state:
        return
    status_word = read("status", "Status").lower()
    codes = {name.lower(): code for code, name in ERROR_NAMES.items()}
    mask = 0
    for xml, text, shift, true in _FABRIC_FLAGS:
        word = read(f"health/{xml}", f"Health/{text}").lower()
        mask |= (1 if word == true else 2 if word in _FABRIC_FALSE else 0) << shift
    summary = read("health/summary", "Health/Summary").lower()
    uuid = read("clusterUuid", "ClusterUUID").lower()
    clique = read("cliqueId", "CliqueId")
    try:
        keys["fabric"] = fabric_value(
            GpuFabric(
                state=FABRIC_STATES[state],
                status=0 if status_word in ("success", "n/a", "") else codes.get(status_word, 999),
                cluster_uuid=uuid if _CLUSTER_UUID.match(uuid) else _ZERO_UUID,
                clique_id=_int(clique) if clique and clique != "N/A" else 0,
                health_mask=mask,
                health_summary=FABRIC_HEALTH_SUMMARIES[_FABRIC_SUMMARIES.get(summary, 0)],
            )
        )
    except ValueError:
        keys["fabric"] = recorded_error(999)  # printed, but not as any known form


_CLUSTER_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


# -- the scenario --------------------------------------------------------------------------------


def _pci_function(keys: dict[str, Any]) -> dict[str, Any] | None:
    """The GPU's own PCI function, as nvidia-smi's PCI section names it (the driver is bound:
    nvidia-smi answered through it)."""
    bus = keys.get("pci.bus_id")
    if not isinstance(bus, str):
        return None
    ids = keys.get("pci.device_id")
    return {
        "bdf": normalise_bus_id(bus),
        "vendor": f"0x{ids & 0xFFFF if isinstance(ids, int) else NVIDIA_VENDOR_ID:04x}",
        "device": f"0x{ids >> 16:04x}" if isinstance(ids, int) else None,
        "class": GPU_CLASS,
        "driver": "nvidia",
    }


def _system(head: dict[str, str]) -> dict[str, Any]:
    system: dict[str, Any] = {}
    if head.get("driver_version"):
        system["driver_version"] = head["driver_version"]
    cuda = re.fullmatch(r"(\d+)\.(\d+)", head.get("cuda_version", ""))
    if cuda:  # NVML's cudaDriverVersion: 1000 x major + 10 x minor
        system["cuda_driver_version"] = int(cuda[1]) * 1000 + int(cuda[2]) * 10
    return system


def _read(src: Path) -> tuple[bytes, str | None]:
    """The file, and a PROVENANCE.md beside it when there is one, both read as files someone
    else wrote (:func:`atomic_file.read_foreign`)."""
    try:
        data = read_foreign(src, max_bytes=MAX_BYTES)
    except ForeignFileRefused as err:
        raise CaptureError(str(err)) from err
    except OSError as err:
        raise CaptureError(f"{src}: cannot read it: {err.strerror or err}") from err
    try:
        provenance = read_foreign(src.parent / PROVENANCE, max_bytes=1 << 20)
    except OSError:  # none, or not one the agent reads: the file stands alone
        return data, None
    return data, provenance.decode("utf-8", "replace")


def convert(src: Path, skus: dict[str, Sku], command: str, sku: str | None = None) -> str:
    """The capture scenario's text for the nvidia-smi print ``src`` (module docstring)."""
    data, provenance = _read(src)
    smi = parse(data, str(src))
    if not smi.gpus:
        raise CaptureError(f"{src}: nvidia-smi listed no GPU; nothing to convert")
    assumed = {
        "pci.class": f"{GPU_CLASS} (nvidia-smi's Base/Sub Classcode of a GPU)",
        "pci.driver": "nvidia (nvidia-smi answered, so the driver was bound)",
    }
    gpus = [gpu_keys(smi, tree, assumed) for _, tree in smi.gpus]
    not_read = sorted({k for g in gpus if "lost" not in g for k in BACKEND_KEYS if k not in g})
    stamp = smi.head.get("timestamp", "")
    record: dict[str, Any] = {
        "format": FORMAT,
        "kind": "converted",
        "source": src.name,
        "reader": f"nvidia-smi -q{' -x' if smi.form == 'xml' else ''} as printed "
        f"(driver {smi.head.get('driver_version') or 'not printed'})",
        "date": stamp or None,
        "command": command,
        "not_known": dict(NOT_KNOWN),
        "kernel_log": {"unavailable": NOT_KNOWN["kernel_log"]},
        "pci": {"source": "nvidia-smi's PCI section of each GPU", "unavailable": NOT_KNOWN["pci"]},
        "assumed": assumed,
        "not_read": not_read,
    }
    header = [
        f"Converted from {src.name} (nvidia-smi -q{' -x' if smi.form == 'xml' else ''}) by "
        "node_agent.sim.nvidia_smi; do not edit:",
        f"regenerate with `{command}`.",
        "What nvidia-smi does not print is not known here (capture.not_known): no kernel log,",
        "no PCI bus beyond the GPUs it listed, no NVLink state per link.",
    ]
    if provenance is not None:
        _add_provenance(provenance, record, header)
    pci = [p for p in (_pci_function(g) for g in gpus) if p is not None]
    nvml = {"system": _system(smi.head), "gpus": gpus}
    hostname = re.sub(r"[^A-Za-z0-9-]", "-", src.stem)[:63] or "converted-node"
    return dump(build_scenario(nvml, pci, [], skus, record, hostname, sku), header)


def _add_provenance(text: str, record: dict[str, Any], header: list[str]) -> None:
    """PROVENANCE.md's source, machine and operator's conclusions into the header, and its
    grades into ``capture.oracle`` when it states them (the form capture_import reads)."""
    for title in ("The source", "The machine", "What a good operator concludes"):
        try:
            body = section(text, title)
        except CaptureError:
            continue
        header += ["", f"{title} (from {PROVENANCE}):", *body]
    try:
        record["oracle"] = oracle_of(text)
    except CaptureError:
        pass
