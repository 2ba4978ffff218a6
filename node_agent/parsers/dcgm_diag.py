"""Parse ``dcgmi diag -r N -j`` (DCGM diagnostic JSON) of DCGM 2.x, 3.x and 4.x.

The document's shape moved between versions (NVIDIA publishes no stable schema for it; see
tests/data/dcgm/README.md for where each shape comes from):

* every version: ``{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware",
  "tests": [{"name": ..., "results": [...]}]}]}}``; a diagnostic that could not run prints
  ``{"DCGM Diagnostic": {"version": ..., "runtime_error": "..."}}`` instead.
* 2.x: a result names its GPUs as a string, ``"gpu_ids": "0,1"``; ``warnings`` is a string or a
  list of strings; ``info`` a string. Statuses ``Pass``/``Fail``/``Skip`` (``PASS`` in NVVS 1.x,
  whose root key was ``"DCGM GPU Diagnostic"``).
* 3.x: per GPU, ``"gpu_id": "2"``; ``warnings`` is a list of objects ``{"warning": msg,
  "error_id": N, "error_category": N, "error_severity": N}`` (3.3 added category and severity;
  the Deployment tests spell the message key ``"warnings"``). ``version``, ``Driver Version
  Detected`` sit at the top. dcgmi 3.x prints a WARN result as ``"Fail"``
  (``Diag::HelperDisplayDiagResult`` knows only Pass, Skip and Fail).
* 4.x: a result names its entity, ``"entity_group": "GPU", "entity_id": 2``; ``info`` is a list;
  a test carries ``test_summary``; versions sit under ``metadata``; statuses include ``Warn``.
* ``--iterations N`` (N > 1): ``{"iterations": [<one document per run>], "Overall Result":
  "Pass"|"Fail", "warning": "..."}``; a run that stopped the loop may leave ``null`` behind.

``error_severity`` and ``error_category`` are DCGM's integer enums (``dcgmErrorSeverity_t``,
``dcgmErrorCategory_t`` in dcgm_errors.h; table in DCGM's "Diagnostic Errors" reference).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from node_agent.parsers import ParseError, json_document

#: dcgmErrorSeverity_t (dcgm_errors.h). NONE/UNKNOWN carry no advice; the grade then falls back.
SEVERITIES = {
    0: "NONE",
    1: "MONITOR",
    2: "ISOLATE",
    3: "UNKNOWN",
    4: "TRIAGE",
    5: "CONFIG",
    6: "RESET",
}
#: worst first: what decides a finding's severity when a result carries several errors
SEVERITY_ORDER = ("ISOLATE", "RESET", "TRIAGE", "UNKNOWN", "CONFIG", "MONITOR", "NONE")

#: dcgmErrorCategory_t (dcgm_errors.h)
CATEGORIES = {
    0: "NONE",
    1: "PERF_THRESHOLD",
    2: "PERF_VIOLATION",
    3: "SOFTWARE_CONFIG",
    4: "SOFTWARE_LIBRARY",
    5: "SOFTWARE_XID",
    6: "SOFTWARE_CUDA",
    7: "SOFTWARE_EUD",
    8: "SOFTWARE_OTHER",
    9: "HARDWARE_THERMAL",
    10: "HARDWARE_MEMORY",
    11: "HARDWARE_NVLINK",
    12: "HARDWARE_NVSWITCH",
    13: "HARDWARE_PCIE",
    14: "HARDWARE_POWER",
    15: "HARDWARE_OTHER",
    16: "INTERNAL_OTHER",
}

#: DCGM_FR_VOLATILE_DBE_DETECTED, DCGM_FR_UNCONTAINED_ERROR: uncorrectable memory errors, for which
#: DCGM's own next step is "drain the GPU and reset it or reboot the node" (the reset applies the
#: row remap the driver recorded), though it rates the first ISOLATE
RESET_FIRST_MEMORY_CODES = frozenset({4, 81})

#: dcgmError_t codes (DCGM_FR_*, dcgm_errors.h) that diagnostics and health watches report most;
#: a code not listed here is still reported by number.
ERROR_NAMES = {
    1: "UNKNOWN",
    3: "PCI_REPLAY_RATE",
    4: "VOLATILE_DBE_DETECTED",
    5: "VOLATILE_SBE_DETECTED",
    6: "PENDING_PAGE_RETIREMENTS",
    7: "RETIRED_PAGES_LIMIT",
    8: "RETIRED_PAGES_DBE_LIMIT",
    9: "CORRUPT_INFOROM",
    10: "CLOCKS_EVENT_THERMAL",
    11: "POWER_UNREADABLE",
    12: "CLOCKS_EVENT_POWER",
    13: "NVLINK_ERROR_THRESHOLD",
    14: "NVLINK_DOWN",
    15: "NVSWITCH_FATAL_ERROR",
    16: "NVSWITCH_NON_FATAL_ERROR",
    17: "NVSWITCH_DOWN",
    19: "NVML_API",
    20: "DEVICE_COUNT_MISMATCH",
    23: "DENYLISTED_DRIVER",
    25: "GRAPHICS_PROCESSES",
    26: "HOSTENGINE_CONN",
    28: "BAD_CUDA_ENV",
    29: "PERSISTENCE_MODE",
    30: "LOW_BANDWIDTH",
    31: "HIGH_LATENCY",
    40: "THERMAL_VIOLATIONS",
    42: "TEMP_VIOLATION",
    43: "CLOCKS_EVENT_VIOLATION",
    44: "INTERNAL",
    45: "PCIE_GENERATION",
    46: "PCIE_WIDTH",
    47: "ABORTED",
    50: "STRESS_LEVEL",
    51: "CUDA_API",
    52: "FAULTY_MEMORY",
    55: "ECC_DISABLED",
    56: "MEMORY_ALLOC",
    57: "CUDA_DBE",
    58: "MEMORY_MISMATCH",
    59: "CUDA_DEVICE",
    61: "ECC_PENDING",
    62: "MEMORY_BANDWIDTH",
    63: "TARGET_POWER",
    66: "CUDA_CONTEXT",
    70: "NVLINK_CRC_ERROR_THRESHOLD",
    71: "NVLINK_ERROR_CRITICAL",
    72: "ENFORCED_POWER_LIMIT",
    79: "L1TAG_MISCOMPARE",
    80: "ROW_REMAP_FAILURE",
    81: "UNCONTAINED_ERROR",
    83: "DBE_PENDING_PAGE_RETIREMENTS",
    84: "UNCORRECTABLE_ROW_REMAP",
    85: "PENDING_ROW_REMAP",
    86: "BROKEN_P2P_MEMORY_DEVICE",
    87: "BROKEN_P2P_WRITER_DEVICE",
    88: "NVSWITCH_NVLINK_DOWN",
    92: "EUD_TIMEOUT",
    95: "EUD_TEST_FAILED",
    98: "PCIE_H_REPLAY_VIOLATION",
    99: "GPU_EXPECTED_NVLINKS_UP",
    101: "XID_ERROR",
    102: "SBE_VIOLATION",
    103: "DBE_VIOLATION",
    104: "PCIE_REPLAY_VIOLATION",
    108: "CUDA_FM_NOT_INITIALIZED",
    109: "SXID_ERROR",
    111: "NAN_VALUE",
    112: "FABRIC_MANAGER_TRAINING_ERROR",
    117: "TEST_SKIPPED",
    122: "IMEX_UNHEALTHY",
    123: "FABRIC_PROBE_STATE",
}

_STATUSES = {"pass": "pass", "fail": "fail", "warn": "warn", "warning": "warn", "skip": "skip"}
_ROOT_KEYS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")  # the second: NVVS 1.x / DCGM 1.x


def error_name(code: int | None) -> str | None:
    """``52`` -> ``"DCGM_FR_FAULTY_MEMORY"``; None for no code, ``DCGM_FR_<n>`` if unlisted."""
    if code is None:
        return None
    return f"DCGM_FR_{ERROR_NAMES.get(code, code)}"


@dataclass(frozen=True)
class DiagWarning:
    """One error DCGM attached to a result: its message and, from DCGM 3.3, its code,
    category and severity (integers as in dcgm_errors.h; None where the version lacks them)."""

    message: str
    error_id: int | None = None
    category: int | None = None
    severity: int | None = None

    @property
    def severity_name(self) -> str | None:
        return None if self.severity is None else SEVERITIES.get(self.severity, "UNKNOWN")

    @property
    def category_name(self) -> str | None:
        return None if self.category is None else CATEGORIES.get(self.category, str(self.category))


@dataclass(frozen=True)
class DiagEntityResult:
    """One test's outcome on one entity (a GPU, a CPU, an NvSwitch; ``node`` for tests that
    name none, such as DCGM 3.x's Deployment checks).

    ``status`` is normalised (pass, warn, fail, skip, unknown); ``printed_status`` is what DCGM
    wrote. A ``Fail`` whose every error has severity MONITOR is a WARN printed as Fail
    (dcgmi 3.x): ``status`` says ``warn`` and ``warn_printed_as_fail`` is set.
    """

    test: str
    category: str
    entity_group: str  # "GPU", "CPU", "NvSwitch", ...; "node" when the result names none
    entity_id: int | None
    status: str
    printed_status: str
    warnings: tuple[DiagWarning, ...] = ()
    info: tuple[str, ...] = ()
    iteration: int | None = None  # index in an --iterations run
    warn_printed_as_fail: bool = False

    @property
    def target(self) -> str:
        """``gpu:2``, ``cpu:0``, ``nvswitch:1``; ``node`` when no entity is named."""
        if self.entity_id is None or self.entity_group == "node":
            return "node"
        return f"{self.entity_group.lower().replace(' ', '_')}:{self.entity_id}"

    @property
    def worst_severity(self) -> str | None:
        """The most serious severity among the errors, or None when none carries one."""
        names = {w.severity_name for w in self.warnings if w.severity_name}
        return next((s for s in SEVERITY_ORDER if s in names), None)


@dataclass(frozen=True)
class DiagReport:
    """Everything one ``dcgmi diag -j`` run (or one bindings call) reported."""

    results: tuple[DiagEntityResult, ...]
    format: str  # "dcgm4" (entity_group), "dcgm3" (gpu_id), "dcgm2" (gpu_ids), "none"
    dcgm_version: str | None = None
    driver_version: str | None = None
    runtime_error: str | None = None  # the diagnostic could not run at all
    iterations: int = 1
    overall: str | None = None  # "Overall Result" of an --iterations run
    overall_warning: str | None = None
    missing_iterations: tuple[int, ...] = ()  # iterations the loop left null (it stopped)

    @property
    def findings(self) -> tuple[DiagEntityResult, ...]:
        """Results that did not pass or skip: failures, warnings, unknown statuses."""
        return tuple(r for r in self.results if r.status not in ("pass", "skip"))


def parse_diag_json(text: str) -> DiagReport:
    """A :class:`DiagReport` from ``dcgmi diag -j`` output (any version above).

    Text dcgmi prints before the JSON document is skipped. Raises :class:`ParseError` for
    empty, truncated or non-JSON output, or JSON without a DCGM diagnostic in it.

    >>> report = parse_diag_json(open("tests/data/dcgm/dcgm4_r3_pass.json").read())
    >>> report.findings
    ()
    """
    if "{" not in text and "| Diagnostic" in text:
        raise ParseError(
            "this is dcgmi diag's text table, not its JSON: run `dcgmi diag -r N "
            "-j` (the table's layout changes between DCGM releases)"
        )
    doc = json_document(text, "dcgmi diag", "`dcgmi diag -j` output")
    if not isinstance(doc, dict):
        raise ParseError(f"dcgmi diag JSON is a {type(doc).__name__}, expected an object")
    if "iterations" in doc:
        return _parse_iterations(doc)
    return _parse_one(doc, iteration=None)


def _parse_iterations(doc: dict[str, Any]) -> DiagReport:
    runs = doc["iterations"]
    if not isinstance(runs, list):
        raise ParseError("dcgmi diag JSON: 'iterations' is not a list")
    results: list[DiagEntityResult] = []
    missing: list[int] = []
    first: DiagReport | None = None
    runtime_errors = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or not run:
            missing.append(i)
            continue
        one = _parse_one(run, iteration=i)
        first = first or one
        results.extend(one.results)
        if one.runtime_error:
            runtime_errors.append(f"iteration {i + 1}: {one.runtime_error}")
    overall = doc.get("Overall Result")
    warning = doc.get("warning", doc.get("Warning"))
    if first is None and not runtime_errors:
        raise ParseError(
            "dcgmi diag --iterations JSON holds no completed iteration"
            + (f" (Overall Result {overall!r}: {warning})" if overall else "")
        )
    return DiagReport(
        results=tuple(results),
        format=first.format if first else "none",
        dcgm_version=first.dcgm_version if first else None,
        driver_version=first.driver_version if first else None,
        runtime_error="; ".join(runtime_errors) or None,
        iterations=len(runs),
        overall=str(overall) if overall is not None else None,
        overall_warning=str(warning) if warning else None,
        missing_iterations=tuple(missing),
    )


def _parse_one(doc: dict[str, Any], iteration: int | None) -> DiagReport:
    root_key = next((k for k in _ROOT_KEYS if k in doc), None)
    if root_key is None:
        raise ParseError(
            "dcgmi diag JSON has no 'DCGM Diagnostic' object (top-level keys: "
            f"{', '.join(sorted(doc)) or 'none'})"
        )
    root = doc[root_key]
    if not isinstance(root, dict):
        raise ParseError(
            f"dcgmi diag JSON: {root_key!r} is a {type(root).__name__}, "
            "expected an object holding 'test_categories'"
        )
    meta = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    version = meta.get("version") or doc.get("version") or root.get("version")
    driver = meta.get("Driver Version Detected") or doc.get("Driver Version Detected")
    runtime_error = root.get("runtime_error")
    categories = root.get("test_categories", [])
    if not isinstance(categories, list):
        raise ParseError("dcgmi diag JSON: 'test_categories' is not a list")
    if not categories and not runtime_error:
        raise ParseError(
            "dcgmi diag JSON has no test_categories and no runtime_error: "
            "the diagnostic reported nothing"
        )
    results: list[DiagEntityResult] = []
    formats: set[str] = set()
    for cat in categories:
        if not isinstance(cat, dict) or not isinstance(cat.get("tests", []), list):
            raise ParseError(f"dcgmi diag JSON: malformed test category {str(cat)[:120]}")
        cat_name = str(cat.get("category", ""))
        for test in cat.get("tests", []):
            if not isinstance(test, dict) or "name" not in test:
                raise ParseError(f"dcgmi diag JSON: a test in category {cat_name!r} has no name")
            results.extend(_test_results(test, cat_name, iteration, formats))
    fmt = (
        "dcgm4"
        if "dcgm4" in formats
        else "dcgm3"
        if "dcgm3" in formats
        else "dcgm2"
        if "dcgm2" in formats
        else "none"
    )
    return DiagReport(
        results=tuple(results),
        format=fmt,
        dcgm_version=str(version) if version else None,
        driver_version=str(driver) if driver else None,
        runtime_error=str(runtime_error) if runtime_error else None,
    )


def _test_results(
    test: dict[str, Any], category: str, iteration: int | None, formats: set[str]
) -> list[DiagEntityResult]:
    name = str(test["name"])
    entries = test.get("results", [])
    if not isinstance(entries, list):
        raise ParseError(f"dcgmi diag JSON: results of test {name!r} is not a list")
    summary = test.get("test_summary")
    if not entries and isinstance(summary, dict) and "status" in summary:
        entries = [summary]  # DCGM 4: a test with no per-entity result still has a summary
    # DCGM 4 puts test-wide notes ("SRAM Threshold checking was skipped") in the summary only
    summary_info = summary.get("info") if isinstance(summary, dict) else None
    extra_info = (
        tuple(str(i) for i in summary_info)
        if isinstance(summary_info, list)
        else ((str(summary_info),) if summary_info else ())
    )
    out: list[DiagEntityResult] = []
    for entry in entries:
        if not isinstance(entry, dict) or "status" not in entry:
            raise ParseError(
                f"dcgmi diag JSON: a result of test {name!r} has no status: {str(entry)[:120]}"
            )
        for group, entity_id, fmt in _entities(entry, name):
            formats.add(fmt)
            result = _entity_result(entry, name, category, group, entity_id, iteration)
            missing = tuple(i for i in extra_info if i not in result.info)
            if missing and entry is not summary:
                result = dataclasses.replace(result, info=result.info + missing)
            out.append(result)
    return out


def _entities(entry: dict[str, Any], test: str) -> list[tuple[str, int | None, str]]:
    """(entity group, entity id, format) for each entity a result names."""
    try:
        if "entity_group" in entry or "entity_id" in entry:
            group = str(entry.get("entity_group", "GPU"))
            entity = entry.get("entity_id")
            return [(group, None if entity is None else int(entity), "dcgm4")]
        if "gpu_id" in entry:
            return [("GPU", int(entry["gpu_id"]), "dcgm3")]
        if "cpu_id" in entry:
            return [("CPU", int(entry["cpu_id"]), "dcgm3")]
        if "gpu_ids" in entry:
            ids = [p.strip() for p in str(entry["gpu_ids"]).split(",") if p.strip()]
            return [("GPU", int(i), "dcgm2") for i in ids] or [("node", None, "dcgm2")]
    except (TypeError, ValueError) as err:
        raise ParseError(
            f"dcgmi diag JSON: test {test!r} names an entity that is not a number: {err}"
        ) from err
    return [("node", None, "none")]


def _entity_result(
    entry: dict[str, Any],
    test: str,
    category: str,
    group: str,
    entity_id: int | None,
    iteration: int | None,
) -> DiagEntityResult:
    printed = str(entry["status"])
    status = _STATUSES.get(printed.strip().lower(), "unknown")
    warnings = _warnings(entry.get("warnings"), test)
    info = entry.get("info")
    info_t = (
        tuple(str(i) for i in info) if isinstance(info, list) else ((str(info),) if info else ())
    )
    printed_as_fail = (
        status == "fail" and bool(warnings) and all(w.severity_name == "MONITOR" for w in warnings)
    )
    return DiagEntityResult(
        test=test,
        category=category,
        entity_group=group,
        entity_id=entity_id,
        status="warn" if printed_as_fail else status,
        printed_status=printed,
        warnings=warnings,
        info=info_t,
        iteration=iteration,
        warn_printed_as_fail=printed_as_fail,
    )


def _warnings(raw: Any, test: str) -> tuple[DiagWarning, ...]:
    if raw is None or raw == "":
        return ()
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(DiagWarning(message=item))
        elif isinstance(item, dict):
            # 3.x Deployment tests spell the message key "warnings" (Diag.cpp)
            message = item.get("warning", item.get("warnings", ""))
            out.append(
                DiagWarning(
                    message=str(message),
                    error_id=_int(item.get("error_id")),
                    category=_int(item.get("error_category")),
                    severity=_int(item.get("error_severity")),
                )
            )
        else:
            raise ParseError(
                f"dcgmi diag JSON: a warning of test {test!r} is neither text "
                f"nor an object: {item!r}"
            )
    return tuple(out)


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


__all__ = [
    "DiagReport",
    "DiagEntityResult",
    "DiagWarning",
    "parse_diag_json",
    "error_name",
    "SEVERITIES",
    "CATEGORIES",
    "ERROR_NAMES",
    "SEVERITY_ORDER",
]
