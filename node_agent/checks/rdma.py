"""Check ``rdma``: RDMA ports from sysfs, and ``ib_write_bw`` loopback bandwidth per HCA.

Reads ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer}`` and the
counters ``link_downed``, ``symbol_error`` and ``port_rcv_errors`` under ``counters/`` (the same
files ``ibstat`` and ``ibv_devinfo`` read). The root is ``params.sysfs_root`` (default
``/sys/class/infiniband``) so tests point it at a fake tree: no RDMA device exists on CI.

Per port (target ``hca:<dev>``, ``hca:<dev>/<port>`` beyond port 1):
  * ``link_state`` — fail unless ``ACTIVE`` (a port that is DOWN or INIT carries no traffic).
  * ``port_rate_gbps`` — the signalling rate (``400 Gb/sec (4X NDR)``) against the SKU's
    ``rdma_port_gbps_min``: a link trained below it (e.g. NDR at 200) fails.
  * ``link_errors`` — warn when ``link_downed`` or ``symbol_error`` is nonzero (flaps and bit
    errors of a marginal cable or transceiver; IBTA PortCounters).
  * ``write_bw_gbps`` — perftest ``ib_write_bw`` server and client on this host over the port,
    ``--report_gbits -D <duration_s>``, JSON from ``--out_json`` where the build supports it,
    against ``rdma_port_gbps_min``.
No device: skip. ``ib_write_bw`` missing: the bandwidth test skips naming Debian's ``perftest``.
Params: ``sysfs_root``, ``ib_write_bw`` (path of the perftest binary; default: found on PATH),
``perftest`` (default true), ``duration_s`` (5), ``gid_index`` (RoCE), ``tcp_port`` (0: a port
free at the run, which no other user can know in advance; a fixed one, perftest's 18515, any
user could hold first and answer the client), ``server_start_s`` (1.0: how long the server gets
to listen), ``ignore`` (``["mlx5_9",
"mlx5_4/2"]``: HCAs or ports not judged, as ``hca_ports`` reads it: unused, uncabled, a
management or storage NIC).

On a stand-in node (the node's ports carry an RDMA tree, ``ctx.ports.rdma_tree``) and no
``sysfs_root`` param, the stand-in's HCAs are a sysfs tree and an ``ib_write_bw`` stand-in
written to a temporary directory, with its RDMA faults applied there; this module reads them exactly as it reads real ones.

In the daemon the ports' error counters are exported by the collector this check shares with
``hca_ports`` (:mod:`node_agent.checking.hca_metrics`).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import proc
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.hca_metrics import HcaPortErrors
from node_agent.checking.params import Reader
from node_agent.host.infiniband import SYSFS_ROOT, Port, discover, ignored
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.perftest import BwRow, parse_bw_json, parse_bw_table
from node_agent.peers import free_loopback_port, held_by_another

PERFTEST_MISSING = "ib_write_bw not installed (Debian package `perftest`: apt-get install perftest)"
WARN_COUNTERS = ("link_downed", "symbol_error")


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    sysfs_root: str | None = None  # None: the node's (this host's SYSFS_ROOT, or a stand-in's)
    ib_write_bw: str | None = None  # None: ``ib_write_bw`` on PATH
    perftest: bool = True  # measure ib_write_bw on each ACTIVE port
    duration_s: float = 5.0
    tcp_port: int = 0  # 0: a port free at the run
    gid_index: int | None = None
    server_start_s: float = 1.0  # the server's head start before the client connects
    ignore: tuple[str, ...] = ()  # HCAs (mlx5_1) or ports (mlx5_1/2) not judged

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("rdma", raw, cls)
        return cls(
            sysfs_root=r.optional_string("sysfs_root"),
            ib_write_bw=r.optional_string("ib_write_bw"),
            perftest=r.flag("perftest"),
            duration_s=r.positive("duration_s"),
            tcp_port=r.integer("tcp_port", 0, 65535),
            gid_index=r.optional_integer("gid_index", 0),
            server_start_s=r.number("server_start_s", at_least=0),
            ignore=r.strings("ignore", lone=True),
        )


def run(ctx: CheckContext) -> list[Result]:
    params = ctx.typed_params(Params)
    if ctx.ports.rdma_tree is not None and params.sysfs_root is None:
        # The HCAs the node's ports build (a stand-in's: a sysfs tree and an ib_write_bw
        # stand-in written for this run); read as the real ones are.
        with ctx.ports.rdma_tree(ctx.ports.clock()) as view:
            if view.absent is not None:
                return [ctx.skip(view.absent)]
            return _run(ctx, view.sysfs_root, view.ib_write_bw)
    return _run(ctx, Path(params.sysfs_root or SYSFS_ROOT), params.ib_write_bw)


def _run(ctx: CheckContext, root: Path, ib_write_bw: str | None) -> list[Result]:
    ports = discover(root)
    if not ports:
        return [
            ctx.skip(
                f"no RDMA device: {root} lists no ports (no InfiniBand/RoCE HCA, or "
                "its driver is not loaded)"
            )
        ]
    minimum = ctx.sku.minimum("rdma_port_gbps_min") if ctx.sku else None
    ignore = set(ctx.typed_params(Params).ignore)
    results = [
        ctx.skip(
            f"{p.device} port {p.port} is in the suite's ignore list",
            target=p.target,
            metric="link_state",
        )
        for p in ports
        if ignored(p.device, p.port, ignore)
    ]
    ports = [p for p in ports if not ignored(p.device, p.port, ignore)]
    for port in ports:
        results.extend(port_results(ctx, port, minimum))
    if ctx.typed_params(Params).perftest:
        results.extend(
            _bandwidth(ctx, [p for p in ports if p.state == "ACTIVE"], minimum, ib_write_bw)
        )
    return results


def port_results(ctx: CheckContext, port: Port, minimum: float | None) -> list[Result]:
    """link_state, port_rate_gbps and link_errors of one port, from sysfs alone."""
    ev: dict[str, Any] = {
        "device": port.device,
        "port": port.port,
        "link_layer": port.link_layer,
        "phys_state": port.phys_state,
    }
    out = []
    active = port.state == "ACTIVE"
    out.append(
        ctx.result(
            port.target,
            "link_state",
            Status.PASS if active else Status.FAIL,
            f"{port.device} port {port.port} is {port.state or 'unknown'} ({port.phys_state})"
            + (
                "" if active else ": no traffic passes; check cable, switch port and subnet manager"
            ),
            value=port.state,
            **ev,
        )
    )
    if port.rate_gbps is None:
        out.append(
            ctx.result(
                port.target,
                "port_rate_gbps",
                Status.ERROR,
                f"cannot read the rate of {port.device} port {port.port}: {port.rate_text!r}",
                **ev,
            )
        )
    else:
        low = minimum is not None and port.rate_gbps < minimum
        out.append(
            ctx.result(
                port.target,
                "port_rate_gbps",
                Status.FAIL if low else Status.PASS,
                f"{port.device} port {port.port} at {port.rate_text}"
                + (
                    f", below the SKU minimum {minimum:g} Gb/s: the link trained at a lower speed"
                    if low
                    else ""
                ),
                value=port.rate_gbps,
                unit="Gb/s",
                minimum=minimum,
                rate=port.rate_text,
                **ev,
            )
        )
    noisy = {k: v for k, v in port.counters.items() if k in WARN_COUNTERS and v}
    out.append(
        ctx.result(
            port.target,
            "link_errors",
            Status.WARN if noisy else Status.PASS,
            (
                f"{port.device} port {port.port} error counters nonzero: "
                + ", ".join(f"{k}={v}" for k, v in noisy.items())
                + " (a flapping link or bit errors: reseat or replace cable/transceiver)"
            )
            if noisy
            else f"{port.device} port {port.port}: no link-down or symbol errors",
            value=sum(noisy.values()),
            unit="errors",
            **port.counters,
            **ev,
        )
    )
    return out


def _bandwidth(
    ctx: CheckContext, ports: list[Port], minimum: float | None, ib_write_bw: str | None = None
) -> list[Result]:
    if not ports:
        return []
    binary = ib_write_bw or proc.which("ib_write_bw")
    if binary is None:
        return [ctx.skip(PERFTEST_MISSING, target=p.target, metric="write_bw_gbps") for p in ports]
    help_text = proc.run([binary, "--help"], 10)
    json_ok = "out_json" in (help_text.stdout + help_text.stderr)
    return [_write_bw(ctx, binary, p, minimum, json_ok) for p in ports]


def perftest_argv(
    binary: str,
    port: Port,
    duration_s: float,
    tcp_port: int,
    gid_index: int | None,
    json_file: Path | None,
    server: str | None = None,
) -> list[str]:
    """ib_write_bw's command line; ``server`` is the address the client connects to."""
    argv = [
        binary,
        "-d",
        port.device,
        "-i",
        port.port,
        "--report_gbits",
        "-D",
        f"{duration_s:g}",
        "-p",
        str(tcp_port),
    ]
    if gid_index is not None:
        argv += ["-x", str(gid_index)]
    if json_file is not None:
        argv += ["--out_json", f"--out_json_file={json_file}"]
    if server:
        argv.append(server)
    return argv


def _write_bw(
    ctx: CheckContext, binary: str, port: Port, minimum: float | None, json_ok: bool
) -> Result:
    p = ctx.typed_params(Params)
    duration, gid = p.duration_s, p.gid_index
    tcp_port = p.tcp_port or free_loopback_port()
    timeout = duration + 30
    with tempfile.TemporaryDirectory(prefix="node-agent-perftest-") as tmp:
        json_file = Path(tmp) / "client.json" if json_ok else None
        server_argv = perftest_argv(binary, port, duration, tcp_port, gid, None)
        client_argv = perftest_argv(
            binary, port, duration, tcp_port, gid, json_file, server="127.0.0.1"
        )
        server: dict[str, proc.ProcResult] = {}
        thread = threading.Thread(
            target=lambda: server.update(r=proc.run(server_argv, timeout)), daemon=True
        )
        thread.start()
        time.sleep(p.server_start_s)  # let the server listen first
        if taken := held_by_another(tcp_port):
            thread.join()
            return ctx.result(
                port.target,
                "write_bw_gbps",
                Status.ERROR,
                f"ib_write_bw on {port.device} was not measured: {taken}; its client would "
                "have measured against it (leave the rdma check's tcp_port unset: a free port)",
                argv=client_argv,
            )
        client = proc.run(client_argv, timeout)
        thread.join()
        json_text = json_file.read_text() if json_file and json_file.exists() else None
    ev: dict[str, Any] = {
        "device": port.device,
        "port": port.port,
        "duration_s": duration,
        "argv": client_argv,
        "minimum": minimum,
    }
    if not client.ok:
        srv = server.get("r")
        return ctx.result(
            port.target,
            "write_bw_gbps",
            Status.ERROR,
            f"ib_write_bw on {port.device}: {client.describe_failure()}",
            returncode=client.returncode,
            stderr_tail=client.stderr[-600:],
            server_failure=srv.describe_failure() if srv and not srv.ok else None,
            **ev,
        )
    try:
        # the run used --report_gbits; the parser still checks that against MsgRate x size
        row: BwRow = (
            parse_bw_json(json_text, unit="Gb/sec")
            if json_text
            else parse_bw_table(client.stdout)[-1]
        )
    except ParseError as err:
        return ctx.result(
            port.target,
            "write_bw_gbps",
            Status.ERROR,
            f"cannot read ib_write_bw output for {port.device}: {err}",
            stdout_tail=client.stdout[-600:],
            **ev,
        )
    low = minimum is not None and row.bw_avg_gbps < minimum
    return ctx.result(
        port.target,
        "write_bw_gbps",
        Status.FAIL if low else Status.PASS,
        f"ib_write_bw {port.device} port {port.port}: {row.bw_avg_gbps:.1f} Gb/s average"
        + (f", below the SKU minimum {minimum:g} Gb/s" if low else ""),
        value=round(row.bw_avg_gbps, 2),
        unit="Gb/s",
        msg_size_bytes=row.msg_size_bytes,
        iterations=row.iterations,
        source="json" if json_text else "table",
        unit_used=row.unit_used,
        unit_note=row.unit_note,
        cross_checked=row.cross_checked,
        perftest_warnings=list(row.warnings),
        **ev,
    )


SERVICE = ServiceBehaviour(metrics=HcaPortErrors)
