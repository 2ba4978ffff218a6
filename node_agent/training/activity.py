"""Device-activity and log-silence hang signals: GPU activity, RDMA port traffic, log silence.

Three of the ``training_progress`` check's independent ways of looking at a training process
(see :mod:`node_agent.training.signals` and ``docs/training_hangs.md``), from issue 10:

* ``gpu_activity`` — every GPU of the process reads busy (``utilization.gpu``) while its power
  draw and memory traffic sit near idle: the signature of a kernel spinning on a peer.
* ``rdma_traffic`` — the RDMA port data counters (``port_xmit_data``/``port_rcv_data``) did
  not move over a window while the job is alive.
* ``log_silence`` — the job's configured log file was not written for a configured time.

Each is cheap enough to run every few seconds: one NVML utilization and power query per GPU,
a handful of sysfs reads per RDMA port, one ``stat`` of a file. Readers take their device or
path as a parameter and judges take the clock reading (``now``) as one, so tests hand in fakes.
Nothing here raises on bad input: what cannot be read becomes an unavailable
:class:`~node_agent.training.signals.Signal` that says why (it neither accuses nor clears).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.gpu.base import GpuDevice, GpuError
from node_agent.host import infiniband
from node_agent.training.signals import Signal

# -- GPU activity --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuActivity:
    """One reading of one GPU (``nvidia-smi --query-gpu=index,utilization.gpu,
    utilization.memory,power.draw,enforced.power.limit``).

    ``gpu_pct``: percent of the last NVML sample period (1/6 s to 1 s, by product) in which a
    kernel was executing. ``memory_pct``: percent of it in which device memory was read or
    written. ``power_w``: draw; ``power_limit_w``: the enforced limit (the default limit where
    the enforced one is not reported). A field is None when the GPU did not answer it;
    ``errors`` then says why, one line per failed query.
    """

    index: int
    gpu_pct: int | None
    memory_pct: int | None
    power_w: float | None
    power_limit_w: float | None
    errors: tuple[str, ...] = ()


def read_gpu_activity(device: GpuDevice) -> GpuActivity:
    """Read ``device``'s utilization and power; a query that fails leaves its fields None.

    Never raises a :class:`~node_agent.gpu.base.GpuError`: NotSupported, NoPermission,
    DeviceLost and GpuTimeout are recorded in ``errors`` with their messages."""
    errors: list[str] = []

    def failed(query: str, err: GpuError) -> None:
        errors.append(f"{query}: {type(err).__name__}: {err}")

    gpu_pct = memory_pct = None
    try:
        util = device.utilization()
        gpu_pct, memory_pct = util.gpu_pct, util.memory_pct
    except GpuError as err:
        failed("utilization", err)
    power_w = limit_w = None
    try:
        power = device.power()
        power_w = power.usage_w
        limit_w = (
            power.enforced_limit_w if power.enforced_limit_w is not None else power.default_limit_w
        )
    except GpuError as err:
        failed("power", err)
    return GpuActivity(device.index, gpu_pct, memory_pct, power_w, limit_w, tuple(errors))


def _missing_fields(reading: GpuActivity) -> list[str]:
    missing = [
        name
        for name in ("gpu_pct", "memory_pct", "power_w", "power_limit_w")
        if getattr(reading, name) is None
    ]
    if reading.power_limit_w is not None and reading.power_limit_w <= 0:
        missing.append("power_limit_w (not positive)")
    return missing


def gpu_activity_signal(
    readings: Sequence[GpuActivity],
    *,
    busy_pct: float = 90,
    idle_memory_pct: float = 10,
    idle_power_fraction: float = 0.4,
) -> Signal:
    """The ``gpu_activity`` signal of one process's GPUs (one reading each).

    ``hang`` when EVERY GPU shows the spin signature: ``gpu_pct >= busy_pct`` while
    ``memory_pct <= idle_memory_pct`` and ``power_w <= idle_power_fraction * power_limit_w``.
    An idle GPU (low ``gpu_pct``) is not the signature: this signal says nothing about it.
    Unavailable with no readings, or when any GPU lacks a field the judgement needs.
    Figures: ``gpus`` (each reading with ``spinning``) and the three thresholds.

    >>> gpu_activity_signal([GpuActivity(0, 100, 0, 120.0, 700.0)]).hang
    True
    """
    # Why this signature: NVML's utilization.gpu is the share of time in which *a* kernel is
    # resident on the GPU, however little it does (nvmlUtilization_t, NVML API reference). An
    # NCCL kernel spinning on a flag for a peer that never arrives therefore reads 100% while
    # it draws little more than idle power and moves no device memory; a working GEMM or
    # training step draws far more power and keeps memory busy. Thresholds:
    #   busy_pct=90: judgement. A spinning kernel is resident all the time (100%); 90 leaves
    #     room for a sample period (1/6 s to 1 s) that straddles the kernel's launch.
    #   idle_memory_pct=10: judgement. A spinning kernel polls a few flags (~0%); a training
    #     step's GEMMs, attention and optimizer stream HBM for much of every step, well above 10.
    #   idle_power_fraction=0.4: judgement. An idle H100 SXM draws roughly 10-15% of its 700 W
    #     limit; a training step sits well above half of it. 0.4 lies between and errs towards
    #     "working" (a false hang needs low power AND low memory traffic AND full utilization).
    #   None of the three is a measurement yet; bench them on a GPU host before tightening.
    if not readings:
        return Signal.unavailable(
            "gpu_activity",
            "no GPU readings: the process's GPUs are not known, so their activity cannot be judged",
        )
    thresholds = {
        "busy_pct": busy_pct,
        "idle_memory_pct": idle_memory_pct,
        "idle_power_fraction": idle_power_fraction,
    }
    gpus, incomplete = _gpu_figures(readings)
    if incomplete:
        return Signal.unavailable(
            "gpu_activity",
            "cannot judge GPU activity: " + "; ".join(incomplete),
            gpus=gpus,
            **thresholds,
        )
    for r, gpu in zip(readings, gpus, strict=True):
        assert r.gpu_pct is not None and r.memory_pct is not None  # checked above
        assert r.power_w is not None and r.power_limit_w is not None
        gpu["spinning"] = (
            r.gpu_pct >= busy_pct
            and r.memory_pct <= idle_memory_pct
            and r.power_w <= idle_power_fraction * r.power_limit_w
        )
    return _spin_signal(gpus, {"gpus": gpus, **thresholds}, busy_pct, idle_memory_pct)


def _gpu_figures(readings: Sequence[GpuActivity]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each reading as a figure, and what the readings lack for a judgement (one line a GPU)."""
    gpus: list[dict[str, Any]] = []
    incomplete: list[str] = []
    for r in readings:
        gpus.append(
            {
                "index": r.index,
                "gpu_pct": r.gpu_pct,
                "memory_pct": r.memory_pct,
                "power_w": r.power_w,
                "power_limit_w": r.power_limit_w,
            }
        )
        missing = _missing_fields(r)
        if missing:
            why = f" ({'; '.join(r.errors)})" if r.errors else ""
            incomplete.append(f"GPU {r.index} did not report {', '.join(missing)}{why}")
    return gpus, incomplete


def _spin_signal(
    gpus: list[dict[str, Any]], figures: dict[str, Any], busy_pct: float, idle_memory_pct: float
) -> Signal:
    """``hang`` when every GPU (marked ``spinning``) shows the spin signature."""
    spinning = [g for g in gpus if g["spinning"]]
    if len(spinning) == len(gpus):
        worst = max(g["power_w"] / g["power_limit_w"] for g in gpus)
        return Signal(
            "gpu_activity",
            True,
            True,
            f"all {len(gpus)} GPU(s) of the process busy (utilization >= {busy_pct:g}%) "
            f"but near idle: memory <= {idle_memory_pct:g}%, power at most "
            f"{worst:.0%} of the limit: a kernel spinning on a peer",
            figures,
        )
    working = [g for g in gpus if not g["spinning"]]
    sample = ", ".join(
        f"GPU {g['index']} {g['gpu_pct']}% util, {g['memory_pct']}% memory, "
        f"{g['power_w']:.0f}/{g['power_limit_w']:.0f} W"
        for g in working[:3]
    )
    return Signal(
        "gpu_activity",
        True,
        False,
        f"{len(working)} of {len(gpus)} GPU(s) not in the spin signature ({sample})",
        figures,
    )


# -- RDMA port traffic ---------------------------------------------------------------------------

#: The data counters, in ``counters/`` of each port. IBTA PortCounters: "total number of data
#: octets, divided by 4" — units of 4-byte words; the kernel prints them unscaled.
DATA_COUNTERS = ("port_xmit_data", "port_rcv_data")
#: Bytes per counter unit (IBTA: data octets divided by 4).
WORD_BYTES = 4
#: Where the 32-bit PortCounters stop. drivers/infiniband/core/sysfs.c shows the 64-bit
#: PortCountersExtended when the HCA's PMA advertises them (IB_PMA_CLASS_CAP_EXT_WIDTH; mlx5
#: declares it in drivers/infiniband/hw/mlx5/mad.c ``process_pma_cmd``) and falls back to the
#: 32-bit PortCounters otherwise. Those saturate: they stop at all ones instead of wrapping
#: (IBTA), after 16 GiB of traffic; a counter that sits there can no longer show movement.
SATURATED_32 = 2**32 - 1


def read_port_counters(root: Path = infiniband.SYSFS_ROOT) -> dict[str, tuple[int, int]]:
    """``{"<dev>/<port>": (port_xmit_data, port_rcv_data)}`` for the ACTIVE ports under ``root``.

    Raw counter units: 4-byte words (IBTA), not bytes; :func:`rdma_traffic_signal` converts.
    Port state comes from :func:`node_agent.host.infiniband.discover`. A port whose data counters
    cannot be read (absent, or ``N/A (no PMA)`` when the HCA answers no PerfMgt query) is left
    out; so is everything when ``root`` cannot be listed. Each counter file read is one
    PerfMgt MAD to the HCA (sysfs.c ``get_perf_mad``), cheap enough for every few seconds.
    """
    try:
        ports = infiniband.discover(root)
    except OSError:
        return {}
    found: dict[str, tuple[int, int]] = {}
    for port in ports:
        if port.state != "ACTIVE":
            continue
        values = []
        for name in DATA_COUNTERS:
            try:
                text = (root / port.device / "ports" / port.port / "counters" / name).read_text()
            except OSError:
                break
            text = text.strip()
            if not text.isdigit():
                break
            values.append(int(text))
        if len(values) == len(DATA_COUNTERS):
            found[f"{port.device}/{port.port}"] = (values[0], values[1])
    return found


def rdma_traffic_signal(
    before: Mapping[str, tuple[int, int]],
    after: Mapping[str, tuple[int, int]],
    window_s: float,
    *,
    min_bytes: int = 0,
) -> Signal:
    """The ``rdma_traffic`` signal from two :func:`read_port_counters` readings ``window_s`` apart.

    ``hang`` when no active port's sent or received data moved more than ``min_bytes`` over the
    window. Only ports in both readings count (a port that came or went is ignored). A counter
    that went backwards (reset, or wrap) counts as movement; a 32-bit counter stuck at
    2**32-1 in both readings (saturated) cannot show any and is left out. Figures:
    ``ports`` (``{"dev/port": {"xmit_bytes", "rcv_bytes"}}``, None where a counter reset or
    saturated), ``window_s``, ``min_bytes``, and ``reset``/``saturated``/``ports_changed``
    when any.

    ``min_bytes=0`` (any data at all is movement) is a judgement: the port also carries what is
    not the job (IPoIB, storage, subnet-manager MADs), so the default errs towards "moving"
    rather than accuse a job; raise it above the port's background traffic to make the signal
    sharper.
    """
    if not before and not after:
        return Signal.unavailable(
            "rdma_traffic",
            "no active RDMA port in /sys/class/infiniband: "
            "the job's traffic cannot be watched here",
        )
    if window_s <= 0:
        return Signal.unavailable(
            "rdma_traffic",
            f"the two counter readings are {window_s:g} s apart: movement needs a positive window",
            window_s=window_s,
        )
    common = sorted(set(before) & set(after))
    changed = sorted(set(before) ^ set(after))
    ports, reset, saturated, moved, watched = _movement(before, after, common, min_bytes)
    figures: dict[str, Any] = {"ports": ports, "window_s": window_s, "min_bytes": min_bytes}
    for name, items in (("reset", reset), ("saturated", saturated), ("ports_changed", changed)):
        if items:
            figures[name] = items
    if not common:
        return Signal.unavailable(
            "rdma_traffic",
            f"the active RDMA ports changed between the two readings "
            f"({', '.join(changed)}): no port to compare",
            **figures,
        )
    if not watched:
        return Signal.unavailable(
            "rdma_traffic",
            f"the data counters of {', '.join(common)} are saturated at "
            f"{SATURATED_32} (32-bit PortCounters stop there): reset them "
            "(`perfquery -R`, infiniband-diags) to watch traffic",
            **figures,
        )
    if moved:
        moving = sorted(set(moved))
        return Signal(
            "rdma_traffic",
            True,
            False,
            f"RDMA data moved in {window_s:g} s on {', '.join(moving)}"
            + (f" (counter reset: {', '.join(reset)})" if reset else ""),
            figures,
        )
    return Signal(
        "rdma_traffic",
        True,
        True,
        f"no RDMA data moved (more than {min_bytes} B) in {window_s:g} s on any active "
        f"port ({', '.join(common)}): the job exchanges no data with its peers",
        figures,
    )


def _movement(
    before: Mapping[str, tuple[int, int]],
    after: Mapping[str, tuple[int, int]],
    common: list[str],
    min_bytes: int,
) -> tuple[dict[str, dict[str, int | None]], list[str], list[str], list[str], int]:
    """Per port of ``common``, the bytes each data counter moved (None where it reset or is
    saturated); the counters that reset and that are saturated; the ports that moved more than
    ``min_bytes`` (a reset counts); how many counters were watched."""
    ports: dict[str, dict[str, int | None]] = {}
    reset: list[str] = []
    saturated: list[str] = []
    moved: list[str] = []
    watched = 0
    for key in common:
        ports[key] = {}
        for name, label, old, new in zip(
            DATA_COUNTERS, ("xmit_bytes", "rcv_bytes"), before[key], after[key], strict=True
        ):
            if old == new == SATURATED_32:
                saturated.append(f"{key} {name}")
                ports[key][label] = None
                continue
            watched += 1
            if new < old:
                reset.append(f"{key} {name}")
                ports[key][label] = None
                moved.append(key)
                continue
            moved_bytes = (new - old) * WORD_BYTES
            ports[key][label] = moved_bytes
            if moved_bytes > min_bytes:
                moved.append(key)
    return ports, reset, saturated, moved, watched


# -- log silence ---------------------------------------------------------------------------------


def log_silence_signal(path: str | None, *, now: float, silence_s: float) -> Signal:
    """The ``log_silence`` signal of the job's log file at wall time ``now`` (``time.time()``).

    ``hang`` when the file was last modified more than ``silence_s`` seconds before ``now``.
    Unavailable when no log file is configured, the file is missing or cannot be stat'ed, or the
    path is a directory. Figures: ``path``, ``silent_s`` (seconds since the last write; negative
    when the file's clock is ahead, e.g. on a network file system) and ``silence_s``.
    ``silence_s`` has no default: how long a job may stay quiet is the job's to say.
    """
    if path is None:
        return Signal.unavailable(
            "log_silence",
            "no log file configured: set NODE_AGENT_TRAIN_LOG "
            "in the job's environment or "
            "Heartbeat(log_file=...)",
        )
    if not os.path.isabs(path):  # relative to what? the job's cwd is not the agent's
        return Signal.unavailable(
            "log_silence",
            f"the job's log file {path!r} is not an absolute path: name it from /",
            path=path,
        )
    try:
        st = os.stat(path)
    except ValueError as err:  # a NUL byte, a lone surrogate: the user's text, not a path
        return Signal.unavailable(
            "log_silence",
            f"the job's log file {path!a} is not a path the system can use ({err})",
            path=ascii(path),
        )
    except FileNotFoundError:
        return Signal.unavailable(
            "log_silence",
            f"the job's log file {path} does not exist (check NODE_AGENT_TRAIN_LOG / log_file)",
            path=path,
        )
    except OSError as err:
        return Signal.unavailable(
            "log_silence",
            f"cannot stat the job's log file {path}: {err.strerror or err}",
            path=path,
        )
    if stat.S_ISDIR(st.st_mode):
        return Signal.unavailable(
            "log_silence",
            f"the job's log file {path} is a directory: name the file the job writes",
            path=path,
        )
    silent_s = round(now - st.st_mtime, 1)
    figures = {"path": path, "silent_s": silent_s, "silence_s": silence_s}
    if silent_s > silence_s:
        return Signal(
            "log_silence",
            True,
            True,
            f"{path} not written for {silent_s:.0f} s (threshold {silence_s:g} s)",
            figures,
        )
    return Signal(
        "log_silence", True, False, f"{path} written {max(silent_s, 0):.0f} s ago", figures
    )
