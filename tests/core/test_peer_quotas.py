"""What all the leases of one peer may hold, pin and evict together, in the
registry: more leases give a peer no more of the pool, a new lease does not
reset the peer's eviction window, a resumed lease stays its opener's, and
the accounts of peers gone are forgotten (bounded memory)."""

from __future__ import annotations

import pytest

from maru_core.index.registry import Registry
from maru_core.index.registry_types import QuotaExceeded
from test_registry import PAGE, Clock, accounting_adds_up, geometry, key, store

HOG, HONEST = "10.0.0.1", "10.0.0.2"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_more_leases_pin_no_more_than_the_peers_share(clock: Clock) -> None:
    """Before, each lease had its own pin quota: two leases pinned the whole pool."""
    reg = Registry(geometry(100), clock=clock, max_lease_pin_fraction=0.5, max_peer_pin_fraction=0.5)
    told = []
    reg.quota_listener = lambda *what: told.append(what)
    writer = reg.open_lease("writer", peer=HONEST)
    keys = [key(i) for i in range(90)]
    store(reg, writer, keys)
    hogs = [reg.open_lease("hog", peer=HOG) for _ in range(4)]
    for i, lease in enumerate(hogs[:3]):
        reg.retrieve(lease, keys[15 * i : 15 * (i + 1)])  # 45 pages in all
    with pytest.raises(QuotaExceeded, match="--max-peer-pin-fraction") as refused:
        reg.retrieve(hogs[3], keys[45:55])  # within its lease's quota, past its peer's
    assert refused.value.error_type == "quota" and refused.value.quota == "peer_pins"
    assert f"peer {HOG}" in str(refused.value) and told[-1][0] == "peer_pins"
    assert reg.describe(keys[50]).pins == 0  # all or nothing
    reg.retrieve(hogs[3], keys[45:50])  # what is left of the peer's share
    reader = reg.open_lease("reader", peer=HONEST)
    reg.retrieve(reader, keys[50:90])  # another peer has its own share
    reg.close_lease(hogs[0])  # its 15 pages come off the peer's account
    reg.retrieve(hogs[3], keys[50:60])
    assert reg.peer_accounts.get(HOG).pin_pages == 45
    accounting_adds_up(reg)


def test_more_leases_reserve_no_more_than_the_peers_share(clock: Clock) -> None:
    reg = Registry(geometry(100), clock=clock, reservation_ttl_s=5, max_lease_pages_fraction=0.5,
                   max_peer_pages_fraction=0.5)  # fmt: skip
    a, b, c = (reg.open_lease("hog", peer=HOG) for _ in range(3))
    assert None not in reg.reserve(a, [(key(i), PAGE) for i in range(30)])
    cut = reg.reserve(b, [(key(100 + i), PAGE) for i in range(30)])  # cut short to the peer's room
    assert sum(slot is not None for slot in cut) == 20
    with pytest.raises(QuotaExceeded, match="--max-peer-pool-fraction") as refused:
        reg.reserve(c, [(key(200), PAGE)])
    assert refused.value.quota == "peer_reservations"
    other = reg.open_lease("honest", peer=HONEST)
    assert None not in reg.reserve(other, [(key(300 + i), PAGE) for i in range(40)])
    clock.now += 6
    reg.expire()  # a's reservations lapsed: fenced, still charged to it and its peer
    with pytest.raises(QuotaExceeded, match="--max-peer-pool-fraction"):
        reg.reserve(c, [(key(201), PAGE)])
    reg.close_lease(a)
    reg.close_lease(b)  # ended leases are charged nothing: the peer has its share back
    assert reg.peer_accounts.get(HOG).held_pages == 0
    assert reg.commit(c, [key(202)]) == [False]
    assert None not in reg.reserve(c, [(key(202 + i), PAGE) for i in range(10)])
    accounting_adds_up(reg)


def test_a_bye_and_hello_does_not_reset_the_peers_eviction_window(clock: Clock) -> None:
    """Before, the window lived with the lease: a new lease evicted a quarter more."""
    reg = Registry(geometry(100), clock=clock, lease_ttl_s=120, max_evict_fraction=0.25,
                   max_lease_evict_fraction=0.25, max_peer_evict_fraction=0.25, evict_window_s=60.0)  # fmt: skip
    honest = reg.open_lease("honest", peer=HONEST)
    theirs = [key(i) for i in range(94)]
    store(reg, honest, theirs)
    wiper = reg.open_lease("wiper", peer=HOG)
    assert any(reg.reserve(wiper, [(key(1000 + i), PAGE) for i in range(40)]))
    for attempt in range(3):
        reg.close_lease(wiper)  # bye
        wiper = reg.open_lease("wiper", peer=HOG)  # hello: a fresh lease, the same peer
        with pytest.raises(QuotaExceeded, match="--max-peer-evict-fraction per --evict-window") as refused:
            reg.reserve(wiper, [(key(2000 + 100 * attempt + i), PAGE) for i in range(40)])
        assert refused.value.quota == "peer_evictions"
    assert reg.stats().evictions <= 25 + 1
    assert sum(reg.describe(k) is not None for k in theirs) >= 94 - 26
    clock.now += 61  # the window has passed
    assert any(reg.reserve(wiper, [(key(3000 + i), PAGE) for i in range(10)]))


def test_a_lease_resumed_by_another_peer_stays_charged_to_the_peer_that_opened_it(clock: Clock) -> None:
    reg = Registry(geometry(100), clock=clock, max_peer_pin_fraction=0.2)
    lease = reg.open_lease("engine", peer=HOG)
    keys = [key(i) for i in range(30)]
    store(reg, lease, keys)
    assert reg.open_lease("engine", lease, peer=HONEST) == lease  # reconnected from elsewhere
    reg.retrieve(lease, keys[:15])
    assert reg.peer_accounts.get(HOG).pin_pages == 15
    assert reg.peer_accounts.get(HONEST) is None
    with pytest.raises(QuotaExceeded, match=f"peer {HOG}"):
        reg.retrieve(lease, keys[15:25])


def test_the_accounts_of_peers_gone_are_kept_for_the_window_then_dropped(clock: Clock) -> None:
    reg = Registry(geometry(100), clock=clock, lease_ttl_s=8, max_peer_evict_fraction=0.25, evict_window_s=10.0,
                   max_idle_peer_accounts=500)  # fmt: skip
    live = reg.open_lease("kept", peer="192.0.2.1")
    for i in range(20_000):  # a client hopping addresses: one lease each, ended at once
        reg.close_lease(reg.open_lease("hop", peer=f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"))
    assert len(reg.peer_accounts) <= 500 + 1
    clock.now += 5
    reg.renew(live)
    reg.expire()
    assert len(reg.peer_accounts) <= 501  # within the window: kept
    clock.now += 6
    reg.renew(live)
    reg.expire()
    assert len(reg.peer_accounts) == 1  # only the peer with a live lease
    clock.now += 9
    reg.expire()  # its lease lapsed: kept a window more, then dropped
    assert len(reg.peer_accounts) == 1
    clock.now += 11
    reg.expire()
    assert len(reg.peer_accounts) == 0


def test_no_peer_quota_binds_by_default_in_the_registry(clock: Clock) -> None:
    reg = Registry(geometry(100), clock=clock)
    leases = [reg.open_lease("a", peer=HOG) for _ in range(2)]
    keys = [key(i) for i in range(100)]
    store(reg, leases[0], keys)
    reg.retrieve(leases[0], keys)
    reg.retrieve(leases[1], keys)
    assert reg.peer_accounts.get(HOG).pin_pages == 200  # each lease's distinct objects, summed
