"""Synthetic delivery reports for the tests, built from the real model objects.

A report here carries the compute checks' result contract (``gpu_burn`` TFLOP/s with
``samples``, ``thermal_power`` ``load_trace`` with its time series, ``hbm_bandwidth``,
``pcie_bandwidth``) next to the node-level checks (``nccl_allreduce``, ``storage``, ``rdma``),
with seeded noise, so that fleet statistics and report rendering can be exercised without
hardware. It lives under ``tests/`` (imported as ``synthetic_reports``: ``tests/conftest.py``
puts this directory on ``sys.path``) and is not part of the installed package.

Example::

    report = synthetic_report("node0042", seed=42, gpu_factors={3: 0.88})
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from node_agent.model import (
    ACTION_FOR_LEVEL,
    GpuInfo,
    Grade,
    HostInfo,
    Level,
    Reason,
    Report,
    Result,
    Status,
)

#: nominal healthy H100 SXM5 figures (order of magnitude of docs' SKU baselines)
NOMINAL_TFLOPS = {
    "tflops_bf16": 720.0,
    "tflops_fp16": 725.0,
    "tflops_tf32": 370.0,
    "tflops_fp32": 52.0,
}
MINIMUM_TFLOPS = {
    "tflops_bf16": 600.0,
    "tflops_fp16": 600.0,
    "tflops_tf32": 300.0,
    "tflops_fp32": 45.0,
}


def _noisy(rng: random.Random, nominal: float, rel_sd: float) -> float:
    return nominal * (1.0 + rng.gauss(0.0, rel_sd))


def load_trace(
    rng: random.Random,
    tflops: float,
    points: int,
    power_limit_w: float = 700.0,
    slowdown_temp_c: float = 90.0,
) -> dict[str, object]:
    """A burn's time series as ``thermal_power`` records it: ramp-up, then a noisy plateau."""
    t_s, tf, temp, power, clock = [], [], [], [], []
    for i in range(points):
        ramp = min(1.0, (i + 1) / max(3, points // 10))
        t_s.append(round(i * 1.0, 1))
        tf.append(round(tflops * ramp * (1 + rng.gauss(0, 0.005)), 1))
        temp.append(round(38 + 34 * ramp + rng.gauss(0, 0.4), 1))
        power.append(round(min(power_limit_w, 120 + 560 * ramp + rng.gauss(0, 6)), 1))
        clock.append(round(1980 - 60 * ramp + rng.gauss(0, 8)))
    return {
        "t_s": t_s,
        "tflops": tf,
        "temp_c": temp,
        "power_w": power,
        "sm_clock_mhz": clock,
        "power_limit_w": power_limit_w,
        "slowdown_temp_c": slowdown_temp_c,
    }


def synthetic_report(
    hostname: str,
    *,
    seed: int = 0,
    gpus: int = 8,
    gpu_factors: Mapping[int, float] | None = None,
    node_factors: Mapping[str, float] | None = None,
    rel_sd: float = 0.01,
    trace_points: int = 0,
    faults: Mapping[int, str] | None = None,
    sku: str = "h100-sxm5-80gb",
) -> Report:
    """A graded delivery report of one node.

    ``gpu_factors`` scales a GPU's throughput and bandwidth (``{3: 0.88}``: GPU 3 at 88%);
    ``node_factors`` scales node-level metrics by name (``{"busbw_peak_gbps": 0.8}``);
    ``rel_sd`` is the relative standard deviation of the noise (0.01 = 1%);
    ``trace_points`` > 0 adds ``load_trace`` results with that many samples per GPU;
    ``faults`` maps a GPU index to ``"xid64"`` (a row remap that failed: FAULT) or ``"slow"`` (a
    failed burn).
    """
    rng = random.Random(seed)
    gpu_factors = dict(gpu_factors or {})
    node_factors = dict(node_factors or {})
    faults = dict(faults or {})
    results: list[Result] = []
    gpu_infos = []
    for i in range(gpus):
        gpu_infos.append(
            GpuInfo(
                index=i,
                uuid=f"GPU-{seed:08x}-{i:04x}-synthetic",
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                serial=f"SYN{seed:07d}{i}",
                memory_total_mib=81559,
                sku=sku,
            )
        )
        results.append(
            Result(
                "inventory",
                f"gpu:{i}",
                "identity",
                Status.PASS,
                f"NVIDIA H100 80GB HBM3 at 00000000:{0x18 + i:02X}:00.0",
            )
        )
        temp = _noisy(rng, 34.0, 0.03)
        results.append(
            Result(
                "nvml_health",
                f"gpu:{i}",
                "temperature",
                Status.PASS,
                f"{temp:.0f} °C, slowdown at 90 °C",
                value=round(temp),
                unit="°C",
                evidence={"slowdown_c": 90, "shutdown_c": 92},
            )
        )
    factors = [gpu_factors.get(i, 1.0) for i in range(gpus)]
    for metric, nominal in NOMINAL_TFLOPS.items():
        values = [_noisy(rng, nominal, rel_sd) * factors[i] for i in range(gpus)]
        for i, value in enumerate(values):
            siblings = sorted(v for j, v in enumerate(values) if j != i)
            median = siblings[len(siblings) // 2] if siblings else value
            failed = faults.get(i) == "slow"
            samples = [round(value * (1 + rng.gauss(0, 0.004)), 1) for _ in range(8)]
            results.append(
                Result(
                    "gpu_burn",
                    f"gpu:{i}",
                    metric,
                    Status.FAIL if failed else Status.PASS,
                    f"{value:.1f} TFLOP/s sustained, {value / median:.3f}× its siblings' median",
                    value=round(value, 1),
                    unit="TFLOP/s",
                    duration_s=30.0,
                    evidence={
                        "samples": samples,
                        "siblings_median": round(median, 1),
                        "minimum": MINIMUM_TFLOPS[metric],
                    },
                )
            )
    results.append(
        Result(
            "gpu_burn",
            "node",
            "wrong_elements",
            Status.PASS,
            "0 wrong elements in the burn GEMMs",
            value=0,
            unit="elements",
        )
    )
    for i in range(gpus):
        bf16 = next(
            r.value
            for r in results
            if r.check == "gpu_burn" and r.target == f"gpu:{i}" and r.metric == "tflops_bf16"
        )
        if trace_points:
            results.append(
                Result(
                    "thermal_power",
                    f"gpu:{i}",
                    "load_trace",
                    Status.PASS,
                    "temperature, power and clocks over the burn",
                    evidence=load_trace(rng, float(bf16), trace_points),
                )
            )
        results.append(
            Result(
                "thermal_power",
                f"gpu:{i}",
                "temperature_max_c",
                Status.PASS,
                "hottest reading under load",
                value=round(_noisy(rng, 72, rel_sd), 1),
                unit="°C",
                evidence={"slowdown_temp_c": 90.0},
            )
        )
        results.append(
            Result(
                "thermal_power",
                f"gpu:{i}",
                "power_reached_fraction",
                Status.PASS,
                "peak power / power limit",
                value=round(_noisy(rng, 0.97, rel_sd), 3),
                unit="",
                evidence={"power_limit_w": 700.0},
            )
        )
        hbm = _noisy(rng, 2900.0, rel_sd) * factors[i]
        results.append(
            Result(
                "hbm_bandwidth",
                f"gpu:{i}",
                "copy_gbps",
                Status.PASS,
                f"device-to-device copy {hbm:.0f} GB/s",
                value=round(hbm, 1),
                unit="GB/s",
                evidence={"minimum": 2500.0},
            )
        )
        for metric, nominal in (
            ("h2d_gbps", 53.0),
            ("d2h_gbps", 52.0),
            ("h2d_gbps_concurrent", 48.0),
            ("d2h_gbps_concurrent", 47.0),
        ):
            value = _noisy(rng, nominal, rel_sd)
            results.append(
                Result(
                    "pcie_bandwidth",
                    f"gpu:{i}",
                    metric,
                    Status.PASS,
                    f"{value:.1f} GB/s",
                    value=round(value, 2),
                    unit="GB/s",
                    evidence={"minimum": 40.0 if "concurrent" not in metric else None},
                )
            )
    busbw = _noisy(rng, 470.0, rel_sd) * node_factors.get("busbw_peak_gbps", 1.0)
    results.append(
        Result(
            "nccl_allreduce",
            "node",
            "busbw_peak_gbps",
            Status.PASS,
            f"peak all-reduce busbw {busbw:.1f} GB/s",
            value=round(busbw, 2),
            unit="GB/s",
            evidence={"minimum": 400.0, "backend": "nccl", "world_size": gpus},
        )
    )
    for metric, nominal, unit in (
        ("write_bw_mbps", 2900.0, "MB/s"),
        ("read_bw_mbps", 3100.0, "MB/s"),
        ("randread_iops", 65000.0, "IOPS"),
    ):
        value = _noisy(rng, nominal, rel_sd) * node_factors.get(metric, 1.0)
        results.append(
            Result(
                "storage",
                "disk:/scratch",
                metric,
                Status.PASS,
                f"/scratch: {value:.1f} {unit}",
                value=round(value, 2),
                unit=unit,
                evidence={"minimum": None, "direct": True},
            )
        )
    for hca in ("mlx5_0", "mlx5_1"):
        value = _noisy(rng, 392.0, rel_sd / 2) * node_factors.get("write_bw_gbps", 1.0)
        results.append(
            Result(
                "rdma",
                f"hca:{hca}",
                "write_bw_gbps",
                Status.PASS,
                f"ib_write_bw {value:.1f} Gb/s",
                value=round(value, 2),
                unit="Gb/s",
                evidence={"minimum": 380.0},
            )
        )
    reasons: list[Reason] = []
    for i, kind in sorted(faults.items()):
        if kind == "xid64":
            results.append(
                Result(
                    "xid",
                    f"gpu:{i}",
                    "xid",
                    Status.FAIL,
                    f"Xid 64 on gpu:{i}: GPU memory remapping failure",
                    value=64,
                )
            )
            reasons.append(
                Reason(
                    "xid",
                    Level.FAULT,
                    f"gpu:{i}",
                    f"Xid 64 on gpu:{i} [Xid 64: GPU memory remapping failure]",
                )
            )
        elif kind == "slow":
            reasons.append(
                Reason(
                    "unclassified-fail",
                    Level.ERROR,
                    f"gpu:{i}",
                    f"gpu_burn/tflops_bf16 on gpu:{i} is slow",
                )
            )
    level = max((r.level for r in reasons), default=Level.HEALTHY)
    grade = Grade(level=level, action=ACTION_FOR_LEVEL[level], reasons=tuple(reasons))
    return Report(
        host=HostInfo(
            hostname=hostname,
            kernel="6.1.0-synthetic",
            driver="550.90.07",
            cuda="12.4",
            gpu_backend="synthetic",
        ),
        gpus=gpu_infos,
        suite="delivery",
        mode="delivery",
        started_at="2026-11-21T10:00:00Z",
        finished_at="2026-11-21T10:09:00Z",
        results=results,
        grade=grade,
        simulated=True,
        agent_version="synthetic",
        sku=sku,
    )


#: the ClusterUUID of the synthetic NVL72 rack's NVLink domain (``rack_reports``)
RACK_UUID = "9f0c2b6e-5a41-4c7e-8d2a-1b3e5f7a9c0d"


def gpu_fabric(
    cluster_uuid: str, clique_id: int, changes: Mapping[str, object] | None = None
) -> dict[str, object]:
    """One GPU's ``inventory.gpus[i].fabric`` as the fabric check reports it: completed,
    success, healthy; ``changes`` overrides keys (``{"clique_id": 3}``, ``{"state":
    "in_progress"}``)."""
    fabric: dict[str, object] = {
        "state": "completed",
        "status": "success",
        "cluster_uuid": cluster_uuid,
        "clique_id": clique_id,
        "health": [],
    }
    fabric.update(changes or {})
    return fabric


def tray_report(
    hostname: str,
    *,
    cluster_uuid: str | None = RACK_UUID,
    clique_id: int = 2,
    seed: int = 0,
    faults: Mapping[int, str] | None = None,
    fabric: Mapping[int, Mapping[str, object]] | None = None,
    gpu_factors: Mapping[int, float] | None = None,
) -> dict[str, object]:
    """The JSON of a GB200 NVL72 compute tray's report (4 GPUs) with the ``inventory`` the
    fabric check adds: ``nvlink_domain`` (None with ``cluster_uuid=None``: not multi-node
    NVLink) and each GPU's ``fabric``. ``faults`` as :func:`synthetic_report`'s (``xid64``
    FAULT, ``slow`` ERROR); ``fabric`` maps a GPU to overrides of its fabric
    (``{1: {"clique_id": 3}}``: GPU 1 in another clique); ``gpu_factors`` as
    :func:`synthetic_report`'s (a slow GPU)."""
    report = synthetic_report(
        hostname, seed=seed, gpus=4, faults=faults, sku="gb200-186gb", gpu_factors=gpu_factors
    )
    data = report.to_dict()
    gpus = [g.to_dict() for g in report.gpus]
    for g in gpus:
        g["fabric"] = (
            None
            if cluster_uuid is None
            else gpu_fabric(cluster_uuid, clique_id, (fabric or {}).get(g["index"]))
        )
    domain = (
        None if cluster_uuid is None else {"cluster_uuid": cluster_uuid, "clique_id": clique_id}
    )
    data["inventory"] = {"host": data["host"], "gpus": gpus, "nvlink_domain": domain}
    return data


def rack_reports(bad: int, *, trays: int = 18, clique_id: int = 2) -> dict[str, dict[str, object]]:
    """Hostname -> report JSON of an NVL72 rack's ``trays`` trays, the first ``bad`` of them
    graded bad: even ones FAULT (an Xid 64 on GPU 0), odd ones ERROR (a slow GPU 3)."""
    out = {}
    for i in range(trays):
        faults = {} if i >= bad else ({0: "xid64"} if i % 2 == 0 else {3: "slow"})
        name = f"tray{i + 1:02d}"
        out[name] = tray_report(name, clique_id=clique_id, seed=i, faults=faults)
    return out
