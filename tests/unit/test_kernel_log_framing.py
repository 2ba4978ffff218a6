"""The framing grammar (issue 37): the kernel's message is read in every framing a log prints
around it, belief comes from the source, and a user's text cannot become a message by looking
like a prefix.

The framings are built from the printers' documented formats (the real samples are in
tests/data/realworld/kernel_log/ and ../shared/realworld/xid/): dmesg's ``--time-format``s,
``--decode`` and the printk caller (``CONFIG_PRINTK_CALLER``: ``[ T1946]``, ``[ C3]``; SUSE
prints it with no blank, microsoft/lisa#3769), syslog (RFC 3164 with any month name: journalctl
and rsyslog print the locale's, with or without a host; RFC 5424; OpenWrt's ``logread``), the
journal's short outputs (journalctl(1)), Talos' ``talosctl dmesg`` (siderolabs/talos#7043), a
tool that quotes the message, and the journal's ``-o export`` / ``-o verbose`` (systemd's
JOURNAL_EXPORT_FORMATS).
"""

from __future__ import annotations

import json

import pytest

from node_agent.kernel_log import XidLine, file_records, frame, scan, scan_lines
from node_agent.kernel_log_distress import scan_distress

XID79 = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)
LOCKUP = "watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [kworker:311]"

#: framing -> the line it prints around a kernel message
FRAMINGS = {
    "kmsg": "3,100,1843308145,-;{m}",
    "dmesg": "[ 1843.308145] {m}",
    "dmesg-caller-task": "[ 1843.308145] [ T1946] {m}",
    "dmesg-caller-cpu": "[ 1843.308145] [     C3] {m}",
    "dmesg-caller-no-blank": "[ 1843.308145][ T1946] {m}",
    "dmesg-ctime": "[Sun Feb 23 16:24:18 2025] {m}",
    "dmesg-ctime-german": "[So Feb 23 16:24:18 2025] {m}",
    "dmesg-human": "[Feb23 16:24] {m}",
    "dmesg-human-delta": "[  +0.000012] {m}",
    "dmesg-delta": "[ 1843.308145 <    0.000012>] {m}",
    "dmesg-iso": "2025-01-25T10:34:54,859532+00:00 {m}",
    "dmesg-decode": "kern  :err   : [ 1843.308145] {m}",
    "syslog": "Dec  2 11:38:27 worker4 kernel: [ 1843.308145] {m}",
    "syslog-caller": "Dec  2 11:38:27 worker4 kernel: [ 1843.308145] [ T1946] {m}",
    "syslog-german": "Dez  2 11:38:27 worker4 kernel: {m}",
    "syslog-french": "déc. 02 11:38:27 worker4 kernel: {m}",
    "syslog-russian": "дек 02 11:38:27 worker4 kernel: {m}",
    "syslog-japanese": "12月 02 11:38:27 worker4 kernel: {m}",
    "syslog-no-host": "Dec  2 11:38:27 kernel: {m}",
    "syslog-pri": "<3>Dec  2 11:38:27 worker4 kernel: {m}",
    "rfc5424": "<3>1 2024-12-02T11:38:27.123456+00:00 worker4 kernel - - - {m}",
    "rfc3339": "2024-12-02T11:38:27.123456+00:00 worker4 kernel: {m}",
    "journal-short-precise": "Dec 02 11:38:27.123456 worker4 kernel: {m}",
    "journal-short-full": "Mon 2024-12-02 11:38:27 UTC worker4 kernel: {m}",
    "journal-short-unix": "1733139507.123456 worker4 kernel: {m}",
    "journal-short-monotonic": "[ 1843.308145] worker4 kernel: {m}",
    "logread": "Mon Dec  2 11:38:27 2024 kern.err kernel: [ 1843.308145] {m}",
    "talos": "10.20.30.29: kern:     err: [2024-12-02T11:38:27.123456789Z]: {m}",
    "quoted": "{q}",
    "quoted-logfmt": "msg={q}",
}
#: the same framings with another writer: never a source
OTHER_WRITERS = {
    "kmsg-user-facility": "12,100,1843308145,-;{m}",
    "syslog-user-program": "Dec  2 11:38:27 worker4 python3[77]: {m}",
    "syslog-no-host-user-program": "Dec  2 11:38:27 python3[77]: {m}",
    "syslog-pri-user-facility": "<11>Dec  2 11:38:27 worker4 kernel: {m}",
    "rfc5424-user-facility": "<11>1 2024-12-02T11:38:27Z worker4 kernel - - - {m}",
    "rfc5424-user-program": "<3>1 2024-12-02T11:38:27Z worker4 python3 77 - - {m}",
    "rfc3339-user-program": "2024-12-02T11:38:27.123456+00:00 worker4 python3[77]: {m}",
    "journal-short-monotonic-user": "[ 1843.308145] worker4 python3[77]: {m}",
    "logread-user-facility": "Mon Dec  2 11:38:27 2024 user.err kernel: {m}",
    "talos-user-facility": "10.20.30.29: user: warning: [2024-12-02T11:38:27.123456789Z]: {m}",
    "dmesg-decode-user-facility": "user  :err   : [ 1843.308145] {m}",
}


def framed(framing: str, message: str, table=FRAMINGS) -> str:
    return table[framing].format(m=message, q=json.dumps(message))


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
def test_the_drivers_message_is_read_in_every_framing(framing):
    line = framed(framing, XID79)
    (event,) = scan_lines([line])
    assert isinstance(event, XidLine) and (event.code, event.pci_bus) == (79, "0000:3b:00")
    assert frame(line)[1] == XID79
    (lockup,) = scan_distress(scan_records([framed(framing, LOCKUP)]))
    assert lockup.kind == "soft_lockup"


def scan_records(lines):
    return file_records("\n".join(lines).encode())


@pytest.mark.parametrize("framing", sorted(OTHER_WRITERS))
def test_another_writer_in_the_same_framing_is_never_a_source(framing):
    assert scan_lines([framed(framing, XID79, OTHER_WRITERS)]) == []
    assert scan_distress(scan_records([framed(framing, LOCKUP, OTHER_WRITERS)])) == []


#: a user's process named after a framing and a driver line (the kernel keeps 15 characters):
#: what the kernel prints about its fault starts with that name
PREFIX_NAMES = [
    "[ T1] NVRM: Xid",
    "[ C3] NVRM: Xid",
    "[1.0] NVRM: Xid",
    "kernel: NVRM: X",
    "kern  :err   : ",
    '"NVRM: Xid (PCI',
    'msg="NVRM: Xid ',
    "host kernel: NV",
    "<3>NVRM: Xid (P",
    "x: kern: err: [",
]


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
@pytest.mark.parametrize("name", PREFIX_NAMES)
def test_a_process_named_like_a_prefix_cannot_make_its_fault_report_a_message(framing, name):
    """The kernel's report of the process's segfault, in a file named after a driver line."""
    report = (
        f"{name}[4242]: segfault at 0 ip 00007f294070e000 sp 00007ffc0d02cd28 error 6 in "
        "Xid (PCI:0000:18:00): 79, GPU has fallen off the bus[0,7f294070e000+1000]"
    )
    line = framed(framing, report)
    assert scan_lines([line]) == []
    assert scan_distress(scan_records([line])) == []


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
@pytest.mark.parametrize("prefix", ["[ T1] " + XID79, "kernel: " + XID79, json.dumps(XID79)])
def test_a_netfilter_prefix_shaped_like_a_framing_is_never_a_source(framing, prefix):
    line = framed(framing, prefix + " IN=eth0 OUT= MAC=52:54:00:12:34:56 SRC=10.0.0.2 LEN=60 ")
    assert scan_lines([line]) == []


def export_entry(transport: str, message: str, **fields: str) -> bytes:
    """One entry of ``journalctl -o export`` (a message with a newline is a binary field)."""
    head = f"__CURSOR=s=1;i=2\n__MONOTONIC_TIMESTAMP=1843308145\n_TRANSPORT={transport}\n"
    head += "".join(f"{k}={v}\n" for k, v in fields.items())
    if "\n" in message:
        data = message.encode()
        return head.encode() + b"MESSAGE\n" + len(data).to_bytes(8, "little") + data + b"\n\n"
    return (head + f"MESSAGE={message}\n\n").encode()


def test_journal_export_reads_the_kernels_message_and_believes_only_its_transport():
    data = (
        export_entry("kernel", XID79, SYSLOG_FACILITY="0", PRIORITY="3")
        # a user's program that calls itself "kernel": the transport says who wrote it
        + export_entry("syslog", XID79.replace("79", "48"), SYSLOG_IDENTIFIER="kernel")
        + export_entry("stdout", XID79.replace("79", "95"))
        + export_entry("kernel", XID79.replace("79", "13"), SYSLOG_FACILITY="1")
    )
    events = scan(file_records(data))
    assert [(e.code, e.stamp.seconds) for e in events] == [(79, 1843.308145)]


def test_journal_export_binary_message_keeps_a_records_lines_together():
    fallen = (
        "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system "
        "has\nNVRM: fallen off the bus and is not responding to commands."
    )
    mismatch = "NVRM: API mismatch: the client has the version x\n" + XID79 + ", but"
    data = export_entry("kernel", fallen) + export_entry("kernel", mismatch)
    assert [(e.code, e.pci_bus, e.origin) for e in scan(file_records(data))] == [
        (79, "0000:b3:00", "fallen-off-bus")
    ]


def test_journal_verbose_reads_the_kernels_entries_only():
    data = (
        "Mon 2024-12-02 11:38:27.123456 UTC [s=8a1f;i=4d2;b=77aa;m=6df0;t=62839;x=91b]\n"
        "    _TRANSPORT=kernel\n    PRIORITY=3\n    SYSLOG_FACILITY=0\n"
        f"    MESSAGE={XID79}\n"
        "Mon 2024-12-02 11:38:28.000001 UTC [s=8a1f;i=4d3;b=77aa;m=6df1;t=62840;x=91c]\n"
        "    _TRANSPORT=syslog\n    SYSLOG_IDENTIFIER=kernel\n"
        f"    MESSAGE={XID79.replace('79', '48')}\n"
    ).encode()
    assert [e.code for e in scan(file_records(data))] == [79]


def test_a_message_field_without_its_entry_is_no_source():
    """``MESSAGE=`` grepped out of an export, without ``_TRANSPORT`` beside it."""
    assert scan_lines([f"MESSAGE={XID79}"]) == []
