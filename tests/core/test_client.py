"""IndexClient against a real server on loopback."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from maru_core.index.client import IndexClient, IndexRejected, IndexTimeout, IndexUnavailable
from maru_core.index.client_ops import check_reply, parse_committed, parse_locations, parse_slots
from maru_core.index.launcher import ThreadedIndex
from maru_core.pool import Pool, SlotHeader
from maru_core.protocol import ErrorType, Location, LocationList, Op

TOKEN = "client-token"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def pool(make_pool):
    return make_pool("test-client", 32 * 1024 * 1024, 64 * 1024)


@pytest.fixture
def index(pool):
    with ThreadedIndex(pool, token=TOKEN, lease_ttl_s=0.6) as index:
        yield index


@pytest.fixture
def client(index):
    client = IndexClient(index.url, token=TOKEN, client_name="test", timeout_s=2.0)
    yield client
    client.close()


def store(client: IndexClient, pool: Pool, keys: list[bytes], length: int = 3000) -> list[bool]:
    slots = client.reserve([(k, length) for k in keys])
    for k, slot in zip(keys, slots):
        pool.view(slot.offset, length)[:] = k * (length // 16) + k[: length % 16]
        pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=length))
    return client.commit(keys)


def pinned(index: ThreadedIndex) -> int:
    return index.on_loop(lambda: index.service.server.registry.stats().pinned_keys)


def test_round_trip(client, pool, index):
    keys = [key(i) for i in range(10)]
    assert client.lease_id is None  # lazy: nothing connected yet
    assert store(client, pool, keys) == [True] * 10
    assert client.geometry == pool.geometry.to_dict() and client.lease_ttl_s == 0.6
    assert client.match_prefix(keys + [key(50)] + keys) == 10
    locations = client.retrieve(keys)
    assert isinstance(locations, LocationList) and len(locations) == 10 and None not in locations
    for k, loc in zip(keys, locations):
        assert isinstance(loc, Location) and loc.length == 3000
        assert bytes(pool.view(loc.offset, 16)) == k
    assert pinned(index) == 10
    assert client.unpin(keys) == 10 and pinned(index) == 0
    misses = client.retrieve([key(1), key(77)])
    assert misses[1] is None and misses.misses() == 1 and pinned(index) == 0
    assert client.reserve([(key(1), 10), (key(2), 10)]) == [None, None]
    slots = client.reserve([(key(20), 10)])
    assert client.abort([key(20)]) == 1
    assert slots[0].offset >= pool.geometry.data_offset
    stats = client.stats()
    assert stats["keys"] == 10 and stats["leases"] == 1 and stats["reserved_keys"] == 0


def test_retrieve_prefix_matches_and_pins_the_whole_groups_in_one_round_trip(client, pool, index):
    keys = [key(i) for i in range(10)]
    store(client, pool, keys)
    asked = keys + [key(50)] + keys
    matched, locations = client.retrieve_prefix(asked, 4)
    assert matched == 10 and len(locations) == 8 and pinned(index) == 8
    assert [bytes(pool.view(loc.offset, 16)) for loc in locations] == keys[:8]
    assert client.unpin(keys[:8]) == 8 and pinned(index) == 0
    assert client.retrieve_prefix(asked, 11) == (10, None) and pinned(index) == 0  # no whole group
    assert client.retrieve_prefix([key(50)] + keys, 1) == (0, None)
    matched, locations = client.retrieve_prefix(b"".join(keys), 1)  # packed keys, as the connector sends
    assert matched == len(locations) == 10 and pinned(index) == 10
    assert client.unpin(keys) == 10
    with pytest.raises(ValueError, match="group"):
        client.retrieve_prefix(keys, 0)


def test_match_prefixes_answers_several_lists_in_one_round_trip(client, pool, index, monkeypatch):
    keys = [key(i) for i in range(10)]
    store(client, pool, keys)
    calls = []
    real_call = client._call
    monkeypatch.setattr(client, "_call", lambda request, *a: calls.append(request["op"]) or real_call(request, *a))
    lists = [keys, keys[:3] + [key(50)] + keys, [], [key(50)] + keys, b"".join(keys[:7])]
    assert client.match_prefixes(lists) == [10, 3, 0, 0, 7]
    assert calls == ["match_prefixes"] and pinned(index) == 0
    with monkeypatch.context() as m:  # more keys than one request may carry: split, in order
        m.setattr("maru_core.index.client_ops.MAX_BATCH_KEYS", 12)
        assert client.match_prefixes([keys, keys[:5], keys[:9]]) == [10, 5, 9]
    assert calls.count("match_prefixes") == 4


def test_the_index_names_a_bad_match_prefixes_request(client):
    client.connect()
    for counts, message in (([2], "got 1 keys but counts adding up to 2"), (b"\x01", "key counts"),
                            ([-1], "key counts from 0")):
        with pytest.raises(IndexRejected, match=message) as info:
            client._call({"op": "match_prefixes", "keys": key(1), "counts": counts})
        assert info.value.error_type is ErrorType.BAD_REQUEST


def test_the_index_names_a_bad_retrieve_prefix_group(client):
    client.connect()
    request = {"op": "retrieve_prefix", "keys": key(1), "group": 0}
    with pytest.raises(IndexRejected, match="'group' must be an integer from 1") as info:
        client._call(request)
    assert info.value.error_type is ErrorType.BAD_REQUEST


def test_empty_batches(client):
    assert client.match_prefix([]) == 0
    assert list(client.retrieve([])) == [] and client.commit([]) == [] and list(client.reserve([])) == []


def test_bad_token_raises_rejected(index):
    with IndexClient(index.url, token="wrong") as bad:
        with pytest.raises(IndexRejected) as info:
            bad.connect()
        assert info.value.error_type is ErrorType.AUTH and info.value.op is Op.HELLO


def test_unreachable_index_fails_fast_then_recovers(pool):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    client = IndexClient(url, timeout_s=1.0, reconnect_backoff_s=0.2)
    try:
        with pytest.raises(IndexUnavailable, match="cannot connect"):
            client.match_prefix([key(1)])
        started = time.monotonic()
        with pytest.raises(IndexUnavailable, match="retrying"):
            client.match_prefix([key(1)])  # within the backoff: no new connect
        assert time.monotonic() - started < 0.1
        with ThreadedIndex(pool, listen=url):
            deadline = time.monotonic() + 5
            while True:
                try:
                    assert client.match_prefix([key(1)]) == 0
                    break
                except IndexUnavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
    finally:
        client.close()


def test_silent_index_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        client = IndexClient(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(IndexUnavailable, match="within the timeout"):
            client.connect()
        assert 0.25 < time.monotonic() - started < 2.0
        client.close()
    finally:
        listener.close()


def test_broken_connection_resumes_the_same_lease(client, pool, index):
    store(client, pool, [key(1)])
    client.retrieve([key(1)])
    lease = client.lease_id
    client._channel._sock.shutdown(socket.SHUT_RDWR)  # the network drops the idle connection
    assert client.match_prefix([key(1)]) == 1  # seen before sending: reconnected, no call lost
    assert client.lease_id == lease and client.unpin([key(1)]) == 1


def test_timed_out_retrieve_gives_up_its_lease(client, pool, index):
    store(client, pool, [key(1)])
    lease = client.lease_id
    index._loop.call_soon_threadsafe(time.sleep, 0.5)  # the index stalls
    with pytest.raises(IndexUnavailable, match="timeout"):
        client.retrieve([key(1)], timeout_s=0.1)
    time.sleep(0.5)
    # The stalled retrieve did pin; the client cannot know, so it opens a new
    # lease and the old one (with that pin) lapses on the index.
    assert client.match_prefix([key(1)]) == 1 and client.lease_id != lease
    deadline = time.monotonic() + 5
    while pinned(index) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned(index) == 0


def test_lapsed_lease_is_replaced_transparently(index, pool):
    with IndexClient(index.url, token=TOKEN, heartbeat=False) as client:
        client.connect()
        lease = client.lease_id
        time.sleep(1.0)  # lease_ttl_s=0.6 with no heartbeat
        assert client.match_prefix([key(1)]) == 0
        assert client.lease_id != lease


def test_heartbeat_keeps_the_lease(client, pool, index):
    store(client, pool, [key(1)])
    client.retrieve([key(1)])
    lease = client.lease_id
    time.sleep(1.5)  # 2.5 TTLs with no call from the test
    assert client.lease_id == lease and pinned(index) == 1
    assert client.unpin([key(1)]) == 1


def test_threads_share_one_client(client, pool, index):
    keys = [key(i) for i in range(64)]
    store(client, pool, keys)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for n in range(40):
                mine = keys[(offset + n) % 32 :][:16]
                locations = client.retrieve(mine)
                assert [bytes(pool.view(l.offset, 16)) for l in locations] == mine
                assert client.unpin(mine) == 16
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pinned(index) == 0


def test_no_space_is_rejected(client):
    with pytest.raises(IndexRejected) as info:
        client.reserve([(key(1), 1 << 40)])
    assert info.value.error_type is ErrorType.NO_SPACE


def test_close_ends_the_lease_at_once(client, pool, index):
    store(client, pool, [key(1)])
    client.retrieve([key(1)])
    assert pinned(index) == 1
    client.close()
    stats = index.on_loop(index.service.server.registry.stats)
    assert (stats.leases, stats.pinned_keys) == (0, 0)


def test_closed_client_refuses_calls(client):
    client.close()
    with pytest.raises(IndexUnavailable, match="closed"):
        client.match_prefix([])


def test_malformed_replies_are_rejected_not_sliced():
    with pytest.raises(IndexRejected, match="1 locations for 2 keys"):
        parse_locations({"locations": bytes(24)}, 2)
    with pytest.raises(IndexRejected, match="3 slots for 2"):
        parse_slots({"slots": bytes(48)}, 2)
    with pytest.raises(IndexRejected, match="booleans"):
        parse_committed({"committed": [True, 1]}, 2)
    with pytest.raises(IndexRejected, match="not a reply map"):
        check_reply("stats", [1])
    with pytest.raises(IndexRejected) as info:
        check_reply("retrieve", {"ok": False, "error": {"type": "no_space", "message": "full"}})
    assert info.value.error_type is ErrorType.NO_SPACE and "full" in str(info.value)


# -- pipelining, errors as types ---------------------------------------------

def test_pipelined_overlapping_retrieves_count_pins_per_key_on_one_lease(index, pool):
    """Retrieves of overlapping batches in flight together on one connection:
    the index counts each key's pins on the lease, and releases them exactly
    as often as they were taken."""
    with IndexClient(index.url, token=TOKEN, client_name="pipelined") as client:
        store(client, pool, [key(i) for i in range(32)])
        assert client.match_prefix([key(i) for i in range(40)]) == 32
        batches = [[key(j) for j in range(i, i + 8)] for i in range(0, 24, 2)]
        start = threading.Barrier(len(batches))

        def retrieve(batch: list[bytes]) -> LocationList:
            start.wait()
            return client.retrieve(batch)

        with ThreadPoolExecutor(len(batches)) as threads:
            results = list(threads.map(retrieve, batches))
            for batch, locations in zip(batches, results):
                assert [bytes(pool.view(l.offset, 16)) for l in locations] == batch
            assert pinned(index) == 30  # keys 0..29, most of them pinned more than once
            counts = list(threads.map(client.unpin, batches))
        assert sum(counts) == 8 * len(batches) and pinned(index) == 0
        slots = client.reserve([(key(100), 10)])
        assert client.abort([key(100)]) == 1 and slots[0] is not None
        assert client.stats()["keys"] == 32
        matched, locations = client.retrieve_prefix([key(i) for i in range(40)], 5)
        assert matched == 32 and len(locations) == 30 and pinned(index) == 30
        assert client.unpin([key(i) for i in range(30)]) == 30
        assert client.heartbeat() == 0.6
        client.retrieve([key(0)])
    stats = index.on_loop(index.service.server.registry.stats)
    assert (stats.leases, stats.pinned_keys) == (0, 0)  # close ended the lease


def test_a_timeout_is_an_index_timeout(client, pool, index):
    """A caller tells a timeout by its type (also a ``TimeoutError``), not by its message."""
    client.connect()
    index._loop.call_soon_threadsafe(time.sleep, 0.5)  # the index stalls
    with pytest.raises(IndexTimeout) as info:
        client.match_prefix([key(1)], timeout_s=0.1)
    assert isinstance(info.value, IndexUnavailable) and isinstance(info.value, TimeoutError)
    time.sleep(0.5)
    assert client.match_prefix([key(1)]) == 0


def test_a_refused_connection_is_unavailable_not_a_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with IndexClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5) as client:
        with pytest.raises(IndexUnavailable) as info:
            client.connect()
    assert not isinstance(info.value, IndexTimeout)


def test_error_types_are_enum_members():
    with pytest.raises(IndexRejected) as info:
        check_reply(Op.RESERVE, {"ok": False, "error": {"type": "no_space", "message": "full"}})
    assert info.value.error_type is ErrorType.NO_SPACE and info.value.op is Op.RESERVE
    assert "[no_space]" in str(info.value) and "index refused reserve" in str(info.value)
    # A type this version does not know (a newer index's) reads as the most cautious one.
    with pytest.raises(IndexRejected) as info:
        check_reply(Op.RETRIEVE, {"ok": False, "error": {"type": "brand_new", "message": "m"}})
    assert info.value.error_type is ErrorType.INTERNAL and "brand_new" in info.value.message


def test_a_client_of_the_next_release_stores_and_reads_through_this_index(index, pool, monkeypatch):
    """A rolling upgrade, the pods first: a connector of the next release offers its protocol,
    this index answers in its own, and the client speaks that (each release speaks the one
    before): stores and lookups work, no refusal loop."""
    from maru_core.index import client_ops

    monkeypatch.setattr(client_ops, "PROTOCOL_VERSION", client_ops.PROTOCOL_VERSION + 1)
    client = IndexClient(index.url, token=TOKEN, client_name="next-release", timeout_s=2.0)
    try:
        keys = [key(i) for i in range(300, 304)]
        assert store(client, pool, keys) == [True] * 4
        assert client.match_prefix(keys) == 4
    finally:
        client.close()


@pytest.mark.parametrize("answered", [None, 0, 2**10])
def test_an_index_answering_a_protocol_this_client_does_not_speak_is_named(answered):
    from maru_core.index.client_ops import parse_hello

    reply = {"ok": True, "lease_id": "l", "lease_ttl_s": 1.0, "geometry": {}, "protocol": answered}
    with pytest.raises(Exception, match="one release at a time"):
        parse_hello(reply)
