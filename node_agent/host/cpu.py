"""CPUs: which are online, and the thermal throttle counters.

``/sys/devices/system/cpu/{online,present}`` hold CPU lists (``0-223``; Linux
``Documentation/ABI/testing/sysfs-devices-system-cpu``). On x86 the ``therm_throt`` driver
counts, per CPU, how often the core and its package crossed their thermal limits since boot:
``cpuN/thermal_throttle/core_throttle_count`` and ``package_throttle_count`` (the same ABI
file; each increment is one throttling episode, already logged as "CPU N: Core temperature
above threshold, cpu clock throttled"). Other architectures, and most VMs, have none.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.host.paths import parse_cpu_list, read_int, read_text

CPU_DIR = Path("devices/system/cpu")
_CPU = re.compile(r"^cpu(\d+)$")


@dataclass(frozen=True)
class CpuState:
    online: list[int] | None  # None: the online file is unreadable
    present: list[int] | None
    #: cpu -> (core_throttle_count, package_throttle_count); empty without therm_throt
    throttle: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    #: ``smt/control``: on, off, forceoff, notsupported, notimplemented; None unreadable
    smt: str | None = None


def _cpu_list(path: Path) -> list[int] | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return parse_cpu_list(text)
    except ValueError:
        return None


def read_cpus(sys_root: Path = Path("/sys")) -> CpuState:
    base = sys_root / CPU_DIR
    throttle: dict[int, tuple[int | None, int | None]] = {}
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        match = _CPU.match(name)
        if not match:
            continue
        tt = base / name / "thermal_throttle"
        if not tt.is_dir():
            continue
        throttle[int(match.group(1))] = (
            read_int(tt / "core_throttle_count"),
            read_int(tt / "package_throttle_count"),
        )
    return CpuState(
        online=_cpu_list(base / "online"),
        present=_cpu_list(base / "present"),
        throttle=dict(sorted(throttle.items())),
        smt=(read_text(base / "smt" / "control") or "").strip() or None,
    )


#: the therm_throt driver's lines (arch/x86/kernel/cpu/mce/therm_throt.c, ``therm_throt_process``;
#: ``mce: `` in front where the file sets pr_fmt, 5.x on; ``is above``/``is throttled`` in some
#: 5.x releases): the total is the same counter as ``core_throttle_count``/``package_throttle_count``
_THROTTLE = re.compile(
    r"^(?:mce: )?CPU(?P<cpu>\d{1,5}): (?P<kind>Core|Package) temperature (?:is )?above "
    r"threshold, (?:cpu|CPU) clock (?:is )?throttled(?: \(total events = (?P<total>\d+)\))?"
)
THROTTLE_WORDS = ("temperature",)


@dataclass(frozen=True)
class ThrottleLine:
    """One "CPUn: Core|Package temperature above threshold" line: the CPU, ``core`` or
    ``package``, and the driver's running total of such episodes (None where not printed)."""

    cpu: int
    kind: str
    total: int | None


def parse_throttle_message(message: str) -> ThrottleLine | None:
    """The thermal-throttle line ``message`` is (from its first character), or None.

    >>> parse_throttle_message("CPU3: Package temperature above threshold, cpu clock throttled "
    ...                        "(total events = 2263)")
    ThrottleLine(cpu=3, kind='package', total=2263)
    """
    m = _THROTTLE.match(message)
    if m is None:
        return None
    return ThrottleLine(
        cpu=int(m["cpu"]),
        kind=m["kind"].lower(),
        total=int(m["total"]) if m["total"] is not None else None,
    )


def throttle_from_lines(lines: list[ThrottleLine]) -> dict[int, tuple[int | None, int | None]]:
    """The counters the lines show, in :class:`CpuState`'s form (cpu -> (core, package)): each
    CPU's highest printed total, or the number of its lines where no total is printed."""
    seen: dict[int, dict[str, int]] = {}
    for line in lines:
        counts = seen.setdefault(line.cpu, {})
        value = line.total if line.total is not None else counts.get(line.kind, 0) + 1
        counts[line.kind] = max(counts.get(line.kind, 0), value)
    return {
        cpu: (counts.get("core"), counts.get("package")) for cpu, counts in sorted(seen.items())
    }
