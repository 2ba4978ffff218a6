"""Findings read from the kernel log with ``since: last_run`` (the periodic suite's cursor: each
line read once) stay part of the daemon's grade after the run that read them: the ``xid``
check's driver lines (a ``GPU lost from the bus`` line graded FAULT must stay FAULT),
``kernel_distress`` (a fatal machine check must not fall back to HEALTHY at the next run) and
the mlx5 lines of ``hca_ports``. Run through the real checks on a simulated node and the daemon's own sticky
mechanism (``Daemon._record``), without its threads.
"""

from __future__ import annotations

import time

import yaml

from node_agent.checking.behaviour import Handover, behaviour
from node_agent.model import Result, Status
from node_agent.runner import run_check
from node_agent.service.daemon import Daemon
from node_agent.suite import CheckSpec

LAST_RUN = {"since": "last_run"}
LOST = (
    "NVRM: GPU {bus}.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
    "[NV_ERR_GPU_IS_LOST] (0x0000000F)"
)


def daemon(tmp_path, faults, **scenario):
    path, config = tmp_path / "scenario.yaml", tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults, **scenario})
    )
    config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "spool")})
    )
    return Daemon(str(config), str(path))


def run_and_record(d, check, params=LAST_RUN):
    results = run_check(
        CheckSpec(check=check, timeout_s=15, params=params), d.env, "service", Handover()
    )
    d._record(check, results, time.time(), 0.1)
    return results


def test_a_fatal_machine_check_read_once_stays_error_at_the_next_last_run(tmp_path):
    d = daemon(tmp_path, [{"kind": "mce", "count": 1, "fatal": True}])
    try:
        first = run_and_record(d, "kernel_distress")
        assert "mce_fatal" in {r.metric for r in first if r.status is Status.FAIL}
        assert d.grade.level.name == "ERROR"
        second = run_and_record(d, "kernel_distress")  # the cursor: nothing new to read
        assert not [r for r in second if r.metric == "mce_fatal"]
        assert d.grade.level.name == "ERROR", d.grade
        kept = [r for r in d.current_results() if r.metric == "mce_fatal"]
        assert len(kept) == 1 and kept[0].status is Status.FAIL
    finally:
        d.env.close()


def finding(check, metric, kind, count, status, target="node", subject=None):
    """A folded kernel-log finding as the checks report it (``kind`` and ``count`` in evidence)."""
    return Result(
        check=check,
        target=target,
        metric=metric,
        status=status,
        value=count,
        unit="lines",
        detail=f"{kind} x{count}",
        evidence={"kind": kind, "count": count, "subject": subject},
    )


def distress(metric, kind, count, status, subject=None, target="node"):
    return finding("kernel_distress", metric, kind, count, status, target, subject)


def test_kernel_distress_keeps_warn_and_fail_per_metric_target_subject_and_never_a_pass():
    service = behaviour("kernel_distress")
    # corrected machine checks below mce_corrected_warn pass: not kept
    assert service.sticky_key(distress("mce_corrected", "mce_corrected", 1, Status.PASS)) is None
    assert service.sticky_key(distress("mce_corrected", "mce_corrected", 3, Status.WARN))
    nfs_a = distress("nfs_not_responding", "nfs_not_responding", 1, Status.WARN, "srv-a")
    nfs_b = distress("nfs_not_responding", "nfs_not_responding", 1, Status.WARN, "srv-b")
    assert service.sticky_key(nfs_a) != service.sticky_key(nfs_b)
    # pstore and rasdaemon are read whole at every run: not kept
    pstore = Result(
        check="kernel_distress", target="node", metric="pstore_panic", status=Status.FAIL, detail=""
    )
    assert service.sticky_key(pstore) is None
    # one key folds to one result: the worse, else the fuller; counts never add up
    many = distress("nvme_timeout", "nvme", 2, Status.WARN, "nvme0", "disk:nvme0")
    removed = distress("nvme_timeout", "nvme", 1, Status.FAIL, "nvme0", "disk:nvme0")
    assert service.sticky_key(many) == service.sticky_key(removed)
    assert service.fold(many, removed) is removed and service.fold(removed, many) is removed
    fuller = distress("nvme_timeout", "nvme", 5, Status.WARN, "nvme0", "disk:nvme0")
    assert service.fold(fuller, many) is fuller and service.fold(many, fuller) is fuller


MLX5_FATAL = "mlx5_core 0000:0c:00.0: poll_health:852:(pid 0): Fatal error 1 detected"


def test_an_mlx5_fatal_error_read_once_stays_at_the_next_last_run(tmp_path):
    d = daemon(tmp_path, [{"kind": "kernel_log", "line": MLX5_FATAL}], hcas=["mlx5_0", "mlx5_1"])
    try:
        first = run_and_record(d, "hca_ports")
        assert [(r.target, r.status) for r in first if r.metric == "mlx5_fatal_error"] == [
            ("hca:mlx5_0", Status.FAIL)
        ]
        level = d.grade.level
        assert level.name != "HEALTHY"
        second = run_and_record(d, "hca_ports")  # the cursor: nothing new to read
        assert not [r for r in second if r.metric == "mlx5_fatal_error"]
        assert d.grade.level == level, d.grade
        kept = [r for r in d.current_results() if r.metric == "mlx5_fatal_error"]
        assert [(r.target, r.value) for r in kept] == [("hca:mlx5_0", 1)]
    finally:
        d.env.close()


def test_hca_ports_mlx5_findings_are_kept_per_metric_and_hca():
    service = behaviour("hca_ports")

    def mlx5(count, target="hca:mlx5_0", metric="mlx5_fatal_error", status=Status.FAIL):
        return finding("hca_ports", metric, "fatal", count, status, target)

    assert service.sticky_key(mlx5(1)) == service.sticky_key(mlx5(3)) is not None
    assert service.sticky_key(mlx5(1, "hca:mlx5_1")) != service.sticky_key(mlx5(1))
    # the sysfs findings are read afresh every run: not kept
    assert service.sticky_key(mlx5(0, metric="link_state")) is None
    assert service.sticky_key(mlx5(0, metric="kernel_lines", status=Status.PASS)) is None
    a, b = mlx5(3), mlx5(1)
    assert service.fold(a, b) is a and service.fold(b, a) is a


def test_a_gpu_lost_driver_line_read_once_stays_at_the_next_last_run(tmp_path):
    d = daemon(tmp_path, [{"kind": "kernel_log", "gpu": 3, "line": LOST}])
    try:
        first = run_and_record(d, "xid")
        assert [(r.metric, r.target, r.status) for r in first if r.metric == "gpu_lost"] == [
            ("gpu_lost", "gpu:3", Status.FAIL)
        ]
        assert d.grade.level.name == "ERROR"
        second = run_and_record(d, "xid")  # the cursor: nothing new to read
        assert not [r for r in second if r.metric == "gpu_lost"]
        assert d.grade.level.name == "ERROR", d.grade
        kept = [r for r in d.current_results() if r.metric == "gpu_lost"]
        assert [(r.target, r.evidence["count"]) for r in kept] == [("gpu:3", 1)]
    finally:
        d.env.close()


def driver_result(metric, target, kind, count, status=Status.FAIL):
    return finding("xid", metric, kind, count, status, target)


def test_driver_line_findings_are_keyed_per_target_and_kind_and_fold_to_the_fuller():
    service = behaviour("xid")
    a = driver_result("gpu_lost", "gpu:3", "gpu-lost", 4)
    b = driver_result("gpu_lost", "gpu:3", "gpu-lost", 1)
    assert service.sticky_key(a) == service.sticky_key(b) is not None
    assert service.sticky_key(driver_result("gpu_lost", "gpu:4", "gpu-lost", 1)) != (
        service.sticky_key(a)
    )
    assert service.sticky_key(
        driver_result("recovery_action", "gpu:3", "reset-required", 1)
    ) != service.sticky_key(a)
    # a warn kind (an AER the kernel recovered) is a finding too; a pass is never kept
    aer = driver_result("pcie_aer_uncorrectable", "gpu:1", "aer-uncorrectable", 1, Status.WARN)
    assert service.sticky_key(aer) is not None
    assert service.sticky_key(driver_result("xid", "node", "gpu-lost", 0, Status.PASS)) is None
    # counts never double: the fuller of the two is kept, whichever came first
    assert service.fold(a, b) is a and service.fold(b, a) is a
    # the Xid keys are unchanged
    xid = Result(check="xid", target="gpu:3", metric="xid", status=Status.FAIL, value=79, detail="")
    assert service.sticky_key(xid) == ("gpu:3", 79)
