"""The xid check's driver-line findings stay part of the daemon's grade after the run that read
them (issue: the periodic suite reads the kernel log ``since: last_run``, so a line is read once).

A ``GPU lost from the bus [NV_ERR_GPU_IS_LOST]`` line graded FAULT at the first run; the next run
reads nothing new, and the grade must stay FAULT for the daemon's life in this boot. Run through
the real check (simulated kernel log, the cursor in the state dir) and the daemon's own sticky
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

LOST = (
    "NVRM: GPU {bus}.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
    "[NV_ERR_GPU_IS_LOST] (0x0000000F)"
)


def daemon(tmp_path, faults):
    scenario, config = tmp_path / "scenario.yaml", tmp_path / "config.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": faults}))
    config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "spool")})
    )
    return Daemon(str(config), str(scenario))


def run_and_record(d, spec):
    results = run_check(spec, d.env, "service", Handover())
    d._record(spec.check, results, time.time(), 0.1)
    return results


def test_a_gpu_lost_driver_line_read_once_stays_fault_at_the_next_last_run(tmp_path):
    d = daemon(tmp_path, [{"kind": "kernel_log", "gpu": 3, "line": LOST}])
    try:
        spec = CheckSpec(check="xid", timeout_s=15, params={"since": "last_run"})
        first = run_and_record(d, spec)
        assert [(r.metric, r.target, r.status) for r in first if r.metric == "gpu_lost"] == [
            ("gpu_lost", "gpu:3", Status.FAIL)
        ]
        assert d.grade.level.name == "FAULT"
        second = run_and_record(d, spec)  # the cursor: nothing new to read
        assert not [r for r in second if r.metric == "gpu_lost"]
        assert d.grade.level.name == "FAULT", d.grade
        kept = [r for r in d.current_results() if r.metric == "gpu_lost"]
        assert [(r.target, r.evidence["count"]) for r in kept] == [("gpu:3", 1)]
    finally:
        d.env.close()


def driver_result(metric, target, kind, count, status=Status.FAIL):
    return Result(
        check="xid",
        target=target,
        metric=metric,
        status=status,
        value=count,
        unit="lines",
        detail=f"{kind} x{count}",
        evidence={"kind": kind, "count": count},
    )


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
