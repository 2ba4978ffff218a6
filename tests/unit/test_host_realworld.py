"""The host checks on real output other people published (tests/data/realworld/<class>/).

Each sample is run through the agent's own path (the check on a tree and a tool stand-in that
prints the sample, or the parser) and graded by the shipped rules; the level asserted is the
oracle in the folder's PROVENANCE.md, which says where each sample comes from. No NVMe drive,
BMC or firmware error source can run here, so the tools are stand-in scripts that print the
published output, and the kernel log is the published lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent import resources
from node_agent.checks import nvme_health
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.model import Level, Status
from tests.unit.test_host_checks import make_ctx, nvme_tree, tool

DATA = Path(__file__).resolve().parents[1] / "data" / "realworld"
GRADER = load_grader(resources.graders_dir(config_from_dict({})))


def level(results) -> Level:
    return GRADER.grade(results).level


def names(folder: str) -> list[str]:
    return sorted(p.name for p in (DATA / folder).iterdir() if p.name != "PROVENANCE.md")


# -- NVMe health through smartctl -x -j, where nvme-cli is absent --------------------------------

#: sample -> the oracle's level (PROVENANCE.md)
NVME = {
    "s01_scrutiny_intel660p_healthy.json": Level.HEALTHY,
    "s02_scrutiny_mp510_healthy_err-log-entries.json": Level.HEALTHY,
    "s03_scrutiny_970evo_media-errors-7.json": Level.WARN,
    "s04_nasty_kingston-snv3s_healthy_null-sensor.json": Level.HEALTHY,
    "s05_smartmontools-537_pm9a1_used-100_cw-0x04.json": Level.WARN,
}


def smartctl(tmp_path: Path, text: str, code: int = 0) -> str:
    return tool(
        tmp_path,
        "smartctl",
        f"assert sys.argv[1:3] == ['-x', '-j'], sys.argv\nprint({text!r}, end='')\n"
        f"sys.exit({code})\n",
    )


def smartctl_results(tmp_path: Path, text: str, code: int = 0, config: dict | None = None):
    nvme_tree(tmp_path)
    prog = smartctl(tmp_path, text, code)
    ctx = make_ctx(tmp_path, "nvme_health", config, nvme="nvme-not-on-this-host", smartctl=prog)
    return nvme_health.run(ctx)


def test_every_nvme_sample_has_an_oracle():
    assert names("nvme_smartctl") == sorted(NVME)


@pytest.mark.parametrize("name", sorted(NVME))
def test_nvme_sample_read_through_smartctl_grades_as_its_oracle(tmp_path, name):
    results = smartctl_results(tmp_path, (DATA / "nvme_smartctl" / name).read_text())
    assert all(r.evidence.get("read_with") == "smartctl" for r in results), results
    assert not [r for r in results if r.status in (Status.ERROR, Status.SKIP)], results
    assert level(results) is NVME[name]


def test_percentage_used_100_warns_naming_the_rated_endurance(tmp_path):
    text = (DATA / "nvme_smartctl" / NVME_537).read_text()
    (wear,) = [r for r in smartctl_results(tmp_path, text) if r.metric == "wear"]
    assert wear.status is Status.WARN and "rated endurance reached" in wear.detail


NVME_537 = "s05_smartmontools-537_pm9a1_used-100_cw-0x04.json"


def test_spare_below_threshold_in_smartctl_form_grades_error(tmp_path):
    """s01 with its spare run down to 3 % of a 10 % threshold (no public capture of such a drive
    was found): the figure alone is judged, with critical-warning bit 0 left clear."""
    text = (DATA / "nvme_smartctl" / "s01_scrutiny_intel660p_healthy.json").read_text()
    results = smartctl_results(
        tmp_path, text.replace('"available_spare": 100', '"available_spare": 3')
    )
    (spare,) = [r for r in results if r.metric == "available_spare"]
    assert (
        spare.status is Status.FAIL
        and "3 % spare left, below its threshold of 10 %" in spare.detail
    )
    assert level(results) is Level.ERROR


def test_smartctl_exit_status_of_the_disk_state_still_reads_the_log(tmp_path):
    """smartctl exits with bit 3 (DISK FAILING) or bit 6 (error log) set and its JSON whole."""
    text = (DATA / "nvme_smartctl" / NVME_537).read_text()
    results = smartctl_results(tmp_path, text, code=0x08 | 0x40)
    assert level(results) is Level.WARN


def test_smartctl_that_could_not_open_the_device_is_an_error_with_its_words(tmp_path):
    text = (
        '{"smartctl": {"exit_status": 2, "messages": [{"string": "Smartctl open device: '
        '/dev/nvme0 failed: No such device", "severity": "error"}]}}\n'
    )
    (err,) = smartctl_results(tmp_path, text, code=2)
    assert err.status is Status.ERROR and err.metric == "smart_log"
    assert "/dev/nvme0 failed: No such device" in err.detail
