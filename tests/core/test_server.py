"""The index server over real sockets, with a real pool and registry, run on
a thread of the test process so its registry can be inspected."""

from __future__ import annotations

import os
import select
import socket
import time

import pytest

from maru_core.index.launcher import IndexProcess, ThreadedIndex, unique_shm_path
from maru_core.pool import Pool, SlotHeader
from maru_core.protocol import (
    MAX_BATCH_KEYS,
    MAX_FRAME_BYTES,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    FrameDecoder,
    LocationList,
    SlotList,
    encode_frame,
    pack_lengths,
    parse_url,
)

TOKEN = "s3cret-token"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Raw:
    """A bare protocol connection: frames out, decoded replies in."""

    def __init__(self, url: str) -> None:
        address = parse_url(url)
        self.sock = socket.create_connection((address.host, address.port), timeout=5)
        self.decoder = FrameDecoder()
        self.pending: list = []
        self.next_id = 1

    def send(self, message: dict) -> int:
        message.setdefault("id", self.next_id)
        self.next_id += 1
        self.sock.sendall(encode_frame(message))
        return message["id"]

    def recv(self) -> dict:
        while not self.pending:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("closed")
            self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def call(self, **message) -> dict:
        rid = self.send(message)
        reply = self.recv()
        assert reply["id"] == rid
        return reply

    def hello(self, token: str | None = TOKEN) -> dict:
        return self.call(op="hello", protocol=PROTOCOL_VERSION, client="raw", token=token)

    def closed_by_peer(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def pool(make_pool):
    return make_pool("test-server", 32 * 1024 * 1024, 64 * 1024)


@pytest.fixture
def index(pool):
    with ThreadedIndex(pool, token=TOKEN, lease_ttl_s=0.5, reservation_ttl_s=30.0) as index:
        yield index


@pytest.fixture
def raw(index):
    conn = Raw(index.url)
    yield conn
    conn.close()


def store(raw: Raw, pool: Pool, keys: list[bytes], length: int = 1000, header: bool = True) -> list[bool]:
    slots = SlotList.from_wire(raw.call(op="reserve", keys=keys, lengths=[length] * len(keys))["slots"])
    for k, slot in zip(keys, slots):
        if header:
            pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=length))
    return raw.call(op="commit", keys=keys)["committed"]


def test_hello_returns_lease_and_geometry(raw, pool):
    reply = raw.hello()
    assert reply["ok"] and reply["protocol"] == PROTOCOL_VERSION
    assert reply["lease_id"] and reply["lease_ttl_s"] == 0.5
    assert reply["geometry"] == pool.geometry.to_dict()


def test_requests_before_hello_get_no_lease(raw):
    reply = raw.call(op="match_prefix", keys=[key(1)])
    assert reply["error"]["type"] == "no_lease" and "hello" in reply["error"]["message"]


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_bad_token_is_refused_and_the_connection_closed(raw, index, token):
    reply = raw.hello(token)
    assert not reply["ok"] and reply["error"]["type"] == "auth"
    assert raw.closed_by_peer()  # no second guess on this connection
    assert index.service.server.closed_connections["auth"] == 1


def test_a_client_of_the_next_release_is_answered_in_this_ones_protocol(raw, pool):
    """A rolling upgrade: pods of the next release may start before the index is upgraded. The
    index answers their hello in its own protocol (each release speaks the one before), and the
    connection serves stores and lookups as before; a release two apart is refused, saying what
    to run."""
    reply = raw.call(op="hello", protocol=PROTOCOL_VERSION + 1, client="next", token=TOKEN)
    assert reply["ok"] and reply["protocol"] == PROTOCOL_VERSION
    keys = [key(i) for i in range(3)]
    assert store(raw, pool, keys) == [True] * 3
    assert raw.call(op="match_prefix", keys=keys)["matched"] == 3


@pytest.mark.parametrize("offered", [PROTOCOL_VERSION + 2, MIN_PROTOCOL_VERSION - 1])
def test_a_protocol_more_than_one_release_apart_is_a_bad_request(raw, offered):
    reply = raw.call(op="hello", protocol=offered, client="c", token=TOKEN)
    assert reply["error"]["type"] == "bad_request"
    assert "one release at a time" in reply["error"]["message"], reply["error"]["message"]


def test_store_then_retrieve_pins_and_unpin(raw, pool, index):
    raw.hello()
    keys = [key(i) for i in range(4)]
    assert store(raw, pool, keys) == [True] * 4
    assert raw.call(op="match_prefix", keys=keys + [key(99)])["matched"] == 4
    locations = LocationList.from_wire(raw.call(op="retrieve", keys=keys)["locations"])
    assert len(locations) == 4 and locations.misses() == 0
    for k, loc in zip(keys, locations):
        assert pool.read_slot_header(loc.offset).names(k, loc.generation)
    assert index.on_loop(lambda: index.service.server.registry.stats().pinned_keys) == 4
    assert raw.call(op="unpin", keys=keys)["unpinned"] == 4
    assert raw.call(op="stats")["pinned_keys"] == 0


def test_the_stats_reply_carries_every_counter_of_the_registry_as_it_is(raw, pool, index):
    raw.hello()
    assert store(raw, pool, [key(i) for i in range(3)]) == [True] * 3
    reply = raw.call(op="stats")
    registry = index.on_loop(index.service.server.registry.stats)
    assert {k: v for k, v in reply.items() if k not in ("id", "ok", "aliases")} == vars(registry)
    assert reply["keys"] == 3 and reply["aliases"] == 0 and reply["quarantined"] is False


def test_packed_keys_are_the_same_keys(raw, pool):
    raw.hello()
    keys = [key(i) for i in range(3)]
    store(raw, pool, keys)
    packed = raw.call(op="retrieve", keys=b"".join(keys))["locations"]
    assert packed == raw.call(op="retrieve", keys=keys)["locations"]
    assert raw.call(op="unpin", keys=b"".join(keys))["unpinned"] == 3
    assert raw.call(op="match_prefix", keys=b"".join(keys))["matched"] == 3
    assert raw.call(op="retrieve", keys=b"x" * 17)["error"]["type"] == "bad_request"


def test_retrieve_with_a_miss_pins_nothing(raw, pool):
    raw.hello()
    store(raw, pool, [key(1)])
    locations = LocationList.from_wire(raw.call(op="retrieve", keys=[key(1), key(2)])["locations"])
    assert len(locations) == 2 and locations[1] is None
    assert raw.call(op="stats")["pinned_keys"] == 0


def test_commit_verifies_the_slot_header(raw, pool):
    raw.hello()
    assert store(raw, pool, [key(1)], header=False) == [False]  # no header written
    slots = SlotList.from_wire(raw.call(op="reserve", keys=[key(2)], lengths=[10])["slots"])
    pool.write_slot_header(slots[0].offset, SlotHeader(key=key(3), generation=slots[0].generation, length=10))
    assert raw.call(op="commit", keys=[key(2)])["committed"] == [False]  # names another key
    slots = SlotList.from_wire(raw.call(op="reserve", keys=[key(4)], lengths=[10])["slots"])
    pool.write_slot_header(slots[0].offset, SlotHeader(key=key(4), generation=slots[0].generation + 1, length=10))
    assert raw.call(op="commit", keys=[key(4)])["committed"] == [False]  # wrong generation
    assert raw.call(op="match_prefix", keys=[key(1)])["matched"] == 0
    assert raw.call(op="stats")["reserved_keys"] == 0  # rejected slots are released


def test_duplicate_reserve_and_abort(raw, pool):
    raw.hello()
    store(raw, pool, [key(1)])
    slots = SlotList.from_wire(raw.call(op="reserve", keys=[key(1), key(2)], lengths=[5, 5])["slots"])
    assert slots[0] is None and slots[1] is not None
    assert raw.call(op="abort", keys=[key(2)])["aborted"] == 1
    assert raw.call(op="stats")["reserved_keys"] == 0


def test_wrong_types_get_typed_errors_and_the_connection_stays(raw):
    raw.hello()
    assert raw.call(op="retrieve", keys="nope")["error"]["type"] == "bad_request"
    assert raw.call(op="retrieve", keys=[b"short"])["error"]["type"] == "bad_request"
    assert raw.call(op="fly")["error"]["type"] == "unknown_op"
    reply = raw.call(op="match_prefix", keys=[key(0)] * (MAX_BATCH_KEYS + 1))
    assert reply["error"]["type"] == "too_large"
    raw.sock.sendall(encode_frame([1, 2, 3]))  # not a map: no id to answer to
    reply = raw.recv()
    assert reply["id"] is None and reply["error"]["type"] == "bad_request"
    assert "must be a map" in reply["error"]["message"]
    assert raw.call(op="heartbeat")["ok"]


def test_pipelined_requests_are_answered_in_order(raw):
    raw.hello()
    frames = b"".join(
        encode_frame({"id": i, "op": op, **({"keys": []} if op == "match_prefix" else {})})
        for i, op in [(10, "heartbeat"), (11, "match_prefix"), (12, "fly"), (13, "stats")]
    )
    raw.sock.sendall(frames)
    replies = [raw.recv() for _ in range(4)]
    assert [r["id"] for r in replies] == [10, 11, 12, 13]
    assert [r["ok"] for r in replies] == [True, True, False, True]


def test_garbage_closes_only_that_connection(index, raw):
    raw.hello()
    bad = Raw(index.url)
    bad.sock.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # a frame whose payload is not msgpack
    assert bad.closed_by_peer()
    assert raw.call(op="heartbeat")["ok"]


def test_oversized_frame_gets_too_large_then_close(index, raw):
    raw.hello()
    big = Raw(index.url)
    big.sock.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    reply = big.recv()
    assert reply["id"] is None and reply["error"]["type"] == "too_large"
    assert big.closed_by_peer()
    assert raw.call(op="heartbeat")["ok"]


def test_lapsed_lease_releases_reservations_and_pins(index, raw, pool):
    raw.hello()
    store(raw, pool, [key(1)])
    raw.call(op="retrieve", keys=[key(1)])
    raw.call(op="reserve", keys=[key(2)], lengths=[100])
    stats = raw.call(op="stats")
    assert (stats["pinned_keys"], stats["reserved_keys"]) == (1, 1)
    deadline = time.monotonic() + 5
    registry = index.service.server.registry
    while time.monotonic() < deadline:  # the expiry task runs every lease_ttl/4
        stats = index.on_loop(registry.stats)
        if stats.leases == 0:
            break
        time.sleep(0.05)
    assert (stats.leases, stats.pinned_keys, stats.reserved_keys, stats.keys) == (0, 0, 0, 1)
    assert raw.call(op="heartbeat")["error"]["type"] == "no_lease"


def test_resumed_lease_keeps_its_pins(index, raw, pool):
    lease_id = raw.hello()["lease_id"]
    store(raw, pool, [key(1)])
    raw.call(op="retrieve", keys=[key(1)])
    raw.close()
    again = Raw(index.url)
    reply = again.call(op="hello", protocol=PROTOCOL_VERSION, client="raw", token=TOKEN, lease_id=lease_id)
    assert reply["lease_id"] == lease_id
    assert again.call(op="unpin", keys=[key(1)])["unpinned"] == 1
    again.close()


def test_bye_ends_the_lease_and_its_pins(raw, pool, index):
    raw.hello()
    store(raw, pool, [key(1)])
    raw.call(op="retrieve", keys=[key(1)])
    raw.call(op="reserve", keys=[key(2)], lengths=[10])
    assert raw.call(op="bye") == {"id": raw.next_id - 1, "ok": True, "closed": True}
    stats = index.on_loop(index.service.server.registry.stats)
    assert (stats.leases, stats.pinned_keys, stats.reserved_keys) == (0, 0, 0)
    assert raw.call(op="heartbeat")["error"]["type"] == "no_lease"


def test_unix_socket(pool, tmp_path):
    url = f"unix://{tmp_path}/index.sock"
    with ThreadedIndex(pool, listen=url) as index:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(tmp_path / "index.sock"))
        sock.sendall(encode_frame({"id": 1, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "u"}))
        reply = FrameDecoder().feed(sock.recv(65536))[0]
        assert reply["ok"] and index.url == url
        sock.close()
    assert not (tmp_path / "index.sock").exists()


def test_a_small_retrieve_is_answered_while_another_client_commits_a_large_batch():
    """A commit of 40,000 keys runs in slices: another client's requests, sent
    after it, are answered between the slices (they see part of the batch
    committed) and before the commit's own reply."""
    path = unique_shm_path("test-server-slices")
    try:
        _commit_while_reading(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _commit_while_reading(path: str) -> None:
    # One lease reserves, and pins, 61 % of the pool here: above a lease's default quotas.
    args = ["--page-size", "4Ki", "--log-level", "WARNING", "--max-lease-pool-fraction", "1",
            "--max-lease-pin-fraction", "1"]
    with IndexProcess(path, pool_size="256Mi", extra_args=args) as index:
        with Pool.attach(path) as pool:
            writer, reader = Raw(index.url), Raw(index.url)
            try:
                writer.hello(None), reader.hello(None)
                small = [key(10**6 + i) for i in range(8)]
                assert store(reader, pool, small) == [True] * 8
                batch = [key(i) for i in range(40_000)]
                packed = b"".join(batch)
                reply = writer.call(op="reserve", keys=packed, lengths=pack_lengths([4096] * len(batch)))
                slots = SlotList.from_wire(reply["slots"])
                for k, slot in zip(batch, slots):
                    pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=4096))

                commit_id = writer.send({"op": "commit", "keys": packed})
                seen, small_replies = [], 0
                while not select.select([writer.sock], [], [], 0)[0]:  # until the commit's reply is here
                    reader.send({"op": "retrieve", "keys": small})
                    reader.send({"op": "match_prefix", "keys": packed})
                    locations = LocationList.from_wire(reader.recv()["locations"])
                    seen.append(reader.recv()["matched"])
                    assert locations.misses() == 0
                    assert reader.call(op="unpin", keys=small)["unpinned"] == 8
                    small_replies += 1
                reply = writer.recv()
                assert reply["id"] == commit_id and reply["committed"] == [True] * len(batch)
                assert small_replies >= 1  # answered before the large reply although sent after the commit
                assert any(0 < matched < len(batch) for matched in seen), seen  # between two slices
                assert reader.call(op="match_prefix", keys=packed)["matched"] == len(batch)
                # a large retrieve_prefix runs in slices too, and answers as a whole one
                reply = reader.call(op="retrieve_prefix", keys=packed + key(10**7), group=7)
                pinned = len(batch) - len(batch) % 7
                assert reply["matched"] == len(batch)
                assert list(LocationList.from_wire(reply["locations"]).offsets()) == list(slots.offsets()[:pinned])
                assert reader.call(op="unpin", keys=packed[: 16 * pinned])["unpinned"] == pinned
            finally:
                writer.close(), reader.close()
