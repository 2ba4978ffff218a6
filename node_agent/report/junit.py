"""JUnit XML: one test case per check and target, so Jenkins and GitLab show a run natively.

Shape (the common Jenkins/GitLab JUnit schema)::

    <testsuites name="node-agent" tests= failures= errors= skipped= time=>
      <testsuite name="node-agent.delivery.<host>" hostname= timestamp= tests= ...>
        <properties> grade, action, each reason, host, SKU, driver </properties>
        <testcase classname="<check>" name="<target>" time=>
          <failure message= type="fail">  a result failed: the grade reason and details
          <error message= type="error">   the check could not run (timeout, crash)
          <skipped message=>              every result skipped: why
          <system-out>                    each result's metric, value, status, detail
        </testcase>

A case holds every metric the check measured on that target; its worst status decides its
outcome (fail > error > warn > pass > skip). A warning is a passing case whose output says so.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from node_agent.model import Report, Result, Status

# XML 1.0 forbids most control characters even escaped; report text is untrusted
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _text(value: object) -> str:
    return _XML_ILLEGAL.sub("\ufffd", "" if value is None else str(value))


def _line(r: Result) -> str:
    value = "" if r.value is None else f" = {r.value}{' ' + r.unit if r.unit else ''}"
    return f"[{r.status.value}] {r.metric}{value}: {r.detail}"


def build_junit(report: Report) -> ET.Element:
    """The ``<testsuites>`` element of a report."""
    cases: dict[tuple[str, str], list[Result]] = {}
    for r in report.results:
        cases.setdefault((r.check, r.target), []).append(r)
    reasons_by_target: dict[str, list[str]] = {}
    for reason in report.grade.reasons:
        reasons_by_target.setdefault(reason.target, []).append(
            f"{reason.level.name} [{reason.rule}]: {reason.message}"
        )

    suite = ET.Element(
        "testsuite",
        name=_text(f"node-agent.{report.suite}.{report.host.hostname}"),
        hostname=_text(report.host.hostname),
        timestamp=_text(report.started_at.rstrip("Z")),
        package="node-agent",
    )
    _add_properties(suite, report)

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for (check, target), results in cases.items():
        seconds = max((r.duration_s for r in results), default=0.0)
        total_time += seconds
        case = ET.SubElement(
            suite, "testcase", classname=_text(check), name=_text(target), time=f"{seconds:.3f}"
        )
        counts["tests"] += 1
        outcome = _add_outcome(case, check, results, reasons_by_target.get(target, []))
        if outcome:
            counts[outcome] += 1
        out = ET.SubElement(case, "system-out")
        out.text = _text("\n".join(_line(r) for r in results))

    suite.set("tests", str(counts["tests"]))
    suite.set("failures", str(counts["failures"]))
    suite.set("errors", str(counts["errors"]))
    suite.set("skipped", str(counts["skipped"]))
    suite.set("time", f"{total_time:.3f}")
    root = ET.Element(
        "testsuites",
        name="node-agent",
        tests=str(counts["tests"]),
        failures=str(counts["failures"]),
        errors=str(counts["errors"]),
        skipped=str(counts["skipped"]),
        time=f"{total_time:.3f}",
    )
    root.append(suite)
    return root


def _add_properties(suite: ET.Element, report: Report) -> None:
    """The report's grade, action, suite, node and the grade's reasons as ``<properties>``."""
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("grade", report.grade.level.name),
        ("action", report.grade.action.value),
        ("suite", report.suite),
        ("mode", report.mode),
        ("sku", report.sku or ""),
        ("driver", report.host.driver or ""),
        ("simulated", str(report.simulated).lower()),
        ("agent_version", report.agent_version),
    ):
        ET.SubElement(props, "property", name=name, value=_text(value))
    for i, reason in enumerate(report.grade.reasons):
        ET.SubElement(
            props,
            "property",
            name=f"reason.{i}",
            value=_text(f"{reason.level.name} {reason.target} [{reason.rule}] {reason.message}"),
        )


def _add_outcome(case: ET.Element, check: str, results: list[Result], reasons: list[str]) -> str:
    """A test case's ``<failure>``, ``<error>`` or ``<skipped>``; which of the counts it adds
    to (``failures``, ``errors``, ``skipped``), or "" for a case that passed."""
    failed = [r for r in results if r.status is Status.FAIL]
    errored = [r for r in results if r.status is Status.ERROR]
    if failed:
        el = ET.SubElement(
            case, "failure", type="fail", message=_text(_message(failed, reasons, check))
        )
        el.text = _text("\n".join(_line(r) for r in failed + errored))
        return "failures"
    if errored:
        el = ET.SubElement(
            case, "error", type="error", message=_text(_message(errored, reasons, check))
        )
        el.text = _text("\n".join(_line(r) for r in errored))
        return "errors"
    if {r.status for r in results} == {Status.SKIP}:
        ET.SubElement(case, "skipped", message=_text(results[0].detail))
        return "skipped"
    return ""


def _message(results: list[Result], reasons: list[str], check: str) -> str:
    """The grade reason for the target when it names this check's finding, else the detail."""
    for reason in reasons:
        if any(r.detail and r.detail in reason for r in results) or check in reason:
            return reason
    return "; ".join(f"{r.metric}: {r.detail}" for r in results)[:1000]


def junit_xml(report: Report) -> str:
    root = build_junit(report)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: Report, path: str | Path) -> Path:
    """Write the report as JUnit XML to ``path`` (atomically); return the path."""
    from node_agent.report.html import write_text_atomic

    return write_text_atomic(junit_xml(report), path)
