"""NVLink domains: the trays of one multi-node NVLink fabric graded as one unit.

A GB200 or GB300 NVL72 rack is 18 compute trays joined by NVSwitch trays into one NVLink
domain; a job laid out over the domain runs on all of its trays or not at all. Each tray's
report says which domain it belongs to (``inventory.nvlink_domain``: the fabric's ClusterUUID
and CliqueID, null where the node is not multi-node NVLink) and what each GPU's fabric said
(``inventory.gpus[i].fabric``). ``node-agent fleet`` groups the trays by (ClusterUUID,
CliqueID) and grades each domain: which trays and GPUs are bad, and a rack-level verdict when
at least ``bad_share`` of its trays are graded ERROR or FAULT: the rack is escalated and its
trays drain together.

Why 0.25 by default: trays fail independently at a low rate, so several bad trays in one rack at
once point to something they share (an NVSwitch tray, a power shelf, the rack's cooling or its
fabric). Even at a pessimistic 5 % of trays bad at any time, 5 or more of 18 (the first count
at or over 0.25) are bad together by chance in 0.15 % of racks (binomial, n = 18, p = 0.05;
0.002 % at p = 0.02). Two bad trays (23 % of racks at 5 %) are what the two spare trays of a
common 16 + 2 layout absorb; three or four leave such a job short too, but happen by chance in
6 % of racks at 5 % (0.5 % at 2 %), too often to drain 18 trays for each. NVSentinel #367's
50 % (9 trays) waits until half the rack is lost. The share is a flag
(``node-agent fleet --domain-bad-share``) for a fleet whose rates or layout differ.

Nodes without a domain are left out: their grade is their own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.fleet.topology import domain_name

#: the share of a domain's trays graded ERROR or FAULT at which the rack is escalated (above)
DEFAULT_BAD_SHARE = 0.25
#: tray grades that count as bad for the domain
BAD_LEVELS = ("ERROR", "FAULT")
LEVELS = ("HEALTHY", "WARN", "ERROR", "FAULT")

_GPU_TARGET = re.compile(r"gpu:(\d+)\Z")


@dataclass(frozen=True)
class BadGpu:
    """One GPU of a tray that its tray's grade or its fabric names: ``level`` (ERROR/FAULT, or
    WARN for a fabric note), and why."""

    index: int
    level: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.index, "level": self.level, "why": self.why}


@dataclass(frozen=True)
class TrayFacts:
    """What one report says about its NVLink domain: the domain, and its GPUs that are bad."""

    cluster_uuid: str
    clique_id: int
    bad_gpus: tuple[BadGpu, ...] = ()


def _domain_of(inventory: Mapping[str, Any]) -> tuple[str, int] | None:
    """(ClusterUUID, CliqueID) of ``inventory.nvlink_domain``; None where it is absent or null
    (not multi-node NVLink, or a report from before the field)."""
    domain = inventory.get("nvlink_domain")
    if not isinstance(domain, Mapping):
        return None
    uuid, clique = domain.get("cluster_uuid"), domain.get("clique_id")
    if not isinstance(uuid, str) or not uuid or isinstance(clique, bool):
        return None
    if not isinstance(clique, int):
        return None
    return uuid, clique


def _fabric_notes(gpu: Mapping[str, Any], domain: tuple[str, int]) -> tuple[str, str] | None:
    """(level, why) for a GPU whose fabric is in another domain or did not complete; None
    where it agrees with its tray (or says nothing)."""
    fabric = gpu.get("fabric")
    if not isinstance(fabric, Mapping):
        return None
    uuid, clique = fabric.get("cluster_uuid"), fabric.get("clique_id")
    if (uuid is not None and uuid != domain[0]) or (clique is not None and clique != domain[1]):
        return "ERROR", f"fabric in clique {clique} of {uuid}, not its tray's"
    state = str(fabric.get("state") or "").lower()
    if state and state != "completed":
        return "ERROR", f"fabric state {state}"
    status = str(fabric.get("status") or "").lower()
    if status and status != "success":
        return "ERROR", f"fabric status {status}"
    return None


def tray_facts(report: Mapping[str, Any]) -> TrayFacts | None:
    """The tray's domain and bad GPUs from a report's JSON; None where it has no domain.

    A GPU is bad where the tray's grade gives it an ERROR or FAULT reason (the node's own
    verdict), or where its fabric is in another clique, or did not complete.

    >>> tray_facts({"inventory": {"nvlink_domain": {"cluster_uuid": "c", "clique_id": 2}},
    ...             "grade": {"reasons": [{"level": "FAULT", "target": "gpu:1", "rule": "xid"}]}})
    TrayFacts(cluster_uuid='c', clique_id=2, bad_gpus=(BadGpu(index=1, level='FAULT', why='xid'),))
    """
    inventory = report.get("inventory")
    if not isinstance(inventory, Mapping):
        return None
    domain = _domain_of(inventory)
    if domain is None:
        return None
    bad: dict[int, BadGpu] = {}
    grade = report.get("grade")
    reasons = grade.get("reasons") if isinstance(grade, Mapping) else None
    for reason in reasons if isinstance(reasons, list) else []:
        if not isinstance(reason, Mapping) or reason.get("level") not in BAD_LEVELS:
            continue
        m = _GPU_TARGET.match(str(reason.get("target", "")))
        if m is None:
            continue
        index, level = int(m.group(1)), str(reason["level"])
        kept = bad.get(index)
        if kept is None or LEVELS.index(level) > LEVELS.index(kept.level):
            bad[index] = BadGpu(index, level, str(reason.get("rule", "")))
    gpus = inventory.get("gpus")
    for i, gpu in enumerate(gpus if isinstance(gpus, list) else []):
        if not isinstance(gpu, Mapping):
            continue
        note = _fabric_notes(gpu, domain)
        index = gpu.get("index", i)
        if note is not None and isinstance(index, int) and index not in bad:
            bad[index] = BadGpu(index, *note)
    return TrayFacts(domain[0], domain[1], tuple(bad[k] for k in sorted(bad)))


@dataclass(frozen=True)
class Tray:
    """One node of a domain: its grade and its bad GPUs."""

    node: str
    level: str
    bad_gpus: tuple[BadGpu, ...]
    path: str

    @property
    def bad(self) -> bool:
        return self.level in BAD_LEVELS

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "level": self.level,
            "bad": self.bad,
            "bad_gpus": [g.to_dict() for g in self.bad_gpus],
            "report": self.path,
        }


@dataclass
class NvlinkDomain:
    """The trays of one (ClusterUUID, CliqueID) and the domain's verdict."""

    cluster_uuid: str
    clique_id: int
    trays: list[Tray]
    #: the share of bad trays that escalates the rack (``--domain-bad-share``)
    threshold: float = DEFAULT_BAD_SHARE

    @property
    def name(self) -> str:
        """``nvlink:<cluster_uuid>/<clique_id>``: the domain as a parallel group's name."""
        return domain_name(self.cluster_uuid, self.clique_id)

    @property
    def bad_trays(self) -> list[Tray]:
        return [t for t in self.trays if t.bad]

    @property
    def share(self) -> float:
        """The share of the domain's trays graded ERROR or FAULT."""
        return len(self.bad_trays) / len(self.trays) if self.trays else 0.0

    @property
    def escalated(self) -> bool:
        """At least ``threshold`` of the trays are bad: the rack is escalated."""
        return bool(self.bad_trays) and self.share >= self.threshold

    @property
    def level(self) -> str:
        """The worst tray's grade (the domain's own grade when it is escalated)."""
        return max((t.level for t in self.trays), key=_rank, default="HEALTHY")

    @property
    def verdict(self) -> str:
        """What to do with the domain, in a sentence."""
        bad, n = len(self.bad_trays), len(self.trays)
        if self.escalated:
            return (
                f"escalate the rack: {bad} of {n} trays ERROR or FAULT ({self.share:.0%}, at or "
                f"over {self.threshold:.0%}); drain the domain's {n} trays together (an NVLink "
                "job cannot run on a partial domain) and look for a cause they share "
                "(NVSwitch tray, power shelf, cooling, fabric)"
            )
        if bad:
            return (
                f"{bad} of {n} trays ERROR or FAULT ({self.share:.0%}, under "
                f"{self.threshold:.0%}): each drains on its own grade; a job that needs all "
                f"{n} trays cannot run until they are back"
            )
        return f"all {n} trays healthy or WARN"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cluster_uuid": self.cluster_uuid,
            "clique_id": self.clique_id,
            "trays": len(self.trays),
            "bad_trays": [t.node for t in self.bad_trays],
            "bad_tray_share": round(self.share, 4),
            "threshold": self.threshold,
            "escalated": self.escalated,
            "level": self.level,
            "action": "drain-domain" if self.escalated else "per-tray",
            "verdict": self.verdict,
            "nodes": [t.node for t in self.trays],
            "tray_grades": [t.to_dict() for t in self.trays],
        }


def _rank(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else 0


def group_domains(
    members: Iterable[tuple[str, str, str, TrayFacts | None]],
    bad_share: float = DEFAULT_BAD_SHARE,
) -> list[NvlinkDomain]:
    """The NVLink domains of ``(node, level, path, facts)`` rows (one per node); nodes whose
    facts are None are not in a domain and left out. Escalated domains first, then by the
    share of bad trays, then by name; trays by node name.

    ``bad_share`` must be in (0, 1]: ValueError otherwise.
    """
    if not 0 < bad_share <= 1:
        raise ValueError(f"the domain's bad-tray share must be in (0, 1], found {bad_share}")
    by_key: dict[tuple[str, int], list[Tray]] = {}
    for node, level, path, facts in members:
        if facts is None:
            continue
        trays = by_key.setdefault((facts.cluster_uuid, facts.clique_id), [])
        trays.append(Tray(node, level, facts.bad_gpus, path))
    domains = [
        NvlinkDomain(uuid, clique, sorted(trays, key=lambda t: t.node), bad_share)
        for (uuid, clique), trays in by_key.items()
    ]
    domains.sort(key=lambda d: (not d.escalated, -d.share, d.cluster_uuid, d.clique_id))
    return domains


def domain_groups(domains: Sequence[NvlinkDomain]) -> dict[str, list[str]]:
    """The domains as parallel groups (the topology format): name -> its trays."""
    return {d.name: [t.node for t in d.trays] for d in domains}
