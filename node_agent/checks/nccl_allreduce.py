"""Check ``nccl_allreduce``: all-reduce bandwidth and correctness across the node's ranks.

With real CUDA GPUs the ranks use backend ``nccl``, one per GPU; otherwise (no GPU, or a node
whose compute port runs on CPU stand-ins) ``params.cpu_ranks`` (default 2) CPU processes use ``gloo``, which exercises the
same path and correctness test but whose bandwidth says nothing about the node's GPUs — the SKU
minimum ``nccl_allreduce_busbw_gbps_min`` (a figure of the whole board over NVLink) is applied
only to ``nccl`` on real GPUs, with as many ranks as the SKU has GPUs per node, on a host that
sees the NVLinks (not a VM holding part of a board). With one rank (one GPU) the check is a
``skip``: busbw = algbw * 2(n-1)/n is 0 by definition for n = 1.

Each rank is a ``python -P -m node_agent.compute.allreduce`` subprocess (see that module for the
method) run in :data:`node_agent.proc.CHILD_CWD`, so it never imports from the working
directory, started through :func:`node_agent.proc.run` with ``MASTER_ADDR=127.0.0.1`` and a
free port.
The whole run is bounded by ``params.timeout_s`` (default: a little below the suite's
``timeout_s``): a rank whose peer never connects is killed with its process group and the check
reports ``error``. Where ``all_reduce_perf`` (nccl-tests) is on PATH and
``params.use_nccl_tests`` is true, it is run on the GPUs and its table parsed instead.

Params: ``sizes`` (bytes, list), ``iters``, ``warmup``, ``cpu_ranks``, ``world_size`` (GPU
ranks; default all GPUs), ``timeout_s``, ``use_nccl_tests``.
Results (target ``node``): ``busbw_gbps`` per size, ``busbw_peak_gbps``, ``wrong_elements``.
In the daemon the latest peak is exported by :class:`BusbwMetrics` (``SERVICE``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import node_agent
from node_agent import proc
from node_agent.checking import host_view
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.figure_gauge import node_gauge
from node_agent.checking.params import Reader
from node_agent.extras import install_command
from node_agent.gpu.base import GpuError
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.nccl_tests import NcclTable, parse_all_reduce_perf
from node_agent.peers import free_loopback_port

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 24)  # 1 KiB .. 16 MiB: seconds on CPU
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankRun:
    """What one rank process did: its proc result and the JSON line it printed (or None)."""

    rank: int
    proc: proc.ProcResult
    doc: dict[str, Any] | None


def worker_argv(
    rank: int,
    world_size: int,
    backend: str,
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    timeout_s: float,
    python: str = sys.executable,
) -> list[str]:
    """``python -P -m node_agent.compute.allreduce ...``: a rank that never imports from its
    working directory (:func:`proc.python_module_argv`)."""
    args = [
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--backend",
        backend,
        "--sizes",
        ",".join(str(int(s)) for s in sizes),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        "--timeout-s",
        f"{timeout_s:g}",
    ]
    return proc.python_module_argv("node_agent.compute.allreduce", *args, python=python)


def child_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the directory this ``node_agent`` was imported from on ``PYTHONPATH``.

    A rank runs as ``python -P`` in :data:`proc.CHILD_CWD`, so an agent run from its source
    tree without being installed would leave its ranks unable to import ``node_agent``. The
    directory added is the one the running agent's own code came from (never the working
    directory), and an empty entry (which Python reads as the working directory) is dropped.
    """
    root = str(Path(node_agent.__file__).resolve().parent.parent)
    entries = [e for e in base.get("PYTHONPATH", "").split(os.pathsep) if e]
    if root not in entries:
        entries.append(root)
    return {**base, "PYTHONPATH": os.pathsep.join(entries)}


def run_ranks(
    world_size: int,
    backend: str,
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    timeout_s: float,
    start_ranks: Sequence[int] | None = None,
    master_port: int | None = None,
) -> list[RankRun]:
    """Start the ranks (all, or only ``start_ranks``: a test of a peer that never connects, or
    one that runs a rank itself), wait for all of them within ``timeout_s``, and return what
    each printed. They meet on 127.0.0.1:``master_port`` (default: a port free now).

    Every rank runs through :func:`proc.run` on its own thread, so a rank still running at the
    deadline is killed with its process group: nothing is left behind.
    """
    env = child_env(
        dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port or free_loopback_port()),
            PYTHONUNBUFFERED="1",
        )
    )
    # the group's own timeout ends a rank waiting for a peer a little before we kill it
    group_timeout = max(1.0, timeout_s - 2.0)
    ranks = list(range(world_size)) if start_ranks is None else list(start_ranks)
    runs: dict[int, proc.ProcResult] = {}

    def one(rank: int) -> None:
        runs[rank] = proc.run(
            worker_argv(rank, world_size, backend, sizes, iters, warmup, group_timeout),
            timeout_s,
            env=env,
            cwd=proc.CHILD_CWD,
        )

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [RankRun(r, runs[r], _last_json(runs[r].stdout)) for r in ranks]


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                doc: dict[str, Any] = json.loads(line)
                return doc
            except json.JSONDecodeError:
                return None
    return None


def torch_available() -> bool:
    """Whether torch can be imported, without importing it (that takes seconds)."""
    return importlib.util.find_spec("torch") is not None


def _has_real_gpus(ctx: CheckContext) -> bool:
    return (
        ctx.ports.compute.measured and not ctx.gpu.unavailable_reason and len(ctx.gpu.devices()) > 0
    )


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    sizes: tuple[int, ...] = DEFAULT_SIZES  # bytes
    iters: int = 20
    warmup: int = 5
    timeout_s: float | None = None  # None: DEFAULT_TIMEOUT_S, inside the check's own timeout
    world_size: int | None = None  # None: one rank per GPU
    use_nccl_tests: bool = False  # all_reduce_perf where it is installed
    cpu_ranks: int | None = None  # set: gloo across this many CPU processes (else 2 off GPUs)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("nccl_allreduce", raw, cls)
        sizes = r.integers("sizes", 1, "a list of sizes in bytes (whole numbers above 0)")
        return cls(
            sizes=sizes,
            iters=r.integer("iters", 1),
            warmup=r.integer("warmup", 0),
            timeout_s=r.optional_number("timeout_s", above=0),
            world_size=r.optional_integer("world_size", 0),
            use_nccl_tests=r.flag("use_nccl_tests"),
            cpu_ranks=r.optional_integer("cpu_ranks", 0),
        )


def run(ctx: CheckContext) -> list[Result]:
    if not torch_available():
        return [ctx.skip(f"torch not installed ({install_command('torch')})")]
    p = ctx.typed_params(Params)
    sizes, iters, warmup = list(p.sizes), p.iters, p.warmup
    # finish (and kill stragglers) before the runner abandons the check
    timeout_s = p.timeout_s or max(5.0, min(DEFAULT_TIMEOUT_S, ctx.remaining_s(10)))
    if _has_real_gpus(ctx):
        backend = "nccl"
        world_size = len(ctx.gpu.devices()) if p.world_size is None else p.world_size
        if world_size < 2:
            return [one_rank_skip(ctx, world_size, backend)]
        if p.use_nccl_tests and proc.which("all_reduce_perf"):
            return _run_nccl_tests(ctx, world_size, sizes, iters, warmup, timeout_s)
    elif not ctx.ports.compute.measured or p.cpu_ranks is not None:
        # the same code path across real processes on the CPU (stand-in GPUs, CI)
        backend = "gloo"
        world_size = 2 if p.cpu_ranks is None else p.cpu_ranks
    else:
        return ctx.gpus_unavailable() or [ctx.skip("no GPUs visible: nothing to all-reduce")]
    if world_size < 2:
        return [one_rank_skip(ctx, world_size, backend)]
    start = time.monotonic()
    runs = run_ranks(world_size, backend, sizes, iters, warmup, timeout_s)
    duration = time.monotonic() - start
    failure = _failure(ctx, runs, timeout_s)
    if failure:
        failure.duration_s = duration
        return [failure]
    doc = runs[0].doc or {}
    rows = [
        {
            "size_bytes": r["size_bytes"],
            "time_us": r["time_us"],
            "algbw": r["algbw_gbps"],
            "busbw": r["busbw_gbps"],
            "wrong": r["wrong"],
        }
        for r in doc["results"]
    ]
    evidence = {
        "backend": backend,
        "world_size": world_size,
        "iters": iters,
        "warmup": warmup,
        "stand_in": not ctx.ports.compute.measured,
        "tool": "torch.distributed",
        "torch": doc.get("torch"),
    }
    return _results(
        ctx,
        rows,
        evidence,
        ungraded=_not_graded_because(ctx, backend, world_size),
        duration=duration,
    )


def one_rank_skip(ctx: CheckContext, world_size: int, backend: str) -> Result:
    """With one rank there is nothing to reduce across: the bus bandwidth nccl-tests defines,
    busbw = algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md), is 0 by definition for n = 1,
    and no data leaves the GPU, so neither bandwidth nor correctness can be measured."""
    return ctx.result(
        "node",
        "busbw_peak_gbps",
        Status.SKIP,
        f"one rank ({backend}): an all-reduce needs two; its bus bandwidth "
        "busbw = algbw * 2(n-1)/n is 0 by definition with n = 1, and nothing "
        "crosses a link to be measured or checked",
        world_size=world_size,
        backend=backend,
    )


def _failure(ctx: CheckContext, runs: list[RankRun], timeout_s: float) -> Result | None:
    """An error result when any rank timed out, failed, or printed no measurement."""
    timed_out = [r.rank for r in runs if r.proc.timed_out]
    if timed_out:
        return ctx.result(
            "node",
            "busbw_peak_gbps",
            Status.ERROR,
            f"all-reduce ranks {timed_out} did not finish within {timeout_s:g} s "
            "and were killed (a peer that never connected, or a hang)",
            timeout_s=timeout_s,
            timed_out_ranks=timed_out,
            stderr_tail=_tail(runs[0].proc.stderr),
        )
    for r in runs:
        if not r.proc.ok or r.doc is None or "error" in r.doc:
            why = (r.doc or {}).get("error") or r.proc.describe_failure()
            return ctx.result(
                "node",
                "busbw_peak_gbps",
                Status.ERROR,
                f"all-reduce rank {r.rank} failed: {why}",
                rank=r.rank,
                returncode=r.proc.returncode,
                stderr_tail=_tail(r.proc.stderr),
            )
    return None


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _not_graded_because(ctx: CheckContext, backend: str, world_size: int) -> str | None:
    """Why the SKU's all-reduce minimum does not apply to this run, or None when it does.

    The minimum is a figure of the whole board over NVLink (``nccl_allreduce_busbw_gbps_min``:
    nccl-tests on all 8 GPUs of an HGX), so it grades only nccl on real GPUs, with as many
    ranks as the SKU has GPUs per node, on a host that sees the NVLinks: a VM holding part of
    a board, or whose GPUs show no active NVLink, measures a different thing."""
    if backend != "nccl":
        return f"backend {backend} on CPU"
    sku = ctx.sku
    if sku is None or sku.minimum("nccl_allreduce_busbw_gbps_min") is None:
        return None  # nothing to grade against; _results says "no SKU minimum"
    if world_size != sku.gpus_per_node:
        return (
            f"the SKU minimum is for all {sku.gpus_per_node} GPUs of a {sku.id} node; this "
            f"run had {world_size} ranks"
        )
    devices = ctx.gpu.devices()
    if host_view.read_host_view(devices).guest and not any(_active_links(d) for d in devices):
        return (
            "the GPUs are passed through to a VM that sees no active NVLink, and the SKU "
            "minimum is for the board's NVLinks"
        )
    return None


def _active_links(dev: Any) -> int:
    """Active NVLinks NVML reports for ``dev`` (0 where it cannot say)."""
    try:
        return sum(1 for link in dev.nvlinks() if link.active)
    except GpuError:
        return 0


def _results(
    ctx: CheckContext,
    rows: list[dict[str, Any]],
    evidence: dict[str, Any],
    ungraded: str | None,
    duration: float,
) -> list[Result]:
    out: list[Result] = []
    for row in rows:
        out.append(
            ctx.result(
                "node",
                "busbw_gbps",
                Status.PASS,
                f"{row['size_bytes']} B all-reduce: busbw {row['busbw']:.3f} GB/s, algbw "
                f"{row['algbw']:.3f} GB/s"
                + (f", {row['time_us']:.1f} us" if row.get("time_us") is not None else "")
                + f" ({evidence['backend']})",
                value=round(row["busbw"], 4),
                unit="GB/s",
                **row,
                **evidence,
            )
        )
    peak = max(rows, key=lambda r: r["busbw"])
    minimum = ctx.sku.minimum("nccl_allreduce_busbw_gbps_min") if ctx.sku else None
    graded = ungraded is None
    if graded and minimum is not None and peak["busbw"] < minimum:
        status = Status.FAIL
        detail = (
            f"peak all-reduce busbw {peak['busbw']:.1f} GB/s is below the SKU minimum "
            f"{minimum:g} GB/s (at {peak['size_bytes']} B)"
        )
    else:
        status = Status.PASS
        note = (
            ""
            if graded and minimum is not None
            else f" (not graded: {ungraded})"
            if not graded
            else " (no SKU minimum)"
        )
        detail = f"peak all-reduce busbw {peak['busbw']:.3f} GB/s at {peak['size_bytes']} B" + note
    out.append(
        ctx.result(
            "node",
            "busbw_peak_gbps",
            status,
            detail,
            value=round(peak["busbw"], 4),
            unit="GB/s",
            size_bytes=peak["size_bytes"],
            minimum=minimum if graded else None,
            **evidence,
        )
    )
    known = [r["wrong"] for r in rows if r["wrong"] is not None]
    wrong = sum(known)
    if known:
        out.append(
            ctx.result(
                "node",
                "wrong_elements",
                Status.FAIL if wrong else Status.PASS,
                f"{wrong} elements of the all-reduce results were wrong"
                + (": a rank contributes or transfers corrupt data" if wrong else ""),
                value=wrong,
                unit="elements",
                wrong_by_size={r["size_bytes"]: r["wrong"] for r in rows},
                **evidence,
            )
        )
    for r in out:
        r.duration_s = duration
    return out


def _run_nccl_tests(
    ctx: CheckContext, world_size: int, sizes: list[int], iters: int, warmup: int, timeout_s: float
) -> list[Result]:
    """nccl-tests' ``all_reduce_perf`` on ``world_size`` GPUs of this node, parsed."""
    argv = _all_reduce_argv(world_size, sizes, iters, warmup)
    res = proc.run(argv, timeout_s)
    if not res.ok:
        return [
            ctx.result(
                "node",
                "busbw_peak_gbps",
                Status.ERROR,
                res.describe_failure(),
                argv=list(argv),
                stderr_tail=_tail(res.stderr),
            )
        ]
    try:
        table = parse_all_reduce_perf(res.stdout)
    except ParseError as err:
        return [
            ctx.result(
                "node",
                "busbw_peak_gbps",
                Status.ERROR,
                f"cannot read all_reduce_perf output: {err}",
                argv=list(argv),
                stdout_tail=_tail(res.stdout),
            )
        ]
    rows = [
        {
            "size_bytes": r.size_bytes,
            "time_us": r.time_us,
            "algbw": r.algbw_gbps,
            "busbw": r.busbw_gbps,
            "wrong": r.wrong,
        }
        for r in table.rows
    ]
    evidence: dict[str, Any] = {
        "backend": "nccl",
        "world_size": world_size,
        "iters": iters,
        "warmup": warmup,
        "stand_in": False,
        "tool": "all_reduce_perf",
        "avg_busbw_gbps": table.avg_busbw_gbps,
        "out_of_bounds": table.out_of_bounds,
    }
    out = _results(
        ctx,
        rows,
        evidence,
        ungraded=_not_graded_because(ctx, "nccl", world_size),
        duration=res.duration_s,
    )
    out.extend(_validation_results(ctx, table, rows, evidence))
    return out


def _all_reduce_argv(world_size: int, sizes: list[int], iters: int, warmup: int) -> list[str]:
    """``all_reduce_perf`` over ``sizes`` (doubling) on ``world_size`` GPUs, validating."""
    return [
        proc.which("all_reduce_perf") or "all_reduce_perf",
        "-b",
        str(min(sizes)),
        "-e",
        str(max(sizes)),
        "-f",
        "2",
        "-g",
        str(world_size),
        "-n",
        str(iters),
        "-w",
        str(warmup),
        "-c",
        "1",
    ]


def _validation_results(
    ctx: CheckContext, table: NcclTable, rows: list[dict[str, Any]], evidence: dict[str, Any]
) -> list[Result]:
    """What all_reduce_perf's own validation says where no per-size count does: a skip when it
    did not validate, the out-of-bounds total of an older nccl-tests."""
    if table.validated is False:
        return [
            ctx.result(
                "node",
                "wrong_elements",
                Status.SKIP,
                "all_reduce_perf ran without validation (#wrong N/A): the results were not checked",
                **evidence,
            )
        ]
    if all(r["wrong"] is None for r in rows) and table.out_of_bounds is not None:
        # older nccl-tests: no per-size count, only the run's out-of-bounds total
        return [
            ctx.result(
                "node",
                "wrong_elements",
                Status.FAIL if table.out_of_bounds else Status.PASS,
                f"{table.out_of_bounds} out-of-bounds values (all_reduce_perf)",
                value=table.out_of_bounds,
                unit="elements",
                **evidence,
            )
        ]
    return []


#: ``node_agent_allreduce_busbw_bytes_per_second``: the latest run's ``busbw_peak_gbps`` (the
#: node's peak, not each message size)
BusbwMetrics = node_gauge(
    "node_agent_allreduce_busbw_bytes_per_second",
    "Peak all-reduce bus bandwidth of the node in the latest nccl_allreduce run "
    "(bytes/s, nccl-tests' busbw)",
    1e9, lambda r: [] if r.metric == "busbw_peak_gbps" else None)  # fmt: skip


SERVICE = ServiceBehaviour(metrics=BusbwMetrics)
