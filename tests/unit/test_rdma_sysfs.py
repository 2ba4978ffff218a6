"""The rdma check against a fake /sys/class/infiniband tree under tmp_path.

No RDMA device exists on CI, so every port here is written by the test in the format the kernel
uses (``4: ACTIVE``, ``400 Gb/sec (4X NDR)``); ib_write_bw is absent or replaced by a stub.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from node_agent.checking.context import CheckContext
from node_agent.checks import rdma
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.hardware.sku import load_sku
from node_agent.host import infiniband
from node_agent.model import Status
from tests.unit.test_hca_ports import make_port  # the sysfs tree of an HCA port

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "perftest"


def make_ctx(root: Path, **params) -> CheckContext:
    return CheckContext(
        check="rdma",
        gpu=AbsentGpuBackend("no GPU on CI"),
        kernel_log=None,
        config=config_from_dict({}),
        inventory=None,
        sku=load_sku(REPO / "graders" / "skus" / "h100-sxm5-80gb.yaml"),
        expected_gpus=None,
        params={"sysfs_root": str(root), **params},
    )


def by(results, target, metric):
    (hit,) = [r for r in results if r.target == target and r.metric == metric]
    return hit


def test_discover_reads_state_rate_layer_and_counters(tmp_path):
    make_port(tmp_path, "mlx5_0", symbol_error=3)
    make_port(
        tmp_path,
        "mlx5_1",
        port="1",
        state="1: DOWN",
        phys="3: Disabled",
        rate="10 Gb/sec (4X SDR)",
        layer="Ethernet",
    )
    ports = infiniband.discover(tmp_path)
    assert [(p.device, p.state, p.phys_state, p.rate_gbps, p.link_layer) for p in ports] == [
        ("mlx5_0", "ACTIVE", "LinkUp", 400.0, "InfiniBand"),
        ("mlx5_1", "DOWN", "Disabled", 10.0, "Ethernet"),
    ]
    assert ports[0].counters == {"link_downed": 0, "symbol_error": 3, "port_rcv_errors": 0}


@pytest.mark.parametrize(
    "text, gbps",
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("56 Gb/sec (4X FDR)", 56.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("", None),
    ],
)
def test_parse_rate_gbps(text, gbps):
    assert infiniband.parse_rate_gbps(text) == gbps


def test_no_rdma_device_skips_with_reason(tmp_path):
    (result,) = rdma.run(make_ctx(tmp_path / "absent"))
    assert result.status is Status.SKIP
    assert "no RDMA device" in result.detail


def test_port_down_fails_link_state(tmp_path):
    make_port(tmp_path, "mlx5_0", state="1: DOWN", phys="2: Polling")
    results = rdma.run(make_ctx(tmp_path, perftest=False))
    assert by(results, "hca:mlx5_0", "link_state").status is Status.FAIL


def test_an_ignored_hca_or_port_is_skipped_naming_the_list_and_never_judged(tmp_path):
    make_port(tmp_path, "mlx5_0", state="2: INIT", phys="5: LinkUp")  # the SM has not set it up
    make_port(tmp_path, "mlx5_9", state="1: DOWN", phys="3: Disabled")  # not cabled on purpose
    make_port(tmp_path, "mlx5_1")
    results = rdma.run(make_ctx(tmp_path, perftest=False, ignore=["mlx5_9", "mlx5_0/1"]))
    for target in ("hca:mlx5_0", "hca:mlx5_9"):
        (skipped,) = [r for r in results if r.target == target]
        assert skipped.status is Status.SKIP and "ignore list" in skipped.detail
    assert by(results, "hca:mlx5_1", "link_state").status is Status.PASS


def test_rate_below_sku_minimum_fails(tmp_path):
    make_port(tmp_path, "mlx5_0", rate="200 Gb/sec (4X HDR)")
    make_port(tmp_path, "mlx5_1")
    results = rdma.run(make_ctx(tmp_path, perftest=False))
    assert by(results, "hca:mlx5_0", "port_rate_gbps").status is Status.FAIL
    assert by(results, "hca:mlx5_1", "port_rate_gbps").status is Status.PASS
    assert by(results, "hca:mlx5_1", "link_state").status is Status.PASS


def test_link_downed_and_symbol_errors_warn(tmp_path):
    make_port(tmp_path, "mlx5_0", link_downed=2, symbol_error=17)
    make_port(tmp_path, "mlx5_1", port_rcv_errors=5)
    results = rdma.run(make_ctx(tmp_path, perftest=False))
    noisy = by(results, "hca:mlx5_0", "link_errors")
    assert noisy.status is Status.WARN and noisy.value == 19
    assert by(results, "hca:mlx5_1", "link_errors").status is Status.PASS


def test_second_port_gets_its_own_target(tmp_path):
    make_port(tmp_path, "mlx5_0", port="1")
    make_port(tmp_path, "mlx5_0", port="2", state="1: DOWN")
    results = rdma.run(make_ctx(tmp_path, perftest=False))
    assert by(results, "hca:mlx5_0/2", "link_state").status is Status.FAIL


def _stub_ib_write_bw(bindir: Path, body: str) -> None:
    """An ``ib_write_bw`` on PATH that prints a captured output (no RDMA hardware on CI)."""
    bindir.mkdir()
    stub = bindir / "ib_write_bw"
    stub.write_text("#!/bin/sh\n" + body)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def path_with(tmp_path, monkeypatch):
    def install(body: str) -> None:
        _stub_ib_write_bw(tmp_path / "bin", body)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    return install


def test_ib_write_bw_missing_skips_naming_perftest(tmp_path, monkeypatch):
    make_port(tmp_path, "mlx5_0")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    results = rdma.run(make_ctx(tmp_path))
    skip = by(results, "hca:mlx5_0", "write_bw_gbps")
    assert skip.status is Status.SKIP and "perftest" in skip.detail


def test_ib_write_bw_table_graded_against_sku_minimum(tmp_path, path_with):
    make_port(tmp_path / "sys", "mlx5_0")
    path_with(f'cat "{DATA / "ib_write_bw_gbits.txt"}"\n')
    results = rdma.run(make_ctx(tmp_path / "sys", server_start_s=0))
    bw = by(results, "hca:mlx5_0", "write_bw_gbps")
    assert bw.status is Status.PASS and bw.value == pytest.approx(388.72)


def test_ib_write_bw_slow_hca_fails(tmp_path, path_with):
    make_port(tmp_path / "sys", "mlx5_0")
    path_with(f'cat "{DATA / "ib_write_bw_mib_roce.txt"}"\n')  # 48.9 Gb/s < 380
    results = rdma.run(make_ctx(tmp_path / "sys", server_start_s=0))
    assert by(results, "hca:mlx5_0", "write_bw_gbps").status is Status.FAIL


def test_ib_write_bw_truncated_output_is_error(tmp_path, path_with):
    make_port(tmp_path / "sys", "mlx5_0")
    path_with(f'cat "{DATA / "ib_write_bw_truncated.txt"}"\n')
    results = rdma.run(make_ctx(tmp_path / "sys", server_start_s=0))
    assert by(results, "hca:mlx5_0", "write_bw_gbps").status is Status.ERROR


def test_ib_write_bw_nonzero_exit_is_error_with_stderr(tmp_path, path_with):
    make_port(tmp_path / "sys", "mlx5_0")
    path_with('echo " Couldn\'t connect to 127.0.0.1:18515" >&2\nexit 1\n')
    results = rdma.run(make_ctx(tmp_path / "sys", server_start_s=0))
    err = by(results, "hca:mlx5_0", "write_bw_gbps")
    assert err.status is Status.ERROR and "Couldn't connect" in err.detail


def test_ib_write_bw_out_json_preferred_when_supported(tmp_path, path_with):
    make_port(tmp_path / "sys", "mlx5_0")
    # the stub advertises --out_json in --help and writes the captured JSON file
    path_with(
        'for a in "$@"; do case "$a" in --help) echo "  --out_json"; exit 0;; '
        f'--out_json_file=*) cp "{DATA / "ib_write_bw_out.json"}" "${{a#*=}}";; esac; '
        'done\necho "no table printed"\n'
    )
    results = rdma.run(make_ctx(tmp_path / "sys", server_start_s=0))
    bw = by(results, "hca:mlx5_0", "write_bw_gbps")
    assert bw.status is Status.PASS and bw.evidence["source"] == "json"
    assert "--out_json" in bw.evidence["argv"]
