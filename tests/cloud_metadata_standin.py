"""A stand-in for the clouds' instance metadata services, on 127.0.0.1.

No cloud can be reached from a test (and none must be), so each provider's documented API is
served here as the provider documents it: GCP's ``computeMetadata/v1/instance/
maintenance-event`` and ``upcoming-maintenance`` (``Metadata-Flavor: Google`` both ways, an
``ETag``, ``wait_for_change``), AWS IMDSv2 (a ``PUT latest/api/token`` first; the events path
refuses a request without the token), Azure Scheduled Events (``Metadata: true``; the
``StartRequests`` acknowledgement is recorded). ``hang`` makes it accept connections and never
answer; ``override`` serves any path with a status and body of the test's choosing.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

AWS_TOKEN = "AQAEAFakeTokenForTests=="


class MetadataStandIn:
    def __init__(self) -> None:
        self.gcp_event = "NONE"
        self.gcp_upcoming: dict[str, Any] | None = None
        self.aws_events: list[dict[str, Any]] = []
        self.azure_events: list[dict[str, Any]] = []
        self.azure_vm = "gpu-vm-1"
        self.acks: list[dict[str, Any]] = []
        self.override: dict[str, tuple[int, str]] = {}
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.hang = False
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> MetadataStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, method: str, path: str, query: dict, headers: Any, body: bytes):
        if path in self.override:
            status, text = self.override[path]
            return status, text, {"Metadata-Flavor": "Google"}
        if path.startswith("/computeMetadata/"):
            if headers.get("Metadata-Flavor") != "Google":
                return 403, "Missing Metadata-Flavor:Google header.", {}
            flavor = {"Metadata-Flavor": "Google"}
            if path == "/computeMetadata/v1/instance/maintenance-event":
                return 200, self.gcp_event, {**flavor, "ETag": f"etag-{self.gcp_event}"}
            if path == "/computeMetadata/v1/instance/upcoming-maintenance":
                if self.gcp_upcoming is None:
                    return 404, "Not Found", flavor
                return 200, json.dumps(self.gcp_upcoming), flavor
        if path == "/latest/api/token" and method == "PUT":
            if not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return 400, "Bad Request", {}
            return 200, AWS_TOKEN, {}
        if path == "/latest/meta-data/events/maintenance/scheduled":
            if headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:
                return 401, "Unauthorized", {}
            return 200, json.dumps(self.aws_events), {}
        if path.startswith("/metadata/"):
            if headers.get("Metadata") != "true":
                return 400, json.dumps({"error": "Bad request. Required metadata header"}), {}
            if path == "/metadata/instance/compute/name":
                return 200, self.azure_vm, {}
            if path == "/metadata/scheduledevents" and method == "POST":
                self.acks.append(json.loads(body))
                return 200, "", {}
            if path == "/metadata/scheduledevents":
                return 200, json.dumps({"DocumentIncarnation": 2, "Events": self.azure_events}), {}
        return 404, "Not Found", {}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                standin.requests.append((method, parts.path, query))
                if standin.hang:  # accept, read, never answer (until the test ends)
                    deadline = time.monotonic() + 30
                    while not standin._stop.is_set() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    return
                status, text, extra = standin._answer(method, parts.path, query, self.headers, body)
                data = text.encode()
                self.send_response(status)
                for key, value in extra.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                self._serve("GET")

            def do_PUT(self) -> None:  # noqa: N802
                self._serve("PUT")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        return Handler
