"""JUnit XML (node_agent.report.junit): one case per check and target, failures with reasons."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from synthetic_reports import synthetic_report  # tests/synthetic_reports.py

from node_agent.model import Result, Status
from node_agent.report.junit import junit_xml, write_junit

# The common Jenkins/GitLab JUnit schema: which children and attributes each element may carry
ALLOWED_CHILDREN = {
    "testsuites": {"testsuite"},
    "testsuite": {"properties", "testcase", "system-out", "system-err"},
    "properties": {"property"},
    "testcase": {"skipped", "error", "failure", "system-out", "system-err"},
}
REQUIRED_ATTRS = {
    "testsuite": {"name", "tests"},
    "testcase": {"name", "classname"},
    "property": {"name", "value"},
}


def parse(report) -> ET.Element:
    return ET.fromstring(junit_xml(report).encode("utf-8"))


def case(root: ET.Element, classname: str, name: str) -> ET.Element:
    (found,) = [
        c
        for c in root.iter("testcase")
        if c.get("classname") == classname and c.get("name") == name
    ]
    return found


def test_a_fault_xid_is_a_failure_on_its_gpu_case_carrying_the_grade_reason():
    root = parse(synthetic_report("n1", faults={5: "xid64"}))
    failure = case(root, "xid", "gpu:5").find("failure")
    assert failure is not None and failure.get("type") == "fail"
    assert "FAULT" in failure.get("message") and "Xid 64" in failure.get("message")
    assert "Xid 64" in failure.text
    suite = root.find("testsuite")
    assert suite.get("failures") == "1" and root.get("failures") == "1"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["grade"] == "FAULT" and props["action"] == "replace"
    assert "gpu:5" in props["reason.0"]


def test_one_case_per_check_and_target_holding_every_metric():
    report = synthetic_report("n1")
    root = parse(report)
    pairs = {(r.check, r.target) for r in report.results}
    cases = [(c.get("classname"), c.get("name")) for c in root.iter("testcase")]
    assert sorted(cases) == sorted(pairs)
    assert root.get("tests") == str(len(pairs))
    out = case(root, "gpu_burn", "gpu:0").find("system-out").text
    assert all(m in out for m in ("tflops_bf16", "tflops_fp16", "tflops_tf32", "tflops_fp32"))


def test_check_that_could_not_run_is_an_error_and_all_skipped_is_skipped():
    report = synthetic_report("n1")
    report.results += [
        Result("nccl_allreduce", "node", "timeout", Status.ERROR, "timed out after 300 s"),
        Result("rdma", "node", "ran", Status.SKIP, "no RDMA devices in /sys/class/infiniband"),
    ]
    root = parse(report)
    error = case(root, "nccl_allreduce", "node").find("error")
    assert error is not None and "timed out after 300 s" in error.get("message")
    assert case(root, "rdma", "node").find("skipped").get("message").startswith("no RDMA")
    assert root.get("errors") == "1" and root.get("skipped") == "1"


def test_untrusted_text_with_markup_and_control_characters_stays_well_formed(tmp_path):
    report = synthetic_report('evil<host>&"', faults={1: "xid64"})
    report.results.append(
        Result(
            "xid",
            "gpu:1",
            "xid",
            Status.FAIL,
            "</failure><injected/>\x00\x1b[31m ]]> bell\x07",
            value=64,
        )
    )
    path = write_junit(report, tmp_path / "junit.xml")
    root = ET.parse(path).getroot()
    assert not list(root.iter("injected"))
    assert "evil<host>" in root.find("testsuite").get("hostname")
    assert "</failure><injected/>" in case(root, "xid", "gpu:1").find("failure").text


def test_output_follows_the_jenkins_gitlab_schema_shape():
    report = synthetic_report("n1", faults={2: "xid64"})
    report.results.append(Result("storage", "disk:/x", "fio", Status.ERROR, "fio crashed"))
    root = parse(report)
    assert root.tag == "testsuites"
    for el in root.iter():
        if el.tag in ALLOWED_CHILDREN:
            assert {c.tag for c in el} <= ALLOWED_CHILDREN[el.tag], el.tag
        assert REQUIRED_ATTRS.get(el.tag, set()) <= set(el.attrib), el.tag
    suite = root.find("testsuite")
    order = [c.tag for c in suite]
    assert order[0] == "properties" and set(order[1:]) == {"testcase"}
    for c in root.iter("testcase"):
        float(c.get("time"))
        outcomes = [x.tag for x in c if x.tag in ("failure", "error", "skipped")]
        assert len(outcomes) <= 1
    for attr in ("tests", "failures", "errors", "skipped"):
        int(suite.get(attr))
    assert int(suite.get("tests")) == len(list(suite.iter("testcase")))
