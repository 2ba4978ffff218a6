"""The mlx5 driver's kernel-log lines of trouble: which forms are graded, and the parser.

The driver prints through ``mlx5_core_err`` / ``_warn`` / ``_info``, so a message is
``mlx5_core <bdf>: <function>:<line>:(pid <n>): <text>``. The ``hca_ports`` check grades the
lines :func:`parse_mlx5_line` finds (docs/host_checks.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from node_agent.kernel_log import kernel_message
from node_agent.model import Status


@dataclass(frozen=True)
class KernelLineKind:
    metric: str
    status: Status
    pattern: re.Pattern[str]
    meaning: str


#: The mlx5 driver's lines this check grades. The driver prints through ``mlx5_core_err`` /
#: ``_warn`` / ``_info`` (``dev_err(dev, "%s:%d:(pid %d): " fmt, __func__, __LINE__, pid)``),
#: so a message is ``mlx5_core <bdf>: <function>:<line>:(pid <n>): <text>``; the function
#: prefix is optional here (older kernels print without it). Forms from Linux
#: drivers/net/ethernet/mellanox/mlx5/core/: events.c ``port_module`` (module status and
#: error strings), ``temp_warn``, ``mlx5_pcie_event``; cmd.c ``mlx5_cmd_out_err`` and the
#: command timeout; health.c ``poll_health``. gpud's kmsg_matcher.go and NVSentinel's syslog
#: patterns match the same lines (sample lines in tests/unit/test_hca_ports.py).
KERNEL_LINES: tuple[KernelLineKind, ...] = (
    KernelLineKind(
        "mlx5_module_temperature",
        Status.FAIL,
        re.compile(
            r"^Port module event\[error\]: module (?P<module>\d+), Cable error, High Temperature"
        ),
        "the port's cable module is over its temperature threshold and shuts down its link",
    ),
    KernelLineKind(
        "mlx5_module_error",
        Status.FAIL,
        re.compile(r"^Port module event\[error\]: module (?P<module>\d+), [^,]+, (?P<what>.+)"),
        "the port's cable module reports an error (power budget, bad or shorted cable, "
        "ports powered down for slot power)",
    ),
    KernelLineKind(
        "mlx5_asic_temperature",
        Status.WARN,
        re.compile(r"^High temperature on sensors with bit set"),
        "the adapter's firmware warns of high temperature on its sensors (airflow, fans)",
    ),
    KernelLineKind(
        "mlx5_insufficient_power",
        Status.WARN,
        re.compile(r"^Detected insufficient power on the PCIe slot \((?P<watts>\d+)W\)"),
        "the slot advertises less power than the adapter needs; it may throttle (on some "
        "platforms the slot advertises 0 W and the line is benign)",
    ),
    KernelLineKind(
        "mlx5_command_timeout",
        Status.FAIL,
        re.compile(
            r"^(?P<cmd>[A-Z0-9_]+)\(0x[0-9a-fA-F]+\) timeout\. Will cause a leak of a command resource"
        ),
        "the adapter's firmware did not answer a command: reset or reboot",
    ),
    KernelLineKind(
        "mlx5_command_failed",
        Status.WARN,
        re.compile(
            r"^(?P<cmd>[A-Z0-9_]+)\(0x[0-9a-fA-F]+\) op_mod\(0x[0-9a-fA-F]+\) failed, "
            r"status (?P<status>[^(]+)\(0x[0-9a-fA-F]+\)"
        ),
        "the adapter's firmware refused a command",
    ),
    KernelLineKind(
        "mlx5_health_compromised",
        Status.FAIL,
        re.compile(r"^device's health compromised - reached miss count"),
        "the adapter's firmware stopped updating its health counter (hung firmware)",
    ),
    KernelLineKind(
        "mlx5_fatal_error",
        Status.FAIL,
        re.compile(r"^Fatal error (?P<code>\d+) detected"),
        "the adapter's firmware reports a fatal error; the driver resets the device",
    ),
)
#: ACCESS_REG failures are what reading counters does on a DGX's firmware-restricted functions
#: (gpud issue 1164, node_exporter issue 3434): this check's own reads would flood them
IGNORED_COMMANDS = frozenset({"ACCESS_REG"})
_MLX5_PREFIX = re.compile(
    r"^mlx5_core (?P<bdf>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): "
    r"(?:[A-Za-z0-9_]+:\d+:\(pid \d+\): )?(?P<text>.*)$"
)


@dataclass(frozen=True)
class Mlx5Line:
    bdf: str
    kind: KernelLineKind
    text: str  # the message after the prefix
    raw: str


def parse_mlx5_line(line: str) -> Mlx5Line | None:
    """The graded mlx5 line in one kernel-log line, or None (not the kernel's, not the
    driver's prefix at the start of the message, not a graded form, or an ignored command).

    >>> parse_mlx5_line("mlx5_core 0000:5c:00.0: mlx5_pcie_event:299:(pid 268269): "
    ...                 "Detected insufficient power on the PCIe slot (27W).").kind.metric
    'mlx5_insufficient_power'
    """
    if "mlx5_core" not in line:
        return None
    found = kernel_message(line)
    if found is None:
        return None
    m = _MLX5_PREFIX.match(found[1])
    if m is None:
        return None
    text = m["text"]
    for kind in KERNEL_LINES:
        km = kind.pattern.match(text)
        if km is None:
            continue
        if "cmd" in km.groupdict() and km["cmd"] in IGNORED_COMMANDS:
            return None
        return Mlx5Line(m["bdf"].lower(), kind, text, line)
    return None
