"""What one call may cost the registry: a reserve evicts a bounded share of
the pool and does work bounded by what fits; pins are released in chunks.
Plus a bounded property-based run over random sequences of operations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import maru_core.index.leases as leases
from maru_core.index.records import State
from maru_core.index.registry import NoSpace, Registry
from maru_core.index.registry_types import QuotaExceeded
from test_registry import PAGE, Clock, accounting_adds_up, fill, geometry, key


def test_one_batch_cannot_wipe_the_cache(clock: Clock = Clock()) -> None:
    reg = Registry(geometry(100), clock=clock)  # max_evict_fraction 0.25 by default
    lease = reg.open_lease("a")
    fill(reg, lease, 0, 90)
    flood = [(key(10_000 + i), 1) for i in range(5_000)]
    slots = reg.reserve(lease, flood)
    granted = sum(slot is not None for slot in slots)
    stats = reg.stats()
    assert stats.evictions <= 25, stats  # a quarter of 100 pages, whatever the batch asks for
    assert stats.keys >= 65 and granted <= 10 + 25
    accounting_adds_up(reg)


def test_a_huge_batch_into_a_pinned_pool_tries_eviction_a_bounded_number_of_times(clock: Clock = Clock()) -> None:
    reg = Registry(geometry(100), high_watermark=1.0, low_watermark=1.0, clock=clock)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 100)
    reg.retrieve(lease, keys)  # everything pinned: nothing can be evicted
    calls = []
    evict = reg._evict
    reg._evict = lambda pages, *claim: calls.append(pages) or evict(pages, *claim)
    with pytest.raises(NoSpace):
        reg.reserve(lease, [(key(10_000 + i), PAGE) for i in range(50_000)])
    assert len(calls) <= 2, len(calls)  # not once per item
    accounting_adds_up(reg)


def test_a_reserve_into_a_full_pool_with_nothing_to_evict_gives_up_without_walking_the_batch(
    clock: Clock = Clock(),
) -> None:
    reg = Registry(geometry(100), clock=clock)
    lease = reg.open_lease("a")
    assert None not in reg.reserve(lease, [(key(i), PAGE) for i in range(100)])  # reserved: not evictable
    calls = []
    evict, place_runs = reg._evict, reg._alloc.allocate
    reg._evict = lambda pages, *claim: calls.append(("evict", pages)) or evict(pages, *claim)
    reg._alloc.allocate = lambda count: calls.append(("allocate", count)) or place_runs(count)
    with pytest.raises(NoSpace):
        reg.reserve(lease, [(key(10_000 + i), PAGE) for i in range(50_000)])
    assert calls == [("evict", 25)], calls  # one try at eviction, then nothing more
    accounting_adds_up(reg)


def test_a_batch_larger_than_its_quota_is_counted_no_further_than_the_quota(clock: Clock = Clock()) -> None:
    """A flood of 20,000 one-page objects at a lease's room of 250 pages: only as many objects
    as there are pages left are counted and placed (each takes a page at least); counting all
    of a 131,072-object batch was one step of 3-4 ms of the index's loop. The cut is reported
    with what the batch asked for at least."""
    reg = Registry(geometry(1000), clock=clock, max_lease_pages_fraction=0.25)
    told = []
    reg.quota_listener = lambda quota, client, message: told.append((quota, message))
    lease = reg.open_lease("a")
    placed = []
    place = reg._place_in_window
    reg._place_in_window = lambda lease_, pages: placed.append(len(pages)) or place(lease_, pages)
    slots = reg.reserve(lease, [(key(i), 1) for i in range(20_000)])
    assert placed == [250] and sum(slot is not None for slot in slots) == 250
    assert told == [("reservations", told[0][1])] and "asks for at least 20000 more" in told[0][1]
    with pytest.raises(QuotaExceeded, match="asks for at least 20000 more"):  # none left: refused whole
        reg.reserve(lease, [(key(100_000 + i), 1) for i in range(20_000)])
    accounting_adds_up(reg)


def test_items_smaller_than_one_that_failed_are_still_placed(clock: Clock = Clock()) -> None:
    reg = Registry(geometry(10), high_watermark=1.0, low_watermark=1.0, clock=clock)
    lease = reg.open_lease("a")
    fill(reg, lease, 0, 8)
    reg.retrieve(lease, [key(i) for i in range(8)])
    # 2 pages free, not contiguous with anything evictable: 3 pages fail, then 1 and 1 fit.
    slots = reg.reserve(lease, [(key(100), 3 * PAGE), (key(101), PAGE), (key(102), 3 * PAGE), (key(103), PAGE)])
    assert [slot is not None for slot in slots] == [False, True, False, True]


def test_bye_and_lapse_release_pins_chunk_by_chunk(monkeypatch, clock: Clock = Clock()) -> None:
    monkeypatch.setattr(leases, "PIN_CHUNK_ROWS", 7)
    reg = Registry(geometry(100), lease_ttl_s=10, clock=clock)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 50)
    reg.retrieve(lease, keys)
    reg.retrieve(lease, keys)
    steps = reg.close_lease_sliced(lease)
    assert sum(1 for _ in steps) == 8  # ceil(50 / 7) chunks of distinct objects, however often pinned
    assert reg.stats().pinned_keys == 0 and reg.stats().leases == 0
    other = reg.open_lease("b")
    reg.retrieve(other, keys)
    clock.now += 11
    expiry = reg.expire_sliced()
    assert sum(1 for _ in expiry) == 8
    assert reg.stats().pinned_keys == 0


def test_a_general_unpin_takes_pins_from_any_retrieve_in_order(monkeypatch, clock: Clock = Clock()) -> None:
    monkeypatch.setattr(leases, "PIN_CHUNK_ROWS", 4)
    reg = Registry(geometry(100), clock=clock)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 10)
    reg.retrieve(lease, keys)
    reg.retrieve(lease, keys[:5] + keys[:5])  # a repeated key is pinned twice
    assert reg.unpin(lease, keys[3:7] + [keys[4]] * 3) == 6  # keys[4]: 4 asked, 3 held
    pins = [reg.describe(k).pins for k in keys]
    assert pins == [3, 3, 3, 2, 0, 0, 0, 1, 1, 1]
    assert reg.unpin(lease, keys) == 7
    assert reg.unpin(lease, keys[:4] * 3) == 2 + 2 + 2 + 1
    assert all(reg.describe(k).pins == 0 for k in keys)


class RegistryOps(RuleBasedStateMachine):
    """Random sequences of every registry operation keep the books balanced:
    pages by state add up, no pin count goes negative, and a lease's pins are
    all released when it ends."""

    def __init__(self) -> None:
        super().__init__()
        leases.PIN_CHUNK_ROWS = 3  # many chunks, so that sliced paths are exercised
        self.clock = Clock()
        self.reg = Registry(geometry(40), lease_ttl_s=10, reservation_ttl_s=30, clock=self.clock)
        self.leases = [self.reg.open_lease(name) for name in "ab"]

    def teardown(self) -> None:
        leases.PIN_CHUNK_ROWS = 65536

    keys = st.lists(st.integers(0, 30).map(key), max_size=12)
    who = st.integers(0, 1)

    @rule(who=who, keys=keys, pages=st.integers(1, 4))
    def store(self, who, keys, pages):
        lease = self.leases[who]
        try:
            slots = self.reg.reserve(lease, [(k, pages * PAGE) for k in keys])
        except NoSpace:
            return
        self.reg.commit(lease, [k for k, slot in zip(keys, slots) if slot is not None])

    @rule(who=who, keys=keys)
    def retrieve(self, who, keys):
        self.reg.retrieve(self.leases[who], keys)

    @rule(who=who, keys=keys)
    def unpin(self, who, keys):
        assert self.reg.unpin(self.leases[who], keys) <= len(keys)

    @rule(who=who)
    def bye(self, who):
        self.reg.close_lease(self.leases[who])
        self.leases[who] = self.reg.open_lease("again")

    @rule(seconds=st.floats(0, 15))
    def time_passes(self, seconds):
        self.clock.now += seconds
        self.reg.expire()
        self.leases = [lease if self.reg.lease_is_live(lease) else self.reg.open_lease("new") for lease in self.leases]

    @invariant()
    def books_balance(self):
        accounting_adds_up(self.reg)
        rec = self.reg._records
        assert (rec.pins[: rec.high_water] >= 0).all()
        leases = list(self.reg._leases.values())
        pinners = np.zeros(rec.high_water, dtype=np.int64)  # each object: the leases that pin it
        for lease in leases:
            rows = lease.pins.rows
            assert (np.diff(rows) > 0).all() and lease.pins.total >= len(rows)
            assert lease.pins.pages == int(rec.pages[rows].sum())  # what the pin quota counts
            pinners[rows] += 1
        assert (rec.pins[: rec.high_water] == pinners).all()
        # stats() counts pinned objects as pins come and go; a recount over every record agrees
        pinned = (pinners > 0) & (rec.state[: rec.high_water] == State.COMMITTED)
        assert (pinners > 0).sum() == pinned.sum()  # only committed objects are pinned
        stats = self.reg.stats()
        assert stats.pinned_keys == int(pinned.sum())
        assert stats.pinned_bytes == int(rec.pages[: rec.high_water][pinned].sum()) * self.reg.geometry.page_size


TestRegistryOps = RegistryOps.TestCase
TestRegistryOps.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                    suppress_health_check=list(HealthCheck))  # fmt: skip


def test_the_reservations_of_an_ended_lease_are_released_a_chunk_per_step(monkeypatch, clock: Clock = Clock()) -> None:
    import maru_core.index.lease_book as lease_book

    monkeypatch.setattr(lease_book, "RESERVATION_CHUNK_ROWS", 100)
    reg = Registry(geometry(1000), clock=clock)
    lease = reg.open_lease("a")
    assert None not in reg.reserve(lease, [(key(i), PAGE) for i in range(350)])
    fenced = []
    fence = reg._fence_lapsed
    reg._fence_lapsed = lambda rows: fenced.append(len(rows)) or fence(rows)
    steps = reg.close_lease_sliced(lease)
    next(steps)
    next(steps)
    assert fenced == [100, 100]  # a chunk per step, not 350 at once
    clock.now += 31  # past their deadline: expiry, running in between, takes what is left
    reg.expire()
    with pytest.raises(StopIteration):
        next(steps)  # nothing released twice
    stats = reg.stats()
    assert stats.reserved_keys == 0 and sum(fenced) == 350
    accounting_adds_up(reg)


def test_a_small_call_on_a_large_table_copies_no_whole_column() -> None:
    """A call's work follows its own keys, not the table's size. The offset, length and
    generation columns are strided views of one array, and numpy's ``take`` on a strided
    view copies the whole column first: a 64-key reserve on a million keys took 3 ms, not
    0.6. Nor does expiry while no reservation can have lapsed, the end of a lease that
    reserved nothing, or ``stats`` look over every record (2, 1.6 and 1.9 ms at a million
    keys). Counted in bytes allocated (numpy reports to tracemalloc; a look over every
    record allocates a mask of a byte per row), not in time."""
    import tracemalloc

    from maru_core.index.memory_bench import _keys, filled_registry

    reg, lease = filled_registry(200_000, PAGE)  # columns of 280k rows: 2.2 MB each
    reg._records._index.finish()  # the fill's rebuild of the key table: its slices' work is not these calls'
    keys = _keys(10**7, 64)
    reader = reg.open_lease("reader")

    def verify(joined, offsets, generations):
        return np.ones(len(offsets), dtype=bool)

    def expire_with_a_store_in_flight():
        reg.reserve(lease, [(k, PAGE) for k in _keys(2 * 10**7, 64)])
        reg.expire()

    def close_a_reader_s_lease():
        reg.retrieve(reader, keys)
        reg.close_lease(reader)

    calls = {
        "reserve": lambda: reg.reserve(lease, [(k, PAGE) for k in keys]),
        "commit": lambda: reg.commit(lease, keys, verify=verify, record=lambda offsets: None),
        "retrieve": lambda: reg.retrieve(lease, keys),
        "unpin": lambda: reg.unpin(lease, keys),
        "committed_rows": lambda: reg.committed_rows(1000, 64),
        "expire": expire_with_a_store_in_flight,
        "close_lease": close_a_reader_s_lease,
        "stats": reg.stats,  # every stats request and metrics scrape
    }
    tracemalloc.start()
    try:
        for name, call in calls.items():
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            call()
            assert tracemalloc.get_traced_memory()[1] - before < 256 * 1024, name
    finally:
        tracemalloc.stop()
