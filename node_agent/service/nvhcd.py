"""NVRx's node health-check service, answered from the daemon's latest grade.

NVIDIA's resiliency extension restarts a job's workers in place; before it does, its
``ft_launcher`` asks a node-local gRPC service over a Unix socket
(``--ft-node-health-check-endpoint unix:///var/run/nvhcd.sock``) whether the node is fit:
``nvhcd.HealthCheckService/RunHealthCheck`` (packaging/nvrx/nvhcd.proto states the wire contract).
NVRx reads ``success`` and, in the JSON ``output``, ``fail_count``: 0 is healthy.

The answer is the daemon's latest grade (HEALTHY or WARN: fit; ERROR or FAULT: not, with the
reasons in ``output``). A grade older than ``max_age_s`` is refreshed by running the quick suite,
at most once per ``min_refresh_s`` however many ask; a request never causes an action, and the
client's ``args`` are recorded, never run. The socket is 0666 (any local user may ask: the job
runs as its user) or 0660 with ``daemon.nvhcd.group``; asking is all a client can do.

The message classes are built at run time from descriptors equal to the .proto's (no generated
code, so no protoc and no generated-code/runtime version pairing to keep);
``tests/unit/test_nvhcd.py`` compiles the .proto and checks they agree.
"""

from __future__ import annotations

import grp
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from google.protobuf.message import Message

SERVICE = "nvhcd.HealthCheckService"
METHOD = "RunHealthCheck"
DEFAULT_SOCKET = "/var/run/nvhcd.sock"
#: a grade older than this is refreshed before it answers (seconds)
DEFAULT_MAX_AGE_S = 60.0
#: the quick suite runs at most this often for the service, however many ask (seconds)
DEFAULT_MIN_REFRESH_S = 30.0
#: concurrent requests served; more wait in gRPC's queue (a job's ranks ask at once)
MAX_CONCURRENT = 16


@dataclass(frozen=True)
class GradeView:
    """What the service answers from: a grade, its reasons and when it was made."""

    level: str  # HEALTHY | WARN | ERROR | FAULT
    reasons: list[dict[str, str]] = field(default_factory=list)  # rule, level, target, message
    graded_at: float = 0.0  # time.time() of the grade
    suite: str = ""


_EXIT = {"HEALTHY": 0, "WARN": 0, "ERROR": 3, "FAULT": 4}


def message_classes() -> tuple[type[Message], type[Message]]:
    """(HealthCheckRequest, HealthCheckResponse), built from descriptors equal to nvhcd.proto's."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="nvhcd.proto", package="nvhcd", syntax="proto3")
    f = descriptor_pb2.FieldDescriptorProto
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="args", number=1, type=f.TYPE_STRING, label=f.LABEL_REPEATED)
    resp = fdp.message_type.add(name="HealthCheckResponse")
    for name, number, kind in (
        ("success", 1, f.TYPE_BOOL),
        ("exit_code", 2, f.TYPE_INT32),
        ("output", 3, f.TYPE_STRING),
        ("error", 4, f.TYPE_STRING),
    ):
        resp.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    svc = fdp.service.add(name="HealthCheckService")
    svc.method.add(
        name=METHOD,
        input_type=".nvhcd.HealthCheckRequest",
        output_type=".nvhcd.HealthCheckResponse",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("nvhcd.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("nvhcd.HealthCheckResponse")),
    )


class HealthAnswerer:
    """The service's logic, apart from gRPC: from the latest grade to NVRx's answer.

    ``latest()`` returns the daemon's latest grade (None before the first); ``refresh()`` runs
    the quick suite and returns its grade. Both are the daemon's; neither acts.
    """

    def __init__(
        self,
        latest: Callable[[], GradeView | None],
        refresh: Callable[[], GradeView | None],
        max_age_s: float = DEFAULT_MAX_AGE_S,
        min_refresh_s: float = DEFAULT_MIN_REFRESH_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._latest, self._refresh = latest, refresh
        self.max_age_s, self.min_refresh_s = max_age_s, min_refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_refresh: float | None = None
        self._refreshed: GradeView | None = None  # the last refresh's grade, newer or not
        self.requests = 0

    def answer(self, args: list[str]) -> dict[str, Any]:
        """The response's fields for one request."""
        with self._lock:
            self.requests += 1
            view = _newest(self._latest(), self._refreshed)
            now = self._clock()
            stale = view is None or now - view.graded_at > self.max_age_s
            may_refresh = (
                self._last_refresh is None or now - self._last_refresh >= self.min_refresh_s
            )
            refreshed = False
            if stale and may_refresh:
                self._last_refresh = now
                try:
                    self._refreshed = self._refresh() or self._refreshed
                    view = _newest(view, self._refreshed)
                    refreshed = True
                except Exception as err:  # noqa: BLE001 - the answer says it; the daemon goes on
                    if view is None:
                        return {
                            "success": False,
                            "exit_code": 1,
                            "output": "",
                            "error": f"node-agent could not grade this node: "
                            f"{type(err).__name__}: {str(err)[:200]}",
                        }
        if view is None:
            return {
                "success": False,
                "exit_code": 1,
                "output": "",
                "error": "node-agent has not graded this node yet; ask again shortly",
            }
        failed = [r for r in view.reasons if r.get("level") in ("ERROR", "FAULT")]
        output = {
            "fail_count": len(failed),
            "failed_checks": sorted({r.get("rule", "") for r in failed}),
            "level": view.level,
            "reasons": view.reasons[:20],
            "graded_at": view.graded_at,
            "age_s": round(max(0.0, now - view.graded_at), 1),
            "suite": view.suite,
            "refreshed": refreshed,
            "source": "node-agent",
            "args_received": [a[:64] for a in args[:16]],
        }
        success = view.level in ("HEALTHY", "WARN")
        if not success and not failed:  # a level without its reasons still fails the check
            output["fail_count"] = 1
        return {
            "success": success,
            "exit_code": _EXIT.get(view.level, 1),
            "output": json.dumps(output, sort_keys=True),
            "error": "",
        }


def _newest(a: GradeView | None, b: GradeView | None) -> GradeView | None:
    if a is None or b is None:
        return a or b
    return a if a.graded_at >= b.graded_at else b


class NvhcdServer:
    """The gRPC server on a Unix socket. ``start()`` binds and serves; ``stop()`` ends it."""

    def __init__(
        self,
        answerer: HealthAnswerer,
        socket_path: str | os.PathLike[str],
        group: str | None = None,
    ) -> None:
        self.answerer = answerer
        self.path = Path(socket_path)
        self.group = group
        self._server: Any = None

    def start(self) -> None:
        import grpc

        request_cls, response_cls = message_classes()

        def run_health_check(request: Any, context: Any) -> Any:
            return response_cls(**self.answerer.answer(list(request.args)))

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                METHOD: grpc.unary_unary_rpc_method_handler(
                    run_health_check,
                    request_deserializer=request_cls.FromString,
                    response_serializer=response_cls.SerializeToString,
                )
            },
        )
        _clear_stale_socket(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvhcd"),
            handlers=[handler],
            maximum_concurrent_rpcs=MAX_CONCURRENT,
        )
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot listen on {self.path}")
        server.start()
        self._server = server
        gid = grp.getgrnam(self.group).gr_gid if self.group else -1
        if gid != -1:
            os.chown(self.path, -1, gid)
        os.chmod(self.path, 0o660 if self.group else 0o666)

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket left by an earlier daemon; refuse anything else at that path (a file or
    a link someone put there is not ours to remove or to listen through)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(
            f"{path} exists and is not a socket this daemon left behind (owner uid "
            f"{st.st_uid}): remove it or set daemon.nvhcd.socket elsewhere"
        )
    os.unlink(path)
