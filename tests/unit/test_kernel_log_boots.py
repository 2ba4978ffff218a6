"""A saved kernel log that spans boots (config ``kernel_log.path``: an rsyslog ``kern.log``, a
``journalctl -k`` of several boots) is read as this boot's, as ``/dev/kmsg`` is.

The audit's case: an Xid 79 logged before a GPU was replaced, in the ``kern.log`` the agent was
pointed at, graded the repaired node FAULT and sent it for a replacement on its first run; an
Xid a reboot cleared came back after every restart and escalated the node."""

from __future__ import annotations

from node_agent.kernel_log import FileKernelLog, scan

OLD_BOOT = [
    "Nov 20 03:01:02 gpu-07 kernel: [    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02)",
    "Nov 20 09:14:55 gpu-07 kernel: [22031.11] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, "
    "name=python3, GPU has fallen off the bus.",
]
NEW_BOOT = [
    "Nov 21 11:00:03 gpu-07 kernel: [    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02)",
    "Nov 21 11:00:41 gpu-07 kernel: [   38.20] nvidia-nvswitch: loading",
]
XID_NOW = (
    "Nov 21 12:30:00 gpu-07 kernel: [ 5435.00] NVRM: Xid (PCI:0000:2a:00): 48, pid=77, "
    "name=python3, An uncorrectable double bit error"
)


def read(tmp_path, lines):
    path = tmp_path / "kern.log"
    path.write_text("\n".join(lines) + "\n")
    return FileKernelLog(str(path)).read()


def codes(records):
    return [(e.code, e.pci_bus) for e in scan(records)]


def test_a_kern_log_of_several_boots_is_read_from_the_last_banner(tmp_path):
    records = read(tmp_path, OLD_BOOT + NEW_BOOT + [XID_NOW])
    assert records[0].text == NEW_BOOT[0]
    assert codes(records) == [(48, "0000:2a:00")]


def test_an_xid_of_an_earlier_boot_is_not_this_boots(tmp_path):
    assert codes(read(tmp_path, OLD_BOOT + NEW_BOOT)) == []


def test_a_log_that_shows_no_boot_is_read_whole(tmp_path):
    assert codes(read(tmp_path, OLD_BOOT[1:] + [XID_NOW])) == [
        (79, "0000:18:00"),
        (48, "0000:2a:00"),
    ]


def test_journalctl_text_of_several_boots_is_read_after_its_last_boot_line(tmp_path):
    lines = [
        OLD_BOOT[1].replace("gpu-07 kernel: [22031.11]", "gpu-07 kernel:"),
        "-- Boot 3f0e6a7b2c1d4e5f8a9b0c1d2e3f4a5b --",
        XID_NOW.replace("kernel: [ 5435.00]", "kernel:"),
    ]
    assert codes(read(tmp_path, lines)) == [(48, "0000:2a:00")]


def test_a_banner_a_user_logged_cuts_nothing(tmp_path):
    forged = "Nov 21 12:00:00 gpu-07 python3[4242]: Linux version 6.8.0 (me@here)"
    kmsg_write = "12,4001,5000000,-;Linux version 6.8.0 (me@here)"  # /dev/kmsg: facility 1
    assert codes(read(tmp_path, OLD_BOOT[1:] + [forged, kmsg_write])) == [(79, "0000:18:00")]
