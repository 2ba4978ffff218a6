"""The dcgm_diag and dcgm_health checks, and the DCGM backend's translation of the bindings.

No DCGM and no GPU exist where these tests run, so DCGM is replaced at its boundary: a fake
:class:`~node_agent.gpu.dcgm.DcgmSource` for the bindings path (returning what the real
bindings return, in the same model the ``dcgmi`` JSON parser gives), fake ``pydcgm`` /
``dcgm_agent`` modules for the backend's own translation code, and a stand-in ``dcgmi``
executable in tmp_path that prints a fixture, exits non-zero, or hangs.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from dcgm_fakes import FakeDCGMError, fake_bindings  # tests/dcgm_fakes.py

from node_agent.checking.context import HOST_PORTS, CheckContext
from node_agent.checking.ports import STAND_IN_NO_DCGM, Ports
from node_agent.checks import dcgm_diag, dcgm_health
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.gpu.dcgm import (
    BINDINGS_PATHS,
    BindingsDcgm,
    DcgmCallError,
    DcgmConnectError,
    DcgmSource,
    DcgmTimeout,
    DcgmUnavailable,
    DiagRequest,
    HealthIncident,
    HealthReport,
    health_mask,
    open_dcgm,
    report_from_response,
)
from node_agent.grading.rules import load_grader
from node_agent.model import Level, Status
from node_agent.parsers.dcgm_diag import (
    DiagEntityResult,
    DiagReport,
    DiagWarning,
    parse_diag_json,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "dcgm"
GRADER = load_grader(REPO / "graders")


class RealLikeGpus:
    """A GPU backend that is present (the DCGM checks only ask that; whether DCGM is there is
    the node's ports')."""

    name = "fake"
    simulated = False
    unavailable_reason = None
    broken = False

    def devices(self):
        return []


class FakeDcgm:
    """DcgmSource fake: returns the report it was given, records what the check asked."""

    def __init__(
        self,
        report: DiagReport | None = None,
        health: HealthReport | None = None,
        diag_error: Exception | None = None,
        connection: str = "host engine at localhost",
    ) -> None:
        self.connection = connection
        self.report, self.health, self.diag_error = report, health, diag_error
        self.requests: list[tuple[DiagRequest, float]] = []
        self.masks: list[int] = []
        self.checks = 0
        self.closed = False

    def run_diag(self, request, timeout_s):
        self.requests.append((request, timeout_s))
        if self.diag_error:
            raise self.diag_error
        return self.report

    def set_health_watches(self, systems):
        self.masks.append(systems)

    def check_health(self):
        self.checks += 1
        return self.health

    def close(self):
        self.closed = True


def ctx_for(
    check: str, gpu=None, timeout_s: float = 60.0, ports: Ports = HOST_PORTS, config=None, **params
) -> CheckContext:
    return CheckContext(
        check=check,
        gpu=gpu or RealLikeGpus(),
        kernel_log=None,
        config=config or config_from_dict({}),
        inventory=None,
        sku=None,
        expected_gpus=None,
        params=params,
        timeout_s=timeout_s,
        ports=ports,
    )


def opener_of(source):
    return lambda config: source


def no_bindings(config):
    raise DcgmUnavailable("DCGM Python bindings not found (searched /nowhere): install DCGM")


def fixture(name: str) -> DiagReport:
    return parse_diag_json((DATA / name).read_text())


def test_fake_satisfies_the_dcgm_source_protocol():
    assert isinstance(FakeDcgm(), DcgmSource)


# -- dcgm_diag through the bindings (fake) ------------------------------------------------------


def test_failed_memory_test_on_gpu2_grades_fault_naming_gpu_test_and_dcgm_error_code():
    source = FakeDcgm(fixture("dcgm3_r3_memory_fail.json"))
    results = dcgm_diag.run(ctx_for("dcgm_diag", level=3), opener=opener_of(source))
    (finding,) = results
    assert (finding.target, finding.metric, finding.status) == (
        "gpu:2",
        "diag_isolate",
        Status.FAIL,
    )
    assert finding.evidence["test"] == "GPU Memory"
    assert finding.evidence["error_id"] == 58
    assert finding.evidence["error_name"] == "DCGM_FR_MEMORY_MISMATCH"
    assert finding.evidence["error_category"] == "HARDWARE_MEMORY"
    assert finding.evidence["error_severity"] == "ISOLATE"
    assert finding.evidence["via"] == "bindings, host engine at localhost"
    grade = GRADER.grade(results)
    assert grade.level is Level.FAULT
    (reason,) = grade.reasons
    assert (reason.rule, reason.target) == ("dcgm-diag-isolate", "gpu:2")
    assert "GPU Memory" in reason.message and "DCGM error 58" in reason.message
    assert source.closed
    assert source.requests[0][0] == DiagRequest(level=3)


ISOLATE, RESET = 2, 6  # dcgm_errors.h severities


@pytest.mark.parametrize(
    ("errors", "metric", "level"),
    [
        ([(4, ISOLATE)], "diag_reset", Level.ERROR),
        ([(81, ISOLATE), (4, ISOLATE)], "diag_reset", Level.ERROR),
        ([(4, ISOLATE), (58, ISOLATE)], "diag_isolate", Level.FAULT),
        ([(80, ISOLATE)], "diag_isolate", Level.FAULT),
    ],
)
def test_a_diagnostic_that_isolates_for_a_double_bit_error_alone_resets_first(
    errors, metric, level
):
    """DCGM rates a volatile double-bit (4) or uncontained (81) memory error ISOLATE, and its
    own next step for it is "drain the GPU and reset it or reboot the node": the reset applies
    the row remap the driver recorded. One such error was a replacement. A memory miscompare
    (58) or a row-remap failure (80) beside it still isolates the GPU."""
    found = DiagEntityResult(
        test="GPU Memory",
        category="Hardware",
        entity_group="GPU",
        entity_id=1,
        status="fail",
        printed_status="Fail",
        warnings=tuple(DiagWarning(f"DCGM error {c}", error_id=c, severity=v) for c, v in errors),
    )
    source = FakeDcgm(DiagReport(results=(found,), format="dcgm4"))
    results = dcgm_diag.run(ctx_for("dcgm_diag", level=3), opener=opener_of(source))
    (finding,) = results
    assert finding.metric == metric and finding.evidence["error_severity"] == "ISOLATE"
    assert finding.evidence.get("graded_as") == ("RESET" if level is Level.ERROR else None)
    assert GRADER.grade(results).level is level


def test_failed_memory_test_without_severity_dcgm2_grades_error_on_gpu2():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag"), opener=opener_of(FakeDcgm(fixture("dcgm2_r2_memory_fail.json")))
    )
    (finding,) = results
    assert (finding.target, finding.metric) == ("gpu:2", "diag_fail")
    grade = GRADER.grade(results)
    assert grade.level is Level.ERROR
    assert grade.reasons[0].rule == "dcgm-diag-failed-unrated"


def test_passing_diag_adds_one_pass_and_nothing_to_the_grade():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag"), opener=opener_of(FakeDcgm(fixture("dcgm4_r3_pass.json")))
    )
    (summary,) = results
    assert (summary.target, summary.metric, summary.status) == ("node", "diag", Status.PASS)
    assert summary.evidence["targets"] == [f"gpu:{i}" for i in range(8)]
    assert GRADER.grade(results).level is Level.HEALTHY


def test_severities_isolate_reset_monitor_grade_fault_error_warn_per_gpu():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag"), opener=opener_of(FakeDcgm(fixture("dcgm4_r3_memory_isolate.json")))
    )
    grade = GRADER.grade(results)
    levels = {r.target: (r.rule, r.level) for r in grade.reasons}
    assert levels == {
        "gpu:2": ("dcgm-diag-isolate", Level.FAULT),
        "gpu:6": ("dcgm-diag-reset", Level.ERROR),
        "gpu:4": ("dcgm-diag-monitor", Level.WARN),
    }
    assert grade.level is Level.FAULT


def test_warn_printed_as_fail_grades_warn_and_says_so():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag"),
        opener=opener_of(FakeDcgm(fixture("dcgm3_r2_warn_printed_as_fail.json"))),
    )
    pcie = next(r for r in results if r.target == "gpu:5")
    assert (pcie.metric, pcie.status) == ("diag_monitor", Status.WARN)
    assert "printed this WARN as 'Fail'" in pcie.evidence["note"]
    persistence = next(r for r in results if r.target == "gpu:0")
    assert persistence.metric == "diag_config"
    # MONITOR and CONFIG are both WARN: nothing here drains the node
    assert GRADER.grade(results).level is Level.WARN


def test_iterations_failure_is_one_result_naming_the_failing_iteration():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag", level=1, iterations=3),
        opener=opener_of(FakeDcgm(fixture("dcgm4_r1_iterations_fail.json"))),
    )
    (finding,) = results
    assert (finding.target, finding.metric) == ("gpu:1", "diag_reset")
    assert finding.evidence["iterations_with_finding"] == [2]
    assert GRADER.grade(results).level is Level.ERROR


def test_runtime_error_is_an_error_result_and_blocks_delivery():
    results = dcgm_diag.run(
        ctx_for("dcgm_diag"), opener=opener_of(FakeDcgm(fixture("dcgm4_runtime_error.json")))
    )
    (err,) = results
    assert err.status is Status.ERROR
    assert "paused" in err.detail
    assert GRADER.grade(results, mode="delivery").level is Level.ERROR


def test_bindings_timeout_is_an_error_result_not_a_crash():
    source = FakeDcgm(diag_error=DcgmTimeout("DCGM diagnostic did not return within 5 s"))
    (err,) = dcgm_diag.run(ctx_for("dcgm_diag"), opener=opener_of(source))
    assert (err.status, err.metric) == (Status.ERROR, "diag")
    assert "did not return" in err.detail
    assert source.closed


def test_bindings_present_but_no_host_engine_is_an_error_not_a_skip():
    def broken(config):
        raise DcgmConnectError("DCGM bindings in /x load, but no host engine answered")

    (err,) = dcgm_diag.run(ctx_for("dcgm_diag"), opener=broken)
    assert err.status is Status.ERROR


def test_named_tests_param_runs_those_tests_instead_of_a_level():
    source = FakeDcgm(fixture("dcgm4_r3_pass.json"))
    dcgm_diag.run(ctx_for("dcgm_diag", tests="memory, pcie"), opener=opener_of(source))
    ((request, _),) = source.requests
    assert request.run_arg == "memory,pcie"


def test_diag_timeout_stays_inside_the_checks_own_timeout():
    source = FakeDcgm(fixture("dcgm4_r3_pass.json"))
    dcgm_diag.run(ctx_for("dcgm_diag", timeout_s=3600), opener=opener_of(source))
    ((_, timeout_s),) = source.requests
    assert 0 < timeout_s < 3600


def test_diag_timeout_is_what_is_left_before_the_runners_deadline():
    """A check started 3500 s into its 3600 s (the runner's deadline is 100 s away) gives DCGM
    those 100 s less the margin, never the whole timeout again."""
    source = FakeDcgm(fixture("dcgm4_r3_pass.json"))
    ctx = ctx_for("dcgm_diag", timeout_s=3600)
    ctx.deadline = time.monotonic() + 100.0
    dcgm_diag.run(ctx, opener=opener_of(source))
    ((_, timeout_s),) = source.requests
    assert 0 < timeout_s <= 100.0 - 30.0


@pytest.mark.parametrize(
    "params", [{"level": 7}, {"level": "three"}, {"iterations": 0}, {"tests": ["memory;rm"]}]
)
def test_bad_suite_params_are_refused_naming_the_param(params):
    """Parsed when the suite loads (tests/unit/test_check_params.py: exit 2, nothing run)."""
    with pytest.raises(ValueError, match=f"params of dcgm_diag: {next(iter(params))} "):
        dcgm_diag.Params.parse(params)


# -- skips ---------------------------------------------------------------------------------------


def test_no_bindings_and_no_dcgmi_skips_naming_paths_searched_and_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dcgmi anywhere
    opener = lambda config: open_dcgm(config, candidates=[tmp_path / "absent"])  # noqa: E731
    (skip,) = dcgm_diag.run(ctx_for("dcgm_diag"), opener=opener)
    assert skip.status is Status.SKIP
    assert str(tmp_path / "absent") in skip.detail
    assert "datacenter-gpu-manager" in skip.detail and "dcgmi" in skip.detail
    (hskip,) = dcgm_health.run(ctx_for("dcgm_health"), opener=opener)
    assert hskip.status is Status.SKIP and "datacenter-gpu-manager" in hskip.detail


def test_default_search_names_the_configured_path_then_the_package_paths(tmp_path):
    if any((p / "pydcgm.py").exists() for p in BINDINGS_PATHS):
        pytest.skip("this host has DCGM installed; the search would find it")
    config = config_from_dict({"dcgm": {"bindings_path": str(tmp_path / "mine")}})
    with pytest.raises(DcgmUnavailable) as err:
        open_dcgm(config, candidates=None, loader=lambda p: pytest.fail("nothing to load"))
    text = str(err.value)
    assert text.index(str(tmp_path / "mine")) < text.index(str(BINDINGS_PATHS[0]))
    assert all(str(p) in text for p in BINDINGS_PATHS)


def test_configured_bindings_path_is_where_the_bindings_are_loaded_from(tmp_path):
    (tmp_path / "pydcgm.py").write_text("")
    loaded = []

    def loader(path):
        loaded.append(path)
        raise DcgmConnectError("stop here")

    with pytest.raises(DcgmConnectError):
        open_dcgm(config_from_dict({"dcgm": {"bindings_path": str(tmp_path)}}), loader=loader)
    assert loaded == [tmp_path]


@pytest.mark.parametrize("module", [dcgm_diag, dcgm_health])
def test_node_without_dcgm_port_skips_with_reason(module):
    ports = Ports(dcgm_absent=STAND_IN_NO_DCGM)
    (skip,) = module.run(
        ctx_for(module.__name__.rsplit(".", 1)[1], ports=ports),
        opener=lambda c: pytest.fail("a stand-in node must not open DCGM"),
    )
    assert skip.status is Status.SKIP and skip.detail.startswith(STAND_IN_NO_DCGM)
    assert skip.detail.endswith(module.ON_REAL_HARDWARE)


@pytest.mark.parametrize("module", [dcgm_diag, dcgm_health])
def test_host_without_gpu_driver_skips_before_touching_dcgm(module):
    (skip,) = module.run(
        ctx_for("x", gpu=AbsentGpuBackend("no NVIDIA driver")),
        opener=lambda c: pytest.fail("no GPU: DCGM must not be opened"),
    )
    assert skip.status is Status.SKIP and "no NVIDIA driver" in skip.detail


# -- dcgm_diag through a stand-in dcgmi --------------------------------------------------------


def stand_in_dcgmi(tmp_path: Path, body: str) -> Path:
    """An executable named dcgmi that records its argv and then runs ``body`` (sh)."""
    path = tmp_path / "dcgmi"
    path.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/argv"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def engine_port():
    """A port of this host held by the account the tests run as (root in CI), standing for the
    host engine's: the stand-in bindings, or dcgmi, answer in its place (no DCGM here)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def our_engine_config(port):
    me = pwd.getpwuid(os.getuid()).pw_name
    return config_from_dict({"dcgm": {"hostengine": f"127.0.0.1:{port}", "hostengine_users": [me]}})


@pytest.fixture
def run_cli(tmp_path, engine_port):
    """dcgm_diag through a stand-in ``dcgmi`` running ``body``, the host engine's port ours."""

    def run(body, timeout_s=60.0, **params):
        dcgmi = stand_in_dcgmi(tmp_path, body)
        ctx = ctx_for(
            "dcgm_diag",
            timeout_s=timeout_s,
            config=our_engine_config(engine_port),
            dcgmi=str(dcgmi),
            **params,
        )
        return dcgm_diag.run(ctx, opener=no_bindings)

    run.host = ["--host", f"127.0.0.1:{engine_port}"]
    return run


def test_dcgmi_cli_json_with_failed_memory_test_grades_fault_on_gpu2(tmp_path, run_cli):
    # dcgmi exits non-zero whenever a test fails; its JSON is then the finding
    results = run_cli(f'cat "{DATA / "dcgm4_r3_memory_isolate.json"}"\nexit 226')
    assert (tmp_path / "argv").read_text().split() == ["diag", "-r", "3", "-j", *run_cli.host]
    memory = next(r for r in results if r.evidence.get("test") == "memory")
    assert (memory.target, memory.metric, memory.evidence["via"]) == (
        "gpu:2",
        "diag_isolate",
        "dcgmi",
    )
    assert memory.evidence["error_id"] == 58
    assert GRADER.grade(results).level is Level.FAULT


def test_dcgmi_cli_passing_run_is_a_pass(tmp_path, run_cli):
    results = run_cli(f'cat "{DATA / "dcgm4_r3_pass.json"}"', level=2, gpus=[0, 1])
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["diag", "-r", "2", "-j", "-i", "0,1", *run_cli.host]
    assert [r.status for r in results] == [Status.PASS]


def test_dcgmi_truncated_json_is_an_error_not_a_pass(tmp_path, run_cli):
    (err,) = run_cli(f'cat "{DATA / "dcgm4_truncated.json"}"')
    assert err.status is Status.ERROR
    assert "truncated or malformed" in err.detail


def test_dcgmi_exiting_nonzero_without_json_is_an_error_with_its_stderr(tmp_path, run_cli):
    (err,) = run_cli(
        'echo "Error: unable to establish a connection to the host engine" >&2\nexit 1'
    )
    assert err.status is Status.ERROR
    assert "exited 1" in err.detail and "host engine" in err.detail


def test_dcgmi_exiting_nonzero_with_a_clean_report_is_still_an_error(tmp_path, run_cli):
    (err,) = run_cli(f'cat "{DATA / "dcgm4_r3_pass.json"}"\nexit 3')
    assert err.status is Status.ERROR and "exited 3" in err.detail


def test_dcgmi_that_hangs_is_killed_at_the_checks_timeout_and_is_an_error(tmp_path, run_cli):
    (err,) = run_cli("exec sleep 60", timeout_s=2.0)
    assert err.status is Status.ERROR
    assert "did not finish" in err.detail


def test_dcgmi_on_path_is_used_when_no_bindings(tmp_path, monkeypatch, engine_port):
    stand_in_dcgmi(tmp_path, f'cat "{DATA / "dcgm4_r3_pass.json"}"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    ctx = ctx_for("dcgm_diag", config=our_engine_config(engine_port))
    (result,) = dcgm_diag.run(ctx, opener=no_bindings)
    assert result.status is Status.PASS and result.evidence["via"] == "dcgmi"


def test_dcgmi_is_not_run_while_nothing_holds_the_host_engines_port(tmp_path):
    """dcgmi asks whatever listens on the port first: with nothing there, whoever binds it
    next would answer the diagnostic."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dcgmi = stand_in_dcgmi(tmp_path, f'cat "{DATA / "dcgm4_r3_memory_isolate.json"}"')
    config = config_from_dict({"dcgm": {"hostengine": f"127.0.0.1:{port}"}})
    ctx = ctx_for("dcgm_diag", config=config, dcgmi=str(dcgmi))
    (err,) = dcgm_diag.run(ctx, opener=no_bindings)
    assert err.status is Status.ERROR and not (tmp_path / "argv").exists()
    assert f"not run: nothing listens on port {port} of this host" in err.detail
    assert "systemctl start nvidia-dcgm" in err.detail


def test_dcgmi_argv_passes_iterations_and_a_remote_host_only():
    argv = dcgm_diag.dcgmi_argv("dcgmi", DiagRequest(level=1, iterations=3), "10.0.0.5")
    assert argv == ["dcgmi", "diag", "-r", "1", "-j", "--iterations", "3", "--host", "10.0.0.5"]
    assert "--host" not in dcgm_diag.dcgmi_argv("dcgmi", DiagRequest(), "localhost")


# -- dcgm_health -----------------------------------------------------------------------------


def incident(system, health, code, gpu, message="m"):
    return HealthIncident(
        system=system, health=health, error_code=code, message=message, entity_id=gpu
    )


def test_health_sets_the_default_watches_and_reports_no_incident_as_pass():
    source = FakeDcgm(health=HealthReport(overall="pass"))
    (result,) = dcgm_health.run(ctx_for("dcgm_health"), opener=opener_of(source))
    assert result.status is Status.PASS
    assert source.masks == [health_mask(dcgm_health.DEFAULT_SYSTEMS)]
    assert source.masks[0] == 0x1 | 0x10 | 0x40 | 0x80 | 0x100 | 0x2 | 0x200
    assert source.closed


def test_health_incidents_grade_by_subsystem_and_keep_dcgm_code_and_message():
    report = HealthReport(
        overall="fail",
        incidents=(
            incident("mem", "fail", 4, 3, "Detected 2 volatile double-bit ECC error(s) in GPU 3."),
            incident(
                "mem",
                "warn",
                85,
                1,
                "GPU 1 had uncorrectable memory errors and row remapping is pending.",
            ),
            incident("pcie", "warn", 3, 5, "Detected more than 8 PCIe replays per minute"),
            incident("thermal", "fail", 42, 0, "Temperature is too high"),
            incident("power", "pass", None, 0, ""),
        ),
    )
    results = dcgm_health.run(ctx_for("dcgm_health"), opener=opener_of(FakeDcgm(health=report)))
    by_target = {r.target: r for r in results}
    assert set(by_target) == {"gpu:3", "gpu:1", "gpu:5", "gpu:0"}  # the PASS is not a finding
    dbe = by_target["gpu:3"]
    assert (dbe.metric, dbe.status, dbe.evidence["error_code"]) == (
        "health_mem_uncorrectable",
        Status.FAIL,
        4,
    )
    assert dbe.evidence["error_name"] == "DCGM_FR_VOLATILE_DBE_DETECTED"
    assert "double-bit" in dbe.detail
    assert by_target["gpu:1"].metric == "health_reset_pending"
    grade = GRADER.grade(results, mode="service")
    levels = {r.target: (r.rule, r.level) for r in grade.reasons}
    assert levels == {
        "gpu:3": ("dcgm-health-uncorrectable-memory", Level.ERROR),
        "gpu:1": ("dcgm-health-reset-pending", Level.ERROR),
        "gpu:5": ("dcgm-health-warn", Level.WARN),
        "gpu:0": ("dcgm-health-fail", Level.ERROR),
    }


@pytest.mark.parametrize(
    "system, code, message, metric, level",
    [
        (
            "nvlink",
            123,
            "GPU 0: Fabric State is Not Started (2).",
            "health_fabric_service",
            "ERROR",
        ),
        ("nvlink", 123, "GPU 0: Fabric State is NvmlTooOld (5).", "health_fabric_service", "ERROR"),
        ("nvlink", 122, "IMEX domain status is DEGRADED", "health_fabric_service", "ERROR"),
        ("nvlink", 71, "Detected 1 NvLink recovery error(s)", "health_nvlink_errors", "WARN"),
        ("nvlink", 14, "GPU 0's NvLink link 3 is currently down", "health_nvlink", "ERROR"),
        (
            "mem",
            4,
            "Detected 1 volatile double-bit ECC error(s)",
            "health_mem_uncorrectable",
            "ERROR",
        ),
        ("mem", 81, "GPU 0 had an uncontained error", "health_mem_uncorrectable", "ERROR"),
        ("mem", 80, "GPU 0 had a row remap failure", "health_mem", "FAULT"),
        ("inforom", 9, "A corrupt InfoROM has been detected in GPU 0.", "health_inforom", "ERROR"),
        ("nvswitch_fatal", 15, "Detected a fatal NVSwitch error", "health_nvswitch_fatal", "ERROR"),
        ("mem", 8, "Retired pages DBE limit reached", "health_mem", "FAULT"),
    ],
)
def test_one_health_fail_is_graded_by_dcgms_error_code_and_only_a_part_is_faulted(
    system, code, message, metric, level
):
    """One poll's FAIL under the NVLink watch was FAULT, a replacement: Fabric Manager not
    started (DCGM's own advice: start it), the IMEX domain degraded, one recovery error (DCGM
    fails on one). By DCGM's error code: a service is an ERROR held for an operator, counted
    link errors a WARN, a link down an ERROR. A double-bit or uncontained memory error was FAULT
    too, where DCGM's own advice is "drain the GPU and reset it or reboot the node" (the reset
    applies the row remap the driver recorded): an ERROR, restarted, escalated if it comes back.
    A row-remap failure and retired pages at their limit, NVIDIA's memory RMA criteria, stay
    FAULT. A corrupt InfoROM was FAULT too, where DCGM's next step is to flash it (held for an
    operator), and a fatal NVSwitch error, which the SXid catalog grades ERROR."""
    report = HealthReport(overall="fail", incidents=(incident(system, "fail", code, 0, message),))
    results = dcgm_health.run(ctx_for("dcgm_health"), opener=opener_of(FakeDcgm(health=report)))
    (found,) = results
    grade = GRADER.grade(results, mode="service")
    assert (found.metric, grade.level.name) == (metric, level)
    if metric in ("health_fabric_service", "health_inforom"):
        assert grade.reasons[0].remedy is not None  # held for an operator, never replaced


def test_health_watch_as_periodic_source_sets_watches_once_and_polls_each_time():
    source = FakeDcgm(health=HealthReport(overall="pass"))
    watch = dcgm_health.HealthWatch(source, ["mem", "nvlink"])
    watch.poll()
    report = watch.poll()
    assert source.masks == [0x10 | 0x2] and source.checks == 2
    assert report.systems == ("mem", "nvlink")


def test_unknown_health_system_param_is_refused_before_dcgm_is_opened():
    """Parsed when the suite loads (tests/unit/test_check_params.py: exit 2, nothing run)."""
    with pytest.raises(ValueError, match="params of dcgm_health: systems .*gpu_vibes"):
        dcgm_health.Params.parse({"systems": ["mem", "gpu_vibes"]})


def test_health_call_failure_is_an_error_result():
    class Failing(FakeDcgm):
        def check_health(self):
            raise DcgmCallError("DCGM health check failed: DCGM_ST_CONNECTION_NOT_VALID")

    source = Failing()
    (err,) = dcgm_health.run(ctx_for("dcgm_health"), opener=opener_of(source))
    assert err.status is Status.ERROR and "CONNECTION_NOT_VALID" in err.detail
    assert source.closed


# -- the real backend's translation, against fake binding modules -------------------------------


def our_engine(bindings, port):
    me = pwd.getpwuid(os.getuid()).pw_name
    return BindingsDcgm(bindings, hostengine=f"127.0.0.1:{port}", hostengine_users=(me,))


def test_backend_connects_to_the_host_engine_and_says_so(engine_port):
    bindings, calls = fake_bindings()
    source = our_engine(bindings, engine_port)
    source.connect()
    assert source.connection == f"host engine at 127.0.0.1:{engine_port}"
    assert calls.handles == [f"127.0.0.1:{engine_port}"]
    source.close()
    assert calls.shutdowns == 1


def test_backend_starts_embedded_engine_when_no_host_engine_answers_and_says_why(engine_port):
    bindings, calls = fake_bindings(refuse_hostengine=True)
    source = our_engine(bindings, engine_port)
    source.connect()
    assert source.connection.startswith(
        f"embedded host engine (no host engine answered at 127.0.0.1:{engine_port}"
    )
    assert calls.handles == [None]


def test_a_port_nothing_listens_on_is_never_asked_for_the_host_engine(engine_port):
    """Nothing there now, anyone may be there when the bindings connect: embedded, saying so."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    bindings, calls = fake_bindings()
    source = our_engine(bindings, port)
    source.connect()
    assert calls.handles == [None]
    assert f"nothing listens on port {port} of this host" in source.connection


def test_backend_with_neither_engine_raises_connect_error_saying_what_to_do():
    bindings, _ = fake_bindings(refuse_hostengine=True, refuse_embedded=True)
    with pytest.raises(DcgmConnectError, match="systemctl start nvidia-dcgm"):
        BindingsDcgm(bindings).connect()


def ns(**kw):
    return SimpleNamespace(**kw)


def entity(group, eid):
    return ns(entityGroupId=group, entityId=eid)


def test_dcgm4_response_struct_becomes_the_same_model_as_the_json():
    resp = ns(
        dcgmVersion=b"4.2.3\0",
        driverVersion=b"570.124.06\0",
        systemError=ns(msg=b""),
        numTests=1,
        categories=[b"Hardware"],
        tests=[
            ns(
                name=b"memory",
                categoryIndex=0,
                numResults=2,
                resultIndices=[0, 1],
                numErrors=1,
                errorIndices=[0],
                numInfo=1,
                infoIndices=[0],
            )
        ],
        results=[ns(entity=entity(1, 0), result=0), ns(entity=entity(1, 2), result=3)],
        errors=[
            ns(
                entity=entity(1, 2),
                code=58,
                category=10,
                severity=2,
                msg=b"A memory mismatch was detected on GPU 2\0",
            )
        ],
        info=[ns(entity=entity(1, 0), msg=b"Allocated 150215999488 bytes\0")],
    )
    report = report_from_response(resp)
    assert (report.format, report.dcgm_version, report.driver_version) == (
        "dcgm4",
        "4.2.3",
        "570.124.06",
    )
    (finding,) = report.findings
    assert (finding.test, finding.category, finding.target) == ("memory", "Hardware", "gpu:2")
    assert finding.worst_severity == "ISOLATE" and finding.warnings[0].error_id == 58
    passed = next(r for r in report.results if r.target == "gpu:0")
    assert passed.info == ("Allocated 150215999488 bytes",)


def test_dcgm3_response_struct_with_per_gpu_slots_becomes_the_model():
    def slot(status, code=0, msg=b"", severity=0):
        err = ns(code=code, msg=msg, category=10 if code else 0, severity=severity)
        return ns(status=status, error=[err, ns(code=0, msg=b"", category=0, severity=0)], info=b"")

    not_run = slot(4)
    resp = ns(
        dcgmVersion=b"3.3.5",
        driverVersion=b"535.154.05",
        systemError=ns(msg=b""),
        levelOneTestCount=2,
        levelOneResults=[slot(0), slot(0)],
        perGpuResponses=[
            ns(gpuId=0, results=[slot(0)] + [not_run] * 9),
            ns(gpuId=2, results=[slot(3, 58, b"memory mismatch on GPU 2", 2)] + [not_run] * 9),
            ns(gpuId=32, results=[not_run] * 10),
        ],
    )
    report = report_from_response(resp)
    assert report.format == "dcgm3"
    (finding,) = report.findings
    assert (finding.test, finding.target, finding.worst_severity) == (
        "GPU Memory",
        "gpu:2",
        "ISOLATE",
    )
    assert {r.test for r in report.results if r.target == "node"} == {"Denylist", "NVML Library"}


def test_backend_runs_the_requested_level_and_converts_the_response():
    resp = ns(
        dcgmVersion=b"4.2.3",
        driverVersion=b"",
        systemError=ns(msg=b""),
        numTests=0,
        categories=[],
        tests=[],
        results=[],
        errors=[],
        info=[],
    )
    bindings, calls = fake_bindings(diag_response=resp)
    source = BindingsDcgm(bindings)
    source.connect()
    report = source.run_diag(DiagRequest(level=2, gpus=(0, 1)), timeout_s=5)
    assert calls.diag_args == ([0, 1], "2")
    assert report.dcgm_version == "4.2.3"


def test_backend_health_sets_watches_on_all_gpus_and_reads_incidents():
    resp = ns(
        overallHealth=20,
        incidentCount=1,
        incidents=[
            ns(
                system=0x10,
                health=20,
                error=ns(code=4, msg=b"Detected 1 volatile DBE in GPU 3\0"),
                entityInfo=entity(1, 3),
            ),
            ns(
                system=0x1,
                health=10,
                error=ns(code=3, msg=b"beyond incidentCount"),
                entityInfo=entity(1, 0),
            ),
        ],
    )
    bindings, calls = fake_bindings(health_response=resp)
    source = BindingsDcgm(bindings, hostengine="embedded")
    source.connect()
    report = dcgm_health.incidents(source, ["mem"])
    assert calls.health_set == [("h-None", 0x7FFFFFFF, 0x10)]
    assert report.overall == "fail"
    (inc,) = report.incidents
    assert (inc.system, inc.health, inc.error_code, inc.target) == ("mem", "fail", 4, "gpu:3")
    assert inc.message == "Detected 1 volatile DBE in GPU 3"


def test_backend_translates_a_dcgm_api_error_into_dcgm_call_error():
    bindings, _ = fake_bindings()

    def boom(h, g):
        raise FakeDCGMError(-15)

    bindings.agent.dcgmHealthCheck = boom
    source = BindingsDcgm(bindings)
    source.connect()
    with pytest.raises(DcgmCallError, match=r"dcgmReturn_t -15"):
        source.check_health()


# -- through the real command, on a simulated node ----------------------------------------------


@pytest.mark.parametrize("suite, check", [("delivery", "dcgm_diag"), ("quick", "dcgm_health")])
def test_simulated_healthy_node_skips_dcgm_with_reason_and_stays_healthy(agent, suite, check):
    run = agent(
        "accept",
        "--simulate",
        str(REPO / "scenarios" / "healthy-h100.yaml"),
        "--suite",
        suite,
        "--only",
        check,
        "--json",
    )
    assert run.code == 0, run.stderr
    report = run.json()
    (result,) = report["results"]
    assert (result["check"], result["status"]) == (check, "skip")
    assert "stand-in node: DCGM is not modelled" in result["detail"]
    assert report["grade"] == {"level": "HEALTHY", "action": "none", "reasons": []}
