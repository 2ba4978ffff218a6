"""Check ``dcgm_diag``: NVIDIA DCGM's active diagnostic (``dcgmi diag``), graded by its severity.

Runs a level (``params.level`` 1-4; 1 takes seconds, 2 about two minutes, 3 about 15-30, 4 an
hour or more) or named tests (``params.tests``: ``[memory, pcie]``) through DCGM's Python
bindings (:mod:`node_agent.gpu.dcgm`), or through ``dcgmi diag -r N -j`` when only the
command-line tool is installed. Neither: ``skip`` naming the paths searched and the package.
A node whose ports have no DCGM (a stand-in's): ``skip``.

Each test that did not pass on an entity becomes one result on that entity (``gpu:2``; ``node``
for tests that name none), keeping DCGM's error code, category and severity as evidence. The
metric says the worst DCGM severity, which ``graders/rules.yaml`` grades:
``diag_isolate``, ``diag_reset``, ``diag_triage``, ``diag_config``, ``diag_monitor``, and
``diag_fail`` when DCGM gave no usable severity (before DCGM 3.3, or NONE/UNKNOWN). An ISOLATE
whose every error is a volatile double-bit or uncontained memory error (DCGM codes 4, 81) is
``diag_reset``: DCGM's own next step for those is "drain the GPU and reset it or reboot the
node", and the reset applies the row remap the driver recorded (evidence ``graded_as``). The status
is DCGM's (``fail`` or ``warn``; a WARN that dcgmi 3.x printed as "Fail" is ``warn``). A clean
run gives one ``pass`` result, ``diag`` on ``node``.

The diagnostic that could not run (``runtime_error``), output that does not parse, ``dcgmi``
killed at the timeout or exiting non-zero without a readable report: ``error`` on ``node``,
never a pass. (dcgmi exits non-zero whenever a test fails; its JSON is then the finding.)

Params: ``level`` (3), ``tests`` (list or ``"a,b"``), ``gpus`` (list of DCGM GPU ids; default
all), ``iterations`` (1), ``timeout_s`` (default: the check's timeout less a margin), ``dcgmi``
(path to the executable; default from PATH).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from node_agent import proc
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.gpu.dcgm import (
    DcgmError,
    DcgmSource,
    DcgmUnavailable,
    DiagRequest,
    open_dcgm,
    untrusted_hostengine,
)
from node_agent.model import Result, Status
from node_agent.parsers import ParseError
from node_agent.parsers.dcgm_diag import (
    RESET_FIRST_MEMORY_CODES,
    DiagEntityResult,
    DiagReport,
    error_name,
    parse_diag_json,
)

#: said after the reason the node has no DCGM (``ports.dcgm_absent``)
ON_REAL_HARDWARE = "on real hardware this runs `dcgmi diag`"
DCGMI_MISSING = "and no `dcgmi` on PATH either"

#: metric and operator advice per DCGM severity (DCGM "Diagnostic Errors" reference)
_BY_SEVERITY = {
    "ISOLATE": ("diag_isolate", "DCGM says isolate this GPU: drain it and replace it"),
    "RESET": ("diag_reset", "DCGM says drain and reset the GPU, then re-run the diagnostic"),
    "TRIAGE": ("diag_triage", "DCGM says triage: run a field diagnostic, then re-run"),
    "CONFIG": ("diag_config", "DCGM says a setting is wrong: fix it (see the message)"),
    "MONITOR": ("diag_monitor", "DCGM says the GPU may keep working but needs watching"),
}
_UNRATED = ("diag_fail", "DCGM gave no severity: re-run after a reset; escalate if it recurs")
_RANK = {"fail": 2, "unknown": 2, "warn": 1}
_SEV_RANK = {"ISOLATE": 6, "RESET": 5, "TRIAGE": 4, "UNKNOWN": 3, "CONFIG": 2, "MONITOR": 1}

Opener = Callable[[Any], DcgmSource]


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    level: int = 3  # 1-4, unless ``tests`` names tests
    tests: tuple[str, ...] = ()  # a list, or one comma-separated string
    gpus: tuple[int, ...] = ()  # empty: every GPU
    iterations: int = 1
    timeout_s: float | None = None  # None: the check's own timeout, less a margin
    dcgmi: str | None = None  # None: ``dcgmi`` on PATH when DCGM's bindings are missing

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("dcgm_diag", raw, cls)
        listed = r.strings("tests", lone=True)  # "memory, pcie" or [memory, pcie]
        tests = tuple(t.strip() for item in listed for t in item.split(",") if t.strip())
        gpus = r.integers("gpus", 0, "a list of GPU indices")
        params = cls(
            level=r.integer("level", 1, 4),
            tests=tests,
            gpus=gpus,
            iterations=r.integer("iterations", 1),
            timeout_s=r.optional_number("timeout_s", above=0),
            dcgmi=r.optional_string("dcgmi"),
        )
        try:
            params.request()
        except ValueError as err:
            r.fail("tests", list(listed), str(err))
        return params

    def request(self) -> DiagRequest:
        """The diagnostic the suite asks for."""
        return DiagRequest(
            level=None if self.tests else self.level,
            tests=self.tests,
            gpus=self.gpus,
            iterations=self.iterations,
        )


def diag_timeout_s(ctx: CheckContext) -> float:
    """How long DCGM may take: ``params.timeout_s``, within the time left before the runner's
    deadline for the check (leaving it time to read and report what came back)."""
    ceiling = max(1.0, ctx.remaining_s(min(30.0, ctx.timeout_s * 0.1)))
    wanted = ctx.typed_params(Params).timeout_s
    return min(wanted, ceiling) if wanted else ceiling


def dcgm_unready(ctx: CheckContext, on_real_hardware: str) -> list[Result] | None:
    """What a DCGM check reports when it cannot ask DCGM: a skip naming why the node has no
    DCGM (``ports.dcgm_absent``, then ``on_real_hardware``), or why its GPUs cannot be
    queried (:meth:`CheckContext.gpus_unavailable`); None when it can ask."""
    if ctx.ports.dcgm_absent is not None:
        return [ctx.skip(f"{ctx.ports.dcgm_absent}; {on_real_hardware}")]
    return ctx.gpus_unavailable()


def run(ctx: CheckContext, opener: Opener = open_dcgm) -> list[Result]:
    if unready := dcgm_unready(ctx, ON_REAL_HARDWARE):
        return unready
    params = ctx.typed_params(Params)
    request = params.request()
    timeout_s = diag_timeout_s(ctx)
    try:
        source = opener(ctx.config)
    except DcgmUnavailable as err:
        dcgmi = params.dcgmi or proc.which("dcgmi")
        if not dcgmi:
            return [ctx.skip(f"{err}; {DCGMI_MISSING}")]
        return run_cli(ctx, str(dcgmi), request, timeout_s)
    except DcgmError as err:
        return [ctx.result("node", "diag", Status.ERROR, str(err))]
    try:
        report = source.run_diag(request, timeout_s)
    except DcgmError as err:
        return [
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                f"DCGM diagnostic -r {request.run_arg} did not complete: {err}",
                via=f"bindings, {source.connection}",
            )
        ]
    finally:
        source.close()
    return results_from_report(ctx, report, request, via=f"bindings, {source.connection}")


def dcgmi_argv(dcgmi: str, request: DiagRequest, host: str | None = None) -> list[str]:
    """``dcgmi diag -r 3 -j [-i 0,1] [--iterations N] [--host H]``.

    Without ``--host`` dcgmi tries the local host engine and starts an embedded one when none
    answers; an explicit host is passed only when the config names another one.
    """
    argv = [dcgmi, "diag", "-r", request.run_arg, "-j"]
    if request.gpus:
        argv += ["-i", ",".join(str(g) for g in request.gpus)]
    if request.iterations > 1:
        argv += ["--iterations", str(request.iterations)]
    if host and host not in ("localhost", "127.0.0.1", "embedded"):
        argv += ["--host", host]
    return argv


def run_cli(ctx: CheckContext, dcgmi: str, request: DiagRequest, timeout_s: float) -> list[Result]:
    """Run ``dcgmi diag -j`` and grade its JSON; every way it can break is an ``error``."""
    argv = dcgmi_argv(dcgmi, request, ctx.config.dcgm.hostengine)
    if distrust := _untrusted(ctx):
        return [_not_asked(ctx, f"dcgmi diag was not run: {distrust}", argv)]
    res = proc.run(argv, timeout_s)
    if distrust := _untrusted(ctx):
        return [
            _not_asked(ctx, f"dcgmi diag's answer was not read: after it ran, {distrust}", argv)
        ]
    ev: dict[str, Any] = {"via": "dcgmi", "argv": argv, "returncode": res.returncode}
    if res.timed_out or res.not_found or (res.returncode is None):
        return [
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                f"dcgmi diag: {res.describe_failure()}"
                + (" (raise the suite's timeout_s for this level)" if res.timed_out else ""),
                stderr_tail=res.stderr[-600:],
                **ev,
            )
        ]
    try:
        report = parse_diag_json(res.stdout)
    except ParseError as err:
        why = (
            f"dcgmi diag: {res.describe_failure()}; its output is not a readable report ({err})"
            if not res.ok
            else f"cannot read dcgmi diag's JSON: {err}"
        )
        return [
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                why,
                stdout_tail=res.stdout[-600:],
                stderr_tail=res.stderr[-600:],
                **ev,
            )
        ]
    results = results_from_report(ctx, report, request, via="dcgmi")
    if not res.ok and not any(
        r.status in (Status.FAIL, Status.WARN, Status.ERROR) for r in results
    ):
        # a clean report from a dcgmi that says it failed: believe the failure, not the pass
        return [
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                f"dcgmi diag: {res.describe_failure()}, although its report shows "
                "no failed test; re-run it by hand to see why",
                stdout_tail=res.stdout[-600:],
                **ev,
            )
        ]
    for r in results:
        r.duration_s = res.duration_s
    return results


def results_from_report(
    ctx: CheckContext, report: DiagReport, request: DiagRequest, via: str
) -> list[Result]:
    """One result per failed test and entity; one ``pass`` when DCGM found nothing."""
    base: dict[str, Any] = {
        "via": via,
        "run": request.run_arg,
        "dcgm_version": report.dcgm_version,
        "driver_version": report.driver_version,
        "format": report.format,
    }
    if report.runtime_error:
        return [
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                f"DCGM could not run the diagnostic -r {request.run_arg}: {report.runtime_error}",
                **base,
            )
        ]
    out = [_finding(ctx, f, iters, base) for f, iters in _merge(report.findings)]
    if report.overall and report.overall.lower() == "fail" and not out:
        out.append(
            ctx.result(
                "node",
                "diag",
                Status.ERROR,
                f"dcgmi diag --iterations reported Overall Result Fail "
                f"({report.overall_warning or 'no reason given'}) but no failed "
                "test; re-run it by hand",
                **base,
            )
        )
    if out:
        return out
    ran = [r for r in report.results if r.status == "pass"]
    skipped = sorted({f"{r.test} ({r.target})" for r in report.results if r.status == "skip"})
    if not ran:
        return [
            ctx.skip(
                f"DCGM ran no test for -r {request.run_arg}: every test was skipped "
                f"({', '.join(skipped[:10]) or 'none reported'})",
                metric="diag",
            )
        ]
    tests = sorted({r.test for r in ran})
    targets = sorted({r.target for r in ran})
    iterations = f" x{report.iterations}" if report.iterations > 1 else ""
    return [
        ctx.result(
            "node",
            "diag",
            Status.PASS,
            f"DCGM diagnostic -r {request.run_arg}{iterations}: {len(tests)} tests "
            f"passed on {len(targets)} entities",
            value=len(tests),
            unit="tests",
            tests=tests,
            targets=targets,
            skipped=skipped,
            iterations=report.iterations,
            **base,
        )
    ]


def _merge(findings: tuple[DiagEntityResult, ...]) -> list[tuple[DiagEntityResult, list[int]]]:
    """One finding per (test, target), the worst over iterations, with the iterations seen."""
    worst: dict[tuple[str, str], DiagEntityResult] = {}
    seen: dict[tuple[str, str], list[int]] = {}
    for f in findings:
        key = (f.test, f.target)
        seen.setdefault(key, [])
        if f.iteration is not None:
            seen[key].append(f.iteration)
        old = worst.get(key)
        if old is None or _rank(f) > _rank(old):
            worst[key] = f
    return [(worst[k], seen[k]) for k in worst]


def _rank(f: DiagEntityResult) -> tuple[int, int]:
    return (_SEV_RANK.get(f.worst_severity or "", 0), _RANK.get(f.status, 0))


def _graded_severity(f: DiagEntityResult) -> str | None:
    """DCGM's worst severity, but RESET where every ISOLATE error is an uncorrectable memory
    error: DCGM's own next step for those is a reset, which applies the recorded row remap."""
    severity = f.worst_severity
    isolating = {w.error_id for w in f.warnings if w.severity_name == "ISOLATE"}
    if severity == "ISOLATE" and isolating <= RESET_FIRST_MEMORY_CODES:
        return "RESET"
    return severity


def _finding(
    ctx: CheckContext, f: DiagEntityResult, iterations: list[int], base: dict[str, Any]
) -> Result:
    severity = f.worst_severity
    lead = next((w for w in f.warnings if w.severity_name == severity), None) or (
        f.warnings[0] if f.warnings else None
    )
    graded = _graded_severity(f)
    metric, advice = _BY_SEVERITY.get(graded or "", _UNRATED)
    code = lead.error_id if lead else None
    evidence = {
        **base,
        "test": f.test,
        "category": f.category,
        "dcgm_status": f.printed_status,
        "error_id": code,
        "error_name": error_name(code),
        "error_category": lead.category_name if lead else None,
        "error_severity": severity,
        "errors": [
            {
                "message": w.message,
                "error_id": w.error_id,
                "error_name": error_name(w.error_id),
                "category": w.category_name,
                "severity": w.severity_name,
            }
            for w in f.warnings
        ],
        "info": list(f.info),
    }
    if graded != severity:
        evidence["graded_as"] = graded
    if f.warn_printed_as_fail:
        evidence["note"] = (
            "dcgmi printed this WARN as 'Fail' (DCGM 3.x prints only Pass, "
            "Skip or Fail); every error on it is severity MONITOR"
        )
    if iterations:
        evidence["iterations_with_finding"] = [i + 1 for i in iterations]
    if f.status == "unknown":
        return ctx.result(
            f.target,
            "diag",
            Status.ERROR,
            f"DCGM test {f.test!r} on {f.target} has status {f.printed_status!r}, "
            "which node-agent does not know; read the evidence",
            **evidence,
        )
    status = Status.WARN if f.status == "warn" else Status.FAIL
    message = lead.message if lead else "no message"
    code_text = f"DCGM error {code} {error_name(code)}" if code is not None else "no error code"
    sev_text = f"severity {severity}" if severity else "no severity"
    detail = (
        f"DCGM diag {f.test} {'warned' if status is Status.WARN else 'failed'} on "
        f"{f.target}: {message} ({code_text}, {sev_text}"
        + (f", category {lead.category_name}" if lead and lead.category_name else "")
        + f"); {advice}"
    )
    return ctx.result(f.target, metric, status, detail, value=code, **evidence)


def _untrusted(ctx: CheckContext) -> str | None:
    """dcgmi asks whoever holds the host engine's port: it runs only while root's engine (or
    ``dcgm.hostengine_users``') holds it, before and after (docs/dcgm.md)."""
    dcgm = ctx.config.dcgm
    return untrusted_hostengine(dcgm.hostengine, dcgm.hostengine_users)


def _not_asked(ctx: CheckContext, why: str, argv: list[str]) -> Result:
    return ctx.result(
        "node",
        "diag",
        Status.ERROR,
        f"{why}; dcgmi asks whatever listens there, even another user's program: start "
        "nv-hostengine (`systemctl start nvidia-dcgm`), or install DCGM's Python bindings for "
        "an engine of the agent's own",
        via="dcgmi",
        argv=argv,
    )
