"""The hca_ports check against fake /sys/class/infiniband trees under tmp_path.

No RDMA device exists on CI, so every port here is written by the test in the kernel's format
(``4: ACTIVE``, ``400 Gb/sec (4X NDR)``, decimal counters; drivers/infiniband/core/sysfs.c),
and time is passed to the check instead of waited for. The mlx5 kernel lines are built in the
driver's own form (``mlx5_core <bdf>: <function>:<line>:(pid <n>): <text>``, the dev_err
prefix of mlx5_core_err/_warn) with the texts of Linux drivers/net/ethernet/mellanox/mlx5/core
events.c, cmd.c and health.c, as gpud's kmsg_matcher.go and NVSentinel's syslog tests quote
them from real nodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checks import hca_ports
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.hardware.sku import load_sku
from node_agent.kernel_log import LinesKernelLog, UnavailableKernelLog
from node_agent.model import Status
from node_agent.sim.scenario import HW_COUNTERS, PORT_COUNTERS
from node_agent.yamlfile import ConfigError

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0
T0 = 1_760_000_000.0


def make_port(
    root: Path,
    dev: str,
    port: str = "1",
    state: str = "4: ACTIVE",
    phys: str = "5: LinkUp",
    rate: str = "400 Gb/sec (4X NDR)",
    layer: str = "InfiniBand",
    bus: str | None = None,
    **counters: int,
) -> None:
    d = root / dev / "ports" / port
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "hw_counters").mkdir(exist_ok=True)
    for name, text in (
        ("state", state),
        ("phys_state", phys),
        ("rate", rate),
        ("link_layer", layer),
    ):
        (d / name).write_text(text + "\n")
    for name in PORT_COUNTERS:
        (d / "counters" / name).write_text(f"{counters.get(name, 0)}\n")
    for name in HW_COUNTERS:
        (d / "hw_counters" / name).write_text(f"{counters.get(name, 0)}\n")
    if bus and not (root / dev / "device").exists():
        function = root.parent / "devices" / bus
        function.mkdir(parents=True, exist_ok=True)
        os.symlink(function, root / dev / "device")


def set_counter(root: Path, dev: str, name: str, value: int, port: str = "1") -> None:
    where = "hw_counters" if name.endswith("_err") else "counters"
    (root / dev / "ports" / port / where / name).write_text(f"{value}\n")


def set_state(root: Path, dev: str, state: str, port: str = "1") -> None:
    (root / dev / "ports" / port / "state").write_text(state + "\n")


def eight_ports(root: Path, **kwargs) -> None:
    for n in range(8):
        make_port(root, f"mlx5_{n}", bus=f"0000:{0x18 + n:02x}:00.0", **kwargs)


def make_ctx(
    root: Path,
    state: Path | None,
    lines: list[str] | None = None,
    sku: str | None = "h100-sxm5-80gb",
    **params,
) -> CheckContext:
    return CheckContext(
        check="hca_ports",
        gpu=AbsentGpuBackend("no GPU on CI"),
        kernel_log=LinesKernelLog(lines or [], source="test lines"),
        config=config_from_dict({}),
        inventory=None,
        sku=load_sku(REPO / "graders" / "skus" / f"{sku}.yaml") if sku else None,
        expected_gpus=None,
        params={"sysfs_root": str(root), **params},
        state_dir=state,
    )


def run(ctx: CheckContext, now: float, uptime: float | None = 30 * 24 * HOUR):
    return hca_ports.check(ctx, Path(ctx.params["sysfs_root"]), now=now, uptime=uptime)


def by(results, target, metric):
    (hit,) = [r for r in results if r.target == target and r.metric == metric]
    return hit


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "sys" / "class" / "infiniband"
    root.mkdir(parents=True)
    return root


# --- state and rate ---------------------------------------------------------------------------


def test_healthy_hgx_node_passes_every_port(tree, tmp_path):
    eight_ports(tree)
    results = run(make_ctx(tree, tmp_path / "state"), T0)
    assert {r.status for r in results} == {Status.PASS}
    count = by(results, "node", "port_count")
    assert (count.value, count.evidence["expected"]) == (8, 8)
    assert len([r for r in results if r.metric == "link_state"]) == 8


def test_port_down_is_a_fail_naming_the_hca_and_port(tree, tmp_path):
    eight_ports(tree)
    set_state(tree, "mlx5_3", "1: DOWN")
    results = run(make_ctx(tree, tmp_path / "state"), T0)
    down = by(results, "hca:mlx5_3", "link_state")
    assert down.status is Status.FAIL and "DOWN" in down.detail
    assert (down.evidence["device"], down.evidence["port"]) == ("mlx5_3", "1")


def test_fewer_ports_than_a_declared_count_fail(tree, tmp_path):
    eight_ports(tree)
    set_state(tree, "mlx5_3", "1: DOWN")
    ctx = make_ctx(tree, tmp_path / "state")
    ctx.config = config_from_dict({"node": {"expected_hca_ports": 8}})
    count = by(run(ctx, T0), "node", "port_count")
    assert count.status is Status.FAIL and count.value == 7


def test_fewer_ports_than_the_skus_reference_build_is_evidence_not_a_fail(tree, tmp_path):
    """The NICs belong to the server: two healthy NDR ports on an HGX H100 pass, and say the
    DGX reference build has 8 and how to declare this server's count."""
    for n in range(2):
        make_port(tree, f"mlx5_{n}")
    count = by(run(make_ctx(tree, tmp_path / "state"), T0), "node", "port_count")
    assert count.status is Status.PASS and count.evidence["declared"] is False
    assert "has at least 8 in its reference build" in count.detail
    assert "node.expected_hca_ports" in count.detail


def test_a_port_that_vanished_since_the_last_run_fails_until_it_is_back(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    gone = tree / "mlx5_7"
    gone.rename(tmp_path / "mlx5_7-away")  # fell off the bus: its class directory goes
    for t in (T0 + 30, T0 + 600):
        missing = by(run(ctx, t), "hca:mlx5_7", "port_missing")
        assert missing.status is Status.FAIL and missing.evidence["missing_since"] == T0 + 30
    (tmp_path / "mlx5_7-away").rename(gone)
    results = run(ctx, T0 + 900)
    assert not [r for r in results if r.metric == "port_missing"]
    assert by(results, "hca:mlx5_7", "error_rates").evidence["rates_per_hour"] == {}


def test_an_hca_renamed_at_boot_is_not_missing_but_one_that_left_the_bus_is(tree, tmp_path):
    """The audit's case: udev renamed mlx5_8 to ibp12s0 (rdma_rename, the same PCI function);
    the old name stayed "missing" for ever, an ERROR that outlived every restart."""
    make_port(tree, "mlx5_0", bus="0000:0c:00.0")
    make_port(tree, "mlx5_8", bus="0000:12:00.0")
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    (tree / "mlx5_8").rename(tree / "ibp12s0")
    results = run(ctx, T0 + 30)
    assert not [r for r in results if r.metric == "port_missing"]
    assert by(results, "hca:ibp12s0", "link_state").status is Status.PASS
    (tree / "ibp12s0").rename(tmp_path / "away")  # now it left the bus
    missing = by(run(ctx, T0 + 60), "hca:ibp12s0", "port_missing")
    assert missing.status is Status.FAIL


def test_port_trained_at_hdr_on_an_ndr_sku_fails_its_rate(tree, tmp_path):
    eight_ports(tree)
    make_port(tree, "mlx5_5", rate="200 Gb/sec (4X HDR)")  # rewrites its rate
    results = run(make_ctx(tree, tmp_path / "state"), T0)
    low = by(results, "hca:mlx5_5", "port_rate_gbps")
    assert low.status is Status.FAIL and low.value == 200.0
    assert "400 Gb/s" in low.detail and low.evidence["source"] == "SKU h100-sxm5-80gb"


def test_slower_storage_ports_beside_all_eight_fabric_ports_pass(tree, tmp_path):
    eight_ports(tree)
    make_port(tree, "mlx5_8", rate="200 Gb/sec (4X HDR)", layer="Ethernet")
    make_port(tree, "mlx5_9", rate="200 Gb/sec (4X HDR)", layer="Ethernet")
    results = run(make_ctx(tree, tmp_path / "state"), T0)
    assert by(results, "hca:mlx5_8", "port_rate_gbps").status is Status.PASS
    assert "not one of the 8 fabric ports" in by(results, "hca:mlx5_9", "port_rate_gbps").detail


def test_without_a_sku_expectation_a_port_below_its_peers_fails(tree, tmp_path):
    for n in range(4):
        make_port(
            tree, f"mlx5_{n}", rate="200 Gb/sec (4X HDR)" if n == 2 else "400 Gb/sec (4X NDR)"
        )
    results = run(make_ctx(tree, tmp_path / "state", sku="h100-pcie-80gb"), T0)
    low = by(results, "hca:mlx5_2", "port_rate_gbps")
    assert low.status is Status.FAIL and low.evidence["peers_gbps"] == 400.0
    assert not [r for r in results if r.metric == "port_count"]


def test_the_nodes_declared_ports_override_the_sku_and_ignore_skips_an_unused_port(tree, tmp_path):
    for n in range(4):
        make_port(tree, f"mlx5_{n}")
    make_port(tree, "mlx5_1", port="2", state="1: DOWN", phys="3: Disabled")
    ctx = make_ctx(tree, tmp_path / "state", ignore=["mlx5_1/2"])
    ctx.config = config_from_dict(
        {"node": {"expected_hca_ports": 4, "expected_hca_rate_gbps": 400}}
    )
    results = run(ctx, T0)
    count = by(results, "node", "port_count")
    assert count.status is Status.PASS and "node.expected_hca_ports" in count.detail
    ignored = by(results, "hca:mlx5_1/2", "link_state")
    assert ignored.status is Status.SKIP and "ignore" in ignored.detail


def test_no_rdma_device_skips_with_the_reason(tmp_path):
    (result,) = run(make_ctx(tmp_path / "absent", tmp_path / "state"), T0)
    assert result.status is Status.SKIP and "no RDMA device" in result.detail


def test_this_host_without_hca_skips_with_the_reason(tmp_path):
    """The real sysfs path of this machine: no HCA here, so a skip that says so."""
    if hca_ports.SYSFS_ROOT.is_dir() and any(hca_ports.SYSFS_ROOT.iterdir()):
        pytest.skip("this host has RDMA devices")
    ctx = make_ctx(hca_ports.SYSFS_ROOT, tmp_path / "state")
    (result,) = hca_ports.run(ctx)
    assert result.status is Status.SKIP and "no RDMA device" in result.detail


# --- flaps ------------------------------------------------------------------------------------


def test_three_flaps_in_twelve_hours_warn(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    assert by(run(ctx, T0), "hca:mlx5_1", "flaps").status is Status.PASS
    for i in range(1, 4):  # link_downed steps once between runs, three times in 3 hours
        set_counter(tree, "mlx5_1", "link_downed", i)
        flaps = by(run(ctx, T0 + i * HOUR), "hca:mlx5_1", "flaps")
    assert flaps.status is Status.WARN and flaps.value == 3
    assert "3 down-up cycles in 12 h" in flaps.detail


def test_down_then_active_between_runs_is_a_cycle_without_the_counter(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    for i in range(3):
        set_state(tree, "mlx5_0", "1: DOWN")
        run(ctx, T0 + i * 600)
        set_state(tree, "mlx5_0", "4: ACTIVE")
        flaps = by(run(ctx, T0 + i * 600 + 300), "hca:mlx5_0", "flaps")
    assert flaps.status is Status.WARN and flaps.value == 3


def test_flaps_older_than_twelve_hours_age_out(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_1", "link_downed", 3)
    assert by(run(ctx, T0 + 60), "hca:mlx5_1", "flaps").status is Status.WARN
    later = by(run(ctx, T0 + 13 * HOUR), "hca:mlx5_1", "flaps")
    assert later.status is Status.PASS and later.value == 0


def test_a_port_that_keeps_flapping_after_its_warning_fails(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_2", "link_downed", 3)
    assert by(run(ctx, T0 + 60), "hca:mlx5_2", "flaps").status is Status.WARN
    set_counter(tree, "mlx5_2", "link_downed", 5)
    assert by(run(ctx, T0 + HOUR), "hca:mlx5_2", "flaps").status is Status.WARN  # 2 since
    set_counter(tree, "mlx5_2", "link_downed", 6)
    flaps = by(run(ctx, T0 + 2 * HOUR), "hca:mlx5_2", "flaps")
    assert flaps.status is Status.FAIL and "keeps flapping" in flaps.detail


def test_link_downed_on_first_sight_counts_only_when_boot_is_inside_the_window(tree, tmp_path):
    eight_ports(tree, link_downed=4)
    fresh = run(make_ctx(tree, tmp_path / "a"), T0, uptime=2 * HOUR)
    assert by(fresh, "hca:mlx5_0", "flaps").status is Status.WARN
    old = run(make_ctx(tree, tmp_path / "b"), T0, uptime=5 * 24 * HOUR)
    flaps = by(old, "hca:mlx5_0", "flaps")
    assert flaps.status is Status.PASS and "too long ago" in flaps.detail


# --- error counters as rates -----------------------------------------------------------------


def test_first_reading_is_a_baseline_not_a_rate(tree, tmp_path):
    eight_ports(tree, symbol_error=50_000)
    rates = by(run(make_ctx(tree, tmp_path / "state"), T0), "hca:mlx5_0", "error_rates")
    assert rates.status is Status.PASS and rates.evidence["rates_per_hour"] == {}
    assert "baseline" in rates.detail


def test_symbol_errors_over_the_warn_rate_warn(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_4", "symbol_error", 50)  # 50 in two hours: 25/h, over 12, under 120
    rates = by(run(ctx, T0 + 2 * HOUR), "hca:mlx5_4", "error_rates")
    assert rates.status is Status.WARN
    assert rates.evidence["rates_per_hour"]["symbol_error"] == pytest.approx(25.0)
    assert "symbol_error 25.0/h" in rates.detail


def test_symbol_errors_over_the_error_rate_fail(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_4", "symbol_error", 1000)
    assert by(run(ctx, T0 + 2 * HOUR), "hca:mlx5_4", "error_rates").status is Status.FAIL


def test_runs_seconds_apart_divide_by_the_minimum_window(tree, tmp_path):
    """Two runs a second apart: 5 symbol errors are 5 in the last hour, not 18,000/h."""
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_0", "symbol_error", 5)
    rates = by(run(ctx, T0 + 1), "hca:mlx5_0", "error_rates")
    assert rates.evidence["rates_per_hour"]["symbol_error"] == pytest.approx(5.0)
    assert rates.status is Status.PASS


def test_a_counter_reset_is_no_negative_rate_and_no_finding(tree, tmp_path):
    eight_ports(tree, symbol_error=400, port_rcv_errors=9000, link_downed=2)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    for name in ("symbol_error", "port_rcv_errors", "link_downed"):  # perfquery -R
        set_counter(tree, "mlx5_6", name, 0)
    results = run(ctx, T0 + HOUR)
    rates = by(results, "hca:mlx5_6", "error_rates")
    assert rates.status is Status.PASS
    assert "symbol_error" not in rates.evidence["rates_per_hour"]
    assert all(v >= 0 for v in rates.evidence["rates_per_hour"].values())
    assert "reset" in rates.detail
    assert by(results, "hca:mlx5_6", "flaps").status is Status.PASS
    # the next run rates from the new baseline
    set_counter(tree, "mlx5_6", "symbol_error", 1)
    after = by(run(ctx, T0 + 2 * HOUR), "hca:mlx5_6", "error_rates")
    assert after.evidence["rates_per_hour"]["symbol_error"] == pytest.approx(1.0)


def test_user_driven_counters_never_fail(tree, tmp_path):
    """Discards, ack timeouts and RNR retries move with any job's traffic: WARN at most."""
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    run(ctx, T0)
    set_counter(tree, "mlx5_0", "rnr_nak_retry_err", 10**9)
    set_counter(tree, "mlx5_0", "local_ack_timeout_err", 10**9)
    set_counter(tree, "mlx5_0", "port_xmit_discards", 60_000)
    assert by(run(ctx, T0 + HOUR), "hca:mlx5_0", "error_rates").status is Status.WARN


def test_a_saturated_counter_is_said(tree, tmp_path):
    eight_ports(tree, excessive_buffer_overrun_errors=15)
    rates = by(run(make_ctx(tree, tmp_path / "state"), T0), "hca:mlx5_0", "error_rates")
    assert "saturated at 15" in rates.detail


def test_history_stays_small_over_a_day_of_runs(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    for i in range(0, 24 * 3600, 15 * 60):  # every 15 minutes for a day
        run(ctx, T0 + i)
    state = json.loads((tmp_path / "state" / hca_ports.STATE_FILE).read_text())
    assert max(len(v) for v in state["ports"]["mlx5_0/1"]["counters"].values()) <= 14


def test_without_a_state_dir_the_run_says_it_has_no_history(tree):
    eight_ports(tree)
    rates = by(run(make_ctx(tree, None), T0), "hca:mlx5_0", "error_rates")
    assert "no writable state directory" in rates.evidence["history"]


def test_a_corrupt_state_file_starts_a_new_baseline(tree, tmp_path):
    eight_ports(tree)
    state = tmp_path / "state"
    state.mkdir()
    (state / hca_ports.STATE_FILE).write_text("{not json")
    results = run(make_ctx(tree, state), T0)
    assert {r.status for r in results} == {Status.PASS}


# --- the mlx5 driver's kernel lines -----------------------------------------------------------


def kmsg(prio: int, text: str, seq: int = 1) -> str:
    """A saved kmsg record: ``prio,seq,usec,flags;message`` (facility = prio >> 3)."""
    return f"{prio},{seq},{seq * 1000},-;{text}"


@pytest.mark.parametrize(
    "text, metric, status",
    [
        (
            "mlx5_core 0000:1a:00.0: mlx5_port_module_event:1131:(pid 0): Port module event[error]: "
            "module 0, Cable error, High Temperature",
            "mlx5_module_temperature",
            Status.FAIL,
        ),
        (
            "mlx5_core 0000:1a:00.0: port_module:258:(pid 0): Port module event[error]: module 0, "
            "Cable error, Bad or shorted cable/module",
            "mlx5_module_error",
            Status.FAIL,
        ),
        (
            "mlx5_core 0000:1a:00.0: temp_warn:165:(pid 0): High temperature on sensors with bit set "
            "0 1",
            "mlx5_asic_temperature",
            Status.WARN,
        ),
        (
            "mlx5_core 0000:1a:00.0: mlx5_pcie_event:299:(pid 268269): Detected insufficient power on "
            "the PCIe slot (27W).",
            "mlx5_insufficient_power",
            Status.WARN,
        ),
        (
            "mlx5_core 0000:1a:00.0: wait_func:964:(pid 112): ENABLE_HCA(0x104) timeout. Will cause a "
            "leak of a command resource",
            "mlx5_command_timeout",
            Status.FAIL,
        ),
        (
            "mlx5_core 0000:1a:00.0: mlx5_cmd_out_err:838:(pid 1441): CREATE_QP(0x500) op_mod(0x0) "
            "failed, status bad parameter(0x3), syndrome (0x1234), err(-22)",
            "mlx5_command_failed",
            Status.WARN,
        ),
        (
            "mlx5_core 0000:1a:00.0: poll_health:852:(pid 0): device's health compromised - reached "
            "miss count",
            "mlx5_health_compromised",
            Status.FAIL,
        ),
        ("mlx5_core 0000:1a:00.0: Fatal error 1 detected", "mlx5_fatal_error", Status.FAIL),
    ],
)
def test_mlx5_line_forms_grade_naming_the_hca(tree, tmp_path, text, metric, status):
    eight_ports(tree)
    make_port(tree, "mlx5_9", bus="0000:1a:00.0")
    results = run(
        make_ctx(tree, tmp_path / "state", [kmsg(3, text), f"[ 17.98] kernel: {text}"]), T0
    )
    finding = by(results, "hca:mlx5_9", metric)
    assert finding.status is status and finding.value == 2
    assert finding.evidence["bus_id"] == "0000:1a:00.0"


def test_access_reg_failures_from_counter_reads_are_not_counted(tree, tmp_path):
    eight_ports(tree)
    line = (
        "mlx5_core 0000:18:00.0: mlx5_cmd_out_err:838:(pid 1441871): ACCESS_REG(0x805) "
        "op_mod(0x1) failed, status bad resource(0x5), syndrome (0x305684), err(-22)"
    )
    results = run(make_ctx(tree, tmp_path / "state", [kmsg(3, line)]), T0)
    assert by(results, "node", "kernel_lines").status is Status.PASS


@pytest.mark.parametrize(
    "line",
    [
        # a user's write to /dev/kmsg is facility 1 (devkmsg_write), never the kernel's
        kmsg(11, "mlx5_core 0000:18:00.0: Fatal error 1 detected"),
        # the driver's words in the middle of another message (a user's process name, a path)
        kmsg(
            6, "python3[4242]: segfault at 0 ip 0 in mlx5_core 0000:18:00.0: Fatal error 1 detected"
        ),
        # a user program's syslog line
        "Nov 25 01:00:00 node7 logger[77]: mlx5_core 0000:18:00.0: Fatal error 1 detected",
    ],
)
def test_lines_the_driver_did_not_write_are_not_believed(tree, tmp_path, line):
    eight_ports(tree)
    results = run(make_ctx(tree, tmp_path / "state", [line]), T0)
    assert by(results, "node", "kernel_lines").status is Status.PASS


def test_a_line_for_a_function_with_no_rdma_device_names_its_bus_id(tree, tmp_path):
    eight_ports(tree)
    line = kmsg(3, "mlx5_core 0000:99:00.1: Fatal error 2 detected")
    finding = by(
        run(make_ctx(tree, tmp_path / "state", [line]), T0), "hca:0000:99:00.1", "mlx5_fatal_error"
    )
    assert finding.status is Status.FAIL


def test_since_last_run_reports_each_line_once(tree, tmp_path):
    eight_ports(tree)
    lines = [
        kmsg(
            4,
            "mlx5_core 0000:18:00.0: mlx5_pcie_event:299:(pid 1): Detected "
            "insufficient power on the PCIe slot (27W).",
        )
    ]
    ctx = make_ctx(tree, tmp_path / "state", lines, since="last_run")
    assert by(run(ctx, T0), "hca:mlx5_0", "mlx5_insufficient_power").status is Status.WARN
    assert by(run(ctx, T0 + 15), "node", "kernel_lines").status is Status.PASS


def test_an_unreadable_kernel_log_skips_only_the_kernel_lines(tree, tmp_path):
    eight_ports(tree)
    ctx = make_ctx(tree, tmp_path / "state")
    ctx.kernel_log = UnavailableKernelLog("no permission to read the kernel log (/dev/kmsg)")
    results = run(ctx, T0)
    skip = by(results, "node", "kernel_lines")
    assert skip.status is Status.SKIP and "no permission" in skip.detail
    assert by(results, "hca:mlx5_0", "link_state").status is Status.PASS


def test_shipped_hca_grading_file_loads():
    table = hca_ports.load_grading(REPO / "graders" / "hca.yaml")
    assert table.flap_count == 3 and table.flap_window_s == 12 * HOUR
    assert {c.name for c in table.counters} >= {
        "symbol_error",
        "port_rcv_errors",
        "excessive_buffer_overrun_errors",
    }


def test_an_old_hca_file_with_a_skus_table_is_a_config_error_naming_the_sku_files(tmp_path):
    """The per-SKU ports moved to the SKU files' ``hca`` sections: an operator's older file
    that still has them fails saying where they go, never read as if they counted."""
    old = (REPO / "graders" / "hca.yaml").read_text()
    path = tmp_path / "hca.yaml"
    path.write_text(old + "skus:\n  h100-sxm5-80gb: {ports: 8, min_rate_gbps: 400}\n")
    with pytest.raises(ConfigError) as err:
        hca_ports.load_grading(path)
    assert "`skus` table moved to the SKU files" in str(err.value)
    assert "hca: {ports, min_rate_gbps}" in str(err.value)


def test_an_old_hca_file_in_graders_dir_stops_the_check_instead_of_passing(tree, tmp_path):
    eight_ports(tree)
    graders = tmp_path / "graders"
    graders.mkdir()
    old = (REPO / "graders" / "hca.yaml").read_text()
    (graders / "hca.yaml").write_text(
        old + "skus: {h100-sxm5-80gb: {ports: 8, min_rate_gbps: 400}}\n"
    )
    ctx = make_ctx(tree, tmp_path / "state")
    ctx.config = config_from_dict({"graders_dir": str(graders)})
    with pytest.raises(ConfigError, match="skus"):
        run(ctx, T0)


def test_a_declared_port_count_short_of_active_ports_fails_naming_the_config_key(tree, tmp_path):
    for n in range(3):
        make_port(tree, f"mlx5_{n}")
    ctx = make_ctx(tree, tmp_path / "state")
    ctx.config = config_from_dict({"node": {"expected_hca_ports": 4}})
    count = by(run(ctx, T0), "node", "port_count")
    assert count.status is Status.FAIL and "node.expected_hca_ports" in count.detail


def test_a_suite_that_still_declares_ports_is_refused_naming_the_config_key():
    with pytest.raises(ValueError, match="node.expected_hca_ports"):
        hca_ports.Params.parse({"ports": 8, "min_rate_gbps": 400})


def test_a_bad_since_param_is_refused_saying_what_is_expected():
    """Parsed when the suite loads (tests/unit/test_check_params.py: exit 2, nothing run)."""
    with pytest.raises(ValueError, match="since 'yesterday': expected one of boot, last_run"):
        hca_ports.Params.parse({"since": "yesterday"})


def test_ignore_may_name_one_port_as_a_string(tree, tmp_path):
    eight_ports(tree)
    set_state(tree, "mlx5_7", "1: DOWN")
    results = run(make_ctx(tree, tmp_path / "state", ignore="mlx5_7"), T0)
    assert by(results, "hca:mlx5_7", "link_state").status is Status.SKIP
