"""Check ``imex``: the IMEX domain this node belongs to, where IMEX is configured (docs/imex.md).

IMEX (NVIDIA's Internode Memory Exchange service, ``nvidia-imex``) shares GPU memory across the
trays of a multi-node NVLink domain (GB200/GB300 NVL72). It is judged only where it is
configured, the IMEX nodes config (``IMEX_NODE_CONFIG_FILE`` of the daemon's config, default
``/etc/nvidia-imex/nodes_config.cfg``) existing and listing nodes, and where it applies: the
node is on multi-node NVLink by NVML's own answers
(:func:`node_agent.gpu.nvlink_topology.nvlink_applicability`, the one rule every NVLink
judgment asks). Anywhere else (a single-node HGX, a PCIe or pass-through GPU VM, a tray whose
IMEX was never set up) the check is a ``skip`` that says why, never a finding: an "IMEX
unhealthy" verdict on a host that does not use IMEX is the field's commonest false positive
(NVSentinel #1471, DCGM #308). An installed ``nvidia-imex`` service with no nodes config is
named in that skip (the package is installed on hosts where it never starts).

Where it is configured, ``nvidia-imex-ctl -N -j`` (run through :func:`node_agent.proc.run`,
argv only) gives the domain (parsed by :mod:`node_agent.parsers.imex`). Two results on
``node``:

* ``imex_node``: this node's state in its domain (found by the address in ``params.local``,
  else by the addresses and names of this host): ``pass`` when READY; ``fail`` (rule
  ``imex-node-not-ready``, ERROR) otherwise, naming the state; ``warn`` when no node of the
  domain is this host (set ``local`` to its address in the nodes config);
* ``imex_domain``: ``pass`` when the domain is UP and every node the config lists is READY;
  ``fail`` (rule ``imex-domain-incomplete``, ERROR) otherwise, naming each node that is not
  READY with its state, and each configured address the tool did not list.

The tool asks the daemon's command service on this host (``IMEX_CMD_PORT``, or its
``IMEX_CMD_UNIX_DOMAIN_PATH``), which any user may hold where the daemon is not running: the
tool runs only while root (or a ``service_users`` account) holds it, before and after, else an
``error`` names the holder (:mod:`node_agent.peers`).
The tool missing where IMEX is configured is an ``error`` naming the package (``nvidia-imex``);
the tool failing, timing out, or printing something truncated or unreadable is an ``error``
naming what was expected. A stand-in node (a scenario or a replayed capture) models no IMEX:
a skip.

Params (:class:`Params`): ``tool`` (``nvidia-imex-ctl``), ``config``
(``/etc/nvidia-imex/config.cfg``, passed to the tool with ``-c``), ``nodes_config`` (the nodes
config when the daemon's config names none), ``local`` (this node's address as the nodes
config writes it; empty: found from the host), ``timeout_s`` (10), ``service_units`` (where an
installed ``nvidia-imex`` unit is looked for), ``service_users`` (accounts besides root whose
command service is believed).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.gpu.nvlink_topology import nvlink_applicability
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.imex import UP, ImexDomain, ImexNode, parse, parse_nodes_config
from node_agent.peers import why_not_trusted, why_socket_not_trusted

PACKAGE = "nvidia-imex"
DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"
DEFAULT_NODES_CONFIG = "/etc/nvidia-imex/nodes_config.cfg"
SERVICE_UNITS = (
    "/etc/systemd/system/nvidia-imex.service",
    "/usr/lib/systemd/system/nvidia-imex.service",
    "/lib/systemd/system/nvidia-imex.service",
)
#: where this host's own IPv4 addresses are read (the LOCAL routes of every interface)
FIB_TRIE = Path("/proc/net/fib_trie")
#: the config key that names the nodes config (NVIDIA IMEX guide, "IMEX Service Config Options")
NODE_CONFIG_KEY = "IMEX_NODE_CONFIG_FILE"
#: the daemon's command service, which nvidia-imex-ctl asks: its TCP port (the guide's
#: examples and NVIDIA's shipped config set 50005), or its Unix socket where one is configured
CMD_PORT_KEY, CMD_PORT = "IMEX_CMD_PORT", 50005
CMD_SOCKET_KEY = "IMEX_CMD_UNIX_DOMAIN_PATH"
#: the most a nodes config may list (an NVL72 domain has 18 trays; a larger NVL576 is 144);
#: a bigger file is not a nodes config
MAX_NODES = 1024
MAX_CONFIG_BYTES = 64 * 1024


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    tool: str = "nvidia-imex-ctl"
    config: str = DEFAULT_CONFIG
    nodes_config: str = DEFAULT_NODES_CONFIG
    local: str = ""
    timeout_s: float = 10.0
    service_units: tuple[str, ...] = SERVICE_UNITS
    service_users: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("imex", raw, cls)
        return cls(
            tool=r.string("tool"),
            config=r.string("config"),
            nodes_config=r.string("nodes_config"),
            local=r.string("local", empty=True),
            timeout_s=r.positive("timeout_s"),
            service_units=r.strings("service_units"),
            service_users=r.strings("service_users"),
        )


def run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    gate = _configured(ctx, params)
    if isinstance(gate, Result):
        return [gate]
    nodes_path, configured = gate
    domain = _read_domain(ctx, params, nodes_path, len(configured))
    if isinstance(domain, Result):
        return [domain]
    local = _local_node(domain, params.local)
    return [
        _node_result(ctx, domain, local, configured),
        _domain_result(ctx, domain, configured),
    ]


def _configured(ctx: CheckContext, params: Params) -> Result | tuple[Path, list[str]]:
    """(the nodes config, its addresses) where IMEX is configured and applies; else the skip
    (or, for a nodes config that cannot be read, the error) that says why."""
    if ctx.ports.software is not None:  # a stand-in: NVML's answers are modelled, IMEX is not
        applies = nvlink_applicability(ctx.gpu)
        why = (
            f"{ctx.ports.software.source} models no IMEX service"
            if applies.multi_node
            else f"IMEX does not apply: this node is not on multi-node NVLink ({applies.why})"
        )
        return ctx.result("node", "imex", Status.SKIP, why, nvlink=applies.kind)
    nodes_path = _nodes_config_path(params)
    configured = _configured_nodes(nodes_path)
    if isinstance(configured, str):
        return ctx.result("node", "imex", Status.ERROR, configured, nodes_config=str(nodes_path))
    if configured is None:
        return ctx.skip(_not_configured(params, nodes_path), metric="imex")
    applies = nvlink_applicability(ctx.gpu)
    if not applies.multi_node:
        return ctx.result(
            "node",
            "imex",
            Status.SKIP,
            f"IMEX is configured ({nodes_path}) but does not apply: this node is not on "
            f"multi-node NVLink ({applies.why})",
            nvlink=applies.kind,
        )
    return nodes_path, configured


def _read_domain(
    ctx: CheckContext, params: Params, nodes_path: Path, configured: int
) -> ImexDomain | Result:
    """``nvidia-imex-ctl -N -j`` parsed; the error result when it cannot be had."""
    argv = [params.tool, "-c", params.config, "-N", "-j"]
    if distrust := _untrusted_command_service(params):
        return _not_asked(ctx, f"the IMEX domain was not read: {distrust}", argv)
    out = proc.run(argv, timeout_s=min(params.timeout_s, max(1.0, ctx.remaining_s(1.0))))
    if not out.not_found and (distrust := _untrusted_command_service(params)):
        return _not_asked(ctx, f"the IMEX domain's answer was not read: then {distrust}", argv)
    if out.not_found:
        return ctx.result(
            "node",
            "imex",
            Status.ERROR,
            f"IMEX is configured ({nodes_path} lists {configured} nodes) but {params.tool} is "
            f"not found; install the {PACKAGE} package (the IMEX service and its control "
            f"tool) or set the check's tool param",
            nodes_config=str(nodes_path),
        )
    try:
        if not out.ok:
            raise ParseError(out.describe_failure())
        return parse(out.stdout)
    except ParseError as err:
        return ctx.result(
            "node",
            "imex",
            Status.ERROR,
            f"could not read the IMEX domain: {err} (expected `{' '.join(argv)}` to print the "
            f"domain's nodes and its state)",
            command=argv,
        )


def _untrusted_command_service(params: Params) -> str | None:
    """Why the command service the tool asks on this host may not be believed (None: it may):
    its Unix socket, where configured, and its TCP port (where configured, or where no socket
    is) must be root's or ``service_users'``. Where nothing holds the port, anyone could."""
    values = _daemon_config(params)
    socket_path = values.get(CMD_SOCKET_KEY)
    if socket_path:
        if distrust := why_socket_not_trusted(Path(socket_path), params.service_users):
            return distrust
        if CMD_PORT_KEY not in values:
            return None
    port = values.get(CMD_PORT_KEY, "")
    number = int(port) if port.isdigit() and 0 < int(port) < 65536 else CMD_PORT
    return why_not_trusted(f"localhost:{number}", number, params.service_users)


def _not_asked(ctx: CheckContext, why: str, argv: list[str]) -> Result:
    return ctx.result(
        "node",
        "imex",
        Status.ERROR,
        f"{why}; nvidia-imex-ctl asks whatever holds it, even another user's program: start "
        f"the IMEX service (`systemctl start {PACKAGE}`), or name the account it runs as in the "
        "check's service_users param",
        command=argv,
    )


def _daemon_config(params: Params) -> dict[str, str]:
    """The IMEX daemon config's ``KEY=value`` lines (empty when it cannot be read)."""
    try:
        text = Path(params.config).read_text(errors="replace")[:MAX_CONFIG_BYTES]
    except OSError:
        return {}
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#") and value.strip():
            values[key.strip()] = value.strip()
    return values


def _nodes_config_path(params: Params) -> Path:
    """The daemon config's ``IMEX_NODE_CONFIG_FILE`` where it sets one, else the param's."""
    return Path(_daemon_config(params).get(NODE_CONFIG_KEY) or params.nodes_config)


def _configured_nodes(path: Path) -> list[str] | str | None:
    """The nodes config's addresses; None when there is none (IMEX not configured); a
    message when it exists but cannot be read as one."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot read the IMEX nodes config {path}: {err.strerror or err}"
    if len(raw) > MAX_CONFIG_BYTES:
        return f"the IMEX nodes config {path} is over {MAX_CONFIG_BYTES} bytes: not a nodes list"
    nodes = parse_nodes_config(raw.decode(errors="replace"))
    if len(nodes) > MAX_NODES:
        return f"the IMEX nodes config {path} lists {len(nodes)} nodes (at most {MAX_NODES})"
    return nodes or None


def _not_configured(params: Params, nodes_path: Path) -> str:
    units = [u for u in params.service_units if Path(u).exists()]
    installed = (
        f"the {PACKAGE} service is installed ({units[0]}) but " if units else "no IMEX service: "
    )
    return (
        f"IMEX is not configured on this node: {installed}no nodes config at {nodes_path} "
        f"(IMEX applies only to a multi-node NVLink domain whose nodes it lists)"
    )


def _local_node(domain: ImexDomain, declared: str) -> ImexNode | None:
    """This node in the domain: the one the output marks, else the one whose address or name
    is the declared one or one of this host's."""
    marked = [n for n in domain.nodes if n.local]
    if marked:
        return marked[0]
    names = {declared} if declared else _host_names()
    return next((n for n in domain.nodes if {n.host, n.hostname} & names), None)


def _host_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        lines = FIB_TRIE.read_text().splitlines()
    except OSError:
        return names
    # "|-- 10.0.0.5" followed by "/32 host LOCAL": an address of this host
    for prev, line in zip(lines, lines[1:], strict=False):
        if "host LOCAL" in line and "|--" in prev:
            names.add(prev.split("|--", 1)[1].strip())
    return names - {"", "127.0.0.1"}


def _states(nodes: list[ImexNode]) -> str:
    return ", ".join(f"{n.label()} {n.state}" for n in nodes)


def _node_result(
    ctx: CheckContext, domain: ImexDomain, local: ImexNode | None, configured: list[str]
) -> Result:
    if local is None:
        return ctx.result(
            "node",
            "imex_node",
            Status.WARN,
            f"none of the IMEX domain's {len(domain.nodes)} nodes is this host (its names and "
            f"addresses match none of {', '.join(n.host for n in domain.nodes[:8])}); set the "
            f"imex check's local param to this node's address in the nodes config",
            nodes=[n.host for n in domain.nodes],
        )
    ok = local.ready
    return ctx.result(
        "node",
        "imex_node",
        Status.PASS if ok else Status.FAIL,
        f"this node's IMEX daemon ({local.label()}) is {local.state}"
        + ("" if ok else ": it shares no memory across the NVLink domain until it is READY"),
        value=local.state,
        index=local.index,
        host=local.host,
        version=local.version,
    )


def _domain_result(ctx: CheckContext, domain: ImexDomain, configured: list[str]) -> Result:
    not_ready = [n for n in domain.nodes if not n.ready]
    listed = {n.host for n in domain.nodes} | {n.hostname for n in domain.nodes}
    unlisted = [a for a in configured if a not in listed]
    ready = len(domain.ready)
    ok = domain.state == UP and ready >= len(configured) and not not_ready
    problems = []
    if not_ready:
        problems.append(f"not READY: {_states(not_ready)}")
    if unlisted:
        problems.append(f"configured but not in the domain: {', '.join(unlisted[:18])}")
    unconnected = domain.unconnected()
    if unconnected and not ok:
        problems.append(
            "not connected: " + ", ".join(f"#{a}->#{b} {word}" for a, b, word in unconnected[:18])
        )
    return ctx.result(
        "node",
        "imex_domain",
        Status.PASS if ok else Status.FAIL,
        f"IMEX domain {domain.state}: {ready} of {len(configured)} configured nodes READY"
        + ("" if ok else "; " + "; ".join(problems)),
        value=ready,
        unit="nodes",
        state=domain.state,
        configured=len(configured),
        nodes={str(n.index): {"host": n.host, "state": n.state} for n in domain.nodes},
        unconnected=[list(u) for u in unconnected],
        form=domain.form,
    )
