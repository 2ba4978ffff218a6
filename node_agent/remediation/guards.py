"""Safety guards: each one a pure function that returns a refusal (a sentence) or None.

The remediator asks them before every *automatic* step; a refusal is journaled as ``refused``,
put in the report's ``actions`` and printed on stderr. Config keys are in docs/remediation.md.
"""

from __future__ import annotations

import math
import re

from node_agent.model import utc_iso
from node_agent.remediation.store import BreakerState
from node_agent.schedulers.base import NodeState, is_agent_reason

MAX_OPERATOR_REASON_LEN = 160
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def sanitise_operator_text(text: str | None, max_len: int = MAX_OPERATOR_REASON_LEN) -> str:
    """``--reason`` is operator input: printable ASCII only, one line, at most ``max_len``.

    Control characters and newlines become spaces, anything else non-printable becomes ``?``;
    the adapters sanitise again (quotes, shell metacharacters) before the scheduler sees it.

    >>> sanitise_operator_text("bad\\nline\\x1b[31m ok")
    'bad line?[31m ok'
    """
    if not text:
        return ""
    one_line = re.sub(r"[\r\n\t\v\f]+", " ", str(text))
    printable = _UNPRINTABLE.sub("?", one_line)
    printable = re.sub(r" {2,}", " ", printable).strip()
    return printable if len(printable) <= max_len else printable[: max_len - 3] + "..."


def foreign_drain(state: NodeState) -> str | None:
    """A refusal when the node is drained by someone else (its reason lacks the agent prefix)."""
    if state.drained and not is_agent_reason(state.reason):
        return (
            f"node {state.name} is drained by someone else (reason {state.reason!r}, "
            f"state {state.state}); node-agent never overrides or resumes a drain it did "
            "not make: resume it with the scheduler's own tools"
        )
    return None


def opt_out(config_opt_out: bool, stored: str | None, node: str) -> str | None:
    if config_opt_out:
        return (
            f"node {node} is opted out of automatic actions (config safety.opt_out: true); "
            "set it to false to let node-agent act"
        )
    if stored:
        return (
            f"node {node} is opted out of automatic actions ({stored}); "
            "run `node-agent optout off` to let node-agent act"
        )
    return None


def breaker(
    state: BreakerState, drains_in_window: int, max_drains: int, window_h: float
) -> tuple[str | None, bool]:
    """(refusal, trip): refused while open; trips when ``drains_in_window`` reached the limit.

    The breaker never closes by itself: only ``node-agent breaker reset`` closes it.
    """
    if state.open:
        return (
            f"circuit breaker is open since {_iso(state.opened_at)} ({state.reason}); "
            "automatic actions stay stopped until an operator runs "
            "`node-agent breaker reset`"
        ), False
    if drains_in_window >= max_drains:
        why = (
            f"{drains_in_window} automatic drains in the last {window_h:g} h reached "
            f"safety.breaker_max_drains={max_drains}"
        )
        return (
            f"circuit breaker tripped: {why}; automatic actions stop until an operator "
            "runs `node-agent breaker reset`"
        ), True
    return None, False


def blast_radius(nodes: list[NodeState] | None, node: str, max_fraction: float) -> str | None:
    """Refuse a drain of ``node`` when the agent-drained share would exceed ``max_fraction``.

    The share counts nodes whose drain reason carries the agent's prefix (drains by people do
    not count against the agent). The limit is ``floor(max_fraction * total)`` nodes, but at
    least one when ``max_fraction > 0``, so a small partition can still isolate one sick node;
    ``max_fraction: 0`` forbids every automatic drain. ``nodes`` None: the adapter cannot read
    the fleet (log drains nothing; a webhook's receiver keeps the fleet), and only
    ``max_fraction: 0`` refuses. A list that does not name ``node`` (an empty or cut answer,
    another partition's) cannot say the share: refused, never read as none drained.
    """
    if nodes is None:
        if max_fraction <= 0:
            return (
                f"blast radius: safety.max_drained_fraction=0 forbids every automatic drain; "
                f"{node} is not drained"
            )
        return None
    names = {n.name for n in nodes}
    if node not in names:
        return (
            f"blast radius: the scheduler's node list ({len(names)} node(s)) does not name "
            f"{node}, so the drained share cannot be read from it; not draining blind. Check "
            "that node.name is the scheduler's name for this node"
        )
    total = len(names)
    drained_by_agent = {n.name for n in nodes if n.drained_by_agent and n.name != node}
    after = len(drained_by_agent) + 1
    allowed = 0 if max_fraction <= 0 else max(1, math.floor(max_fraction * total + 1e-9))
    if after > allowed:
        return (
            f"blast radius: draining {node} would make {after} of {total} nodes drained by "
            f"node-agent ({after / total:.0%}), above safety.max_drained_fraction="
            f"{max_fraction:g} (at most {allowed}); already drained: "
            f"{', '.join(sorted(drained_by_agent)) or 'none'}. Repair or resume those "
            "first, or raise the limit deliberately"
        )
    return None


def rate_limit(last_action_at: float | None, now: float, min_interval_s: float) -> str | None:
    """Refuse starting a new remediation within ``min_interval_s`` of the last action."""
    if last_action_at is not None and now - last_action_at < min_interval_s:
        return (
            f"rate limit: the last action on this node was {now - last_action_at:.0f} s ago, "
            f"less than safety.min_action_interval_s={min_interval_s:g}; retried once it has "
            "passed if the fault is still there"
        )
    return None


def _iso(epoch: float | None) -> str:
    return "an unknown time" if epoch is None else utc_iso(epoch)
