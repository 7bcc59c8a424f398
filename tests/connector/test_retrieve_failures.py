"""Every way a load's ``retrieve`` can fail leaves nothing pinned on the index.

A real index (``ThreadedIndex``, the server and registry the product runs)
sits behind a small TCP proxy that rewrites the next ``retrieve`` reply the
way a faulty network, a buggy index or a version mismatch would. After each
failure the registry's own count of pinned keys must drop to zero: at once
where the client can tell what was pinned (it unpins), within one lease period
where it cannot (it leaves that lease to lapse, and the heartbeat no longer
renews it).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
from maru_core.index.client import IndexClient, IndexRejected, IndexTimeout, IndexUnavailable
from maru_core.index.launcher import ThreadedIndex, unique_shm_path
from maru_core.pool import Pool, SlotHeader
from maru_core.protocol import ErrorType, LocationList, Op, pack_locations

from maru_connector.resolve import LoadFailure, index_failure, object_keys, release_pins, resolve_load
from maru_connector.transfer import TransferEngine

from kv_builders import make_kv_caches

TOKEN = "retrieve-failures"
LEASE_TTL_S = 0.6
BLOCK, CHUNK, LAYERS = 16, 32, 4

Tamper = Callable[[dict], "dict | None"]  # None: close the connection instead


class TamperingProxy:
    """Forwards index frames (4-byte big-endian length, msgpack map) both ways
    and hands the next reply to ``op`` (a ``retrieve`` unless told) to
    ``tamper`` once armed."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._tamper: Tamper | None = None
        self._op = "retrieve"
        self.delay_s = 0.0
        self.fired = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, tamper: Tamper, delay_s: float = 0.0, op: str = "retrieve") -> None:
        with self._lock:
            self._tamper, self.delay_s, self._op = tamper, delay_s, op

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._sockets += [client, upstream]
            ops: dict[int, str] = {}
            threading.Thread(target=self._pump, args=(client, upstream, ops, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, ops, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, ops: dict[int, str], replies: bool) -> None:
        try:
            while (message := _read(src)) is not None:
                if not replies:
                    ops[message["id"]] = message["op"]
                elif ops.pop(message.get("id"), "") == self._op:
                    message = self._apply(message)
                    if message is None:
                        break
                dst.sendall(_frame(message))
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _apply(self, message: dict) -> dict | None:
        with self._lock:
            tamper, self._tamper = self._tamper, None
        if tamper is None:
            return message
        self.fired += 1
        time.sleep(self.delay_s)
        return tamper(message)


def _read(sock: socket.socket) -> dict | None:
    header = _read_exactly(sock, 4)
    if header is None:
        return None
    body = _read_exactly(sock, struct.unpack(">I", header)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            return None
        data += part
    return data


def _frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _locations(message: dict) -> list:
    return list(LocationList.from_wire(message["locations"]))


def short(message: dict) -> dict:
    return {**message, "locations": pack_locations(_locations(message)[:-1])}


def long(message: dict) -> dict:
    locations = _locations(message)
    return {**message, "locations": pack_locations(locations + locations[-1:])}


def short_with_a_miss(message: dict) -> dict:
    locations = _locations(message)[:-1]
    locations[0] = None
    return {**message, "locations": pack_locations(locations)}


def undecodable(message: dict) -> dict:
    return {**message, "locations": message["locations"][:-5]}


def ok_not_a_boolean(message: dict) -> dict:
    return {**message, "ok": "yes"}


def internal_error(message: dict) -> dict:
    return {"id": message["id"], "ok": False, "error": {"type": "internal", "message": "boom"}}


def dropped(message: dict) -> None:
    return None


# ---- fixtures -----------------------------------------------------------------


@pytest.fixture
def pool() -> Iterator[Pool]:
    path = unique_shm_path("test-retrieve-failures")
    pool = Pool.create(path, 16 * 1024 * 1024, page_size=4096)
    yield pool
    pool.close()
    os.unlink(path)


@pytest.fixture
def index(pool) -> Iterator[ThreadedIndex]:
    with ThreadedIndex(pool, token=TOKEN, lease_ttl_s=LEASE_TTL_S) as index:
        yield index


@pytest.fixture
def proxy(index) -> Iterator[TamperingProxy]:
    proxy = TamperingProxy(int(index.url.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


@pytest.fixture
def client(proxy) -> Iterator[IndexClient]:
    client = IndexClient(proxy.url, token=TOKEN, client_name="reader", timeout_s=1.0)
    yield client
    client.close()


@pytest.fixture
def fmt():
    kv = make_kv_caches("cpu", layers=LAYERS, blocks=16, heads=2, block_size=BLOCK, head_size=8, seed=0)
    return TransferEngine.detect(kv, CHUNK, True, BLOCK)  # layerwise: one object per layer


def pinned(index: ThreadedIndex) -> int:
    return index.on_loop(lambda: index.service.server.registry.stats().pinned_keys)


def wait_unpinned(index: ThreadedIndex, timeout_s: float = 4 * LEASE_TTL_S + 2) -> int:
    deadline = time.monotonic() + timeout_s
    while pinned(index) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pinned(index)


def chunk_keys(n: int, first: int = 0) -> list[bytes]:
    return [(first + i).to_bytes(16, "big") for i in range(n)]


def store(index: ThreadedIndex, pool: Pool, fmt, chunks: list[bytes]) -> None:
    """Commit the layer objects of ``chunks`` (real slots and slot headers)."""
    keys = object_keys(fmt, chunks)
    with IndexClient(index.url, token=TOKEN, client_name="writer") as writer:
        slots = writer.reserve([(k, fmt.object_bytes) for k in keys])
        for k, slot in zip(keys, slots):
            pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation,
                                                           length=fmt.object_bytes, layout=fmt.fingerprint))
        assert all(writer.commit(keys))


def blocks(n: int) -> list[tuple[int, ...]]:
    per = CHUNK // BLOCK
    return [tuple(range(c * per, (c + 1) * per)) for c in range(n)]


# ---- the index client on its own ------------------------------------------------


def stored(index, pool, fmt) -> list[bytes]:
    """The four layer objects of one stored chunk."""
    store(index, pool, fmt, chunk_keys(1))
    return object_keys(fmt, chunk_keys(1))


def test_long_reply_is_unpinned_at_once_on_the_same_lease(index, pool, proxy, client, fmt):
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    proxy.arm(long)
    with pytest.raises(IndexRejected, match="locations for"):
        client.retrieve(keys)
    assert proxy.fired == 1
    assert pinned(index) == 0  # unpinned before retrieve raised, not by a lapse
    assert client.lease_id == lease


@pytest.mark.parametrize("tamper", [short, short_with_a_miss, undecodable, ok_not_a_boolean, internal_error],
                         ids=["short", "short-with-a-miss", "undecodable", "ok-not-a-boolean", "internal-error"])
def test_reply_that_cannot_tell_what_was_pinned_leaves_the_lease_to_lapse(index, pool, proxy, client, fmt, tamper):
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    proxy.arm(tamper)
    with pytest.raises(IndexRejected):
        client.retrieve(keys)
    assert proxy.fired == 1
    assert pinned(index) == len(keys)  # the index did pin; its answer was lost on the way
    assert client.lease_id != lease  # a fresh lease; the heartbeat no longer renews the old one
    assert wait_unpinned(index) == 0
    assert client.match_prefix(keys) == len(keys)  # the client keeps serving


def test_real_refusal_pins_nothing_and_keeps_the_lease(index, pool, client, fmt):
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    with pytest.raises(IndexRejected) as info:
        client.retrieve(keys * 100_000)  # above the protocol's batch limit
    assert info.value.error_type is ErrorType.TOO_LARGE
    assert pinned(index) == 0 and client.lease_id == lease


@pytest.mark.parametrize("tamper, delay_s", [(dropped, 0.0), (lambda m: m, 1.5)], ids=["dropped", "timeout"])
def test_lost_or_late_reply_leaves_the_lease_to_lapse(index, pool, proxy, client, fmt, tamper, delay_s):
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    proxy.arm(tamper, delay_s=delay_s)
    with pytest.raises(IndexUnavailable):
        client.retrieve(keys)
    time.sleep(delay_s)  # the late reply has pinned by now
    assert client.match_prefix(keys) == len(keys) and client.lease_id != lease
    assert wait_unpinned(index) == 0


def test_a_retrieve_prefix_reply_that_cannot_be_trusted_leaves_the_lease_to_lapse(index, pool, proxy, client, fmt):
    """Its pinned count is what failed the check, so nothing is unpinned on its
    word: the client moves to a fresh lease and the old one lapses."""
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    proxy.arm(short, op="retrieve_prefix")
    with pytest.raises(IndexRejected, match="locations"):
        client.retrieve_prefix(keys + chunk_keys(1, first=99), len(keys))
    assert proxy.fired == 1
    assert pinned(index) == len(keys) and client.lease_id != lease
    assert wait_unpinned(index) == 0
    matched, locations = client.retrieve_prefix(keys, len(keys))  # the client keeps serving
    assert matched == len(keys) and len(locations) == len(keys) and pinned(index) == len(keys)


def test_a_refused_retrieve_prefix_pins_nothing_and_keeps_the_lease(index, pool, client, fmt):
    keys = stored(index, pool, fmt)
    lease = client.connect().lease_id
    with pytest.raises(IndexRejected) as info:
        client.retrieve_prefix(keys * 100_000, 1)  # above the protocol's batch limit
    assert info.value.error_type is ErrorType.TOO_LARGE
    assert pinned(index) == 0 and client.lease_id == lease


def test_a_failed_retrieve_counts_as_a_timeout_by_its_type_not_its_words():
    """``timeout`` is the index client's ``IndexTimeout``; an error that only
    mentions a timeout (a refusal naming a field, a lost connection) is an
    ``index_error``."""
    assert index_failure(IndexTimeout("no reply to retrieve within the timeout")).reason == "timeout"
    assert index_failure(IndexTimeout("cannot connect to the index at tcp://h:1: boom")).reason == "timeout"
    refused = IndexRejected(ErrorType.BAD_REQUEST, "field 'timeout_ms' is unknown", Op.RETRIEVE)
    assert index_failure(refused).reason == "index_error"
    lost = IndexUnavailable("the index closed the connection (it timed out our idle lease)")
    assert index_failure(lost).reason == "index_error"


# ---- resolve_load: the connector's side -------------------------------------------


def miss_in_the_middle(message: dict) -> dict:
    locations = _locations(message)
    locations[len(locations) // 2] = None
    return {**message, "locations": pack_locations(locations)}


@pytest.mark.parametrize(
    "tamper, delay_s, reason",
    [(short, 0.0, "index_error"), (long, 0.0, "index_error"), (undecodable, 0.0, "index_error"),
     (ok_not_a_boolean, 0.0, "index_error"), (internal_error, 0.0, "index_error"),
     (miss_in_the_middle, 0.0, "miss"), (dropped, 0.0, "index_error"), (lambda m: m, 1.5, "timeout")],
    ids=["short", "long", "undecodable", "ok-not-a-boolean", "internal-error", "altered-miss",
         "dropped", "timeout"],
)
def test_every_failed_retrieve_of_a_load_ends_with_nothing_pinned(
    index, pool, proxy, client, fmt, tamper, delay_s, reason
):
    chunks = chunk_keys(3)
    store(index, pool, fmt, chunks)
    proxy.arm(tamper, delay_s=delay_s)
    with pytest.raises(LoadFailure) as info:
        resolve_load(client, pool, fmt, chunks, blocks(3))
    assert proxy.fired == 1
    assert info.value.reason == reason
    time.sleep(delay_s)  # a late reply has pinned by now
    assert wait_unpinned(index) == 0
    # The next load of the same chunks goes through and releases its pins.
    pinned_load = resolve_load(client, pool, fmt, chunks, blocks(3))
    assert pinned(index) == 3 * LAYERS
    release_pins(client, pinned_load)
    assert pinned(index) == 0


def test_header_mismatch_unpins_and_a_miss_keeps_other_loads_pins(index, pool, proxy, client, fmt):
    shared, tail = chunk_keys(2), chunk_keys(1, first=100)
    store(index, pool, fmt, shared)
    first = resolve_load(client, pool, fmt, shared, blocks(2))  # a load still copying
    with pytest.raises(LoadFailure) as info:  # its last chunk is not in the pool
        resolve_load(client, pool, fmt, shared + tail, blocks(3))
    assert info.value.reason == "miss"
    assert pinned(index) == 2 * LAYERS  # the first load's pins are untouched

    # A slot reused under the reader: the header names another generation.
    victim = client.retrieve(object_keys(fmt, shared[:1]))[0]
    client.unpin(object_keys(fmt, shared[:1]))
    header = pool.read_slot_header(victim.offset)
    pool.write_slot_header(victim.offset, SlotHeader(key=header.key, generation=header.generation + 1,
                                                     length=header.length))
    with pytest.raises(LoadFailure) as info:
        resolve_load(client, pool, fmt, shared, blocks(2))
    assert info.value.reason == "header_mismatch"
    assert pinned(index) == 2 * LAYERS  # only the first load's pins remain
    release_pins(client, first)
    assert pinned(index) == 0
