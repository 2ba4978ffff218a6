"""The ``webhook`` adapter: each action is a signed JSON POST to ``adapter.webhook.url``.

Body (UTF-8 JSON, keys sorted)::

    {"schema": "node-agent.action/2", "action": "drain", "node": "gpu-01",
     "reason": "node-agent: FAULT xid79 gpu:5", "idempotency_key": "<64 hex>",
     "at": "2025-01-01T00:00:00Z", "timestamp": 1735689600, "nonce": "<32 hex>"}

Headers::

    X-Node-Agent-Timestamp: 1735689600               (Unix seconds, the body's "timestamp")
    X-Node-Agent-Nonce: <32 hex>                     (the body's "nonce", fresh per request)
    X-Node-Agent-Signature: sha256=<hex HMAC-SHA256 of b"<timestamp>." + body>

with the secret read from ``adapter.webhook.secret_file`` (trailing newline stripped). The
signature covers the timestamp and the body (which holds the nonce), so a captured request
cannot be replayed later or with another nonce. A receiver (docs/schedulers.md has the code):

1. rejects a timestamp more than 300 s from its own clock (a replay window of 5 minutes);
2. checks the signature with ``hmac.compare_digest`` over ``timestamp + "." + raw body``;
3. rejects a nonce it has seen in the last 10 minutes (a replay inside the window);
4. deduplicates on ``idempotency_key``: the agent's key for this step of this fault — the same
   on every retry (a webhook retry, the daemon's retry while the fault stands, the agent
   completing a half-done action after a crash), and new for the same fault after a repair
   (it covers the fault's first sighting in the episode, ``remediation/executor.py``).

``replace`` adds ``"evidence": "<path>"`` when the agent took the driver's bug report before
the request (``nvidia-bug-report.sh``, a file on the node under its state directory: the
receiver fetches it for the RMA; remediation/evidence.py); the key is absent when none was
taken. ``restart_job`` posts action ``restart-job`` with two more keys, ``"job": "slurm:1234"`` and
``"uid": 1001``, the uid of the hung process (only a job the kernel vouched for reaches an
adapter: ``training/processes.py``; a pod's job carries its UID, ``pod:<ns>/<name>@<uid>``, and
``uid`` is null when the job carries none). The receiver restarts it and must check itself
that the job runs on ``node`` and that it belongs to ``uid`` (a user's process can name
another user's job in its environment; only the cgroup and the uid are the kernel's word).

Transport: ``https`` (verified against ``adapter.webhook.ca_file``, else the system CAs, with an
optional client certificate ``client_cert``/``client_key``); plain ``http`` only to a loopback
address, where nothing crosses a network (so no proxy of the environment's is used for it).
Anything else is a configuration error. A loopback receiver has no certificate to show, and any
user may listen on its port where it is not running: a request is sent only while the port is
held by root or an account in ``adapter.webhook.receiver_users``, and its answer believed only
if that is still so after it (:func:`node_agent.peers.why_not_trusted`).

The receiver's answer decides: any 2xx is success. A connection error, a timeout, 408, 429 or
5xx is retried ``adapter.webhook.retries`` times with exponential backoff (1 s, 2 s, 4 s ...);
other 4xx are final. ``timeout_s`` bounds one request; ``deadline_s`` bounds the whole action,
retries and backoff included: a receiver that answers one byte at a time cannot hold the agent
past it. Failure raises AdapterError with the last status and body, for the journal.

A webhook cannot tell the node's state: ``node_state`` reports ``unknown`` (not drained) and
``list_nodes`` returns an empty list, so the blast-radius guard has no share to read from it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from node_agent.model import utc_iso
from node_agent.peers import why_not_trusted
from node_agent.schedulers.base import (
    ActionByName,
    AdapterAction,
    AdapterError,
    AdapterOutcome,
    NodeState,
    check_node_name,
    split_job_uid,
)

if TYPE_CHECKING:
    from node_agent.config import Config, WebhookConfig

SIGNATURE_HEADER = "X-Node-Agent-Signature"
TIMESTAMP_HEADER = "X-Node-Agent-Timestamp"
NONCE_HEADER = "X-Node-Agent-Nonce"
BODY_SCHEMA = "node-agent.action/2"
#: what a receiver should accept between its clock and the request's timestamp (docs)
MAX_SKEW_S = 300
_RETRY_STATUS = {408, 429}
_MAX_ANSWER_CHARS = 300


def sign(secret: bytes, body: bytes, timestamp: int | str) -> str:
    """The signature header value: ``sha256=<hex HMAC-SHA256 of b"<timestamp>." + body>``."""
    return "sha256=" + hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def idempotency_key(node: str, action: str, reason: str, job: str | None = None) -> str:
    """SHA-256 over (node, action, reason[, job]): the key when the caller gives none."""
    text = f"{node}\n{action}\n{reason}" + (f"\n{job}" if job is not None else "")
    return hashlib.sha256(text.encode()).hexdigest()


def check_url(url: str) -> str:
    """``url`` if it is ``https://``, or ``http://`` to a loopback address; else AdapterError."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and parts.hostname:
        host = parts.hostname
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if loopback:
            return url
        raise AdapterError(
            f"adapter.webhook.url {url!r}: plain http is allowed only to a "
            "loopback address (127.0.0.1, ::1, localhost); use https:// with "
            "adapter.webhook.ca_file for a receiver on the network"
        )
    raise AdapterError(
        f"adapter.webhook.url {url!r}: expected an https:// URL (or http:// to a loopback address)"
    )


class WebhookAdapter(ActionByName):
    name = "webhook"

    def __init__(
        self,
        web: WebhookConfig,
        secret: bytes,
        *,
        backoff_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], str] = utc_iso,
        session: Any = None,
        unix_time: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``web``: the ``adapter.webhook`` section (its url, timeout, retries, deadline and TLS
        files), ``secret``: the HMAC key read from its ``secret_file`` (:meth:`from_config`)."""
        import requests

        self.url = check_url(web.url or "")
        self.web = web
        self._secret = secret
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._clock = clock
        self._unix_time = unix_time
        self._monotonic = monotonic
        self._session = session or requests.Session()
        if urlsplit(self.url).scheme == "http":
            # loopback: nothing may cross a network, so no proxy from the environment (its
            # answer would decide the outcome) and no ~/.netrc credentials
            self._session.trust_env = False
        self._verify: bool | str = web.ca_file or True
        self._cert: tuple[str, str] | str | None = (
            (web.client_cert, web.client_key)
            if web.client_cert and web.client_key
            else web.client_cert or None
        )

    @classmethod
    def from_config(cls, config: Config) -> WebhookAdapter:
        web = config.adapter.webhook
        url, secret_file = web.url, web.secret_file
        if not url:
            raise AdapterError("the webhook adapter needs adapter.webhook.url in the config")
        if not secret_file:
            raise AdapterError(
                "the webhook adapter needs adapter.webhook.secret_file (a file "
                "holding the HMAC secret shared with the receiver)"
            )
        try:
            secret = Path(secret_file).read_bytes().rstrip(b"\r\n")
        except OSError as err:
            raise AdapterError(
                f"cannot read adapter.webhook.secret_file {secret_file}: {err.strerror}"
            ) from err
        if not secret:
            raise AdapterError(f"adapter.webhook.secret_file {secret_file} is empty")
        w = "adapter.webhook."
        for key, path in (
            ("ca_file", web.ca_file),
            ("client_cert", web.client_cert),
            ("client_key", web.client_key),
        ):
            if path and not Path(path).is_file():
                raise AdapterError(f"{w}{key} {path}: no such file")
        if web.client_key and not web.client_cert:
            raise AdapterError(f"{w}client_key is set without {w}client_cert")
        if not url.startswith("https://") and (web.ca_file or web.client_cert):
            raise AdapterError(f"{w}ca_file/client_cert apply to an https:// url only")
        return cls(web, secret)

    def _send(self, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
        """One POST, abandoned at ``timeout_s`` whatever the receiver does (a slow drip of
        bytes resets requests' per-read timeout; this does not): raises TimeoutError."""
        box: dict[str, Any] = {}

        def post() -> None:
            try:
                resp = self._session.post(
                    self.url,
                    data=body,
                    headers=headers,
                    timeout=timeout_s,
                    verify=self._verify,
                    cert=self._cert,
                    stream=True,
                    allow_redirects=False,
                )
                # the answer is only read for the journal: a bounded piece of it
                raw = resp.raw.read(4 * _MAX_ANSWER_CHARS, decode_content=True) or b""
                box["answer"] = (resp.status_code, raw.decode("utf-8", "replace"))
                resp.close()
            except Exception as err:  # noqa: BLE001 - handed to the caller below
                box["error"] = err

        worker = threading.Thread(target=post, name="webhook-post", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise TimeoutError(f"no complete answer within {timeout_s:.1f} s")
        if "error" in box:
            raise box["error"]
        return box["answer"]

    def _act(self, act: AdapterAction) -> AdapterOutcome:
        import requests

        action, node, reason, job, what = act.action, act.node, act.reason, act.job, act.what
        extra: dict[str, Any] = {"evidence": act.evidence} if act.evidence else {}
        if job is not None:
            bare, uid = split_job_uid(job)
            extra.update(job=bare, uid=uid)
        start = self._monotonic()
        last = "no attempt made"
        attempts = self.web.retries + 1
        made = 0
        for attempt in range(attempts):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if self._monotonic() - start + pause >= self.web.deadline_s:
                    break
                self._sleep(pause)
            left = self.web.deadline_s - (self._monotonic() - start)
            if left <= 0:
                break
            timestamp = int(self._unix_time())
            nonce = secrets.token_hex(16)
            payload = {
                "schema": BODY_SCHEMA,
                "action": action,
                "node": node,
                "reason": reason,
                "idempotency_key": act.key or idempotency_key(node, action, reason, job),
                "at": self._clock(),
                "timestamp": timestamp,
                "nonce": nonce,
                **extra,
            }
            body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: str(timestamp),
                NONCE_HEADER: nonce,
                SIGNATURE_HEADER: sign(self._secret, body, timestamp),
            }
            if distrust := self._receiver_distrust():
                last = f"not sent: {distrust}"
                continue
            made += 1
            try:
                status, answer = self._send(body, headers, min(self.web.timeout_s, left))
            except (requests.RequestException, TimeoutError, OSError) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            text = " ".join(answer.split())[:_MAX_ANSWER_CHARS]
            if 200 <= status < 300 and (distrust := self._receiver_distrust()):
                last = f"HTTP {status}, not believed: after it, {distrust}"
                continue
            if 200 <= status < 300:
                return AdapterOutcome.done(
                    f"webhook: {what} accepted by {self.url} (HTTP {status}"
                    + (f": {text})" if text else ")")
                )
            last = f"HTTP {status}: {text}"
            if status < 500 and status not in _RETRY_STATUS:
                raise AdapterError(f"webhook {self.url} refused {what}: {last}")
        raise AdapterError(
            f"webhook {self.url}: {what} failed after {made} attempt(s) within "
            f"the {self.web.deadline_s:g} s deadline (adapter.webhook.deadline_s); "
            f"last: {last}; check the receiver and adapter.webhook.url"
        )

    def _receiver_distrust(self) -> str | None:
        """Why a receiver on this host may not be asked (None: it may, or it is https)."""
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            return None
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        distrust = why_not_trusted(f"{host}:{parts.port or 80}", 80, self.web.receiver_users)
        return distrust and (
            f"{distrust}; a receiver on this host must run as root or an account in "
            "adapter.webhook.receiver_users"
        )

    def node_state(self, node: str) -> NodeState:
        return NodeState(
            name=check_node_name(node), state="unknown", drained=False, reason=None, known=False
        )

    def list_nodes(self) -> list[NodeState]:
        return []
