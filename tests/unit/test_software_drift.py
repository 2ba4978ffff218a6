"""The ``software_drift`` check: the node's stack against ``node.software``, the pieces its SKU
needs, PCIe ACS and persistence mode.

Nodes are simulated (``--simulate`` scenarios through ``open_environment``: the simulated NVML
backend gives the driver, CUDA and VBIOS versions of the scenario), the ``software`` fault gives
the simulated node's NCCL, kernel, fabric manager, peermem and ACS. The readers of this host's
files (``ldconfig -p``'s paths, ``/proc``, a bridge's config space) are tested on trees the test
writes in the real formats: ``ldconfig -p`` prints ``\\tlibnccl.so.2 (libc6,x86-64) => <path>``
(glibc elf/ldconfig.c, ``print_cache``); a PCIe extended capability header is ID (bits 15:0),
version (19:16) and the next offset (31:20), the ACS control register at +6 (PCIe base spec
6.0, 7.6.3 and 7.7.11).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from node_agent.checking.context import HOST_PORTS
from node_agent.checks import software_drift as sd
from node_agent.config import load_config
from node_agent.environment import open_environment
from node_agent.kernel_log import LinesKernelLog
from node_agent.model import Level, Status


def node(tmp_path, software=None, faults=(), **scenario):
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "state"), "node": {"software": software or {}}})
    )
    path = tmp_path / "scenario.yaml"
    path.write_text(
        yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 8, "faults": list(faults), **scenario})
    )
    return open_environment(load_config(config), str(path))


def run(env, **params):
    ctx = env.check_context(
        "software_drift",
        "delivery",
        params,
        kernel_log=LinesKernelLog([]),
    )
    return sd.run(ctx)


def by_metric(results, metric):
    return [r for r in results if r.metric == metric]


def test_declared_versions_match_exactly_or_by_a_dotted_prefix():
    assert sd.matches("570", "570.86.15") and sd.matches("570.86.15", "570.86.15")
    assert not sd.matches("57", "570.86.15") and not sd.matches("570.86.16", "570.86.15")


def test_nothing_declared_passes_with_what_was_found(tmp_path):
    env = node(tmp_path)
    try:
        results = run(env)
    finally:
        env.close()
    (driver,) = by_metric(results, "driver_version")
    assert driver.status is Status.PASS and "570.86.15" in driver.detail
    assert "nothing declared" in driver.detail
    assert env.grader.grade(results, "delivery").level is Level.HEALTHY


def test_driver_nccl_and_vbios_drift_warn_naming_expected_and_found(tmp_path):
    env = node(
        tmp_path,
        {"driver": "575.51.03", "nccl": "2.21.5", "vbios": "96.00.99.00.01", "cuda": "12.8"},
        faults=[{"kind": "software", "nccl": "2.18.1"}],
    )
    try:
        results = run(env)
        g = env.grader.grade(results, "delivery")
    finally:
        env.close()
    (driver,) = by_metric(results, "driver_version")
    assert driver.status is Status.WARN
    assert (driver.evidence["expected"], driver.evidence["found"]) == ("575.51.03", "570.86.15")
    assert "expected 575.51.03" in driver.detail and "found 570.86.15" in driver.detail
    (nccl,) = by_metric(results, "nccl_version")
    assert (nccl.status, nccl.evidence["found"]) == (Status.WARN, "2.18.1")
    assert {r.status for r in by_metric(results, "vbios_version")} == {Status.PASS}
    assert by_metric(results, "cuda_version")[0].status is Status.PASS
    assert g.level is Level.WARN and {r.rule for r in g.reasons} == {"software-drift"}


def test_fabric_manager_peermem_acs_and_persistence_drift_each_warn(tmp_path):
    env = node(
        tmp_path,
        hcas=["mlx5_0"],
        faults=[
            {"kind": "software", "fabricmanager": False, "peermem": False, "acs": ["0000:17:01.0"]},
            {"kind": "persistence_off", "gpu": 3},
        ],
    )
    try:
        results = run(env)
        g = env.grader.grade(results, "service")
    finally:
        env.close()
    warned = {r.metric: r for r in results if r.status is Status.WARN}
    assert set(warned) == {"fabric_manager", "nvidia_peermem", "pcie_acs", "persistence_mode"}
    assert warned["pcie_acs"].evidence["bridges"] == ["0000:17:01.0"]
    assert warned["persistence_mode"].evidence["gpus"] == [3]
    assert g.level is Level.WARN


def test_peermem_is_not_needed_without_rdma_devices_nor_fabric_manager_in_a_vm(tmp_path):
    env = node(
        tmp_path,
        virtualization="pass_through",
        faults=[{"kind": "software", "fabricmanager": False, "peermem": False}],
    )
    try:
        results = run(env)
    finally:
        env.close()
    assert by_metric(results, "nvidia_peermem")[0].status is Status.SKIP
    assert by_metric(results, "fabric_manager")[0].status is Status.SKIP
    assert by_metric(results, "pcie_acs")[0].status is Status.SKIP


def test_the_needs_of_a_sku_can_be_overridden_by_params(tmp_path):
    env = node(tmp_path, faults=[{"kind": "software", "fabricmanager": False}])
    try:
        results = run(env, needs={"fabricmanager": False})
    finally:
        env.close()
    assert by_metric(results, "fabric_manager")[0].status is Status.SKIP


def test_nccl_version_is_the_name_its_soname_link_resolves_to(tmp_path):
    lib = tmp_path / "libnccl.so.2.21.5"
    lib.write_bytes(b"\x7fELF")
    (tmp_path / "libnccl.so.2").symlink_to(lib.name)
    text = (
        f"12 libs found in cache `/etc/ld.so.cache'\n"
        f"\tlibnccl.so.2 (libc6,x86-64) => {tmp_path / 'libnccl.so.2'}\n"
        "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n"
    )
    (path,) = sd.parse_ldconfig_nccl(text)
    assert sd.nccl_version_of(path) == "2.21.5"
    assert sd.nccl_version_of(str(tmp_path / "libnccl.so")) is None


def test_this_hosts_nccl_is_read_through_ldconfig_or_said_missing():
    version, where = sd.system_nccl()
    assert ("ldconfig" in where) or ("linker cache" in where)
    if version is None:
        assert "libnccl" in where or "ldconfig" in where


def config_space(caps: list[tuple[int, bytes]]) -> bytes:
    """4096 bytes of config space with these extended capabilities chained from 0x100."""
    space = bytearray(4096)
    offset = 0x100
    for i, (cap_id, body) in enumerate(caps):
        nxt = offset + 0x40 if i + 1 < len(caps) else 0
        header = cap_id | (1 << 16) | (nxt << 20)
        space[offset : offset + 4] = header.to_bytes(4, "little")
        space[offset + 4 : offset + 4 + len(body)] = body
        offset = nxt
    return bytes(space)


def test_acs_control_is_found_along_the_extended_capability_chain():
    aer = (0x0001, b"\0" * 8)
    acs_on = (sd.ACS_CAP_ID, b"\x7f\x00" + (0x001D).to_bytes(2, "little"))  # SV RR CR UF
    acs_off = (sd.ACS_CAP_ID, b"\x7f\x00\x00\x00")
    assert sd.acs_control(config_space([aer, acs_on])) & sd.ACS_P2P_BREAKING
    assert sd.acs_control(config_space([aer, acs_off])) == 0
    assert sd.acs_control(config_space([aer])) is None
    assert sd.acs_control(b"\0" * 64) is None  # what sysfs gives a non-root reader


def test_upstream_bridges_come_from_the_devices_sysfs_path(tmp_path):
    chain = tmp_path / "devices" / "pci0000:16" / "0000:16:02.0" / "0000:17:00.0" / "0000:18:00.0"
    chain.mkdir(parents=True)
    links = tmp_path / "bus"
    links.mkdir()
    (links / "0000:18:00.0").symlink_to(chain)
    assert sd.upstream_bridges("0000:18:00.0", links) == ["0000:17:00.0", "0000:16:02.0"]


def test_fabric_manager_counts_only_a_root_process(tmp_path):
    proc_root = tmp_path / "proc"
    (proc_root / "4242").mkdir(parents=True)
    (proc_root / "4242" / "comm").write_text("nv-fabricmanage\n")
    os.chown(proc_root / "4242", 65534, 65534)
    assert not sd.fabric_manager_running(proc_root)
    (proc_root / "77").mkdir()
    (proc_root / "77" / "comm").write_text("nv-fabricmanage\n")
    assert sd.fabric_manager_running(proc_root) is (os.stat(proc_root / "77").st_uid == 0)


@pytest.mark.skipif(
    os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"),
    reason="this host has RDMA devices",
)
def test_on_this_host_without_gpus_the_check_skips_what_it_cannot_see(tmp_path):
    """Real mode (no scenario) on a host without GPUs or HCAs: no pass for what was not seen."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    env = open_environment(load_config(config))
    try:
        if env.inventory.gpus:
            pytest.skip("this host has GPUs")
        results = sd.run(
            env.check_context(
                "software_drift",
                "delivery",
                {},
                kernel_log=LinesKernelLog([]),
                expected_gpus=None,
                ports=HOST_PORTS,
            )
        )
    finally:
        env.close()
    assert not by_metric(results, "driver_version") and not by_metric(results, "persistence_mode")
    assert by_metric(results, "pcie_acs")[0].status is Status.SKIP
    assert by_metric(results, "kernel_version")[0].evidence["found"] == os.uname().release


def test_a_captured_node_skips_what_its_capture_did_not_record(tmp_path):
    """scenarios/real/h100-sxm5-vm.yaml: NVML was recorded (driver, CUDA, VBIOS, persistence),
    the kernel, NCCL, services and bridges were not: those are skips, never this host's values."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    real = Path(__file__).resolve().parents[2] / "scenarios" / "real" / "h100-sxm5-vm.yaml"
    env = open_environment(load_config(config), str(real))
    try:
        results = run(env)
    finally:
        env.close()
    status = {r.metric: r.status for r in results}
    assert status["driver_version"] is Status.PASS and status["persistence_mode"] is Status.PASS
    for metric in ("kernel_version", "nccl_version", "nvidia_peermem"):
        assert status[metric] is Status.SKIP, metric
