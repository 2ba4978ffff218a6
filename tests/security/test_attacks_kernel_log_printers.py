"""Issue 34's rules of belief, round three: kernel printers that start a record with a user's text.

- **The driver's API-mismatch record.** Any user who can open ``/dev/nvidiactl`` (mode 0666)
  sends a version string of up to 63 characters, newlines included, and the driver prints it on
  the record's first line: ``NVRM: API mismatch: the client has the version <string>, but`` and
  three lines of its own (R535 and R550, osapi.c ``RmCheckVersion``, one printk, so one kmsg
  record). The agent searched the whole message for ``NV_ERR_GPU_IS_LOST`` and counted a driver
  line without a bus against the node: FAULT ``gpu-lost``, drain, replace.
- **netfilter's LOG target** prints the rule's prefix at the start of a kernel record, then
  `` IN=<dev> OUT=<dev> ...`` (nf_log_syslog.c). Where ``nf_log_all_netns=1``, or for a user with
  network-admin rights in the host namespace, a prefix ``NVRM: Xid (PCI:<gpu>): 79, ...`` gave
  FAULT and ``watchdog: BUG: soft lockup ...`` gave ERROR and a reboot.

The records are built exactly as the driver and the kernel print them (this host has no NVIDIA
driver, and a test must not set a netfilter LOG rule or ``nf_log_all_netns`` on a shared host),
in the framings a kernel log has: the raw kmsg record ``kernel_log.path`` reads as ``/dev/kmsg``
does, ``dmesg`` and syslog text. Root's agent reads them in real mode (no ``--simulate``):
``node-agent check --act`` and the acting daemon stay HEALTHY and take no action; a genuine
driver record in the same log is graded (the control: the log was read).
"""

from __future__ import annotations

import json

import pytest
from test_attacks_kernel_log import (  # tests/security, same dir
    GENUINE_XID13,
    assert_daemon_healthy_then_reads_a_genuine_line,
    check_act,
    daemon_on,
    run_agent,
)

from tests.unit.test_kernel_log_never_sources import api_mismatch_r535

GPU_LESS = "0000:18:00"
FAKE_79 = f"NVRM: Xid (PCI:{GPU_LESS}): 79, GPU has fallen off the bus."


def nf_log(prefix: str) -> str:
    """nf_log_syslog.c, nf_log_dump_packet_common and dump_ipv4_packet: "%sIN=%s OUT=%s "."""
    return (
        f"{prefix}IN=eth0 OUT= MAC=52:54:00:12:34:56:52:54:00:65:43:21:08:00 SRC=10.0.0.2 "
        "DST=10.0.0.1 LEN=60 TOS=0x00 PREC=0x00 TTL=64 ID=54321 DF PROTO=TCP SPT=40000 DPT=22 "
        "WINDOW=64240 RES=0x00 SYN URGP=0 "
    )


def kmsg(prio: int, seq: int, lines: list[str]) -> list[str]:
    """One /dev/kmsg record (its newlines escaped as the kernel escapes them)."""
    return [f"{prio},{seq},{seq * 1000 + 512000000},-;" + "\\x0a".join(lines)]


def dmesg(lines: list[str]) -> list[str]:
    """util-linux dmesg: the time on the first line, the later lines indented."""
    return ["[  512.123456] " + lines[0]] + [" " * 15 + line for line in lines[1:]]


def syslog(lines: list[str]) -> list[str]:
    """rsyslog's kernel input: each line of the record with the record's kernel time."""
    return ["Nov 27 10:00:00 gpu7 kernel: [  512.123456] " + line for line in lines]


#: the client's version strings: the driver's status text whole, or a newline and a driver line
GPU_LOST = "GPU lost from the bus [NV_ERR_GPU_IS_LOST] (0x0000000F)"
NEWLINE_79 = "x\n" + FAKE_79
RECORDS = {
    "api-mismatch-r535-kmsg": kmsg(3, 91001, api_mismatch_r535(GPU_LOST, "535.161.08")),
    "api-mismatch-r550-kmsg": kmsg(3, 91002, api_mismatch_r535(NEWLINE_79, "550.90.12")),
    "api-mismatch-r535-dmesg": dmesg(api_mismatch_r535(NEWLINE_79, "535.161.08")),
    "api-mismatch-r550-syslog": syslog(api_mismatch_r535(GPU_LOST, "550.90.12")),
    "api-mismatch-r550-syslog-newline": syslog(api_mismatch_r535(NEWLINE_79, "550.90.12")),
    "netfilter-xid79-kmsg": kmsg(4, 91003, [nf_log(FAKE_79 + " ")]),
    "netfilter-lockup-kmsg": kmsg(
        4, 91004, [nf_log("watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [kworker:311] ")]
    ),
    "netfilter-xid79-syslog": syslog([nf_log(FAKE_79)]),
    "netfilter-gpu-lost-dmesg": dmesg(
        [nf_log(f"NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: {GPU_LOST} ")]
    ),
}


@pytest.mark.parametrize("attack", sorted(RECORDS))
def test_a_user_text_printer_record_leaves_check_act_healthy(node, attack):
    config, kernel_log = node
    assert all(len(s) <= 63 for s in (GPU_LOST, NEWLINE_79))  # the driver's string length
    kernel_log.write_text("\n".join(RECORDS[attack]) + "\n")
    code, report = check_act(config)
    assert (code, report["grade"]["level"], report["actions"]) == (0, "HEALTHY", []), report[
        "grade"
    ]
    assert not [
        r
        for r in report["results"]
        if r["check"] in ("xid", "kernel_distress") and r["status"] in ("fail", "warn", "error")
    ]
    # the control: a genuine driver record in the same log is read and graded
    kernel_log.write_text(
        "\n".join(RECORDS[attack]) + "\n" + GENUINE_XID13.format(seq=92002, usec=604608999) + "\n"
    )
    graded = json.loads(run_agent("check", "--json", "--config", str(config)).stdout)
    assert [
        (r["target"], r["value"])
        for r in graded["results"]
        if r["check"] == "xid" and r["status"] == "fail"
    ] == [("pci:0000:3b:00", 13)]


def test_the_daemon_takes_no_action_on_any_user_text_printer_record(
    node,
    shared_dir,
    monkeypatch,
):
    _, kernel_log = node
    daemon, thread, acted = daemon_on(node, shared_dir, monkeypatch)
    try:
        for lines in RECORDS.values():
            with kernel_log.open("a") as log:
                log.write("\n".join(lines) + "\n")
        assert_daemon_healthy_then_reads_a_genuine_line(daemon, kernel_log, acted)
    finally:
        daemon.stop()
        thread.join(5)
