"""RDMA ports as sysfs shows them (``/sys/class/infiniband/<dev>/ports/<n>/``): state, physical
state, rate, link layer and the error counters ``ibstat`` and ``ibv_devinfo`` read.

Below the checks and the training wing: the ``rdma`` check grades the ports, and the training
signals read the data counters of the ACTIVE ones (``training.activity``).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

SYSFS_ROOT = Path("/sys/class/infiniband")
COUNTERS = ("link_downed", "symbol_error", "port_rcv_errors")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


@dataclass(frozen=True)
class Port:
    """One RDMA port as sysfs shows it."""

    device: str
    port: str
    state: str  # "ACTIVE", "DOWN", "INIT", "ARMED" (from "4: ACTIVE")
    phys_state: str  # "LinkUp", "Polling", "Disabled" (from "5: LinkUp")
    rate_text: str  # "400 Gb/sec (4X NDR)"
    rate_gbps: float | None
    link_layer: str  # "InfiniBand" or "Ethernet"
    counters: dict[str, int | None] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"hca:{self.device}" if self.port == "1" else f"hca:{self.device}/{self.port}"


def ignored(device: str, port: str, names: Collection[str]) -> bool:
    """Whether a check's ``ignore`` list names this HCA (``mlx5_1``) or this port of it
    (``mlx5_1/2``): unused, uncabled, a management or storage NIC, never judged."""
    return device in names or f"{device}/{port}" in names


def parse_rate_gbps(text: str) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0; None when sysfs says something else.

    >>> parse_rate_gbps("200 Gb/sec (4X HDR)")
    200.0
    """
    match = _RATE.match(text)
    return float(match.group(1)) if match else None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _state_name(text: str) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"`` (sysfs prints the enum value, a colon, the name)."""
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def discover(root: Path = SYSFS_ROOT) -> list[Port]:
    """Every port of every RDMA device under ``root``, sorted by device and port."""
    ports: list[Port] = []
    if not root.is_dir():
        return ports
    for dev in sorted(p for p in root.iterdir() if (p / "ports").is_dir()):
        for port_dir in sorted((dev / "ports").iterdir(), key=lambda p: p.name):
            counters: dict[str, int | None] = {}
            for name in COUNTERS:
                text = _read(port_dir / "counters" / name)
                counters[name] = int(text) if text.isdigit() else None
            rate_text = _read(port_dir / "rate")
            ports.append(
                Port(
                    device=dev.name,
                    port=port_dir.name,
                    state=_state_name(_read(port_dir / "state")),
                    phys_state=_state_name(_read(port_dir / "phys_state")),
                    rate_text=rate_text,
                    rate_gbps=parse_rate_gbps(rate_text),
                    link_layer=_read(port_dir / "link_layer"),
                    counters=counters,
                )
            )
    return ports
