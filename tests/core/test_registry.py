"""The registry: leases, write-once commits, pins, eviction, restore, and a model-checked state machine."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from maru_core.index.memory_bench import bytes_per_key, growth_steps
from maru_core.pool.slot_check import SlotHeaderCheck
from maru_core.index.registry import BadRequest, NoLease, NoSpace, Quarantined, Registry, RegistryError
from maru_core.pool import Pool, SlotHeader, SlotState
from maru_core.pool.commit_records import CommitRecords
from maru_core.pool.geometry import DATA_ALIGN, PoolGeometry
from maru_core.protocol.locations import Location, Slot

PAGE = 4096


def geometry(pages: int) -> PoolGeometry:
    data_offset = -(-(4096 + 64 * pages) // DATA_ALIGN) * DATA_ALIGN
    g = PoolGeometry.plan(data_offset + pages * PAGE, PAGE)
    assert g.num_pages == pages
    return g


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reg(clock: Clock) -> Registry:
    return Registry(geometry(100), lease_ttl_s=10, reservation_ttl_s=30, clock=clock)


def store(reg: Registry, lease: str, keys: list[bytes], length: int = PAGE) -> list[Slot]:
    slots = list(reg.reserve(lease, [(k, length) for k in keys]))
    assert None not in slots
    assert reg.commit(lease, keys) == [True] * len(keys)
    return slots


def accounting_adds_up(reg: Registry) -> None:
    s = reg.stats()
    assert s.free_bytes + s.reserved_bytes + s.committed_bytes == s.capacity_bytes
    assert s.pinned_bytes <= s.committed_bytes


# -- leases ---------------------------------------------------------------------------------------


def test_leases_open_resume_renew_and_close(reg: Registry, clock: Clock) -> None:
    lease = reg.open_lease("a")
    assert reg.open_lease("a", lease) == lease
    clock.now += 8
    reg.renew(lease)
    clock.now += 8  # 16 s after opening, 8 after the renewal: still live
    reg.renew(lease)
    assert reg.stats().leases == 1
    assert reg.close_lease(lease) and not reg.close_lease(lease)
    with pytest.raises(NoLease, match="hello"):
        reg.renew(lease)
    assert reg.open_lease("a", lease) != lease  # a closed lease is not resumed


def test_a_lapsed_lease_releases_its_pins_and_reservations(reg: Registry, clock: Clock) -> None:
    reader, writer = reg.open_lease("reader"), reg.open_lease("writer")
    store(reg, writer, [key(1), key(2)])
    assert None not in reg.retrieve(reader, [key(1), key(2)])
    reg.reserve(reader, [(key(3), PAGE)])
    assert reg.stats().pinned_keys == 2 and reg.stats().reserved_keys == 1
    clock.now += 9
    reg.renew(writer)
    clock.now += 2  # reader lapsed, writer not
    report = reg.expire()
    assert report.pins_released == 2 and report.reservations_released == 1
    assert len(report.lapsed_leases) == 1
    s = reg.stats()
    assert (s.pinned_keys, s.reserved_keys, s.leases, s.keys) == (0, 0, 1, 2)
    with pytest.raises(NoLease):
        reg.retrieve(reader, [key(1)])
    accounting_adds_up(reg)


def test_a_lapsed_lease_is_refused_even_before_expire_runs(reg: Registry, clock: Clock) -> None:
    lease = reg.open_lease("a")
    reg.reserve(lease, [(key(1), PAGE)])
    clock.now += 11
    with pytest.raises(NoLease):
        reg.commit(lease, [key(1)])
    assert reg.stats().reserved_keys == 0  # released on the spot
    assert reg.describe(key(1)) is None


# -- write path -----------------------------------------------------------------------------------


def test_store_then_load(reg: Registry) -> None:
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(5)]
    slots = store(reg, lease, keys, length=PAGE + 1)
    locations = reg.retrieve(lease, keys)
    assert list(locations) == [Location(s.offset, PAGE + 1, s.generation) for s in slots]
    assert reg.match_prefix(keys + [key(99)]) == 5
    assert reg.unpin(lease, keys) == 5
    assert reg.stats().pinned_keys == 0


def test_a_batch_is_placed_contiguously_in_order(reg: Registry) -> None:
    lease = reg.open_lease("a")
    lengths = [PAGE, 3 * PAGE, 1, 2 * PAGE + 5]
    slots = list(reg.reserve(lease, [(key(i), n) for i, n in enumerate(lengths)]))
    pages = [-(-n // PAGE) for n in lengths]
    for i in range(1, len(slots)):
        assert slots[i].offset == slots[i - 1].offset + pages[i - 1] * PAGE
    assert [s.generation for s in slots] == sorted({s.generation for s in slots})


def test_generations_only_grow(reg: Registry) -> None:
    lease = reg.open_lease("a")
    first = store(reg, lease, [key(1)])[0]
    reg.reserve(lease, [(key(2), PAGE)])
    reg.abort(lease, [key(2)])
    second = reg.reserve(lease, [(key(2), PAGE)])[0]
    assert second.generation > first.generation + 1


def test_uncommitted_keys_are_invisible(reg: Registry) -> None:
    lease = reg.open_lease("a")
    reg.reserve(lease, [(key(1), PAGE)])
    assert reg.match_prefix([key(1)]) == 0
    assert list(reg.retrieve(lease, [key(1)])) == [None]


def test_reserve_refuses_known_and_repeated_keys(reg: Registry) -> None:
    a, b = reg.open_lease("a"), reg.open_lease("b")
    store(reg, a, [key(1)])
    reg.reserve(a, [(key(2), PAGE)])
    slots = list(reg.reserve(b, [(key(1), PAGE), (key(2), PAGE), (key(3), PAGE), (key(3), PAGE)]))
    assert slots[0] is None and slots[1] is None and slots[3] is None
    assert slots[2] is not None


@pytest.mark.parametrize(
    "items, message",
    [
        ([(b"short", 10)], "16 bytes"),
        ([(key(1), 0)], "positive"),
        ([(key(1), 2.5)], "int"),
        ([(key(1),)], "pairs"),
    ],
)
def test_reserve_refuses_bad_items(reg: Registry, items: list, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        reg.reserve(reg.open_lease("a"), items)


def test_bad_keys_are_a_bad_request(reg: Registry) -> None:
    with pytest.raises(BadRequest):
        reg.retrieve(reg.open_lease("a"), [b"short"])
    with pytest.raises(BadRequest):
        reg.match_prefix([12])


def test_commit_is_write_once(reg: Registry) -> None:
    lease = reg.open_lease("a")
    slot = store(reg, lease, [key(1)])[0]
    assert reg.commit(lease, [key(1)]) == [False]
    assert reg.describe(key(1)).generation == slot.generation
    assert reg.stats().keys == 1
    accounting_adds_up(reg)


def test_only_the_reserving_lease_commits(reg: Registry) -> None:
    a, b = reg.open_lease("a"), reg.open_lease("b")
    reg.reserve(a, [(key(1), PAGE)])
    assert reg.commit(b, [key(1)]) == [False]
    assert reg.abort(b, [key(1)]) == 0
    assert reg.commit(a, [key(1), key(1)]) == [True, False]


def test_a_failed_verify_releases_the_slot(reg: Registry) -> None:
    lease = reg.open_lease("a")
    reg.reserve(lease, [(key(1), PAGE), (key(2), PAGE)])
    slots = {k: reg.describe(k) for k in (key(1), key(2))}
    seen = []

    def verify(keys: bytes, offsets: np.ndarray, generations: np.ndarray) -> list[bool]:
        seen.append((keys, offsets.tolist(), generations.tolist()))
        return [keys[i : i + 16] == key(1) for i in range(0, len(keys), 16)]

    assert reg.commit(lease, [key(1), key(2)], verify=verify) == [True, False]
    assert seen == [
        (key(1) + key(2), [slots[k].offset for k in (key(1), key(2))], [slots[k].generation for k in (key(1), key(2))])
    ]
    assert reg.describe(key(2)) is None
    assert reg.stats().reserved_keys == 0
    assert reg.reserve(lease, [(key(2), PAGE)])[0] is not None  # free to store again
    accounting_adds_up(reg)


def test_a_commit_records_exactly_the_keys_it_commits_before_they_are_visible(reg: Registry) -> None:
    """``record`` (the server marks those heads committed: what a restart restores) gets
    the offsets of the keys this call commits, and of no other; while it runs they are
    still invisible, and if it fails none of them becomes visible."""
    a, b = reg.open_lease("a"), reg.open_lease("b")
    reg.reserve(a, [(key(i), PAGE) for i in range(4)])
    reg.reserve(b, [(key(9), PAGE)])
    offsets = {k: reg.describe(k).offset for k in (key(0), key(1), key(2), key(3), key(9))}
    recorded = []

    def record(at: np.ndarray) -> None:
        assert all(reg.describe(k).state == "reserved" for k in (key(0), key(2)))
        recorded.append(at.tolist())

    def verify(keys: bytes, at: np.ndarray, generations: np.ndarray) -> list[bool]:
        return [keys[i : i + 16] != key(1) for i in range(0, len(keys), 16)]

    # key(1): its header fails the check; key(9): another lease's; key(3): not in this commit.
    assert reg.commit(a, [key(0), key(1), key(9), key(2), key(0)], verify=verify, record=record) == [
        True, False, False, True, False]  # fmt: skip
    assert recorded == [[offsets[key(0)], offsets[key(2)]]]
    assert reg.commit(a, [key(1), key(9)], record=record) == [False, False]
    assert len(recorded) == 1  # nothing committed: nothing recorded

    def failing(at: np.ndarray) -> None:
        raise OSError("the pool went away")

    with pytest.raises(OSError):
        reg.commit(a, [key(3)], record=failing)
    assert reg.describe(key(3)).state == "reserved" and reg.stats().keys == 2
    accounting_adds_up(reg)


def test_abort_releases_reservations(reg: Registry) -> None:
    lease = reg.open_lease("a")
    reg.reserve(lease, [(key(i), PAGE) for i in range(4)])
    assert reg.abort(lease, [key(0), key(1), key(1), key(9)]) == 2
    assert reg.stats().reserved_keys == 2
    accounting_adds_up(reg)


def test_stale_reservations_expire(reg: Registry, clock: Clock) -> None:
    lease = reg.open_lease("a")
    reg.reserve(lease, [(key(1), PAGE)])
    for _ in range(4):  # keep the lease alive past the reservation timeout
        clock.now += 8
        reg.renew(lease)
    assert reg.expire().reservations_released == 1
    assert reg.commit(lease, [key(1)]) == [False]


def test_keys_may_come_packed_as_on_the_wire(reg: Registry) -> None:
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(6)]
    packed = b"".join(keys)
    reg.reserve(lease, [(k, PAGE) for k in keys])
    assert reg.abort(lease, memoryview(packed)[80:]) == 1
    assert reg.commit(lease, packed[:80]) == [True] * 5
    assert reg.match_prefix(packed) == 5
    assert list(reg.retrieve(lease, packed[:80])) == list(reg.retrieve(lease, keys[:5]))
    assert reg.unpin(lease, bytearray(packed[:80])) == 5
    assert reg.unpin(lease, keys[:5]) == 5
    with pytest.raises(BadRequest, match="multiple of 16"):
        reg.retrieve(lease, packed[:20])


def test_empty_batches(reg: Registry) -> None:
    lease = reg.open_lease("a")
    assert reg.match_prefix([]) == 0 and reg.match_prefix(b"") == 0
    assert list(reg.retrieve(lease, [])) == [] and list(reg.reserve(lease, [])) == []
    assert reg.commit(lease, []) == [] and reg.abort(lease, []) == 0 and reg.unpin(lease, []) == 0


# -- read path ------------------------------------------------------------------------------------


def test_retrieve_is_all_or_nothing(reg: Registry) -> None:
    lease = reg.open_lease("a")
    store(reg, lease, [key(1), key(3)])
    locations = reg.retrieve(lease, [key(1), key(2), key(3)])
    assert len(locations) == 3 and locations[1] is None
    assert reg.stats().pinned_keys == 0
    assert reg.unpin(lease, [key(1), key(3)]) == 0


def test_pins_count_per_occurrence_and_per_lease(reg: Registry) -> None:
    a, b = reg.open_lease("a"), reg.open_lease("b")
    store(reg, a, [key(1), key(2)])
    reg.retrieve(a, [key(1), key(1), key(2)])
    reg.retrieve(b, [key(1)])
    assert reg.describe(key(1)).pins == 3
    assert reg.unpin(b, [key(1), key(1)]) == 1  # b held one
    assert reg.unpin(a, [key(1)]) == 1
    assert reg.describe(key(1)).pins == 1
    assert reg.unpin(a, [key(1), key(2), key(2)]) == 2
    assert reg.stats().pinned_keys == 0


def test_unpin_of_a_whole_retrieve_and_of_pieces(reg: Registry) -> None:
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(20)]
    store(reg, lease, keys)
    reg.retrieve(lease, keys)
    reg.retrieve(lease, keys[:10])
    assert reg.unpin(lease, keys[:10]) == 10
    assert reg.unpin(lease, keys[5:]) == 15
    assert reg.unpin(lease, keys) == 5
    assert reg.stats().pinned_keys == 0


# -- eviction -------------------------------------------------------------------------------------


def fill(reg: Registry, lease: str, first: int, count: int) -> list[bytes]:
    keys = [key(i) for i in range(first, first + count)]
    for k in keys:  # one by one: each its own LRU tick, oldest first
        store(reg, lease, [k])
    return keys


def test_eviction_starts_above_high_and_goes_down_to_low(clock: Clock) -> None:
    reg = Registry(geometry(100), high_watermark=0.9, low_watermark=0.6, clock=clock, max_evict_fraction=1.0)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 90)
    assert reg.stats().evictions == 0
    store(reg, lease, [key(1000)])  # 91 pages would be above 90: evict down to 60 including it
    s = reg.stats()
    assert s.evictions == 31 and s.keys == 60
    # the least recently used went first
    assert all(reg.describe(k) is None for k in keys[:31])
    assert all(reg.describe(k) is not None for k in keys[31:])


def test_lru_spares_what_was_read_recently_and_a_prefix_head(clock: Clock) -> None:
    reg = Registry(geometry(10), high_watermark=1.0, low_watermark=1.0, clock=clock)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(10)]
    store(reg, lease, keys)  # one batch: a prefix
    reg.retrieve(lease, [keys[0], keys[1]])
    reg.unpin(lease, [keys[0], keys[1]])
    store(reg, lease, [key(100), key(101)])
    # within the batch, the tail (latest chunks) goes first; the recently read stays
    assert reg.describe(keys[9]) is None and reg.describe(keys[8]) is None
    assert reg.describe(keys[0]) is not None and reg.describe(keys[2]) is not None


def test_pinned_objects_are_never_evicted(clock: Clock) -> None:
    reg = Registry(geometry(10), high_watermark=0.5, low_watermark=0.2, clock=clock)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 5)
    reg.retrieve(lease, keys)
    with pytest.raises(NoSpace, match="pinned or reserved"):
        reg.reserve(lease, [(key(50), 6 * PAGE)])
    assert all(reg.describe(k).pins == 1 for k in keys)
    assert reg.reserve(lease, [(key(50), 5 * PAGE)])[0] is not None
    accounting_adds_up(reg)


def test_fragmented_space_is_defragmented_by_eviction(clock: Clock) -> None:
    reg = Registry(geometry(10), high_watermark=1.0, low_watermark=1.0, clock=clock, max_evict_fraction=1.0)
    lease = reg.open_lease("a")
    keys = fill(reg, lease, 0, 10)  # page i holds key i; LRU: 0 oldest
    even = keys[0::2]
    reg.retrieve(lease, even)
    reg.unpin(lease, even)  # the even pages are now recent: LRU order 1, 3, 5, 7, 9, then 8, 6, ...
    slot = reg.reserve(lease, [(key(50), 3 * PAGE)])[0]
    # Evicting 1, 3, 5 frees three pages but no run of three; evicting on
    # (7, 9, then the least recent even one, 8) opens pages 7-9.
    assert slot.offset == reg.geometry.page_offset(7)
    gone = {i for i in range(10) if reg.describe(keys[i]) is None}
    assert gone == {1, 3, 5, 7, 8, 9}
    assert reg.stats().evictions == 6
    accounting_adds_up(reg)


def test_a_partial_reserve_places_what_fits(clock: Clock) -> None:
    reg = Registry(geometry(10), clock=clock)
    lease = reg.open_lease("a")
    store(reg, lease, [key(0)], length=3 * PAGE)
    reg.retrieve(lease, [key(0)])  # pinned: 7 pages left
    slots = list(reg.reserve(lease, [(key(1), 4 * PAGE), (key(2), 20 * PAGE), (key(3), 4 * PAGE), (key(4), 3 * PAGE)]))
    assert [s is not None for s in slots] == [True, False, False, True]
    assert reg.stats().evictions == 0  # the object that can never fit evicted nothing
    with pytest.raises(NoSpace, match="larger than the pool"):
        reg.reserve(lease, [(key(5), 11 * PAGE)])


# -- restore --------------------------------------------------------------------------------------


def test_restore_rebuilds_and_quarantines(clock: Clock) -> None:
    g = geometry(100)
    old = Registry(g, clock=clock)
    lease = old.open_lease("a")
    keys = [key(i) for i in range(10)]
    slots = store(old, lease, keys, length=2 * PAGE)
    objects = [(k, Location(s.offset, 2 * PAGE, s.generation)) for k, s in zip(keys, slots)]

    new = Registry(g, lease_ttl_s=10, clock=clock)
    assert new.restore(objects) == 10
    lease = new.open_lease("b")
    assert list(new.retrieve(lease, keys)) == [loc for _, loc in objects]
    assert new.stats().quarantined
    with pytest.raises(Quarantined, match="restarted") as refused:
        new.reserve(lease, [(key(50), PAGE)])
    assert refused.value.error_type == "quarantined" and isinstance(refused.value, NoSpace)
    clock.now += 6
    new.renew(lease)
    assert new.stats().quarantined
    clock.now += 4  # one lease period after the restore
    slot = new.reserve(lease, [(key(50), PAGE)])[0]
    assert slot.generation > max(s.generation for s in slots)
    assert not new.stats().quarantined
    accounting_adds_up(new)
    with pytest.raises(RegistryError, match="empty"):
        new.restore(objects)


def test_restore_from_a_real_pool_after_a_restart(clock: Clock) -> None:
    """Writers store through the pool; a new registry rebuilds from its slot headers."""
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    try:
        with Pool.create(path, 8 * 1024 * 1024, page_size=PAGE) as pool:
            old = Registry(pool.geometry, clock=clock)
            lease = old.open_lease("writer")
            keys = [key(i) for i in range(8)]
            lengths = [PAGE * (1 + i % 3) - 7 for i in range(8)]
            slots = list(old.reserve(lease, list(zip(keys, lengths))))
            for k, n, slot in zip(keys, lengths, slots):
                pool.invalidate_slot(slot.offset, n)
                pool.view(slot.offset, n)[:] = k * (n // 16) + k[: n % 16]
                pool.write_slot_header(slot.offset, SlotHeader(k, slot.generation, n))
            verify = SlotHeaderCheck(pool, SlotState.PENDING)
            assert old.commit(lease, keys[:6], verify=verify, record=CommitRecords(pool)) == [True] * 6
            # keys 6 and 7: written, never committed (the writer died): their headers stay pending
        with Pool.attach(path) as pool:
            new = Registry(pool.geometry, clock=clock)
            restored = new.restore((h.key, Location(off, h.length, h.generation)) for off, h in pool.iter_slot_headers())
            assert restored == 6
            reader = new.open_lease("reader")
            found = new.retrieve(reader, keys)
            assert found.misses() == 2 and found[6] is None and found[7] is None
            for k, n, loc in zip(keys[:6], lengths, found):
                assert loc.length == n and bytes(pool.view(loc.offset, 16)) == k
    finally:
        os.unlink(path)


def test_restore_keeps_the_newest_of_overlaps_and_skips_nonsense(clock: Clock) -> None:
    g = geometry(100)
    reg = Registry(g, clock=clock)
    at = g.page_offset
    objects = [
        (key(1), Location(at(0), 4 * PAGE, 5)),
        (key(2), Location(at(2), 2 * PAGE, 9)),  # overlaps key(1), newer: wins
        (key(3), Location(at(10), PAGE, 3)),
        (key(3), Location(at(20), PAGE, 4)),  # same key, newer: wins
        (key(4), Location(at(30) + 1, PAGE, 6)),  # not a page start
        (key(5), Location(at(99), 2 * PAGE, 7)),  # runs past the end
        (b"short", Location(at(40), PAGE, 8)),
    ]
    assert reg.restore(objects) == 2
    assert reg.describe(key(1)) is None
    assert reg.describe(key(2)).offset == at(2)
    assert reg.describe(key(3)).offset == at(20)
    assert reg.stats().committed_bytes == 3 * PAGE
    accounting_adds_up(reg)


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        Registry(geometry(10), high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ValueError, match="positive"):
        Registry(geometry(10), lease_ttl_s=0)


# -- scale ----------------------------------------------------------------------------------------


def test_many_keys_with_removals_stay_findable(clock: Clock) -> None:
    """The key table through growth, eviction, aborts (tombstones) and rebuilds."""
    reg = Registry(geometry(40_000), high_watermark=1.0, low_watermark=1.0, clock=clock)
    lease = reg.open_lease("a")
    keys = [key(i) for i in range(30_000)]
    for start in range(0, 30_000, 5000):
        store(reg, lease, keys[start : start + 5000])
    pinned = keys[1::3]
    assert reg.retrieve(lease, pinned).misses() == 0
    newcomers = [key(10**6 + i) for i in range(20_000)]
    assert reg.reserve(lease, [(k, PAGE) for k in newcomers]).misses() == 0
    s = reg.stats()
    assert (s.keys, s.reserved_keys, s.evictions) == (20_000, 20_000, 10_000)
    assert reg.match_prefix(pinned) == 10_000
    assert sum(reg.describe(k) is None for k in keys) == 10_000
    locations = reg.retrieve(lease, pinned)
    assert locations.misses() == 0 and len(set(locations.offsets())) == 10_000
    assert reg.abort(lease, newcomers) == 20_000
    assert reg.match_prefix(pinned) == 10_000
    assert all(reg.describe(k) is None for k in newcomers[::97])
    assert reg.reserve(lease, [(k, PAGE) for k in newcomers[:5000]]).misses() == 0
    accounting_adds_up(reg)


def test_one_million_keys_fit_in_256_bytes_each() -> None:
    assert bytes_per_key(1_000_000) <= 256


def test_the_growth_report_names_each_batch_that_rebuilt_the_key_table() -> None:
    # 40,000 keys, 4,096 at a time: the key table is rebuilt as its rows pass an eighth
    # of its slots (16,384 slots at first), each rebuild done by the batches after it.
    report = growth_steps(40_000, batch=4096)
    steps = report["rebuild_steps"]
    began = [step["rows_before"] for step in steps if step["did"] == "began a rebuild"]
    assert began and began[0] == 0 and len(began) >= 3  # 16k slots at first, 512k at the end
    assert {step["did"] for step in steps} == {"began a rebuild", "worked on a rebuild"}
    assert all(step["seconds"] > 0 for step in steps)
    # most batches rebuild nothing: the report's scale is one of those
    assert len(steps) < 40_000 // 4096 and report["plain_batch_median_s"] > 0
    assert report["longest_batch_s"] >= max(step["seconds"] for step in steps)


# -- the state machine ----------------------------------------------------------------------------

KEYS = [key(i) for i in range(14)]
LEASE_TTL, RESERVATION_TTL = 10.0, 30.0
MAX_FENCE = 60.0  # a live writer's lapsed reservation is fenced this long at most


class RegistryMachine(RuleBasedStateMachine):
    """Random clients against a model: what must hold whatever they do."""

    @initialize(pages=st.integers(8, 40), high=st.sampled_from([1.0, 0.9, 0.7]))
    def start(self, pages: int, high: float) -> None:
        self.clock = Clock()
        self.geometry = geometry(pages)
        self.reg = Registry(self.geometry, lease_ttl_s=LEASE_TTL, reservation_ttl_s=RESERVATION_TTL,
                            high_watermark=high, low_watermark=high * 0.8, clock=self.clock,
                            max_fence_s=MAX_FENCE)  # fmt: skip
        self.leases: dict[str, float] = {}  # lease id -> expiry
        self.committed: dict[bytes, Location] = {}
        self.reserved: dict[bytes, tuple[str, Slot, int, float]] = {}  # key -> lease, slot, length, deadline
        self.pins: dict[str, Counter] = {}
        self.max_generation = 0
        self.peer_of: dict[str, str] = {}  # lease id -> the peer that opened it
        self.owner_of: dict[bytes, str] = {}  # committed key -> the peer whose lease committed it
        # Lapsed reservations whose pages are fenced: [key, lease, offset, length, until].
        self.fenced: list[list] = []

    # -- model helpers

    def _drop(self, lease: str) -> None:
        del self.leases[lease]
        self.pins.pop(lease, None)
        for k in [k for k, r in self.reserved.items() if r[0] == lease]:
            self._fence(k)
        for entry in self.fenced:
            if entry[1] == lease:
                entry[4] = min(entry[4], self.clock.now + RESERVATION_TTL)

    def _fence(self, k: bytes) -> None:
        lease, slot, length, _ = self.reserved.pop(k)
        until = self.clock.now + (MAX_FENCE if lease in self.leases else RESERVATION_TTL)
        self.fenced.append([k, lease, slot.offset, length, until])

    def _writer_done(self, lease: str, keys: set[bytes]) -> None:
        self.fenced = [e for e in self.fenced if not (e[1] == lease and e[0] in keys)]

    def _call(self, lease: str, op, *args):
        """Call ``op`` under ``lease``, expecting NoLease exactly when the model says it lapsed."""
        if self.leases[lease] <= self.clock.now:
            with pytest.raises(NoLease):
                op(lease, *args)
            self._drop(lease)
            return None
        result = op(lease, *args)
        self.leases[lease] = self.clock.now + LEASE_TTL
        return result

    def _sync_evictions(self) -> None:
        for k in list(self.committed):
            if self.reg.describe(k) is None:
                assert not any(c[k] for c in self.pins.values()), "a pinned object was evicted"
                del self.committed[k]
                del self.owner_of[k]

    # -- rules

    @rule(peer=st.sampled_from(["10.0.0.1", "10.0.0.2"]))
    def open_lease(self, peer: str) -> None:
        lease = self.reg.open_lease("client", peer=peer)
        assert lease not in self.leases
        self.leases[lease] = self.clock.now + LEASE_TTL
        self.pins[lease] = Counter()
        self.peer_of[lease] = peer

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def close_lease(self, data) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        assert self.reg.close_lease(lease)
        self._drop(lease)

    @rule(dt=st.sampled_from([1.0, 5.0, 11.0, 31.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def expire(self) -> None:
        report = self.reg.expire()
        lapsed = {lease for lease, until in self.leases.items() if until <= self.clock.now}
        assert set(report.lapsed_leases) == lapsed
        for lease in lapsed:
            self._drop(lease)
        stale = [k for k, r in self.reserved.items() if r[3] <= self.clock.now]
        for k in stale:
            self._fence(k)
        self.fenced = [e for e in self.fenced if e[4] > self.clock.now]

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), picks=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 5 * PAGE)), min_size=1, max_size=6))
    def reserve(self, data, picks) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        known = set(self.committed) | set(self.reserved)
        try:
            slots = self._call(lease, self.reg.reserve, picks)
        except NoSpace:
            slots = [None] * len(picks)
        self._sync_evictions()
        if slots is None:
            return
        seen = set()
        for (k, length), slot in zip(picks, slots):
            if k in known or k in seen:
                assert slot is None, "a slot for a key already committed, reserved or repeated"
            seen.add(k)
            if slot is None:
                continue
            assert slot.generation > self.max_generation
            self.max_generation = slot.generation
            self.geometry.page_index(slot.offset)  # a page start
            self.reserved[k] = (lease, slot, length, self.clock.now + RESERVATION_TTL)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6), bad=st.sets(st.sampled_from(KEYS), max_size=3))
    def commit(self, data, keys, bad) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        before = dict(self.committed)
        def verify(packed: bytes, offsets: np.ndarray, generations: np.ndarray) -> list[bool]:
            asked = [packed[i : i + 16] for i in range(0, len(packed), 16)]
            for k, offset, generation in zip(asked, offsets.tolist(), generations.tolist()):
                assert self.reserved[k][1] == Slot(offset, generation)  # the slot reserved for it
            return [k not in bad for k in asked]

        result = self._call(lease, self.reg.commit, keys, verify)
        if result is None:
            return
        self._writer_done(lease, {k for k, ok in zip(keys, result) if not ok})
        done = set()
        for k, ok in zip(keys, result):
            mine = k in self.reserved and self.reserved[k][0] == lease and k not in done
            assert ok == (mine and k not in bad)
            if mine:
                _, slot, length, _ = self.reserved.pop(k)
                done.add(k)
                if ok:
                    self.committed[k] = Location(slot.offset, length, slot.generation)
                    self.owner_of[k] = self.peer_of[lease]
        for k, loc in before.items():  # write-once: committed objects never move
            assert self.committed[k] == loc

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def abort(self, data, keys) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        expected = {k for k in keys if k in self.reserved and self.reserved[k][0] == lease}
        count = self._call(lease, self.reg.abort, keys)
        if count is not None:
            assert count == len(expected)
            for k in expected:
                del self.reserved[k]
            self._writer_done(lease, set(keys) - expected)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def retrieve(self, data, keys) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        locations = self._call(lease, self.reg.retrieve, keys)
        if locations is None:
            return
        assert len(locations) == len(keys)
        for k, loc in zip(keys, locations):
            assert loc == self.committed.get(k)
        if all(k in self.committed for k in keys):
            self.pins[lease].update(keys)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def unpin(self, data, keys) -> None:
        lease = data.draw(st.sampled_from(list(self.leases)))
        held = self.pins[lease]
        wanted = Counter(keys)
        expected = sum(min(n, held[k]) for k, n in wanted.items())
        count = self._call(lease, self.reg.unpin, keys)
        if count is not None:
            assert count == expected
            held.subtract({k: min(n, held[k]) for k, n in wanted.items()})

    # -- invariants

    @invariant()
    def accounting_adds_up_to_capacity(self) -> None:
        s = self.reg.stats()
        ps = self.geometry.page_size
        assert s.free_bytes + s.reserved_bytes + s.committed_bytes == s.capacity_bytes
        fenced = sum(-(-e[3] // ps) for e in self.fenced)
        assert s.reserved_bytes == (sum(-(-r[2] // ps) for r in self.reserved.values()) + fenced) * ps
        assert self.reg.fenced_pages == fenced
        assert s.committed_bytes == sum(-(-loc.length // ps) for loc in self.committed.values()) * ps
        assert (s.keys, s.reserved_keys, s.leases) == (len(self.committed), len(self.reserved), len(self.leases))
        rec = self.reg._records  # pinned objects are counted as pins come and go: a recount agrees
        pinned = rec.pins[: rec.high_water] > 0
        assert (s.pinned_keys, s.pinned_bytes) == (int(pinned.sum()), int(rec.pages[: rec.high_water][pinned].sum()) * ps)

    @invariant()
    def each_lease_holds_the_pages_of_its_reservations_and_fenced_runs(self) -> None:
        """What a lease's quota counts: its reserved pages plus its fenced ones."""
        ps = self.geometry.page_size
        for lease in self.leases:
            live = self.reg._leases.get(lease)
            if live is None:
                continue  # lapsed, not yet seen by a call
            want = sum(-(-r[2] // ps) for r in self.reserved.values() if r[0] == lease)
            want += sum(-(-e[3] // ps) for e in self.fenced if e[1] == lease)
            assert live.held_pages == want

    @invariant()
    def each_peer_holds_and_pins_what_its_live_leases_do(self) -> None:
        """What a peer's quotas count: the sums over the leases it opened that have not ended."""
        for peer in ("10.0.0.1", "10.0.0.2"):
            account = self.reg.peer_accounts.get(peer)
            leases = [lease for lease in self.reg._leases.values() if lease.account.peer == peer]
            if account is None:
                assert not leases
                continue
            assert account.held_pages == sum(lease.held_pages for lease in leases)
            assert account.pin_pages == sum(lease.pins.pages for lease in leases)
            assert account.leases == len(leases)

    @invariant()
    def each_peer_owns_the_pages_it_committed(self) -> None:
        """What eviction by fair share counts: committed pages by the peer that committed them."""
        ps, owned = self.geometry.page_size, Counter()
        for k, loc in self.committed.items():
            owned[self.owner_of[k]] += -(-loc.length // ps)
        assert self.reg.owned_pages() == dict(owned)

    @invariant()
    def live_objects_never_overlap(self) -> None:
        ps = self.geometry.page_size
        runs = [(loc.offset, -(-loc.length // ps)) for loc in self.committed.values()]
        runs += [(r[1].offset, -(-r[2] // ps)) for r in self.reserved.values()]
        # A lapsed writer may still copy into its fenced pages: nobody else may hold them.
        runs += [(e[2], -(-e[3] // ps)) for e in self.fenced]
        used = np.zeros(self.geometry.num_pages, dtype=int)
        for offset, pages in runs:
            first = self.geometry.page_index(offset)
            used[first : first + pages] += 1
        assert used.max(initial=0) <= 1, "two live objects share a page"

    @invariant()
    def pins_match_the_model(self) -> None:
        for k, loc in self.committed.items():
            info = self.reg.describe(k)
            assert info is not None and info.state == "committed"
            assert (info.offset, info.length, info.generation) == loc
            assert info.pins == sum(c[k] for c in self.pins.values())
        for k, (lease, slot, length, _) in self.reserved.items():
            info = self.reg.describe(k)
            assert info.state == "reserved" and info.lease_id == lease and info.offset == slot.offset


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


# -- fencing of lapsed writers ---------------------------------------------------------------------


def test_a_lapsed_reservation_s_pages_are_not_reused_while_its_lease_lives(clock: Clock) -> None:
    reg = Registry(geometry(2), lease_ttl_s=10, reservation_ttl_s=1, fence_grace_s=5, clock=clock)
    slow, other = reg.open_lease("slow writer"), reg.open_lease("other writer")
    (mine,) = reg.reserve(slow, [(key(1), 2 * PAGE)])
    clock.now += 2  # the reservation lapses; both leases live
    reg.renew(slow), reg.renew(other)
    assert reg.expire().reservations_released == 1
    with pytest.raises(NoSpace):  # the slow writer may still be copying into both pages
        reg.reserve(other, [(key(2), 2 * PAGE)])
    assert reg.fenced_pages == 2 and reg.stats().reserved_keys == 0
    accounting_adds_up(reg)
    # Its lease ends; the pages come back only after the grace.
    assert reg.close_lease(slow)
    clock.now += 4
    reg.renew(other)
    reg.expire()
    with pytest.raises(NoSpace):
        reg.reserve(other, [(key(2), 2 * PAGE)])
    clock.now += 2
    reg.renew(other)
    reg.expire()
    assert reg.fenced_pages == 0
    assert list(reg.reserve(other, [(key(2), 2 * PAGE)]))[0].offset == mine.offset
    accounting_adds_up(reg)


def test_a_lapsed_lease_fences_its_reservations_for_the_grace(clock: Clock) -> None:
    reg = Registry(geometry(1), lease_ttl_s=10, reservation_ttl_s=30, fence_grace_s=30, clock=clock)
    dead = reg.open_lease("dead")
    reg.reserve(dead, [(key(1), PAGE)])
    clock.now += 11
    live = reg.open_lease("live")
    assert reg.expire().lapsed_leases == (dead,)
    with pytest.raises(NoSpace):
        reg.reserve(live, [(key(1), PAGE)])  # the key is free again, its page is not
    for _ in range(3):
        clock.now += 9
        reg.renew(live)
    reg.expire()
    with pytest.raises(NoSpace):  # 27 s of a 30 s grace
        reg.reserve(live, [(key(1), PAGE)])
    clock.now += 4
    reg.renew(live)
    reg.expire()
    assert list(reg.reserve(live, [(key(1), PAGE)]))[0] is not None


def test_a_lapsed_writer_that_commits_or_aborts_ends_its_fence(clock: Clock) -> None:
    reg = Registry(geometry(2), lease_ttl_s=100, reservation_ttl_s=1, clock=clock)
    writer = reg.open_lease("writer")
    reg.reserve(writer, [(key(1), PAGE), (key(2), PAGE)])
    clock.now += 2
    reg.expire()
    assert reg.fenced_pages == 2
    assert reg.commit(writer, [key(1)]) == [False]  # too late: refused, and its copy is over
    assert reg.fenced_pages == 1
    assert reg.abort(writer, [key(2)]) == 0
    assert reg.fenced_pages == 0
    assert None not in reg.reserve(writer, [(key(3), PAGE), (key(4), PAGE)])
    accounting_adds_up(reg)
