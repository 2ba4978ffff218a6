"""The NVRx node health-check service (node_agent/service/nvhcd.py): its wire contract, its
answers from a grade, and a gRPC round trip over a real Unix socket with a client that keeps
NVRx's contract (tests/nvrx_client.py says why it is not NVRx's own class)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")

from nvrx_client import NodeHealthCheck, generated_modules  # noqa: E402

from node_agent.service.nvhcd import (  # noqa: E402
    GradeView,
    HealthAnswerer,
    NvhcdServer,
    message_classes,
)

FAULT = GradeView(
    "FAULT",
    [
        {
            "rule": "xid-79",
            "level": "FAULT",
            "target": "gpu:5",
            "message": "Xid 79: GPU has fallen off the bus",
        }
    ],
    graded_at=1000.0,
)
HEALTHY = GradeView("HEALTHY", [], graded_at=1000.0)


def test_the_runtime_messages_are_the_protos_field_for_field():
    from google.protobuf import descriptor_pb2

    pb2, _ = generated_modules()

    def shape(cls):
        proto = descriptor_pb2.DescriptorProto()
        cls.DESCRIPTOR.CopyToProto(proto)
        return proto

    request, response = message_classes()
    assert shape(request) == shape(pb2.HealthCheckRequest)
    assert shape(response) == shape(pb2.HealthCheckResponse)
    service = pb2.DESCRIPTOR.services_by_name["HealthCheckService"]
    assert service.full_name == "nvhcd.HealthCheckService"
    assert [m.name for m in service.methods] == ["RunHealthCheck"]


def answerer(view, refresh=None, **kw):
    return HealthAnswerer(lambda: view, refresh or (lambda: view), clock=lambda: 1010.0, **kw)


def test_a_fresh_healthy_grade_answers_success_with_no_failures():
    answer = answerer(HEALTHY).answer(["--group", "gpu"])
    assert answer["success"] is True and answer["exit_code"] == 0
    output = json.loads(answer["output"])
    assert output["fail_count"] == 0 and output["level"] == "HEALTHY"
    assert output["args_received"] == ["--group", "gpu"]


def test_a_fault_answers_unhealthy_with_its_reasons():
    answer = answerer(FAULT).answer([])
    output = json.loads(answer["output"])
    assert answer["success"] is False and answer["exit_code"] == 4
    assert output["fail_count"] == 1 and output["failed_checks"] == ["xid-79"]
    assert "fallen off the bus" in output["reasons"][0]["message"]


def test_a_stale_grade_is_refreshed_at_most_once_per_interval():
    calls = []

    def refresh():
        calls.append(1)
        return GradeView("HEALTHY", graded_at=1005.0)

    a = answerer(GradeView("HEALTHY", graded_at=0.0), refresh, max_age_s=60, min_refresh_s=30)
    for _ in range(20):
        a.answer([])
    assert len(calls) == 1 and a.requests == 20


def test_no_grade_and_a_failing_refresh_is_an_error_not_a_pass():
    def broken():
        raise RuntimeError("NVML did not load")

    answer = HealthAnswerer(lambda: None, broken, clock=lambda: 5.0).answer([])
    assert answer["success"] is False
    assert "could not grade this node" in answer["error"]


def test_nvrx_contract_client_over_a_real_unix_socket(tmp_path):
    sock = tmp_path / "nvhcd.sock"
    view = {"now": HEALTHY}
    server = NvhcdServer(
        HealthAnswerer(lambda: view["now"], lambda: view["now"], clock=lambda: 1010.0), sock
    )
    server.start()
    try:
        assert oct(sock.stat().st_mode & 0o777) == "0o666"
        client = NodeHealthCheck(str(sock))
        assert client() is True and client.last_output["fail_count"] == 0
        view["now"] = FAULT
        assert client() is False and client.last_output["failed_checks"] == ["xid-79"]
    finally:
        server.stop()
    assert not sock.exists()
    assert NodeHealthCheck(f"unix://{sock}")() is True  # service down: NVRx skips


def test_the_server_refuses_to_replace_a_file_it_did_not_leave(tmp_path):
    planted = tmp_path / "nvhcd.sock"
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a socket this daemon left behind"):
        NvhcdServer(answerer(HEALTHY), planted).start()
    assert planted.is_symlink()
