"""``dcgmi diag -j`` parsing on DCGM 2.x, 3.3 and 4.x JSON shapes (tests/data/dcgm, README there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.parsers import ParseError
from node_agent.parsers.dcgm_diag import error_name, parse_diag_json

DATA = Path(__file__).resolve().parents[1] / "data" / "dcgm"


def load(name: str):
    return parse_diag_json((DATA / name).read_text())


def test_dcgm4_passing_run_has_results_for_every_gpu_and_no_findings():
    report = load("dcgm4_r3_pass.json")
    assert report.format == "dcgm4"
    assert report.dcgm_version == "4.2.3"
    assert report.driver_version == "570.124.06"
    assert report.findings == ()
    memory = [r for r in report.results if r.test == "memory"]
    assert sorted(r.target for r in memory) == [f"gpu:{i}" for i in range(8)]
    assert memory[0].category == "Hardware"
    assert memory[0].info == ("Allocated 150215999488 bytes (99.0%)",)


def test_dcgm4_memory_failure_on_gpu2_keeps_code_category_and_severity():
    report = load("dcgm4_r3_memory_isolate.json")
    (memory,) = [f for f in report.findings if f.test == "memory"]
    assert (memory.target, memory.status, memory.printed_status) == ("gpu:2", "fail", "Fail")
    (warning,) = memory.warnings
    assert (warning.error_id, warning.category, warning.severity) == (58, 10, 2)
    assert (warning.category_name, warning.severity_name) == ("HARDWARE_MEMORY", "ISOLATE")
    assert error_name(warning.error_id) == "DCGM_FR_MEMORY_MISMATCH"
    assert "memory mismatch" in warning.message
    severities = {f.target: (f.test, f.status, f.worst_severity) for f in report.findings}
    assert severities == {
        "gpu:2": ("memory", "fail", "ISOLATE"),
        "gpu:6": ("software", "fail", "RESET"),
        "gpu:4": ("targeted_power", "warn", "MONITOR"),
    }


def test_dcgm33_gpu_id_format_memory_failure_on_gpu2_is_isolate():
    report = load("dcgm3_r3_memory_fail.json")
    assert (report.format, report.dcgm_version, report.driver_version) == (
        "dcgm3",
        "3.3.5",
        "535.154.05",
    )
    (finding,) = report.findings
    assert (finding.test, finding.target, finding.worst_severity) == (
        "GPU Memory",
        "gpu:2",
        "ISOLATE",
    )
    assert finding.warnings[0].error_id == 58
    # Deployment tests name no GPU: they land on the node
    assert {r.target for r in report.results if r.category == "Deployment"} == {"node"}


def test_dcgm3_warn_printed_as_fail_with_only_monitor_errors_reads_as_warn():
    report = load("dcgm3_r2_warn_printed_as_fail.json")
    by_test = {f.test: f for f in report.findings}
    pcie = by_test["PCIe"]
    assert (pcie.target, pcie.printed_status, pcie.status) == ("gpu:5", "Fail", "warn")
    assert pcie.warn_printed_as_fail
    assert pcie.warnings[0].error_id == 3  # DCGM_FR_PCI_REPLAY_RATE


def test_dcgm3_deployment_warning_message_under_key_warnings_and_integer_gpu_id():
    persistence = {f.test: f for f in load("dcgm3_r2_warn_printed_as_fail.json").findings}[
        "Persistence Mode"
    ]
    # a CONFIG error printed Fail stays a failure (only MONITOR-only results are WARNs)
    assert (persistence.target, persistence.status, persistence.worst_severity) == (
        "gpu:0",
        "fail",
        "CONFIG",
    )
    assert persistence.warnings[0].message.startswith("Persistence mode for GPU 0")
    assert persistence.warnings[0].error_id == 29


def test_dcgm2_gpu_ids_text_warnings_have_no_code_or_severity():
    report = load("dcgm2_r2_memory_fail.json")
    assert (report.format, report.dcgm_version) == ("dcgm2", "2.4.7")
    (finding,) = report.findings
    assert (finding.test, finding.target, finding.status) == ("GPU Memory", "gpu:2", "fail")
    (warning,) = finding.warnings
    assert warning.error_id is None and warning.severity is None
    assert finding.worst_severity is None
    skipped = [r for r in report.results if r.status == "skip"]
    assert {r.test for r in skipped} == {"Diagnostic"}


def test_iterations_output_keeps_each_run_and_the_overall_result():
    report = load("dcgm4_r1_iterations_fail.json")
    assert (report.iterations, report.overall) == (2, "Fail")
    assert report.overall_warning == "Detected an error in the NVIDIA Validation Suite"
    (finding,) = report.findings
    assert (finding.target, finding.iteration, finding.worst_severity) == ("gpu:1", 1, "RESET")
    assert {r.iteration for r in report.results} == {0, 1}


def test_iterations_with_a_null_run_records_it_missing():
    text = (
        '{"iterations": ['
        + (DATA / "dcgm4_r3_pass.json").read_text()
        + ', null], "Overall Result": "Fail", "warning": "aborted"}'
    )
    report = parse_diag_json(text)
    assert report.missing_iterations == (1,)
    assert report.overall == "Fail"


def test_runtime_error_is_reported_not_raised():
    report = load("dcgm4_runtime_error.json")
    assert report.runtime_error == "Error: Diagnostic could not be run while DCGM is paused."
    assert report.results == ()


def test_text_before_the_json_document_is_skipped():
    text = "Warning: NVVS ran as non-root\n" + (DATA / "dcgm4_r3_pass.json").read_text()
    assert parse_diag_json(text).findings == ()


def test_unknown_status_is_kept_as_unknown_not_pass():
    text = (
        '{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{'
        '"name": "memory", "results": [{"entity_group": "GPU", "entity_id": 3, '
        '"status": "Mystery"}]}]}]}}'
    )
    (finding,) = parse_diag_json(text).findings
    assert (finding.target, finding.status, finding.printed_status) == (
        "gpu:3",
        "unknown",
        "Mystery",
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Error: unable to connect to host engine\n",
        (DATA / "dcgm4_truncated.json").read_text(),
        '{"DCGM Diagnostic": {"test_categories": []}}',
        '{"something": "else"}',
        "[1, 2]",
        '{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": '
        '"memory", "results": [{"gpu_id": "two", "status": "Fail"}]}]}]}}',
        '{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": '
        '"memory", "results": [{"gpu_id": "2"}]}]}]}}',
    ],
)
def test_truncated_empty_or_malformed_output_raises_parse_error(text):
    with pytest.raises(ParseError):
        parse_diag_json(text)
