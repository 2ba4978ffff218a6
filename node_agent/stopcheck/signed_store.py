"""The process group's rendezvous, signed: what gloo and NCCL write in the store is believed only
under the job's key.

A process group meets through the job's store: each rank sets its address (gloo) or its
communicator id (NCCL) there, and its peers connect to what they read. The store authenticates
nobody and lists its keys to any client, so a local user who reaches the port could replace a
rank's address with its own, sit between two ranks, and change the bytes of the phases' bulk
transfers (the ring exchange, the replay's reductions) to have a healthy node named. Wrapped in
:class:`SignedStore`, every value the group sets carries an HMAC over its key name and bytes
under a key derived from the job's key and this run's session; a value that does not verify is
an error in the phase that read it, and the run stops with exit 2 naming no one.

torch imports here at module level: only :func:`node_agent.stopcheck.ranks.init_group` imports
this module, once torch is needed anyway.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta
from typing import Any

import torch.distributed as dist

MAC_BYTES = 32
#: Every SignedStore made in this process. torch keeps only the C++ side of a Python store; once
#: the Python object is collected, a call from C++ finds no method ("Not implemented"), so the
#: stores live as long as the process (one per process group, a handful per run).
_LIVE: list[SignedStore] = []


class SignedStore(dist.Store):
    """A store whose values are signed on ``set`` and verified on ``get``; counters (``add``)
    and waits pass through: a stranger who changes a counter can stall or stop a run, never
    steer one."""

    def __init__(self, inner: Any, mac_key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._mac_key = mac_key
        _LIVE.append(self)

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._mac_key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        return self._verified(key, bytes(self._inner.get(key)))

    def _verified(self, key: str, raw: bytes) -> bytes:
        mac, data = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, data)):
            raise RuntimeError(
                f"the process group's store value {key!r} is not signed with the job's key: "
                "someone else wrote it; stopping"
            )
        return data

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> SignedStore:
        """A store of its own connection (gloo asks for one per group), signed alike."""
        return SignedStore(self._inner.clone(), self._mac_key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return False  # append and compare_set would have to sign partial values

    def append(self, key: str, value: bytes | str) -> None:
        raise RuntimeError("a signed store cannot append to a signed value")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        raise RuntimeError("a signed store cannot compare a signed value")

    def list_keys(self) -> list[str]:
        return list(self._inner.list_keys())

    def queue_push(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.queue_push(key, self._mac(key, data) + data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raw = bytes(self._inner.queue_pop(key, block))
        return self._verified(key, raw)

    def queue_len(self, key: str) -> int:
        return int(self._inner.queue_len(key))

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.barrier(key, world_size)
        else:
            self._inner.barrier(key, world_size, timeout)
