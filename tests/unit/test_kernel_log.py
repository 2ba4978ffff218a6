"""Kernel-log lines in the drivers' real forms: Xids (MIG, NVLink 5, 154, old formats, any PCI
domain, any log prefix), SXids, the three-line "fallen off the bus" without an Xid; a line that
names an Xid but cannot be read is refused with the reason; garbage never crashes.

The real samples are read from ``../shared/realworld/xid/`` (provenance in its PROVENANCE.md);
where that folder is absent the sample tests skip and say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.kernel_log import (
    DriverLine,
    KernelLogScanner,
    LinesKernelLog,
    LogRecord,
    Stamp,
    SxidLine,
    Unreadable,
    XidLine,
    _parse_kmsg_record,
    journal_records,
    kernel_message,
    line_stamp,
    normalise_bus,
    parse_line,
    parse_xid_line,
    scan,
    scan_lines,
)

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "realworld" / "xid"
needs_samples = pytest.mark.skipif(
    not SAMPLES.is_dir(), reason=f"real kernel-log samples not found at {SAMPLES}"
)


def sample(prefix: str) -> list[str]:
    (path,) = SAMPLES.glob(prefix + "_*.log")
    return path.read_text().splitlines()


def events(prefix: str):
    return scan_lines(sample(prefix))


def summary(event):
    if isinstance(event, XidLine):
        return ("xid", event.code, event.pci_bus)
    if isinstance(event, SxidLine):
        return ("sxid", event.code, event.target)
    if isinstance(event, DriverLine):
        return ("driver", event.kind, event.pci_bus)
    return ("unreadable", event.code, event.reason)


# What each real sample says, line by line in log order: (kind, code, GPU bus / NVSwitch).
EXPECTED = {
    "x01": [("xid", 119, "0000:9b:00")] * 5,  # the GSP RPC history lines around them are not Xids
    "x02": [],  # raw kmsg records, nvswitch open / IPv6: nothing
    "x03": [],  # nvidia-peermem errors: not Xids
    "x04": [
        ("xid", 79, "0000:91:00"),
        ("sxid", 20034, "nvswitch:1"),
        ("sxid", 20034, "nvswitch:0"),
        ("sxid", 20034, "nvswitch:2"),
        ("sxid", 20034, "nvswitch:0"),
        ("sxid", 20034, "nvswitch:2"),
        ("sxid", 20034, "nvswitch:0"),
        ("sxid", 20034, "nvswitch:2"),
        ("sxid", 20034, "nvswitch:0"),
    ],
    "x05": [
        ("xid", 149, "0018:01:00"),
        ("xid", 145, "0018:01:00"),
        ("xid", 145, "0019:01:00"),
        ("xid", 149, "0008:01:00"),
        ("xid", 145, "0019:01:00"),
        ("xid", 149, "0019:01:00"),
        ("xid", 145, "0008:01:00"),
        ("xid", 145, "0008:01:00"),
        ("xid", 145, "0018:01:00"),
        ("xid", 145, "0008:01:00"),
        ("xid", 149, "0008:01:00"),
        ("xid", 149, "0008:01:00"),
        ("xid", 149, "0018:01:00"),
        ("xid", 149, "0018:01:00"),
    ],
    "x06": [
        ("xid", 149, "0009:01:00"),
        ("xid", 154, "0009:01:00"),
        ("xid", 149, "0008:01:00"),
        ("xid", 154, "0019:01:00"),
        ("xid", 149, "0009:01:00"),
        ("xid", 149, "0009:01:00"),
        ("xid", 149, "0008:01:00"),
        ("xid", 154, "0018:01:00"),
        ("xid", 154, "0008:01:00"),
    ],
    "x07": [("xid", 13, "0000:cb:00")] * 3 + [("xid", 109, "0000:cb:00")],
    "x08": [
        ("xid", 43, "0000:00:05"),
        ("xid", 43, "0000:00:05"),
        ("xid", 31, "0000:00:07"),
        ("xid", 94, "0000:00:08"),
    ],
    "x09": [
        ("xid", 79, "0000:a1:00")
    ],  # the "GPU has fallen off the bus" line after it: same event
    "x10": [
        ("xid", 45, b)
        for b in (
            "0000:dc:00",
            "0000:ed:00",
            "0000:ba:00",
            "0000:97:00",
            "0000:dc:00",
            "0000:ba:00",
            "0000:ed:00",
        )
    ],
    "x11": [
        ("driver", "init-failed", "0000:0a:00"),
        ("xid", 48, "0000:07:00"),
        ("xid", 64, "0000:07:00"),
        ("driver", "init-failed", "0000:0a:00"),
    ],
    "x12": [("xid", 119, "0000:01:00")],  # "_kgspLogXid119:" lines are function names
    "x13": [("xid", 32, "0000:01:00"), ("xid", 32, "0000:01:00"), ("xid", 31, "0000:01:00")],
    "x14": [
        ("xid", 32, "0000:01:00"),
        ("xid", 69, "0000:01:00"),
        ("xid", 69, "0000:01:00"),
        ("xid", 62, "0000:01:00"),
    ],
    "x15": [
        ("xid", 13, "0000:00:05"),
        ("xid", 9, "0000:00:05"),
        ("xid", 9, "0000:00:05"),
        ("xid", 31, "0000:01:00"),
        ("xid", 31, "0000:01:00"),
        ("xid", 13, "0000:01:00"),
    ],
    # line 2 is an alert that quotes a syslog line in its middle: not the kernel's message
    "x16": [("xid", 63, "0000:10:1c")],
    "x17": [("xid", 79, "0000:01:00"), ("xid", 154, "0000:01:00")],
    "x18": [
        ("xid", 51, "0000:0d:00"),
        ("xid", 154, "0000:0d:00"),
        ("driver", "reset-required", None),
    ],  # "NVRM: GPU0 ...": the driver's number, no bus
    "x19": [("xid", 79, "0000:b3:00")],  # three lines, no Xid line
    "x20": [("sxid", 12028, "nvswitch:1")],
    "x21": [("xid", 119, "000f:01:00"), ("xid", 120, "000f:01:00")],
    "x22": [("xid", 95, "0000:37:00")],
    "x23": [("xid", 43, "0009:01:00")],
    "x24": [("xid", 94, "0000:01:00"), ("xid", 94, "0000:01:00"), ("xid", 95, "0000:01:00")],
    "x25": [("xid", 74, "0003:00:00")],
    "x26": [
        ("unreadable", 145, "the PCI address is not readable ('PCI:...'): the line names no GPU"),
        ("unreadable", 137, "the PCI address is not readable ('PCI:...'): the line names no GPU"),
    ],
}


@needs_samples
def test_every_real_sample_has_an_expectation():
    assert sorted(p.name[:3] for p in SAMPLES.glob("x*.log")) == sorted(EXPECTED)


@needs_samples
@pytest.mark.parametrize("prefix", sorted(EXPECTED))
def test_real_sample_reads_each_code_and_gpu_or_refuses_with_the_reason(prefix):
    assert [summary(e) for e in events(prefix)] == EXPECTED[prefix]


@needs_samples
def test_mig_xid_line_records_the_gpu_instance():
    mig, plain, _ = events("x24")
    assert (mig.code, mig.pci_bus, mig.gpu_instance, mig.compute_instance) == (
        94,
        "0000:01:00",
        5,
        None,
    )
    assert mig.pid == 7194 and mig.message.startswith("Contained: CE User Channel")
    assert plain.gpu_instance is None


def test_mig_line_with_a_compute_instance_reads_both():
    xid = parse_xid_line("NVRM: Xid (PCI:0000:01:00 GPU-I:02 GPU-CI:01): 43, pid=7, name=x, Ch 8")
    assert (xid.gpu_instance, xid.compute_instance, xid.code, xid.process) == (2, 1, 43, "x")


@needs_samples
def test_xid79_fallen_off_bus_without_xid_line_is_read_as_xid79():
    (event,) = events("x19")
    assert (event.code, event.pci_bus, event.origin) == (79, "0000:b3:00", "fallen-off-bus")
    assert event.stamp == Stamp("boot", 1843.308145)
    assert "10de:26b5" in event.message


def test_fallen_off_bus_as_one_kmsg_record_with_escaped_newlines_is_xid79():
    raw = (
        "3,1201,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) "
        "installed in this system has\\x0aNVRM: fallen off the bus and is not responding to "
        "commands.\n"
    )
    record = _parse_kmsg_record(raw)
    assert record.text.count("\n") == 2 and record.boot_s == pytest.approx(1843.308145)
    (event,) = scan([record])
    assert (event.code, event.pci_bus, event.stamp) == (
        79,
        "0000:b3:00",
        Stamp("boot", 1843.308145),
    )


def test_not_supported_gpu_message_is_not_fallen_off_the_bus():
    lines = [
        "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1b80)",
        "NVRM: installed in this system is not supported by the",
        "NVRM: NVIDIA 470.42 driver release.",
        "some other line",
    ]
    assert scan_lines(lines) == []


def test_fallen_off_line_alone_is_xid79_but_not_counted_twice_after_the_xid_line():
    after = [
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
        "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
    ]
    assert [e.code for e in scan_lines(after)] == [79]
    alone = scan_lines(["[ 10.0] NVRM: GPU 0000:02:00.0: GPU has fallen off the bus."])
    assert [(e.code, e.pci_bus, e.origin) for e in alone] == [(79, "0000:02:00", "fallen-off-bus")]


@needs_samples
def test_sxid_lines_name_the_nvswitch_severity_and_link():
    first, second, detail = events("x04")[1:4]
    assert (first.target, first.pci_bus, first.severity, first.link) == (
        "nvswitch:1",
        "0000:06:00.0",
        "Fatal",
        48,
    )
    assert (second.target, second.link) == ("nvswitch:0", 63)
    assert (detail.target, detail.severity, detail.link) == (
        "nvswitch:2",
        None,
        None,
    )  # "Severity 1 ..."


def test_sxid_line_without_colon_after_the_device_and_nonfatal_word():
    sxid = parse_line(
        "4,6010676,3561654626948,-;nvidia-nvswitch0 SXid (PCI:0000:06:00.0): 20009, "
        "Non-fatal, Link 04 RX Short Error Rate"
    )
    assert (sxid.code, sxid.target, sxid.severity, sxid.link) == (
        20009,
        "nvswitch:0",
        "Nonfatal",
        4,
    )


def test_sxid_line_in_a_user_facility_kmsg_record_is_not_believed():
    # prio 12 = facility 1 (user) << 3 | level 4: written to /dev/kmsg by a program
    assert (
        parse_line(
            "12,6010676,3561654626948,-;nvidia-nvswitch0: SXid (PCI:0000:06:00.0): "
            "20034, Fatal, Link 48 LTSSM Fault Up"
        )
        is None
    )


@needs_samples
def test_gb200_nvlink5_lines_read_unit_severity_status_and_link():
    ber, rxpipe = events("x05")[:2]
    assert (ber.unit, ber.severity, ber.link, ber.intrinfo, ber.error_status) == (
        "NETIR_BER_EVENT",
        "Nonfatal",
        3,
        0x00086226,
        0x1,
    )
    assert (rxpipe.pid, rxpipe.process, rxpipe.unit, rxpipe.error_status) == (
        876767,
        "ray::WorkerDict",
        "RLW_RXPIPE",
        0x8,
    )
    link_evt = events("x05")[11]
    assert (link_evt.unit, link_evt.severity, link_evt.decode_fields()["subcode"]) == (
        "NETIR_LINK_EVT",
        "Fatal",
        "000100",
    )


@needs_samples
def test_gb200_lines_with_extra_spaces_and_154_recovery_actions():
    evt, recovery = events("x06")[:2]
    assert (evt.unit, evt.severity, evt.decode_fields()["subcode"]) == (
        "NETIR_LINK_EVT",
        "Fatal",
        "100001",
    )
    assert recovery.recovery_action == "Drain and Reset"
    assert [
        e.recovery_action
        for e in events("x17") + events("x18")
        if isinstance(e, XidLine) and e.code == 154
    ] == ["OS Reboot", "PF FLR"]


@needs_samples
def test_xid45_names_the_xid_that_caused_it():
    assert {e.caused_by for e in events("x10")} == {145, 149}


@needs_samples
def test_gsp_function_names_containing_xid_are_not_xids():
    lines = [line for line in sample("x12") if "_kgspLogXid119" in line]
    assert lines and all(parse_line(line) is None for line in lines)


@needs_samples
def test_redacted_pci_address_is_refused_naming_the_reason_and_code():
    refused = events("x26")
    assert all(isinstance(e, Unreadable) for e in refused)
    assert [e.code for e in refused] == [145, 137]
    assert all("not readable" in e.reason and "PCI:..." in e.reason for e in refused)


@needs_samples
@pytest.mark.parametrize(
    "prefix, index, stamp",
    [
        ("x01", 0, Stamp("wall", 1740327858.0)),  # dmesg -T: [Sun Feb 23 16:24:18 2025]
        ("x07", 3, Stamp("wall", 1725018194.0)),  # dmesg --ctime
        ("x11", 1, Stamp("boot", 219.470994)),  # syslog with the kernel's [  219.47] time
        ("x20", 0, Stamp("wall", 1737801294.859532)),  # dmesg --time-format iso
        ("x06", 0, Stamp("boot", 171167.620236)),  # plain dmesg
    ],
)
def test_prefix_times_are_read(prefix, index, stamp):
    assert events(prefix)[index].stamp == stamp


def test_kmsg_header_in_a_saved_line_is_a_boot_time():
    assert line_stamp("6,3964,206764307,-;") == Stamp("boot", 206.764307)
    assert line_stamp("Dec  2 11:38:27 worker4 kernel: ") is None  # syslog: no year, not used


REAL_LINES = [
    # driver 535+ (pid and name)
    (
        "[ 4123.331842] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        79,
        "0000:3b:00",
    ),
    (
        "NVRM: Xid (PCI:0000:18:00): 13, pid=2791, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        13,
        "0000:18:00",
    ),
    # driver 450-470 form
    (
        "kernel: NVRM: Xid (PCI:0000:ab:00): 48, pid=1912, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
        48,
        "0000:ab:00",
    ),
    (
        "NVRM: Xid (PCI:0000:5d:00): 63, pid=0, Row Remapper: New row (0x00000000000d8da0) marked for remapping, reset gpu to activate.",
        63,
        "0000:5d:00",
    ),
    # no PCI: prefix, upper-case bus
    ("NVRM: Xid (0000:DB:00): 94, Contained ECC error.", 94, "0000:db:00"),
]


@pytest.mark.parametrize("line, code, bus", REAL_LINES)
def test_real_xid_lines_parse(line, code, bus):
    xid = parse_xid_line(line)
    assert xid is not None and (xid.code, xid.pci_bus) == (code, bus)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("NVRM: Xid (PCI:0000:3b:00", "truncated inside the address"),
        ("NVRM: Xid (PCI:0000:3b:00): ", "truncated: no code"),
        ("NVRM: Xid (PCI:zzzz:3b:00): 79, x", "not readable"),
        ("NVRM: Xid (PCI:0000:3b:00): seventy-nine", "no numeric code"),
    ],
)
def test_truncated_or_garbled_xid_lines_are_refused_with_the_reason(line, reason):
    assert parse_xid_line(line) is None
    refused = parse_line(line)
    assert isinstance(refused, Unreadable) and reason in refused.reason


@pytest.mark.parametrize(
    "line",
    [
        "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 12028, Non-fatal",  # an SXid is not a GPU Xid
        "",
        "\x00\xff NVRM: Xid",
        "Xid errors on instance: ip-26-0-146-100",
    ],
)
def test_lines_that_are_not_gpu_xids(line):
    assert parse_xid_line(line) is None


@given(st.text())
def test_no_input_crashes_the_parser(text):
    parse_line(text)
    parse_line("NVRM: Xid (PCI:0000:3b:00): " + text)
    parse_line("NVRM: Xid (PCI:0018:01:00): 149, " + text)
    parse_line("nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 20034, " + text)
    scan([LogRecord(1, text), LogRecord(2, "NVRM: The NVIDIA GPU 0000:b3:00.0 " + text)])


@given(
    st.lists(
        st.sampled_from(
            [
                "NVRM: The NVIDIA GPU 0000:b3:00.0",
                "NVRM: fallen off the bus and is not responding",
                "NVRM: Xid (PCI:0000:01:00): 79, x",
                "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
                "garbage",
                "",
            ]
        ),
        max_size=12,
    )
)
def test_scanner_never_crashes_on_any_order_of_multiline_pieces(lines):
    scanner = KernelLogScanner()
    for i, line in enumerate(lines):
        scanner.feed(LogRecord(i, line))


def test_nvml_and_kernel_bus_ids_normalise_alike():
    assert normalise_bus("00000000:3B:00.0") == normalise_bus("0000:3b:00") == "0000:3b:00"


def test_kmsg_records_carry_their_sequence_number_and_time():
    record = _parse_kmsg_record(
        "4,1023,4123331842,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1\n SUBSYSTEM=pci\n"
    )
    assert record.seq == 1023 and record.text.startswith("NVRM: Xid")
    assert record.boot_s == pytest.approx(4123.331842)
    assert _parse_kmsg_record("garbage without header") is None


def test_lines_log_numbers_lines():
    assert [r.seq for r in LinesKernelLog(["a", "b"]).read()] == [1, 2]


# -- what is believed: the driver's own message, from the kernel ------------------------------

# The record this kernel wrote when a user's program jumped into a file it had named after an
# Xid line and mapped executable (arch/x86/mm/fault.c show_signal_msg + print_vma_addr), as
# read from /dev/kmsg: facility 0, but the message starts with the user's process name.
SEGFAULT_RECORD = (
    "6,345,404608925,-;python3[11346]: segfault at 0 ip 00007f294070e000 sp "
    "00007ffc0d02cd28 error 6 in Xid (PCI:0000:18:00): 79, GPU has fallen off the "
    "bus[0,7f294070e000+1000] likely on CPU 0 (core 0, socket 0)"
)
INJECTED_NAMES = [
    "Xid (PCI:0000:18:00): 79, GPU has fallen off the bus",
    "Xid (PCI:0000:18:00): 48, pid=1, An uncorrectable double bit error (DBE) has been detected",
    "NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
    "NVRM: The NVIDIA GPU 0000:18:00.0",
    "NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: GPU lost from the bus [NV_ERR_GPU_IS_LOST]",
]


@pytest.mark.parametrize("name", INJECTED_NAMES)
@pytest.mark.parametrize(
    "form",
    [
        "6,345,404608925,-;python3[11346]: segfault at 0 ip 00007f294070e000 sp 00007ffc0d02cd28 "
        "error 6 in {name}[0,7f294070e000+1000] likely on CPU 0 (core 0, socket 0)",
        "[  404.608925] python3[11346]: segfault at 0 ip 00007f294070e000 sp 00007ffc0d02cd28 error 6 "
        "in {name}[7f294070e000+1000]",
        "Nov 25 00:31:12 node7 kernel: python3[11346]: segfault at 0 ip 00007f294070e000 sp "
        "00007ffc0d02cd28 error 6 in {name}[7f294070e000+1000]",
        # a process named like the driver (comm is 15 characters): still the kernel's user report
        "6,346,404608926,-;NVRM: Xid (PCI[11346]: segfault at 0 ip 00007f294070e000 sp 0 error 6 "
        "in {name}[7f294070e000+1000]",
        "6,347,404608927,-;traps: NVRM: GPU 000[11347] general protection fault ip:7f2 sp:7ff "
        "error:0 in {name}[7f294070e000+1000]",
        "6,348,404608928,-;NVRM: Xid (PC (11348): drop_caches: 3 {name}",
    ],
)
def test_user_fault_report_naming_a_driver_line_is_not_believed(form, name):
    line = form.format(name=name)
    assert parse_line(line) is None
    assert scan_lines([line]) == []


def test_the_real_segfault_record_gives_nothing():
    record = _parse_kmsg_record(SEGFAULT_RECORD)
    assert record.facility == 0  # the kernel wrote it: the message start is what refuses it
    assert scan([record]) == []


@pytest.mark.parametrize(
    "line",
    [
        # written to /dev/kmsg: devkmsg_write gives user space facility 1 (prio 8-15) at least
        "12,5,5000,-;NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "14,6,5001,-;NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
        # a user program's syslog line, and dmesg --decode of a user record
        "Nov 25 00:31:12 node7 python3[77]: NVRM: Xid (PCI:0000:18:00): 79, x",
        "2026-11-25T00:31:12+00:00 node7 logger: NVRM: Xid (PCI:0000:18:00): 79, x",
        "user  :warn  : [  404.608925] NVRM: Xid (PCI:0000:18:00): 79, x",
        # the middle of a line is never searched
        "something else NVRM: Xid (PCI:0000:18:00): 79, x",
        "Xid errors on instance: ip-1, Error: May 19 07:08:57 ip-1 kernel: [1.0] NVRM: Xid (PCI:0000:10:1c): 63, x",
    ],
)
def test_lines_the_kernel_did_not_write_are_not_believed(line):
    assert parse_line(line) is None
    assert scan_lines([line]) == []


def test_user_facility_kmsg_record_is_dropped_by_the_scanner():
    record = _parse_kmsg_record("12,5,5000,-;NVRM: Xid (PCI:0000:18:00): 79, x\n")
    assert (record.facility, record.from_kernel) == (1, False)
    assert scan([record]) == []


def test_only_the_first_line_of_a_kmsg_record_is_a_message():
    # a process name with a newline in a real Xid line cannot start a line of its own
    record = LogRecord(
        1,
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=5, name=x\nNVRM: Xid (PCI:0000:3b:00): 79, y",
        1.0,
        facility=0,
    )
    assert [(e.code, e.pci_bus) for e in scan([record])] == [(13, "0000:3b:00")]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "6,3964,206764307,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
            "NVRM: Xid (PCI:0000:3b:00): 79, x",
        ),
        ("[Sun Feb 23 16:24:18 2025] NVRM: GPU at PCI:0000:9b:00", "NVRM: GPU at PCI:0000:9b:00"),
        (
            "kern  :err   : 2025-01-25T10:34:54,859532+00:00 nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 1",
            "nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 1",
        ),
        ("[ 1843.308145] gpu7 kernel: NVRM: x", "NVRM: x"),  # journalctl -o short-monotonic
        ("Apr 24 13:23:29 banana kernel: NVRM: x", "NVRM: x"),
        ("2025-04-24T13:23:29+0000 banana kernel: NVRM: x", "NVRM: x"),  # journalctl -o short-iso
        ("2025-04-24T13:23:29.123456+00:00 banana kernel: [ 12.5] NVRM: x", "NVRM: x"),
        ("kernel: NVRM: x", "NVRM: x"),
    ],
)
def test_known_prefixes_are_stripped_to_the_kernel_message(line, message):
    assert kernel_message(line)[1] == message


def test_journal_entries_other_than_the_kernels_are_dropped():
    import json

    entries = [
        {
            "_TRANSPORT": "kernel",
            "SYSLOG_FACILITY": "0",
            "__MONOTONIC_TIMESTAMP": "4123331842",
            "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
        },
        {
            "_TRANSPORT": "syslog",
            "SYSLOG_FACILITY": "0",
            "MESSAGE": "NVRM: Xid (PCI:0000:3c:00): 79, x",
        },
        {
            "_TRANSPORT": "kernel",
            "SYSLOG_FACILITY": "1",
            "MESSAGE": "NVRM: Xid (PCI:0000:3d:00): 79, x",
        },
        {"_TRANSPORT": "kernel", "MESSAGE": list(b"NVRM: Xid (PCI:0000:3e:00): 48, x")},
    ]
    records = journal_records("\n".join(json.dumps(e) for e in entries) + "\nnot json\n")
    assert [(e.code, e.pci_bus) for e in scan(records)] == [(79, "0000:3b:00"), (48, "0000:3e:00")]
    assert records[0].boot_s == pytest.approx(4123.331842)


# -- the driver's lines without an Xid, and PCIe AER ------------------------------------------


@pytest.mark.parametrize(
    "line, kind, bus, gpu_n, status",
    [
        # NVIDIA open-gpu-kernel-modules: NV_ASSERT_OK / NV_CHECK_OK print "Assertion failed: <status
        # string> [<name>] (0x%08x)" (src/nvidia/inc/kernel/core/prelude.h, nvAssertOkFailedNoLog),
        # the string and name from src/common/sdk/nvidia/inc/nvstatuscodes.h (NV_ERR_RESET_REQUIRED
        # 0x62 "Reset required"; NV_ERR_GPU_IS_LOST 0xf "GPU lost from the bus"); the lines as quoted
        # in ../shared/realworld/xid/x18 and public reports (open-gpu-kernel-modules#916)
        (
            "NVRM: GPU0 nvAssertOkFailedNoLog: Assertion failed: Reset required [NV_ERR_RESET_REQUIRED] "
            "(0x00000062) returned from status @ kernel_channel.c:2874",
            "reset-required",
            None,
            0,
            0x62,
        ),
        (
            "[  921.6] NVRM: nvCheckOkFailedNoLog: Check failed: Reset required [NV_ERR_RESET_REQUIRED] "
            "(0x00000062)",
            "reset-required",
            None,
            None,
            0x62,
        ),
        (
            "NVRM: GPU5 nvCheckOkFailedNoLog: Check failed: GPU lost from the bus [NV_ERR_GPU_IS_LOST] "
            "(0x0000000F) returned from pRmApi->Free",
            "gpu-lost",
            None,
            5,
            0xF,
        ),
        (
            "NVRM: GPU 0000:b3:00.0: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
            "[NV_ERR_GPU_IS_LOST] (0x0000000F)",
            "gpu-lost",
            "0000:b3:00",
            None,
            0xF,
        ),
        # src/nvidia/arch/nvalloc/unix/src/osinit.c, RmInitAdapter: "RmInitAdapter failed! (0x%x:0x%x:%d)"
        # (status, RM init step, line), printed under the GPU's bus id (x11)
        (
            "Dec  2 11:38:46 worker4 kernel: [  218.250408] NVRM: GPU 0000:0a:00.0: RmInitAdapter "
            "failed! (0x24:0x72:1568)",
            "init-failed",
            "0000:0a:00",
            None,
            0x24,
        ),
        ("NVRM: RmInitAdapter failed! (0x62:0x65:2028)", "init-failed", None, None, 0x62),
    ],
)
def test_driver_lines_without_an_xid_are_read_with_the_gpu_they_name(
    line, kind, bus, gpu_n, status
):
    (event,) = scan_lines([line])
    assert isinstance(event, DriverLine)
    assert (event.kind, event.pci_bus, event.driver_gpu, event.status) == (kind, bus, gpu_n, status)


# Linux drivers/pci/pcie/aer.c: aer_print_port_info ("AER: Uncorrected (Fatal) error received:
# <bdf>"; "Uncorrectable ... message received from" on 6.10 and later) and aer_print_error
# (pci_err(dev, "PCIe Bus Error: severity=%s, type=%s, (%s)"), the device's driver name in front);
# drivers/pci/pcie/err.c pcie_do_recovery: pci_info(bridge, "device recovery failed") under
# dev_fmt "AER: ".
AER_FATAL = [
    "[ 3182.43] pcieport 0000:17:00.0: AER: Uncorrected (Fatal) error received: 0000:18:00.0",
    "[ 3182.43] nvidia 0000:18:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
    "type=Transaction Layer, (Receiver ID)",
    "[ 3182.43] nvidia 0000:18:00.0:   device [10de:2330] error status/mask=00040000/00000000",
    "[ 3182.43] nvidia 0000:18:00.0:    [18] MalfTLP                (First)",
    "[ 3182.67] pcieport 0000:17:00.0: AER: Root Port link has been reset",
    "[ 3182.67] pcieport 0000:17:00.0: AER: device recovery failed",
]


def test_aer_uncorrectable_then_failed_recovery_names_the_device_not_the_port():
    error, failed = scan_lines(AER_FATAL)
    assert (error.kind, error.pci_bus, error.severity, error.device_driver) == (
        "aer-uncorrectable",
        "0000:18:00",
        "Fatal",
        "nvidia",
    )
    assert (failed.kind, failed.pci_bus, failed.port) == (
        "aer-recovery-failed",
        "0000:18:00",
        "0000:17:00.0",
    )
    assert failed.stamp == Stamp("boot", 3182.67)


def test_aer_uncorrectable_spelling_of_newer_kernels_and_nonfatal():
    (event,) = scan_lines(
        [
            "nvidia 0000:18:00.0: PCIe Bus Error: severity=Uncorrectable "
            "(Non-Fatal), type=Transaction Layer, (Requester ID)"
        ]
    )
    assert (event.kind, event.severity) == ("aer-uncorrectable", "Non-Fatal")


def test_aer_uncorrectable_with_the_aer_prefix_the_kernel_puts_in_front_of_it():
    """aer.c sets ``dev_fmt`` to "AER: ", so kernels print "<drv> <bdf>: AER: PCIe Bus Error"
    (github.com/NVIDIA/nvidia-docker/issues/1553); the xid check and the pcie_aer check read
    the same line through one parser (host/aer_lines.py) and cannot disagree on it."""
    (event,) = scan_lines(
        [
            "[1086487.61] nvidia 0000:65:00.0: AER: PCIe Bus Error: severity=Uncorrected "
            "(Fatal), type=Inaccessible, (Unregistered Agent ID)"
        ]
    )
    assert (event.kind, event.pci_bus, event.severity, event.device_driver) == (
        "aer-uncorrectable",
        "0000:65:00",
        "Fatal",
        "nvidia",
    )


def test_a_corrected_aer_error_is_no_driver_line():
    assert (
        scan_lines(
            [
                "pcieport 0000:00:01.1: AER: PCIe Bus Error: severity=Corrected, "
                "type=Data Link Layer, (Receiver ID)"
            ]
        )
        == []
    )


def test_aer_recovery_failed_without_an_uncorrectable_error_before_it_names_no_device():
    assert scan_lines(["pcieport 0000:17:00.0: AER: device recovery failed"]) == []


def test_aer_correctable_errors_are_not_read():
    assert (
        scan_lines(
            [
                "nvidia 0000:18:00.0: PCIe Bus Error: severity=Corrected, type=Physical "
                "Layer, (Receiver ID)"
            ]
        )
        == []
    )
