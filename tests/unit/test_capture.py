"""``node-agent capture``: a node recorded call by call replays as that node.

The GPUs are the stand-in libnvidia-ml.so.1 (tests/nvml_fake, loaded by the real nvidia-ml-py)
or its rules in Python (``node_agent.gpu.replay.StateNvml``): no GPU can run here, and NVML is
the one thing faked. Everything above it (the NVML backend, the recorder, the scenario loader,
the checks and grading) is the agent's real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from node_agent import resources
from node_agent.config import config_from_dict
from node_agent.gpu import base
from node_agent.gpu.pci import read_functions
from node_agent.gpu.record import record_nvml
from node_agent.gpu.replay import StateNvml
from node_agent.hardware.sku import load_skus
from node_agent.sim.capture import build_scenario, capture_node, dump, read_kmsg_tail
from node_agent.sim.node import open_gpus
from node_agent.sim.nvml_state import render
from node_agent.sim.scenario import Scenario, load_scenario
from node_agent.sim.tools import SimPciDevice, stand_in_pci_bus, write_pci_sysfs
from node_agent.yamlfile import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvml_fake"))
import nvml_fake_harness as harness  # noqa: E402  (tests/nvml_fake, not an installed module)

REPO = harness.REPO
SHARED_H100 = REPO.parent / "shared" / "realworld" / "gpu-h100-vm"
REAL_H100 = REPO / "scenarios" / "real" / "h100-sxm5-vm.yaml"
CONVERT_COMMAND = (
    "python -m node_agent.sim.capture_import ../shared/realworld/gpu-h100-vm "
    "--out scenarios/real/h100-sxm5-vm.yaml"
)
EXIT = {"HEALTHY": 0, "WARN": 0, "ERROR": 3, "FAULT": 4}


@pytest.fixture(scope="module")
def skus():
    return load_skus(resources.graders_dir(config_from_dict({})))


def _lib(
    *gpu_sections: list[str],
    head=("driver_version 580.159.04", "nvml_version 13.580.159.04", "cuda_driver_version 13000"),
) -> StateNvml:
    lines = ["nvml-fake-state 1", *head]
    for index, gpu in enumerate(gpu_sections):
        lines += [f"[gpu {index}]", *gpu]
    return StateNvml(lines)


H100 = [
    "name NVIDIA H100 80GB HBM3",
    "uuid GPU-0e1c0e5c-95a4-4a7a-8c0c-000000000000",
    "pci.bus_id 00000000:3B:00.0",
    f"memory.total {81559 * 1024 * 1024}",
    "temperature.gpu 33",
    "virtualization_mode 1",
]


def h100_capture(skus) -> dict:
    """The scenario ``node-agent capture`` makes of the stand-in's one healthy H100."""
    return build_scenario(
        record_nvml(call_timeout_s=2, lib=_lib(H100)),
        [],
        [],
        skus,
        {"kind": "test"},
        "n",
        sku="h100-sxm5-80gb",
    )


def _save_and_load(tmp_path: Path, scenario: dict, skus) -> Scenario:
    path = tmp_path / "captured.yaml"
    path.write_text(dump(scenario, ["a test capture"]))
    return load_scenario(path, skus)


# -- what a capture records -----------------------------------------------------------------------


def test_capture_records_each_call_value_or_its_nvml_error(skus):
    lib = _lib(
        H100
        + [
            "unsupported nvmlDeviceGetSerial",
            "retired_pages.pending error 3",
            "remapped_rows 0 0 0 0",
            "nvlink.0.state error 3",
            "field.230 error 4",
            "field.91 uint 18",
        ]
    )
    nvml = record_nvml(call_timeout_s=2, lib=lib)
    gpu = nvml["gpus"][0]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["temperature.gpu"] == 33
    assert gpu["serial"] == {"error": "Not Supported", "code": 3}
    assert gpu["retired_pages.pending"] == {"error": "Not Supported", "code": 3}
    assert gpu["nvlink.0.state"] == {"error": "Not Supported", "code": 3}
    assert gpu["virtualization_mode"] == 1 and gpu["remapped_rows"] == "0 0 0 0"
    assert gpu["field.91"] == "uint 18"
    assert "field.82" not in gpu  # every field id asked; those Not Supported left out
    assert gpu["field.230"] == {"error": "Insufficient Permissions", "code": 4}
    assert nvml["system"] == {
        "driver_version": "580.159.04",
        "nvml_version": "13.580.159.04",
        "cuda_driver_version": 13000,
    }


def test_not_supported_stays_not_supported_in_the_replay(tmp_path, skus):
    lib = _lib(
        H100
        + [
            "unsupported nvmlDeviceGetSerial",
            "unsupported nvmlDeviceGetRetiredPages",
            "remapped_rows 0 0 0 0",
        ]
    )
    scenario = build_scenario(
        record_nvml(call_timeout_s=2, lib=lib), [], [], skus, {"kind": "test"}, "node-1"
    )
    loaded = _save_and_load(tmp_path, scenario, skus)
    backend = open_gpus(loaded, skus[loaded.sku])
    try:
        (dev,) = backend.devices()
        assert dev.identity().serial is None
        with pytest.raises(base.NotSupported):
            dev.retired_pages()
        with pytest.raises(base.NotSupported):
            dev.recovery_action()
        assert dev.virtualization_mode() == "pass_through"
        assert dev.nvlinks() == []
        assert loaded.virtualization == "pass_through" and loaded.captured
    finally:
        backend.close()
    state = render(loaded, skus[loaded.sku])
    assert "serial error 3" in state.splitlines() and "virtualization_mode 1" in state


def test_a_captured_gpu_under_the_agents_load_does_not_pass_off_its_snapshot_as_load(skus):
    """The real H100 was read at idle (70 W, 345 MHz): while the agent loads it (a burn under
    --simulate), power, clocks and temperatures answer Not Supported saying why, so the
    thermal and power checks skip instead of grading an idle reading as a weak GPU."""
    loaded = load_scenario(REPO / "scenarios" / "real" / "h100-sxm5-vm.yaml", skus)
    backend = open_gpus(loaded, skus[loaded.sku])
    try:
        (dev,) = backend.devices()
        assert dev.power().usage_w == 70.361
        backend.load_hint([0], True)
        for reading in (
            dev.power,
            dev.clocks,
            dev.temperature_c,
            dev.throttle_reasons,
            dev.utilization,
            dev.memory_temperature_c,
        ):
            with pytest.raises(base.NotSupported, match="under load is not in the capture"):
                reading()
        assert dev.identity().uuid.startswith("GPU-")  # what load does not change still reads
        backend.load_hint([0], False)
        assert dev.clocks().sm_mhz == 345
    finally:
        backend.close()


def test_a_capture_says_where_when_and_how_it_was_taken(tmp_path, skus):
    captured, header = capture_node(
        skus,
        ["capture", "out.yaml"],
        nvml_lib=_lib(H100),
        pci_root=tmp_path / "no-sysfs",
        kernel_log_records=0,
    )
    record = captured["capture"]
    assert set(record) >= {"host", "date", "agent_version", "command", "kernel"}
    assert record["command"] == "node-agent capture out.yaml"
    assert record["agent_version"] and time.strptime(record["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert "cannot list" in record["pci"]["unavailable"]  # said, not silently empty
    assert captured["sku"] == "h100-sxm5-80gb" and captured["driver"] == "580.159.04"
    assert captured["cuda"] == "13.0" and captured["virtualization"] == "pass_through"
    assert header[0].startswith("node-agent capture of ")


def test_odd_and_hostile_values_are_data_never_a_crash(tmp_path, skus):
    """A GPU name with YAML and state-file syntax in it, a line break, quotes and non-ASCII
    text; a kernel-log record with YAML specials: written quoted, read back the same."""
    name = 'NVIDIA H100 80GB HBM3 "x": [gpu 1]\nname evil # ü'
    lib = _lib([f"name {name}", *H100[1:]])
    record = "6,77,1234,-;NVRM: Xid (PCI:0000:3b:00): 13, name: {evil} 'quoted' # not a comment"
    scenario = build_scenario(
        record_nvml(call_timeout_s=2, lib=lib),
        [],
        [record],
        skus,
        {"kind": "test"},
        "node\n1",
        sku="h100-sxm5-80gb",
    )
    loaded = _save_and_load(tmp_path, scenario, skus)
    assert loaded.kernel_log == (record,)
    backend = open_gpus(loaded, skus[loaded.sku])
    try:
        assert backend.devices()[0].identity().name == name
    finally:
        backend.close()
    # the stand-in's line-based state file cannot carry a line break: a clear error, named
    with pytest.raises(ConfigError, match="'name'.*control character"):
        render(loaded, skus[loaded.sku])


def test_a_hostile_capture_replays_without_hanging_or_crashing(tmp_path, skus):
    """A capture is a file someone else wrote (a bug report's attachment): absurd counts and
    text where numbers belong are errors of the reading they belong to, never a hang."""
    scenario = h100_capture(skus)
    gpu = scenario["nvml"]["gpus"][0]
    gpu.update(
        {
            "retired_pages.sbe": 10**15,
            "retired_pages.dbe": 1,
            "retired_pages.pending": 0,
            "pcie.gen": "five",
            "remapped_rows": "1 2",
            "process": ["x y"],
        }
    )
    loaded = _save_and_load(tmp_path, scenario, skus)
    backend = open_gpus(loaded, skus[loaded.sku])
    try:
        (dev,) = backend.devices()
        started = time.monotonic()
        for reading in (dev.retired_pages, dev.pcie, dev.row_remap, dev.compute_processes):
            with pytest.raises(base.GpuError):
                reading()
        assert time.monotonic() - started < 5
        assert dev.identity().name == "NVIDIA H100 80GB HBM3"  # the rest still reads
    finally:
        backend.close()


@pytest.mark.parametrize(
    "key, entry, message",
    [
        ("pci", {"bdf": "../../../etc/passwd", "vendor": "0x10de", "class": "0x030200"}, "bdf"),
        (
            "pci",
            {"bdf": "0000:3b:00.0", "vendor": "0x10de", "class": "0x030200", "physfn": "/etc"},
            "physfn",
        ),
        (
            "pci",
            {"bdf": "0000:3b:00.0", "vendor": "0x10de", "class": "0x030200", "driver": "../nvidia"},
            "driver",
        ),
        ("kernel_log", "6,1,2,-;NVRM: Xid (PCI:0000:3b:00): 79\nsecond line", "line break"),
    ],
)
def test_a_capture_whose_pci_or_kernel_log_entries_are_not_what_sysfs_and_kmsg_give_is_refused(
    tmp_path, skus, key, entry, message
):
    """The replayed PCI bus is written as a sysfs tree: a bus id or link that is a path is
    refused before anything is written; a kernel-log record is one line (kmsg escapes breaks)."""
    scenario = h100_capture(skus)
    scenario[key] = [entry]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(scenario))
    with pytest.raises(ConfigError, match=message):
        load_scenario(path, skus)


@pytest.mark.parametrize("key", ["hang", "xid", "unsupported"])
def test_a_capture_holding_a_stand_in_switch_instead_of_an_nvml_answer_is_refused(
    tmp_path, skus, key
):
    """``hang *`` would hang every call through the stand-in; ``xid`` would inject events only
    one way: a capture records what NVML answered, nothing else."""
    scenario = h100_capture(skus)
    scenario["nvml"]["gpus"][0][key] = "*"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(scenario))
    with pytest.raises(ConfigError, match=f"'{key}' should not be valid"):
        load_scenario(path, skus)


def test_a_capture_refuses_an_nvml_fault_and_a_gpu_count_that_disagrees(tmp_path, skus):
    scenario = h100_capture(skus)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**scenario, "faults": [{"kind": "xid", "gpu": 0, "code": 79}]}))
    with pytest.raises(ConfigError, match="acts on NVML, which a capture replays as recorded"):
        load_scenario(path, skus)
    path.write_text(yaml.safe_dump({**scenario, "gpus": 8}))
    with pytest.raises(ConfigError, match="nvml.gpus records 1 GPUs"):
        load_scenario(path, skus)


def test_the_pci_bus_is_recorded_from_sysfs_and_replayed_as_that_bus(tmp_path, skus):
    tree = write_pci_sysfs(
        (
            SimPciDevice("0000:3b:00.0", 0x10DE, 0x030200, "nvidia", device=0x2330),
            SimPciDevice("0000:5d:00.0", 0x10DE, 0x030200, "vfio-pci", device=0x2330),
            SimPciDevice("0000:05:00.0", 0x10DE, 0x068000, "nvidia-nvswitch", device=0x22A3),
            SimPciDevice("0000:0c:00.0", 0x15B3, 0x020700, "mlx5_core"),
        ),
        tmp_path / "devices",
    )
    functions = read_functions(tree)
    assert [f["bdf"] for f in functions] == ["0000:05:00.0", "0000:3b:00.0", "0000:5d:00.0"]
    assert functions[1] == {
        "bdf": "0000:3b:00.0",
        "vendor": "0x10de",
        "device": "0x2330",
        "class": "0x030200",
        "driver": "nvidia",
    }
    scenario = build_scenario(
        record_nvml(call_timeout_s=2, lib=_lib(H100)), functions, [], skus, {"kind": "test"}, "n"
    )
    loaded = _save_and_load(tmp_path, scenario, skus)
    bus = stand_in_pci_bus(loaded, skus[loaded.sku])
    assert [(g.bus_id, g.driver, g.device_id) for g in bus.gpus] == [
        ("0000:3b:00.0", "nvidia", 0x2330),
        ("0000:5d:00.0", "vfio-pci", 0x2330),
    ]


def test_nvml_that_did_not_load_is_recorded_and_fails_the_same_way_in_the_replay(tmp_path, skus):
    lib = _lib(head=("error nvmlInit 9",))
    nvml = record_nvml(call_timeout_s=2, lib=lib)
    assert nvml == {"system": {"nvmlInit": {"error": "Driver Not Loaded", "code": 9}}, "gpus": []}
    scenario = build_scenario(nvml, [], [], skus, {"kind": "test"}, "n", sku="h100-sxm5-80gb")
    loaded = _save_and_load(tmp_path, scenario, skus)
    assert loaded.driver == "not_loaded"
    backend = open_gpus(loaded, skus[loaded.sku])
    assert backend.devices() == [] and backend.broken
    assert "nvidia kernel module is not loaded" in backend.unavailable_reason


def test_a_node_matching_no_sku_file_needs_one_named(skus):
    from node_agent.sim.capture import CaptureError

    lib = _lib(["name Some Future GPU", "uuid GPU-1", "pci.bus_id 00000000:3B:00.0"])
    with pytest.raises(CaptureError, match="--sku NAME"):
        build_scenario(record_nvml(call_timeout_s=2, lib=lib), [], [], skus, {}, "n")


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/dev/kmsg", os.R_OK | os.W_OK),
    reason="writing and reading /dev/kmsg needs root (CAP_SYSLOG)",
)
def test_the_kernel_log_tail_keeps_each_records_kmsg_header():
    """A record written to the real /dev/kmsg comes back with its facility and priority: a
    user's write is facility 1 (LOG_USER) whatever it claims, ``13,...`` at priority 5."""
    marker = f"node-agent capture test record {os.getpid()} {time.time_ns()}"
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, f"<5>{marker}\n".encode())
    finally:
        os.close(fd)
    records, why = read_kmsg_tail(limit=100_000)
    assert why is None
    (mine,) = [r for r in records if marker in r]
    prio, seq, usec, _flags = mine.split(";", 1)[0].split(",")[:4]
    assert (int(prio) >> 3, int(prio) & 7) == (1, 5) and int(seq) >= 0 and int(usec) >= 0


def test_a_configured_kernel_log_file_is_captured_as_it_is_and_only_if_root_alone_writes_it(
    tmp_path,
):
    from node_agent.sim.capture import read_file_tail

    log = tmp_path / "kernel.log"
    lines = [
        "6,10,1000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus.",
        "[ 1.325094] NVRM: loading",
        "",
    ]
    log.write_text("\n".join(lines))
    log.chmod(0o644)
    assert read_file_tail(str(log), limit=10) == (lines[:2], None)
    assert read_file_tail(str(log), limit=1) == (lines[1:2], None)
    link = tmp_path / "link.log"
    link.symlink_to(log)
    assert read_file_tail(str(link))[0] == []  # not followed
    if os.geteuid() == 0:
        log.chmod(0o666)
        records, why = read_file_tail(str(log))
        assert records == [] and "writable by others" in why


# -- round trips ----------------------------------------------------------------------------------


def _run(args, tmp_path, env, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "node_agent.commands.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env,
    )


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.yaml"
    log = tmp_path / "kernel.log"
    log.write_text("")
    path.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "kernel_log": {"path": str(log)},
                "nvml": {"call_timeout_s": 5},
            }
        )
    )
    return path


def test_a_healthy_h100_captured_through_nvidia_ml_py_replays_healthy_with_8_gpus(tmp_path, config):
    """``node-agent capture`` through the real nvidia-ml-py against the stand-in library
    serving scenarios/healthy-h100.yaml, then ``check --simulate`` on the capture."""
    harness.build()
    out = tmp_path / "captured.yaml"
    env = harness.agent_env(scenario=REPO / "scenarios" / "healthy-h100.yaml")
    captured = _run(["capture", str(out), "--config", str(config)], tmp_path, env)
    assert captured.returncode == 0, captured.stderr
    data = yaml.safe_load(out.read_text())
    assert len(data["nvml"]["gpus"]) == 8 and data["sku"] == "h100-sxm5-80gb"
    assert out.stat().st_mode & 0o077 == 0  # it holds the node's details: private
    plain = harness.agent_env()
    plain.pop("LD_LIBRARY_PATH")
    for command in (
        ["check"],
        ["accept", "--only", "inventory,nvml_health,xid", "--out", str(tmp_path / "out")],
    ):
        replay = _run(
            [*command, "--simulate", str(out), "--json", "--config", str(config)], tmp_path, plain
        )
        assert replay.returncode == 0, replay.stderr
        report = json.loads(replay.stdout)
        assert report["grade"]["level"] == "HEALTHY", report["grade"]
        assert report["simulated"] is True and len(report["gpus"]) == 8
        assert {g["sku"] for g in report["gpus"]} == {"h100-sxm5-80gb"}


def test_a_simulated_node_captured_with_simulate_grades_as_the_node_did(tmp_path, config):
    """faulty-h100 (Xid 79, a pending and a failed row remap, 91 °C, a PCIe x8 link) captured
    through the recorder from its simulation: its replay grades as its simulation, reason for
    reason."""
    env = harness.agent_env()
    env.pop("LD_LIBRARY_PATH")
    source = REPO / "scenarios" / "faulty-h100.yaml"
    out = tmp_path / "captured.yaml"
    captured = _run(
        ["capture", str(out), "--simulate", str(source), "--config", str(config)], tmp_path, env
    )
    assert captured.returncode == 0, captured.stderr

    def graded(scenario):
        run = _run(
            ["check", "--simulate", str(scenario), "--json", "--config", str(config)], tmp_path, env
        )
        report = json.loads(run.stdout)
        return (
            run.returncode,
            report["grade"]["level"],
            sorted((r["rule"], r["target"], r["level"]) for r in report["grade"]["reasons"]),
        )

    assert graded(out) == graded(source)
    assert graded(out)[:2] == (EXIT["FAULT"], "FAULT")


# -- the real H100 ---------------------------------------------------------------------------------


def test_the_committed_real_h100_scenario_is_what_the_converter_makes_of_the_readings(skus):
    if not SHARED_H100.is_dir():
        pytest.skip(f"the readings it is converted from are not here ({SHARED_H100} is absent)")
    from node_agent.sim.capture_import import convert

    assert REAL_H100.read_text() == convert(SHARED_H100, skus, CONVERT_COMMAND), (
        f"scenarios/real/h100-sxm5-vm.yaml is stale: regenerate it with `{CONVERT_COMMAND}`"
    )


def test_the_real_h100_scenario_carries_its_provenance_and_oracle(skus):
    loaded = load_scenario(REAL_H100, skus)
    assert loaded.captured and loaded.gpus == 1 and loaded.virtualization == "pass_through"
    assert loaded.capture["oracle"] == {
        "declared": {"node.expected_gpus": 1, "grade": "HEALTHY"},
        "undeclared": {"at_most": "WARN", "never": ["ERROR", "FAULT"]},
    }
    assert loaded.capture["date"] == "2026-11-24" and loaded.capture["kind"] == "converted"
    header = REAL_H100.read_text().split("\ncapture:", 1)[0]
    assert "What a good operator concludes" in header and "Pass-Through" not in header
    assert [p["bdf"] for p in loaded.pci] == ["0000:00:06.0"]
    assert any("FBHUB Interrupt detected" in line for line in loaded.kernel_log)


# -- a readings directory is someone else's (issue 34) --------------------------------------------


def _readings_dir(tmp_path: Path) -> Path:
    if not SHARED_H100.is_dir():
        pytest.skip(f"the real readings are not here ({SHARED_H100} is absent)")
    src = tmp_path / "readings"
    src.mkdir()
    for name in ("nvml-readings.json", "kernel-log-boot.txt", "PROVENANCE.md"):
        (src / name).write_bytes((SHARED_H100 / name).read_bytes())
    return src


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p, secret: (p.unlink(), p.symlink_to(secret)), "is a symbolic link"),
        (lambda p, secret: (p.unlink(), os.mkfifo(p)), "is a FIFO, not a regular file"),
        (lambda p, secret: (p.unlink(), os.link(secret, p)), "has 2 hard links"),
    ],
    ids=["symlink", "fifo", "hardlink"],
)
def test_a_link_or_fifo_in_a_readings_directory_is_refused_naming_it(tmp_path, skus, make, said):
    from node_agent.sim.capture import CaptureError
    from node_agent.sim.capture_import import convert

    src = _readings_dir(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("root:$6$secret-hash:19000:0:99999:7:::\n")
    make(src / "kernel-log-boot.txt", secret)
    with pytest.raises(CaptureError) as err:
        convert(src, skus, "test")
    assert "kernel-log-boot.txt" in str(err.value) and said in str(err.value)
    assert "secret-hash" not in str(err.value)


def test_an_oversized_file_in_a_readings_directory_is_refused(tmp_path, skus, monkeypatch):
    from node_agent.sim import capture_import
    from node_agent.sim.capture import CaptureError
    from node_agent.sim.capture_import import convert

    src = _readings_dir(tmp_path)
    monkeypatch.setattr(capture_import, "MAX_BYTES", 1000)
    with pytest.raises(CaptureError, match=r"nvml-readings.json is \d+ bytes, more than the 1000"):
        convert(src, skus, "test")
