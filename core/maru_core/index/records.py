"""The index's object records: parallel numpy arrays behind a vectorised hash table.

One million keys must cost at most 256 bytes each, and a retrieve of 8,000
keys well under a millisecond. A Python dict from key to record would cost
about 130 bytes per key before any field (the key object, the dict entry,
an int per row) and a Python-level hash and probe per key. Here a record is
a row number; each field, the key included (two little-endian u64 words),
is one numpy array (the key's two words side by side, and the location
fields side by side, as they travel); and the key -> row index is an
open-addressing table of row numbers probed for a whole batch at once. Keys are blake2b digests, so
their words are already uniform; a Fibonacci multiply still spreads keys
that are not.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from maru_core.keys import KEY_BYTES

_GROWTH = 1.5
_MIN_ROWS = 1024
_EMPTY = -1  # a table slot never used since the last rebuild: ends a probe
_TOMBSTONE = -2  # a slot whose key was removed: probes go on past it
# At most one slot in eight in use: about 94 % of keys then sit in their home
# slot and a lookup needs no second round for them (at one in four, 89 %,
# and a retrieve of 8,000 keys took a fifth longer). 4 bytes a slot.
_MAX_LOAD = 0.125  # rows + tombstones per slot before the table is rebuilt
_HEADROOM = 8  # a rebuilt table has at least this many slots per row
_WINDOW = 8  # slots probed per key and round after the first (8 bools read as one u64)
_WINDOW_STEPS = np.arange(_WINDOW, dtype=np.int64)
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)


class State(enum.IntEnum):
    FREE = 0  # the row holds no object
    RESERVED = 1  # a slot handed to a writer, not yet visible
    COMMITTED = 2  # visible to readers


# field name -> dtype, with the value of a free row
_FIELDS: dict[str, tuple[str, int | float]] = {
    "page": ("i8", 0),  # first page of the object
    "pages": ("i8", 0),  # pages it spans
    "state": ("i1", State.FREE),
    "pins": ("i4", 0),  # leases pinning it (each counts its own pins: leases.LeasePins)
    "owner": ("i4", -1),  # number of the lease holding the reservation
    "peer": ("i4", -1),  # owner id of the peer that committed it (maru_core.index.ownership)
    "last_used": ("i8", 0),  # LRU tick of its last commit or retrieve
    "deadline": ("f8", 0.0),  # when an uncommitted reservation lapses
}
# Fields read together, kept side by side in one 2-D array (zero in a free row):
# group name -> dtype, the names of its columns (each a view).
_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    # The key as two little-endian u64 words: a probe gathers and compares both at once.
    "keys": ("<u8", ("key0", "key1")),
    # A location as it travels (see maru_core.protocol.locations): a retrieve's
    # reply is one gather of these rows.
    "location": ("<i8", ("offset", "length", "generation")),
}
_BOTH_TRUE = 0x0101  # two bools read as one u16


def join_keys(keys: Sequence[bytes]) -> bytes:
    """The keys concatenated; ``ValueError`` unless they are all 16-byte bytes-like objects.

    (Only the total length is checked; the protocol checks each key.)
    """
    try:
        data = b"".join(keys)
    except TypeError:
        raise ValueError(f"keys must be {KEY_BYTES}-byte bytes") from None
    if len(data) != KEY_BYTES * len(keys):
        raise ValueError(f"keys must be {KEY_BYTES} bytes each")
    return data


def key_words(joined: bytes | memoryview) -> np.ndarray:
    """The two u64 words of each key in ``joined`` (see ``join_keys``), as an ``(n, 2)`` array."""
    return np.frombuffer(joined, dtype="<u8").reshape(-1, 2)


class RecordTable:
    """Rows of object records plus the key -> row index.

    Attributes named after ``_FIELDS`` are the numpy arrays (``capacity``
    long; rows ``>= high_water`` were never used).
    """

    keys: np.ndarray
    key0: np.ndarray
    key1: np.ndarray
    location: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    generation: np.ndarray
    page: np.ndarray
    pages: np.ndarray
    state: np.ndarray
    pins: np.ndarray
    owner: np.ndarray
    peer: np.ndarray
    last_used: np.ndarray
    deadline: np.ndarray

    def __init__(self) -> None:
        self.count = 0
        self.removals = 0  # calls of remove(): a row found before may hold another key since
        self.high_water = 0
        self.capacity = 0
        self._free_rows = np.zeros(0, dtype=np.int64)
        for name, (dtype, fill) in _FIELDS.items():
            setattr(self, name, np.full(0, fill, dtype=dtype))
        for name, (dtype, columns) in _GROUPS.items():
            self._set_group(name, np.zeros((0, len(columns)), dtype=dtype))
        self._grow(_MIN_ROWS)
        self._tombstones = 0
        self._bits = 0
        self._table = np.zeros(0, dtype=np.int32)
        self._rebuild(_MIN_ROWS)

    def __len__(self) -> int:
        return self.count

    @property
    def key_slots(self) -> int:
        """Slots of the key table (it is rebuilt larger as rows are added)."""
        return len(self._table)

    def _set_group(self, name: str, array: np.ndarray) -> None:
        setattr(self, name, array)
        for i, column in enumerate(_GROUPS[name][1]):
            setattr(self, column, array[:, i])

    def _grow(self, needed: int) -> None:
        capacity = max(_MIN_ROWS, int(self.capacity * _GROWTH), needed)
        for name, (dtype, fill) in _FIELDS.items():
            grown = np.full(capacity, fill, dtype=dtype)
            grown[: self.capacity] = getattr(self, name)
            setattr(self, name, grown)
        for name, (dtype, columns) in _GROUPS.items():
            grown = np.zeros((capacity, len(columns)), dtype=dtype)
            grown[: self.capacity] = getattr(self, name)
            self._set_group(name, grown)
        self.capacity = capacity

    # -- the hash table ---------------------------------------------------------------------------

    def _slots(self, words: np.ndarray) -> np.ndarray:
        """The home slot of each key (``words``: ``(n, 2)``)."""
        mixed = words[:, 1] >> np.uint64(1)
        mixed ^= words[:, 0]
        mixed *= _FIBONACCI
        mixed >>= np.uint64(64 - self._bits)
        return mixed.view(np.int64)

    def _rebuild(self, rows_to_hold: int) -> None:
        """A fresh table with at least ``_HEADROOM`` slots per row, holding every live row."""
        self._bits = max(10, int(rows_to_hold * _HEADROOM).bit_length())
        self._table = np.full(1 << self._bits, _EMPTY, dtype=np.int32)
        self._tombstones = 0
        self._insert(np.flatnonzero(self.state[: self.high_water] != State.FREE))

    def _insert(self, rows: np.ndarray) -> None:
        """Enter ``rows`` (whose keys are set, distinct and absent) into the table."""
        table, mask = self._table, len(self._table) - 1
        slot = self._slots(self.keys.take(rows, axis=0))
        rows = rows.astype(np.int32)
        while len(rows):
            before = table.take(slot)
            free = before < 0
            # Racing rows on one free slot: the last write wins, the others move on.
            table[slot[free]] = rows[free]
            won = np.zeros(len(rows), dtype=bool)
            won[free] = table[slot[free]] == rows[free]
            self._tombstones -= int(np.count_nonzero(before[won] == _TOMBSTONE))
            rows, slot = rows[~won], (slot[~won] + 1) & mask

    def _probe(self, words: np.ndarray, want_slots: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
        """``(slots, rows)``: the table slot (only if ``want_slots``, else ``None``)
        and the row of each key (``words``: ``(n, 2)``), both -1 for an unknown key.

        Linear probing for the whole batch at once. The first round reads
        each key's home slot; at this load most keys end there (found, or an
        empty slot). The rest are probed a window of ``_WINDOW`` slots per
        round: a key is found where its window holds it, and is unknown once
        its window holds an empty slot, since a live key never lies beyond an
        empty slot of its probe sequence (a removal leaves a tombstone, made
        empty again only where no probe needs it: ``remove``). Every operation works on flat,
        contiguous arrays: numpy is slow on a short inner axis.
        """
        table, mask, keys = self._table, len(self._table) - 1, self.keys
        slot = self._slots(words)
        row = table.take(slot)
        # take() reads the negative markers as the last rows; "row >= 0" discards those.
        hit = (keys.take(row, axis=0) == words).view(np.uint16).ravel() == _BOTH_TRUE
        hit &= row >= 0
        rows = np.where(hit, row, -1).astype(np.int64)
        slots = np.where(hit, slot, -1) if want_slots else None
        hit |= row == _EMPTY
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
            match |= found == _EMPTY
            done = match.view(np.uint64) != 0  # any() of each key's 8 bools, read as one word
            todo = todo[~done]
            slot[todo] += _WINDOW
        return slots, rows

    # -- records ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes] | bytes) -> np.ndarray:
        """Row of each key (-1 for an unknown key), as an int64 array; ``keys``
        may be given joined (``join_keys``)."""
        return self._probe(key_words(keys if isinstance(keys, bytes) else join_keys(keys)))[1]

    def lookup_in_state(self, keys: Sequence[bytes] | bytes, state: State) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, mask)``: each key's row and whether it is a record in ``state``."""
        rows = self.lookup(keys)
        mask = self.state.take(rows) == state
        mask &= rows >= 0
        return rows, mask

    def still_in_state(self, rows: np.ndarray, joined: bytes, state: State) -> np.ndarray:
        """Whether each of ``rows`` (found for the keys of ``joined`` earlier,
        -1 where not found) still holds its key, in ``state``: one vectorised
        pass, no hashing."""
        found = rows >= 0
        mask = (self.keys.take(rows, axis=0) == key_words(joined)).all(axis=1)
        mask &= self.state.take(rows) == state
        return mask & found

    def add(self, keys: Sequence[bytes] | bytes) -> np.ndarray:
        """Give each key (new, distinct; ``keys`` may be given joined) a row with
        state ``RESERVED``; the caller fills the other fields."""
        words = key_words(keys if isinstance(keys, bytes) else join_keys(keys))
        n = len(words)
        reused = self._free_rows[len(self._free_rows) - min(n, len(self._free_rows)) :]
        self._free_rows = self._free_rows[: len(self._free_rows) - len(reused)]
        fresh = n - len(reused)
        if self.high_water + fresh > self.capacity:
            self._grow(self.high_water + fresh)
        rows = np.concatenate((reused, np.arange(self.high_water, self.high_water + fresh, dtype=np.int64)))
        self.high_water += fresh
        self.keys[rows] = words
        self.state[rows] = State.RESERVED
        self.count += n
        if self.count + self._tombstones > _MAX_LOAD * len(self._table):
            self._rebuild(self.count)  # takes in the new rows too
        else:
            self._insert(rows)
        return rows

    def make_room(self, n: int) -> None:
        """Grow now, in one call, as far as adding ``n`` rows would (the columns and the key
        table): a large batch then added a slice at a time grows nothing in its slices. Each
        growth copies every column or rebuilds the key table, 1.5-2.8 ms at 46,000 rows on
        the 2-core VM, and a batch growing the table by half at a time did so several times
        among its slices, each a long step of the index's loop."""
        fresh = n - len(self._free_rows)
        if fresh > 0 and self.high_water + fresh > self.capacity:
            self._grow(self.high_water + fresh)
        if self.count + n + self._tombstones > _MAX_LOAD * len(self._table):
            self._rebuild(self.count + n)

    def remove(self, rows: np.ndarray) -> None:
        """Forget the records at ``rows`` (distinct, live) and make the rows free."""
        slots, _ = self._probe(self.keys.take(rows, axis=0), want_slots=True)
        assert slots is not None  # want_slots
        if np.any(slots < 0):
            raise RuntimeError("a live record is missing from the key table")
        self._table[slots] = _TOMBSTONE
        self._tombstones += len(rows)
        self._empty_unneeded_tombstones(slots)
        for name, (_, fill) in _FIELDS.items():
            getattr(self, name)[rows] = fill
        for name in _GROUPS:
            getattr(self, name)[rows] = 0
        self._free_rows = np.concatenate((self._free_rows, rows))
        self.count -= len(rows)
        self.removals += 1

    def _empty_unneeded_tombstones(self, slots: np.ndarray) -> None:
        """Make empty again the tombstones at ``slots`` (distinct) that no probe needs, and
        those before them in turn. A tombstone followed by an empty slot is one: no live key
        lies beyond an empty slot of its probe sequence, so a probe that passed it would stop
        at the next slot anyway. At this load most removals end so, leaving nothing behind;
        tombstones left to pile up made the table rebuild (100 ms at a million keys) every
        few tens of thousands of removals, as a full pool evicts."""
        table, mask = self._table, len(self._table) - 1
        frontier = slots[table.take((slots + 1) & mask) == _EMPTY]
        while len(frontier):
            table[frontier] = _EMPTY
            self._tombstones -= len(frontier)
            frontier = (frontier - 1) & mask
            frontier = frontier[table.take(frontier) == _TOMBSTONE]

    def key_of(self, row: int) -> bytes:
        return self.keys[row].tobytes()

    def row_of(self, key: bytes) -> int | None:
        rows = self.lookup([key]) if type(key) is bytes and len(key) == KEY_BYTES else [-1]
        return int(rows[0]) if rows[0] >= 0 else None

    def used_rows(self, state: State) -> np.ndarray:
        """Rows whose record is in ``state``."""
        return np.flatnonzero(self.state[: self.high_water] == state)
