"""Parse ``nvidia-imex-ctl -N`` (the IMEX domain's status) in its text and JSON (``-N -j``) forms,
and the IMEX nodes config (``/etc/nvidia-imex/nodes_config.cfg``).

Where each form comes from (tests/data/imex/PROVENANCE.md keeps the samples and their sources):

* **Text** (NVIDIA's IMEX guide, "The nvidia-imex-ctl Tool"; an 18-node READY domain in AWS's
  Parallel Computing Service guide, "Validate the IMEX setup"): the connectivity legend, a
  timestamp, ``Nodes:`` and one line per configured node::

      Node #0   - 172.31.48.81    - READY                - Version: 570.172

  then the ``Nodes From\\To`` matrix of one-letter states (``C`` connected, ``N`` never
  connected, ``I`` invalid, ``R`` recovering, ``D`` disconnected, ``A`` authenticating,
  ``!V!`` version mismatch, ``!M!`` node map mismatch) and ``Domain State: UP``. Newer
  daemons mark the node that answered with asterisks (``Node #1   * name *  - READY ...``);
  an unreachable node prints its state with no version.
* **JSON** (``-N -j``; the shape NVIDIA's ai-cloud-validation checked against live 1- and
  2-node domains, isvctl ``imex_domain_test.py``): ``{"nodes": {"0": {"status": "READY",
  "host": "10.0.0.1", "hostName": ..., "connections": {"1": {"host": ..., "status":
  "CONNECTED", "changed": true}}, "version": "580.95.05"}}, "timestamp": ..., "status": "UP"}``.
  Every configured node has an entry; one whose daemon is down reads ``UNAVAILABLE`` with its
  connections ``INVALID`` or ``NEVER_CONNECTED``.

Node states are the daemon's (DCGM's ``DCGM_FI_IMEX_DAEMON_STATUS``, dcgm_fields.h):
INITIALIZING, STARTING_AUTH_SERVER, WAITING_FOR_PEERS, WAITING_FOR_RECOVERY, INIT_GPU, READY,
SHUTTING_DOWN, UNAVAILABLE. The domain's state is UP, DEGRADED or DOWN
(``DCGM_FI_IMEX_DOMAIN_STATUS``). The parser keeps whatever word the tool printed; the check
judges READY and UP and names anything else as it was printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from node_agent.parsers import ParseError, json_document

TOOL = "nvidia-imex-ctl"
#: the longest name, address, state or version kept (a DNS name is at most 253 characters):
#: a peer's host name reaches the reports, and no report carries an unbounded field
MAX_NAME = 255
READY = "READY"
UP = "UP"
#: the text form's one-letter connection states and the JSON form's words for them
CONNECTION_WORDS = {
    "C": "CONNECTED",
    "N": "NEVER_CONNECTED",
    "I": "INVALID",
    "R": "RECOVERING",
    "D": "DISCONNECTED",
    "A": "AUTHENTICATING",
    "!V!": "VERSION_MISMATCH",
    "!M!": "NODE_MAP_MISMATCH",
}

_NODE_LINE = re.compile(
    r"^\s*Node\s+#(?P<index>\d+)\s+(?P<mark>[-*])\s+(?P<host>\S+)\s+\*?\s*-\s+"
    r"(?P<state>[A-Z_]+)\s*(?:-\s+Version:\s*(?P<version>\S*))?\s*$"
)
_DOMAIN_LINE = re.compile(r"^\s*Domain State:\s*(?P<state>\S+)\s*$")
_MATRIX_HEADER = re.compile(r"^\s*Nodes From\\To\s+(?P<columns>[\d\s]+)$")
_MATRIX_ROW = re.compile(r"^\s*(?P<row>\d+)\s+(?P<cells>\S.*)$")


@dataclass(frozen=True)
class ImexNode:
    """One configured node as the domain reports it. ``local`` is True for the node that
    answered where the output marks it (the text form's asterisks), else None (not said)."""

    index: int
    host: str
    state: str
    version: str = ""
    hostname: str = ""
    local: bool | None = None

    @property
    def ready(self) -> bool:
        return self.state == READY

    def label(self) -> str:
        name = f" ({self.hostname})" if self.hostname and self.hostname != self.host else ""
        return f"node #{self.index} {self.host}{name}"


@dataclass(frozen=True)
class ImexDomain:
    """``nvidia-imex-ctl -N``: the domain's state, its nodes, and who sees whom (from node
    index -> to node index -> the connection's word, ``CONNECTED`` ...)."""

    state: str
    nodes: tuple[ImexNode, ...]
    form: str  # text | json
    timestamp: str = ""
    connections: dict[int, dict[int, str]] = field(default_factory=dict)

    @property
    def ready(self) -> list[ImexNode]:
        return [n for n in self.nodes if n.ready]

    def unconnected(self) -> list[tuple[int, int, str]]:
        """(from, to, word) for each pair of READY nodes that is not CONNECTED."""
        ready = {n.index for n in self.ready}
        return [
            (a, b, word)
            for a, row in sorted(self.connections.items())
            for b, word in sorted(row.items())
            if a in ready and b in ready and word != "CONNECTED"
        ]


def parse(text: str) -> ImexDomain:
    """Either form: JSON when the output's first non-blank character opens an object."""
    return parse_json(text) if text.lstrip().startswith("{") else parse_text(text)


def parse_text(text: str) -> ImexDomain:
    """The formatted form; ParseError naming what is missing (a truncated output lacks the
    ``Domain State:`` line, which comes last)."""
    nodes: list[ImexNode] = []
    state = ""
    columns: list[int] = []
    connections: dict[int, dict[int, str]] = {}
    lines = text.splitlines()
    timestamp = ""
    for i, line in enumerate(lines):
        if line.strip() == "Nodes:" and i > 0:
            timestamp = lines[i - 1].strip()
        if m := _NODE_LINE.match(line):
            nodes.append(
                ImexNode(
                    index=int(m["index"]),
                    host=m["host"][:MAX_NAME],
                    state=m["state"],
                    version=(m["version"] or "")[:MAX_NAME],
                    local=True if m["mark"] == "*" else None,
                )
            )
        elif m := _DOMAIN_LINE.match(line):
            state = m["state"]
        elif m := _MATRIX_HEADER.match(line):
            columns = [int(c) for c in m["columns"].split()]
        elif columns and (m := _MATRIX_ROW.match(line)):
            cells = m["cells"].split()
            if len(cells) == len(columns):
                connections[int(m["row"])] = {
                    col: CONNECTION_WORDS.get(cell, cell)
                    for col, cell in zip(columns, cells, strict=True)
                }
    if not nodes:
        raise ParseError(
            f"{TOOL} -N printed no 'Node #N - <address> - <STATE>' line (expected the "
            f"domain's node list after 'Nodes:'; got {text.strip()[:160]!r})"
        )
    if not state:
        raise ParseError(
            f"{TOOL} -N output ends before its 'Domain State:' line ({len(nodes)} node lines "
            f"read): truncated, or the tool stopped early"
        )
    if any(n.local for n in nodes):
        nodes = [n if n.local else replace(n, local=False) for n in nodes]
    return ImexDomain(state, tuple(nodes), "text", timestamp, connections)


def parse_json(text: str) -> ImexDomain:
    """The ``-j`` form; ParseError naming the key that is missing or of the wrong type."""
    doc = json_document(text, TOOL, "-N -j output: an object with 'nodes' and 'status'")
    if not isinstance(doc, dict):
        raise ParseError(f"{TOOL} -N -j printed {type(doc).__name__}, expected an object")
    state = doc.get("status")
    raw_nodes = doc.get("nodes")
    if not isinstance(state, str) or not state:
        raise ParseError(f"{TOOL} -N -j has no 'status' (the domain's UP/DEGRADED/DOWN)")
    if not isinstance(raw_nodes, dict) or not raw_nodes:
        raise ParseError(
            f"{TOOL} -N -j has no 'nodes' object (expected one entry per configured node; "
            f"found {type(raw_nodes).__name__})"
        )
    nodes: list[ImexNode] = []
    connections: dict[int, dict[int, str]] = {}
    for key, raw in raw_nodes.items():
        index = _index(key)
        if not isinstance(raw, dict) or not isinstance(raw.get("status"), str):
            raise ParseError(f"{TOOL} -N -j: node {key!r} has no 'status' string")
        nodes.append(
            ImexNode(
                index=index,
                host=str(raw.get("host") or "")[:MAX_NAME],
                state=raw["status"][:MAX_NAME],
                version=str(raw.get("version") or "")[:MAX_NAME],
                hostname=_hostname(raw.get("hostName")),
            )
        )
        connections[index] = _connections(raw.get("connections"), key)
    nodes.sort(key=lambda n: n.index)
    return ImexDomain(state, tuple(nodes), "json", str(doc.get("timestamp") or ""), connections)


def _index(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ParseError(f"{TOOL} -N -j: node key {key!r} is not a node number") from None


def _hostname(value: Any) -> str:
    return value[:MAX_NAME] if isinstance(value, str) and value != "N/A" else ""


def _connections(raw: Any, node: str) -> dict[int, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ParseError(f"{TOOL} -N -j: node {node!r} 'connections' is not an object")
    return {
        _index(k): str(v.get("status", "")) if isinstance(v, dict) else "" for k, v in raw.items()
    }


def parse_nodes_config(text: str) -> list[str]:
    """The IMEX nodes config: one node's address (an IP, or a name) per line, in node order;
    blank lines and ``#`` comments left out (NVIDIA's IMEX guide, ``IMEX_NODE_CONFIG_FILE``)."""
    return [
        line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()
    ]
