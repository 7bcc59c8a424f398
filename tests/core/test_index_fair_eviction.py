"""Eviction by fair share against a real index process over real sockets: a token
holder from another address (127.0.0.2 over loopback: another peer) stores the
pool over three times, and a victim's objects, stored before and far under its
share, all stay retrievable; the attacker evicts its own.

The eviction quotas are lifted (one reserve may evict the whole pool, one peer
the whole pool per second): what keeps the victim's objects here is the fair
share alone."""

from __future__ import annotations

import time

from quota_objects import OBJECT, numbered, store

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.pool import Pool, SlotHeader
from maru_tools.index_process import IndexProcess

ATTACKER_ADDRESS = "127.0.0.2"
NO_EVICTION_WINDOWS = ("--max-evict-fraction", "1", "--max-lease-evict-fraction", "1",
                       "--max-peer-evict-fraction", "1", "--evict-window", "1")  # fmt: skip


def test_a_peer_storing_without_end_leaves_another_peers_objects_within_its_share():
    """Before, the attacker's stores evicted the least recently used first: the victim's, stored first."""
    extra_args = ("--page-size", "4Ki", *NO_EVICTION_WINDOWS)
    with IndexProcess(pool_size="32Mi", extra_args=extra_args) as index, Pool.attach(index.pool_path) as pool:
        pages = pool.geometry.num_pages
        victim = index.client()  # 127.0.0.1; keeps its lease (heartbeats) all along, as an engine does
        attacker = IndexClient(index.url, token=index.token, client_name="attacker", timeout_s=10,
                               source_address=ATTACKER_ADDRESS)  # fmt: skip
        try:
            mine = numbered(1, pages // 8)  # a page each: far under half of the pool up to the low watermark
            store(victim, pool, mine)
            stored = 0
            while stored < 3 * pages:
                stored += _store_what_fits(attacker, pool, _keys(stored, 1000))
            stats = victim.stats()
            assert stats["evictions"] >= 2 * pages, stats  # the attacker turned the pool over
            found = victim.retrieve(mine)
            assert found.misses() == 0, "some of the victim's objects were evicted (a retrieve is all or nothing)"
            assert victim.unpin(mine) == len(mine)
        finally:
            attacker.close()
            victim.close()


def _store_what_fits(client: IndexClient, pool: Pool, keys: list[bytes]) -> int:
    """Store what the index gives slots to (its window may cut a batch short, or refuse it
    for a moment); return how many."""
    try:
        slots = list(client.reserve([(k, OBJECT) for k in keys]))
    except IndexRejected as exc:
        assert exc.error_type == "quota", exc
        time.sleep(0.1)
        return 0
    given = [(k, slot) for k, slot in zip(keys, slots) if slot is not None]
    for k, slot in given:
        pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=OBJECT))
    assert client.commit([k for k, _ in given]) == [True] * len(given)
    return len(given)


def _keys(first: int, count: int) -> list[bytes]:
    """The attacker's keys, numbered from ``first`` (apart from the victim's)."""
    return [b"\xaa" + (first + i).to_bytes(8, "little") + bytes(7) for i in range(count)]
