"""Where the host readers look: the roots of sysfs, procfs and /dev, and the tools.

One value handed to every reader, so a test or a stand-in node swaps the whole host at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostPaths:
    """The roots the host readers read under, and the programs they run (argv[0])."""

    sys: Path = Path("/sys")
    proc: Path = Path("/proc")
    dev: Path = Path("/dev")
    ipmitool: str = "ipmitool"
    nvme: str = "nvme"
    smartctl: str = "smartctl"  # smartmontools: the NVMe health log where nvme-cli is absent
    ipmi_sensors: str = "ipmi-sensors"  # FreeIPMI: the BMC where ipmitool is absent
    ipmi_sel: str = "ipmi-sel"
    #: said in results so a reader knows where the figures came from
    stand_in: bool = False


def read_text(path: Path) -> str | None:
    """The file's text without surrounding whitespace; None when it is absent or unreadable
    (PermissionError is raised: "only root can read it" is a reason, not an absence)."""
    try:
        return path.read_text(errors="replace").strip()
    except PermissionError:
        raise
    except OSError:
        return None


def read_int(path: Path) -> int | None:
    """A sysfs counter (``"12\\n"``) as an int; None when absent or not a number."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, 0) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's CPU list format (``/sys/devices/system/cpu/online``) -> sorted ids.

    Raises ValueError on text that is not one.

    >>> parse_cpu_list("0-3,8,10-11")
    [0, 1, 2, 3, 8, 10, 11]
    >>> parse_cpu_list("")
    []
    """
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"not a CPU list: {text!r}")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low or high - low > 1 << 16:
            raise ValueError(f"not a CPU list: {text!r}")
        out.update(range(low, high + 1))
    return sorted(out)


def format_cpu_list(cpus: list[int]) -> str:
    """Sorted ids -> the kernel's compact form.

    >>> format_cpu_list([0, 1, 2, 5, 7, 8])
    '0-2,5,7-8'
    """
    parts: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


_SAFE = re.compile(r"[^A-Za-z0-9_.#:@+-]+")


def entity_name(text: str, limit: int = 64) -> str:
    """A name read from hardware (a DIMM label, a sensor name) made fit for a target:
    whitespace and odd characters become ``_``, at most ``limit`` characters.

    >>> entity_name("CPU0 DIMM A1\\x1b[31m")
    'CPU0_DIMM_A1_31m'
    """
    return _SAFE.sub("_", text.strip()).strip("_")[:limit] or "unnamed"
