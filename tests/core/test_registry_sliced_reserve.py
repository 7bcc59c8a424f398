"""A large reserve done a slice per step (``Registry.reserve_sliced``): each
step adds a bounded number of records, the batch means what it means whole,
a key reserved by another lease between steps is never reserved twice, and
pages placed for records never added go back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import maru_core.index.registry_types as registry_types
from maru_core.index.registry import NoSpace, Registry
from maru_core.index.registry_types import first_occurrences, first_occurrences_sliced, run_to_end
from test_registry import PAGE, Clock, accounting_adds_up, geometry, key, store


def _batch(keys: list[bytes], lengths: list[int]) -> tuple[bytes, list[int]]:
    return b"".join(keys), lengths


def step_until(steps, done) -> None:
    """Run a sliced reserve step by step until ``done()``."""
    for _ in range(1000):
        if done():
            return
        next(steps)
    raise AssertionError("never reached")


def _slots_as_tuples(slots) -> list:
    return [None if slot is None else (slot.offset, slot.generation) for slot in slots]


def test_each_step_adds_at_most_a_slice_of_records_and_the_batch_stays_contiguous(monkeypatch) -> None:
    sorted_at_once = []
    first_among = registry_types._first_among
    monkeypatch.setattr(registry_types, "_first_among", lambda words: sorted_at_once.append(len(words)) or
                        first_among(words))  # fmt: skip
    reg = Registry(geometry(20_000), clock=Clock())
    lease = reg.open_lease("big")
    added = []
    add = reg._records.add
    reg._records.add = lambda keys: added.append(len(keys) // 16) or add(keys)
    keys = [key(i) for i in range(10_000)]
    steps = reg.reserve_sliced(lease, b"".join(keys), [PAGE] * len(keys), slice_keys=1000)
    slots = run_to_end(steps)
    assert added and max(added) <= 1000 and sum(added) == 10_000
    assert len(sorted_at_once) == 4 and max(sorted_at_once) <= 2 * 4000  # the repeat check: parts of ~2,500
    offsets = [slot.offset for slot in slots]
    assert offsets == [offsets[0] + i * PAGE for i in range(len(keys))]  # one placement: contiguous, in order
    accounting_adds_up(reg)


def test_the_key_table_is_rebuilt_once_for_a_batch_in_steps_before_its_slices(monkeypatch) -> None:
    """Each rebuild of the key table enters every key again: done at once, a long step of
    the index's loop. A batch of 10,000 records added 1,000 at a time into a fresh table
    rebuilt it among its slices; now once, for the whole batch, a slice per step before
    any record is added (the columns never grow: they hold a row per pool page)."""
    reg = Registry(geometry(20_000), clock=Clock())
    lease = reg.open_lease("big")
    index = reg._records._index
    index.slice_slots = 4096
    rebuilds, worked, worked_after_adding = [], [], []
    begin, advance = index.begin_rebuild, index._advance
    monkeypatch.setattr(index, "begin_rebuild", lambda rows, live: rebuilds.append(rows) or begin(rows, live))

    def advance_noting_adds(count):
        if index.rebuilding:
            (worked_after_adding if reg.stats().reserved_keys else worked).append(count)
        advance(count)

    monkeypatch.setattr(index, "_advance", advance_noting_adds)
    keys = [key(i) for i in range(10_000)]
    steps = reg.reserve_sliced(lease, b"".join(keys), [PAGE] * len(keys), slice_keys=1000)
    slots = run_to_end(steps)
    assert rebuilds == [10_000] and len(worked) > 1 and not worked_after_adding and not index.rebuilding
    assert reg.stats().reserved_keys == 10_000 and None not in slots
    assert (reg._records.lookup(b"".join(keys)) >= 0).all()
    accounting_adds_up(reg)


def test_a_key_reserved_by_another_lease_between_steps_is_not_reserved_twice() -> None:
    reg = Registry(geometry(1000), clock=Clock())
    big, other = reg.open_lease("big"), reg.open_lease("other")
    keys = [key(i) for i in range(600)]
    steps = reg.reserve_sliced(big, b"".join(keys), [PAGE] * len(keys), slice_keys=100)
    step_until(steps, lambda: reg.stats().reserved_bytes == 600 * PAGE)  # placed, no record added yet
    assert reg.stats().reserved_keys == 0
    theirs = reg.reserve(other, [(keys[450], PAGE)])[0]
    slots = run_to_end(steps)
    assert slots[450] is None and theirs is not None
    assert sum(slot is not None for slot in slots) == 599
    stats = reg.stats()
    assert stats.reserved_keys == 600 and stats.reserved_bytes == 600 * PAGE  # the unused page went back
    accounting_adds_up(reg)


def test_a_reserve_abandoned_midway_gives_back_the_pages_it_placed() -> None:
    reg = Registry(geometry(1000), clock=Clock())
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(600)]
    steps = reg.reserve_sliced(lease, b"".join(keys), [PAGE] * len(keys), slice_keys=100)
    step_until(steps, lambda: reg.stats().reserved_keys == 200)  # two slices of records added
    steps.close()  # the connection went away
    stats = reg.stats()
    assert stats.reserved_keys == 200 and stats.reserved_bytes == 200 * PAGE
    assert stats.free_bytes == 800 * PAGE
    accounting_adds_up(reg)


def test_nothing_placeable_is_no_space_as_whole() -> None:
    reg = Registry(geometry(10), high_watermark=1.0, low_watermark=1.0, clock=Clock())
    lease = reg.open_lease("a")
    held = store(reg, lease, [key(i) for i in range(10)])
    assert len(held) == 10
    reg.retrieve(lease, [key(i) for i in range(10)])  # pinned: nothing can be evicted
    keys = b"".join(key(100 + i) for i in range(50))
    with pytest.raises(NoSpace):
        run_to_end(reg.reserve_sliced(lease, keys, [PAGE] * 50, slice_keys=8))
    accounting_adds_up(reg)


@settings(max_examples=200, deadline=None)
@given(
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=300),
    slice_keys=st.integers(1, 64),
)
def test_repeats_found_part_by_part_are_those_of_the_whole_batch(picks, slice_keys) -> None:
    """Keys sharing a first word (as a batch built to collide would) included."""
    joined = b"".join(a.to_bytes(8, "little") + b.to_bytes(8, "little") for a, b in picks)
    sliced = run_to_end(first_occurrences_sliced(joined, slice_keys))
    assert sliced.tolist() == first_occurrences(joined).tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    picks=st.lists(st.integers(0, 60), min_size=1, max_size=120),  # repeats likely
    present=st.sets(st.integers(0, 60), max_size=20),
    pages=st.lists(st.integers(1, 4), min_size=120, max_size=120),
    slice_keys=st.integers(1, 50),
    pool_pages=st.integers(40, 400),
)
def test_sliced_and_whole_reserves_give_the_same_slots(picks, present, pages, slice_keys, pool_pages) -> None:
    """With nothing in between, the slices mean exactly the whole batch: same
    slots (offsets and generations), same misses, same evictions."""
    registries = [Registry(geometry(pool_pages), clock=Clock()) for _ in range(2)]
    results = []
    for i, reg in enumerate(registries):
        lease = reg.open_lease("a")
        for j in sorted(present):
            if reg.reserve(lease, [(key(j), PAGE)])[0] is not None:
                reg.commit(lease, [key(j)])
        keys = b"".join(key(p) for p in picks)
        lengths = [pages[n] * PAGE - 7 for n in range(len(picks))]
        try:
            if i == 0:
                slots = reg.reserve_packed(lease, keys, lengths)
            else:
                slots = run_to_end(reg.reserve_sliced(lease, keys, lengths, slice_keys))
            results.append(("slots", _slots_as_tuples(slots)))
        except NoSpace:
            results.append(("no_space", None))
        accounting_adds_up(reg)
    assert results[0] == results[1]
    assert registries[0].stats() == registries[1].stats()
