"""The record table's key index, against a dict, with keys chosen to collide,
rebuilt while it is used: its next table filled, then copied into, a few slots
at a time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from maru_core.index.key_table import EMPTY, TOMBSTONE, KeyIndex
from maru_core.index.records import RecordTable, State, key_words


def clustered_key(i: int) -> bytes:
    """Keys that differ in a few bits only: their home slots crowd together,
    so probes run long, through tombstones and across the table's end."""
    return (i % 7).to_bytes(8, "little") + (i // 7).to_bytes(8, "little")


def colliding_key(i: int) -> bytes:
    """Keys whose words mix to the same value: all have one home slot, in every table
    size, so they lie in one run of slots that probes walk through."""
    return (0x5A5A ^ i).to_bytes(8, "little") + (2 * i).to_bytes(8, "little")


KEYS = [clustered_key(i) for i in range(250)] + [colliding_key(i) for i in range(50)]


class RecordTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # A first key table of 1,024 slots, rebuilt from 86 rows on and again from 171, 64
        # slots of a rebuild a step: adds, removes and lookups meet half-filled and
        # half-copied next tables.
        self.table = RecordTable(len(KEYS), first_key_rows=1, rebuild_slice_slots=64)
        self.rows: dict[bytes, int] = {}
        self.room = None  # a make_room under way, run a step at a time

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=40, unique=True))
    def add(self, keys: list[bytes]) -> None:
        new = [k for k in keys if k not in self.rows]
        if not new:
            return
        rows = self.table.add(b"".join(new) if len(new) % 2 else new)  # packed or listed
        assert len(set(rows.tolist())) == len(new)
        assert not set(rows.tolist()) & set(self.rows.values())
        self.rows.update(zip(new, rows.tolist()))

    @rule(data=st.data())
    def remove(self, data) -> None:
        if not self.rows:
            return
        gone = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=60, unique=True))
        self.table.remove(np.array([self.rows.pop(k) for k in gone], dtype=np.int64))
        assert all(self.table.row_of(k) is None for k in gone)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=200))
    def lookup(self, keys: list[bytes]) -> None:
        found = self.table.lookup(b"".join(keys)).tolist()
        assert found == [self.rows.get(k, -1) for k in keys]
        rows, committed = self.table.lookup_in_state(keys, State.COMMITTED)
        assert rows.tolist() == found and not committed.any()  # everything added is RESERVED

    @rule()
    def a_step_of_a_rebuild(self) -> None:
        next(self.table.finish_rebuild_sliced(), None)

    @rule(n=st.integers(1, 300))
    def make_room(self, n: int) -> None:
        self.room = self.table.make_room(n)

    @rule()
    def a_step_of_make_room(self) -> None:
        if self.room is not None and next(self.room, "done") == "done":
            self.room = None

    @invariant()
    def counts_and_keys_agree(self) -> None:
        assert len(self.table) == len(self.rows)
        index = self.table._index
        assert index.table.tombstones == int((index.table.slots == TOMBSTONE).sum())
        assert_complete_and_copied(index, len(self.rows))
        for k, row in list(self.rows.items())[:20]:
            assert self.table.key_of(row) == k

    @invariant()
    def every_key_is_found(self) -> None:
        if self.rows:
            assert self.table.lookup(list(self.rows)).tolist() == list(self.rows.values())


def assert_complete_and_copied(index: KeyIndex, live: int) -> None:
    """The table in use holds every key once; a next table being copied into holds
    exactly the rows of the slots the copy has passed (and rows only once)."""
    in_use = index.table.slots
    assert int((in_use >= 0).sum()) == live
    nxt = index._copying()
    if nxt is not None:
        copied = nxt.slots[nxt.slots >= 0]
        passed = in_use[: index._copied]
        assert sorted(copied.tolist()) == sorted(passed[passed >= 0].tolist())


TestRecordTable = RecordTableMachine.TestCase
TestRecordTable.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_every_key_of_a_large_batch_is_found_and_unknown_keys_are_not() -> None:
    table = RecordTable(20_000)
    keys = [clustered_key(i) for i in range(20_000)]
    rows = table.add(b"".join(keys[:15_000]))
    table.remove(rows[::3])  # tombstones all over the probe chains
    present = np.ones(15_000, dtype=bool)
    present[::3] = False
    found = table.lookup(b"".join(keys))
    assert (found[:15_000][present] == rows[present]).all()
    assert (found[:15_000][~present] == -1).all() and (found[15_000:] == -1).all()


def test_a_table_that_removes_as_much_as_it_adds_is_seldom_rebuilt(monkeypatch) -> None:
    """A full pool evicts as it stores. Were every removal to leave a tombstone, the table
    would be rebuilt (every row entered again) every few tens of thousands of removals;
    emptied where no probe needs them, they do not pile up."""
    table = RecordTable(20_000)
    fresh = np.random.default_rng(0).bytes(16 * 120_000)  # distinct 16-byte keys, taken in order
    taken = 20_000
    live = table.add(fresh[: 16 * taken])
    table._index.finish()  # the rebuild the first add began
    rebuilds = []
    rebuild = table._index.begin_rebuild
    monkeypatch.setattr(table._index, "begin_rebuild", lambda *rows: rebuilds.append(rows) or rebuild(*rows))
    rng = np.random.default_rng(1)
    for _ in range(40):  # 80,000 removals and as many additions, at 20,000 keys
        gone = rng.choice(len(live), 2000, replace=False)
        table.remove(live[gone])
        added = table.add(fresh[16 * taken : 16 * (taken + 2000)])
        taken += 2000
        live = np.concatenate((np.delete(live, gone), added))
    # 5 rebuilds before removals emptied the tombstones no probe needs; now the few left
    # begin one or two (each done a slice at a time, as any rebuild)
    assert len(rebuilds) <= 2
    assert len(table) == 20_000 and (table.lookup(table.keys[live].tobytes()) == live).all()


def work_of(index: KeyIndex, monkeypatch) -> tuple[list[int], list[str]]:
    """The slot count of every step of a rebuild that ``index`` does from now on (with
    the size of the table in use), and a line for each rebuild it finishes at once."""
    counts: list[tuple[int, int]] = []
    finished: list[str] = []
    advance, finish = index._advance, index.finish

    def counted(count: int) -> None:
        if index.rebuilding and count < 1 << 62:
            counts.append((count, index.slots))
        advance(count)

    monkeypatch.setattr(index, "_advance", counted)
    monkeypatch.setattr(index, "finish", lambda: finished.append("at once") or finish())
    return counts, finished


def test_a_table_filled_in_batches_is_rebuilt_in_slices_never_at_once(monkeypatch) -> None:
    """Rebuilt at once, the key table took 0.6 s of the index's loop at two million keys.
    A rebuild now fills its next table and drains the old one in proportion to the rows
    added, so it is done before the new table fills: no addition ever has to do the rest
    at once."""
    table = RecordTable(200_000, rebuild_slice_slots=4096)
    work, finished = work_of(table._index, monkeypatch)
    keys = np.random.default_rng(3).bytes(16 * 200_000)
    rebuilt = []
    for start in range(0, 200_000, 2000):
        slots = table.key_slots
        table.add(keys[16 * start : 16 * (start + 2000)])
        rebuilt += [start] if table.key_slots != slots else []
        assert (table.lookup(keys[: 16 * (start + 2000)]) >= 0).all()
    assert len(rebuilt) >= 5  # 16k slots at first, 4M at the end
    # Each addition did its share, never the rest of a rebuild at once. A share is the
    # next table's and the current one's slots (3 T) over the rows between the rebuild
    # load and the load (T / 24): 72 slots a row, whatever the table's size (a little
    # more where one batch is a good part of those rows).
    assert work and not finished
    assert max(count for count, slots in work if slots >= 1 << 18) <= 2000 * 96
    assert (table.lookup(keys) == np.arange(200_000)).all()


def test_one_addition_larger_than_the_table_can_take_rebuilds_at_once() -> None:
    """A restore enters every committed object in one addition: the rebuild it begins is
    finished before the rows go in (the table in use could not hold them)."""
    table = RecordTable(100_000)
    keys = np.random.default_rng(4).bytes(16 * 100_000)
    rows = table.add(keys)
    assert not table.key_table_rebuilding and table.key_slots >= 8 * 100_000
    assert (table.lookup(keys) == rows).all()


def test_room_made_for_a_batch_lets_its_slices_rebuild_nothing(monkeypatch) -> None:
    """A large reserve adds its records a slice per step; were a slice to begin a rebuild,
    the slices after it would do its work too. ``make_room`` rebuilds once, for the
    whole batch, in steps of its own."""
    table = RecordTable(30_000, rebuild_slice_slots=4096)
    keys = np.random.default_rng(2).bytes(16 * 30_000)
    before = table.add(keys[: 16 * 1000])
    table.remove(before[::2])  # free rows to reuse, and tombstones, as a live table has
    index = table._index
    rebuilds = []
    begin = index.begin_rebuild
    monkeypatch.setattr(index, "begin_rebuild", lambda rows, live: rebuilds.append(rows) or begin(rows, live))
    old_slots = table.key_slots
    steps = list(table.make_room(29_000))
    assert rebuilds == [500 + 29_000] and not table.key_table_rebuilding
    # a slice per step, a yield between them: the new table filled, the old one drained
    assert len(steps) == (table.key_slots + old_slots) // 4096 - 1
    work, finished = work_of(index, monkeypatch)
    rows = [table.add(keys[16 * i : 16 * (i + 1000)]) for i in range(1000, 30_000, 1000)]
    assert rebuilds == [29_500] and not work and not finished  # the slices rebuilt nothing, did no share
    assert (table.lookup(keys[16 * 1000 :]) == np.concatenate(rows)).all()
    kept = b"".join(keys[16 * i : 16 * (i + 1)] for i in range(1, 1000, 2))
    assert (table.lookup(kept) == before[1::2]).all()  # the rows kept are still found


def rebuilt_32_slots_a_step(monkeypatch) -> tuple[RecordTable, KeyIndex]:
    """A table for 1,000 rows whose rebuilds do the least share a step: 32 slots."""
    table = RecordTable(1000, first_key_rows=1, rebuild_slice_slots=32)
    index = table._index
    begin = index.begin_rebuild

    def slowly(rows_to_hold: int, live: int) -> None:
        begin(rows_to_hold, live)
        index._work_per_row = 0

    monkeypatch.setattr(index, "begin_rebuild", slowly)
    return table, index


def test_a_rebuild_under_way_finds_removes_and_copies_keys_of_one_long_run(monkeypatch) -> None:
    """Fifty keys of one home slot, in a table rebuilt 32 slots a step: a key added or
    removed where the copy has passed must be added to or removed from the next table
    too, and the keys the copy meets later must not be copied twice."""
    table, index = rebuilt_32_slots_a_step(monkeypatch)
    run = [colliding_key(i) for i in range(50)]
    others = [clustered_key(i) for i in range(250)]
    rows = dict(zip(run, table.add(run).tolist()))
    rows.update(zip(others[:30], table.add(others[:30]).tolist()))  # 80 rows: just below the rebuild load
    removed, copying = [], 0
    for key in others[30:]:
        rows[key] = int(table.add([key])[0])
        if index._copying() is not None and len(removed) < 40:  # the run's keys, ahead of the copy and behind
            removed.append(run[len(removed)])
            table.remove(np.array([rows.pop(removed[-1])]))
        copying += index._copying() is not None
        assert table.lookup(list(rows)).tolist() == list(rows.values())
        assert (table.lookup(removed) == -1).all()
        assert_complete_and_copied(index, len(rows))
    assert copying >= 20 and len(removed) == 40
    index.finish()
    assert table.lookup(list(rows)).tolist() == list(rows.values()) and (table.lookup(removed) == -1).all()
    assert_complete_and_copied(index, len(rows))


def test_keys_added_and_removed_at_the_copy_position(monkeypatch) -> None:
    """The slot the copy comes to next is not behind the copy: a key added there is
    copied by the copy itself, so the addition must not put it in the next table too,
    and a key removed from there was never copied, so its removal must not look for it
    in the next table."""
    table, index = rebuilt_32_slots_a_step(monkeypatch)
    keys = iter(clustered_key(i) for i in range(250))
    rows: dict[bytes, int] = {}

    def add(key: bytes) -> int:
        rows[key] = int(table.add([key])[0])
        return rows[key]

    while index._copying() is None or index.table.slots[index._copied] != EMPTY:
        add(next(keys))
    at = index._copied
    candidates = np.random.default_rng(7).integers(0, 256, size=(20_000, 16), dtype=np.uint8)
    homes = index.table.home(key_words(candidates.tobytes()))
    landing = candidates[np.flatnonzero(homes == at)[0]].tobytes()
    row = add(landing)
    assert index.table.slots[at] == row  # it landed at the copy position
    assert_complete_and_copied(index, len(rows))

    while index._copying() is None or index.table.slots[index._copied] < 0:
        add(next(keys))
    at = index._copied
    leaving = next(k for k, r in rows.items() if r == index.table.slots[at])
    table.remove(np.array([rows.pop(leaving)]))  # before the copy reaches it
    assert_complete_and_copied(index, len(rows))
    index.finish()
    assert_complete_and_copied(index, len(rows))
    assert table.lookup(list(rows)).tolist() == list(rows.values()) and table.row_of(leaving) is None


def test_columns_too_large_for_the_address_space_are_refused_with_what_to_change() -> None:
    """The columns are allocated whole, a row per pool page; a pool of 2^45 pages would
    need more address space than a process has, on any machine."""
    with pytest.raises(MemoryError, match="larger pages"):
        RecordTable(1 << 45)
