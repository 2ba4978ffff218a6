"""What stop-check ranks say to each other: data, signed with the job's key, never code.

torch.distributed's store and its ``*_object`` collectives authenticate nobody and unpickle
anything; a local user who binds the rendezvous port first would be rank 0. So every message
between ranks is an *envelope*: canonical JSON (sorted keys, no spaces, no NaN or Infinity)

    {"v": 1, "session": "...", "phase": "alignment", "seq": 4, "rank": 3, "data": {...}}

preceded by its HMAC-SHA256 under a key derived from the job's key (32 bytes: the MAC, then the
body). A receiver checks, before it believes a byte of ``data``: the MAC (``hmac.compare_digest``),
that the body is canonical, the schema version, that ``rank`` is the rank it came from, that
``session``, ``phase`` and ``seq`` are the ones this exchange expects (an earlier run's or an
earlier phase's message is refused), the size (:data:`MAX_MESSAGE_BYTES`) and the payload's
types (:func:`check`). Anything else raises :class:`PeerUnverified`, and the command stops with
exit 2, naming and draining nothing.

The job's key is a file of 64 hex characters (32 random bytes) that only the job's user and
root can read (:func:`load_key`); it never travels on a command line or in the environment.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from node_agent.yamlfile import ConfigError

if TYPE_CHECKING:
    import torch

VERSION = 1
#: the most one rank may send in one exchange (1,000 nodes of 8 GPUs' hashes are about 0.5 MB)
MAX_MESSAGE_BYTES = 4 << 20
MAC_BYTES = 32
KEY_HEX = re.compile(rb"[0-9a-fA-F]{64}\n?")
_FIELDS = {"v", "session", "phase", "seq", "rank", "data"}


class PeerUnverified(Exception):
    """A message between ranks that cannot be believed: a wrong key, a stranger, a replay, a
    broken or oversize body. The rank stops (exit 2) and names nothing."""


# -- the key ------------------------------------------------------------------------------------


def load_key(path: str) -> bytes:
    """The job's 32-byte key from ``path``: a regular file (not a link), owned by the caller or
    root, mode 0600 or tighter, holding exactly 64 hex characters (one trailing newline allowed).
    Anything else is a ConfigError naming the file and what to do."""
    fix = f"make it with: umask 077; openssl rand -hex 32 > {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        why = "is a symbolic link" if err.errno == 40 else f"cannot be opened ({err.strerror})"
        raise ConfigError(
            f"--key-file {path} {why}: give the job's key file itself; {fix}"
        ) from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--key-file {path} is not a regular file; {fix}")
        if st.st_uid not in (os.getuid(), 0):
            raise ConfigError(
                f"--key-file {path} is owned by uid {st.st_uid}, not by uid {os.getuid()} or "
                "root: another user could have chosen the key; make your own"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"--key-file {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
                f"read or change the job's key; chmod 600 {path} and make a new key"
            )
        data = os.read(fd, 200)
    finally:
        os.close(fd)
    if not KEY_HEX.fullmatch(data):
        raise ConfigError(f"--key-file {path} does not hold exactly 64 hex characters; {fix}")
    return bytes.fromhex(data[:64].decode())


def derive(key: bytes, label: str) -> bytes:
    """A key or name for one use (``label``), so one use never reveals another's."""
    return hmac.new(key, b"node-agent stop-check v1\0" + label.encode(), hashlib.sha256).digest()


def store_prefix(key: bytes) -> str:
    """The store's key prefix for this job: someone without the key cannot guess it."""
    return "node-agent/stop-check/" + derive(key, "store-prefix").hex()[:32]


# -- envelopes ----------------------------------------------------------------------------------


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def seal(key: bytes, session: str, phase: str, seq: int, rank: int, data: Any) -> bytes:
    """The signed wire bytes of ``data`` from ``rank``; ValueError if ``data`` is not plain JSON
    (NaN, a set, an object)."""
    body = _canonical(
        {"v": VERSION, "session": session, "phase": phase, "seq": seq, "rank": rank, "data": data}
    )
    return hmac.new(derive(key, "message"), body, hashlib.sha256).digest() + body


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON data")


def unseal(
    key: bytes, wire: bytes, session: str, phase: str, seq: int, sender: int, schema: Any = None
) -> Any:
    """``data`` of a message that ``sender`` sent in exchange (``session``, ``phase``, ``seq``),
    after every check in the module's docstring; PeerUnverified saying which one failed."""
    who = f"rank {sender}'s {phase} message"
    if len(wire) > MAX_MESSAGE_BYTES:
        raise PeerUnverified(f"{who} is {len(wire)} bytes, over the {MAX_MESSAGE_BYTES} cap")
    mac, body = wire[:MAC_BYTES], wire[MAC_BYTES:]
    expected = hmac.new(derive(key, "message"), body, hashlib.sha256).digest()
    if len(wire) <= MAC_BYTES or not hmac.compare_digest(mac, expected):
        raise PeerUnverified(
            f"{who} does not carry the job key's signature (a wrong key or a stranger)"
        )
    try:
        env = json.loads(body, parse_constant=_no_constant, parse_float=_finite)
        if _canonical(env) != body:
            raise ValueError("not in canonical form")
    except ValueError as err:
        raise PeerUnverified(f"{who} is not canonical JSON: {str(err)[:100]}") from err
    if not isinstance(env, dict) or set(env) != _FIELDS or env["v"] != VERSION:
        raise PeerUnverified(f"{who} is not a version {VERSION} envelope")
    got = (env["session"], env["phase"], env["seq"], env["rank"])
    if type(env["rank"]) is not int or env["rank"] != sender:
        raise PeerUnverified(f"{who} claims to come from rank {env['rank']!r}")
    if got != (session, phase, seq, sender):
        raise PeerUnverified(
            f"{who} belongs to another exchange (session {str(got[0])[:16]}, phase "
            f"{str(got[1])[:20]}, seq {got[2]!r}): a replay or a rank out of step"
        )
    if schema is not None:
        try:
            check(env["data"], schema)
        except ValueError as err:
            raise PeerUnverified(f"{who} does not fit its schema: {err}") from err
    return env["data"]


# -- payload schemas ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MapOf:
    """A JSON object whose keys match ``keys`` and whose values fit ``values``."""

    values: Any
    keys: str = r".{0,200}"


@dataclass(frozen=True)
class Maybe:
    """``None`` or a value that fits ``inner``."""

    inner: Any


def check(value: Any, schema: Any, where: str = "data") -> None:
    """ValueError unless ``value`` fits ``schema``: a type (``str``, ``int``, ``float`` also
    takes an int; ``bool`` is never a number), ``[S]`` a list of S, ``(S1, S2)`` a list of
    exactly those, ``{"k": S}`` an object with exactly those keys, :class:`MapOf`, :class:`Maybe`,
    or a callable that returns whether the value is good."""
    ok: bool
    if isinstance(schema, Maybe):
        if value is not None:
            check(value, schema.inner, where)
        return
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            raise ValueError(f"{where} is not an object")
        for k, v in value.items():
            if not re.fullmatch(schema.keys, k):
                raise ValueError(f"{where} has an unexpected key {k[:40]!r}")
            check(v, schema.values, f"{where}.{k[:40]}")
        return
    if isinstance(schema, dict):
        if not isinstance(value, dict) or set(value) != set(schema):
            raise ValueError(f"{where} does not have exactly the keys {sorted(schema)}")
        for k, s in schema.items():
            check(value[k], s, f"{where}.{k}")
        return
    if isinstance(schema, list):
        if not isinstance(value, list):
            raise ValueError(f"{where} is not a list")
        for i, v in enumerate(value):
            check(v, schema[0], f"{where}[{i}]")
        return
    if isinstance(schema, tuple):
        if not isinstance(value, list) or len(value) != len(schema):
            raise ValueError(f"{where} is not a list of {len(schema)}")
        for i, (v, s) in enumerate(zip(value, schema, strict=True)):
            check(v, s, f"{where}[{i}]")
        return
    if schema is float:
        ok = type(value) in (int, float)
    elif isinstance(schema, type):
        ok = type(value) is schema
    else:
        try:
            ok = bool(schema(value))
        except (TypeError, ValueError):  # a value of the wrong kind for the test (a list)
            ok = False
    if not ok:
        raise ValueError(f"{where} = {str(value)[:40]!r} is not what was expected")


# -- the exchange -------------------------------------------------------------------------------


@dataclass
class Exchange:
    """Every rank's signed gather in one session: one call per phase step, the same calls in the
    same order on every rank. ``device`` is where the collective's tensors live (``cpu`` for gloo,
    a CUDA device for NCCL)."""

    key: bytes
    session: str
    rank: int
    world: int
    device: Any = "cpu"
    seq: int = 0

    def gather(self, phase: str, data: Any, schema: Any = None) -> list[Any]:
        """Every rank's ``data``, by rank, each verified; PeerUnverified on every rank as soon as
        any rank could not verify any message (a rank that fails still takes part in the rounds,
        then says so, so nobody waits for it)."""
        import torch
        import torch.distributed as dist

        self.seq += 1
        own: PeerUnverified | None = None
        try:
            wire = seal(self.key, self.session, phase, self.seq, self.rank, data)
        except (TypeError, ValueError) as err:  # our own payload is not data: everyone stops
            wire, own = b"", PeerUnverified(f"this rank's {phase} message is not JSON data: {err}")
        sizes = self._all_gather(torch.tensor([len(wire)], dtype=torch.int64))
        lengths = [int(s.item()) for s in sizes]
        failure: PeerUnverified | None = own
        over = [r for r, n in enumerate(lengths) if not MAC_BYTES < n <= MAX_MESSAGE_BYTES]
        if over:  # every rank sees the same lengths, so every rank stops here alike
            raise own or PeerUnverified(
                f"rank {over[0]}'s {phase} message is {lengths[over[0]]} bytes, outside "
                f"{MAC_BYTES + 1}..{MAX_MESSAGE_BYTES}"
            )
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(wire)] = torch.frombuffer(bytearray(wire), dtype=torch.uint8)
        parts = self._all_gather(buf)
        out: list[Any] = []
        for r, (part, n) in enumerate(zip(parts, lengths, strict=True)):
            try:
                body = part[:n].cpu().numpy().tobytes()
                out.append(unseal(self.key, body, self.session, phase, self.seq, r, schema))
            except PeerUnverified as err:
                failure = failure or err
                out.append(None)
        verdict = torch.tensor([1 if failure else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(verdict, dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if int(verdict.item()):
            raise PeerUnverified(f"another rank could not verify a {phase} message")
        return out

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        tensor = tensor.to(self.device)
        parts = [tensor.new_empty(tensor.shape) for _ in range(self.world)]
        dist.all_gather(parts, tensor)
        return parts
