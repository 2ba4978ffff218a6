"""``host_power``'s reading of the BMC's System Event Log (:mod:`node_agent.parsers.sel`).

The sensors say how the supplies are now; the SEL keeps what happened: a supply that failed and
came back, an input that was lost for a minute, redundancy lost while a supply was swapped. Each
power event (a supply's failure or lost input, the power unit's AC lost or failure, redundancy
lost or degraded; asserted) is judged by its age against the BMC's own clock
(``ipmitool sel time get``; this host's clock where the BMC's cannot be read):

* ``sel_power`` (target ``psu:<name>`` for a supply's sensor, ``node`` for the power unit and
  redundancy) — ``fail`` (graded ERROR) for an event within ``graders/host.yaml``
  ``power.sel_recent_h`` (24 h) and after the log's last clear: the node lost a supply or its
  input today, and what failed once fails again; ``warn`` for an older one, one before the last
  clear, one the BMC logged before its clock was set, and any redundancy-degraded event (kept
  visible as history, no drain). ``sel`` (``node``) passes when the log holds none.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from node_agent.checking.context import CheckContext
from node_agent.host.paths import entity_name
from node_agent.model import Result, Status
from node_agent.parsers.sel import SelEvent

_WORDS = {
    "failure": "a supply failed or lost its input",
    "redundancy_lost": "power redundancy was lost",
    "redundancy_degraded": "power redundancy was degraded",
}


#: FreeIPMI's ipmi-sel puts the entity in front of the sensor's name ("Power Supply 2 PS2 Status")
_ENTITY_PREFIX = re.compile(r"^Power Supply \d+ (?=\S)")


def _target(event: SelEvent) -> str:
    """``psu:<name>`` as the supply's status sensor names it (``PS2 Status`` -> ``psu:PS2``, the
    target ``psu_status`` gives the same supply), ``node`` for the power unit and redundancy."""
    if event.sensor_type != "Power Supply" or event.kind != "failure":
        return "node"
    name = _ENTITY_PREFIX.sub("", event.sensor)
    name = re.sub(r"[\s_-]*status$", "", name, flags=re.IGNORECASE).strip() or event.sensor
    return f"psu:{entity_name(name)}"


def sel_results(
    ctx: CheckContext, events: list[SelEvent], now: datetime, clock: str, recent_h: float
) -> list[Result]:
    """The SEL's power events, judged (see the module docstring)."""
    cleared = [e.when for e in events if e.kind == "cleared" and e.when is not None]
    last_clear = max(cleared) if cleared else None
    groups: dict[tuple[str, str, str], list[SelEvent]] = {}
    for e in events:
        if e.kind in _WORDS:
            groups.setdefault((_target(e), e.sensor, str(e.kind)), []).append(e)
    if not groups:
        return [
            ctx.result(
                "node",
                "sel",
                Status.PASS,
                f"no power-supply failure, input loss or redundancy loss in the BMC's event log "
                f"({len(events)} entries)",
                value=0,
                unit="events",
            )
        ]
    since = now - timedelta(hours=recent_h)
    results = []
    for (target, sensor, kind), group in sorted(groups.items()):
        dated = [e.when for e in group if e.when is not None]
        latest = max(dated) if dated else None
        recent = (
            latest is not None
            and latest >= since
            and (last_clear is None or latest > last_clear)
            and kind != "redundancy_degraded"
        )
        when = (
            latest.strftime("%Y-%m-%d %H:%M:%S UTC") if latest else "before the BMC's clock was set"
        )
        why = (
            f"within {recent_h:g} h of the BMC's clock ({now:%Y-%m-%d %H:%M} UTC, {clock})"
            if recent
            else "before the log's last clear"
            if latest is not None and last_clear is not None and latest <= last_clear
            else f"older than {recent_h:g} h (graders/host.yaml power.sel_recent_h)"
            if latest is not None
            else "undated"
        )
        results.append(
            ctx.result(
                target,
                "sel_power",
                Status.FAIL if recent else Status.WARN,
                f"the BMC's event log: {_WORDS[kind]} ({sensor}: {group[-1].event}, "
                f"{len(group)} event(s), the last at {when}; {why})"
                + (
                    "; check the supply, its cord and its feed before the node runs on one"
                    if recent
                    else ""
                ),
                value=len(group),
                unit="events",
                sensor=sensor,
                event=group[-1].event,
                last=latest.isoformat() if latest else None,
                last_clear=last_clear.isoformat() if last_clear else None,
                ids=[e.id for e in group][-10:],
            )
        )
    return results
