"""Stop-check's signed envelopes, its job key and its rendezvous refuse what they cannot verify.

The envelopes are pure functions; the key file tests make real files (a symlink, a FIFO, a file
another uid owns where the tests run as root); the join tests use a real torch ``TCPStore`` on
loopback in this process, and the listening socket a real bind.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from node_agent.peers import free_loopback_port
from node_agent.stopcheck import signed
from node_agent.stopcheck.signed import MapOf, Maybe, PeerUnverified, seal, unseal
from node_agent.yamlfile import ConfigError

KEY = bytes(range(32))
SESSION = "0123456789abcdef0123456789abcdef"


def wire(data=None, *, key=KEY, session=SESSION, phase="alignment", seq=3, rank=2) -> bytes:
    return seal(key, session, phase, seq, rank, {"x": 1} if data is None else data)


def opened(raw: bytes, *, session=SESSION, phase="alignment", seq=3, sender=2, schema=None):
    return unseal(KEY, raw, session, phase, seq, sender, schema)


def forged_body(body: bytes) -> bytes:
    """A body signed with the right key: what only a key holder could send."""
    return hmac.new(signed.derive(KEY, "message"), body, hashlib.sha256).digest() + body


# -- envelopes ----------------------------------------------------------------------------------


def test_a_sealed_message_opens_to_its_data():
    assert opened(wire({"hashes": [{"gpu": 0, "digest": "a" * 64}]})) == {
        "hashes": [{"gpu": 0, "digest": "a" * 64}]
    }


@pytest.mark.parametrize("where", [0, 31, 32, 60, -1])
def test_a_tampered_byte_is_refused(where):
    raw = bytearray(wire())
    raw[where] ^= 0x01
    with pytest.raises(PeerUnverified, match="signature"):
        opened(bytes(raw))


def test_a_message_under_another_key_is_refused():
    with pytest.raises(PeerUnverified, match="wrong key or a stranger"):
        opened(wire(key=secrets.token_bytes(32)))


def test_a_message_from_another_rank_than_it_says_is_refused():
    with pytest.raises(PeerUnverified, match="claims to come from rank 5"):
        opened(wire(rank=5), sender=2)


def test_a_message_of_another_session_is_refused():
    with pytest.raises(PeerUnverified, match="another exchange"):
        opened(wire(session="f" * 32))


@pytest.mark.parametrize("phase,seq", [("self", 3), ("alignment", 2)])
def test_a_replayed_phase_or_step_is_refused(phase, seq):
    with pytest.raises(PeerUnverified, match="a replay or a rank out of step"):
        opened(wire(phase=phase, seq=seq))


def test_an_oversize_message_is_refused_before_its_signature_is_checked():
    raw = wire({"pad": "x" * signed.MAX_MESSAGE_BYTES})
    with pytest.raises(PeerUnverified, match="over the"):
        opened(raw)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_signed_message_with_nan_or_infinity_is_refused(number):
    body = (
        '{"data":{"seconds":' + number + '},"phase":"alignment","rank":2,"seq":3,'
        '"session":"' + SESSION + '","v":1}'
    ).encode()
    with pytest.raises(PeerUnverified, match="not canonical JSON"):
        opened(forged_body(body))


def test_nan_is_never_sealed():
    with pytest.raises(ValueError):
        wire({"seconds": float("nan")})


def test_a_signed_message_with_a_duplicated_key_is_refused():
    body = (
        '{"data":{"x":1},"data":{"x":2},"phase":"alignment","rank":2,"seq":3,'
        '"session":"' + SESSION + '","v":1}'
    ).encode()
    with pytest.raises(PeerUnverified, match="canonical"):
        opened(forged_body(body))


def test_a_signed_message_of_another_schema_version_is_refused():
    body = signed._canonical(
        {"v": 2, "session": SESSION, "phase": "alignment", "seq": 3, "rank": 2, "data": {}}
    )
    with pytest.raises(PeerUnverified, match="version 1 envelope"):
        opened(forged_body(body))


@pytest.mark.parametrize(
    "data",
    [
        {"seconds": "1.0", "wrong_elements": 0},  # a string for a number
        {"seconds": 1.0, "wrong_elements": True},  # a bool is not a count
        {"seconds": 1.0, "wrong_elements": 0, "node": "node3"},  # a name it may not give
        {"seconds": 1.0},  # a key missing
    ],
)
def test_a_payload_of_the_wrong_shape_is_refused(data):
    schema = {"seconds": float, "wrong_elements": int}
    with pytest.raises(PeerUnverified, match="schema"):
        opened(wire(data), schema=schema)


def test_a_value_a_schema_test_cannot_take_is_refused_not_a_crash():
    """A peer with the key sends a list where a level name belongs: the membership test
    raises TypeError (a list is unhashable), which must be a refusal, not a broken phase."""
    from node_agent.stopcheck.phases import SCHEMAS

    with pytest.raises(PeerUnverified, match="schema"):
        opened(wire({"level": ["FAULT"], "reasons": []}), schema=SCHEMAS["self"])


def test_schemas_take_maps_lists_and_nothing():
    signed.check({"a->b": 1}, MapOf(int, r"\w->\w"))
    signed.check(None, Maybe(str))
    signed.check([1, "x", "y"], (int, str, str))
    with pytest.raises(ValueError, match="unexpected key"):
        signed.check({"0->1; rm": 1}, MapOf(int, r"\d->\d"))


# -- the key file -------------------------------------------------------------------------------


def key_file(path: Path, text: str | None = None, mode: int = 0o600) -> Path:
    path.write_text(secrets.token_hex(32) + "\n" if text is None else text)
    path.chmod(mode)
    return path


def test_a_private_key_file_of_64_hex_characters_loads(tmp_path):
    path = key_file(tmp_path / "job.key", "ab" * 32)
    assert signed.load_key(str(path)) == bytes([0xAB]) * 32


def test_a_key_file_others_can_read_is_refused_and_named(tmp_path):
    path = key_file(tmp_path / "job.key", mode=0o644)
    with pytest.raises(ConfigError, match=f"{path} has mode 0644.*chmod 600"):
        signed.load_key(str(path))


def test_a_symlinked_key_file_is_refused_and_named(tmp_path):
    target = key_file(tmp_path / "real.key")
    link = tmp_path / "job.key"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=f"{link} is a symbolic link"):
        signed.load_key(str(link))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_key_file_another_user_owns_is_refused_and_named(tmp_path):
    path = key_file(tmp_path / "job.key")
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match=f"{path} is owned by uid 65534"):
        signed.load_key(str(path))


def test_a_fifo_as_key_file_is_refused_without_blocking(tmp_path):
    path = tmp_path / "job.key"
    os.mkfifo(path, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        signed.load_key(str(path))


@pytest.mark.parametrize("text", ["", "ab" * 31, "zz" * 32, "ab" * 33, " " + "ab" * 32])
def test_a_key_file_without_exactly_64_hex_characters_is_refused(tmp_path, text):
    path = key_file(tmp_path / "job.key", text)
    with pytest.raises(ConfigError, match="exactly 64 hex characters"):
        signed.load_key(str(path))


def test_the_store_prefix_depends_on_the_key():
    assert signed.store_prefix(KEY) != signed.store_prefix(bytes(32))
    assert signed.store_prefix(KEY).startswith("node-agent/stop-check/")


# -- the rendezvous -----------------------------------------------------------------------------

dist = pytest.importorskip("torch.distributed", reason="the rendezvous uses torch")
from node_agent.stopcheck import ranks  # noqa: E402


def place(rank: int, port: int, world: int = 2) -> ranks.Place:
    return ranks.Place(rank, world, "127.0.0.1", port, agent_store=False)


def test_a_port_someone_else_holds_fails_closed_before_anyone_joins():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}.*nothing run"):
            ranks.listen(place(0, port))


@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0"])
def test_no_second_socket_binds_beside_rank_0s_listener(addr):
    fd = ranks.listen(place(0, free_loopback_port()))
    try:
        port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
        with socket.socket() as second:
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="in use"):
                second.bind((addr, port))
    finally:
        os.close(fd)


@pytest.fixture
def store():
    """A real store on loopback, as rank 0 hosts it: ``raw`` for the join, ``mine`` the view
    under the job's prefix where the tests put what a peer would."""
    raw = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    return SimpleNamespace(raw=raw, mine=dist.PrefixStore(signed.store_prefix(KEY), raw))


def test_a_replayed_join_record_of_an_earlier_run_is_refused(store):
    """rank 1 joins; the store already holds rank 0's signed record of an earlier run (its
    nonce for rank 1 is not this run's): refused."""
    old = {
        "members": [{"rank": 1, "node": "node1", "nonce": "0" * 32}],
        "missing": [],
        "refused": [],
    }
    store.mine.set("joined", seal(KEY, ranks.JOIN_SESSION, "joined", 0, 0, old))
    with pytest.raises(PeerUnverified, match="fresh nonce"):
        ranks.join(store.raw, place(1, 0), "node1", KEY, deadline_s=1)


def test_a_forged_join_record_is_refused(store):
    forged = {"members": [], "missing": [], "refused": []}
    store.mine.set(
        "joined", seal(secrets.token_bytes(32), ranks.JOIN_SESSION, "joined", 0, 0, forged)
    )
    with pytest.raises(PeerUnverified, match="signature"):
        ranks.join(store.raw, place(1, 0), "node1", KEY, deadline_s=1)


def test_rank_0_refuses_a_peer_with_the_wrong_key_and_says_so_to_all(store):
    wrong = secrets.token_bytes(32)
    store.mine.set(
        "join/1", seal(wrong, ranks.JOIN_SESSION, "join", 0, 1, {"node": "x", "nonce": "1" * 32})
    )
    store.raw.add(ranks.SEEN, 1)  # rank 1 will have read rank 0's word: rank 0 need not wait
    with pytest.raises(PeerUnverified, match="rank 0 could not verify the join record of rank 1"):
        ranks.join(store.raw, place(0, 0), "node0", KEY, deadline_s=1)
    published = unseal(KEY, store.mine.get("joined"), ranks.JOIN_SESSION, "joined", 0, 0)
    assert published["refused"] == [1] and [m["rank"] for m in published["members"]] == [0]


def test_a_fresh_join_binds_each_rank_to_its_node_and_gives_one_session(store):
    store.mine.set(
        "join/1", seal(KEY, ranks.JOIN_SESSION, "join", 0, 1, {"node": "node1", "nonce": "1" * 32})
    )
    joined = ranks.join(store.raw, place(0, 0), "node0", KEY, deadline_s=1)
    assert joined.nodes == {0: "node0", 1: "node1"} and joined.missing == []
    assert len(joined.session) == 32


def test_rank_0_stops_at_once_for_a_rank_holding_another_key_and_waits_until_it_is_told(store):
    """A rank with another key writes under another prefix, so its record is never seen; its
    key id is, and rank 0 refuses it without waiting out the join deadline, and stays (it hosts
    the store) until that rank has read that the run stopped."""
    port = store.raw.port
    other = {}

    def rank_1() -> None:
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
        try:
            ranks.join(client, place(1, port), "node1", secrets.token_bytes(32), deadline_s=60)
        except PeerUnverified as err:
            other["error"] = str(err)

    peer = threading.Thread(target=rank_1)
    peer.start()
    with pytest.raises(PeerUnverified, match="could not verify the join record of rank 1"):
        ranks.join(store.raw, place(0, port), "node0", KEY, deadline_s=60)
    peer.join(timeout=30)
    assert other["error"].startswith("rank 0 stopped the run")
    assert store.raw.add(ranks.SEEN, 0) == 1


# -- the process group's rendezvous values ------------------------------------------------------


def test_the_groups_store_values_round_trip_under_the_key(store):
    from node_agent.stopcheck.signed_store import SignedStore

    group_store = SignedStore(store.raw, signed.derive(KEY, "pg-values|s1"))
    group_store.set("rank_1/address", b"10.0.0.2:41234")
    assert group_store.get("rank_1/address") == b"10.0.0.2:41234"


def test_a_rank_address_a_stranger_rewrote_in_the_store_is_refused(store):
    """A local user can list the store's keys and set any of them: the address gloo would connect
    to is then someone else's, and reading it stops the group instead of connecting there."""
    from node_agent.stopcheck.signed_store import SignedStore

    group_store = SignedStore(store.raw, signed.derive(KEY, "pg-values|s1"))
    group_store.set("rank_1/address", b"10.0.0.2:41234")
    store.raw.set("rank_1/address", b"\0" * 32 + b"127.0.0.1:6666")  # the stranger's
    with pytest.raises(RuntimeError, match="not signed with the job's key"):
        group_store.get("rank_1/address")


def test_a_value_signed_for_another_run_or_key_name_is_refused(store):
    from node_agent.stopcheck.signed_store import SignedStore

    earlier_run = SignedStore(store.raw, signed.derive(KEY, "pg-values|s0"))
    earlier_run.set("rank_1/address", b"10.0.0.2:41234")
    this_run = SignedStore(store.raw, signed.derive(KEY, "pg-values|s1"))
    with pytest.raises(RuntimeError, match="not signed"):
        this_run.get("rank_1/address")
    store.raw.set("rank_0/address", store.raw.get("rank_1/address"))  # moved to another name
    with pytest.raises(RuntimeError, match="not signed"):
        earlier_run.get("rank_0/address")
