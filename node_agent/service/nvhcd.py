"""NVRx's node health-check service, answered from the node's state; it fails closed.

NVIDIA's resiliency extension restarts a job's workers in place; before it does, its
``ft_launcher`` asks a node-local gRPC service over a Unix socket
(``--ft-node-health-check-endpoint unix:///var/run/nvhcd.sock``) whether the node is fit:
``nvhcd.HealthCheckService/RunHealthCheck`` (packaging/nvrx/nvhcd.proto states the wire contract).
NVRx reads ``success`` and, in the JSON ``output``, ``fail_count``: 0 is healthy. It treats a
timeout, a refused call and a missing socket as "healthy, skip", so this service must never
time out, refuse or vanish while the node is not known to be healthy:

- the answer is the daemon's :class:`~node_agent.service.node_state.NodeView`, already made
  (HEALTHY or WARN: fit; ERROR, FAULT or UNKNOWN: not, with the reasons); a call reads it and
  never waits on a check, so a stalled client never delays another;
- a gate in front of gRPC (:class:`_Gate`) owns the public socket: it reads each caller's uid
  (``SO_PEERCRED``), holds at most ``max_per_uid`` calls of one uid and ``MAX_CALLS`` in all
  (past a cap the oldest call of that uid, or of the uid holding most, is closed), and closes a
  call older than ``call_s``; gRPC listens on a private socket (0700 directory) with more
  workers than the gate lets calls through, one stream per connection;
- a caller is told the node's level and its reasons, with other users' jobs, pids and stack
  frames left out unless the caller's uid owns them (root sees all);
- the request's ``args`` (NVRx >= 0.7 sends ``--no-slurm --group prolog epilog logs gpu``)
  are accepted, logged and echoed, never run; only ``RunHealthCheck`` is served.

The socket is 0666 (the job runs as its user) or 0660 with ``daemon.nvhcd.group``, in a
directory the job's users can traverse (a missing one is made 0755, or 0750 for the group; one
they cannot reach is a WARN finding, as is a socket that cannot be served).

The message classes are built at run time from descriptors equal to the .proto's (no generated
code, so no protoc and no generated-code/runtime version pairing to keep);
``tests/unit/test_nvhcd.py`` compiles the .proto and checks they agree.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import secrets
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.peers import unix_peer
from node_agent.remediation.plan import JOB_RULES
from node_agent.report.terminal import printable
from node_agent.service.node_state import UNKNOWN, NodeView, ViewReason
from node_agent.service.sd_notify import inherited_unix_listener

if TYPE_CHECKING:
    from google.protobuf.message import Message

log = logging.getLogger("node_agent.service.nvhcd")

SERVICE = "nvhcd.HealthCheckService"
METHOD = "RunHealthCheck"
#: the shipped unit's runtime directory; tmpfiles links NVRx's default /run/nvhcd.sock to it
DEFAULT_SOCKET = "/run/node-agent/nvhcd.sock"
#: calls of one uid held open at once (daemon.nvhcd.max_per_uid's default)
MAX_PER_UID = 4
#: calls held open at once in all; gRPC has twice as many workers
MAX_CALLS = 64
#: the longest a call may take, its request's arrival included (daemon.nvhcd.call_s's default);
#: an answer takes milliseconds (it is read, never computed)
CALL_S = 5.0
#: the abstract-socket prefix of the gate's connections to gRPC (the peer gRPC reports)
_PEER_PREFIX = "node-agent-nvhcd-"
#: the largest request read (NVRx sends a few short args)
MAX_REQUEST_BYTES = 64 << 10

_EXIT = {"HEALTHY": 0, "WARN": 0, "ERROR": 3, "FAULT": 4}
_UNFIT = ("ERROR", "FAULT")


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
    """The service's logic, apart from gRPC: from the node's view to NVRx's answer.

    ``view()`` returns the daemon's current :class:`NodeView` (None before its first grading);
    it is read, never computed, so an answer never waits on a check."""

    def __init__(
        self, view: Callable[[], NodeView | None], clock: Callable[[], float] = time.time
    ) -> None:
        self._view = view
        self._clock = clock
        self._lock = threading.Lock()
        self._args_seen: set[tuple[str, ...]] = set()
        self.requests = 0

    def answer(self, args: list[str], uid: int | None = None) -> dict[str, Any]:
        """The response's fields for one request of ``uid`` (None: unknown, told the least)."""
        shown = [printable(a)[:64] for a in args[:16]]
        with self._lock:
            self.requests += 1
            first = tuple(shown) not in self._args_seen and len(self._args_seen) < 32
            self._args_seen.add(tuple(shown))
        (log.info if first else log.debug)(
            "NVRx health check asked by uid %s with args %s", uid, " ".join(shown) or "(none)"
        )
        view, now = self._view(), self._clock()
        common: dict[str, Any] = {"source": "node-agent", "args_received": shown}
        level = _node_level(view, uid) if view is not None else UNKNOWN
        if view is None or level == UNKNOWN:
            why = (
                "node-agent has not graded this node yet; ask again shortly"
                if view is None
                else view.why_unknown()
                if view.missing
                else "node-agent's only ERRORs are other users' training jobs' and its checks of "
                "the node itself are not all in yet; ask again shortly"
            )
            output = {
                **common,
                "fail_count": 1,
                "failed_checks": ["node-state-unknown"],
                "level": "UNKNOWN",
                "missing_checks": list(view.missing) if view else [],
                "reasons": view.reasons_for(uid)[:20] if view else [],
            }
            return {"success": False, "exit_code": 1, "output": _json(output), "error": why}
        failed = [r for r in view.reasons if r.level in _UNFIT and _counts_for(r, uid)]
        output = {
            **common,
            "fail_count": len(failed),
            "failed_checks": sorted({r.rule for r in failed}),
            "level": level,
            "reasons": view.reasons_for(uid)[:20],
            "graded_at": view.graded_at,
            "age_s": round(max(0.0, now - view.graded_at), 1),
            "complete": view.complete,
            "stored_grade": view.stored_grade,
            "result_age_s": view.ages(now),
            "restored_checks": sorted(view.restored),
            "suite": view.suite,
        }
        success = level in ("HEALTHY", "WARN")
        if not success and not failed:  # a level without its reasons still fails the check
            output["fail_count"] = 1
        return {
            "success": success,
            "exit_code": _EXIT.get(level, 1),
            "output": _json(output),
            "error": "",
        }


def _counts_for(reason: ViewReason, uid: int | None) -> bool:
    """Whether an ERROR or FAULT reason makes the node unfit for ``uid``: every finding about
    the node does; a training job's (``JOB_RULES``: a hung job, for which the node is not
    drained either) only for that job's user and root, whose restart it is."""
    return reason.rule not in JOB_RULES or (
        uid is not None and (uid == 0 or reason.owner_uid == uid)
    )


def _node_level(view: NodeView, uid: int | None) -> str:
    """The view's level as the node's fitness for ``uid``: an ERROR or FAULT made only of other
    users' jobs' findings is theirs, not the node's: WARN where every check is in, UNKNOWN
    while they are not (the node's own checks could still find it unfit)."""
    unfit = [r for r in view.reasons if r.level in _UNFIT]
    if view.level not in _UNFIT or not unfit:  # a level without its reasons stands as it is
        return view.level
    counted = [r.level for r in unfit if _counts_for(r, uid)]
    if counted:
        return "FAULT" if "FAULT" in counted else "ERROR"
    return "WARN" if view.complete and not view.stored_grade else UNKNOWN


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True)


@dataclass
class _Call:
    """One caller's connection through the gate, and its connection on to gRPC."""

    uid: int
    client: socket.socket
    backend: socket.socket
    opened: float
    token: str
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.backend):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Gate:
    """The public socket: who calls (``SO_PEERCRED``), how many at once, for how long.

    Each accepted call gets a connection to the private gRPC socket bound to an unguessable
    abstract name; gRPC reports that name as the call's peer, and :meth:`uid_of` maps it back
    to the caller's uid. A thread per call copies bytes until either side closes or
    ``call_s`` passes (calls are at most ``max_calls``, so threads are too)."""

    def __init__(
        self,
        public: Path,
        backend: str,
        *,
        max_per_uid: int,
        max_calls: int,
        call_s: float,
        clock: Callable[[], float] = time.monotonic,
        listener: socket.socket,
    ) -> None:
        """``listener``: the public socket, listening."""
        self.public, self.backend = public, backend
        self.max_per_uid, self.max_calls, self.call_s = max_per_uid, max_calls, call_s
        self._clock = clock
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.evicted = 0
        self.listener = listener
        self.listener.settimeout(0.25)

    def serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as err:
                if self._stop.is_set():
                    return
                log.debug("nvhcd: accept failed: %s", err)
                time.sleep(0.05)
                continue
            try:
                self._admit(client)
            except OSError as err:
                log.warning("nvhcd: a call could not be passed on to gRPC: %s", err)
                client.close()

    def _admit(self, client: socket.socket) -> None:
        uid = unix_peer(client).uid
        token = secrets.token_hex(12)
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            backend.bind("\0" + _PEER_PREFIX + token)
            backend.settimeout(1.0)
            backend.connect(self.backend)
        except OSError:
            backend.close()
            raise
        call = _Call(uid, client, backend, self._clock(), token)
        with self._lock:
            self._make_room(uid)
            self._calls[token] = call
        threading.Thread(target=self._pump, args=(call,), name="nvhcd-call", daemon=True).start()

    def _make_room(self, uid: int) -> None:
        """Under the lock: close the oldest call of ``uid`` while it is at its cap, and the
        oldest of the uid holding most while all are at theirs."""
        while True:
            mine = [c for c in self._calls.values() if c.uid == uid and not c.closed.is_set()]
            live = [c for c in self._calls.values() if not c.closed.is_set()]
            if len(mine) >= self.max_per_uid:
                victim = min(mine, key=lambda c: c.opened)
            elif len(live) >= self.max_calls:
                counts: dict[int, int] = {}
                for c in live:
                    counts[c.uid] = counts.get(c.uid, 0) + 1
                heaviest = max(counts, key=lambda u: counts[u])
                victim = min((c for c in live if c.uid == heaviest), key=lambda c: c.opened)
            else:
                return
            victim.close()
            self.evicted += 1
            log.debug("nvhcd: closed a call of uid %d to make room (a cap)", victim.uid)

    def _pump(self, call: _Call) -> None:
        ends = {call.client.fileno(): (call.client, call.backend)}
        ends[call.backend.fileno()] = (call.backend, call.client)
        poller = select.poll()
        for fd in ends:
            poller.register(fd, select.POLLIN)
        try:
            while not call.closed.is_set():
                left = call.opened + self.call_s - self._clock()
                if left <= 0:
                    log.debug(
                        "nvhcd: a call of uid %d passed %.1f s: closed", call.uid, self.call_s
                    )
                    return
                for fd, _ in poller.poll(left * 1000):
                    src, dst = ends[fd]
                    try:
                        data = src.recv(65536)
                        if data:
                            dst.settimeout(max(0.01, left))
                            dst.sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        return
        finally:
            call.close()
            call.client.close()
            call.backend.close()
            with self._lock:
                self._calls.pop(call.token, None)

    def uid_of(self, peer: str) -> int | None:
        """The caller's uid for gRPC's ``context.peer()`` of a call through the gate."""
        _, _, name = peer.partition(":")
        if not name.startswith(_PEER_PREFIX):
            return None
        with self._lock:
            call = self._calls.get(name[len(_PEER_PREFIX) :])
        return call.uid if call is not None else None

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._lock:
            for call in list(self._calls.values()):
                call.close()


class NvhcdServer:
    """The service: the gate on ``socket_path`` in front of gRPC on a private socket.
    ``start()`` binds and serves, returning what keeps the job's users from reaching it (a
    note each, for the daemon's findings); ``stop()`` ends it."""

    def __init__(
        self,
        answerer: HealthAnswerer,
        socket_path: str | os.PathLike[str],
        group: str | None = None,
        *,
        max_per_uid: int = MAX_PER_UID,
        max_calls: int = MAX_CALLS,
        call_s: float = CALL_S,
    ) -> None:
        self.answerer = answerer
        self.path = Path(socket_path)
        self.group = group
        self.max_per_uid, self.max_calls, self.call_s = max_per_uid, max_calls, call_s
        self._server: Any = None
        self._gate: _Gate | None = None
        self._private: str | None = None
        #: the listening socket systemd passed for ``socket_path`` (socket activation), if any
        self._held: socket.socket | None = None

    def start(self) -> list[str]:
        import grpc

        self._held = inherited_unix_listener(str(self.path))
        if self._held is not None:
            listener, notes = self._held, _make_parent(self.path.parent, _gid(self.group))
        else:
            listener, notes = public_listener(self.path, self.group)
        self._private = tempfile.mkdtemp(prefix="node-agent-nvhcd-")  # 0700, root's
        backend = os.path.join(self._private, "grpc.sock")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * self.max_calls, thread_name_prefix="nvhcd"),
            handlers=[self._handler(grpc)],
            options=[
                ("grpc.max_concurrent_streams", 1),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ],
        )
        if server.add_insecure_port(f"unix:{backend}") == 0:
            shutil.rmtree(self._private, ignore_errors=True)
            if self._held is None:
                listener.close()
            raise OSError(f"cannot listen on {backend}")
        server.start()
        self._server = server
        try:
            self._gate = _Gate(
                self.path,
                backend,
                max_per_uid=self.max_per_uid,
                max_calls=self.max_calls,
                call_s=self.call_s,
                listener=listener,
            )
            _open_to_callers(self.path, self.group)
        except OSError:
            self.stop()
            raise
        threading.Thread(target=self._gate.serve, name="nvhcd-gate", daemon=True).start()
        return notes

    def _handler(self, grpc: Any) -> Any:
        request_cls, response_cls = message_classes()

        def run_health_check(request: Any, context: Any) -> Any:
            gate = self._gate
            uid = gate.uid_of(context.peer()) if gate is not None else None
            try:
                return response_cls(**self.answerer.answer(list(request.args), uid))
            except Exception as err:  # noqa: BLE001 - an exception would read as "skip" to NVRx
                log.exception("nvhcd: answering failed")
                return response_cls(
                    success=False,
                    exit_code=1,
                    output=_json({"fail_count": 1, "failed_checks": ["node-agent-error"]}),
                    error=f"node-agent could not answer: {type(err).__name__}",
                )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                METHOD: grpc.unary_unary_rpc_method_handler(
                    run_health_check,
                    request_deserializer=request_cls.FromString,
                    response_serializer=response_cls.SerializeToString,
                )
            },
        )

    @property
    def held_across_restarts(self) -> bool:
        """The public socket was passed to this daemon (by systemd's socket unit, or by
        ``daemon --keep-socket``): it outlives this daemon."""
        return self._held is not None

    @property
    def evicted(self) -> int:
        """Calls the gate closed to make room (a cap)."""
        return self._gate.evicted if self._gate is not None else 0

    def stop(self, grace_s: float = 1.0) -> None:
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
        if self._held is not None:
            return  # the holder's socket: it keeps listening, and callers wait for the next daemon
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def public_listener(path: Path, group: str | None) -> tuple[socket.socket, list[str]]:
    """The public socket bound at ``path`` and listening, open to NVRx's callers (0666, or
    0660 and ``group``'s), with :func:`_make_parent`'s notes. OSError where the directory is
    not root's alone or something not ours is at the path."""
    notes = _make_parent(path.parent, _gid(group))
    _clear_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(128)
        _open_to_callers(path, group)
    except OSError:
        listener.close()
        raise
    return listener, notes


def _gid(group: str | None) -> int:
    return grp.getgrnam(group).gr_gid if group else -1


def _open_to_callers(path: Path, group: str | None) -> None:
    gid = _gid(group)
    if gid != -1:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660 if group else 0o666)


def _make_parent(directory: Path, gid: int) -> list[str]:
    """Make the socket's directory if missing (0755, or 0750 and ``gid``'s); return a note for
    each directory on the way that keeps the job's users from reaching the socket. OSError when
    another user could take the path (:func:`_refuse_a_shared_directory`)."""
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o755)
        if gid != -1:
            os.chown(directory, -1, gid)
        os.chmod(directory, 0o750 if gid != -1 else 0o755)  # whatever the umask
    _refuse_a_shared_directory(directory)
    notes = []
    for d in (directory, *directory.parents):
        st = os.stat(d)
        reachable = st.st_mode & 0o001 or (gid != -1 and st.st_gid == gid and st.st_mode & 0o010)
        if not reachable:
            notes.append(
                f"the NVRx socket's directory {d} is mode {stat.S_IMODE(st.st_mode):04o} (uid "
                f"{st.st_uid}): the job's users cannot reach {directory}; make it 0755 (or "
                "name a group in daemon.nvhcd.group and give it that group)"
            )
            break
    return notes


def _refuse_a_shared_directory(directory: Path) -> None:
    """OSError unless only root (or this daemon's user) can change what ``directory`` holds:
    a user who can write there could bind the socket's name first and answer NVRx as the
    daemon, or swap the socket for a link between its bind and its chmod. Above it, a
    directory others can write must be sticky (others then cannot rename what is not theirs)."""
    owners = {0, os.geteuid()}
    for d in (directory, *directory.parents):
        st = os.stat(d)
        others_write = st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != 0)
        sticky_above = d != directory and st.st_mode & stat.S_ISVTX
        if st.st_uid not in owners or (others_write and not sticky_above):
            raise OSError(
                f"the NVRx socket's directory {directory} is not root's alone ({d}: uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): another user could put "
                "their own socket at its path and answer NVRx as node-agent; set "
                "daemon.nvhcd.socket in a directory only root can write (the default "
                f"{DEFAULT_SOCKET})"
            )


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
