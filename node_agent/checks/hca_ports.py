"""Check ``hca_ports``: every port of every HCA, from sysfs and the mlx5 driver's kernel lines.

Delivery runs perftest once (the ``rdma`` check); in service a port can go down, train at a
lower rate, flap or gather errors at any time, so this check reads only sysfs (milliseconds)
and runs in the quick, periodic and delivery suites, as gpud's infiniband component and Meta's
gcm watch their ports. Per port (target ``hca:<dev>``, ``hca:<dev>/<port>`` beyond port 1, as
the ``rdma`` check names them; device and port in the evidence):

* ``link_state`` — fail unless ``ACTIVE`` (``/sys/class/infiniband/<dev>/ports/<n>/state``).
* ``port_rate_gbps`` — the signalling rate (``rate``: ``400 Gb/sec (4X NDR)``) against the
  node's expectation: the SKU's ``ports`` of at least ``min_rate_gbps`` (the SKU file's
  ``hca`` section, from NVIDIA's DGX user guides, as gpud holds them), or where the SKU says
  nothing, the rate most ACTIVE ports of the same link layer run at. ``port_count`` (target
  ``node``) fails when fewer ports are ACTIVE at that rate than the config's
  ``node.expected_hca_ports`` declares (and ``node.expected_hca_rate_gbps``, over the SKU's
  rate); the SKU's count is its reference build (a DGX's 8), evidence only: the NICs belong to
  the server.
* ``port_missing`` — a port an earlier run saw is gone from sysfs (its HCA fell off the bus or
  lost its driver): fail until it is back.
* ``flaps`` — down-up cycles (growth of ``counters/link_downed``, or a run that found the port
  down and a later one ACTIVE) in the last 12 hours, kept in ``ctx.state_dir``: 3 or more ->
  warn (gpud's count), and fail when the port goes on cycling after the warning (``flaps`` in
  ``graders/hca.yaml`` says what "goes on" means).
* ``error_rates`` — the error counters of ``counters/`` and ``hw_counters/`` named in
  ``graders/hca.yaml``, as rates per hour against the last readings kept in ``ctx.state_dir``;
  a counter that went down was reset (a new baseline, never a negative rate).

And per HCA, ``mlx5_*`` results from the kernel log: module over temperature, other module
errors, the ASIC's temperature warning, insufficient PCIe slot power, firmware command failures
and timeouts, the firmware health poll (forms from drivers/net/ethernet/mellanox/mlx5/core/
events.c, cmd.c and health.c; see :data:`KERNEL_LINES`). Only kernel-facility records whose
message *starts* with ``mlx5_core <domain:bus:dev.fn>: `` are believed (docs/xid.md, "Rules of
belief"); the bus id becomes ``hca:<dev>`` through ``/sys/class/infiniband/<dev>/device``.

No RDMA device: skip with the reason. Params: ``sysfs_root`` (default
``/sys/class/infiniband``), ``ignore``
(``["mlx5_9", "mlx5_4/2"]``: ports not cabled on purpose), ``since`` (``boot``, default, or
``last_run``: kernel lines after the previous run's cursor). In the daemon the ports' error
counters are exported by the collector this check shares with ``rdma``
(:mod:`node_agent.checking.hca_metrics`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent import atomic_file, resources
from node_agent.checking import log_cursor
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.hca_metrics import HcaPortErrors
from node_agent.checking.params import Reader
from node_agent.checking.thresholds import refuse_thresholds
from node_agent.checking.xid_fold import keep_fuller
from node_agent.host import infiniband
from node_agent.kernel_log import LogRecord
from node_agent.kernel_log.mlx5_lines import KERNEL_LINES, Mlx5Line, parse_mlx5_line
from node_agent.model import Result, Status
from node_agent.yamlfile import ConfigError, load_yaml, validate

SYSFS_ROOT = infiniband.SYSFS_ROOT
STATE_FILE = "hca_ports.json"
#: params that held this node's expectation before it moved to the config (node.expected_hca_*)
MOVED_TO_NODE = ("ports", "min_rate_gbps")
NODE_KEYS = "the config's node.expected_hca_ports and node.expected_hca_rate_gbps"
UPTIME = Path("/proc/uptime")
#: the most down-up cycles one run adds to a port's history (a saturated or huge jump is still
#: "many"; the history stays small)
MAX_CYCLES_PER_RUN = 64

_NUM_OR_NULL = {"type": ["number", "null"], "minimum": 0}
HCA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["flaps", "min_window_h", "counters"],
    "properties": {
        "flaps": {
            "type": "object",
            "additionalProperties": False,
            "required": ["count", "window_h"],
            "properties": {
                "count": {"type": "integer", "minimum": 1},
                "window_h": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        "min_window_h": {"type": "number", "exclusiveMinimum": 0},
        "counters": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["dir", "warn_per_hour", "error_per_hour"],
                "properties": {
                    "dir": {"enum": ["counters", "hw_counters"]},
                    "warn_per_hour": _NUM_OR_NULL,
                    "error_per_hour": _NUM_OR_NULL,
                    "bits": {"type": "integer", "minimum": 1, "maximum": 64},
                },
            },
        },
    },
}


# --- what the ports are held to ----------------------------------------------------------------


@dataclass(frozen=True)
class CounterRule:
    """One error counter: where it lives, its thresholds (per hour; None: never that level)."""

    name: str
    dir: str  # "counters" | "hw_counters"
    warn_per_hour: float | None
    error_per_hour: float | None
    bits: int = 64

    @property
    def saturated_at(self) -> int | None:
        """The value a PortCounters counter stops at (IBTA: they saturate, never wrap)."""
        return 2**self.bits - 1 if self.bits < 64 else None


@dataclass(frozen=True)
class HcaGrading:
    """``graders/hca.yaml``."""

    flap_count: int
    flap_window_s: float
    min_window_s: float
    counters: tuple[CounterRule, ...]


def load_grading(path: Path) -> HcaGrading:
    """Read and validate ``hca.yaml``; ConfigError on any problem (an older file's ``skus``
    table included: its numbers are the SKU files' now, and a file that still has it must not
    be read as if they counted)."""
    data = load_yaml(path, what="HCA grading file")
    if isinstance(data, dict) and "skus" in data:
        raise ConfigError(
            f"{path}: the HCA grading file's `skus` table moved to the SKU files: give each "
            "graders/skus/<sku>.yaml an `hca: {ports, min_rate_gbps}` section with that SKU's "
            "entry, and delete `skus` from this file"
        )
    validate(data, HCA_SCHEMA, str(path))
    return HcaGrading(
        flap_count=data["flaps"]["count"],
        flap_window_s=float(data["flaps"]["window_h"]) * 3600,
        min_window_s=float(data["min_window_h"]) * 3600,
        counters=tuple(
            CounterRule(
                name=name,
                dir=c["dir"],
                warn_per_hour=c["warn_per_hour"],
                error_per_hour=c["error_per_hour"],
                bits=c.get("bits", 64),
            )
            for name, c in data["counters"].items()
        ),
    )


#: the last file read, by (path, mtime_ns, size): the daemon runs the check every 15 s, and
#: parsing the YAML was a third of a run's time
_LOADED: dict[tuple[str, int, int], HcaGrading] = {}


def grading(ctx: CheckContext) -> HcaGrading:
    """``hca.yaml`` of the configured graders directory (the shipped one where an operator's
    directory predates the file), read again only when the file changes."""
    path = resources.graders_dir(ctx.config) / "hca.yaml"
    if not path.exists():
        path = resources.shipped_graders_dir() / "hca.yaml"
    try:
        st = path.stat()
    except OSError:
        return load_grading(path)  # says what is wrong with it
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_grading(path)
    return _LOADED[key]


@dataclass(frozen=True)
class Expectation:
    """At least ``ports`` ports ACTIVE at ``min_rate_gbps`` or faster; None: not declared.

    ``declared``: the count is this node's (``node.expected_hca_ports``), not the SKU's reference
    build (a DGX's 8): only a declared count that is short fails by itself; the NICs belong to
    the server, and a server built with fewer is not broken. A port that was there and is gone
    fails either way (``port_missing``).
    """

    ports: int | None
    min_rate_gbps: float | None
    source: str
    declared: bool = False


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    sysfs_root: str | None = None  # None: the node's (this host's SYSFS_ROOT, or a stand-in's)
    since: str = "boot"  # the mlx5 kernel lines read: since boot, or since the last run
    ignore: tuple[str, ...] = ()  # HCAs (mlx5_1) or ports (mlx5_1/2) not judged

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected (for a threshold: its home)."""
        refuse_thresholds("hca_ports", raw, MOVED_TO_NODE, NODE_KEYS)
        r = Reader("hca_ports", raw, cls)
        return cls(
            sysfs_root=r.optional_string("sysfs_root"),
            since=r.choice("since", ("boot", "last_run")),
            ignore=r.strings("ignore", lone=True),
        )


def expectation(ctx: CheckContext) -> Expectation:
    """This node's ``node.expected_hca_ports``/``expected_hca_rate_gbps``, else the SKU's
    ``hca`` section, else nothing declared."""
    node = ctx.config.node
    if node.expected_hca_ports is not None or node.expected_hca_rate_gbps is not None:
        return Expectation(
            node.expected_hca_ports,
            node.expected_hca_rate_gbps,
            "node.expected_hca_ports in the config",
            declared=node.expected_hca_ports is not None,
        )
    if ctx.sku is None:
        return Expectation(None, None, "no SKU")
    entry = ctx.sku.section("hca")
    if not entry:
        return Expectation(None, None, f"SKU {ctx.sku.id} declares no HCA ports")
    return Expectation(int(entry["ports"]), float(entry["min_rate_gbps"]), f"SKU {ctx.sku.id}")


# --- reading sysfs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PortReading:
    """One port (``infiniband.Port``: state, rate, link layer) and its error counters."""

    port: infiniband.Port
    counters: dict[str, int | None] = field(default_factory=dict)
    link_downed: int | None = None

    @property
    def key(self) -> str:
        return f"{self.port.device}/{self.port.port}"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def read_ports(root: Path, rules: tuple[CounterRule, ...]) -> list[PortReading]:
    """Every port under ``root`` with the counters ``rules`` name (None: absent or unreadable,
    e.g. ``N/A (no PMA)``)."""
    out = []
    for port in infiniband.discover(root):
        base = root / port.device / "ports" / port.port
        counters = {r.name: _read_int(base / r.dir / r.name) for r in rules}
        out.append(PortReading(port, counters, _read_int(base / "counters" / "link_downed")))
    return out


def hca_bus_ids(root: Path) -> dict[str, str]:
    """``{"0000:0c:00.0": "mlx5_0"}``: each HCA's PCI function, from its ``device`` link."""
    found: dict[str, str] = {}
    try:
        devices = sorted(root.iterdir())
    except OSError:
        return found
    for dev in devices:
        try:
            found[(dev / "device").resolve(strict=True).name.lower()] = dev.name
        except OSError:
            continue
    return found


def uptime_s(path: Path = UPTIME) -> float | None:
    """Seconds since boot (``/proc/uptime``'s first field); None where unreadable."""
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# --- the check ---------------------------------------------------------------------------------


def run(ctx: CheckContext) -> list[Result]:
    now = ctx.ports.clock()
    root = ctx.typed_params(Params).sysfs_root
    if ctx.ports.rdma_tree is not None and root is None:
        # The HCAs the node's ports build (a stand-in's: a sysfs tree written for this run),
        # read below exactly as the real one is.
        with ctx.ports.rdma_tree(now) as view:
            if view.absent is not None:
                return [ctx.skip(view.absent)]
            return check(ctx, view.sysfs_root, now=now, uptime=view.uptime_s)
    return check(ctx, Path(root or SYSFS_ROOT), now=now, uptime=uptime_s())


def check(
    ctx: CheckContext, root: Path, now: float, uptime: float | None, table: HcaGrading | None = None
) -> list[Result]:
    """The whole check on the tree at ``root`` at time ``now`` (Unix seconds), the node up for
    ``uptime`` seconds (None: unknown). Reads and rewrites ``ctx.state_dir``'s state file."""
    table = table or grading(ctx)
    try:
        readings = read_ports(root, table.counters)
    except OSError as err:
        return [
            ctx.result(
                "node",
                "ran",
                Status.ERROR,
                f"cannot list the HCA ports under {root}: {err.strerror or err}",
            )
        ]
    if not readings:
        return [
            ctx.skip(
                f"no RDMA device: {root} lists no ports (no InfiniBand/RoCE HCA, or "
                "its driver is not loaded)"
            )
        ]
    ignore = set(ctx.typed_params(Params).ignore)
    watched = [r for r in readings if not infiniband.ignored(r.port.device, r.port.port, ignore)]
    results = [
        ctx.skip(
            f"{r.port.device} port {r.port.port} is in the suite's ignore list",
            target=r.port.target,
            metric="link_state",
        )
        for r in readings
        if r not in watched
    ]
    results += link_results(ctx, watched, expectation(ctx))
    state = load_state(ctx)
    kept = state.get("ports") or {}
    # a port no longer in sysfs keeps only when it went missing; one that comes back starts a
    # new baseline
    ports_state = state["ports"] = {}
    buses = hca_bus_ids(root)
    bus_of = {device: bus for bus, device in buses.items()}
    results += missing_results(
        ctx, kept, {r.key for r in readings}, ignore, ports_state, now, set(buses)
    )
    for reading in watched:
        previous = kept.get(reading.key)
        previous = previous if isinstance(previous, dict) else None
        previous = None if previous and previous.get("missing_since") else previous
        flap, ports_state[reading.key] = flap_result(ctx, reading, previous, now, uptime, table)
        if reading.port.device in bus_of:
            ports_state[reading.key]["bus"] = bus_of[reading.port.device]
        results.append(flap)
        rates, ports_state[reading.key]["counters"] = rate_result(
            ctx, reading, (previous or {}).get("counters") or {}, now, table
        )
        results.append(rates)
    results += kernel_line_results(ctx, buses, state)
    if ctx.state_dir is None:
        for r in results:
            if r.metric in ("flaps", "error_rates"):
                r.evidence["history"] = (
                    "none kept: no writable state directory, so flaps and rates see this run alone"
                )
    else:
        save_state(ctx, state)
    return results


def link_results(
    ctx: CheckContext, readings: list[PortReading], expect: Expectation
) -> list[Result]:
    """``link_state`` and ``port_rate_gbps`` per port, ``port_count`` for the node."""
    active = [r.port for r in readings if r.port.state == "ACTIVE"]
    fast = [
        p
        for p in active
        if expect.min_rate_gbps is None
        or (p.rate_gbps is not None and p.rate_gbps >= expect.min_rate_gbps)
    ]
    short = expect.ports is not None and len(fast) < expect.ports
    out: list[Result] = [] if expect.ports is None else [_port_count(ctx, fast, expect, short)]
    majority = _majority_rates(active)
    for reading in readings:
        out.extend(_port_results(ctx, reading.port, expect, short, majority))
    return out


def _port_count(
    ctx: CheckContext, fast: list[infiniband.Port], expect: Expectation, short: bool
) -> Result:
    """``port_count``: the ports ACTIVE at the expected rate against the count expected."""
    rate_text = (
        f"{expect.min_rate_gbps:g} Gb/s or faster"
        if expect.min_rate_gbps is not None
        else "any rate"
    )
    if not short:
        tail = ""
    elif expect.declared:
        tail = ": an HCA is missing, down or trained at a lower rate"
    else:
        tail = (
            " in its reference build; this server has fewer (set the config's "
            "node.expected_hca_ports to this server's count to grade a missing one)"
        )
    return ctx.result(
        "node",
        "port_count",
        Status.FAIL if short and expect.declared else Status.PASS,
        f"{len(fast)} HCA port(s) ACTIVE at {rate_text}, {expect.source} "
        f"{'expects' if expect.declared else 'has'} at least {expect.ports}{tail}",
        value=len(fast),
        unit="ports",
        expected=expect.ports,
        declared=expect.declared,
        min_rate_gbps=expect.min_rate_gbps,
        source=expect.source,
        ports=sorted(f"{p.device}/{p.port}" for p in fast),
    )


def _port_results(
    ctx: CheckContext,
    port: infiniband.Port,
    expect: Expectation,
    short: bool,
    majority: dict[str, float],
) -> list[Result]:
    """One port's ``link_state`` and, when it is up, its ``port_rate_gbps``."""
    ev = {
        "device": port.device,
        "port": port.port,
        "link_layer": port.link_layer,
        "phys_state": port.phys_state,
    }
    up = port.state == "ACTIVE"
    state = ctx.result(
        port.target,
        "link_state",
        Status.PASS if up else Status.FAIL,
        f"{port.device} port {port.port} is {port.state or 'unknown'} ({port.phys_state})"
        + (
            ""
            if up
            else ": no traffic passes; check the cable, the switch port and the "
            "subnet manager (list the port under the check's `ignore` if it is unused)"
        ),
        value=port.state,
        **ev,
    )
    if not up:
        return [state]
    if port.rate_gbps is None:
        return [
            state,
            ctx.result(
                port.target,
                "port_rate_gbps",
                Status.ERROR,
                f"cannot read the rate of {port.device} port {port.port}: {port.rate_text!r}",
                **ev,
            ),
        ]
    return [state, _rate_result(ctx, port, expect, short, majority.get(port.link_layer), ev)]


def missing_results(
    ctx: CheckContext,
    kept: dict[str, Any],
    present: set[str],
    ignore: set[str],
    ports_state: dict[str, Any],
    now: float,
    present_buses: set[str],
) -> list[Result]:
    """``port_missing`` (fail) for each port the state knew that sysfs no longer lists: its HCA
    fell off the bus or lost its driver. It stays failing until the port is back (its state
    entry keeps when it went missing). A port whose HCA's PCI function is still there under
    another name (udev's or rdma_rename's ``ibp12s0`` for ``mlx5_8``) was renamed, not lost."""
    out = []
    for key, entry in sorted(kept.items()):
        device, _, port = key.partition("/")
        if (
            key in present
            or infiniband.ignored(device, port, ignore)
            or not isinstance(entry, dict)
        ):
            continue
        if entry.get("bus") in present_buses:
            continue
        since = float(entry.get("missing_since") or now)
        ports_state[key] = {"missing_since": since}
        if isinstance(entry.get("bus"), str):
            ports_state[key]["bus"] = entry["bus"]
        target = f"hca:{device}" if port == "1" else f"hca:{device}/{port}"
        ago = (now - since) / 60
        out.append(
            ctx.result(
                target,
                "port_missing",
                Status.FAIL,
                f"{device} port {port} was in sysfs at an earlier run and is gone"
                + (f" (for {ago:.0f} min)" if ago >= 1 else "")
                + ": the HCA fell off the PCI bus or its driver unloaded (`dmesg | grep mlx5`, "
                "`lspci -d 15b3:`); reseat or replace it",
                device=device,
                port=port,
                missing_since=since,
            )
        )
    return out


def _majority_rates(ports: list[infiniband.Port]) -> dict[str, float]:
    """Per link layer, the rate more than half of its ACTIVE ports run at (2 ports or more)."""
    out = {}
    for layer in {p.link_layer for p in ports}:
        rates = [p.rate_gbps for p in ports if p.link_layer == layer and p.rate_gbps is not None]
        if len(rates) < 2:
            continue
        rate, n = Counter(rates).most_common(1)[0]
        if n * 2 > len(rates):
            out[layer] = rate
    return out


def _rate_result(
    ctx: CheckContext,
    port: infiniband.Port,
    expect: Expectation,
    short: bool,
    peers: float | None,
    ev: dict[str, Any],
) -> Result:
    rate = port.rate_gbps or 0.0
    head = f"{port.device} port {port.port} at {port.rate_text}"
    if expect.min_rate_gbps is not None:
        low = rate < expect.min_rate_gbps
        if low and (short or expect.ports is None):
            status, detail = (
                Status.FAIL,
                (
                    f"{head}, below the {expect.min_rate_gbps:g} Gb/s {expect.source} expects: the "
                    "link trained at a lower speed (reseat or replace the cable or transceiver)"
                ),
            )
        elif low:
            status, detail = (
                Status.PASS,
                (
                    f"{head}: not one of the {expect.ports} fabric ports at "
                    f"{expect.min_rate_gbps:g} Gb/s (those are all there)"
                ),
            )
        else:
            status, detail = Status.PASS, head
        return ctx.result(
            port.target,
            "port_rate_gbps",
            status,
            detail,
            value=rate,
            unit="Gb/s",
            minimum=expect.min_rate_gbps,
            source=expect.source,
            rate=port.rate_text,
            **ev,
        )
    if peers is not None and rate < peers:
        return ctx.result(
            port.target,
            "port_rate_gbps",
            Status.FAIL,
            f"{head}, below the {peers:g} Gb/s most of this node's "
            f"{port.link_layer} ports run at: the link trained at a lower speed",
            value=rate,
            unit="Gb/s",
            peers_gbps=peers,
            source="the node's ports",
            rate=port.rate_text,
            **ev,
        )
    return ctx.result(
        port.target,
        "port_rate_gbps",
        Status.PASS,
        head
        + (
            ""
            if peers is not None
            else " (no expectation declared and no majority of peers to compare)"
        ),
        value=rate,
        unit="Gb/s",
        peers_gbps=peers,
        source="the node's ports",
        rate=port.rate_text,
        **ev,
    )


# --- flaps -------------------------------------------------------------------------------------


def _cycles(
    reading: PortReading,
    previous: dict[str, Any] | None,
    now: float,
    uptime: float | None,
    window: float,
) -> tuple[list[float], str]:
    """The times of the port's down-up cycles: the stored ones and those since the last
    reading (on a first reading, those since boot where boot is inside the window), and a note
    on how they were counted."""
    port, value = reading.port, reading.link_downed
    cycles = [float(t) for t in (previous or {}).get("cycles", [])]
    note = ""
    if previous is None:
        if value:
            if uptime is not None and uptime <= window:
                # the counters start at zero when the driver loads: every step of link_downed
                # happened since boot, inside the window
                cycles += [now - uptime] * min(value, MAX_CYCLES_PER_RUN)
                note = f"first reading: {value} link-down event(s) since boot {uptime / 3600:.1f} h ago"
            else:
                note = (
                    f"first reading: link_downed is {value} since the counters were cleared, "
                    "too long ago to place in the window; growth from now on is counted"
                )
        return cycles, note
    before = previous.get("link_downed")
    grown = value - before if value is not None and before is not None and value >= before else 0
    came_up = previous.get("state") not in (None, "ACTIVE") and port.state == "ACTIVE"
    new = min(max(grown, int(came_up)), MAX_CYCLES_PER_RUN)
    cycles += [now] * new
    if value is not None and before is not None and value < before:
        note = f"link_downed went from {before} to {value}: the counters were reset"
    return cycles, note


def flap_result(
    ctx: CheckContext,
    reading: PortReading,
    previous: dict[str, Any] | None,
    now: float,
    uptime: float | None,
    table: HcaGrading,
) -> tuple[Result, dict[str, Any]]:
    """The port's ``flaps`` result and its new state (last state and link_downed, the times of
    its down-up cycles in the window, when the flap WARN was first raised)."""
    port = reading.port
    window = table.flap_window_s
    value = reading.link_downed
    cycles, note = _cycles(reading, previous, now, uptime, window)
    cycles = sorted(t for t in cycles if t > now - window)
    warned_at = (previous or {}).get("warned_at")
    status = Status.PASS
    if len(cycles) >= table.flap_count:
        warned_at = now if warned_at is None else float(warned_at)
        after = [t for t in cycles if t > warned_at]
        status = Status.FAIL if len(after) >= table.flap_count else Status.WARN
    else:
        warned_at = None
    hours = window / 3600
    if status is Status.FAIL:
        detail = (
            f"{port.device} port {port.port} keeps flapping: {len(cycles)} down-up cycles "
            f"in {hours:g} h, {len(after)} of them after the first warning; replace the "
            "cable or transceiver, or move the port"
        )
    elif status is Status.WARN:
        detail = (
            f"{port.device} port {port.port} flapped: {len(cycles)} down-up cycles in "
            f"{hours:g} h (a marginal cable, transceiver or switch port)"
        )
    else:
        detail = f"{port.device} port {port.port}: {len(cycles)} down-up cycle(s) in {hours:g} h"
    state = {
        "t": now,
        "state": port.state,
        "link_downed": value,
        "cycles": cycles,
        "warned_at": warned_at,
    }
    result = ctx.result(
        port.target,
        "flaps",
        status,
        detail + (f" ({note})" if note else ""),
        value=len(cycles),
        unit="cycles",
        window_h=hours,
        threshold=table.flap_count,
        link_downed=value,
        warned_at=warned_at,
        device=port.device,
        port=port.port,
    )
    return result, state


# --- error counters as rates -------------------------------------------------------------------


def rate_result(
    ctx: CheckContext,
    reading: PortReading,
    history: dict[str, list[list[float]]],
    now: float,
    table: HcaGrading,
) -> tuple[Result, dict[str, list[list[float]]]]:
    """The port's ``error_rates`` result and each counter's kept readings ``[[t, value], ...]``.

    A rate is the increase since the oldest reading kept (the last ``min_window_h``, and the
    newest one before it) over at least ``min_window_h``; a counter below its last reading was
    reset and starts a new history with no rate this run.
    """
    port = reading.port
    rates: dict[str, float] = {}
    notes: list[str] = []
    over: list[tuple[Status, str]] = []
    kept: dict[str, list[list[float]]] = {}
    for rule in table.counters:
        value = reading.counters.get(rule.name)
        if value is None:
            continue
        samples = [list(s) for s in history.get(rule.name, [])]
        if samples and value < samples[-1][1]:
            notes.append(f"{rule.name} went from {int(samples[-1][1])} to {value}: reset")
            samples = []
        if samples:
            first_t, first_v = samples[0]
            rate = (value - first_v) * 3600 / max(now - first_t, table.min_window_s)
            rates[rule.name] = round(rate, 3)
            level = _over(rule, rate)
            if level is not None:
                limit = rule.error_per_hour if level is Status.FAIL else rule.warn_per_hour
                over.append((level, f"{rule.name} {rate:.1f}/h (over {limit:g}/h)"))
        if rule.saturated_at is not None and value >= rule.saturated_at:
            notes.append(
                f"{rule.name} is saturated at {value} (it no longer counts; clear the "
                "port's counters, e.g. `perfquery -x -R`)"
            )
        kept[rule.name] = _keep(samples, now, value, table.min_window_s)
    status = max((s for s, _ in over), key=_rank, default=Status.PASS)
    if over:
        detail = (
            f"{port.device} port {port.port} error rates over their thresholds: "
            + ", ".join(text for _, text in over)
            + " (bit errors of a marginal cable or transceiver, or a port in trouble)"
        )
    elif rates:
        detail = f"{port.device} port {port.port}: error rates under their thresholds"
    else:
        detail = f"{port.device} port {port.port}: first reading of its error counters (baseline)"
    if notes:
        detail += "; " + "; ".join(notes)
    result = ctx.result(
        port.target,
        "error_rates",
        status,
        detail,
        value=max(rates.values(), default=None),
        unit="errors/h",
        rates_per_hour=rates,
        notes=notes,
        device=port.device,
        port=port.port,
        # the counters as read, at the top level as the rdma check has them
        # (the daemon's metrics export them: node_agent_hca_port_errors)
        link_downed=reading.link_downed,
        **reading.counters,
    )
    return result, kept


def _over(rule: CounterRule, rate: float) -> Status | None:
    if rule.error_per_hour is not None and rate > rule.error_per_hour:
        return Status.FAIL
    if rule.warn_per_hour is not None and rate > rule.warn_per_hour:
        return Status.WARN
    return None


def _rank(status: Status) -> int:
    return {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2}.get(status, 0)


def _keep(samples: list[list[float]], now: float, value: int, window_s: float) -> list[list[float]]:
    """The readings to keep: those of the last ``window_s`` and the newest before them, at most
    one per ``window_s / 12`` (the newest replaces a closer one), then this one."""
    old = [s for s in samples if s[0] <= now - window_s]
    kept = old[-1:] + [s for s in samples if s[0] > now - window_s]
    if len(kept) >= 2 and now - kept[-2][0] < window_s / 12:
        kept[-1] = [now, value]
    else:
        kept.append([now, value])
    return kept


# --- the mlx5 driver's kernel lines (graded forms: node_agent.kernel_log.mlx5_lines) -----------

_KEPT_LINES = 3


def kernel_line_results(
    ctx: CheckContext, buses: dict[str, str], state: dict[str, Any]
) -> list[Result]:
    """One result per HCA and graded form found in the kernel log (``since`` boot or the last
    run's cursor), or one ``kernel_lines`` pass/skip for the node."""
    log = ctx.kernel_log
    if log.unavailable_reason:
        return [
            ctx.skip(
                f"the mlx5 driver's kernel lines cannot be read: {log.unavailable_reason}",
                metric="kernel_lines",
            )
        ]
    since = ctx.typed_params(Params).since
    cursor = None
    if since == "last_run":
        saved = state.get("kernel_cursor") or {}
        if saved.get("boot_id") == log_cursor.boot_id() and saved.get("source") == log.source:
            cursor = saved.get("seq")
    try:
        records = log.read()
    except OSError as err:
        return [
            ctx.result(
                "node",
                "kernel_lines",
                Status.ERROR,
                f"cannot read the kernel log {log.source}: {err}",
            )
        ]
    found = _mlx5_lines(records, cursor, buses)
    if since == "last_run" and records:
        state["kernel_cursor"] = {
            "boot_id": log_cursor.boot_id(),
            "source": log.source,
            "seq": records[-1].seq,
        }
    window = "since the last run" if cursor is not None else "in the kernel log"
    if not found:
        return [
            ctx.result(
                "node",
                "kernel_lines",
                Status.PASS,
                f"no mlx5 driver line of trouble {window} ({log.source})",
                source=log.source,
            )
        ]
    return [
        ctx.result(
            target,
            metric,
            lines[0].kind.status,
            f"{target}: {len(lines)} mlx5 line(s) {window}: {lines[0].kind.meaning} — "
            f"{lines[-1].text[:200]}",
            value=len(lines),
            unit="lines",
            count=len(lines),
            bus_id=lines[0].bdf,
            source=log.source,
            lines=[x.raw[:300] for x in lines[:_KEPT_LINES]],
            last=lines[-1].raw[:300] if len(lines) > _KEPT_LINES else None,
        )
        for (target, metric), lines in sorted(found.items())
    ]


def _mlx5_lines(
    records: list[LogRecord], cursor: int | None, buses: dict[str, str]
) -> dict[tuple[str, str], list[Mlx5Line]]:
    """The mlx5 driver's graded lines after ``cursor``, by (HCA target, metric)."""
    found: dict[tuple[str, str], list[Mlx5Line]] = {}
    for record in records:
        if (cursor is not None and record.seq <= cursor) or not record.from_kernel:
            continue
        line = parse_mlx5_line(record.text.split("\n", 1)[0])
        if line is not None:
            target = f"hca:{buses.get(line.bdf, line.bdf)}"
            found.setdefault((target, line.kind.metric), []).append(line)
    return found


# --- state -------------------------------------------------------------------------------------


def _state_path(ctx: CheckContext) -> Path | None:
    return ctx.state_dir / STATE_FILE if ctx.state_dir else None


def load_state(ctx: CheckContext) -> dict[str, Any]:
    """The last run's readings; empty where there are none or they cannot be read (a corrupt
    file means a new baseline: rates and flaps start over, nothing is invented)."""
    path = _state_path(ctx)
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("ports", {}), dict) else {}


def save_state(ctx: CheckContext, state: dict[str, Any]) -> None:
    path = _state_path(ctx)
    if path is not None:
        atomic_file.write_json(path, state)


#: the metrics of the mlx5 driver's kernel-line findings
_KERNEL_LINE_METRICS = frozenset(kind.metric for kind in KERNEL_LINES)


def sticky_key(result: Result) -> tuple[str, str] | None:
    """An mlx5 kernel-line finding (warn or fail) stays part of the daemon's grade for its life
    in this boot, whichever window a later run reads: the periodic suite reads
    ``since: last_run``, so a line is read once. One per (metric, HCA target). The sysfs
    findings (state, rate, flaps, error rates) are read afresh each run and are not kept."""
    if result.status in (Status.WARN, Status.FAIL) and result.metric in _KERNEL_LINE_METRICS:
        return (result.metric, result.target)
    return None


SERVICE = ServiceBehaviour(sticky=sticky_key, fold=keep_fuller, metrics=HcaPortErrors)
