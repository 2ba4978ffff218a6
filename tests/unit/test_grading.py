"""Grading rules as shipped in graders/: each finding gets the level the catalog documents,
reading the line where NVIDIA's catalog decodes it (Xid 144-150, 154, SXid severity) and
counting recurrence where it says to count. Real lines come from ``../shared/realworld/xid/``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from node_agent import resources
from node_agent.checking.xid_fold import Folder
from node_agent.config import config_from_dict
from node_agent.grading.rules import load_grader
from node_agent.kernel_log import SxidLine, XidLine, scan_lines
from node_agent.model import Action, Level, Result, Status
from node_agent.yamlfile import ConfigError


@pytest.fixture(scope="module")
def grader():
    return load_grader(resources.graders_dir(config_from_dict({})))


def res(metric, status="fail", check="nvml_health", target="gpu:0", value=None, detail="d"):
    return Result(
        check=check, target=target, metric=metric, status=Status(status), detail=detail, value=value
    )


@pytest.mark.parametrize(
    "code, level",
    [
        (79, Level.ERROR),
        (48, Level.ERROR),
        (64, Level.FAULT),
        (63, Level.ERROR),
        (94, Level.ERROR),
        (95, Level.ERROR),
        (119, Level.ERROR),
        (13, Level.WARN),
        (31, Level.WARN),
        (43, Level.WARN),
    ],
)
def test_xid_catalog_levels(grader, code, level):
    grade = grader.grade([res("xid", check="xid", value=code, detail=f"Xid {code}")])
    assert grade.level is level
    assert grade.reasons[0].rule == "xid"


def test_unknown_xid_is_not_ignored(grader):
    grade = grader.grade([res("xid", check="xid", value=9999)])
    assert grade.level is Level.ERROR
    assert "not in the XID catalog" in grade.reasons[0].message


@pytest.mark.parametrize(
    "metric, level, action",
    [
        ("ecc_dbe_volatile", Level.ERROR, Action.RESTART),
        ("row_remap_failure", Level.FAULT, Action.REPLACE),
        ("row_remap_pending", Level.ERROR, Action.RESTART),
        ("pcie_width", Level.ERROR, Action.RESTART),
        ("gpu_not_enumerated", Level.ERROR, Action.RESTART),
        ("recovery_action", Level.ERROR, Action.RESTART),
    ],
)
def test_hardware_findings_map_to_level_and_action(grader, metric, level, action):
    grade = grader.grade([res(metric)])
    assert (grade.level, grade.action) == (level, action)


def test_warn_never_asks_for_an_action(grader):
    grade = grader.grade([res("temperature", status="warn")])
    assert grade.level is Level.WARN and grade.action is Action.NONE


def test_a_check_that_could_not_run_blocks_delivery_but_only_warns_in_service(grader):
    broken = [res("ran", status="error", check="storage", target="node")]
    assert grader.grade(broken, "delivery").level is Level.ERROR
    assert grader.grade(broken, "service").level is Level.WARN


def test_a_hang_is_an_error_in_service_too(grader):
    assert (
        grader.grade([res("timeout", status="error", target="node")], "service").level
        is Level.ERROR
    )


def test_the_training_checks_own_timeout_is_a_warn_a_user_can_cause_not_a_hang(grader):
    """training_progress reads only what users control; 80 processes blocked in vfork() could
    make it time out (issue 29): that says nothing about the node."""
    for mode in ("service", "delivery"):
        grade = grader.grade(
            [res("timeout", status="error", check="training_progress", target="node")], mode
        )
        assert grade.level is Level.WARN and grade.action is Action.NONE
        assert grade.reasons[0].rule == "training-check-timeout"


def test_an_unverified_hang_is_a_warn_and_a_verified_one_an_error(grader):
    unverified = grader.grade(
        [res("training_hang", status="warn", check="training_progress", target="pid:4242")]
    )
    assert (
        unverified.level is Level.WARN and unverified.reasons[0].rule == "training-hang-unverified"
    )
    verified = grader.grade([res("training_hang", check="training_progress", target="pid:4242")])
    assert verified.level is Level.ERROR and verified.reasons[0].rule == "training-hang"


def test_unclassified_failure_is_error_not_ignored_nor_taken_for_hardware(grader):
    (reason,) = grader.grade([res("something_new")]).reasons
    assert (reason.rule, reason.level, reason.remedy) == (
        "unclassified-fail",
        Level.ERROR,
        "unclassified",
    )


def test_passes_and_skips_never_make_reasons(grader):
    grade = grader.grade([res("temperature", status="pass"), res("ran", status="skip")])
    assert grade.level is Level.HEALTHY and grade.reasons == ()


def test_worst_reason_decides_and_all_are_kept(grader):
    grade = grader.grade(
        [
            res("temperature", status="warn", target="gpu:0"),
            res("row_remap_pending", target="gpu:2"),
            res("xid", check="xid", value=64, target="gpu:5"),
        ]
    )
    assert grade.level is Level.FAULT
    assert [(r.level, r.target) for r in grade.reasons] == [
        (Level.FAULT, "gpu:5"),
        (Level.ERROR, "gpu:2"),
        (Level.WARN, "gpu:0"),
    ]


def test_operator_can_override_a_level_in_a_copied_graders_dir(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    xid = tmp_path / "graders" / "xid.yaml"
    xid.write_text(
        xid.read_text().replace(
            'name: "Graphics Engine Exception"\n    level: WARN',
            'name: "Graphics Engine Exception"\n    level: ERROR',
        )
    )
    grader = load_grader(tmp_path / "graders")
    assert grader.grade([res("xid", check="xid", value=13)]).level is Level.ERROR


def test_a_broken_rules_file_is_a_config_error_naming_it(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    (tmp_path / "graders" / "rules.yaml").write_text(
        "rules:\n  - {id: x, level: SEVERE}\nfallback: {}\n"
    )
    with pytest.raises(ConfigError, match="rules.yaml"):
        load_grader(tmp_path / "graders")


# -- the XID catalog reads the whole line (144-150, 154), SXids, recurrence --------------------

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "realworld" / "xid"
needs_samples = pytest.mark.skipif(
    not SAMPLES.is_dir(), reason=f"real kernel-log samples not found at {SAMPLES}"
)


def sample_lines(prefix: str) -> list[str]:
    (path,) = SAMPLES.glob(prefix + "_*.log")
    return path.read_text().splitlines()


def findings(lines: list[str]) -> list[Result]:
    """The ``xid`` check's results for these lines (folded per GPU bus / NVSwitch and code)."""
    folder = Folder()
    for event in scan_lines(lines):
        if isinstance(event, SxidLine):
            folder.add(event, event.target, "test")
        elif isinstance(event, XidLine):
            folder.add(event, f"pci:{event.pci_bus}", "test")
    return [fold.result() for fold in folder.sorted()]


def nvlink5(
    code: int, unit: str, severity: str, intrinfo: int, status: int, bus="0018:01:00"
) -> str:
    return (
        f"NVRM: Xid (PCI:{bus}): {code}, {unit} {severity} XC0 i0 Link 03 "
        f"(0x{intrinfo:08x} 0x{status:08x} 0x00000000 0x00000000 0x00000000 0x00000000)"
    )


@needs_samples
def test_gb200_production_nonfatal_nvlink5_lines_never_drain(grader):
    nonfatal = [line for line in sample_lines("x05") if "Nonfatal" in line]
    assert len(nonfatal) == 9
    grade = grader.grade(findings(nonfatal), "service")
    assert grade.level is Level.WARN and grade.action is Action.NONE
    assert {r.message.split("[")[-1].split(",")[0] for r in grade.reasons} == {
        "Xid 149: NVLINK: NETIR Error",
        "Xid 145: NVLINK: RLW Error",
    }
    assert any("NETIR_BER_EVENT Nonfatal -> IGNORE" in r.message for r in grade.reasons)
    assert any("RLW_SRC_TRACK Nonfatal -> XID_154_EVAL" in r.message for r in grade.reasons)


@needs_samples
def test_gb200_production_fatal_nvlink5_lines_grade_error(grader):
    fatal = [line for line in sample_lines("x05") if " Fatal " in line]
    grade = grader.grade(findings(fatal), "service")
    assert grade.level is Level.ERROR and grade.action is Action.RESTART
    assert {r.target for r in grade.reasons} == {
        "pci:0008:01:00",
        "pci:0018:01:00",
        "pci:0019:01:00",
    }
    assert all("RESET_GPU" in r.message for r in grade.reasons)


@needs_samples
def test_gb200_whole_log_fatal_line_decides_its_gpu_and_nonfatal_codes_stay_warn(grader):
    grade = grader.grade(findings(sample_lines("x05")), "service")
    by = {(r.target, r.message.split("[Xid ")[1][:3]): r.level for r in grade.reasons}
    assert by[("pci:0018:01:00", "149")] is Level.ERROR  # BER Nonfatal + NETIR Fatal on one GPU
    assert by[("pci:0018:01:00", "145")] is Level.WARN
    assert grade.level is Level.ERROR


@pytest.mark.parametrize(
    "subcode, level",
    [
        (0b100110, Level.WARN),  # IGNORE (software/user took the link down)
        (0b101000, Level.WARN),  # IGNORE (host)
        (0b000100, Level.ERROR),  # RESET_GPU (link signal integrity)
        (0b100001, Level.ERROR),  # RESET_GPU (peer device)
    ],
)
def test_netir_link_event_subcode_decides_ignore_or_reset(grader, subcode, level):
    line = nvlink5(149, "NETIR_LINK_EVT", "Fatal", (subcode << 20) | 0x0005C6, 0)
    assert grader.grade(findings([line])).level is level


def test_nvlink5_unit_the_sheet_does_not_list_is_graded_by_its_printed_severity(grader):
    assert (
        grader.grade(findings([nvlink5(146, "TLW_NEW", "Nonfatal", 0x3, 0x1)])).level is Level.WARN
    )
    assert grader.grade(findings([nvlink5(146, "TLW_NEW", "Fatal", 0x3, 0x4)])).level is Level.ERROR


def test_nvlink5_xid_without_a_line_to_decode_takes_the_code_level(grader):
    nvml_only = Result(
        check="xid",
        target="gpu:0",
        metric="xid",
        status=Status.FAIL,
        value=149,
        detail="Xid 149 (NVML event)",
        evidence={"count": 1, "variants": []},
    )
    grade = grader.grade([nvml_only])
    assert grade.level is Level.ERROR and "no kernel-log line to decode" in grade.reasons[0].message
    assert grader.grade([res("xid", check="xid", value=147)]).level is Level.WARN


def test_saved_report_without_variants_is_decoded_from_its_lines(grader):
    old = Result(
        check="xid",
        target="gpu:0",
        metric="xid",
        status=Status.FAIL,
        value=149,
        detail="Xid 149",
        evidence={
            "count": 1,
            "lines": [nvlink5(149, "NETIR_BER_EVENT", "Nonfatal", 0x00086226, 1)],
        },
    )
    assert grader.grade([old]).level is Level.WARN


@pytest.mark.parametrize(
    "action, level",
    [("None", Level.WARN), ("Drain and Reset", Level.ERROR), ("GPU Reset Required", Level.ERROR)],
)
def test_xid154_is_graded_by_the_recovery_action_it_names(grader, action, level):
    line = f"NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x4 (Drain and Reset) to 0x0 ({action})"
    assert grader.grade(findings([line])).level is level


@needs_samples
def test_sxid_20034_ltssm_fault_up_grades_error_per_nvswitch(grader):
    grade = grader.grade(findings(sample_lines("x04")), "service")
    sxid = [r for r in grade.reasons if r.rule == "sxid"]
    assert {(r.target, r.level) for r in sxid} == {
        (f"nvswitch:{n}", Level.ERROR) for n in (0, 1, 2)
    }
    assert all("[SXid 20034: LTSSM Fault Up" in r.message for r in sxid)
    assert grade.level is Level.ERROR  # the Xid 79 that came before them: a reboot first


@pytest.mark.parametrize(
    "line, level",
    [
        (
            "nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04 RX Short Error Rate",
            Level.WARN,
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 MC TS crumbstore MCTO",
            Level.WARN,
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 29999, Fatal, Link 28 something new",
            Level.ERROR,
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 22012, Non-fatal, Link 3 Minion Link NA interrupt",
            Level.WARN,
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 22012, Fatal, Link 3 Minion Link NA interrupt",
            Level.ERROR,
        ),
        (
            "nvidia-nvswitch4: SXid (PCI:0000:c6:00.0): 19084, Non-fatal, Link 29 AN1 Heartbeat Timeout Error",
            Level.ERROR,
        ),
    ],
)
def test_sxid_level_reads_the_printed_severity_where_the_catalog_allows(grader, line, level):
    (finding,) = findings([line])
    assert finding.target.startswith("nvswitch:") and finding.metric == "sxid"
    assert grader.grade([finding]).level is level


def test_rules_file_without_an_sxid_rule_still_routes_sxids_to_their_catalog(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    rules = tmp_path / "graders" / "rules.yaml"
    data = yaml.safe_load(rules.read_text())  # an operator's older rules.yaml: no sxid rule
    data["rules"] = [r for r in data["rules"] if r["level"] != "sxid_catalog"]
    rules.write_text(yaml.safe_dump(data))
    grader = load_grader(tmp_path / "graders")
    (finding,) = findings(
        ["nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20001, Non-fatal, Link 4 TX Replay Error"]
    )
    assert grader.grade([finding]).level is Level.WARN


def timed(seconds: float, line: str) -> str:
    return f"[{seconds:12.6f}] {line}"


MMU = "NVRM: Xid (PCI:0000:3b:00): 31, pid=9, name=python, Ch 00000008, intr 0. MMU Fault"


def test_xid31_repeating_in_two_bursts_on_one_gpu_grades_error(grader):
    once = findings([timed(100.0, MMU), timed(100.2, MMU)])  # one crash, two lines: one burst
    assert grader.grade(once).level is Level.WARN
    twice = findings([timed(100.0, MMU), timed(4000.0, MMU)])
    grade = grader.grade(twice)
    assert (
        grade.level is Level.ERROR and "recurred: 2 bursts within 24 h" in grade.reasons[0].message
    )


def test_xid31_bursts_further_apart_than_the_window_do_not_escalate(grader):
    far = findings([timed(100.0, MMU), timed(100.0 + 25 * 3600, MMU)])
    assert grader.grade(far).level is Level.WARN


def test_xid45_flood_is_one_warn_finding_and_never_escalates(grader):
    line = "NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=python3, Ch 00000001 caused by previous Xid 149"
    flood = findings([timed(1000.0 + 400 * i, line) for i in range(200)])  # 200 separate bursts
    (finding,) = flood
    assert finding.evidence["count"] == 200 and finding.evidence["bursts"] == 200
    grade = grader.grade(flood, "service")
    assert grade.level is Level.WARN and len(grade.reasons) == 1


def test_xid92_persisting_over_five_bursts_in_a_day_grades_error(grader):
    line = "NVRM: Xid (PCI:0000:3b:00): 92, pid=1, High single-bit ECC error rate"
    assert grader.grade(findings([timed(500.0 * i, line) for i in range(4)])).level is Level.WARN
    assert grader.grade(findings([timed(500.0 * i, line) for i in range(5)])).level is Level.ERROR


def test_a_recurrence_threshold_is_configurable_in_xid_yaml(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    xid = tmp_path / "graders" / "xid.yaml"
    text = xid.read_text()
    assert "      bursts: 2\n      within_h: 24\n" in text
    xid.write_text(
        text.replace(
            "      bursts: 2\n      within_h: 24\n", "      bursts: 3\n      within_h: 24\n", 1
        )
    )
    grader = load_grader(tmp_path / "graders")
    assert grader.grade(findings([timed(100.0, MMU), timed(4000.0, MMU)])).level is Level.WARN
    assert (
        grader.grade(findings([timed(100.0 + 4000 * i, MMU) for i in range(3)])).level
        is Level.ERROR
    )


@pytest.mark.parametrize(
    "broken, key",
    [
        ("    decode:\n      - {unit: X, resolution: IGNORE, level: MAYBE, why: w}\n", "level"),
        (
            "    decode:\n      - {subcode: ['12'], resolution: IGNORE, level: WARN, why: w}\n",
            "subcode",
        ),
        ("    recurrence: {bursts: 1, within_h: 24, level: ERROR, why: w}\n", "bursts"),
    ],
)
def test_a_broken_decode_or_recurrence_entry_is_a_config_error_naming_the_key(
    tmp_path, broken, key
):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    xid = tmp_path / "graders" / "xid.yaml"
    xid.write_text(
        xid.read_text().replace(
            '    name: "Fake or injected error"\n',
            '    name: "Fake or injected error"\n' + broken,
            1,
        )
    )
    with pytest.raises(ConfigError, match=rf"xid.yaml.*{key}"):
        load_grader(tmp_path / "graders")


def test_docs_xid_catalog_table_lists_every_code_at_its_level(grader):
    """docs/xid.md is what operators read: its catalog table must say what graders/xid.yaml does."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "xid.md").read_text()
    table = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit() and cells[2].split(" ")[0] in Level.__members__:
            table[int(cells[0])] = Level[cells[2].split(" ")[0]]
    assert table == {code: entry.level for code, entry in grader.xid.codes.items()}


# -- remedy: software (the remediation plan holds such a node for an operator, never replaces) --
@pytest.mark.parametrize(
    "result, rule",
    [
        (
            res("driver_not_loaded", status="error", check="nvml_health", target="node"),
            "driver-not-loaded",
        ),
        (res("gpu_not_enumerated", status="error", target="node"), "driver-initialised-no-gpu"),
        (res("gpu_backend", status="error", target="node"), "gpu-driver-broken"),
        (res("timeout", status="error", check="gpu_burn"), "check-hang"),
        (res("ran", status="error", check="storage", target="node"), "check-error-delivery"),
    ],
)
def test_software_causes_carry_their_remedy_on_the_reason(grader, result, rule):
    (reason,) = grader.grade([result], "delivery").reasons
    assert (reason.rule, reason.level, reason.remedy) == (rule, Level.ERROR, "software")


@pytest.mark.parametrize(
    "metric, status",
    [
        ("row_remap_pending", "fail"),
        ("driver_hang", "error"),
        ("worker_died", "error"),
    ],
)
def test_hardware_looking_errors_have_no_remedy(grader, metric, status):
    (reason,) = grader.grade([res(metric, status=status)]).reasons
    assert reason.level is Level.ERROR and reason.remedy is None


def test_remedy_survives_a_saved_report_and_an_unknown_one_is_refused():
    from node_agent.model import Reason

    r = Reason("driver-not-loaded", Level.ERROR, "node", "no driver", remedy="software")
    assert Reason.from_dict(r.to_dict()) == r
    plain = Reason("xid", Level.ERROR, "gpu:0", "x")
    assert "remedy" not in plain.to_dict() and Reason.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match="unknown remedy 'firmware'"):
        Reason.from_dict({**r.to_dict(), "remedy": "firmware"})


def test_a_rules_file_with_an_unknown_remedy_is_a_config_error(tmp_path):
    shipped = resources.graders_dir(config_from_dict({}))
    shutil.copytree(shipped, tmp_path / "graders")
    rules = tmp_path / "graders" / "rules.yaml"
    rules.write_text(rules.read_text().replace("    remedy: software", "    remedy: firmware", 1))
    with pytest.raises(ConfigError, match="rules.yaml"):
        load_grader(tmp_path / "graders")


@pytest.mark.parametrize(
    "metric, status, level, rule",
    [
        ("driver_init_failed", "fail", Level.ERROR, "driver-init-failed"),
        ("pcie_aer_recovery_failed", "fail", Level.ERROR, "pcie-aer-recovery-failed"),
        ("pcie_aer_uncorrectable", "warn", Level.WARN, "pcie-aer-uncorrectable"),
        ("recovery_action", "fail", Level.ERROR, "recovery-action"),
        ("gpu_lost", "fail", Level.ERROR, "gpu-lost"),
    ],
)
def test_driver_lines_without_an_xid_grade_by_their_own_rules(grader, metric, status, level, rule):
    """graders/driver_lines.yaml's kinds, as the xid check reports them: each has a named rule,
    never the unclassified fallback."""
    grade = grader.grade([res(metric, status=status, check="xid", target="gpu:3")], "service")
    assert grade.level is level and grade.reasons[0].rule == rule
