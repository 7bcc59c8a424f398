"""The registry's flush by row range (``maru_core.index.maintenance``): what it
may never remove (pinned objects, reservations, fenced pages of lapsed
writers), and the eviction windows it is charged to."""

from __future__ import annotations

import numpy as np
from test_registry import PAGE, Clock, accounting_adds_up, geometry, key, store

from maru_core.index.registry import Registry


def flush_all(reg: Registry, lease: str):
    found = reg.committed_rows(0, 1 << 20)
    return reg.flush_rows(lease, found, np.ones(len(found.rows), dtype=bool))


def test_flush_keeps_pins_reservations_and_the_fence_of_a_lapsed_writer():
    clock = Clock()
    reg = Registry(geometry(100), lease_ttl_s=1000, reservation_ttl_s=5, clock=clock)
    writer, reader, slow, admin = (reg.open_lease(name) for name in ("writer", "reader", "slow", "admin"))
    store(reg, writer, [key(i) for i in range(10)])
    assert reg.retrieve(reader, [key(0), key(1)]).misses() == 0
    reg.reserve(slow, [(key(50), 3 * PAGE)])  # lapses: a late copy may still land in its pages
    clock.now += 6
    reg.expire()
    assert reg.fenced_pages == 3
    reg.reserve(writer, [(key(60), PAGE)])  # a store in flight
    outcome = flush_all(reg, admin)
    assert (outcome.evicted, outcome.evicted_pages, outcome.pinned, outcome.held_back) == (8, 8, 2, 0)
    assert reg.fenced_pages == 3, "the fenced pages of the lapsed writer stay fenced"
    assert reg.describe(key(60)).state == "reserved"
    assert [reg.describe(key(i)) is not None for i in range(3)] == [True, True, False]
    stats = reg.stats()
    assert stats.keys == 2 and stats.reserved_bytes == 4 * PAGE and stats.evictions == 0
    accounting_adds_up(reg)


def test_a_flush_is_charged_to_the_lease_and_peer_eviction_windows():
    clock = Clock()
    reg = Registry(geometry(100), lease_ttl_s=1000, clock=clock, max_lease_evict_fraction=0.1,
                   max_peer_evict_fraction=0.15,
                   evict_window_s=10)  # fmt: skip
    writer = reg.open_lease("writer", peer="10.0.0.1")
    store(reg, writer, [key(i) for i in range(40)])
    first = reg.open_lease("admin", peer="10.0.0.9")
    outcome = flush_all(reg, first)
    assert (outcome.evicted, outcome.quota) == (10, "evictions") and outcome.held_back == 30
    second = reg.open_lease("admin", peer="10.0.0.9")  # a second lease of the same peer
    outcome = flush_all(reg, second)
    assert (outcome.evicted, outcome.quota) == (5, "peer_evictions")
    clock.now += 11  # the windows have passed
    assert flush_all(reg, first).evicted == 10
    assert reg.stats().keys == 15
