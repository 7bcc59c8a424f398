"""Eviction by fair share among peers, in the registry: a peer storing without end
evicts its own objects once over its share and leaves the others theirs; a peer
alone still has the whole pool; pinned objects stay; objects of an owner without
a lease (a peer gone, the objects a restart restored) are kept for nobody.

Pool of 100 one-page objects, watermarks 95 % / 85 %: two peers with a lease
have 85 // 2 = 42 pages each kept for them."""

from __future__ import annotations

import pytest

from maru_core.index.registry import NoSpace, Registry
from maru_core.protocol.locations import Location
from test_registry import PAGE, Clock, accounting_adds_up, geometry, key, store

A, B = "10.0.0.1", "10.0.0.2"
SHARE = 85 // 2


@pytest.fixture
def clock() -> Clock:
    return Clock()


def numbered(first: int, count: int) -> list[bytes]:
    return [key(i) for i in range(first, first + count)]


def store_each(reg: Registry, lease: str, keys: list[bytes]) -> None:
    """One key per reserve: each its own LRU tick, the first the oldest (within a
    batch the tail is the least recently used)."""
    for k in keys:
        store(reg, lease, [k])


def kept(reg: Registry, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if reg.describe(k) is not None]


def test_a_peer_storing_without_end_leaves_another_its_fair_share(clock: Clock) -> None:
    """Before, B's stores aged out A's objects, the least recently used, to the last."""
    reg = Registry(geometry(100), clock=clock)
    a, b = reg.open_lease("a", peer=A), reg.open_lease("b", peer=B)
    theirs = numbered(0, 90)
    for start in range(0, 90, 10):
        store_each(reg, a, theirs[start : start + 10])
    for round_ in range(30):  # 300 pages: the pool three times over, 10 pages a reserve
        mine = numbered(1000 + 10 * round_, 10)
        store(reg, b, mine)
        reg.renew(a)  # A's engine is alive: its lease lives
    assert len(kept(reg, theirs)) == SHARE  # down to its share, not below
    assert kept(reg, theirs) == theirs[-SHARE:]  # its most recently used
    assert kept(reg, mine) == mine
    owned = reg.owned_pages()
    assert owned[A] == SHARE and SHARE <= owned[B] <= 95 - SHARE
    accounting_adds_up(reg)


def test_a_peer_over_its_share_evicts_its_own_objects_first(clock: Clock) -> None:
    """Before, the least recently used went, whoever's: A's, stored first."""
    reg = Registry(geometry(100), clock=clock)
    a, b = reg.open_lease("a", peer=A), reg.open_lease("b", peer=B)
    theirs, mine = numbered(0, 40), numbered(100, 50)
    store_each(reg, a, theirs)  # under its share, and older than anything of B
    for start in range(0, 50, 10):
        store_each(reg, b, mine[start : start + 10])
    store(reg, b, numbered(200, 10))  # 100 pages: down to 85, B's 15 oldest go
    assert kept(reg, theirs) == theirs
    assert kept(reg, mine) == mine[15:]
    assert reg.stats().evictions == 15
    accounting_adds_up(reg)


def test_a_peer_alone_uses_the_whole_pool_least_recently_used_first(clock: Clock) -> None:
    """A lease that owns nothing (a reader) does not shrink the only owner's share."""
    reg = Registry(geometry(100), clock=clock)
    writer = reg.open_lease("writer", peer=A)
    reg.open_lease("reader", peer=B)
    stored: list[bytes] = []
    for round_ in range(30):
        stored += numbered(10 * round_, 10)
        store_each(reg, writer, stored[-10:])
    present = kept(reg, stored)
    assert 85 <= len(present) <= 95 and present == stored[-len(present):]
    assert reg.owned_pages() == {A: len(present)}


def test_pinned_objects_stay_and_a_peer_over_its_share_takes_nothing_from_others(clock: Clock) -> None:
    """Before, B, its objects pinned, evicted A's to store more."""
    reg = Registry(geometry(100), clock=clock)
    a, b = reg.open_lease("a", peer=A), reg.open_lease("b", peer=B)
    theirs, pinned, loose = numbered(0, 30), numbered(100, 60), numbered(200, 5)
    store_each(reg, a, theirs)
    store_each(reg, b, pinned)
    reg.retrieve(b, pinned)  # B pins what it stored
    store(reg, b, loose)  # 95 pages
    more = numbered(300, 10)
    store(reg, b, more)  # over its share: it evicts its own unpinned objects, none of A's
    assert kept(reg, theirs) == theirs and kept(reg, loose) == []
    reg.retrieve(b, more)  # now all of B's objects are pinned, 70 pages: over its share
    with pytest.raises(NoSpace, match="fair share"):
        reg.reserve(b, [(k, PAGE) for k in numbered(400, 5)])
    assert kept(reg, theirs) == theirs
    store(reg, a, numbered(500, 10))  # A, within its share, still stores
    assert kept(reg, pinned + more) == pinned + more
    assert all(reg.describe(k).pins == 1 for k in pinned + more)
    accounting_adds_up(reg)


def test_the_objects_of_a_peer_without_a_lease_go_first(clock: Clock) -> None:
    """Within the eviction window after its lease ended a peer keeps its share; then
    nothing is kept for it (a pod gone; one that comes back has a new address)."""
    reg = Registry(geometry(100), clock=clock, lease_ttl_s=60.0, evict_window_s=10.0)
    b = reg.open_lease("b", peer=B)
    mine, theirs = numbered(0, 40), numbered(100, 40)
    store_each(reg, b, mine)  # older than A's
    a = reg.open_lease("a", peer=A)
    store_each(reg, a, theirs)
    reg.close_lease(a)
    store(reg, b, numbered(200, 20))  # A's account lives on for the window: B, over its share, evicts its own
    assert kept(reg, theirs) == theirs and kept(reg, mine) == mine[15:]
    clock.now += 11
    reg.renew(b)
    reg.expire()
    assert reg.peer_accounts.get(A) is None
    store(reg, b, numbered(300, 20))  # 105 pages: A's 20 oldest go, B (alone, under 85) keeps all
    assert kept(reg, theirs) == theirs[20:]
    assert kept(reg, mine) == mine[15:]
    accounting_adds_up(reg)


def test_restored_objects_belong_to_no_peer_and_go_before_a_peer_within_its_share(clock: Clock) -> None:
    """After a restart the headers name no peer: the objects are ``RESTORED``'s, kept for nobody,
    even those read since (more recently used than the engine's own)."""
    g = geometry(100)
    old = Registry(g, clock=clock)
    before = numbered(0, 50)
    slots = store(old, old.open_lease("old", peer=A), before)
    new = Registry(g, lease_ttl_s=10, quarantine_s=0, clock=clock)
    assert new.restore([(k, Location(s.offset, PAGE, s.generation)) for k, s in zip(before, slots)]) == 50
    engine = new.open_lease("engine", peer=A)
    mine = numbered(100, 40)
    store_each(new, engine, mine)
    new.retrieve(engine, before)
    new.unpin(engine, before)  # read again: the restored objects are now the most recently used
    store(new, engine, numbered(200, 10))  # 100 pages: 15 go, restored ones
    assert kept(new, mine) == mine and len(kept(new, before)) == 35
    from maru_core.index.ownership import RESTORED  # here: the other tests also run against older trees

    assert new.owned_pages() == {RESTORED: 35, A: 50}
    accounting_adds_up(new)
