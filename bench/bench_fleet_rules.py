"""Benchmark: what the fleet's Prometheus rules (packaging/prometheus/) cost a real Prometheus.

    .venv/bin/python bench/bench_fleet_rules.py [--nodes 500,1000,2000] [--gpus 8] \
        [--hcas 8] [--seconds 180] [--prometheus prometheus]

For each fleet size N it starts a local Prometheus server (loopback only, a temporary TSDB)
that scrapes a synthetic fleet served from this process: N nodes of ``--gpus`` GPUs and
``--hcas`` HCA ports, each with the series the rules read, as the daemon names them (119 per
node at 8 GPUs and 8 ports: grades, drained, burn in two precisions, HBM, four PCIe figures,
busbw, corrected ECC, PCIe replays, remapped rows by cause, three HCA counters per port),
split into targets of 100 nodes, every 15 s. It first runs ``--seconds`` without rules, then
loads the shipped rules (SIGHUP; every group's interval set to 15 s: the cost of one
evaluation does not depend on its interval) and runs ``--seconds`` more. The difference of
the server's CPU time (user + system, /proc/<pid>/stat) per 15 s round is what one round of
every rule costs; CPU time, unlike wall time, holds on a machine others are using too. Each
group's and rule's ``evaluationTime`` (wall; the median of reads of ``/api/v1/rules`` every
15 s) gives their shares.

The range rules read what the TSDB holds: a run of ``--seconds`` gives their windows (1 h, 1 d,
7 d) a few minutes of samples, not a day, so their figures here are a floor; docs/fleet.md
turns them into the cost of full windows with the per-sample cost measured by ``--window``:
    .venv/bin/python bench/bench_fleet_rules.py --window --series 2000 --samples 5760
backfills ``--series`` counters of ``--samples`` samples (a day at 15 s) with ``promtool tsdb
create-blocks-from openmetrics`` and times the forecast expression over them through the
server's query API (median of 5).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from node_agent.peers import free_loopback_port

RULES = Path(__file__).resolve().parents[1] / "packaging" / "prometheus" / "node-agent.rules.yml"
NODES_PER_TARGET = 100


def node_text(i: int, gpus: int, hcas: int, rng: random.Random) -> str:
    h = f'hostname="node{i:05d}"'
    lines = [f'node_agent_up{{{h},simulated="false"}} 1']
    level = "FAULT" if i % 997 == 0 else "HEALTHY"
    lines += [
        f'node_agent_health{{{h},level="{lv}"}} {int(lv == level)}'
        for lv in ("HEALTHY", "WARN", "ERROR", "FAULT")
    ]
    lines.append(f'node_agent_drained_by_agent{{{h},source="state"}} {int(i % 50 == 0)}')
    slow = 0.85 if i % 211 == 0 else 1.0
    for g in range(gpus):
        gl = f'{h},gpu="{g}",uuid="GPU-{i:05d}-{g}"'
        for p, base in (("bf16", 700e12), ("fp8", 1400e12)):
            lines.append(
                f'node_agent_gpu_burn_flops_per_second{{{gl},precision="{p}"}} '
                f"{base * slow * rng.uniform(0.99, 1.01):.6g}"
            )
        lines.append(
            f"node_agent_gpu_hbm_copy_bytes_per_second{{{gl}}} "
            f"{2900e9 * rng.uniform(0.99, 1.01):.6g}"
        )
        for d in ("h2d", "d2h"):
            for m in ("alone", "concurrent"):
                lines.append(
                    f'node_agent_gpu_pcie_bytes_per_second{{{gl},direction="{d}",'
                    f'mode="{m}"}} {55e9 * rng.uniform(0.98, 1.02):.6g}'
                )
        lines.append(f"node_agent_gpu_ecc_sbe_volatile_errors{{{gl}}} {rng.randrange(5)}")
        lines.append(f"node_agent_gpu_pcie_replay_errors{{{gl}}} {rng.randrange(3)}")
        for c in ("correctable", "uncorrectable"):
            lines.append(f'node_agent_gpu_remapped_rows{{{gl},cause="{c}"}} {rng.randrange(2)}')
    for p in range(hcas):
        for c in ("symbol_error", "link_downed", "port_rcv_errors"):
            lines.append(
                f'node_agent_hca_port_errors{{{h},hca="mlx5_{p}",port="1",'
                f'counter="{c}"}} {rng.randrange(2)}'
            )
    lines.append(
        f"node_agent_allreduce_busbw_bytes_per_second{{{h}}} "
        f"{480e9 * slow * rng.uniform(0.99, 1.01):.6g}"
    )
    return "\n".join(lines) + "\n"


def serve(pages: dict[str, bytes]) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def get_json(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_prometheus(
    prometheus: str, workdir: Path, config: dict, port: int, rules: dict | None
) -> subprocess.Popen:
    if rules is not None:
        (workdir / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config["rule_files"] = [str(workdir / "rules.yml")]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=30d",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"prometheus exited: {proc.stderr.read()}") from None
            time.sleep(0.5)
    raise SystemExit("prometheus did not start within 60 s")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/<pid>/stat), robust to a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fleet(args, n: int) -> dict:
    """One Prometheus scrapes the fleet for ``--seconds`` without rules, then (the rules loaded
    by SIGHUP) for ``--seconds`` with them: the difference of its CPU time, per round of
    evaluations, is what the rules cost; ``evaluationTime`` (wall, inflated by a busy machine)
    gives each group's and rule's share."""
    rng = random.Random(n)
    pages = {}
    for t in range(0, n, NODES_PER_TARGET):
        pages[f"/metrics/{t}"] = "".join(
            node_text(i, args.gpus, args.hcas, rng) for i in range(t, min(n, t + NODES_PER_TARGET))
        ).encode()
    server, port = serve(pages)
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "15s"
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s", "scrape_timeout": "10s"},
        "scrape_configs": [
            {
                "job_name": "node-agent",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{port}"],
                        "labels": {
                            "__metrics_path__": path,
                            "instance": f"shard{path.rsplit('/', 1)[1]}",
                            "cluster": "bench",
                            "sku": "h100-sxm5-80gb",
                        },
                    }
                    for path in pages
                ],
            }
        ],
    }
    prom_port = free_loopback_port()
    with tempfile.TemporaryDirectory(prefix="bench-rules-") as tmp:
        work = Path(tmp)
        proc = start_prometheus(args.prometheus, work, config, prom_port, {"groups": []})
        try:
            base = f"http://127.0.0.1:{prom_port}"
            time.sleep(45)  # the first scrapes create the series
            c0 = cpu_s(proc.pid)
            time.sleep(args.seconds)
            idle = cpu_s(proc.pid) - c0
            (work / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
            proc.send_signal(signal.SIGHUP)
            time.sleep(35)  # every group has evaluated once (series of the records created)
            groups: dict[str, list[float]] = {}
            per_rule: dict[str, list[float]] = {}
            c1 = cpu_s(proc.pid)
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                time.sleep(15)
                for g in get_json(base + "/api/v1/rules")["data"]["groups"]:
                    groups.setdefault(g["name"], []).append(g["evaluationTime"])
                    for r in g["rules"]:
                        per_rule.setdefault(r["name"], []).append(r["evaluationTime"])
            busy = cpu_s(proc.pid) - c1
            elapsed = args.seconds + (time.monotonic() - end)
            series = get_json(base + "/api/v1/status/tsdb")["data"]["headStats"]["numSeries"]
            samples = get_json(
                base
                + "/api/v1/query?query="
                + urllib.parse.quote(
                    "max(count_over_time(node_agent_gpu_ecc_sbe_volatile_errors[1d]))"
                )
            )
        finally:
            proc.terminate()
            proc.wait(30)
            server.shutdown()
    window = samples["data"]["result"][0]["value"][1] if samples["data"]["result"] else "0"
    rounds = elapsed / 15
    return {
        "nodes": n,
        "head_series": int(series),
        "samples_in_1d_window": int(window),
        "cpu_idle_s": idle,
        "cpu_rules_s": busy,
        "rules_cpu_per_round_s": (busy - idle * elapsed / args.seconds) / rounds,
        "groups_s": {k: statistics.median(v) for k, v in groups.items()},
        "rules_s": {k: statistics.median(v) for k, v in per_rule.items()},
        "reads": len(next(iter(groups.values()), [])),
    }


def window(args) -> dict:
    """Per-sample cost of the forecast's range read: backfill a day, time the query."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool not installed")
    start = int(time.time()) - args.samples * 15 - 3600
    with tempfile.TemporaryDirectory(prefix="bench-window-") as tmp:
        work = Path(tmp)
        om = work / "data.om"
        with om.open("w") as f:
            f.write("# TYPE node_agent_gpu_ecc_sbe_volatile_errors gauge\n")
            for k in range(args.samples):
                ts = start + 15 * k
                for s in range(args.series):
                    f.write(
                        f'node_agent_gpu_ecc_sbe_volatile_errors{{hostname="n{s // 8}",'
                        f'gpu="{s % 8}"}} {k // 100 + s % 3} {ts}\n'
                    )
            f.write("# EOF\n")
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(work / "tsdb")],
            check=True,
            capture_output=True,
            timeout=3600,
        )
        om.unlink()
        port = free_loopback_port()
        proc = start_prometheus(args.prometheus, work, {"global": {}}, port, None)
        try:
            expr = (
                "predict_linear(node_agent_gpu_ecc_sbe_volatile_errors[1d], 7 * 86400) "
                "> 1000 unless on(hostname, gpu) "
                "(resets(node_agent_gpu_ecc_sbe_volatile_errors[1d]) > 0)"
            )
            at = start + 15 * args.samples
            times = []
            for _ in range(6):
                t0 = time.perf_counter()
                doc = get_json(
                    f"http://127.0.0.1:{port}/api/v1/query?stats=all&time={at}"
                    f"&query={urllib.parse.quote(expr)}",
                    600,
                )
                times.append(time.perf_counter() - t0)
            stats = doc["data"].get("stats", {})
        finally:
            proc.terminate()
            proc.wait(30)
    t = statistics.median(times[1:])
    read = args.series * args.samples * 2  # two range reads of the same series
    return {
        "series": args.series,
        "samples_per_series": args.samples,
        "query_s": t,
        "ns_per_sample_read": t / read * 1e9,
        "stats": stats.get("samples", stats),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", default="500,1000,2000")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hcas", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=180)
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    ap.add_argument("--window", action="store_true")
    ap.add_argument("--series", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=5760)
    args = ap.parse_args()
    if args.window:
        print(json.dumps(window(args), indent=1))
        return 0
    for n in (int(x) for x in args.nodes.split(",")):
        out = fleet(args, n)
        print(
            f"\n{n} nodes: {out['head_series']} head series, "
            f"{out['samples_in_1d_window']} samples in a 1d window, {out['reads']} reads; "
            f"Prometheus CPU {out['cpu_idle_s']:.1f} s without rules, "
            f"{out['cpu_rules_s']:.1f} s with them ({args.seconds} s each): the rules cost "
            f"{out['rules_cpu_per_round_s']:.3f} CPU s per round of evaluations"
        )
        for name, s in out["groups_s"].items():
            print(f"  group {name:28s} {s * 1000:9.1f} ms")
        slowest = sorted(out["rules_s"].items(), key=lambda kv: -kv[1])[:8]
        for name, s in slowest:
            print(f"    rule {name:58s} {s * 1000:8.1f} ms")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
