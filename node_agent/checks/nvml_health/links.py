"""``nvml_health``'s NVLink judgments: each GPU's links against what the node should have, and
their error counters as readings for the trend history (docs/nvlink.md, docs/trends.md).

A link is named with its other end where NVML says what and where it is
(``nvmlDeviceGetNvLinkRemoteDeviceType``, ``nvmlDeviceGetNvLinkRemotePciInfo_v2``): ``link 7
(to NVSwitch 0000:05:00.0)``. NVLink 5's effective and symbol error counts are readings like the
DL counters, with their BERs as evidence, on GPUs that report them (Blackwell); a GPU that
answers Not Supported (every Hopper) reports no such reading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from node_agent.checking import host_view
from node_agent.checking.context import CheckContext
from node_agent.gpu.base import GpuDevice, NvLink
from node_agent.gpu.nvlink_topology import HIDDEN, Applicability, classify
from node_agent.model import Result, Status

#: ``reading(metric, query)``: the query's value, or None after recording why there is none
Reading = Callable[[str, Callable[[], Any]], Any]


def nvlink(
    ctx: CheckContext, dev: GpuDevice, target: str, reading: Reading, out: list[Result]
) -> None:
    links = reading("nvlink", dev.nvlinks)
    if links is None:
        return
    mode = "none"
    if not links or not all(link.active for link in links):
        # only a judgment short of links depends on the host (read only then: one call less)
        def query() -> str:
            return host_view.virtualization_mode(dev)

        mode = reading("virtualization", query) or "none"
    out.append(nvlink_state(ctx, target, links, mode))
    replay_max = ctx.sku.limit("nvlink_replay_max") if ctx.sku else None
    recovery_max = ctx.sku.limit("nvlink_recovery_max") if ctx.sku else None
    noisy = []
    for link in links:
        if replay_max is not None and (link.replay_errors or 0) > replay_max:
            noisy.append(f"{link_name(link)}: {link.replay_errors} replays")
        if recovery_max is not None and (link.recovery_errors or 0) > recovery_max:
            noisy.append(f"{link_name(link)}: {link.recovery_errors} recoveries")
    if noisy:
        out.append(
            ctx.result(
                target,
                "nvlink_errors",
                Status.WARN,
                "NVLink error counters above limits: " + "; ".join(noisy),
                value=len(noisy),
                replay_max=replay_max,
                recovery_max=recovery_max,
            )
        )
    out.extend(_nvlink_counters(ctx, target, links))


#: NVLink error counters reported as readings (the worst link of a GPU, every link in the
#: evidence), so the daemon's counter history can see one rise (graders/trends.yaml): an NVLink
#: with 505 recovery events was visible five days before it failed with Xid 149 (issue 28).
#: (NvLink attribute, metric, unit, the BER attribute shown beside it: NVLink 5's field values)
NVLINK_COUNTERS = (
    ("replay_errors", "nvlink_replay_errors", "replays", ""),
    ("recovery_errors", "nvlink_recovery_errors", "recoveries", ""),
    ("crc_errors", "nvlink_crc_errors", "errors", ""),
    ("effective_errors", "nvlink_effective_errors", "errors", "effective_ber"),
    ("symbol_errors", "nvlink_symbol_errors", "errors", "symbol_ber"),
)


def link_name(link: NvLink) -> str:
    """``link 7 (to NVSwitch 0000:05:00.0)``: the link and, where NVML says, its other end."""
    return f"link {link.link}" + (f" (to {link.peer})" if link.peer else "")


def _nvlink_counters(ctx: CheckContext, target: str, links: list[NvLink]) -> list[Result]:
    """One PASS reading per counter a link reports (never one NVML answers Not Supported for:
    NVLink 5's effective and symbol errors appear on Blackwell only), with ``per_link`` and
    ``peer_by_link`` (the trend history's series and their links' other ends) as evidence."""
    out = []
    peers = {str(link.link): link.peer for link in links if link.peer}
    for field, metric, unit, ber in NVLINK_COUNTERS:
        per_link = {
            link.link: getattr(link, field) for link in links if getattr(link, field) is not None
        }
        if not per_link:
            continue  # the GPU reports no such counter: nothing to follow
        worst = max(per_link, key=lambda k: (per_link[k], -k))
        by_link = {link.link: link for link in links}
        evidence: dict[str, Any] = {"peer_by_link": peers} if peers else {}
        if ber:
            evidence["ber_by_link"] = {
                str(k): getattr(by_link[k], ber)
                for k in sorted(per_link)
                if getattr(by_link[k], ber) is not None
            }
        out.append(
            ctx.result(
                target,
                metric,
                Status.PASS,
                f"NVLink {unit}{' (' + field.split('_')[0] + ')' if ber else ''}: at most "
                f"{per_link[worst]} on one link ({link_name(by_link[worst])}), "
                f"{sum(per_link.values())} on {len(per_link)} links",
                value=per_link[worst],
                unit=unit,
                worst_link=worst,
                per_link={str(k): v for k, v in sorted(per_link.items())},
                **evidence,
            )
        )
    return out


def nvlink_state(ctx: CheckContext, target: str, links: list[NvLink], mode: str = "none") -> Result:
    """NVLinks against ``node.expected_nvlinks``, else the SKU file's count, else what the
    GPU can use. ``mode`` is the GPU's NVML virtualization mode (``"none"`` on bare metal).

    Whether NVLink is there to judge is asked first, of the one rule every NVLink judgment
    shares (:func:`node_agent.gpu.nvlink_topology.classify`): a virtualized GPU for which NVML
    answers no link index has its links hidden behind the hypervisor (a skip, unless the
    operator declared a count). A FAULT needs a link NVML reports and reports down. On bare
    metal, NVML answering for no link where the SKU has some is a WARN naming
    ``node.expected_nvlinks`` (nothing shows a broken link). Inside a VM, links that answer but
    are all inactive are a GPU given to the VM without its NVLink peers (NVIDIA Fabric Manager
    user guide, virtualization models: a VM or GPU partition of one GPU has no NVLink
    interconnect), a WARN. A declared ``node.expected_nvlinks`` is the operator's word: fewer
    active is a FAIL.
    """
    applies = classify(links, None, mode)
    active = [link.link for link in links if link.active]
    usable = [link for link in links if link.p2p_supported is not False]
    evidence: dict[str, Any] = {
        "active": active,
        "indices": len(links),
        "inactive": [link.link for link in usable if not link.active],
        "not_p2p_capable": [link.link for link in links if link.p2p_supported is False],
        "virtualization": mode,
        "nvlink": applies.kind,
    }
    declared = ctx.config.node.expected_nvlinks
    if declared is not None:
        return _nvlink_against(ctx, target, links, declared, "node.expected_nvlinks", evidence)
    expected = ctx.sku.section("nvlink").get("links") if ctx.sku else None
    if expected:
        return _nvlink_sku(ctx, target, links, expected, applies, evidence)
    return _nvlink_own(ctx, target, links, expected, evidence)


def _nvlink_sku(
    ctx: CheckContext,
    target: str,
    links: list[NvLink],
    expected: int,
    applies: Applicability,
    evidence: dict[str, Any],
) -> Result:
    """Links against the SKU file's count, where NVLink is there to judge."""
    where, mode = f"SKU {ctx.sku.id if ctx.sku else None}", evidence["virtualization"]
    host = host_view.describe_mode(mode)
    if applies.kind == HIDDEN:
        status, value = Status.SKIP, None
        detail = (
            f"NVLinks are not exposed to this host: NVML answers Not Supported on every link "
            f"and the GPU is {host} ({where} has {expected}; set node.expected_nvlinks to "
            "require them)"
        )
    elif not links:
        status, value = Status.WARN, 0
        detail = (
            "NVML answers for none of this GPU's NVLinks (every link call Not Supported), "
            f"where {where} has {expected}: nothing shows a broken link, and nothing shows a "
            f"working one. Set node.expected_nvlinks ({expected} where the board's links must "
            "be checked, 0 where this host has none)"
        )
    elif not evidence["active"] and mode in host_view.GUEST_MODES:
        status, value = Status.WARN, 0
        detail = (
            f"0 of {expected} NVLinks active ({where}), and the GPU is {host}: a GPU given to "
            "a VM without its NVLink peers has its links down by design. Set "
            "node.expected_nvlinks to the links this VM should have to check them"
        )
    else:
        return _nvlink_against(ctx, target, links, expected, where, evidence)
    unit = "" if value is None else "links"
    return ctx.result(
        target, "nvlink_state", status, detail, value, unit, expected=expected, **evidence
    )


def _nvlink_own(
    ctx: CheckContext,
    target: str,
    links: list[NvLink],
    expected: int | None,
    evidence: dict[str, Any],
) -> Result:
    """Links where the SKU file expects none (0) or gives no count: what the GPU can use."""
    active, idle = evidence["active"], evidence["inactive"]
    usable = len(links) - len(evidence["not_p2p_capable"])
    status, value, wanted = Status.PASS, len(active), usable
    if expected == 0:
        bridged = f"{len(active)} active through a bridge" if active else "none in use"
        detail = (
            f"SKU {ctx.sku.id if ctx.sku else None} expects no NVLink ({bridged}; "
            f"{len(links)} link indices answer, inactive ones are not wired)"
        )
        wanted = 0
    elif not usable:
        detail = "no NVLink: no link index answers with P2P capability"
    elif idle:
        status = Status.WARN
        detail = (
            f"{len(active)} of {usable} NVLinks this GPU reports are active (inactive: "
            f"{idle}); without a SKU file a down link cannot be told from one this board does "
            "not wire (a PCIe card without a bridge): add a SKU file or set node.sku"
        )
    else:
        detail = f"{len(active)} NVLinks active (every link this GPU reports)"
    return ctx.result(
        target, "nvlink_state", status, detail, value, "links", expected=wanted, **evidence
    )


def _nvlink_against(
    ctx: CheckContext,
    target: str,
    links: list[NvLink],
    expected: int,
    where: str,
    evidence: dict[str, Any],
) -> Result:
    """Active links against ``expected`` (from ``where``: the SKU file or the operator)."""
    active = evidence["active"]
    status, detail = Status.PASS, f"{len(active)} of {expected} NVLinks active ({where})"
    if len(active) < expected:
        down = [link_name(link) for link in links if not link.active and link.link < expected]
        status = Status.FAIL
        detail = (
            f"{len(active)} of {expected} NVLinks active ({where}; "
            f"down: {', '.join(down) or 'links missing'}): a degraded NVLink"
        )
    return ctx.result(
        target, "nvlink_state", status, detail, len(active), "links", expected=expected, **evidence
    )


def fabric_wide_loss(ctx: CheckContext, results: list[Result]) -> list[Result]:
    """Links down on every GPU at once are not that many failed parts. Every NVLink of every
    GPU down: an NVSwitch board's links stay untrained until nvidia-fabricmanager runs (or while
    it fails, or its version is not the driver's). The same links down on every GPU: the far end
    they share, an NVSwitch (on an NVL72 rack, a switch tray out for an upgrade or a reboot, which
    takes the same two links from every GPU of every compute tray; three GPUs or more, since
    two GPUs linked to each other see one broken link at both ends). The GPUs' ``nvlink_state``
    FAILs give way to one node ``nvlink_fabric_down`` or ``nvlink_down_alike`` (ERROR, held for
    an operator: never a GPU replaced), with each GPU's reading as evidence. Other links down,
    or one GPU's, stay each GPU's own."""
    states = [r for r in results if r.metric == "nvlink_state"]
    if len(states) < 2 or any(r.status is not Status.FAIL for r in states):
        return results
    per_gpu = {r.target: r.detail for r in states}
    kept = [r for r in results if r.metric != "nvlink_state"]
    if not any(r.value for r in states):
        return kept + [
            ctx.result(
                "node",
                "nvlink_fabric_down",
                Status.FAIL,
                f"every NVLink of all {len(states)} GPUs is down: the fabric was not brought up, "
                "not a GPU failing (on an NVSwitch board, nvidia-fabricmanager trains the links: "
                "`systemctl status nvidia-fabricmanager`, its version must be the driver's; else "
                "the NVSwitches); start it and re-test",
                0,
                "links",
                gpus=len(states),
                per_gpu=per_gpu,
            )
        ]
    down = {tuple(r.evidence.get("inactive") or ()) for r in states}
    # two GPUs linked to each other see one broken link from both ends: a far end they share
    # takes at least three
    if len(states) < 3 or len(down) != 1 or not (links := next(iter(down))):
        return results
    return kept + [
        ctx.result(
            "node",
            "nvlink_down_alike",
            Status.FAIL,
            f"NVLink(s) {', '.join(map(str, links))} are down on all {len(states)} GPUs alike: "
            "the far end they share, not every GPU failing (an NVSwitch; on an NVL72 rack a "
            "switch tray, being upgraded or rebooted, or its cable cartridge); check the switches "
            "(`nvidia-smi nvlink -s`, the switch trays' state) and re-test",
            len(links),
            "links",
            gpus=len(states),
            links_down=list(links),
            per_gpu=per_gpu,
        )
    ]
