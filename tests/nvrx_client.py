"""A client of the node health-check service that keeps NVRx's wire contract and behaviour.

The registry serves nvidia-resiliency-ext only up to 0.4.1, which has no node health-check
client, so the tests cannot use NVRx's own ``NodeHealthCheck`` class. This one follows it line
for line in what it decides (nvidia_resiliency_ext/shared_utils/health_check.py,
``NodeHealthCheck._perform_health_check`` and ``_validate_and_get_target``, NVRx 0.7): its stubs
are generated at test time from our ``packaging/nvrx/nvhcd.proto`` (the same package, service,
method and field numbers as NVRx's ``shared_utils/proto/nvhcd.proto``), and

- the endpoint ``unix:///path``, ``/path`` or ``./path`` is a Unix socket; another form skips
  the check (healthy); the socket's existence is tested once, when the client is made, and a
  missing (or unreachable: ``os.path.exists`` is false) socket skips the check (healthy);
- each call opens an insecure channel and calls ``RunHealthCheck`` with NVRx's default request
  (``--no-slurm --group prolog epilog logs gpu`` since 0.7) and its default 60 s timeout;
- any exception of the call (a timeout, a refused or reset connection, RESOURCE_EXHAUSTED)
  skips the check (healthy): NVRx fails open, which is why the service must not;
- ``success`` false is unhealthy; then the JSON ``output`` must parse and hold ``fail_count``,
  and only ``fail_count == 0`` is healthy.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

PROTO = Path(__file__).resolve().parents[1] / "packaging" / "nvrx" / "nvhcd.proto"
DEFAULT_ARGS = ("--no-slurm", "--group", "prolog", "epilog", "logs", "gpu")  # NVRx's defaults


@functools.cache
def generated_modules():
    """(nvhcd_pb2, nvhcd_pb2_grpc) compiled from packaging/nvrx/nvhcd.proto with grpc_tools."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="nvhcd-proto-"))
    code = protoc.main(
        [
            "protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
    sys.path.insert(0, str(out))
    try:
        for name in ("nvhcd_pb2", "nvhcd_pb2_grpc"):
            sys.modules.pop(name, None)
        return importlib.import_module("nvhcd_pb2"), importlib.import_module("nvhcd_pb2_grpc")
    finally:
        sys.path.remove(str(out))


class NodeHealthCheck:
    def __init__(self, endpoint: str, args=DEFAULT_ARGS, request_timeout_sec: float = 60):
        import grpc

        self._grpc = grpc
        self._pb2, self._pb2_grpc = generated_modules()
        self.args = list(args)
        self.request_timeout_sec = request_timeout_sec
        self.last_output: dict | None = None
        self.last_response = None
        self.skipped: str | None = None
        self._target = self._resolve(endpoint)

    def _resolve(self, endpoint: str) -> str | None:
        if endpoint.startswith("unix://"):
            target = endpoint
        elif endpoint.startswith(("/", "./")):
            target = f"unix://{endpoint}"
        else:
            self.skipped = f"{endpoint} is not a Unix socket"
            return None
        if not os.path.exists(target[len("unix://") :]):
            self.skipped = f"{target} does not exist"
            return None
        return target

    def __call__(self) -> bool:
        if self._target is None:
            return True
        try:
            with self._grpc.insecure_channel(self._target) as channel:
                stub = self._pb2_grpc.HealthCheckServiceStub(channel)
                response = stub.RunHealthCheck(
                    self._pb2.HealthCheckRequest(args=self.args), timeout=self.request_timeout_sec
                )
                self.last_response = response
                if not response.success:
                    self._remember(response.output)
                    return False
                try:
                    output = json.loads(response.output)
                except json.JSONDecodeError:
                    return False
                self.last_output = output
                if output.get("fail_count") is None:
                    return False
                return output["fail_count"] == 0
        except Exception as err:  # NVRx: a connectivity error skips the check (healthy)
            self.skipped = f"connectivity: {err}"
            return True

    def _remember(self, output: str) -> None:
        """Keep the output of an unhealthy answer for the test to read (NVRx logs it)."""
        try:
            self.last_output = json.loads(output) if output else None
        except json.JSONDecodeError:
            self.last_output = None


#: a script: ``python -c STALL SOCKET N`` opens N calls that never send their message, prints
#: "ready" and holds them (``tests/`` on its PYTHONPATH)
STALL = """
import sys, threading
from nvrx_client import stall_calls
stall_calls(sys.argv[1], int(sys.argv[2]), threading.Event())
print("ready", flush=True)
threading.Event().wait()
"""


def stall_calls(sock, n: int, release: threading.Event) -> list:
    """Open ``n`` calls of ``RunHealthCheck`` on ``sock`` that send their headers and never
    their message (each on its own connection: a local subchannel pool per channel) until
    ``release`` is set; returns the (channel, future) pairs. The stalled client of the round's
    finding, not a part of NVRx."""
    import grpc

    def never():
        release.wait()
        return
        yield  # a generator that sends no message

    calls = []
    for _ in range(n):
        channel = grpc.insecure_channel(
            f"unix://{sock}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        method = channel.stream_unary(
            "/nvhcd.HealthCheckService/RunHealthCheck",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        calls.append((channel, method.future(never(), timeout=600)))
    return calls
