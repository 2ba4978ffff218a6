"""The ``cloud_maintenance`` check against each cloud's documented metadata API.

No cloud metadata service can run here, so each provider's API is served by a stand-in on
127.0.0.1 (tests/cloud_metadata_standin.py) in the provider's documented format, and the DMI
strings that name the cloud are a tree the test writes. Everything above the HTTP boundary is
the real code: the check, its typed params, the shipped grading rules.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import stat
import sys
import time
from pathlib import Path

import pytest
from cloud_metadata_standin import MetadataStandIn  # tests/cloud_metadata_standin.py

from node_agent import resources
from node_agent.checking.context import CheckContext
from node_agent.checking.ports import Ports
from node_agent.checks import cloud_maintenance
from node_agent.config import config_from_dict
from node_agent.gpu.absent import AbsentGpuBackend
from node_agent.grading.rules import Grader, load_grader
from node_agent.host import cloud_metadata as cm
from node_agent.inventory import Inventory
from node_agent.model import Action, HostInfo, Level, PlannedEvent, Remedy, Status

NOW = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc).timestamp()


@functools.cache
def grader() -> Grader:
    return load_grader(resources.shipped_graders_dir())


def at(minutes: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(NOW + minutes * 60, dt.timezone.utc)


def rfc3339(minutes: float) -> str:
    return at(minutes).strftime("%Y-%m-%dT%H:%M:%SZ")


def aws_time(minutes: float) -> str:
    return at(minutes).strftime("%d %b %Y %H:%M:%S GMT")


def rfc1123(minutes: float) -> str:
    return at(minutes).strftime("%a, %d %b %Y %H:%M:%S GMT")


def make_ctx(
    tmp_path: Path, ctx_timeout_s: float = 10.0, graders: Path | None = None, **params
) -> CheckContext:
    """``graders``: an operator's graders directory (its cloud.yaml holds the lead time)."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return CheckContext(
        check="cloud_maintenance",
        gpu=AbsentGpuBackend("no GPU"),
        kernel_log=None,  # type: ignore[arg-type]
        config=config_from_dict({} if graders is None else {"graders_dir": str(graders)}),
        inventory=Inventory(host=HostInfo(hostname="h", kernel="6.8"), gpus=[], sku=None),
        sku=None,
        expected_gpus=None,
        mode="service",
        params=params,
        state_dir=state,
        timeout_s=ctx_timeout_s,
        ports=Ports(clock=lambda: NOW),
    )


@pytest.fixture
def standin():
    with MetadataStandIn() as server:
        yield server


def check(tmp_path, standin, provider, graders=None, **params):
    (result,) = cloud_maintenance.run(
        make_ctx(tmp_path, graders=graders, provider=provider, metadata_url=standin.url, **params)
    )
    return result


def dmi_tree(tmp_path: Path, **values: str) -> Path:
    root = tmp_path / "root"
    base = root / "sys/class/dmi/id"
    base.mkdir(parents=True)
    for name, value in values.items():
        (base / name).write_text(value + "\n")
    return root


# -- which cloud --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "provider"),
    [
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, "gcp"),
        ({"sys_vendor": "Amazon EC2", "product_name": "p5.48xlarge"}, "aws"),
        ({"bios_vendor": "Amazon EC2"}, "aws"),
        (
            {"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": cm.AZURE_ASSET_TAG},
            "azure",
        ),
        ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": "None"}, None),  # Hyper-V
        ({"sys_vendor": "Supermicro", "product_name": "SYS-821GE-TNHR"}, None),
    ],
)
def test_the_cloud_is_detected_from_the_dmi_strings(tmp_path, values, provider):
    assert cm.detect_provider(dmi_tree(tmp_path, **values))[0] == provider


def test_a_node_off_the_cloud_skips_naming_its_vendor(tmp_path):
    root = dmi_tree(tmp_path, sys_vendor="Supermicro")
    (result,) = cloud_maintenance.run(make_ctx(tmp_path, dmi_root=str(root)))
    assert result.status is Status.SKIP
    assert "Supermicro" in result.detail and "provider: command" in result.detail


def test_a_detected_cloud_is_read_at_the_configured_address(tmp_path, standin):
    root = dmi_tree(tmp_path, sys_vendor="Google")
    standin.gcp_event = "TERMINATE_ON_HOST_MAINTENANCE"
    (result,) = cloud_maintenance.run(
        make_ctx(tmp_path, dmi_root=str(root), metadata_url=standin.url)
    )
    assert result.status is Status.FAIL and result.evidence["provider"] == "gcp"


# -- each provider: nothing, far ahead, inside the lead time --------------------------------------
def announce(standin: MetadataStandIn, provider: str, minutes: float) -> str:
    """Announce one event ``minutes`` ahead in ``provider``'s format; returns its kind."""
    if provider == "gcp":
        standin.gcp_upcoming = {
            "type": "SCHEDULED",
            "maintenance_status": "PENDING",
            "window_start_time": rfc3339(minutes),
            "window_end_time": rfc3339(minutes + 60),
            "can_reschedule": True,
        }
        return "SCHEDULED"
    if provider == "aws":
        standin.aws_events = [
            {
                "NotBefore": aws_time(minutes),
                "Code": "system-reboot",
                "Description": "scheduled reboot",
                "EventId": "instance-event-0d59937288b749b32",
                "NotAfter": aws_time(minutes + 30),
                "State": "active",
            }
        ]
        return "system-reboot"
    standin.azure_events = [
        {
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Redeploy",
            "ResourceType": "VirtualMachine",
            "Resources": [standin.azure_vm],
            "EventStatus": "Scheduled",
            "NotBefore": rfc1123(minutes),
            "Description": "Virtual machine is being moved to another node.",
            "EventSource": "Platform",
            "DurationInSeconds": 600,
        }
    ]
    return "Redeploy"


PROVIDERS = ("gcp", "aws", "azure")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_no_announced_maintenance_passes(tmp_path, standin, provider):
    result = check(tmp_path, standin, provider)
    assert result.status is Status.PASS and "no maintenance announced" in result.detail
    assert result.planned is None


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_maintenance_far_ahead_warns_with_its_kind_and_start(tmp_path, standin, provider):
    kind = announce(standin, provider, minutes=24 * 60)
    result = check(tmp_path, standin, provider)
    assert result.status is Status.WARN, result.detail
    assert kind in result.detail and "2026-11-22T12:00:00Z" in result.detail
    graded = grader().grade([result], "service")
    assert graded.level is Level.WARN and graded.action is Action.NONE


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_maintenance_inside_the_lead_time_is_an_error_with_the_planned_remedy(
    tmp_path, standin, provider
):
    kind = announce(standin, provider, minutes=20)
    result = check(tmp_path, standin, provider)
    assert result.status is Status.FAIL, result.detail
    assert result.planned is not None and result.planned.kind == kind
    assert result.planned.starts_at == "2026-11-21T12:20:00Z"
    graded = grader().grade([result], "service")
    assert (graded.level, graded.action) == (Level.ERROR, Action.DRAIN)
    assert graded.reasons[0].remedy is Remedy.PLANNED
    assert graded.reasons[0].planned == result.planned


def test_the_lead_time_is_graders_cloud_yamls(tmp_path, standin):
    announce(standin, "aws", minutes=90)
    assert check(tmp_path, standin, "aws").status is Status.WARN  # the shipped 30 min
    graders = tmp_path / "graders"
    graders.mkdir()
    (graders / "cloud.yaml").write_text("lead_time_s: 7200\n")
    result = check(tmp_path, standin, "aws", graders=graders)
    assert result.status is Status.FAIL
    assert "inside the 120 min lead time" in result.detail
    assert result.evidence["lead_time_s"] == 7200


def test_a_suite_carrying_the_lead_time_is_refused_naming_graders_cloud_yaml():
    with pytest.raises(ValueError, match="lead_time_s judges") as err:
        cloud_maintenance.Params.parse({"lead_time_s": 3600})
    assert "graders/cloud.yaml" in str(err.value)


def test_gcp_maintenance_event_without_a_window_is_imminent(tmp_path, standin):
    standin.gcp_event = "TERMINATE_ON_HOST_MAINTENANCE"
    result = check(tmp_path, standin, "gcp")
    assert result.status is Status.FAIL and "now" in result.detail
    assert result.planned == PlannedEvent("gcp", "TERMINATE_ON_HOST_MAINTENANCE")


def test_gcp_wait_for_change_sends_the_last_etag(tmp_path, standin):
    check(tmp_path, standin, "gcp", wait_s=1)
    check(tmp_path, standin, "gcp", wait_s=1)
    waits = [q for m, p, q in standin.requests if p.endswith("maintenance-event")]
    assert waits[0]["wait_for_change"] == ["true"] and "last_etag" not in waits[0]
    assert waits[1]["last_etag"] == ["etag-NONE"]


def test_aws_completed_and_canceled_events_are_left_out(tmp_path, standin):
    announce(standin, "aws", minutes=10)
    standin.aws_events[0]["State"] = "completed"
    standin.aws_events[0]["Description"] = "[Completed] scheduled reboot"
    assert check(tmp_path, standin, "aws").status is Status.PASS


def test_an_event_that_is_over_passes(tmp_path, standin):
    announce(standin, "gcp", minutes=-120)  # window ended an hour ago
    assert check(tmp_path, standin, "gcp").status is Status.PASS


def test_an_azure_event_of_another_vm_is_not_this_nodes(tmp_path, standin):
    announce(standin, "azure", minutes=5)
    standin.azure_events[0]["Resources"] = ["another-vm"]
    result = check(tmp_path, standin, "azure")
    assert result.status is Status.PASS and result.evidence["vm_name"] == "gpu-vm-1"


@pytest.mark.parametrize(
    ("answer", "words"),
    [((500, "Internal Server Error"), "HTTP 500: Internal Server Error"), ((200, ""), "empty")],
)
def test_an_azure_event_of_another_vm_is_never_drained_when_this_vms_name_is_unknown(
    tmp_path, standin, answer, words
):
    """The name lookup fails: another VM's event is shown (WARN), never drained for, never
    acknowledged (which would start that VM's maintenance at once)."""
    announce(standin, "azure", minutes=0)
    standin.azure_events[0].update(Resources=["other-vm-7"], EventStatus="Started", NotBefore="")
    standin.override["/metadata/instance/compute/name"] = answer
    result = check(tmp_path, standin, "azure", acknowledge=True)
    assert result.status is Status.WARN, result.detail
    assert result.planned is None
    assert "name could not be read" in result.detail and words in result.detail
    assert "Redeploy" in result.detail and "'other-vm-7'" in result.detail
    assert result.evidence["vm_name"] is None and words in result.evidence["vm_name_error"]
    assert result.evidence["events"][0]["resources"] == ["other-vm-7"]
    graded = grader().grade([result], "service")
    assert graded.level is Level.WARN and graded.action is Action.NONE
    assert not any(reason.planned for reason in graded.reasons)
    assert standin.acks == []


def test_a_started_azure_event_is_inside_the_lead_time(tmp_path, standin):
    announce(standin, "azure", minutes=0)
    standin.azure_events[0].update(EventStatus="Started", NotBefore="")
    assert check(tmp_path, standin, "azure").status is Status.FAIL


def test_azure_acknowledgement_posts_start_requests(standin):
    detail = cm.acknowledge("602d9444", base_url=standin.url)
    assert standin.acks == [{"StartRequests": [{"EventId": "602d9444"}]}]
    assert "602d9444" in detail


def test_the_acknowledge_param_rides_on_the_planned_event_for_azure_only(tmp_path, standin):
    announce(standin, "azure", minutes=5)
    assert check(tmp_path, standin, "azure", acknowledge=True).planned.acknowledge
    announce(standin, "aws", minutes=5)
    assert not check(tmp_path, standin, "aws", acknowledge=True).planned.acknowledge


# -- what is not a pass -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("provider", "path", "body"),
    [
        ("gcp", "/computeMetadata/v1/instance/maintenance-event", "<html>captive portal</html>"),
        ("gcp", "/computeMetadata/v1/instance/upcoming-maintenance", "{not json"),
        ("aws", "/latest/meta-data/events/maintenance/scheduled", '{"Code": "x"}'),
        ("azure", "/metadata/scheduledevents", '{"Events": [{"EventType": "Reboot"}]}'),
        (  # an event that names no VM cannot be told to be this VM's
            "azure",
            "/metadata/scheduledevents",
            '{"Events": [{"EventId": "E1", "EventType": "Reboot", "EventStatus": "Started", '
            '"NotBefore": "", "Resources": []}]}',
        ),
        (
            "aws",
            "/latest/meta-data/events/maintenance/scheduled",
            '[{"Code": "system-reboot", "NotBefore": "tomorrow morning"}]',
        ),
    ],
)
def test_a_malformed_answer_is_a_clear_error_never_healthy(tmp_path, standin, provider, path, body):
    standin.override[path] = (200, body)
    result = check(tmp_path, standin, provider)
    assert result.status is Status.ERROR, result.detail
    assert provider in result.detail and "cannot be read" in result.detail
    graded = grader().grade([result], "service")
    assert graded.level is not Level.HEALTHY


def test_a_refusal_of_the_aws_token_is_an_error(tmp_path, standin):
    standin.override["/latest/api/token"] = (403, "Forbidden")
    result = check(tmp_path, standin, "aws")
    assert result.status is Status.ERROR and "HTTP 403" in result.detail


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_server_that_never_answers_is_a_skip_within_the_timeout(tmp_path, standin, provider):
    standin.hang = True
    start = time.monotonic()
    result = check(tmp_path, standin, provider, timeout_s=0.5)
    assert result.status is Status.SKIP and "within 0.5 s" in result.detail
    assert time.monotonic() - start < 5  # one read timeout, not the check's whole budget


def test_a_node_without_a_metadata_service_skips(tmp_path):
    with MetadataStandIn() as gone:
        url = gone.url  # a port nothing listens on once it is closed
    (result,) = cloud_maintenance.run(make_ctx(tmp_path, provider="gcp", metadata_url=url))
    assert result.status is Status.SKIP and "no metadata service answered" in result.detail


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"provider": "oci"}, "provider 'oci'"),
        ({"timeout_s": "2s"}, "timeout_s '2s': expected a finite number"),
        ({"metadata_url": "http://metadata.example.com"}, "169.254.169.254 only"),
        ({"metadata_url": "https://127.0.0.1:1"}, "169.254.169.254 only"),
        ({"provider": "command"}, "needs command"),
        ({"lead_time": 60}, "unknown key(s) lead_time"),
    ],
)
def test_bad_params_are_refused_naming_the_key(params, words):
    """Parsed when the suite loads (tests/unit/test_check_params.py: exit 2, nothing run)."""
    with pytest.raises(ValueError, match="params of cloud_maintenance") as err:
        cloud_maintenance.Params.parse(params)
    assert words in str(err.value)


def test_a_stand_in_node_is_not_read_for_its_cloud(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.ports = Ports(host_unrecorded="captured", clock=lambda: NOW)
    (result,) = cloud_maintenance.run(ctx)
    assert result.status is Status.SKIP and "stand-in node" in result.detail


# -- any other cloud: the operator's command -----------------------------------------------------
def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "events"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_command_prints_the_events_of_another_cloud(tmp_path):
    events = {"events": [{"kind": "reboot", "id": "ocid1.event.x", "starts_at": rfc3339(10)}]}
    argv = [script(tmp_path, f"print({json.dumps(json.dumps(events))})")]
    (result,) = cloud_maintenance.run(make_ctx(tmp_path, provider="command", command=argv))
    assert result.status is Status.FAIL and result.planned.provider == "command"
    assert result.planned.event_id == "ocid1.event.x"


def test_a_failing_command_is_an_error(tmp_path):
    argv = [script(tmp_path, "import sys; sys.exit(3)")]
    (result,) = cloud_maintenance.run(make_ctx(tmp_path, provider="command", command=argv))
    assert result.status is Status.ERROR and "exited 3" in result.detail


def test_the_shipped_suites_run_the_check_with_valid_params():
    import yaml

    for name in ("quick", "periodic"):
        data = yaml.safe_load((resources.shipped_suites_dir() / f"{name}.yaml").read_text())
        (spec,) = [c for c in data["checks"] if c["check"] == "cloud_maintenance"]
        params = cloud_maintenance.Params.parse(spec.get("params") or {})
        assert params.metadata_url == cm.LINK_LOCAL
