"""The record table's key -> row index: open addressing over row numbers, probed
for a whole batch of keys at once, and rebuilt larger a slice at a time.

A key is two little-endian u64 words (a blake2b digest, so already uniform;
a Fibonacci multiply still spreads keys that are not); the table holds row
numbers of the record table, whose ``keys`` column a probe compares against.

A rebuild enters every live key again into a larger table, which first has
to be filled with empty slots: 0.6 s at two million keys on the 2-core VM,
one step of the index's loop had it been done at once. So a rebuild is
spread over the steps after it begins: it fills the next table a range of
slots at a time, then copies the rows of the table in use into it a range
of slots at a time, then swaps it in. The table in use stays complete
throughout, so a lookup reads one table; an addition or removal at a slot
the copy has passed is made in the next table too. A rebuild begins at two
thirds of the table's load, and each addition does work in proportion to
the rows it adds, so it is done before the table in use reaches its load
(no lookup meets a fuller table than before); each removal does a slice; a
large reserve finishes it in steps of its own before it adds its records,
and the index's periodic expiry finishes what is left.
"""

from __future__ import annotations

import math
from collections.abc import Generator

import numpy as np

EMPTY = -1  # a slot never used since the table was made: ends a probe
TOMBSTONE = -2  # a slot whose key was removed: probes go on past it
# At most one slot in eight in use: about 94 % of keys then sit in their home
# slot and a lookup needs no second round for them (at one in four, 89 %,
# and a retrieve of 8,000 keys took a fifth longer). 4 bytes a slot.
MAX_LOAD = 0.125  # rows + tombstones per slot a table holds at most, in the usual course
# A rebuild begins at two thirds of that, to be done by the time the table in
# use reaches it: lookups never meet a fuller table than a rebuild at once left.
REBUILD_LOAD = MAX_LOAD * 2 / 3
_HEADROOM = 12  # slots per row a table is made with at least: its rows sit below the rebuild load
_MIN_BITS = 10
_WINDOW = 8  # slots probed per key and round after the first (8 bools read as one u64)
_WINDOW_STEPS = np.arange(_WINDOW, dtype=np.int64)
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
_BOTH_TRUE = 0x0101  # two bools read as one u16
# The least work a step of a rebuild does, in slots filled or copied: a
# copied range of this size holds 10,000-16,000 rows, a few milliseconds'
# work on the 2-core VM.
REBUILD_SLICE_SLOTS = 1 << 17


class SlotTable:
    """One open-addressing table: each slot ``EMPTY``, ``TOMBSTONE`` or a row number."""

    def __init__(self, rows_to_hold: int, filled: bool = True) -> None:
        """A table for ``rows_to_hold`` rows; unless ``filled``, its slots are set
        empty later, by ``fill``, before it may be used."""
        self.bits = max(_MIN_BITS, (rows_to_hold * _HEADROOM).bit_length())
        self.slots = np.full(1 << self.bits, EMPTY, dtype=np.int32) if filled else np.empty(1 << self.bits, np.int32)
        self.filled = len(self.slots) if filled else 0
        self.tombstones = 0

    def __len__(self) -> int:
        return len(self.slots)

    def fill(self, count: int) -> int:
        """Set up to ``count`` more slots empty; how many it set."""
        end = min(len(self.slots), self.filled + count)
        self.slots[self.filled : end] = EMPTY
        done, self.filled = end - self.filled, end
        return done

    @property
    def max_rows(self) -> int:
        """Rows plus tombstones it holds at most, in the usual course."""
        return int(MAX_LOAD * len(self.slots))

    @property
    def rebuild_rows(self) -> int:
        """Rows plus tombstones past which a rebuild begins."""
        return int(REBUILD_LOAD * len(self.slots))

    def home(self, words: np.ndarray) -> np.ndarray:
        """The home slot of each key (``words``: ``(n, 2)``)."""
        mixed = words[:, 1] >> np.uint64(1)
        mixed ^= words[:, 0]
        mixed *= _FIBONACCI
        mixed >>= np.uint64(64 - self.bits)
        return mixed.view(np.int64)

    def insert(self, rows: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Enter ``rows`` (whose keys ``words`` are distinct and not in the table); the slot of each."""
        table, mask = self.slots, len(self.slots) - 1
        slot = self.home(words)
        rows = rows.astype(np.int32)
        placed = np.empty(len(rows), dtype=np.int64)
        todo = np.arange(len(rows))
        while len(rows):
            before = table.take(slot)
            free = before < 0
            # Racing rows on one free slot: the last write wins, the others move on.
            table[slot[free]] = rows[free]
            won = np.zeros(len(rows), dtype=bool)
            won[free] = table[slot[free]] == rows[free]
            self.tombstones -= int(np.count_nonzero(before[won] == TOMBSTONE))
            placed[todo[won]] = slot[won]
            rows, slot, todo = rows[~won], (slot[~won] + 1) & mask, todo[~won]
        return placed

    def probe(self, keys: np.ndarray, words: np.ndarray, want_slots: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
        """``(slots, rows)``: the slot (only if ``want_slots``, else ``None``) and the row
        of each key (``words``: ``(n, 2)``; ``keys``: the record table's key column),
        both -1 for a key not in this table.

        Linear probing for the whole batch at once. The first round reads
        each key's home slot; at this load most keys end there (found, or an
        empty slot). The rest are probed a window of ``_WINDOW`` slots per
        round: a key is found where its window holds it, and is unknown once
        its window holds an empty slot, since a live key never lies beyond an
        empty slot of its probe sequence (a removal leaves a tombstone, made
        empty again only where no probe needs it: ``bury``). Every operation
        works on flat, contiguous arrays: numpy is slow on a short inner axis.
        """
        table, mask = self.slots, len(self.slots) - 1
        slot = self.home(words)
        row = table.take(slot)
        # take() reads the negative markers as the last rows; "row >= 0" discards those.
        hit = (keys.take(row, axis=0) == words).view(np.uint16).ravel() == _BOTH_TRUE
        hit &= row >= 0
        rows = np.where(hit, row, -1).astype(np.int64)
        slots = np.where(hit, slot, -1) if want_slots else None
        hit |= row == EMPTY
        todo = np.flatnonzero(~hit)
        while len(todo):
            # Each key left: the _WINDOW slots from its home slot on, laid out flat.
            start = slot.take(todo).repeat(_WINDOW)
            start += np.resize(_WINDOW_STEPS, len(start))
            start &= mask
            found = table.take(start)
            match = (keys.take(found, axis=0) == words.take(todo.repeat(_WINDOW), axis=0)).view(np.uint16).ravel()
            match = match == _BOTH_TRUE
            match &= found >= 0
            at = np.flatnonzero(match)  # a key is in its window at most once
            where = todo.take(at // _WINDOW)
            rows[where] = found.take(at)
            if slots is not None:  # want_slots
                slots[where] = start.take(at)
            match |= found == EMPTY
            done = match.view(np.uint64) != 0  # any() of each key's 8 bools, read as one word
            todo = todo[~done]
            slot[todo] += _WINDOW
        return slots, rows

    def bury(self, slots: np.ndarray) -> None:
        """Tombstone the slots ``slots`` (distinct, each holding a row), then make empty
        again the tombstones there that no probe needs, and those before them in turn.
        A tombstone followed by an empty slot is one: no live key lies beyond an
        empty slot of its probe sequence, so a probe that passed it would stop at
        the next slot anyway. At this load most removals end so, leaving nothing
        behind; tombstones left to pile up made the table rebuild every few tens of
        thousands of removals, as a full pool evicts."""
        table, mask = self.slots, len(self.slots) - 1
        table[slots] = TOMBSTONE
        self.tombstones += len(slots)
        frontier = slots[table.take((slots + 1) & mask) == EMPTY]
        while len(frontier):
            table[frontier] = EMPTY
            self.tombstones -= len(frontier)
            frontier = (frontier - 1) & mask
            frontier = frontier[table.take(frontier) == TOMBSTONE]


class KeyIndex:
    """Key -> row over the record table's ``keys`` column: the table in use (always
    complete) and, during a rebuild, the next table, being filled, then copied into."""

    def __init__(self, keys: np.ndarray, rows_to_hold: int, slice_slots: int = REBUILD_SLICE_SLOTS) -> None:
        self.keys = keys  # the record table's key column (allocated once: it never moves)
        self.table = SlotTable(rows_to_hold)
        self.slice_slots = slice_slots
        self._next: SlotTable | None = None
        self._copied = 0  # once the next table is filled: slots of the table in use copied into it
        self._work_per_row = 0.0  # slots to fill or copy per row added, to be done in time

    @property
    def slots(self) -> int:
        """Slots of the table in use."""
        return len(self.table)

    @property
    def rebuilding(self) -> bool:
        """Whether a rebuild is under way."""
        return self._next is not None

    def _copying(self) -> SlotTable | None:
        """The next table, once it is filled and being copied into."""
        nxt = self._next
        return nxt if nxt is not None and nxt.filled == len(nxt) else None

    def rows_of(self, words: np.ndarray) -> np.ndarray:
        """The row of each key (``words``), -1 for an unknown key."""
        return self.table.probe(self.keys, words)[1]

    def enter(self, rows: np.ndarray, live: int) -> None:
        """Enter ``rows`` (new, their keys set); ``live`` counts them too. Begins a
        rebuild where the table in use is past two thirds of its load, and does a
        share of the one under way."""
        if self.needs_rebuild(live) and not self.rebuilding:
            self.begin_rebuild(live, live)  # twice the slots, as the table grows
        while live + self.table.tombstones > 2 * self.table.max_rows:
            # The table in use would pass twice its load: one addition that large (a
            # restore), or removals' tombstones outran a rebuild. It is done at once.
            self.finish()
            if self.needs_rebuild(live):
                self.begin_rebuild(live, live)
        words = self.keys.take(rows, axis=0)
        slots = self.table.insert(rows, words)
        nxt = self._copying()
        if nxt is not None:  # the rows that went where the copy has passed: into the next table too
            behind = slots < self._copied
            if behind.any():
                nxt.insert(rows[behind], words[behind])
        self._advance(max(self.slice_slots, math.ceil(len(rows) * self._work_per_row)))

    def forget(self, words: np.ndarray) -> None:
        """Remove the keys ``words`` (each in the index), then do a slice of a rebuild."""
        slots, _ = self.table.probe(self.keys, words, want_slots=True)
        assert slots is not None  # want_slots
        if np.any(slots < 0):
            raise RuntimeError("a live record is missing from the key table")
        nxt = self._copying()
        if nxt is not None:  # keys the copy has passed: out of the next table too
            behind = slots < self._copied
            if behind.any():
                copied, _ = nxt.probe(self.keys, words[behind], want_slots=True)
                assert copied is not None  # want_slots
                if np.any(copied < 0):
                    raise RuntimeError("a copied record is missing from the next key table")
                nxt.bury(copied)
        self.table.bury(slots)
        self._advance(self.slice_slots)

    def needs_rebuild(self, rows: int) -> bool:
        """Whether ``rows`` live rows are past the load at which the table in use is rebuilt."""
        return rows + self.table.tombstones > self.table.rebuild_rows

    def begin_rebuild(self, rows_to_hold: int, live: int) -> None:
        """Begin a rebuild into a table sized for ``rows_to_hold`` (``live`` are held now),
        to be done (filled, copied into, swapped in) before the table in use, or the next
        one, passes its load."""
        assert not self.rebuilding
        self._next = SlotTable(rows_to_hold, filled=False)
        headroom = min(self.table.max_rows, self._next.max_rows) - live
        self._work_per_row = (len(self._next) + len(self.table)) / max(1, headroom)

    def finish_sliced(self) -> Generator[None, None, None]:
        """Finish a rebuild under way, ``slice_slots`` a step."""
        while self.rebuilding:
            self._advance(self.slice_slots)
            if self.rebuilding:
                yield

    def finish(self) -> None:
        """Finish a rebuild under way at once."""
        while self.rebuilding:
            self._advance(1 << 62)

    def _advance(self, count: int) -> None:
        """Do ``count`` slots of a rebuild's work: fill the next table, or copy the rows of
        the next ``count`` slots of the table in use into it; once all are, swap it in."""
        nxt = self._next
        if nxt is None:
            return
        if nxt.filled < len(nxt):
            count -= nxt.fill(count)
            if nxt.filled < len(nxt):
                return
            self._copied = 0
        end = min(len(self.table), self._copied + max(0, count))
        part = self.table.slots[self._copied : end]
        rows = part[part >= 0]
        if len(rows):
            nxt.insert(rows, self.keys.take(rows, axis=0))
        self._copied = end
        if end == len(self.table):
            self.table, self._next = nxt, None
