"""Real kernel logs in other people's framings (tests/data/realworld/kernel_log/, provenance and
oracle in its PROVENANCE.md), read as ``kernel_log.path`` reads a file and graded by the ``xid``
and ``kernel_distress`` checks and the shipped grader: each file's oracle level, and the forms
issue 37 found unread (the pre-5.0 OOM wording, ``VFS: file-max limit``, the driver's VA-space
exhaustion)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_agent.checking.context import HOST_PORTS
from node_agent.checks import kernel_distress as kd
from node_agent.checks import xid as xid_check
from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.kernel_log import FileKernelLog
from node_agent.model import Level, Status

DATA = Path(__file__).resolve().parents[1] / "data" / "realworld" / "kernel_log"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A simulated 8-GPU H100 node without faults (none of its buses is in these logs)."""
    tmp = tmp_path_factory.mktemp("realworld-kernel-log")
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {"state_dir": str(tmp / "state"), "host": {"ras_mc_ctl": "ras-mc-ctl-not-here"}}
        )
    )
    scenario = tmp / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8}))
    environment = open_environment(load_config(config), str(scenario))
    yield environment
    environment.close()


def graded(env, name: str):
    """The file through FileKernelLog, the two checks and the grader: (results, grade)."""
    log = FileKernelLog(str(DATA / name))
    results = []
    for check, module, params in (
        ("xid", xid_check, {}),
        (
            "kernel_distress",
            kd,
            {"pstore_root": "/nonexistent/pstore", "pstore_archive": "/nonexistent/archive"},
        ),
    ):
        ctx = env.check_context(
            check,
            "service",
            params,
            kernel_log=log,
            ports=HOST_PORTS,
        )
        results += module.run(ctx)
    findings = [
        r
        for r in results
        if r.status in (Status.WARN, Status.FAIL) and r.metric not in ("ras_mce",)
    ]
    return findings, env.grader.grade(findings, "service")


#: file -> (the findings as (metric, target, value), the grade): PROVENANCE.md's oracle
ORACLE = {
    "k01": ([("driver_line_no_gpu", "node", 3)], Level.WARN),
    "k02": ([("driver_line_no_gpu", "node", 4)], Level.WARN),
    "k03": ([("driver_line_no_gpu", "node", 2)], Level.WARN),
    "k04": ([], Level.HEALTHY),
    "k05": ([("oom_kill", "node", 1)], Level.WARN),
    "k06": ([("oom_kill", "node", 3)], Level.WARN),
    "k07": ([("file_max_reached", "node", 4)], Level.WARN),
    "k08": ([("file_max_reached", "node", 1)], Level.WARN),
    "k09": ([], Level.HEALTHY),
    "k10": ([], Level.HEALTHY),
    "k11": ([], Level.HEALTHY),
    "k12": ([], Level.HEALTHY),
    "k13": ([], Level.HEALTHY),
    "k14": ([("driver_init_failed", "pci:0000:09:00", 1)], Level.ERROR),
    "k15": ([], Level.HEALTHY),
    "k16": ([], Level.HEALTHY),
}


def test_every_sample_has_an_oracle_and_a_provenance_row():
    files = sorted(p.name for p in DATA.glob("k*.log"))
    assert sorted(name[:3] for name in files) == sorted(ORACLE)
    provenance = (DATA / "PROVENANCE.md").read_text()
    assert all(f"| {name} |" in provenance for name in files)


@pytest.mark.parametrize("key", sorted(ORACLE))
def test_real_sample_grades_as_its_oracle(env, key):
    (path,) = DATA.glob(key + "_*.log")
    findings, grade = graded(env, path.name)
    expected, level = ORACLE[key]
    assert sorted((r.metric, r.target, r.value) for r in findings) == expected
    assert grade.level is level, grade.reasons


def test_va_space_exhaustion_names_its_kind_and_never_drains(env):
    findings, grade = graded(env, "k01_open-gpu-kernel-modules-1140_journal_va_space.log")
    (found,) = findings
    assert found.evidence["kind"] == "va-space-exhausted" and found.status is Status.WARN
    assert "can't alloc VA space" in found.detail and grade.action.value == "none"


def test_pre_5_0_oom_kill_and_its_killed_line_are_one_kill_naming_the_process(env):
    (found,), _ = graded(env, "k05_alicloud-duplicity-3_dmesg_oom_pre5.log")
    assert found.value == 1 and "python2:21518" in found.detail


def test_file_max_names_the_limit_and_the_remedy(env):
    (found,), _ = graded(env, "k07_koolshare-clash-14_logread_file_max.log")
    assert "limit 51200" in found.detail and "fs.file-max" in found.evidence["why"]
