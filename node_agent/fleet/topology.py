"""The topology file: parallel groups, NVLink domains among them.

``node-agent fleet --topology`` flags a group as a whole when it holds a suspect node, and
``node-agent stop-check --topology`` widens an eviction to every group a suspect is in. A file
is a YAML mapping of a group's name to its nodes; its key ``nvlink_domains`` (reserved) lists
NVLink domains, each a group named ``nvlink:<cluster_uuid>/<clique_id>``::

    dp-0: [gpu001, gpu002]
    nvlink_domains:
      - {cluster_uuid: 9f0c..., clique_id: 2, nodes: [tray01, tray02, ..., tray18]}

The JSON that ``node-agent fleet --json`` prints is a topology file too: its ``nvlink_domains``
(the domains it found in the reports) are the groups, so an eviction widens to the NVLink
domain without a hand-written file::

    node-agent fleet reports/ --json > fleet.json
    node-agent stop-check --topology fleet.json ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node_agent.yamlfile import ConfigError, load_yaml, validate

#: the fleet's JSON output (``FleetAnalysis.to_dict``)
FLEET_OUTPUT_SCHEMA = "node-agent.fleet/1"
#: the reserved key of a topology file that lists NVLink domains
DOMAINS_KEY = "nvlink_domains"

DOMAIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["cluster_uuid", "clique_id", "nodes"],
    "properties": {
        "cluster_uuid": {"type": "string", "minLength": 1},
        "clique_id": {"type": "integer"},
        "nodes": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
}

TOPOLOGY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "minProperties": 1,
    "properties": {DOMAINS_KEY: {"type": "array", "items": DOMAIN_SCHEMA}},
    "additionalProperties": {"type": "array", "items": {"type": "string"}, "minItems": 1},
}

FLEET_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [DOMAINS_KEY],
    "properties": {DOMAINS_KEY: {"type": "array", "items": DOMAIN_SCHEMA}},
}


def domain_name(cluster_uuid: str, clique_id: int) -> str:
    """The parallel group's name of an NVLink domain: ``nvlink:<cluster_uuid>/<clique_id>``."""
    return f"nvlink:{cluster_uuid}/{clique_id}"


def load_topology(path: str | Path) -> dict[str, list[str]]:
    """A topology file: each parallel group's name -> its nodes; an NVLink domain is the group
    ``nvlink:<cluster_uuid>/<clique_id>``. ConfigError naming the file and key otherwise."""
    data = load_yaml(path, None, what="topology file")
    groups: dict[str, list[str]] = {}
    if isinstance(data, dict) and data.get("schema") == FLEET_OUTPUT_SCHEMA:
        validate(data, FLEET_JSON_SCHEMA, str(path))
        if not data[DOMAINS_KEY]:
            raise ConfigError(
                f"{path}: the fleet's output names no NVLink domain (none of its reports "
                "has inventory.nvlink_domain): give a topology file of parallel groups"
            )
    else:
        validate(data, TOPOLOGY_SCHEMA, str(path))
        groups = {str(g): [str(n) for n in v] for g, v in data.items() if g != DOMAINS_KEY}
    for domain in data.get(DOMAINS_KEY) or []:
        name = domain_name(domain["cluster_uuid"], domain["clique_id"])
        if name in groups:
            raise ConfigError(f"{path}: NVLink domain {name} is listed twice")
        groups[name] = [str(n) for n in domain["nodes"]]
    return groups
