"""XID lines from the kernel log in the driver's real formats; garbage never crashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.kernel_log import (
    LinesKernelLog,
    _parse_kmsg_record,
    normalise_bus,
    parse_xid_line,
)

REAL_LINES = [
    # driver 535+ (pid and name)
    ("[ 4123.331842] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     79, "0000:3b:00"),
    ("NVRM: Xid (PCI:0000:18:00): 13, pid=2791, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
     13, "0000:18:00"),
    # driver 450-470 form
    ("kernel: NVRM: Xid (PCI:0000:ab:00): 48, pid=1912, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
     48, "0000:ab:00"),
    ("NVRM: Xid (PCI:0000:5d:00): 63, pid=0, Row Remapper: New row (0x00000000000d8da0) marked for remapping, reset gpu to activate.",
     63, "0000:5d:00"),
    # no PCI: prefix, upper-case bus
    ("NVRM: Xid (0000:DB:00): 94, Contained ECC error.", 94, "0000:db:00"),
]


@pytest.mark.parametrize("line, code, bus", REAL_LINES)
def test_real_xid_lines_parse(line, code, bus):
    xid = parse_xid_line(line)
    assert xid is not None and (xid.code, xid.pci_bus) == (code, bus)


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:3b:00",           # truncated mid-bus
    "NVRM: Xid (PCI:0000:3b:00): ",        # truncated before the code
    "NVRM: Xid (PCI:zzzz:3b:00): 79, x",   # garbled bus
    "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 12028, Non-fatal",  # NVSwitch SXid is not a GPU Xid
    "",
    "\x00\xff NVRM: Xid",
])
def test_truncated_or_garbled_lines_are_not_xids(line):
    assert parse_xid_line(line) is None


@given(st.text())
def test_no_input_crashes_the_parser(text):
    parse_xid_line(text)
    parse_xid_line("NVRM: Xid (PCI:0000:3b:00): " + text)


def test_nvml_and_kernel_bus_ids_normalise_alike():
    assert normalise_bus("00000000:3B:00.0") == normalise_bus("0000:3b:00") == "0000:3b:00"


def test_kmsg_records_carry_their_sequence_number():
    record = _parse_kmsg_record("4,1023,4123331842,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1\n SUBSYSTEM=pci\n")
    assert record.seq == 1023 and record.text.startswith("NVRM: Xid")
    assert _parse_kmsg_record("garbage without header") is None


def test_lines_log_numbers_lines():
    assert [r.seq for r in LinesKernelLog(["a", "b"]).read()] == [1, 2]
