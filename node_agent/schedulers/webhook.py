"""The ``webhook`` adapter: each action is a signed JSON POST to ``adapter.webhook.url``.

Body (UTF-8 JSON, keys sorted)::

    {"schema": "node-agent.action/1", "action": "drain", "node": "gpu-01",
     "reason": "node-agent: FAULT xid79 gpu:5", "idempotency_key": "<64 hex>",
     "at": "2025-01-01T00:00:00Z"}

Header ``X-Node-Agent-Signature: sha256=<hex HMAC-SHA256 of the exact body bytes>`` with the
secret read from ``adapter.webhook.secret_file`` (trailing newline stripped). A receiver checks
it with ``hmac.compare_digest`` before acting, and deduplicates on ``idempotency_key``: the key is
SHA-256 over (node, action, reason), so the same action sent again (a retry, or the agent
completing a half-done action after a crash) carries the same key.

``restart_job`` posts action ``restart-job`` with one more key, ``"job": "slurm:1234"`` (any
kind that passes :func:`~node_agent.schedulers.base.check_job_id`; the receiver restarts the
job, and must check itself that the job runs on ``node``); its idempotency key covers the job.

The receiver's answer decides: any 2xx is success. A connection error, a timeout
(``adapter.webhook.timeout_s``), 408, 429 or 5xx is retried ``adapter.webhook.retries`` times with
exponential backoff (1 s, 2 s, 4 s ...); other 4xx are final. Failure raises AdapterError with the
last status and body, for the journal.

A webhook cannot tell the node's state: ``node_state`` reports ``unknown`` (not drained) and
``list_nodes`` returns an empty list, so the blast-radius guard has no share to read from it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.schedulers.base import (
    AdapterError,
    NodeState,
    check_job_id,
    check_node_name,
    sanitise_reason,
)

if TYPE_CHECKING:
    from node_agent.config import Config

SIGNATURE_HEADER = "X-Node-Agent-Signature"
BODY_SCHEMA = "node-agent.action/1"
_RETRY_STATUS = {408, 429}


def sign(secret: bytes, body: bytes) -> str:
    """The signature header value for ``body``: ``sha256=<hex HMAC-SHA256>``."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def idempotency_key(node: str, action: str, reason: str, job: str | None = None) -> str:
    """SHA-256 over (node, action, reason[, job]): the same action always has the same key."""
    text = f"{node}\n{action}\n{reason}" + (f"\n{job}" if job is not None else "")
    return hashlib.sha256(text.encode()).hexdigest()


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class WebhookAdapter:
    name = "webhook"

    def __init__(self, url: str, secret: bytes, timeout_s: float = 5, retries: int = 3,
                 backoff_s: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], str] = _now_iso, session: Any = None) -> None:
        import requests

        self.url = url
        self._secret = secret
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._clock = clock
        self._session = session or requests.Session()

    @classmethod
    def from_config(cls, config: Config) -> WebhookAdapter:
        url = config.get("adapter.webhook.url")
        secret_file = config.get("adapter.webhook.secret_file")
        if not url:
            raise AdapterError("the webhook adapter needs adapter.webhook.url in the config")
        if not secret_file:
            raise AdapterError("the webhook adapter needs adapter.webhook.secret_file (a file "
                               "holding the HMAC secret shared with the receiver)")
        try:
            secret = Path(secret_file).read_bytes().rstrip(b"\r\n")
        except OSError as err:
            raise AdapterError(f"cannot read adapter.webhook.secret_file {secret_file}: "
                               f"{err.strerror}") from err
        if not secret:
            raise AdapterError(f"adapter.webhook.secret_file {secret_file} is empty")
        return cls(url, secret, timeout_s=config.get("adapter.webhook.timeout_s"),
                   retries=config.get("adapter.webhook.retries"))

    def _post(self, action: str, node: str, reason: str, job: str | None = None,
              key: str | None = None) -> str:
        import requests

        node, reason = check_node_name(node), sanitise_reason(reason)
        if job is not None:
            check_job_id(job)
        payload = {"schema": BODY_SCHEMA, "action": action, "node": node, "reason": reason,
                   "idempotency_key": key or idempotency_key(node, action, reason, job),
                   "at": self._clock(), **({"job": job} if job is not None else {})}
        what = f"{action} {job} on {node}" if job is not None else f"{action} {node}"
        body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(self._secret, body)}
        last = "no attempt made"
        attempts = self.retries + 1
        for attempt in range(attempts):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._session.post(self.url, data=body, headers=headers,
                                          timeout=self.timeout_s)
            except requests.RequestException as err:
                last = f"{type(err).__name__}: {err}"
                continue
            text = " ".join(resp.text.split())[:300]
            if 200 <= resp.status_code < 300:
                return f"webhook: {what} accepted by {self.url} (HTTP {resp.status_code}" \
                       + (f": {text})" if text else ")")
            last = f"HTTP {resp.status_code}: {text}"
            if resp.status_code < 500 and resp.status_code not in _RETRY_STATUS:
                raise AdapterError(f"webhook {self.url} refused {what}: {last}")
        raise AdapterError(f"webhook {self.url}: {what} failed after {attempts} "
                           f"attempt(s); last: {last}; check the receiver and adapter.webhook.url")

    def node_state(self, node: str) -> NodeState:
        return NodeState(name=check_node_name(node), state="unknown", drained=False, reason=None)

    def list_nodes(self) -> list[NodeState]:
        return []

    def drain(self, node: str, reason: str, *, key: str | None = None) -> str:
        return self._post("drain", node, reason, key=key)

    def resume(self, node: str, reason: str, *, key: str | None = None) -> str:
        return self._post("resume", node, reason, key=key)

    def restart(self, node: str, reason: str, *, key: str | None = None) -> str:
        return self._post("restart", node, reason, key=key)

    def replace(self, node: str, reason: str, *, key: str | None = None) -> str:
        return self._post("replace", node, reason, key=key)

    def restart_job(self, node: str, job: str, reason: str, *,
                    key: str | None = None) -> str:
        return self._post("restart-job", node, reason, job=job, key=key)
