"""The host checks' parsers on the real output forms of ipmitool and nvme-cli.

Provenance of each form is named beside it:
- ipmitool: the line layout of ``sdr type``/``sdr elist`` is ipmitool's own format
  (``lib/ipmi_sdr.c``: ``"%-16s | %02Xh | %-3s | %2d.%1d | "`` then the asserted states joined by
  ``", "``), its state words those of ``include/ipmitool/ipmi_sel.h``; the sample lines are the
  forms public reports show (cited per test).
- nvme-cli: the JSON keys and their types per version come from ``json_smart_log`` in nvme-cli's
  ``nvme-print.c`` (1.x) / ``nvme-print-json.c`` (2.x), and the uint128 string episode from its
  commits a1fe475 (v2.2, Sept 2022) and 134ea78 (v2.4, "util: Revert JSON output to plain
  numbers"); smartctl's spelling from smartmontools' JSON output.
"""

from __future__ import annotations

import json

import pytest

from node_agent.host.aer_lines import parse_aer_message
from node_agent.host.ghes import parse_ghes
from node_agent.parsers import ParseError
from node_agent.parsers.ipmitool import judge_psus, no_bmc_reason, parse_sdr
from node_agent.parsers.nvme import parse_smart_log, parse_smartctl_json
from node_agent.parsers.sel import parse_sel

# -- ipmitool ----------------------------------------------------------------------------------

# HP ProLiant (iLO 2) `ipmitool sdr elist full`, as shown in CollegeBoreal/Laboratoires
# (3202/proliant/IPMI/README.md): an analog reading followed by the discrete states, and a
# redundancy sensor after one supply failed.
PROLIANT_FAILED = """\
VRM 1            | 01h | ok  |  9.1 | Device Present
Power Supply 1   | 06h | ok  | 10.1 | 0 Watts, Presence detected, Failure detected
Power Supply 2   | 07h | ok  | 10.2 | 95 Watts, Presence detected
Power Supplies   | 08h | ok  | 10.3 | Non-Redundant: Sufficient from Redundant
Fan Block 1      | 09h | ok  |  7.1 | 21.56 percent, Transition to Running
"""

# A Supermicro-style board's `ipmitool sdr type 0x08` with its second supply not installed
# (a public ipmitool how-to's example session): the status sensor asserts nothing, the others
# give no reading, the redundancy sensor says non-redundant.
SECOND_PSU_ABSENT = """\
PSU1_STATUS      | 26h | ok  | 10.1 | Presence detected
PSU1_PWRGD       | 28h | ok  | 10.1 | State Asserted
PSU1_POUT        | 2Bh | ok  | 10.1 | 120 Watts
PSU2_STATUS      | 2Ch | ok  | 10.2 |
PSU2_PWRGD       | 2Eh | ns  | 10.2 | No Reading
PSU2_POUT        | 31h | ns  | 10.2 | No Reading
PS_RDNDNT_MODE   | ADh | ok  | 20.0 | Non-Redundant: Sufficient from Redundant
POWER_USAGE      | AEh | ok  |  7.0 | 128 Watts
"""

# Dell PowerEdge (iDRAC) `sdr elist`: both supplies' sensors are named "Status" (entities 10.1
# and 10.2), beside a CPU's "Status" (3.1) and a battery's "Presence Detected" (7.1).
DELL_ELIST = """\
PS Redundancy    | 77h | ok  |  7.1 | Fully Redundant
Status           | 81h | ok  |  3.1 | Presence detected
Status           | 85h | ok  | 10.1 | Presence detected
Status           | 86h | ok  | 10.2 | Presence detected
CMOS Battery     | 87h | ok  |  7.1 | Presence Detected
Status           | 53h | ns  | 11.6 | No Reading
Fan1 Status      | 3Eh | ok  |  7.1 |
"""


def test_proliant_failed_supply_is_failed_and_redundancy_lost():
    psus, redundancy = judge_psus(parse_sdr(PROLIANT_FAILED))
    verdicts = {p.psu: p.verdict for p in psus}
    assert verdicts == {"Power Supply 1": "failed", "Power Supply 2": "ok"}
    failed = next(p for p in psus if p.verdict == "failed")
    assert failed.states == ("Presence detected", "Failure detected")
    assert [(r.sensor, r.verdict) for r in redundancy] == [("Power Supplies", "lost")]


def test_status_sensor_asserting_nothing_is_an_absent_supply():
    psus, redundancy = judge_psus(parse_sdr(SECOND_PSU_ABSENT))
    assert {p.psu: p.verdict for p in psus} == {"PSU1": "ok", "PSU2": "absent"}
    assert redundancy[0].verdict == "lost"


def test_dell_supplies_both_named_status_are_named_by_entity_and_a_cpu_is_not_a_supply():
    psus, redundancy = judge_psus(parse_sdr(DELL_ELIST))
    assert sorted(p.psu for p in psus) == ["PS1", "PS2"]  # named by entity instance
    assert all(p.verdict == "ok" for p in psus)
    assert [r.verdict for r in redundancy] == ["redundant"]


def test_brief_form_with_hex_number_and_freeipmi_wording():
    # 0x07 as the number field and FreeIPMI's "Power Supply Failure detected" wording (as in
    # thomas-krenn/check_ipmi_sensor_v3 issue #26's SEL text)
    text = "PS1 Status | 0x07 | ok | 10.1 | Presence detected, Power Supply Failure detected\n"
    (psu,), _ = judge_psus(parse_sdr(text))
    assert (psu.psu, psu.verdict) == ("PS1", "failed")


def test_ac_out_of_range_but_present_stays_one_state_and_is_degraded():
    text = "PS2 Status       | C9h | ok  | 10.2 | Presence detected, AC out-of-range, but present\n"
    (row,) = parse_sdr(text)
    assert row.states == ("Presence detected", "AC out-of-range, but present")
    (psu,), _ = judge_psus([row])
    assert psu.verdict == "degraded"


def test_sdr_list_three_field_form_parses():
    # `ipmitool sdr list`, as in ipmitool/ipmitool issue #176
    rows = parse_sdr(
        "PS1 Status       | 0x00              | ok\nPS2 Status       | 0x00              | ok\n"
    )
    assert [(r.name, r.status, r.entity) for r in rows] == [
        ("PS1 Status", "ok", None),
        ("PS2 Status", "ok", None),
    ]


def test_a_malformed_sensor_line_is_refused():
    with pytest.raises(ParseError, match="fields"):
        parse_sdr("PS1 Status | C8h | ok | 10.1\n")


def test_no_bmc_device_is_recognised_from_ipmitool_stderr():
    # src/plugins/open/open.c
    stderr = (
        "Could not open device at /dev/ipmi0 or /dev/ipmi/0 or /dev/ipmidev/0: No such "
        "file or directory\n"
    )
    assert no_bmc_reason(stderr).startswith("Could not open device")
    assert no_bmc_reason("Invalid command\n") is None


# -- nvme-cli ---------------------------------------------------------------------------------


def _smart(**over):
    doc = {
        "critical_warning": 0,
        "temperature": 301,
        "avail_spare": 100,
        "spare_thresh": 5,
        "percent_used": 15,
        "endurance_grp_critical_warning_summary": 0,
        "data_units_read": 499296134,
        "data_units_written": 1474968593,
        "host_read_commands": 9347931143,
        "host_write_commands": 51493840602,
        "controller_busy_time": 1974546,
        "power_cycles": 290,
        "power_on_hours": 38313,
        "unsafe_shutdowns": 139,
        "media_errors": 0,
        "num_err_log_entries": 17,
        "warning_temp_time": 0,
        "critical_comp_time": 0,
    }
    doc.update(over)
    return doc


def test_nvme_cli_1x_and_2_4_plain_numbers():
    # 1.x printed its long doubles "%.0Lf" in nvme-cli's own JSON writer (" : " separators)
    text = json.dumps(_smart(), indent=2, separators=(",", " : "))
    log = parse_smart_log(text)
    assert (
        log.critical_warning,
        log.percent_used,
        log.avail_spare,
        log.spare_thresh,
        log.media_errors,
    ) == (0, 15, 100, 5, 0)
    assert log.warnings == [] and not log.media_warning


def test_nvme_cli_2_2_uint128_counters_as_strings():
    text = json.dumps(_smart(media_errors="12", data_units_read="499296134", critical_warning=4))
    log = parse_smart_log(text)
    assert log.media_errors == 12 and log.critical_warning == 4
    assert log.media_warning
    assert log.warnings == ["reliability degraded (media or internal errors)"]


def test_nvme_cli_verbose_critical_warning_object():
    crt = {
        "value": 2,
        "available_spare": 0,
        "temp_threshold": 1,
        "reliability_degraded": 0,
        "ro": 0,
        "vmbu_failed": 0,
        "pmr_ro": 0,
    }
    log = parse_smart_log(json.dumps(_smart(critical_warning=crt)))
    assert log.critical_warning == 2
    assert log.warnings == ["temperature over threshold"] and not log.media_warning


def test_smartctl_spelling_percentage_used_is_read():
    doc = {
        "nvme_smart_health_information_log": {
            "critical_warning": 1,
            "temperature": 36,
            "available_spare": 4,
            "available_spare_threshold": 10,
            "percentage_used": 97,
            "media_errors": 0,
        }
    }
    log = parse_smart_log(json.dumps(doc))
    assert (log.percent_used, log.avail_spare, log.spare_thresh) == (97, 4, 10)
    assert log.warnings == ["available spare below threshold"] and log.media_warning


def test_smart_log_banner_before_json_and_missing_field():
    text = "Smart Log for NVME device:nvme0 namespace-id:ffffffff\n" + json.dumps(_smart())
    assert parse_smart_log(text).percent_used == 15
    with pytest.raises(ParseError, match="critical_warning"):
        parse_smart_log(json.dumps({"temperature": 300}))
    with pytest.raises(ParseError, match="no JSON"):
        parse_smart_log("NVMe status: Access Denied: Access to the namespace is denied\n")


# -- the SEL, FreeIPMI, smartctl, and the kernel's AER and GHES messages -----------------------


def test_sel_pre_init_and_deasserted_events_are_kept_apart():
    """ipmitool's `sel elist` (lib/ipmi_sel.c): an event before the BMC's clock was set has no
    time; a deassertion (the supply came back) is not a failure."""
    events = parse_sel(
        "   1 | Pre-Init   |  0000012 | Power Supply PS1 Status | Failure detected | Asserted\n"
        "   2 | 12/10/2024 | 08:31:00 | Power Supply PS1 Status | Failure detected | Deasserted\n"
        "   3 | 12/10/2024 | 08:32:00 | Power Unit Pwr Unit Redund | Redundancy Lost | Asserted\n"
    )
    assert [(e.when is None, e.kind) for e in events] == [
        (True, "failure"),
        (False, None),
        (False, "redundancy_lost"),
    ]


def test_sel_of_no_known_form_is_refused_and_an_empty_log_is_empty():
    assert parse_sel("SEL has no entries\n") == []
    with pytest.raises(ParseError, match="no SEL entry"):
        parse_sel("Error: Unable to establish IPMI v2 / RMCP+ session\n")


@pytest.mark.parametrize(
    "message, kind, severity, source",
    [
        (
            "pcieport 0000:80:1b.4: AER: Uncorrectable (Fatal) error message received from "
            "0000:81:00.0",
            "received",
            "fatal",
            "0000:81:00.0",
        ),
        (
            "nvme 0000:03:00.0: PCIe Bus Error: severity=Correctable, type=Physical Layer, "
            "(Receiver ID)",
            "bus_error",
            "corrected",
            None,
        ),
        ("pcieport 0000:00:03.0: device recovery failed", "recovery_failed", None, None),
    ],
)
def test_aer_wordings_of_each_kernel_read_alike(message, kind, severity, source):
    """6.x's "error message received from" and "Correctable", 4.x's bare "device recovery
    failed" (drivers/pci/pcie/aer.c, err.c)."""
    line = parse_aer_message(message)
    assert line is not None and (line.kind, line.severity, line.source) == (kind, severity, source)


def test_a_ghes_section_of_another_type_is_not_a_memory_error():
    errors = parse_ghes(
        [
            "{5}[Hardware Error]: event severity: fatal",
            "{5}[Hardware Error]:  Error 0, type: fatal",
            "{5}[Hardware Error]:   section_type: PCIe error",
            "{5}[Hardware Error]:  Error 1, type: corrected",
            "{5}[Hardware Error]:   section_type: memory error",
            "{5}[Hardware Error]:   DIMM location: not present. DMI handle: 0x0021",
        ]
    )
    assert [(e.severity, e.label) for e in errors] == [("corrected", None)]


def test_smartctl_temperature_is_celsius_and_a_sata_disk_is_refused():
    doc = {
        "smartctl": {"exit_status": 0},
        "nvme_smart_health_information_log": {"critical_warning": 0, "temperature": 36},
    }
    assert parse_smartctl_json(json.dumps(doc)).log.temperature_k == 309
    sata = {"smartctl": {"exit_status": 0}, "device": {"protocol": "ATA"}}
    with pytest.raises(ParseError, match="speaks ATA, not NVMe"):
        parse_smartctl_json(json.dumps(sata))
