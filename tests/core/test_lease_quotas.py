"""What one lease may pin and evict, in the registry: pins counted once per
object and lease (memory set by distinct objects, never by repetition), the
pin quota, the window on a lease's evictions, and an abandoned ``bye``."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_core.index.leases import LeasePins, SortedBatch
from maru_core.index.registry import NoSpace, Registry
from maru_core.index.registry_types import QuotaExceeded
from test_registry import PAGE, Clock, accounting_adds_up, geometry, key, store


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(clock: Clock) -> Registry:
    return Registry(geometry(100), lease_ttl_s=10, reservation_ttl_s=30, clock=clock)


def _traced_growth(action) -> int:
    """Bytes still allocated after ``action()`` that were not before (tracemalloc)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        action()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_pinning_the_same_objects_again_takes_no_memory(clock: Clock = Clock()) -> None:
    """Before, every occurrence of a pin was kept: 1,500 retrieves of 131,072
    keys grew the index by 1.55 GB. Now a second pin of an object by the same
    lease adds to its count: 2,000 keys pinned 300 times more cost nothing."""
    reg = Registry(geometry(4000), clock=clock)
    lease = reg.open_lease("a")
    keys = b"".join(key(i) for i in range(2000))
    store(reg, lease, [keys[i : i + 16] for i in range(0, len(keys), 16)])
    reg.retrieve(lease, keys)

    def pin_again() -> None:
        for _ in range(300):
            reg.retrieve(lease, keys)

    assert _traced_growth(pin_again) < 64 * 1024  # 300 x 2,000 pins kept one by one: 4.8 MB
    assert reg.describe(key(7)).pins == 301 and reg.stats().pinned_keys == 2000
    assert reg.unpin(lease, keys) == 2000  # one per occurrence: 300 left on each
    assert reg.describe(key(7)).pins == 300


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 24), max_size=12), max_size=10))
def test_a_lease_s_pins_count_every_occurrence_of_each_retrieve_as_a_counter_does(batches) -> None:
    """Pins added batch by batch (new objects, objects pinned again, a run of the pins or
    scattered among them, repeated in a batch) hold what a ``Counter`` of the rows holds."""
    pins, model = LeasePins(), Counter()
    for rows in batches:
        pins.add(pins.plan(SortedBatch(np.array(rows, dtype=np.int64))),
                 b"".join(row.to_bytes(16, "little") for row in rows))  # fmt: skip
        model.update(rows)
        assert pins.rows.tolist() == sorted(model)
        assert [pins.count_of(row) for row in sorted(model)] == [model[row] for row in sorted(model)]
        assert pins.total == sum(model.values())


def test_a_lease_that_pins_the_same_objects_under_ever_new_batches_cannot_grow_what_it_remembers(
    clock: Clock = Clock(),
) -> None:
    """The keys of earlier retrieves, remembered for a cheap unpin of the same
    batch, are bounded by the distinct objects pinned: rotating the batch's
    order makes every batch new, yet the memory stays flat."""
    reg = Registry(geometry(4000), clock=clock)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(1000)]
    store(reg, lease, keys)
    reg.retrieve(lease, keys)

    def rotations() -> None:
        for shift in range(1, 200):
            reg.retrieve(lease, b"".join(keys[shift:] + keys[:shift]))

    assert _traced_growth(rotations) < 256 * 1024  # each batch remembered: 199 x 24 KB = 4.8 MB


def test_pins_are_counts_per_lease_so_overlapping_loads_of_one_lease_keep_theirs(reg: Registry) -> None:
    """Two loads of one lease pin a shared prefix; the first to finish unpins
    its keys and the other's pins stay (as ``maru_connector.held_pins`` relies on)."""
    lease = reg.open_lease("engine")
    prefix, first_tail, second_tail = [key(i) for i in range(4)], [key(10)], [key(20)]
    store(reg, lease, prefix + first_tail + second_tail)
    reg.retrieve(lease, prefix + first_tail)
    reg.retrieve(lease, prefix + second_tail)
    assert reg.unpin(lease, prefix + first_tail) == 5
    assert all(reg.describe(k).pins == 1 for k in prefix + second_tail)
    assert reg.describe(first_tail[0]).pins == 0
    assert reg.unpin(lease, prefix + second_tail) == 5
    assert reg.stats().pinned_keys == 0
    assert reg._leases[lease].pins.pages == 0  # what the quota counts comes back too


def test_the_pin_quota_refuses_a_retrieve_past_it_and_pins_nothing_of_it(clock: Clock = Clock()) -> None:
    reg = Registry(geometry(100), clock=clock, max_lease_pin_fraction=0.3)
    told = []
    reg.quota_listener = lambda *what: told.append(what)
    hog, honest = reg.open_lease("hog"), reg.open_lease("honest")
    keys = [key(i) for i in range(60)]
    store(reg, hog, keys)
    reg.retrieve(hog, keys[:30])
    for _ in range(5):
        reg.retrieve(hog, keys[:30])  # the same objects again: nothing more counted
    with pytest.raises(QuotaExceeded, match="--max-lease-pin-fraction") as refused:
        reg.retrieve(hog, keys[25:35])
    assert refused.value.error_type == "quota" and refused.value.quota == "pins"
    assert reg.describe(keys[32]).pins == 0  # all or nothing
    assert told == [("pins", "hog", str(refused.value))]
    reg.retrieve(honest, keys[30:60])  # its own quota
    assert reg.unpin(hog, keys[:10]) == 10
    assert reg.unpin(hog, keys[:10]) == 10  # still pinned 4 times more: still counted
    reg.unpin(hog, b"".join(keys[:10]) * 4)
    reg.retrieve(hog, keys[30:40])  # ten objects released: room for ten
    accounting_adds_up(reg)


def test_a_bye_abandoned_midway_releases_every_pin_at_once(monkeypatch, clock: Clock = Clock()) -> None:
    """The connection of a ``bye`` may go while its pins are released a chunk per
    step; the lease is gone by then. Before, the pins left were never released:
    their objects could never be evicted again."""
    import maru_core.index.leases as leases

    monkeypatch.setattr(leases, "PIN_CHUNK_ROWS", 10)
    reg = Registry(geometry(100), clock=clock)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(50)]
    store(reg, lease, keys)
    reg.retrieve(lease, keys)
    steps = reg.close_lease_sliced(lease)
    next(steps)
    steps.close()  # the server drops the job of a connection that went away
    assert reg.stats().pinned_keys == 0
    assert (reg._records.pins == 0).all()


def test_an_honest_writer_under_steady_churn_never_meets_the_eviction_window(clock: Clock) -> None:
    """A writer whose stores turn a full pool over every 50 s (a tenth of it
    every 5 s) is never cut short by the default window (a quarter per 10 s)."""
    reg = Registry(geometry(1000), clock=clock, max_lease_evict_fraction=0.25, evict_window_s=10.0)
    told = []
    reg.quota_listener = lambda *what: told.append(what)
    lease = reg.open_lease("writer")
    store(reg, lease, [key(i) for i in range(940)])
    for step in range(60):
        clock.now += 5
        batch = [key(10_000 + 100 * step + i) for i in range(100)]
        store(reg, lease, batch)
    assert told == [] and reg.stats().evictions >= 5000


def test_reserves_past_the_eviction_window_are_cut_short_then_refused_and_it_refills(clock: Clock) -> None:
    """Four reserves in a row used to evict the whole pool (a quarter each).
    Now a lease's reserves evict at most its window's share; the rest of the
    others' objects stay, and the lease is told by name."""
    reg = Registry(geometry(100), clock=clock, lease_ttl_s=120, max_evict_fraction=0.25,
                   max_lease_evict_fraction=0.25, evict_window_s=60.0)  # fmt: skip
    told = []
    reg.quota_listener = lambda *what: told.append(what)
    honest, wiper = reg.open_lease("honest"), reg.open_lease("wiper")
    theirs = [key(i) for i in range(94)]
    store(reg, honest, theirs)
    first = reg.reserve(wiper, [(key(1000 + i), PAGE) for i in range(40)])
    assert 0 < sum(slot is not None for slot in first) < 40  # one reserve's bound, as before
    assert told == []
    for attempt in range(3):
        with pytest.raises(QuotaExceeded, match="--max-lease-evict-fraction per --evict-window") as refused:
            reg.reserve(wiper, [(key(2000 + 100 * attempt + i), PAGE) for i in range(40)])
        assert refused.value.quota == "evictions"
    assert [quota for quota, _, _ in told] == ["evictions"] * 3
    assert reg.stats().evictions <= 25 + 1  # its window's share (the last object may overshoot)
    assert sum(reg.describe(k) is not None for k in theirs) >= 94 - 26
    clock.now += 61  # the window has passed: it may evict again
    assert any(slot is not None for slot in reg.reserve(wiper, [(key(3000 + i), PAGE) for i in range(10)]))
    accounting_adds_up(reg)


def test_a_full_pool_with_nothing_to_evict_is_still_no_space_not_quota(clock: Clock) -> None:
    reg = Registry(geometry(100), clock=clock, max_lease_evict_fraction=0.1, evict_window_s=60.0)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(100)]
    store(reg, lease, keys)
    reg.retrieve(lease, keys)  # everything pinned
    with pytest.raises(NoSpace):
        reg.reserve(lease, [(key(500), PAGE)])


def test_the_window_never_forgets_evictions_early_however_often_they_come(clock: Clock) -> None:
    from maru_core.index.quotas import EvictionWindow

    window = EvictionWindow()
    for i in range(10_000):  # an eviction every millisecond for 10 s
        window.add(1, clock.now + i / 1000, 10.0)
    now = clock.now + 9.999
    assert window.pages(now, 10.0) == 10_000  # nothing within the last 10 s forgotten
    assert len(window._entries) <= 70  # a bounded number of entries
    assert window.pages(now + 10.2, 10.0) == 0


def test_a_pin_planned_ahead_is_planned_again_when_the_lease_pinned_meanwhile(clock: Clock) -> None:
    """A large retrieve plans its pin in steps ahead of it; another connection of
    the same lease may pin other objects in between: the plan is made again."""
    reg = Registry(geometry(200), clock=clock)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(100)]
    store(reg, lease, keys)
    steps = reg.retrieve_sliced(lease, b"".join(keys[:60]), 10)
    others = iter(keys[60:])
    try:
        while True:
            next(steps)
            reg.retrieve(lease, [next(others)])  # a new object pinned between every two steps
    except StopIteration as done:
        assert done.value.misses() == 0
    pinned_meanwhile = 100 - 60 - len(list(others))
    assert [reg.describe(k).pins for k in keys[: 60 + pinned_meanwhile]] == [1] * (60 + pinned_meanwhile)
    assert reg.unpin(lease, keys) == 60 + pinned_meanwhile
    assert reg.stats().pinned_keys == 0 and reg._leases[lease].pins.pages == 0
