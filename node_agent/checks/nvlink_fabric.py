"""Check ``nvlink_fabric``: each GPU's place in the NVLink fabric (docs/nvlink.md).

NVML's fabric (``nvmlDeviceGetGpuFabricInfoV``, ``nvidia-smi -q``'s Fabric section) says
whether the GPU registered with the fabric manager (state, status), which multi-node NVLink
domain and clique it belongs to (ClusterUUID, CliqueID) and what the fabric's health mask says.
The check first asks :func:`node_agent.gpu.nvlink_topology.nvlink_applicability`: where NVML
reports no fabric (PCIe cards, NVLink bridges, NVSwitch boards before Hopper, a pass-through VM
that sees no links) every judgment is one ``skip`` that says why.

Results, per GPU (``gpu:N``):

* ``fabric_state``: ``pass`` when the registration completed with status Success; ``fail``
  (rule ``nvlink-fabric-incomplete``, ERROR) when it did not, naming the state and status;
  where no GPU of the node has completed it, ``fabric_unregistered`` instead (rule
  ``nvlink-fabric-unregistered``, ERROR held for an operator): the fabric manager's state;
* ``fabric_health``: ``pass`` when the mask flags nothing; ``warn`` (``nvlink-fabric-degraded``)
  for degraded bandwidth alone; ``fail`` (``nvlink-fabric-unhealthy``, ERROR) naming each other
  flag (route recovery, route unhealthy, access timeout recovery, a refused configuration, the
  global fabric manager disconnected) or an Unhealthy summary;
* ``fabric_clique`` (multi-node NVLink only): ``pass`` when the GPU is in the tray's domain and
  clique (the one most of its GPUs report, or the params' ``cluster_uuid``/``clique_id``);
  ``fail`` (``nvlink-fabric-wrong-clique``, ERROR) naming both.

On ``node``: ``nvlink_domain``, ``pass`` naming the tray's domain, or ``skip`` with why where the
node is not multi-node NVLink (a single-node NVSwitch board: no domain to belong to).

Params (:class:`Params`): ``cluster_uuid``, ``clique_id``: the domain the operator says this
tray belongs to (default: none; the GPUs are compared with each other).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.gpu.base import GpuError, GpuFabric
from node_agent.gpu.nvlink_topology import (
    Applicability,
    fabric_dict,
    nvlink_applicability,
    read_fabric,
    status_name,
    tray_domain,
)
from node_agent.model import Result, Status

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    cluster_uuid: str | None = None
    clique_id: int | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("nvlink_fabric", raw, cls)
        uuid = r.optional_string("cluster_uuid")
        if uuid is not None and not _UUID.match(uuid.lower()):
            r.fail(
                "cluster_uuid",
                uuid,
                "a UUID as nvidia-smi -q prints the fabric's ClusterUUID (8-4-4-4-12 hex digits)",
            )
        return cls(
            cluster_uuid=uuid.lower() if uuid else None,
            clique_id=r.optional_integer("clique_id", 0, 2**32 - 1),
        )


def run(ctx: CheckContext) -> list[Result]:
    if unavailable := ctx.gpus_unavailable():
        return unavailable
    params = ctx.typed_params(Params)
    applies = nvlink_applicability(ctx.gpu)
    if not applies.fabric:
        return [
            ctx.result(
                "node",
                "nvlink_fabric",
                Status.SKIP,
                f"no NVLink fabric to judge: {applies.why}",
                nvlink=applies.kind,
            )
        ]
    out: list[Result] = []
    fabrics: dict[int, GpuFabric] = {}
    for dev in ctx.gpu.devices():
        target = f"gpu:{dev.index}"
        try:
            fabric = read_fabric(dev)
        except GpuError as err:
            out.append(ctx.result(target, "fabric_state", Status.ERROR, f"query failed: {err}"))
            continue
        if fabric is None:
            out.append(
                ctx.result(
                    target,
                    "fabric_state",
                    Status.FAIL,
                    f"GPU {dev.index} reports no NVLink fabric while the node's other GPUs "
                    f"do ({applies.why})",
                    fabric=None,
                )
            )
            continue
        fabrics[dev.index] = fabric
        out.append(_state(ctx, dev.index, fabric, applies))
        out.append(_health(ctx, dev.index, fabric))
    out.extend(_domain(ctx, fabrics, applies, params))
    return _tray_wide(out)


def _tray_wide(out: list[Result]) -> list[Result]:
    """Every GPU of the node waiting for the fabric manager (registration not started or in
    progress) is the fabric manager's state, not each GPU's: their findings become
    ``fabric_unregistered`` (rule ``nvlink-fabric-unregistered``: held for an operator, never
    a GPU or a tray replaced). One GPU alone short of it stays its own ``fabric_state``."""
    states = [r for r in out if r.metric == "fabric_state"]
    waiting = [
        r
        for r in states
        if r.status is Status.FAIL
        and (r.evidence.get("fabric") or {}).get("state") != "completed"
        and r.evidence.get("fabric") is not None
    ]
    if len(states) < 2 or len(waiting) != len(states):
        return out
    return [
        replace(
            r,
            metric="fabric_unregistered",
            detail=f"{r.detail}; so are all {len(states)} GPUs of the node: the fabric manager "
            "has not registered them (on an NVL72 rack it runs on the NVSwitch trays; on an "
            "NVSwitch board, nvidia-fabricmanager here)",
        )
        if r in waiting
        else r
        for r in out
    ]


def _evidence(fabric: GpuFabric) -> dict[str, Any]:
    return {
        "fabric": fabric_dict(fabric),
        "health_mask": None if fabric.health_mask is None else f"{fabric.health_mask:#x}",
        "health_summary": fabric.health_summary,
    }


def _state(ctx: CheckContext, index: int, fabric: GpuFabric, applies: Applicability) -> Result:
    target, where = f"gpu:{index}", _where(applies)
    status = status_name(fabric.status)
    if fabric.state != "completed":
        return ctx.result(
            target,
            "fabric_state",
            Status.FAIL,
            f"GPU {index}: NVLink fabric registration {fabric.state.replace('_', ' ')} "
            f"{where}: the GPU has no NVLink peers until the fabric manager completes it",
            **_evidence(fabric),
        )
    if fabric.status != 0:
        return ctx.result(
            target,
            "fabric_state",
            Status.FAIL,
            f"GPU {index}: NVLink fabric registration completed with status {status} {where}",
            **_evidence(fabric),
        )
    return ctx.result(
        target,
        "fabric_state",
        Status.PASS,
        f"GPU {index}: NVLink fabric registration completed, status {status}",
        **_evidence(fabric),
    )


def _where(applies: Applicability) -> str:
    # a tray none of whose GPUs completed has no ClusterUUID yet: it is not called single-node
    return "on a multi-node NVLink tray" if applies.multi_node else "(no NVLink domain reported)"


def _health(ctx: CheckContext, index: int, fabric: GpuFabric) -> Result:
    target, flags = f"gpu:{index}", fabric.health
    said = f"health mask {_evidence(fabric)['health_mask']}, summary {fabric.health_summary}"
    if not fabric.health_mask and fabric.health_summary in (None, "not_supported"):
        return ctx.result(
            target,
            "fabric_health",
            Status.SKIP,
            f"GPU {index}: the driver reports no fabric health (nvmlDeviceGetGpuFabricInfoV "
            "is not answered; the older call has no health mask)",
            **_evidence(fabric),
        )
    serious = [f for f in flags if f != "degraded_bandwidth"]
    if serious or fabric.health_summary == "unhealthy":
        named = ", ".join(f.replace("_", " ") for f in flags) or "the summary"
        return ctx.result(
            target,
            "fabric_health",
            Status.FAIL,
            f"GPU {index}: NVLink fabric unhealthy: {named} ({said})",
            **_evidence(fabric),
        )
    if flags or fabric.health_summary == "limited_capacity":
        return ctx.result(
            target,
            "fabric_health",
            Status.WARN,
            f"GPU {index}: NVLink fabric bandwidth degraded ({said})",
            **_evidence(fabric),
        )
    return ctx.result(
        target, "fabric_health", Status.PASS, f"GPU {index}: NVLink fabric healthy ({said})"
    )


def _domain(
    ctx: CheckContext, fabrics: dict[int, GpuFabric], applies: Applicability, params: Params
) -> list[Result]:
    """The tray's domain on ``node``, and each GPU against it."""
    if not applies.multi_node:
        return [
            ctx.result(
                "node",
                "nvlink_domain",
                Status.SKIP,
                f"no multi-node NVLink domain: {applies.why}",
                nvlink=applies.kind,
            )
        ]
    found = tray_domain(fabrics)
    uuid = params.cluster_uuid or (found[0] if found else "")
    clique = params.clique_id if params.clique_id is not None else (found[1] if found else 0)
    declared = params.cluster_uuid is not None or params.clique_id is not None
    source = "the suite's params" if declared else "most of the tray's GPUs"
    out = [
        ctx.result(
            "node",
            "nvlink_domain",
            Status.PASS,
            f"NVLink domain {uuid}, clique {clique} ({source})",
            value=clique,
            cluster_uuid=uuid,
            clique_id=clique,
        )
    ]
    for index, fabric in sorted(fabrics.items()):
        if fabric.state != "completed":
            out.append(
                ctx.result(
                    f"gpu:{index}",
                    "fabric_clique",
                    Status.SKIP,
                    f"GPU {index}: no clique until its fabric registration completes "
                    "(fabric_state says why)",
                )
            )
            continue
        same = fabric.cluster_uuid == uuid and fabric.clique_id == clique
        detail = (
            f"GPU {index}: in the tray's NVLink domain (clique {clique})"
            if same
            else f"GPU {index}: in clique {fabric.clique_id} of domain {fabric.cluster_uuid}, "
            f"while the tray is in clique {clique} of {uuid} ({source}): it cannot reach the "
            "tray's GPUs over NVLink"
        )
        out.append(
            ctx.result(
                f"gpu:{index}",
                "fabric_clique",
                Status.PASS if same else Status.FAIL,
                detail,
                value=fabric.clique_id,
                expected_cluster_uuid=uuid,
                expected_clique_id=clique,
                cluster_uuid=fabric.cluster_uuid,
                clique_id=fabric.clique_id,
            )
        )
    return out
