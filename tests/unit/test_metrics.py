"""The daemon's metrics, rendered through a real Prometheus registry: the daemon's node-wide
series (node_agent.service.metrics) and the checks' own collectors (each check's
``SERVICE.metrics``: training_progress's processes, nvml_health's readings, the throughput
checks' figures, the HCA port counters of rdma and hca_ports)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_agent.checking.behaviour import MAX_LABEL_CHARS, CheckMetrics, NodeLabels, behaviour
from node_agent.checking.hca_metrics import HcaPortErrors
from node_agent.checking.registry import REGISTRY
from node_agent.checks.nvml_health.metrics import NvmlReadings
from node_agent.checks.training_progress import TrainingMetrics
from node_agent.model import Level, Result, Status
from node_agent.service.metrics import DaemonCollector, Snapshot


def HangTracker() -> TrainingMetrics:  # noqa: N802 - the tests below read as before
    return TrainingMetrics(lambda: NodeLabels("n1", {}))


def training(
    metric: str,
    status: Status,
    *,
    pid: int,
    rank: int | None = 0,
    job: str = "slurm:1234",
    age: float | None = 1.5,
    step_time: float | None = 0.4,
    **extra,
) -> Result:
    """A per-process ``training_progress`` result in the shape of docs/training_hangs.md."""
    target = f"job:{job}/rank:{rank}" if rank is not None else f"job:{job}/pid:{pid}"
    value = {"training_progress": age, "training_hang": age, "training_straggler": 2.5}[metric]
    return Result(
        "training_progress",
        target,
        metric,
        status,
        f"{metric} of pid {pid}",
        value=value,
        unit="x" if metric == "training_straggler" else "s",
        evidence={
            "pid": pid,
            "rank": rank,
            "local_rank": rank,
            "world_size": 16,
            "job": job,
            "step": 120,
            "step_time_s": step_time,
            "heartbeat_age_s": age,
            "gpus": [0],
            "signals": {},
            "agreeing": ["heartbeat"] if metric == "training_hang" else [],
            "likely_origin": None,
            **extra,
        },
    )


def check_collectors(
    results: list[Result],
    labels: NodeLabels,
    built: dict[object, CheckMetrics] | None = None,
) -> list[CheckMetrics]:
    """The checks' own collectors, as the daemon builds and feeds them: one per factory that a
    check's SERVICE declares (``built``: some already built), each run's results to the
    collector of the check that ran."""
    built = {} if built is None else built
    for check in dict.fromkeys(r.check for r in results):
        factory = behaviour(check).metrics
        if factory is not None:
            if factory not in built:
                built[factory] = factory(lambda: labels)
            built[factory].observe([r for r in results if r.check == check])
    return list(built.values())


def render(snap: Snapshot, collectors: list[CheckMetrics]) -> dict[str, list]:
    """name -> samples, from ``generate_latest`` of a fresh registry, parsed back."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(lambda: snap))
    for collector in collectors:
        registry.register(collector)
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def scrape(results: list[Result], hangs: TrainingMetrics | None = None) -> dict[str, list]:
    """The daemon's collector and the checks' own, ``results`` fed to the collector their
    check's SERVICE declares (``hangs``: training_progress's, one that has observed its runs
    already)."""
    built: dict[object, CheckMetrics] = {TrainingMetrics: hangs or HangTracker()}
    if hangs is not None:
        results = [r for r in results if behaviour(r.check).metrics is not TrainingMetrics]
    snap = Snapshot(hostname="n1", level=Level.HEALTHY, checks={})
    return render(snap, check_collectors(results, NodeLabels("n1", {}), built))


def by_pid(samples) -> dict[str, float]:
    return {s.labels["pid"]: s.value for s in samples}


def test_training_gauges_carry_job_rank_pid_and_the_heartbeat_figures():
    m = scrape(
        [
            training("training_progress", Status.PASS, pid=11, rank=0, age=2.0, step_time=0.5),
            training("training_hang", Status.FAIL, pid=12, rank=1, age=400.0, step_time=0.5),
        ]
    )
    ages = m["node_agent_training_heartbeat_age_seconds"]
    assert {
        (s.labels["job"], s.labels["rank"], s.labels["pid"], s.labels["hostname"], s.value)
        for s in ages
    } == {("slurm:1234", "0", "11", "n1", 2.0), ("slurm:1234", "1", "12", "n1", 400.0)}
    assert by_pid(m["node_agent_training_hang_suspected"]) == {"11": 0.0, "12": 1.0}
    assert by_pid(m["node_agent_training_step_time_seconds"]) == {"11": 0.5, "12": 0.5}


def test_straggler_is_not_a_hang_and_its_progress_result_is_the_same_series():
    m = scrape(
        [
            training("training_straggler", Status.WARN, pid=21, step_time=1.2),
            training("training_progress", Status.PASS, pid=21, step_time=1.2),
        ]
    )
    assert [(s.labels["pid"], s.value) for s in m["node_agent_training_hang_suspected"]] == [
        ("21", 0.0)
    ], "one series per process, never a duplicate sample"
    assert by_pid(m["node_agent_training_step_time_seconds"]) == {"21": 1.2}


def test_process_without_heartbeat_has_no_age_or_step_time_and_an_empty_rank():
    m = scrape(
        [
            training(
                "training_progress",
                Status.PASS,
                pid=31,
                rank=None,
                age=None,
                step_time=None,
                job="ppid:77",
            )
        ]
    )
    assert "node_agent_training_heartbeat_age_seconds" not in m
    assert "node_agent_training_step_time_seconds" not in m
    (sample,) = m["node_agent_training_hang_suspected"]
    assert sample.labels == {"hostname": "n1", "job": "ppid:77", "rank": "", "pid": "31"}


def test_discovery_problems_and_other_checks_make_no_training_series():
    m = scrape(
        [
            Result(
                "training_progress",
                "node",
                "training_discovery",
                Status.WARN,
                "cannot list processes",
            ),
            Result(
                "nvml_health",
                "gpu:0",
                "training_hang",
                Status.FAIL,
                "not ours",
                evidence={"pid": 1},
            ),
        ]
    )
    assert "node_agent_training_hang_suspected" not in m


def test_untrusted_job_label_is_cut_and_escaped():
    job = "pod:ns/" + '"\\\n' * 10 + "x" * 500
    m = scrape([training("training_hang", Status.FAIL, pid=41, job=job)])
    (sample,) = m["node_agent_training_hang_suspected"]
    assert sample.labels["job"] == job[:MAX_LABEL_CHARS], "escaped on the wire, parsed back"
    assert len(sample.labels["job"]) == MAX_LABEL_CHARS


def test_a_lone_surrogate_in_a_job_label_is_escaped_and_the_scrape_still_renders():
    samples = scrape([training("training_progress", Status.PASS, pid=7, job="slurm:\ud800x")])
    (series,) = samples["node_agent_training_heartbeat_age_seconds"]
    assert series.labels["job"] == "slurm:\\ud800x"


def test_hang_suspicions_counter_is_exported_even_at_zero():
    assert [s.value for s in scrape([])["node_agent_training_hang_suspicions_total"]] == [0.0]
    hangs = HangTracker()
    hangs.observe([training("training_hang", Status.FAIL, pid=p, rank=p) for p in (1, 2, 3)])
    assert [s.value for s in scrape([], hangs)["node_agent_training_hang_suspicions_total"]] == [
        3.0
    ]


def test_training_progress_declares_the_hang_counter_and_other_checks_do_not():
    """The daemon feeds a check's results only to the collector its SERVICE declares."""
    assert behaviour("training_progress").metrics is TrainingMetrics
    assert behaviour("xid").metrics is None, "the XID watch is the Xid counter's collector"
    assert behaviour("nvml_health").metrics is NvmlReadings


def test_hang_tracker_counts_a_process_once_while_it_stays_hung():
    t = HangTracker()
    stepping = [
        training("training_progress", Status.PASS, pid=1),
        training("training_progress", Status.PASS, pid=2, rank=1),
    ]
    hung = [
        training("training_hang", Status.FAIL, pid=1),
        training("training_progress", Status.PASS, pid=2, rank=1),
    ]
    t.observe(stepping)
    assert t.total == 0
    t.observe(hung)
    t.observe(hung)
    assert t.total == 1, "still hung on the next run: the same suspicion"
    t.observe(stepping)
    t.observe(hung)
    assert t.total == 2, "recovered, then hung again: a new suspicion"


def test_hang_tracker_counts_each_hung_process_and_ignores_broken_runs():
    t = HangTracker()
    both = [
        training("training_hang", Status.FAIL, pid=1),
        training("training_hang", Status.FAIL, pid=2, rank=1),
    ]
    t.observe(both)
    assert t.total == 2
    t.observe([Result("training_progress", "node", "crashed", Status.ERROR, "timed out")])
    t.observe(both)
    assert t.total == 2, "a run that could not complete is no news about the processes"
    t.observe(both)
    assert t.total == 2
    same_pid_other_job = [training("training_hang", Status.FAIL, pid=1, job="slurm:99")]
    t.observe(same_pid_other_job)
    assert t.total == 3


# -- the HTTP endpoint: one thread, idle connections never block a scrape, no tracebacks ------


def _get(port: int, path: str = "/metrics", timeout: float = 5.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _serve(**kw):
    import threading

    from node_agent.service.metrics import MetricsServer

    server = MetricsServer(
        ("127.0.0.1", 0), {"/metrics": lambda: (200, "text/plain", b"ok\n")}, **kw
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_idle_connections_never_block_a_scrape_nor_cost_a_thread(capfd):
    import socket
    import threading

    before = threading.active_count()
    server = _serve(max_per_peer=16)
    port = server.server_address[1]
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        # no thread per connection; the newest connection (a scrape) is served at once, the
        # oldest idle ones are closed to make room (16 per peer at most)
        assert threading.active_count() - before <= 1
        for _ in range(5):
            assert _get(port, timeout=2) == (200, b"ok\n")
        assert _get(port, "/nowhere")[0] == 404
        assert server.served == 6 and server.dropped >= 300 - 16
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_connection_that_sends_no_request_is_closed_after_the_request_timeout():
    import socket
    import time

    server = _serve(request_s=0.3)
    try:
        sock = socket.create_connection(server.server_address[:2])
        sock.sendall(b"GET /metr")  # a dribbler: never finishes its request line
        sock.settimeout(5)
        start = time.monotonic()
        assert sock.recv(100) == b""  # closed by the server, unanswered
        assert time.monotonic() - start < 4
        sock.close()
    finally:
        server.shutdown()
        server.server_close()


def test_head_answers_headers_only_and_other_methods_405():
    import socket

    server = _serve()
    try:
        for request, status, body in (
            (b"HEAD /metrics HTTP/1.1\r\n\r\n", b"200", b""),
            (b"POST /metrics HTTP/1.1\r\n\r\n", b"405", b"only GET\n"),
            (b"nonsense\r\n\r\n", b"400", b"bad request\n"),
        ):
            with socket.create_connection(server.server_address[:2], timeout=5) as sock:
                sock.sendall(request)
                reply = b""
                while chunk := sock.recv(4096):
                    reply += chunk
            head, _, rest = reply.partition(b"\r\n\r\n")
            assert head.split()[1] == status and rest == body
    finally:
        server.shutdown()
        server.server_close()


# keeps n idle connections open at all times: one the server closes is opened again at once
HOLD_IDLE = """
import select, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
print("ready", flush=True)
while True:
    readable, _, _ = select.select(socks, [], [], 0.2)
    for s in readable:
        s.close()
        socks.remove(s)
        try:
            socks.append(socket.create_connection(("127.0.0.1", port)))
        except OSError:
            pass
"""


def test_scrapes_are_served_while_a_peer_keeps_200_idle_connections_open_past_its_cap():
    import subprocess
    import sys

    server = _serve()  # 64 per peer: every newcomer of the holder closes an older one of its own
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_IDLE, str(server.server_address[1]), "200"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        codes = [_get(server.server_address[1], timeout=5)[0] for _ in range(40)]
        assert codes == [200] * 40
        assert server.dropped > 200 - 64  # the holder's connections were the ones closed
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        server.shutdown()
        server.server_close()


# -- the fleet's series: throughput, error counters, drained by the agent -----------------------


GPU_UUIDS = {0: "GPU-aaa", 1: "GPU-bbb"}


def scrape_snapshot(results: list[Result] = (), **kw) -> dict[str, list]:
    """The daemon's collector on a snapshot of ``kw``, and the checks' own collectors fed
    ``results`` (each check's run to the collector its SERVICE declares)."""
    snap = Snapshot(**{"hostname": "n1", "level": Level.HEALTHY, "checks": {}, **kw})
    return render(snap, check_collectors(list(results), NodeLabels("n1", GPU_UUIDS)))


def test_throughput_figures_are_exported_per_gpu_in_base_units():
    m = scrape_snapshot(
        results=[
            Result(
                "gpu_burn", "gpu:0", "tflops_bf16", Status.PASS, "", value=712.5, unit="TFLOP/s"
            ),
            Result(
                "gpu_burn", "gpu:1", "tflops_bf16", Status.FAIL, "slow", value=600.0, unit="TFLOP/s"
            ),
            Result(
                "gpu_burn", "gpu:0", "tflops_fp8", Status.PASS, "", value=1400.0, unit="TFLOP/s"
            ),
            Result(
                "hbm_bandwidth", "gpu:1", "copy_gbps", Status.PASS, "", value=2900.0, unit="GB/s"
            ),
            Result("pcie_bandwidth", "gpu:0", "h2d_gbps", Status.PASS, "", value=55.0, unit="GB/s"),
            Result(
                "pcie_bandwidth",
                "gpu:0",
                "d2h_gbps_concurrent",
                Status.PASS,
                "",
                value=40.0,
                unit="GB/s",
            ),
            Result(
                "nccl_allreduce",
                "node",
                "busbw_peak_gbps",
                Status.PASS,
                "",
                value=480.0,
                unit="GB/s",
            ),
            Result(
                "nccl_allreduce", "node", "busbw_gbps", Status.PASS, "", value=12.0, unit="GB/s"
            ),
        ]
    )
    burn = {
        (s.labels["gpu"], s.labels["uuid"], s.labels["precision"]): s.value
        for s in m["node_agent_gpu_burn_flops_per_second"]
    }
    assert burn == {
        ("0", "GPU-aaa", "bf16"): 712.5e12,
        ("1", "GPU-bbb", "bf16"): 600e12,
        ("0", "GPU-aaa", "fp8"): 1400e12,
    }, "a failing (slow) GPU is the point"
    (hbm,) = m["node_agent_gpu_hbm_copy_bytes_per_second"]
    assert (hbm.labels["gpu"], hbm.value) == ("1", 2900e9)
    assert {
        (s.labels["direction"], s.labels["mode"]): s.value
        for s in m["node_agent_gpu_pcie_bytes_per_second"]
    } == {("h2d", "alone"): 55e9, ("d2h", "concurrent"): 40e9}
    assert [(s.labels, s.value) for s in m["node_agent_allreduce_busbw_bytes_per_second"]] == [
        ({"hostname": "n1"}, 480e9)
    ], "the peak only, not each message size"


def test_a_throughput_check_that_skipped_or_broke_makes_no_series():
    m = scrape_snapshot(
        results=[
            Result("gpu_burn", "node", "tflops_fp8", Status.SKIP, "fp8 not supported"),
            Result("gpu_burn", "gpu:0", "tflops_bf16", Status.ERROR, "worker died", value=None),
            Result("hbm_bandwidth", "gpu:0", "copy_gbps", Status.ERROR, "timed out", value=1.0),
            Result("nvml_health", "gpu:0", "copy_gbps", Status.PASS, "not this check", value=1.0),
        ]
    )
    assert "node_agent_gpu_burn_flops_per_second" not in m
    assert "node_agent_gpu_hbm_copy_bytes_per_second" not in m


def test_remapped_rows_and_hca_port_counters_are_exported_as_read():
    m = scrape_snapshot(
        results=[
            Result(
                "nvml_health",
                "gpu:1",
                "row_remap",
                Status.PASS,
                "",
                value=1,
                evidence={"corrected_rows": 3, "uncorrected_rows": 1},
            ),
            Result(
                "rdma",
                "hca:mlx5_0",
                "link_errors",
                Status.WARN,
                "",
                value=7,
                evidence={
                    "device": "mlx5_0",
                    "port": "1",
                    "symbol_error": 5,
                    "link_downed": 2,
                    "port_rcv_errors": None,
                    "link_layer": "InfiniBand",
                },
            ),
        ]
    )
    assert {
        (s.labels["gpu"], s.labels["uuid"], s.labels["cause"]): s.value
        for s in m["node_agent_gpu_remapped_rows"]
    } == {("1", "GPU-bbb", "correctable"): 3, ("1", "GPU-bbb", "uncorrectable"): 1}
    assert {
        (s.labels["hca"], s.labels["port"], s.labels["counter"]): s.value
        for s in m["node_agent_hca_port_errors"]
    } == {("mlx5_0", "1", "symbol_error"): 5, ("mlx5_0", "1", "link_downed"): 2}, (
        "an unreadable counter (None) is no series, never a 0"
    )


def test_drained_by_agent_reads_the_remediation_state_when_the_daemon_gives_it():
    for state, drained in (
        ("in-service", 0),
        ("drained", 1),
        ("restarting", 1),
        ("awaiting-replacement", 1),
        ("needs-operator", 1),
    ):
        (sample,) = scrape_snapshot(remediation_state=state)["node_agent_drained_by_agent"]
        assert (sample.value, sample.labels["source"]) == (drained, "state"), state


def test_drained_by_agent_falls_back_to_the_actions_counted_since_the_daemon_started():
    def drained(actions):
        (sample,) = scrape_snapshot(actions=actions)["node_agent_drained_by_agent"]
        assert sample.labels["source"] == "actions"
        return sample.value

    assert drained({}) == 0
    assert drained({("drain", "done"): 1, ("drain", "refused"): 4}) == 1
    assert drained({("drain", "done"): 1, ("resume", "done"): 1}) == 0
    assert drained({("drain", "dry-run"): 2}) == 0, "a dry run drains nothing"


# -- one home per family: the daemon's collector renders no check's results ---------------------


def every_check_collector(labels: NodeLabels) -> list[CheckMetrics]:
    """One collector per factory that any registered check declares, as the daemon builds them
    at start."""
    built: dict[object, CheckMetrics] = {}
    for check in REGISTRY:
        factory = behaviour(check).metrics
        if factory is not None and factory not in built:
            built[factory] = factory(lambda: labels)
    return list(built.values())


def test_every_family_has_one_home_in_the_exposition():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        DaemonCollector(lambda: Snapshot(hostname="n1", level=Level.HEALTHY, checks={}))
    )
    for collector in every_check_collector(NodeLabels("n1", GPU_UUIDS)):
        registry.register(collector)
    text = generate_latest(registry).decode()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert sorted(names) == sorted(set(names)), "a family rendered twice fails the scrape"
    assert "node_agent_hca_port_errors" in names and "node_agent_gpu_remapped_rows" in names


def test_the_daemons_collector_renders_only_node_wide_series_and_holds_no_results():
    results = [
        Result("nvml_health", "gpu:0", "temperature", Status.PASS, "", value=40.0),
        Result("gpu_burn", "gpu:0", "tflops_bf16", Status.PASS, "", value=700.0),
        Result("nccl_allreduce", "node", "busbw_peak_gbps", Status.PASS, "", value=400.0),
    ]
    # what checks measure reaches a scrape only through the checks' own collectors
    assert not {"results", "gpu_uuids"} & set(Snapshot.__dataclass_fields__)
    snap = Snapshot(hostname="n1", level=Level.HEALTHY, checks={})
    rendered = render(snap, [])
    assert not [n for n in rendered if n.startswith(("node_agent_gpu_", "node_agent_allreduce"))]
    assert scrape_snapshot(results)["node_agent_gpu_temperature_celsius"][0].value == 40.0


def test_rdma_and_hca_ports_feed_one_family_and_a_run_replaces_only_its_own_checks_counters():
    def port(check: str, device: str, symbol_error: int | None) -> Result:
        evidence = {"device": device, "port": "1", "symbol_error": symbol_error}
        return Result(check, f"hca:{device}", "link_errors", Status.PASS, "", evidence=evidence)

    assert behaviour("rdma").metrics is behaviour("hca_ports").metrics is HcaPortErrors
    (collector,) = check_collectors(
        [port("rdma", "mlx5_0", 5), port("hca_ports", "mlx5_1", 9)], NodeLabels("n1", {})
    )

    def counters() -> dict[str, float]:
        m = render(Snapshot(hostname="n1", level=Level.HEALTHY, checks={}), [collector])
        return {s.labels["hca"]: s.value for s in m.get("node_agent_hca_port_errors", [])}

    assert counters() == {"mlx5_0": 5, "mlx5_1": 9}
    collector.observe([port("hca_ports", "mlx5_1", 11)])
    assert counters() == {"mlx5_0": 5, "mlx5_1": 11}, "rdma's run stays until rdma runs again"
    collector.observe([Result("rdma", "node", "rdma", Status.ERROR, "ib_write_bw timed out")])
    assert counters() == {"mlx5_1": 11}, "a run that could not read the ports takes its series"


def test_a_check_the_daemon_no_longer_runs_is_forgotten_gauges_go_and_counters_stay():
    """A reload that drops a check calls ``forget``: no stale reading is scraped as current."""

    def port(check: str, device: str) -> Result:
        evidence = {"device": device, "port": "1", "symbol_error": 3}
        return Result(check, f"hca:{device}", "link_errors", Status.PASS, "", evidence=evidence)

    (hca,) = check_collectors(
        [port("rdma", "mlx5_0"), port("hca_ports", "mlx5_1")], NodeLabels("n1", {})
    )
    hca.forget("rdma")
    m = render(Snapshot(hostname="n1", level=Level.HEALTHY, checks={}), [hca])
    assert {s.labels["hca"] for s in m["node_agent_hca_port_errors"]} == {"mlx5_1"}

    hangs = HangTracker()
    hangs.observe([training("training_hang", Status.FAIL, pid=1)])
    hangs.forget("training_progress")
    m = scrape([], hangs)
    assert "node_agent_training_hang_suspected" not in m
    assert [s.value for s in m["node_agent_training_hang_suspicions_total"]] == [1.0]
    hangs.observe([training("training_hang", Status.FAIL, pid=1)])
    assert hangs.total == 2, "back on the schedule and hung: seen going from unseen to hung"

    sdc_result = Result("sdc", "gpu:0", "sdc", Status.PASS, "")
    (sdc,) = check_collectors([sdc_result], NodeLabels("n1", {}))
    sdc.forget("sdc")
    m = render(Snapshot(hostname="n1", level=Level.HEALTHY, checks={}), [sdc])
    assert [s.value for s in m["node_agent_sdc_probes_total"]] == [1.0]


def test_a_throughput_figure_is_the_latest_runs_and_a_broken_run_takes_it_away():
    (burn,) = check_collectors(
        [Result("gpu_burn", "gpu:1", "tflops_bf16", Status.PASS, "", value=700.0)],
        NodeLabels("n1", GPU_UUIDS),
    )

    def flops() -> list[tuple[str, float]]:
        m = render(Snapshot(hostname="n1", level=Level.HEALTHY, checks={}), [burn])
        return [
            (s.labels["uuid"], s.value) for s in m.get("node_agent_gpu_burn_flops_per_second", [])
        ]

    assert flops() == [("GPU-bbb", 700e12)]
    burn.observe([Result("gpu_burn", "gpu:1", "tflops_bf16", Status.FAIL, "slow", value=500.0)])
    assert flops() == [("GPU-bbb", 500e12)]
    burn.observe([Result("gpu_burn", "node", "crashed", Status.ERROR, "worker died")])
    assert flops() == []


def test_row_remap_state_is_exported_per_gpu_as_nvml_health_read_it():
    m = scrape_snapshot(
        [
            Result("nvml_health", "gpu:1", "row_remap_pending", Status.WARN, "", value=1),
            Result("nvml_health", "gpu:0", "row_remap", Status.PASS, "", value=0),
            Result("nvml_health", "gpu:0", "power", Status.PASS, "", value=True),
        ]
    )
    pending = {s.labels["gpu"]: s.value for s in m["node_agent_gpu_row_remap_pending"]}
    failure = {s.labels["gpu"]: s.value for s in m["node_agent_gpu_row_remap_failure"]}
    assert (pending, failure) == ({"0": 0, "1": 1}, {"0": 0, "1": 0})
    assert "node_agent_gpu_power_usage_watts" not in m, "a bool is no reading"
