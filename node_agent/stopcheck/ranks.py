"""Who is in the stopped job: rank, world size and rendezvous, as any PyTorch launcher gives them.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (and hosts the store
itself: ``TORCHELASTIC_USE_AGENT_STORE=True``); ``srun`` sets ``SLURM_PROCID`` and
``SLURM_NTASKS``; an indexed Kubernetes Job sets ``JOB_COMPLETION_INDEX``. ``MASTER_ADDR`` and
``MASTER_PORT`` must then be exported by the job script (the first node and a free port).

Joining is checked before any collective: every rank writes a signed join record (its node's
name and a fresh nonce, :mod:`node_agent.stopcheck.signed`) into the job's store, and rank 0
waits for all of them until the join deadline, then publishes the records it verified, signed. A
rank that never arrives is then named by rank 0 (``did not join``) instead of every rank hanging
in the process group's set-up until its own timeout with nobody named; a record nobody can verify
stops every rank (exit 2). The node a rank speaks for is the one its join record bound it to.

The store's keys live under a prefix derived from the job's key. That keeps a stranger who
connects to the store from writing where the ranks read on torch versions without
``Store.list_keys``; with it (torch 2.13 has it) the names can be listed, and the signatures
alone keep a stranger's records from being believed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from node_agent.stopcheck import signed
from node_agent.yamlfile import ConfigError


@dataclass(frozen=True)
class Place:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun hosts the store; we are its clients


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError as err:
                raise ConfigError(f"{name}={value!r} is not a whole number") from err
    return None


def place_from_env(env: Mapping[str, str] | None = None) -> Place:
    """This rank's place in the job; ConfigError (exit 2, one line) when the launcher gave too
    little or the job is one node (nothing to compare with)."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX")
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise ConfigError(
            "stop-check runs as one rank per node of a torch.distributed job: "
            "start it with torchrun, srun or a Kubernetes indexed Job (RANK and "
            "WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, are not set)"
        )
    if world < 2:
        raise ConfigError(
            f"stop-check compares nodes with each other, but WORLD_SIZE={world}: "
            "run it over at least two nodes (one rank per node); for one node "
            "run `node-agent check`"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside the job's world of {world}")
    addr = env.get("MASTER_ADDR", "").strip()
    port = _int(env, "MASTER_PORT")
    if not addr or port is None:
        raise ConfigError(
            "MASTER_ADDR and MASTER_PORT are not set: export the first node's "
            "address and a free port in the job script (torchrun sets them)"
        )
    return Place(
        rank, world, addr, port, env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    )


def listen(place: Place) -> int:
    """Rank 0's listening socket at ``MASTER_ADDR:MASTER_PORT``, bound before anything else so
    that a port someone else holds fails closed (ConfigError, exit 2) before any rank joins.

    ``SO_REUSEADDR`` only lets the bind pass over the port's old TIME_WAIT connections: on Linux
    no second socket may bind an address a listening socket holds, with or without it, and
    ``SO_REUSEPORT`` (which would let another socket of the same uid share the port) is never
    set. The descriptor is handed to the store (``master_listen_fd``), which owns it from then.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            place.master_addr, place.master_port, type=socket.SOCK_STREAM
        )[0]
    except OSError as err:
        raise ConfigError(f"MASTER_ADDR={place.master_addr!r} does not resolve: {err}") from err
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise ConfigError(
            f"stop-check rank 0 cannot listen on {addr[0]}:{place.master_port} "
            f"({err.strerror}): another process holds the port; nothing run, pick a free "
            "MASTER_PORT"
        ) from err
    return sock.detach()


def open_store(place: Place, timeout_s: float) -> Any:
    """The job's key-value store: torchrun's, or one rank 0 hosts on its own listening socket
    (:func:`listen`). :func:`join` puts this job's keys under a prefix derived from its key."""
    import torch.distributed as dist

    master = place.rank == 0 and not place.agent_store
    return dist.TCPStore(
        place.master_addr,
        place.master_port,
        place.world_size,
        is_master=master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen(place) if master else None,
    )


@dataclass(frozen=True)
class Joined:
    nodes: dict[int, str]  # rank -> node name, bound by each rank's signed join record
    missing: list[int]
    session: str  # every later message's session: a digest of rank 0's signed record
    store: Any  # the store under this job's prefix, for the process group


JOIN_SESSION = "join"
_JOIN_SCHEMA = {"node": str, "nonce": lambda v: isinstance(v, str) and len(v) == 32}
_MEMBER = {"rank": int, "node": str, "nonce": str}
_JOINED_SCHEMA = {"members": [_MEMBER], "missing": [int], "refused": [int]}
#: outside the job's prefix, so that a rank holding another key is seen (and told) at once
#: rather than waited for: each rank's key id (a digest that reveals nothing of the key), and
#: rank 0's word that it stopped. A stranger can write both: it can only stop the run.
KEY_IDS = "node-agent/stop-check/key-id"
STOPPED = "node-agent/stop-check/stopped"
#: how many ranks have read rank 0's word: rank 0 hosts the store, and when it stops the run it
#: waits for them before it exits with it
SEEN = "node-agent/stop-check/seen"


def join(raw: Any, place: Place, node: str, key: bytes, deadline_s: float) -> Joined:
    """Announce this rank's node with a fresh nonce, signed; rank 0 gathers the records it can
    verify until ``deadline_s`` and publishes them, signed; every rank checks rank 0's record and
    that its own nonce is in it (an earlier run's records replayed by someone else are not).
    PeerUnverified when a record cannot be believed, on every rank that sees it; TimeoutError
    when rank 0's record never comes."""
    import torch.distributed as dist

    store: Any = dist.PrefixStore(signed.store_prefix(key), raw)  # set() takes bytes too
    nonce = secrets.token_hex(16)
    mine = {"node": node, "nonce": nonce}
    raw.set(f"{KEY_IDS}/{place.rank}", _key_id(key))
    store.set(f"join/{place.rank}", signed.seal(key, JOIN_SESSION, "join", 0, place.rank, mine))
    if place.rank == 0:
        wire = _publish(raw, store, place, key, deadline_s)
    else:
        try:
            wire = _await_joined(raw, store, deadline_s + 30)
        finally:
            raw.add(SEEN, 1)
    data = signed.unseal(key, wire, JOIN_SESSION, "joined", 0, 0, _JOINED_SCHEMA)
    members = {m["rank"]: m for m in data["members"]}
    if members.get(place.rank, {}).get("nonce") != nonce:
        raise signed.PeerUnverified(
            "rank 0's join record does not carry this rank's fresh nonce (an old run's record "
            "replayed, or a stranger's)"
        )
    if data["refused"]:
        raise signed.PeerUnverified(
            "rank 0 could not verify the join record of "
            + ", ".join(f"rank {r}" for r in data["refused"])
            + " (a wrong key or a stranger)"
        )
    return Joined(
        {r: m["node"] for r, m in sorted(members.items())},
        list(data["missing"]),
        hashlib.sha256(wire).hexdigest()[:32],
        store,
    )


def _key_id(key: bytes) -> str:
    return signed.derive(key, "key-id").hex()[:16]


def _await_joined(raw: Any, store: Any, timeout_s: float) -> bytes:
    end = time.monotonic() + timeout_s
    while not store.check(["joined"]):
        if raw.check([STOPPED]):
            raise signed.PeerUnverified(
                "rank 0 stopped the run: a rank holds another key than rank 0's, or a stranger "
                "said so"
            )
        if time.monotonic() > end:
            raise TimeoutError(f"no join record from rank 0 within {timeout_s:g} s")
        time.sleep(0.1)
    return bytes(store.get("joined"))


def _publish(raw: Any, store: Any, place: Place, key: bytes, deadline_s: float) -> bytes:
    mine = _key_id(key)
    keys = [f"join/{r}" for r in range(place.world_size)]
    end = time.monotonic() + deadline_s
    other: list[int] = []
    while time.monotonic() < end and not store.check(keys) and not other:
        time.sleep(0.1)
        other = [
            r
            for r in range(place.world_size)
            if raw.check([f"{KEY_IDS}/{r}"]) and raw.get(f"{KEY_IDS}/{r}") != mine.encode()
        ]
    members, refused = [], list(other)
    for r in range(place.world_size):
        if r in other or not store.check([f"join/{r}"]):
            continue
        try:
            got = signed.unseal(
                key, store.get(f"join/{r}"), JOIN_SESSION, "join", 0, r, _JOIN_SCHEMA
            )
            members.append({"rank": r, **got})
        except signed.PeerUnverified:
            refused.append(r)
    seen = {m["rank"] for m in members} | set(refused)
    missing = [r for r in range(place.world_size) if r not in seen]
    record = {"members": members, "missing": missing, "refused": sorted(refused)}
    wire = signed.seal(key, JOIN_SESSION, "joined", 0, 0, record)
    store.set("joined", wire)
    # every rank that can be told is, before rank 0 (and the store it hosts) goes: all of them
    # when the run stops, those that joined when some never did
    told = place.world_size - 1 if refused else len(members) - 1
    if refused:
        raw.set(STOPPED, "1")
    if refused or missing:
        while raw.add(SEEN, 0) < told and time.monotonic() < end + 30:
            time.sleep(0.1)
    return wire


def init_group(
    store: Any, place: Place, key: bytes, session: str, backend: str, timeout_s: float
) -> None:
    """The job's process group over the same store, under a prefix of this run's (``session``), every
    value the group sets there signed (:mod:`node_agent.stopcheck.signed_store`)."""
    import torch.distributed as dist

    from node_agent.stopcheck.signed_store import SignedStore

    prefixed = dist.PrefixStore("pg/" + signed.derive(key, "pg|" + session).hex()[:32], store)
    dist.init_process_group(
        backend,
        store=SignedStore(prefixed, signed.derive(key, "pg-values|" + session)),
        rank=place.rank,
        world_size=place.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
