"""Kernel printers that start a record with a user's text are never sources (issue 34).

- The NVIDIA driver's version check prints the client's version string, which any user who can
  open ``/dev/nvidiactl`` chooses (up to 63 characters, newlines included): R535/R550
  ``NVRM: API mismatch: the client has the version <string>, but`` / ``NVRM: this kernel module
  has the version <v>.  Please`` / ``NVRM: make sure that this kernel module and all NVIDIA
  driver`` / ``NVRM: components have the same version.`` (open-gpu-kernel-modules 535.179 and
  550.90.12, src/nvidia/arch/nvalloc/unix/src/osapi.c, ``RmCheckVersion``: one ``nv_printf`` with
  the newlines inside, so one kmsg record); from R575 ``NVRM: API mismatch: the client '<comm>'
  (pid <n>)`` / ``NVRM: has the version <string>, but this kernel module has`` / ...
- netfilter's LOG target prints the rule's prefix first, then ``IN=<dev> OUT=<dev> ...``
  (net/netfilter/nf_log_syslog.c, ``"%sIN=%s OUT=%s "``; ebtables' ``ebt_log`` ``"%s IN=%s
  OUT=%s "``); nftables allows a 127-character prefix.

Each record is written in the framings a log gives it: the kmsg record (newlines escaped as
``\\x0a``), ``dmesg`` (its later lines indented), ``dmesg -S`` and syslog (each line with the
record's time), ``journalctl -k`` (later lines indented).
"""

from __future__ import annotations

import struct

import pytest

from node_agent.kernel_log import (
    FILE_READ_BYTES,
    FileKernelLog,
    LogRecord,
    _parse_kmsg_record,
    kernel_message,
    parse_driver_line,
    refusal,
    scan,
    scan_lines,
)
from node_agent.kernel_log_distress import parse_distress, scan_distress

FAKE_79 = "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."
FAKE_LOST = "GPU lost from the bus [NV_ERR_GPU_IS_LOST] (0x0000000F)"
FAKE_LOCKUP = "watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [kworker:1]"
GENUINE_13 = "NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=python3, Graphics Exception"


def api_mismatch_r535(client: str, module: str = "535.161.08") -> list[str]:
    """osapi.c RmCheckVersion, 535.179 and 550.90.12 (the same text in both)."""
    return (
        f"NVRM: API mismatch: the client has the version {client}, but\n"
        f"NVRM: this kernel module has the version {module}.  Please\n"
        "NVRM: make sure that this kernel module and all NVIDIA driver\n"
        "NVRM: components have the same version."
    ).split("\n")


def api_mismatch_r575(client: str, comm: str = "python3", module: str = "575.51.02") -> list[str]:
    """osapi.c RmCheckVersion from 575.51.02 on (the client's process name first)."""
    return (
        f"NVRM: API mismatch: the client '{comm}' (pid 4242)\n"
        f"NVRM: has the version {client}, but this kernel module has\n"
        f"NVRM: the version {module}.  Please make sure that this\n"
        "NVRM: kernel module and all NVIDIA driver components\n"
        "NVRM: have the same version."
    ).split("\n")


def framed(lines: list[str], framing: str) -> list[str]:
    """One record's lines as a log prints them."""
    if framing == "kmsg":
        return ["3,9001,512123456,-;" + "\\x0a".join(lines)]
    if framing == "dmesg":
        return ["[  512.123456] " + lines[0]] + [" " * 15 + line for line in lines[1:]]
    if framing == "dmesg-S":
        return ["[  512.123456] " + line for line in lines]
    if framing == "syslog":
        return ["Nov 27 10:00:00 gpu7 kernel: [  512.123456] " + line for line in lines]
    if framing == "journalctl":
        head = "Nov 27 10:00:00 gpu7 kernel: "
        return [head + lines[0]] + [" " * len(head) + line for line in lines[1:]]
    raise AssertionError(framing)


FRAMINGS = ["kmsg", "dmesg", "dmesg-S", "syslog", "journalctl"]
#: what a client names its version: a driver line's text, or a newline and a whole driver line
CLIENT_STRINGS = {
    "gpu-lost-text": FAKE_LOST,
    "newline-xid79": "x\n" + FAKE_79,
    "newline-init-failed": "\nNVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
    "newline-lockup": "\n" + FAKE_LOCKUP,
    "newline-forged-time": "\n[999.1] NVRM: Xid (PCI:0000:18:00): 79, x",
    "newline-forged-end": "\nNVRM: have the same version.\n" + FAKE_79[:30],
}


def records(lines: list[str]) -> list[LogRecord]:
    """Lines of a file, as FileKernelLog makes records of them."""
    out = []
    for i, line in enumerate(lines):
        record = _parse_kmsg_record(line) if line[:1].isdigit() and ";" in line else None
        out.append(LogRecord(i + 1, line) if record is None else record)
    return out


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("client", sorted(CLIENT_STRINGS))
@pytest.mark.parametrize("form", [api_mismatch_r535, api_mismatch_r575])
def test_api_mismatch_record_is_never_a_source_in_any_framing(form, client, framing):
    assert len(CLIENT_STRINGS[client]) <= 63  # NV_RM_API_VERSION_STRING_LENGTH less its NUL
    lines = framed(form(CLIENT_STRINGS[client]), framing)
    genuine = framed([GENUINE_13], framing)
    got = scan(records(lines + genuine))
    assert [(e.code, e.pci_bus) for e in got] == [(13, "0000:3b:00")]  # the control only
    assert scan_distress(records(lines)) == []


def test_the_old_reader_found_gpu_lost_in_the_api_mismatch_line():
    """What the attack relied on: the version string holds the driver's status text whole."""
    (first, *_) = api_mismatch_r535(FAKE_LOST)
    assert "[NV_ERR_GPU_IS_LOST]" in first and parse_driver_line(first) is None
    assert refusal(first) is not None and kernel_message(first) is None


def test_a_record_after_an_api_mismatch_record_with_another_time_is_read():
    lines = framed(api_mismatch_r535("x\n" + FAKE_79), "dmesg-S")
    lines.append("[  513.000001] " + GENUINE_13)
    assert [e.code for e in scan_lines(lines)] == [13]


NETFILTER_TAIL = (
    "IN=eth0 OUT= MAC=52:54:00:12:34:56:52:54:00:65:43:21:08:00 SRC=10.0.0.2 DST=10.0.0.1 "
    "LEN=60 TOS=0x00 PREC=0x00 TTL=64 ID=54321 DF PROTO=TCP SPT=40000 DPT=22 WINDOW=64240 "
    "RES=0x00 SYN URGP=0 "
)
NETFILTER_PREFIXES = {
    "xid79": "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus. ",
    "xid79-no-blank": "NVRM: Xid (PCI:0000:18:00): 79, x",
    "gpu-lost": "NVRM: GPU 0000:18:00.0: nvCheckOkFailedNoLog: Check failed: " + FAKE_LOST + " ",
    "sxid": "nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up ",
    "aer": "nvidia 0000:18:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), ",
    "soft-lockup": FAKE_LOCKUP + " ",
    "fs-readonly": "EXT4-fs (nvme0n1p1): Remounting filesystem read-only ",
}


@pytest.mark.parametrize("framing", ["kmsg", "dmesg", "syslog", "journalctl"])
@pytest.mark.parametrize("prefix", sorted(NETFILTER_PREFIXES))
def test_netfilter_log_record_is_never_a_source_whatever_it_starts_with(prefix, framing):
    (line,) = framed([NETFILTER_PREFIXES[prefix] + NETFILTER_TAIL], framing)
    assert scan(records([line])) == []
    assert scan_distress(records([line])) == []
    assert parse_distress(line) is None and kernel_message(line) is None


@pytest.mark.parametrize(
    "line",
    [
        # ebtables' ebt_log: "%s IN=%s OUT=%s MAC source = ..."
        "[ 600.1] " + FAKE_79 + " IN=br0 OUT=eth1 MAC source = 52:54:00:12:34:56 MAC dest = "
        "ff:ff:ff:ff:ff:ff proto = 0x0800",
        # a prefix with a newline in it: the tail is on the record's second line
        "4,9002,600000001,-;" + FAKE_79 + "\\x0a" + NETFILTER_TAIL,
        # a packet that left through no interface: IN= and OUT= both empty
        "[ 600.2] " + FAKE_LOCKUP + " IN= OUT= SRC=10.0.0.2 DST=10.0.0.1 LEN=60",
    ],
)
def test_netfilter_log_forms_of_ebtables_and_a_newline_prefix_are_refused(line):
    assert scan(records([line])) == []
    assert scan_distress(records([line])) == []


def test_a_firewall_log_of_the_real_kind_is_no_finding():
    """UFW's prefix, as a node with a host firewall logs every blocked packet."""
    line = "[ 1234.5] [UFW BLOCK] " + NETFILTER_TAIL
    assert refusal(line.split("] ", 1)[1]) is not None
    assert scan_lines([line]) == []


@pytest.mark.parametrize(
    "line",
    [
        # the status name in another sentence, or not at the start of the driver's message
        "NVRM: GPU5 client said GPU lost from the bus [NV_ERR_GPU_IS_LOST] (0x0000000F)",
        "NVRM: something: Check failed: GPU lost from the bus [NV_ERR_GPU_IS_LOST]",
        "NVRM: osInitNvMapping: NV_ERR_GPU_IS_LOST",
        # the name, its text and its code must agree
        "NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: Reset required [NV_ERR_GPU_IS_LOST] "
        "(0x0000000F)",
        "NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
        "[NV_ERR_GPU_IS_LOST] (0x00000062)",
        # RmInitAdapter only in osinit.c's own form, whole
        "NVRM: RmInitAdapter: osInitNvMapping failed, bailing out of RmInitAdapter",
        "NVRM: the client says RmInitAdapter failed! (0x24:0x72:1568)",
        "NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568) and more",
    ],
)
def test_nv_err_and_rminitadapter_are_read_only_in_the_drivers_own_forms(line):
    assert parse_driver_line(line) is None


@pytest.mark.parametrize(
    "line, kind",
    [
        # a real report's form (open-gpu-kernel-modules#1151, driver 595.71.05)
        (
            "May 27 16:50:10 fedora kernel: NVRM: GPU 0000:09:00.0: RmInitAdapter failed! "
            "(0x22:0x56:894)",
            "init-failed",
        ),
        (
            "NVRM: GPU 0000:b3:00.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
            "[NV_ERR_GPU_IS_LOST] (0x0000000F) returned from pRmApi->Control(...) @ rs_client.c:42",
            "gpu-lost",
        ),
    ],
)
def test_the_drivers_own_forms_are_still_read(line, kind):
    event = parse_driver_line(line)
    assert event is not None and event.kind == kind and event.pci_bus is not None


# -- a saved journal export too large to read whole -------------------------------------------


def journal_export(path, message_blocks: int) -> None:
    """A root-owned ``journalctl -o export`` file: one kernel entry, then a user's entry whose
    multi-line MESSAGE (a binary field: name, 64-bit length, bytes) repeats entries that look
    like the kernel's Xid 79."""
    forged = (
        b"\n\n__CURSOR=s=x\n_TRANSPORT=kernel\nSYSLOG_FACILITY=0\nMESSAGE="
        + FAKE_79.encode()
        + b"\n\n"
    )
    message = forged * message_blocks
    path.write_bytes(
        b"__CURSOR=s=1\n_TRANSPORT=kernel\nSYSLOG_FACILITY=0\nMESSAGE=Linux version 6.1.0\n\n"
        b"__CURSOR=s=2\n_TRANSPORT=journal\n_UID=1001\nSYSLOG_IDENTIFIER=user\nMESSAGE\n"
        + struct.pack("<Q", len(message))
        + message
        + b"\n\n"
    )
    path.chmod(0o600)


def test_a_users_binary_message_in_a_journal_export_is_data_when_read_whole(tmp_path):
    journal_export(tmp_path / "kernel.export", message_blocks=3)
    records = FileKernelLog(str(tmp_path / "kernel.export")).read()
    assert [r.text for r in records] == ["Linux version 6.1.0"]


def test_a_journal_export_too_large_to_read_whole_is_refused_not_read_from_its_tail(tmp_path):
    """Read from its tail, the first line break could fall inside the user's message and make
    its forged entries the kernel's: the file is refused, saying how to read it instead."""
    path = tmp_path / "kernel.export"
    journal_export(path, message_blocks=FILE_READ_BYTES // 100 + 2)
    assert path.stat().st_size > FILE_READ_BYTES
    with pytest.raises(OSError, match="cannot be read from its tail.*--since"):
        FileKernelLog(str(path)).read()
