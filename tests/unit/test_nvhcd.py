"""The NVRx node health-check service (node_agent/service/nvhcd.py): its wire contract, its
answers from a grade, and a gRPC round trip over a real Unix socket with a client that keeps
NVRx's contract (tests/nvrx_client.py says why it is not NVRx's own class)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed: make deps-test")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed: make deps-test")

from nvrx_client import NodeHealthCheck, generated_modules  # noqa: E402

from node_agent.service.node_state import NodeView, ViewReason, answered  # noqa: E402
from node_agent.service.nvhcd import (  # noqa: E402
    HealthAnswerer,
    NvhcdServer,
    message_classes,
)

XID79 = ViewReason(
    "xid",
    "FAULT",
    "gpu:5",
    "NVRM: Xid (PCI:0000:ab:00): 79, pid=4242, name=secret_train.py, GPU has fallen off the bus",
    catalog="xid",
    code=79,
    name="GPU has fallen off the bus",
)
HANG = ViewReason(
    "training-hang",
    "ERROR",
    "job:slurm:77@uid:1234/rank:3",
    "rank 3 (pid 999, job llama-secret): stuck in all_reduce (model.py:42)",
    owner_uid=1234,
    about_users=True,
)
FAULT = NodeView("FAULT", (XID79,), graded_at=1000.0, complete=True)
HEALTHY = NodeView("HEALTHY", (), graded_at=1000.0, complete=True)
UNKNOWN = NodeView("UNKNOWN", (), graded_at=1000.0, missing=("nvml_health", "hca_ports"))


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


def answerer(view):
    return HealthAnswerer(lambda: view, clock=lambda: 1010.0)


def test_a_complete_healthy_state_answers_success_with_no_failures():
    answer = answerer(HEALTHY).answer(["--group", "gpu"], uid=0)
    assert answer["success"] is True and answer["exit_code"] == 0
    output = json.loads(answer["output"])
    assert output["fail_count"] == 0 and output["level"] == "HEALTHY"
    assert output["args_received"] == ["--group", "gpu"]


def test_a_fault_answers_unhealthy_with_its_reasons():
    answer = answerer(FAULT).answer([], uid=0)
    output = json.loads(answer["output"])
    assert answer["success"] is False and answer["exit_code"] == 4
    assert output["fail_count"] == 1 and output["failed_checks"] == ["xid"]
    assert "fallen off the bus" in output["reasons"][0]["message"]


def test_an_unknown_state_fails_the_check_and_says_which_checks_have_not_run():
    answer = answerer(UNKNOWN).answer([], uid=1000)
    output = json.loads(answer["output"])
    assert answer["success"] is False and output["fail_count"] == 1
    assert output["level"] == "UNKNOWN" and output["missing_checks"] == ["nvml_health", "hca_ports"]
    assert "nvml_health" in answer["error"] and "no result" in answer["error"]


def test_before_the_first_grading_the_answer_is_not_a_pass():
    answer = HealthAnswerer(lambda: None, clock=lambda: 5.0).answer([])
    assert answer["success"] is False and "not graded" in answer["error"]
    assert json.loads(answer["output"])["fail_count"] == 1


def test_nvrx_07_default_args_are_accepted_logged_and_echoed_escaped(caplog):
    args = ["--no-slurm", "--group", "prolog", "epilog", "logs", "gpu"]
    with caplog.at_level("INFO", logger="node_agent.service.nvhcd"):
        answer = answerer(HEALTHY).answer(args, uid=1000)
        evil = answerer(HEALTHY).answer(["--group", "gpu\x1b[2J\nFAKE LINE"], uid=1000)
    assert answer["success"] is True
    assert json.loads(answer["output"])["args_received"] == args
    assert "--no-slurm --group prolog epilog logs gpu" in caplog.text
    assert "\x1b" not in caplog.text and "\nFAKE" not in caplog.text
    assert "\x1b" not in json.loads(evil["output"])["args_received"][1]


def test_another_users_job_pid_and_frames_are_left_out_of_the_answer():
    view = NodeView("ERROR", (HANG, XID79), graded_at=1000.0, complete=True)
    stranger = json.dumps(json.loads(answerer(view).answer([], uid=2000)["output"]))
    for secret in ("llama-secret", "slurm:77", "1234", "pid 999", "model.py", "secret_train"):
        assert secret not in stranger
    assert "Xid 79" in stranger or "xid 79" in stranger  # the typed finding stays
    owner = json.loads(answerer(view).answer([], uid=1234)["output"])
    assert "llama-secret" in owner["reasons"][0]["message"]
    assert "secret_train" not in json.dumps(owner)  # the Xid line's process is not theirs
    root = json.dumps(json.loads(answerer(view).answer([], uid=0)["output"]))
    assert "llama-secret" in root and "secret_train" in root
    unknown_caller = json.dumps(json.loads(answerer(view).answer([], uid=None)["output"]))
    assert "llama-secret" not in unknown_caller


def test_a_stored_fault_stands_until_every_check_has_a_result():
    from node_agent.model import Action, Grade, Level, Reason

    stored = Grade(Level.FAULT, Action.REPLACE, (Reason("xid", Level.FAULT, "gpu:5", "Xid 79"),))
    partial = Grade(Level.HEALTHY, Action.NONE, ())
    assert answered(partial, False, stored)[:1] == ("FAULT",)
    assert answered(partial, False, None)[0] == "UNKNOWN"
    assert answered(partial, True, stored)[0] == "HEALTHY"
    error = Grade(Level.ERROR, Action.RESTART, (Reason("r", Level.ERROR, "gpu:1", "m"),))
    assert answered(error, False, None)[0] == "ERROR"


def test_nvrx_contract_client_over_a_real_unix_socket(tmp_path):
    sock = tmp_path / "run" / "nvhcd.sock"
    view = {"now": HEALTHY}
    server = NvhcdServer(HealthAnswerer(lambda: view["now"], clock=lambda: 1010.0), sock)
    server.start()  # pytest's tmp_path is 0700: a note, not a failure
    try:
        assert oct(sock.stat().st_mode & 0o777) == "0o666"
        assert oct(sock.parent.stat().st_mode & 0o777) == "0o755"
        client = NodeHealthCheck(str(sock))
        assert client() is True and client.last_output["fail_count"] == 0
        view["now"] = FAULT
        assert client() is False and client.last_output["failed_checks"] == ["xid"]
        view["now"] = UNKNOWN
        assert client() is False and client.skipped is None
    finally:
        server.stop()
    assert not sock.exists()
    assert NodeHealthCheck(f"unix://{sock}")() is True  # service down: NVRx skips


def test_a_socket_directory_users_cannot_traverse_is_reported(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    server = NvhcdServer(answerer(HEALTHY), private / "nvhcd.sock")
    notes = server.start()
    try:
        assert notes and "cannot reach" in notes[0] and str(private) in notes[0]
    finally:
        server.stop()


def test_only_run_health_check_is_served(tmp_path):
    import grpc

    sock = tmp_path / "nvhcd.sock"
    server = NvhcdServer(answerer(HEALTHY), sock)
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            other = channel.unary_unary("/grpc.health.v1.Health/Check")
            with pytest.raises(grpc.RpcError) as err:
                other(b"", timeout=5)
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_the_server_refuses_to_replace_a_file_it_did_not_leave(tmp_path):
    planted = tmp_path / "nvhcd.sock"
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a socket this daemon left behind"):
        NvhcdServer(answerer(HEALTHY), planted).start()
    assert planted.is_symlink()


def test_another_users_hung_job_alone_leaves_the_node_fit_for_nvrx():
    """A hung job is its job's ERROR (the node is not drained for it either): its user and root
    are told the node is unfit (their restart decides), anyone else WARN with no failure; while
    the node's own checks are not all in, UNKNOWN; beside a FAULT, unfit for everyone."""
    complete = answerer(NodeView("ERROR", (HANG,), graded_at=1000.0, complete=True))
    answer = complete.answer([], uid=2000)
    output = json.loads(answer["output"])
    assert (answer["success"], answer["exit_code"]) == (True, 0)
    assert (output["level"], output["fail_count"], output["failed_checks"]) == ("WARN", 0, [])
    assert output["reasons"][0]["rule"] == "training-hang"
    for owner in (1234, 0):
        answer = complete.answer([], uid=owner)
        assert (answer["success"], json.loads(answer["output"])["fail_count"]) == (False, 1)
    early = answerer(NodeView("ERROR", (HANG,), graded_at=1000.0, missing=("nvml_health",)))
    answer = early.answer([], uid=2000)
    assert answer["success"] is False and json.loads(answer["output"])["level"] == "UNKNOWN"
    stored = answerer(NodeView("ERROR", (HANG,), graded_at=1000.0, stored_grade=True))
    assert stored.answer([], uid=2000)["success"] is False
    both = answerer(NodeView("FAULT", (HANG, XID79), graded_at=1000.0, complete=True))
    output = json.loads(both.answer([], uid=2000)["output"])
    assert (output["level"], output["failed_checks"]) == ("FAULT", ["xid"])


@pytest.mark.parametrize("mode, owner", [(0o777, 0), (0o775, 0), (0o755, 65534)])
def test_a_socket_directory_another_user_can_write_is_refused(tmp_path, mode, owner):
    """A user who can write the socket's directory could bind its name first and answer NVRx
    as the daemon, or swap the socket for a link before it is chmod'ed: nothing is served."""
    import os

    if os.geteuid() != 0:
        pytest.skip("giving the directory to another user takes root (chown)")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, owner, 1234 if mode == 0o775 else 0)
    shared.chmod(mode)
    with pytest.raises(OSError, match="not root's alone"):
        NvhcdServer(answerer(HEALTHY), shared / "nvhcd.sock").start()
    assert not (shared / "nvhcd.sock").exists()
