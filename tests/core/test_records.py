"""The record table's key index, against a dict, with keys chosen to collide."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from maru_core.index.records import _TOMBSTONE, RecordTable, State


def clustered_key(i: int) -> bytes:
    """Keys that differ in a few bits only: their home slots crowd together,
    so probes run long, through tombstones and across the table's end."""
    return (i % 7).to_bytes(8, "little") + (i // 7).to_bytes(8, "little")


KEYS = [clustered_key(i) for i in range(300)]


class RecordTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = RecordTable()
        self.rows: dict[bytes, int] = {}

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=120, unique=True))
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

    @invariant()
    def counts_and_keys_agree(self) -> None:
        assert len(self.table) == len(self.rows)
        assert self.table._tombstones == int((self.table._table == _TOMBSTONE).sum())
        for k, row in list(self.rows.items())[:20]:
            assert self.table.key_of(row) == k


TestRecordTable = RecordTableMachine.TestCase
TestRecordTable.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_every_key_of_a_large_batch_is_found_and_unknown_keys_are_not() -> None:
    table = RecordTable()
    keys = [clustered_key(i) for i in range(20_000)]
    rows = table.add(b"".join(keys[:15_000]))
    table.remove(rows[::3])  # tombstones all over the probe chains
    present = np.ones(15_000, dtype=bool)
    present[::3] = False
    found = table.lookup(b"".join(keys))
    assert (found[:15_000][present] == rows[present]).all()
    assert (found[:15_000][~present] == -1).all() and (found[15_000:] == -1).all()


def test_a_table_that_removes_as_much_as_it_adds_is_not_rebuilt(monkeypatch) -> None:
    """A full pool evicts as it stores. Were every removal to leave a tombstone, the table
    would be rebuilt (every row entered again: 100 ms at a million keys, on the event loop)
    every few tens of thousands of removals; emptied where no probe needs them, they do not
    pile up."""
    table = RecordTable()
    fresh = np.random.default_rng(0).bytes(16 * 120_000)  # distinct 16-byte keys, taken in order
    taken = 20_000
    live = table.add(fresh[: 16 * taken])
    rebuilds = []
    rebuild = table._rebuild
    monkeypatch.setattr(table, "_rebuild", lambda rows: rebuilds.append(rows) or rebuild(rows))
    rng = np.random.default_rng(1)
    for _ in range(40):  # 80,000 removals and as many additions, at 20,000 keys
        gone = rng.choice(len(live), 2000, replace=False)
        table.remove(live[gone])
        added = table.add(fresh[16 * taken : 16 * (taken + 2000)])
        taken += 2000
        live = np.concatenate((np.delete(live, gone), added))
    assert not rebuilds
    assert len(table) == 20_000 and (table.lookup(table.keys[live].tobytes()) == live).all()


def test_room_made_for_a_batch_lets_its_slices_grow_nothing(monkeypatch) -> None:
    """A large reserve adds its records a slice per step; were each slice to grow the columns
    (by half) or rebuild the key table, each growth would be a long step of the index's loop.
    ``make_room`` grows once, for the whole batch."""
    table = RecordTable()
    keys = np.random.default_rng(2).bytes(16 * 30_000)
    before = table.add(keys[: 16 * 1000])
    table.remove(before[::2])  # free rows to reuse, and tombstones, as a live table has
    grown = []
    for name in ("_grow", "_rebuild"):
        method = getattr(table, name)
        monkeypatch.setattr(table, name, lambda n, method=method, name=name: grown.append(name) or method(n))
    table.make_room(29_000)
    assert grown == ["_grow", "_rebuild"]
    rows = [table.add(keys[16 * i : 16 * (i + 1000)]) for i in range(1000, 30_000, 1000)]
    assert grown == ["_grow", "_rebuild"]  # the slices grew nothing more
    assert (table.lookup(keys[16 * 1000 :]) == np.concatenate(rows)).all()
    kept = b"".join(keys[16 * i : 16 * (i + 1)] for i in range(1, 1000, 2))
    assert (table.lookup(kept) == before[1::2]).all()  # the rows kept are still found
