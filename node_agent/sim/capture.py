"""``node-agent capture OUT.yaml``: this node as a scenario that replays as this node.

What a capture holds (docs/capture.md):

* ``capture``: provenance: host, date, agent version, the command, the kernel, where the
  kernel log came from (or why there is none);
* ``sku``, ``hostname``, ``driver``, ``cuda``, ``virtualization``: what the replay needs to
  know first, read back from the recording itself (the SKU is the one the agent's own
  inventory matches to the recorded GPUs);
* ``nvml``: NVML call by call (:mod:`node_agent.gpu.record`): each call's value or its error;
* ``pci``: every NVIDIA function on the PCI bus from sysfs (bdf, vendor, device, class, bound
  driver);
* ``kernel_log``: the kernel log's tail, each ``/dev/kmsg`` record as the kernel gave it
  (``6,1234,5678901,-;NVRM: ...``: facility and priority kept, so the kernel-log reader judges
  a replayed record as it judges a live one).

``--simulate OUT.yaml`` and the stand-in NVML library (``NVML_FAKE_SCENARIO=OUT.yaml``) both
replay it. Everything the node reported is data: odd strings are written quoted, never run,
and a call that fails is recorded with its error.
"""

from __future__ import annotations

import collections
import errno
import os
import platform
import socket
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from node_agent import __version__
from node_agent.gpu.base import VIRTUALIZATION_MODES
from node_agent.gpu.pci import SYSFS_PCI_DEVICES, PciUnreadable, read_functions
from node_agent.gpu.replay import error_code, open_replay
from node_agent.hardware.sku import Sku
from node_agent.inventory import collect
from node_agent.model import utc_iso
from node_agent.yamlfile import ConfigError

FORMAT = 1
#: the kernel-log records a capture keeps (the ring buffer's tail)
KERNEL_LOG_RECORDS = 500
_KMSG = "/dev/kmsg"
#: nvmlReturn_t of a failed nvmlInit -> the scenario's ``driver`` state
_DRIVER_DOWN = {9: "not_loaded", 12: "not_installed"}


class CaptureError(Exception):
    """The capture cannot be written as asked; the message says what to do."""


def read_kmsg_tail(
    path: str = _KMSG, limit: int = KERNEL_LOG_RECORDS
) -> tuple[list[str], str | None]:
    """The last ``limit`` records of the kernel's ring buffer, each as ``/dev/kmsg`` gives it
    (``prio,seq,usec,flags;message``, its continuation ``KEY=value`` lines left out, kmsg's
    ``\\xNN`` escapes kept), and None; or no records and why not."""
    if limit <= 0:
        return [], None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        return [], f"cannot read {path}: {err.strerror or err} (run as root, or grant CAP_SYSLOG)"
    records: collections.deque[str] = collections.deque(maxlen=max(0, limit))
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except OSError as err:
                if err.errno == errno.EAGAIN:
                    break
                if err.errno == errno.EPIPE:  # overwritten while reading: skip ahead
                    continue
                return list(records), f"reading {path}: {err.strerror or err}"
            if not chunk:
                break
            record = chunk.decode("utf-8", "replace").split("\n", 1)[0]
            if ";" in record:
                records.append(record)
    finally:
        os.close(fd)
    return list(records), None


def read_file_tail(path: str, limit: int = KERNEL_LOG_RECORDS) -> tuple[list[str], str | None]:
    """The last ``limit`` lines of the kernel log the agent is configured to read
    (``kernel_log.path``), as they are; a character device there is read as kmsg. Opened as the
    agent's kernel-log reader opens it: no symlink followed, a regular file, and when running
    as root a file root owns and nobody else can write (anyone else could write "kernel"
    lines into it)."""
    if limit <= 0:
        return [], None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        return [], f"cannot read {path}: {err.strerror or err}"
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode):
            os.close(fd)
            fd = -1
            return read_kmsg_tail(path, limit)
        if not stat.S_ISREG(st.st_mode):
            return [], f"{path} is not a regular file"
        if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
            return [], (
                f"{path} is owned by uid {st.st_uid} or writable by others: a kernel "
                "log must be root's alone"
            )
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            fd = -1
            lines = collections.deque((line.rstrip("\r\n") for line in f), maxlen=limit)
    except OSError as err:
        return [], f"reading {path}: {err.strerror or err}"
    finally:
        if fd >= 0:
            os.close(fd)
    return [line for line in lines if line], None


def _clean(text: str) -> str:
    """One line for a YAML comment: control characters shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _replayed(nvml: dict[str, Any], skus: dict[str, Sku]) -> tuple[Any, Any, str | None]:
    """(the inventory, the driver, why NVML is unavailable) the agent reads from the
    recording, as the replay will."""
    backend = open_replay(nvml, source="the capture being written")
    try:
        return (
            collect(backend, skus, "auto", hostname="capture"),
            backend.driver(),
            backend.unavailable_reason,
        )
    finally:
        backend.close()


def build_scenario(
    nvml: dict[str, Any],
    pci: Sequence[dict[str, Any]],
    kernel_log: Sequence[str],
    skus: dict[str, Sku],
    provenance: dict[str, Any],
    hostname: str,
    sku: str | None = None,
) -> dict[str, Any]:
    """The capture as a scenario mapping (key order as written)."""
    inventory, driver, unavailable = _replayed(nvml, skus)
    if sku is not None and sku not in skus:
        raise CaptureError(
            f"--sku {sku!r} is not a SKU file under graders/skus/; expected one "
            f"of: {', '.join(sorted(skus))}"
        )
    chosen = sku or (inventory.sku.id if inventory.sku else None)
    if chosen is None:
        why = (
            f"NVML is not usable: {unavailable}"
            if unavailable
            else inventory.sku_problem or "NVML listed no GPU"
        )
        raise CaptureError(
            f"no SKU file matches this node ({why}): name one with --sku NAME "
            f"(one of: {', '.join(sorted(skus))}), or add a SKU file"
        )
    scenario: dict[str, Any] = {
        "capture": provenance,
        "sku": chosen,
        "hostname": _host_key(hostname),
    }
    init = (nvml.get("system") or {}).get("nvmlInit")
    if error_code(init) is not None:
        scenario["driver"] = _DRIVER_DOWN.get(error_code(init) or 0, "not_loaded")
    elif driver.driver_version:
        scenario["driver"] = driver.driver_version
    if driver.cuda_version:
        scenario["cuda"] = driver.cuda_version
    modes = [g.get("virtualization_mode") for g in nvml.get("gpus") or []]
    if modes and isinstance(modes[0], int) and 0 <= modes[0] < len(VIRTUALIZATION_MODES):
        scenario["virtualization"] = VIRTUALIZATION_MODES[modes[0]]
    scenario["pci"] = [dict(p) for p in pci]
    scenario["kernel_log"] = list(kernel_log)
    scenario["nvml"] = nvml
    return scenario


def _host_key(hostname: str) -> str:
    return hostname if hostname else "captured-node"


class _Flow(dict[str, Any]):
    """A recorded NVML error, written on one line: ``{error: Not Supported, code: 3}``."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Flow,
    lambda dumper, data: dumper.represent_mapping(
        "tag:yaml.org,2002:map", data.items(), flow_style=True
    ),
)


def _flowed(value: Any) -> Any:
    if isinstance(value, dict):
        if error_code(value) is not None:
            return _Flow(value)
        return {k: _flowed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_flowed(v) for v in value]
    return value


def dump(scenario: dict[str, Any], header: Sequence[str]) -> str:
    """The scenario file's text: ``header`` as comments, then the YAML."""
    lines = [f"# {_clean(line)}".rstrip() for line in header]
    body = yaml.dump(
        _flowed(scenario),
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=100,
        allow_unicode=False,
    )
    return "\n".join(lines) + ("\n" if lines else "") + body


def capture_node(
    skus: dict[str, Sku],
    argv: Sequence[str],
    sku: str | None = None,
    call_timeout_s: float = 10.0,
    kernel_log_records: int = KERNEL_LOG_RECORDS,
    pci_root: Path = SYSFS_PCI_DEVICES,
    kmsg_path: str = _KMSG,
    nvml_lib: Any = None,
    kernel_log_file: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Read this node and return (the scenario mapping, its header lines). The kernel log is
    ``/dev/kmsg``'s records, or the lines of ``kernel_log_file`` (``kernel_log.path``: a
    node whose kernel log the agent reads from a file)."""
    from node_agent.gpu.record import record_nvml

    now = utc_iso()
    nvml = record_nvml(call_timeout_s=call_timeout_s, lib=nvml_lib)
    try:
        pci: list[dict[str, Any]] = list(read_functions(pci_root))
        pci_note = None
    except PciUnreadable as err:
        pci, pci_note = [], str(err)
    log_source = kernel_log_file or kmsg_path
    records, log_note = (
        read_file_tail(kernel_log_file, kernel_log_records)
        if kernel_log_file
        else read_kmsg_tail(kmsg_path, kernel_log_records)
    )
    host = socket.gethostname()
    provenance: dict[str, Any] = {
        "format": FORMAT,
        "kind": "captured",
        "host": host,
        "date": now,
        "agent_version": __version__,
        "command": " ".join(["node-agent", *argv]),
        "kernel": platform.release(),
        "kernel_log": {
            "source": log_source,
            "records": len(records),
            **({"unavailable": log_note} if log_note else {}),
        },
        "pci": {"source": str(pci_root), **({"unavailable": pci_note} if pci_note else {})},
    }
    scenario = build_scenario(nvml, pci, records, skus, provenance, host.split(".")[0], sku)
    header = [
        f"node-agent capture of {host} at {now} (node-agent {__version__})",
        f"command: {provenance['command']}",
        "Replay: node-agent check --simulate THIS.yaml; or the stand-in NVML library "
        "(docs/capture.md).",
        "It holds this node's NVML readings, PCI functions and kernel-log tail: review "
        "before attaching it to a bug report.",
    ]
    return scenario, header


def write_capture(out: Path, text: str) -> None:
    """Write the file whole (temp file + rename, private), or say why not."""
    from node_agent.atomic_file import write_text

    try:
        write_text(out, text)
    except OSError as err:
        raise ConfigError(f"capture {out}: cannot write: {err.strerror or err}") from err
