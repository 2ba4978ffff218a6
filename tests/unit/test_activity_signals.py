"""The gpu_activity, rdma_traffic and log_silence hang signals (node_agent.training.activity).

Logs are real files under tmp_path with their mtimes set by ``os.utime``; RDMA ports are a fake
``/sys/class/infiniband`` tree written by the rdma check's own test helper; GPUs are a fake
device (below).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from test_rdma_sysfs import make_port  # the rdma check's fake-sysfs helper (tests/unit)

from node_agent.gpu.base import DeviceLost, Identity, NotSupported, Power
from node_agent.training.activity import (
    SATURATED_32,
    GpuActivity,
    gpu_activity_signal,
    log_silence_signal,
    rdma_traffic_signal,
    read_gpu_activity,
    read_port_counters,
)

# -- GPU activity --------------------------------------------------------------------------------

H100_LIMIT_W = 700.0
SPIN_POWER = Power(120.0, H100_LIMIT_W, H100_LIMIT_W)


@dataclass(frozen=True)
class Utilization:
    gpu_pct: int
    memory_pct: int


SPIN_UTIL = Utilization(100, 0)


class FakeGpu:
    """A GPU that answers what it is told to: no GPU exists on CI, and the spin signature
    (busy, cold, no memory traffic) cannot be produced on demand even where one does."""

    def __init__(
        self,
        index: int = 0,
        util: Utilization | Exception = SPIN_UTIL,
        power: Power | Exception = SPIN_POWER,
    ):
        self.index = index
        self._util, self._power = util, power

    def identity(self) -> Identity:
        return Identity(
            self.index,
            f"GPU-fake-{self.index}",
            "NVIDIA H100 80GB HBM3",
            f"00000000:{self.index + 0x18:02X}:00.0",
            None,
            None,
            81559,
        )

    def utilization(self) -> Utilization:
        if isinstance(self._util, Exception):
            raise self._util
        return self._util

    def power(self) -> Power:
        if isinstance(self._power, Exception):
            raise self._power
        return self._power


def spinning(index: int = 0) -> GpuActivity:
    return GpuActivity(index, gpu_pct=100, memory_pct=0, power_w=110.0, power_limit_w=H100_LIMIT_W)


def working(index: int = 0) -> GpuActivity:
    return GpuActivity(index, gpu_pct=100, memory_pct=55, power_w=640.0, power_limit_w=H100_LIMIT_W)


def test_read_gpu_activity_takes_utilization_and_enforced_power_limit():
    reading = read_gpu_activity(FakeGpu(3, Utilization(97, 4), Power(150.0, 500.0, 700.0)))
    assert reading == GpuActivity(3, 97, 4, 150.0, 500.0)


def test_read_gpu_activity_falls_back_to_default_limit_when_enforced_unreported():
    reading = read_gpu_activity(FakeGpu(power=Power(150.0, None, 700.0)))
    assert reading.power_limit_w == 700.0


def test_read_gpu_activity_turns_gpu_errors_into_none_fields_with_the_reason():
    reading = read_gpu_activity(
        FakeGpu(
            1,
            util=NotSupported("nvmlDeviceGetUtilizationRates"),
            power=DeviceLost("GPU 1 fell off the bus"),
        )
    )
    assert (reading.gpu_pct, reading.memory_pct, reading.power_w, reading.power_limit_w) == (
        None,
        None,
        None,
        None,
    )
    assert any("NotSupported" in e for e in reading.errors)
    assert any("DeviceLost" in e and "fell off the bus" in e for e in reading.errors)


def test_spinning_gpu_busy_but_cold_and_without_memory_traffic_is_a_hang():
    signal = gpu_activity_signal([spinning(0)])
    assert signal.name == "gpu_activity" and signal.available and signal.hang
    assert signal.figures["gpus"][0]["spinning"] is True


def test_working_gpu_high_utilization_and_high_power_is_not_a_hang():
    signal = gpu_activity_signal([working()])
    assert signal.available and not signal.hang
    assert signal.figures["gpus"][0]["spinning"] is False


def test_busy_gpu_drawing_power_but_no_memory_traffic_is_not_the_spin_signature():
    # compute-bound work (e.g. a GEMM from registers/shared memory) draws power: still working
    hot = GpuActivity(0, gpu_pct=100, memory_pct=2, power_w=600.0, power_limit_w=H100_LIMIT_W)
    assert not gpu_activity_signal([hot]).hang


def test_idle_gpu_at_zero_utilization_is_not_the_spin_signature():
    idle = GpuActivity(0, gpu_pct=0, memory_pct=0, power_w=70.0, power_limit_w=H100_LIMIT_W)
    signal = gpu_activity_signal([idle])
    assert signal.available and not signal.hang


def test_only_one_of_two_gpus_spinning_is_not_a_hang():
    signal = gpu_activity_signal([spinning(0), working(1)])
    assert signal.available and not signal.hang
    assert [g["spinning"] for g in signal.figures["gpus"]] == [True, False]


def test_all_gpus_of_the_process_spinning_is_a_hang():
    assert gpu_activity_signal([spinning(0), spinning(1)]).hang


@pytest.mark.parametrize("busy_pct, hang", [(90, True), (101, False)])
def test_busy_threshold_is_a_parameter(busy_pct, hang):
    assert gpu_activity_signal([spinning()], busy_pct=busy_pct).hang is hang


def test_no_gpu_readings_is_unavailable_with_reason():
    signal = gpu_activity_signal([])
    assert not signal.available and not signal.hang
    assert "no GPU readings" in signal.detail


def test_missing_field_is_unavailable_naming_the_gpu_field_and_error():
    partial = GpuActivity(
        1, None, None, 110.0, H100_LIMIT_W, errors=("utilization: NotSupported: vGPU guest",)
    )
    signal = gpu_activity_signal([spinning(0), partial])
    assert not signal.available and not signal.hang
    assert "GPU 1" in signal.detail and "gpu_pct" in signal.detail
    assert "vGPU guest" in signal.detail


def test_missing_power_limit_is_unavailable():
    signal = gpu_activity_signal([GpuActivity(0, 100, 0, 110.0, None)])
    assert not signal.available and "power_limit_w" in signal.detail


# -- RDMA port traffic ---------------------------------------------------------------------------


def make_data_port(root, dev, port="1", xmit=0, rcv=0, **kw):
    """A port as make_port writes it, plus the data counters this signal reads."""
    make_port(root, dev, port, **kw)
    set_data(root, dev, port, xmit, rcv)


def set_data(root, dev, port, xmit, rcv):
    counters = root / dev / "ports" / port / "counters"
    (counters / "port_xmit_data").write_text(f"{xmit}\n")
    (counters / "port_rcv_data").write_text(f"{rcv}\n")


def test_read_port_counters_reads_active_ports_in_raw_words(tmp_path):
    make_data_port(tmp_path, "mlx5_0", xmit=1000, rcv=2000)
    make_data_port(tmp_path, "mlx5_1", xmit=5, rcv=6)
    assert read_port_counters(tmp_path) == {"mlx5_0/1": (1000, 2000), "mlx5_1/1": (5, 6)}


def test_down_port_is_ignored(tmp_path):
    make_data_port(tmp_path, "mlx5_0", xmit=1000, rcv=2000)
    make_data_port(tmp_path, "mlx5_1", state="1: DOWN", phys="3: Disabled", xmit=7, rcv=8)
    assert read_port_counters(tmp_path) == {"mlx5_0/1": (1000, 2000)}


def test_port_without_pma_counters_is_left_out(tmp_path):
    make_data_port(tmp_path, "mlx5_0")
    (tmp_path / "mlx5_0" / "ports" / "1" / "counters" / "port_rcv_data").write_text(
        "N/A (no PMA)\n"
    )
    assert read_port_counters(tmp_path) == {}


def test_counters_unchanged_over_the_window_is_a_hang(tmp_path):
    make_data_port(tmp_path, "mlx5_0", xmit=1000, rcv=2000)
    make_data_port(tmp_path, "mlx5_1", port="2", xmit=10, rcv=20)
    before = read_port_counters(tmp_path)
    after = read_port_counters(tmp_path)
    signal = rdma_traffic_signal(before, after, 10.0)
    assert signal.name == "rdma_traffic" and signal.available and signal.hang
    assert signal.figures["ports"] == {
        "mlx5_0/1": {"xmit_bytes": 0, "rcv_bytes": 0},
        "mlx5_1/2": {"xmit_bytes": 0, "rcv_bytes": 0},
    }
    assert signal.figures["window_s"] == 10.0


def test_counters_moved_is_not_a_hang_and_reports_bytes(tmp_path):
    make_data_port(tmp_path, "mlx5_0", xmit=1000, rcv=2000)
    before = read_port_counters(tmp_path)
    set_data(tmp_path, "mlx5_0", "1", 1000, 2500)
    signal = rdma_traffic_signal(before, read_port_counters(tmp_path), 5.0)
    assert signal.available and not signal.hang
    assert signal.figures["ports"]["mlx5_0/1"] == {"xmit_bytes": 0, "rcv_bytes": 500 * 4}


def test_movement_within_min_bytes_is_still_a_hang():
    signal = rdma_traffic_signal({"mlx5_0/1": (0, 0)}, {"mlx5_0/1": (256, 0)}, 5.0, min_bytes=4096)
    assert signal.hang and signal.figures["ports"]["mlx5_0/1"]["xmit_bytes"] == 1024


def test_counter_that_went_backwards_counts_as_movement():
    signal = rdma_traffic_signal({"mlx5_0/1": (5_000_000, 7)}, {"mlx5_0/1": (12, 7)}, 5.0)
    assert signal.available and not signal.hang
    assert signal.figures["reset"] == ["mlx5_0/1 port_xmit_data"]
    assert signal.figures["ports"]["mlx5_0/1"]["xmit_bytes"] is None


def test_saturated_32_bit_counter_is_left_out_not_read_as_standing_still():
    moving = rdma_traffic_signal(
        {"mlx5_0/1": (SATURATED_32, 10)}, {"mlx5_0/1": (SATURATED_32, 90)}, 5.0
    )
    assert moving.available and not moving.hang
    assert moving.figures["saturated"] == ["mlx5_0/1 port_xmit_data"]
    stuck = rdma_traffic_signal(
        {"mlx5_0/1": (SATURATED_32, SATURATED_32)}, {"mlx5_0/1": (SATURATED_32, SATURATED_32)}, 5.0
    )
    assert not stuck.available and "perfquery -R" in stuck.detail


def test_port_that_appears_or_disappears_between_readings_is_ignored():
    before = {"mlx5_0/1": (100, 100), "mlx5_1/1": (1, 1)}
    after = {"mlx5_0/1": (100, 100), "mlx5_2/1": (999, 999)}
    signal = rdma_traffic_signal(before, after, 5.0)
    assert signal.hang and list(signal.figures["ports"]) == ["mlx5_0/1"]
    assert signal.figures["ports_changed"] == ["mlx5_1/1", "mlx5_2/1"]


def test_no_port_in_both_readings_is_unavailable():
    signal = rdma_traffic_signal({"mlx5_0/1": (1, 1)}, {"mlx5_1/1": (1, 1)}, 5.0)
    assert not signal.available and "changed between" in signal.detail


def test_no_rdma_device_is_unavailable(tmp_path):
    counters = read_port_counters(tmp_path / "absent")
    assert counters == {}
    signal = rdma_traffic_signal(counters, counters, 5.0)
    assert not signal.available and not signal.hang
    assert signal.detail == (
        "no active RDMA port in /sys/class/infiniband: the job's traffic cannot be watched here"
    )


def test_only_down_ports_is_unavailable(tmp_path):
    make_data_port(tmp_path, "mlx5_0", state="1: DOWN", phys="2: Polling")
    counters = read_port_counters(tmp_path)
    assert not rdma_traffic_signal(counters, counters, 5.0).available


def test_non_positive_window_is_unavailable():
    assert not rdma_traffic_signal({"mlx5_0/1": (1, 1)}, {"mlx5_0/1": (1, 1)}, 0.0).available


# -- log silence ---------------------------------------------------------------------------------

NOW = 1_700_000_000.0


def log_written_at(tmp_path, mtime: float) -> str:
    path = tmp_path / "train.log"
    path.write_text("step 100 loss 2.31\n")
    os.utime(path, (mtime, mtime))
    return str(path)


def test_log_silent_longer_than_threshold_is_a_hang(tmp_path):
    path = log_written_at(tmp_path, NOW - 600)
    signal = log_silence_signal(path, now=NOW, silence_s=300)
    assert signal.name == "log_silence" and signal.available and signal.hang
    assert signal.figures["path"] == path and signal.figures["silent_s"] == 600.0


def test_recently_written_log_is_not_a_hang(tmp_path):
    signal = log_silence_signal(log_written_at(tmp_path, NOW - 5), now=NOW, silence_s=300)
    assert signal.available and not signal.hang
    assert signal.figures["silent_s"] == 5.0


def test_log_written_exactly_at_threshold_is_not_yet_a_hang(tmp_path):
    signal = log_silence_signal(log_written_at(tmp_path, NOW - 300), now=NOW, silence_s=300)
    assert not signal.hang


def test_missing_log_file_is_unavailable_naming_the_path(tmp_path):
    path = str(tmp_path / "nowhere.log")
    signal = log_silence_signal(path, now=NOW, silence_s=300)
    assert not signal.available and not signal.hang and path in signal.detail


def test_unconfigured_log_is_unavailable_saying_how_to_configure():
    signal = log_silence_signal(None, now=NOW, silence_s=300)
    assert not signal.available
    assert "NODE_AGENT_TRAIN_LOG" in signal.detail and "Heartbeat(log_file=...)" in signal.detail


def test_log_path_that_is_a_directory_is_unavailable(tmp_path):
    signal = log_silence_signal(str(tmp_path), now=NOW, silence_s=300)
    assert not signal.available and "directory" in signal.detail


@pytest.mark.parametrize("path", ["/tmp/job\x00.log", "/tmp/job\ud800.log"])
def test_a_log_file_path_with_a_nul_or_a_lone_surrogate_is_unavailable_not_a_crash(path):
    # issue 29, Medium 7: one heartbeat's log_file crashed the check on every run
    signal = log_silence_signal(path, now=NOW, silence_s=300)
    assert not signal.available and "not a path the system can use" in signal.detail
    assert signal.detail.isascii()


def test_a_relative_log_file_path_is_unavailable_naming_it():
    signal = log_silence_signal("job.log", now=NOW, silence_s=300)
    assert not signal.available and "not an absolute path" in signal.detail
