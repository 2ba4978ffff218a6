"""``node-agent capture --from-nvidia-smi FILE``: what ``nvidia-smi -q`` (text) or ``-q -x``
(XML) printed, as a capture scenario that replays through ``--simulate`` (issue 37, item 8).

Real material: the H100 and H200 hosts' own ``nvidia-smi -q`` (and the H100's ``-q -x``) in
../shared/realworld/ (read where they lie; a test skips, saying so, where they are absent), a
real 4x GB200 tray's ``-q -x`` and two fault prints of the same nvidia-smi over NVIDIA's NVML
mock, from NVIDIA/k8s-test-infra (tests/data/realworld/nvidia_smi/, PROVENANCE.md there). The
replays run the real ``node-agent check``; NVML is replayed from the file (no GPU here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.hardware.sku import load_skus
from node_agent.sim.capture import CaptureError
from node_agent.sim.nvidia_smi import convert, parse

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "realworld"
DATA = REPO / "tests" / "data" / "realworld" / "nvidia_smi"
GB200 = DATA / "gb200-p6e" / "nvidia-smi-q.xml"
GB200_SCENARIO = REPO / "scenarios" / "real" / "gb200-p6e-nvidia-smi.yaml"
GB200_COMMAND = (
    f"node-agent capture --from-nvidia-smi {GB200.relative_to(REPO)} "
    f"{GB200_SCENARIO.relative_to(REPO)}"
)
#: keys a print of a moment later may read differently (live readings)
LIVE = {"temperature.gpu", "power.usage", "clock.graphics", "clock.sm", "memory.used", "field.82"}


@pytest.fixture(scope="module")
def skus():
    return load_skus(resources.graders_dir(config_from_dict({})))


def shared(host: str, name: str) -> Path:
    path = SHARED / host / name
    if not path.is_file():
        pytest.skip(f"the real print is not here ({path} is absent)")
    return path


def scenario_of(src: Path, skus, **kw) -> dict:
    return yaml.safe_load(convert(src, skus, "test", **kw))


def check(scenario: Path, tmp_path: Path, **config) -> tuple[int, dict]:
    """The real ``node-agent check --json`` on the scenario (state and reports in tmp_path)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), **config}))
    done = subprocess.run(
        [sys.executable, "-m", "node_agent.commands.main", "check", "--simulate", str(scenario)]
        + ["--json", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ),
    )
    assert done.returncode in (0, 3, 4), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def rules(report: dict) -> set[tuple[str, str, str]]:
    return {(r["level"], r["rule"], r["target"]) for r in report["grade"]["reasons"]}


# -- what is read -----------------------------------------------------------------------------------


def test_the_h100s_text_and_xml_of_one_moment_give_the_same_calls(skus):
    text = scenario_of(shared("gpu-h100-vm", "nvidia-smi-q.txt"), skus)
    xml = scenario_of(shared("gpu-h100-vm", "nvidia-smi-q.xml"), skus)
    (a,), (b,) = text["nvml"]["gpus"], xml["nvml"]["gpus"]
    assert {k: v for k, v in a.items() if k not in LIVE} == {
        k: v for k, v in b.items() if k not in LIVE
    }
    assert a["name"] == "NVIDIA H100 80GB HBM3" and a["remapped_rows"] == "0 0 0 0"
    assert a["retired_pages.sbe"] == {"error": "Not Supported", "code": 3}
    assert (text["sku"], text["virtualization"], text["pci"]) == (
        "h100-sxm5-80gb",
        "pass_through",
        [
            {
                "bdf": "0000:00:06.0",
                "vendor": "0x10de",
                "device": "0x2330",
                "class": "0x030200",
                "driver": "nvidia",
            }
        ],
    )


def test_the_h200s_print_agrees_with_what_its_nvml_answered_on_the_same_host(skus):
    """The H200 host was also captured through NVML (capture.yaml): every call both hold
    answers alike, but for live readings and the T.Limit-derived thresholds (a degree)."""
    (smi,) = scenario_of(shared("gpu-h200-vm", "nvidia-smi-q.txt"), skus)["nvml"]["gpus"]
    captured = yaml.safe_load(shared("gpu-h200-vm", "capture.yaml").read_text())
    (nvml,) = captured["nvml"]["gpus"]
    both = (set(smi) & set(nvml)) - LIVE
    assert len(both) > 50
    thresholds = {k for k in both if k.startswith("temperature.threshold.")}
    assert thresholds == {f"temperature.threshold.{t}" for t in ("shutdown", "slowdown", "gpu_max")}
    assert all(abs(smi[k] - nvml[k]) <= 1 for k in thresholds)
    differ = {k: (smi[k], nvml[k]) for k in both - thresholds if smi[k] != nvml[k]}
    assert differ == {}


def test_what_nvidia_smi_does_not_print_is_said_in_the_file(skus):
    loaded = scenario_of(GB200, skus)
    record = loaded["capture"]
    assert loaded["kernel_log"] == [] and "no kernel log" in record["kernel_log"]["unavailable"]
    assert set(record["not_known"]) >= {"kernel_log", "pci", "nvlink"}
    assert "only the GPUs nvidia-smi listed" in record["pci"]["unavailable"]
    assert "temperature.threshold" in record["assumed"]
    assert len(loaded["nvml"]["gpus"]) == 4 and len(loaded["pci"]) == 4
    assert not any(k.startswith("nvlink.") for g in loaded["nvml"]["gpus"] for k in g)


def test_the_committed_gb200_scenario_is_what_the_converter_makes_of_the_print(skus):
    assert GB200_SCENARIO.read_text() == convert(GB200, skus, GB200_COMMAND), (
        f"{GB200_SCENARIO.relative_to(REPO)} is stale: regenerate it with `{GB200_COMMAND}`"
    )


# -- the replay grades as a good operator would ------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("gpu-h100-vm", "nvidia-smi-q.txt"),
        ("gpu-h100-vm", "nvidia-smi-q.xml"),
        ("gpu-h200-vm", "nvidia-smi-q.txt"),
    ],
)
def test_a_passed_through_hopper_replays_as_its_oracle_says(tmp_path, skus, host, name):
    """PROVENANCE.md: with `node.expected_gpus: 1` HEALTHY; with nothing declared at most
    WARN, naming what could not be verified; never ERROR or FAULT."""
    out = tmp_path / "node.yaml"
    out.write_text(convert(shared(host, name), skus, "test"))
    code, report = check(out, tmp_path / "undeclared")
    assert (code, report["grade"]["level"]) == (0, "WARN")
    assert {rule for _, rule, _ in rules(report)} == {"gpu-count-unconfirmed"}
    code, report = check(out, tmp_path / "declared", node={"expected_gpus": 1})
    assert (code, report["grade"]["level"], rules(report)) == (0, "HEALTHY", set())
    xid = [r for r in report["results"] if r["check"] == "xid" and r["metric"] == "kernel_log"]
    assert [r["status"] for r in xid] == ["skip"] and "no kernel log" in xid[0]["detail"]


def test_the_real_gb200_tray_replays_healthy(tmp_path):
    code, report = check(GB200_SCENARIO, tmp_path)
    assert (code, report["grade"]["level"], rules(report)) == (0, "HEALTHY", set())
    assert len(report["gpus"]) == 4
    assert not [r for r in report["results"] if r["status"] == "error"]


@pytest.mark.parametrize(
    ("name", "faults"),
    [
        (
            "lost.xml",
            {
                ("ERROR", "gpu-lost", "gpu:1"),
                ("FAULT", "row-remap-failure", "gpu:0"),
                ("ERROR", "ecc-dbe-volatile", "gpu:0"),
            },
        ),
        (
            "ecc-injected.xml",
            {("FAULT", "row-remap-failure", "gpu:0"), ("ERROR", "ecc-dbe-volatile", "gpu:0")},
        ),
    ],
)
def test_a_lost_gpu_and_a_failed_row_remap_as_nvidia_smi_prints_them(tmp_path, skus, name, faults):
    """The volatile double-bit errors are ERRORs (a reset applies the row remap), and so is the
    lost GPU (Xid 79's RESTART_BM: rebooted first); the row remap that failed is the
    replacement."""
    out = tmp_path / "node.yaml"
    out.write_text(convert(DATA / "gb200-mock-faults" / name, skus, "test", sku="gb200-186gb"))
    code, report = check(out, tmp_path)
    assert (code, report["grade"]["level"], report["grade"]["action"]) == (4, "FAULT", "replace")
    assert faults <= rules(report), rules(report)


# -- the file is someone else's -------------------------------------------------------------------


def test_an_xml_that_declares_an_entity_is_refused_before_it_expands(tmp_path, skus):
    laughs = (
        '<?xml version="1.0"?>\n<!DOCTYPE nvidia_smi_log [\n<!ENTITY a "ha">\n'
        '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">\n<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;">\n]>\n'
        "<nvidia_smi_log><gpu><product_name>&c;</product_name></gpu></nvidia_smi_log>\n"
    )
    src = tmp_path / "q.xml"
    src.write_text(laughs)
    with pytest.raises(CaptureError, match="declares an entity: refused"):
        convert(src, skus, "test")


def test_a_symlink_or_something_else_is_refused_naming_it(tmp_path, skus):
    link = tmp_path / "nvidia-smi-q.txt"
    link.symlink_to("/etc/shadow")
    with pytest.raises(CaptureError, match="is a symbolic link"):
        convert(link, skus, "test")
    other = tmp_path / "other.txt"
    other.write_text("hello\n")
    with pytest.raises(CaptureError, match="not what nvidia-smi -q prints"):
        convert(other, skus, "test")
    deep = tmp_path / "deep.xml"
    deep.write_text("<nvidia_smi_log>" + "<a>" * 100 + "</a>" * 100 + "</nvidia_smi_log>")
    with pytest.raises(CaptureError, match="nested more than 64 deep"):
        convert(deep, skus, "test")


def test_the_command_converts_a_print_and_refuses_two_sources(tmp_path):
    out = tmp_path / "gb200.yaml"
    base = [sys.executable, "-m", "node_agent.commands.main", "capture"]
    done = subprocess.run(
        [*base, "--from-nvidia-smi", str(GB200), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load(out.read_text())["sku"] == "gb200-186gb"
    both = subprocess.run(
        [*base, "--from-nvidia-smi", str(GB200), "--from-readings", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_a_gpu_whose_readings_say_gpu_is_lost_is_recorded_lost(skus):
    gpus = scenario_of(DATA / "gb200-mock-faults" / "lost.xml", skus, sku="gb200-186gb")
    first, lost = gpus["nvml"]["gpus"]
    assert lost.get("lost") == 1 and "name" not in lost
    assert first["name"] == "NVIDIA GB200" and first["ecc.uncorrected.volatile.dram"] == 5
    assert parse((DATA / "gb200-mock-faults" / "lost.xml").read_bytes(), "lost.xml").form == "xml"
