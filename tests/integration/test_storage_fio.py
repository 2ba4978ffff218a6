"""The storage check running real fio on tmp_path (Debian package fio; see
scripts/install-test-system-deps). Sizes are CI-small: 16 MiB, 1 s per job."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from node_agent.checking.context import CheckContext
from node_agent.checks import storage
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.model import Status

SMALL = {"size": "16M", "runtime_s": 1, "iodepth": 8}


def make_ctx(paths: list[str], graders: Path | None = None, **params) -> CheckContext:
    """A context for ``paths``; ``graders``: an operator's graders directory (minima)."""
    config = {"storage": {"paths": paths}}
    if graders is not None:
        config["graders_dir"] = str(graders)
    return CheckContext(
        check="storage",
        gpu=AbsentGpuBackend("no GPU on CI"),
        kernel_log=None,
        config=config_from_dict(config),
        inventory=None,
        sku=None,
        expected_gpus=None,
        params={**SMALL, **params},
    )


def test_fio_is_installed():
    assert shutil.which("fio"), "fio missing: run scripts/install-test-system-deps as root"


def test_real_fio_reports_positive_bandwidth_and_iops_per_path(tmp_path):
    tmp_path = tmp_path / "scratch"
    tmp_path.mkdir()
    results = storage.run(make_ctx([str(tmp_path)]))
    by_metric = {r.metric: r for r in results}
    assert set(by_metric) == {"read_bw_mbps", "write_bw_mbps", "randread_iops"}, results
    for r in results:
        assert r.target == f"disk:{tmp_path}"
        assert r.status is Status.PASS
        assert r.value > 0
        assert isinstance(r.evidence["direct"], bool)
    assert by_metric["read_bw_mbps"].unit == "MB/s"
    assert by_metric["randread_iops"].unit == "IOPS"
    assert not list(Path(tmp_path).iterdir()), "the fio data file must be removed"


def test_figure_below_its_graders_minimum_fails(tmp_path):
    graders = tmp_path / "graders"
    graders.mkdir()
    (graders / "storage.yaml").write_text("read_bw_mbps_min: 1.0e+12\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    results = storage.run(make_ctx([str(scratch)], graders=graders))
    by_metric = {r.metric: r for r in results}
    assert by_metric["read_bw_mbps"].status is Status.FAIL
    assert "below the minimum" in by_metric["read_bw_mbps"].detail
    assert "storage.yaml read_bw_mbps_min" in by_metric["read_bw_mbps"].detail
    assert by_metric["read_bw_mbps"].evidence["minimum"] == 1e12
    assert by_metric["write_bw_mbps"].status is Status.PASS  # the shipped file sets none


def test_fio_nonzero_exit_is_error_with_stderr_not_crash(tmp_path):
    (result,) = storage.run(make_ctx([str(tmp_path)], ioengine="nosuchengine"))
    assert result.status is Status.ERROR
    assert "nosuchengine" in result.evidence["stderr_tail"]


def test_missing_path_is_error_naming_the_config_key(tmp_path):
    (result,) = storage.run(make_ctx([str(tmp_path / "absent")]))
    assert result.status is Status.ERROR and "storage.paths" in result.detail


def test_fio_missing_skips_naming_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (result,) = storage.run(make_ctx([str(tmp_path)]))
    assert result.status is Status.SKIP and "`fio`" in result.detail


def test_buffered_fallback_is_noted_in_evidence(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "supports_o_direct", lambda path: False)
    results = storage.run(make_ctx([str(tmp_path)], runtime_s=0.5))
    assert all(r.evidence["direct"] is False for r in results)
    assert all("buffered" in r.evidence["io_mode"] for r in results)
    assert "--direct=0" in results[0].evidence["argv"]


def test_truncated_fio_json_is_error_not_crash(tmp_path, monkeypatch):
    # an fio that exits 0 but whose JSON was cut off (killed writer, full disk)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "fio"
    data = Path(__file__).resolve().parents[1] / "data" / "fio" / "truncated.json"
    stub.write_text(f'#!/bin/sh\ncat "{data}"\n')
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    target = tmp_path / "disk"
    target.mkdir()
    (result,) = storage.run(make_ctx([str(target)]))
    assert result.status is Status.ERROR and "truncated" in result.detail


def test_fio_file_is_in_a_fresh_private_directory_removed_afterwards(tmp_path, monkeypatch):
    # a predictable name in a scratch path users write to is a symlink target (issue 29); fio
    # reaches the directory through the agent's descriptor (/proc/<pid>/fd/<n>), not its name
    tmp_path = tmp_path / "scratch"
    tmp_path.mkdir()
    seen = []
    real_run = storage.proc.run

    def spy(argv, timeout_s, **kw):
        filename = Path(next(a for a in argv if a.startswith("--filename="))[11:])
        assert filename.parent.parent == Path(f"/proc/{os.getpid()}/fd")
        directory = Path(os.readlink(filename.parent))
        st = directory.stat()
        seen.append((directory, st.st_mode & 0o777, directory.parent, kw.get("cwd")))
        return real_run(argv, timeout_s, **kw)

    monkeypatch.setattr(storage.proc, "run", spy)
    first = storage.run(make_ctx([str(tmp_path)]))
    second = storage.run(make_ctx([str(tmp_path)]))
    assert all(r.status is Status.PASS for r in first + second)
    (one, mode, parent, cwd), (two, *_) = seen
    assert mode == 0o700 and parent == tmp_path and cwd == "/"
    assert one != two  # a fresh random name each run, not the pid
    assert not list(tmp_path.iterdir())
