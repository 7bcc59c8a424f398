"""Large retrieves and prefix matches looked up a slice per step
(``Registry.retrieve_sliced``, ``match_prefix_sliced``): the answer and the
pins are those of the whole call, and a key evicted between steps makes a
retrieve a miss with nothing pinned, never a pin on another key's object."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maru_core.index.records import State
from maru_core.index.registry import NoLease, Registry
from maru_core.index.registry_types import run_to_end
from test_registry import Clock, accounting_adds_up, geometry, key, store


def _twin_registries(stored: list[int]) -> tuple[tuple[Registry, str], tuple[Registry, str]]:
    out = []
    for _ in range(2):
        reg = Registry(geometry(400), clock=Clock())
        lease = reg.open_lease("w")
        if stored:
            store(reg, lease, [key(i) for i in stored])
        out.append((reg, reg.open_lease("r")))
    return out[0], out[1]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored=st.lists(st.integers(0, 60), unique=True, max_size=40),
       asked=st.lists(st.integers(0, 60), max_size=50),
       slice_keys=st.integers(1, 8))
def test_a_sliced_read_answers_and_pins_as_the_whole_one(stored, asked, slice_keys) -> None:
    (whole, w_lease), (sliced, s_lease) = _twin_registries(stored)
    keys = b"".join(key(i) for i in asked)
    assert run_to_end(sliced.match_prefix_sliced(keys, slice_keys)) == whole.match_prefix(keys)
    want = whole.retrieve(w_lease, keys)
    got = run_to_end(sliced.retrieve_sliced(s_lease, keys, slice_keys))
    assert bytes(got.to_wire()) == bytes(want.to_wire())
    assert np.array_equal(sliced._records.pins, whole._records.pins)
    assert np.array_equal(sliced._records.last_used, whole._records.last_used)  # made as recent, ahead or not
    # the pins are held the same way: the same unpin releases them all
    assert whole.unpin(w_lease, keys) == sliced.unpin(s_lease, keys)
    assert not sliced._records.pins.any()
    accounting_adds_up(sliced)


def _retrieve_evicting_after_its_first_slice(keys: list[bytes], slice_keys: int,
                                             stored_meanwhile: list[bytes]):
    """A sliced retrieve of stored ``keys`` with every unpinned object evicted
    after its first slice and ``stored_meanwhile`` stored into the freed rows;
    returns the registry, the reader's lease and the retrieve's answer."""
    reg = Registry(geometry(400), clock=Clock())
    writer, reader = reg.open_lease("w"), reg.open_lease("r")
    store(reg, writer, keys)
    steps = reg.retrieve_sliced(reader, b"".join(keys), slice_keys=slice_keys)
    next(steps)  # the first slice looked up
    reg._evict(10**6)
    store(reg, writer, stored_meanwhile)
    return reg, reader, run_to_end(steps)


def test_a_key_evicted_between_steps_makes_the_retrieve_a_miss_with_nothing_pinned() -> None:
    keys = [key(i) for i in range(30)]
    reg, _, locations = _retrieve_evicting_after_its_first_slice(
        keys, 10, [key(i) for i in range(100, 130)])  # other keys reuse the rows
    assert locations.misses() > 0
    assert not reg._records.pins.any()
    accounting_adds_up(reg)


def test_a_key_stored_again_between_steps_at_another_place_is_not_pinned_at_its_old_one() -> None:
    keys = [key(i) for i in range(20)]
    reg, reader, locations = _retrieve_evicting_after_its_first_slice(
        keys, 5, keys)  # the same keys again, in new records
    assert locations.misses() > 0  # a miss (the keys were gone meanwhile): nothing pinned
    assert not reg._records.pins.any()
    assert reg.retrieve(reader, b"".join(keys)).misses() == 0  # asked again, a hit
    assert reg._records.pins.sum() == len(keys)


def test_objects_stored_again_in_their_rows_after_the_locations_were_read_ahead_are_answered_where_they_are_now(
        ) -> None:
    """A large retrieve reads its locations a step before it pins. Objects evicted and
    stored again meanwhile, under the same keys in the same rows, are still a hit; the
    answer must be their new places and generations, not those read ahead."""
    keys = [key(i) for i in range(30)]
    joined = b"".join(keys)

    def fresh() -> tuple[Registry, str, str]:
        reg = Registry(geometry(400), clock=Clock())
        writer, reader = reg.open_lease("w"), reg.open_lease("r")
        store(reg, writer, keys)
        return reg, writer, reader

    reg, _, reader = fresh()
    before_the_pin = sum(1 for _ in reg.retrieve_sliced(reader, joined, slice_keys=10))  # its yields
    reg, writer, reader = fresh()
    rows_before = reg._records.lookup_in_state(joined, State.COMMITTED)[0].copy()
    steps = reg.retrieve_sliced(reader, joined, slice_keys=10)
    for _ in range(before_the_pin):
        next(steps)  # all but the step that pins
    reg._evict(10**6)
    store(reg, writer, list(reversed(keys)))  # new places, new generations
    assert np.array_equal(reg._records.lookup_in_state(joined, State.COMMITTED)[0], rows_before)  # the same rows
    answer = run_to_end(steps)
    assert answer.misses() == 0
    assert bytes(answer.to_wire()) == bytes(reg.retrieve(reg.open_lease("x"), joined).to_wire())
    accounting_adds_up(reg)


def _interleaved(*operations):
    """Run sliced operations a step each in turn until all are done; their results in order."""
    results: list = [None] * len(operations)
    running = dict(enumerate(operations))
    while running:
        for i, steps in list(running.items()):
            try:
                next(steps)
            except StopIteration as done:
                results[i] = done.value
                del running[i]
    return results


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(0, 39), min_size=1, max_size=30),
       second=st.lists(st.integers(0, 39), min_size=1, max_size=30),
       slice_keys=st.integers(1, 4), unpin_first=st.booleans())
def test_one_lease_s_retrieves_interleaved_step_by_step_pin_as_the_two_in_turn(
        first, second, slice_keys, unpin_first) -> None:
    """A large retrieve plans its pin among the lease's pins a slice per step; the
    lease's other calls may change those pins between the slices (a plan then gone
    stale is made again in the step that pins), and the pins end as if the two
    retrieves had run one after the other."""
    (whole, w_lease), (sliced, s_lease) = _twin_registries(list(range(40)))
    keys_1, keys_2 = (b"".join(key(i) for i in asked) for asked in (first, second))
    for reg, lease in ((whole, w_lease), (sliced, s_lease)):
        reg.retrieve(lease, keys_2)  # pins of the lease's own for the plans to be made among
    if unpin_first:
        whole.unpin(w_lease, keys_2)
    want = [whole.retrieve(w_lease, keys_1), whole.retrieve(w_lease, keys_2)]
    operations = [sliced.retrieve_sliced(s_lease, keys_1, slice_keys)]
    if unpin_first:
        operations.insert(0, sliced.unpin_sliced(s_lease, keys_2, slice_keys))
    got = _interleaved(*operations, sliced.retrieve_sliced(s_lease, keys_2, slice_keys))[-2:]
    assert [bytes(g.to_wire()) for g in got] == [bytes(w.to_wire()) for w in want]
    assert np.array_equal(sliced._records.pins, whole._records.pins)
    w_pins, s_pins = whole._lease(w_lease).pins, sliced._lease(s_lease).pins
    assert np.array_equal(s_pins.rows, w_pins.rows) and s_pins.total == w_pins.total
    accounting_adds_up(sliced)


# -- retrieve_prefix: the match and the pin of its whole groups in one call ------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored=st.lists(st.integers(0, 60), unique=True, max_size=40),
       asked=st.lists(st.integers(0, 60), max_size=50),
       group=st.integers(1, 5), slice_keys=st.integers(1, 8))
def test_retrieve_prefix_is_a_match_then_a_retrieve_of_the_whole_groups(stored, asked, group, slice_keys) -> None:
    (two, t_lease), (one, o_lease) = _twin_registries(stored)
    keys = b"".join(key(i) for i in asked)
    matched = two.match_prefix(keys)
    pinned = matched - matched % group
    want = two.retrieve(t_lease, keys[: 16 * pinned]) if pinned else None
    got_matched, got = run_to_end(one.retrieve_prefix_sliced(o_lease, keys, group, slice_keys))
    assert got_matched == matched
    assert (got is None) == (want is None)
    if want is not None:
        assert bytes(got.to_wire()) == bytes(want.to_wire()) and got.misses() == 0
    assert np.array_equal(one._records.pins, two._records.pins)
    assert one.retrieve_prefix(o_lease, keys, group)[0] == matched  # the whole call says the same
    prefix = keys[: 16 * pinned]
    assert one.unpin(o_lease, prefix) == one.unpin(o_lease, prefix) == pinned  # pinned twice, held alike
    assert not one._records.pins.any()
    accounting_adds_up(one)


def test_retrieve_prefix_pins_nothing_when_its_prefix_was_evicted_between_steps() -> None:
    reg = Registry(geometry(400), clock=Clock())
    writer, reader = reg.open_lease("w"), reg.open_lease("r")
    keys = [key(i) for i in range(30)]
    store(reg, writer, keys)
    steps = reg.retrieve_prefix_sliced(reader, b"".join(keys), group=5, slice_keys=10)
    next(steps)  # the first slice looked up
    reg._evict(10**6)
    store(reg, writer, [key(i) for i in range(100, 130)])  # other keys reuse the rows
    matched, locations = run_to_end(steps)
    assert matched >= 10 and locations is None
    assert not reg._records.pins.any()
    accounting_adds_up(reg)


def test_retrieve_prefix_needs_a_live_lease_and_a_positive_group() -> None:
    reg = Registry(geometry(400), clock=Clock())
    lease = reg.open_lease("r")
    with pytest.raises(ValueError, match="group"):
        reg.retrieve_prefix(lease, [key(1)], 0)
    with pytest.raises(NoLease):
        reg.retrieve_prefix("no-such-lease", [key(1)], 1)
