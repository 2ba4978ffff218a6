"""The scheduler adapter interface: the one small surface remediation acts through.

Every adapter (``log``, ``slurm``, ``kubernetes``, ``webhook``) implements
:class:`SchedulerAdapter`. An adapter that the scheduler refuses, or that cannot reach it,
raises :class:`AdapterError` whose message carries the scheduler's own words (stderr, HTTP
body), so the journal records why an action failed and the agent itself never crashes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

REASON_PREFIX = "node-agent:"  # every drain reason the agent writes starts with this
MAX_REASON_LEN = 200  # Slurm keeps long reasons, but sinfo -R and humans read the first line
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NODE_MAX_LEN = 63


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # scheduler's words, e.g. "IDLE", "DRAIN", "Ready"
    drained: bool
    reason: str | None  # drain reason as the scheduler stores it

    @property
    def drained_by_agent(self) -> bool:
        """True when the drain reason is one the agent wrote (so the agent may undo it)."""
        return self.drained and is_agent_reason(self.reason)


class AdapterError(Exception):
    """The scheduler refused or failed; the message includes its stderr or HTTP body."""


@runtime_checkable
class SchedulerAdapter(Protocol):
    name: str  # "log" | "slurm" | "kubernetes" | "webhook"

    def node_state(self, node: str) -> NodeState: ...

    def drain(self, node: str, reason: str) -> str: ...  # returns a detail line of what was done

    def resume(self, node: str, reason: str) -> str: ...

    def restart(self, node: str, reason: str) -> str: ...  # reboot request

    def replace(self, node: str, reason: str) -> str: ...  # drain + mark for replacement

    def list_nodes(self) -> list[NodeState]: ...  # all nodes it manages (blast radius)


def is_agent_reason(reason: str | None) -> bool:
    return bool(reason) and reason.strip().startswith(REASON_PREFIX)  # type: ignore[union-attr]


def check_node_name(node: str) -> str:
    """Return ``node`` if it is a safe host name for an argv/URL, else raise AdapterError."""
    if not isinstance(node, str) or len(node) > _NODE_MAX_LEN or not _NODE_RE.fullmatch(node):
        raise AdapterError(
            f"refusing node name {node!r}: a node name must match "
            f"{_NODE_RE.pattern} and be at most {_NODE_MAX_LEN} characters; "
            "set node.name in the config to the scheduler's name for this host")
    return node


def sanitise_reason(reason: str, max_len: int = MAX_REASON_LEN) -> str:
    """Printable ASCII only, no quotes/backslashes/newlines/``=``-confusion, bounded length.

    Always starts with :data:`REASON_PREFIX` (added when missing), so that a drain the agent
    wrote can be told from one an operator wrote.
    """
    text = str(reason).replace("\r", " ").replace("\n", " ").replace("\t", " ")
    out = []
    for ch in text:
        if ch in "\"'`\\$;&|<>" or not (32 <= ord(ch) < 127):
            out.append("_" if (32 <= ord(ch) < 127) else "?")
        else:
            out.append(ch)
    text = re.sub(r"\s+", " ", "".join(out)).strip()
    if not text.startswith(REASON_PREFIX):
        text = f"{REASON_PREFIX} {text}".rstrip()
    if len(text) > max_len:
        text = text[: max_len - 3].rstrip() + "..."
    return text
