"""The index's object records: parallel numpy arrays behind a vectorised hash table.

One million keys must cost at most 256 bytes each, and a retrieve of 8,000
keys well under a millisecond. A Python dict from key to record would cost
about 130 bytes per key before any field (the key object, the dict entry,
an int per row) and a Python-level hash and probe per key. Here a record is
a row number; each field, the key included (two little-endian u64 words),
is one numpy array; and the key -> row index is an open-addressing table of
row numbers probed for a whole batch at once. Keys are blake2b digests, so
their words are already uniform; a Fibonacci multiply still spreads keys
that are not.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

_GROWTH = 1.5
_MIN_ROWS = 1024
_EMPTY = -1  # a table slot never used since the last rebuild: ends a probe
_TOMBSTONE = -2  # a slot whose key was removed: probes go on past it
_MAX_LOAD = 0.25  # rows + tombstones per slot before the table is rebuilt
_HEADROOM = 4  # a rebuilt table has at least this many slots per row (4 bytes each)
_SCALAR_TAIL = 16  # probes left for so few keys finish in plain Python
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
KEY_BYTES = 16


class State(enum.IntEnum):
    FREE = 0  # the row holds no object
    RESERVED = 1  # a slot handed to a writer, not yet visible
    COMMITTED = 2  # visible to readers


# field name -> dtype, with the value of a free row
_FIELDS: dict[str, tuple[str, int | float]] = {
    "key0": ("<u8", 0),  # first 8 bytes of the key
    "key1": ("<u8", 0),  # last 8 bytes of the key
    "page": ("i8", 0),  # first page of the object
    "pages": ("i8", 0),  # pages it spans
    "length": ("i8", 0),  # bytes
    "generation": ("i8", 0),
    "state": ("i1", State.FREE),
    "pins": ("i4", 0),  # pins held on it, over all leases
    "owner": ("i4", -1),  # number of the lease holding the reservation
    "last_used": ("i8", 0),  # LRU tick of its last commit or retrieve
    "deadline": ("f8", 0.0),  # when an uncommitted reservation lapses
}


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


def key_words(joined: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The two u64 words of each key in ``joined`` (see ``join_keys``)."""
    words = np.frombuffer(joined, dtype="<u8").reshape(-1, 2)
    return words[:, 0], words[:, 1]


class RecordTable:
    """Rows of object records plus the key -> row index.

    Attributes named after ``_FIELDS`` are the numpy arrays (``capacity``
    long; rows ``>= high_water`` were never used).
    """

    key0: np.ndarray
    key1: np.ndarray
    page: np.ndarray
    pages: np.ndarray
    length: np.ndarray
    generation: np.ndarray
    state: np.ndarray
    pins: np.ndarray
    owner: np.ndarray
    last_used: np.ndarray
    deadline: np.ndarray

    def __init__(self) -> None:
        self.count = 0
        self.high_water = 0
        self.capacity = 0
        self._free_rows = np.zeros(0, dtype=np.int64)
        for name, (dtype, fill) in _FIELDS.items():
            setattr(self, name, np.full(0, fill, dtype=dtype))
        self._grow(_MIN_ROWS)
        self._tombstones = 0
        self._bits = 0
        self._table = np.zeros(0, dtype=np.int32)
        self._rebuild(_MIN_ROWS)

    def __len__(self) -> int:
        return self.count

    def _grow(self, needed: int) -> None:
        capacity = max(_MIN_ROWS, int(self.capacity * _GROWTH), needed)
        for name, (dtype, fill) in _FIELDS.items():
            grown = np.full(capacity, fill, dtype=dtype)
            grown[: self.capacity] = getattr(self, name)
            setattr(self, name, grown)
        self.capacity = capacity

    # -- the hash table ---------------------------------------------------------------------------

    def _slots(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        mixed = (k0 ^ (k1 >> np.uint64(1))) * _FIBONACCI
        return (mixed >> np.uint64(64 - self._bits)).astype(np.int64)

    def _rebuild(self, rows_to_hold: int) -> None:
        """A fresh table with at least ``_HEADROOM`` slots per row, holding every live row."""
        self._bits = max(10, int(rows_to_hold * _HEADROOM).bit_length())
        self._table = np.full(1 << self._bits, _EMPTY, dtype=np.int32)
        self._tombstones = 0
        self._insert(np.flatnonzero(self.state[: self.high_water] != State.FREE))

    def _insert(self, rows: np.ndarray) -> None:
        """Enter ``rows`` (whose keys are set, distinct and absent) into the table."""
        table, mask = self._table, len(self._table) - 1
        rows = rows.astype(np.int32)
        slot = self._slots(self.key0[rows], self.key1[rows])
        while len(rows):
            before = table[slot]
            free = before < 0
            # Racing rows on one free slot: the last write wins, the others move on.
            table[slot[free]] = rows[free]
            won = np.zeros(len(rows), dtype=bool)
            won[free] = table[slot[free]] == rows[free]
            self._tombstones -= int(np.count_nonzero(before[won] == _TOMBSTONE))
            rows, slot = rows[~won], (slot[~won] + 1) & mask

    def _find(self, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
        """The table slot holding each key, or -1.

        Linear probing for the whole batch at once: each round reads one
        slot per key still unresolved; at this load most keys resolve in the
        first round, and the last few finish in plain Python.
        """
        table, mask = self._table, len(self._table) - 1
        found = np.full(len(k0), -1, dtype=np.int64)
        pending = np.arange(len(k0))
        slot = self._slots(k0, k1)
        while len(pending) > _SCALAR_TAIL:
            row = table[slot]
            safe = np.maximum(row, 0)
            hit = (self.key0[safe] == k0) & (self.key1[safe] == k1) & (row >= 0)
            found[pending[hit]] = slot[hit]
            go_on = ~hit & (row != _EMPTY)
            pending, slot, k0, k1 = pending[go_on], (slot[go_on] + 1) & mask, k0[go_on], k1[go_on]
        for i, s, a, b in zip(pending.tolist(), slot.tolist(), k0.tolist(), k1.tolist()):
            while (row := int(table[s])) != _EMPTY:
                if row >= 0 and int(self.key0[row]) == a and int(self.key1[row]) == b:
                    found[i] = s
                    break
                s = (s + 1) & mask
        return found

    # -- records ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes] | bytes) -> np.ndarray:
        """Row of each key (-1 for an unknown key), as an int64 array; ``keys``
        may be given joined (``join_keys``)."""
        slots = self._find(*key_words(keys if isinstance(keys, bytes) else join_keys(keys)))
        rows = self._table[slots].astype(np.int64)
        rows[slots < 0] = -1
        return rows

    def lookup_in_state(self, keys: Sequence[bytes] | bytes, state: State) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, mask)``: each key's row and whether it is a record in ``state``."""
        rows = self.lookup(keys)
        return rows, (rows >= 0) & (self.state[rows] == state)

    def add(self, keys: Sequence[bytes]) -> np.ndarray:
        """Give each key (new, distinct) a row with state ``RESERVED``; the caller fills the other fields."""
        k0, k1 = key_words(join_keys(keys))
        n = len(keys)
        reused = self._free_rows[len(self._free_rows) - min(n, len(self._free_rows)) :]
        self._free_rows = self._free_rows[: len(self._free_rows) - len(reused)]
        fresh = n - len(reused)
        if self.high_water + fresh > self.capacity:
            self._grow(self.high_water + fresh)
        rows = np.concatenate((reused, np.arange(self.high_water, self.high_water + fresh, dtype=np.int64)))
        self.high_water += fresh
        self.key0[rows], self.key1[rows] = k0, k1
        self.state[rows] = State.RESERVED
        self.count += n
        if self.count + self._tombstones > _MAX_LOAD * len(self._table):
            self._rebuild(self.count)  # takes in the new rows too
        else:
            self._insert(rows)
        return rows

    def remove(self, rows: np.ndarray) -> None:
        """Forget the records at ``rows`` (distinct, live) and make the rows free."""
        slots = self._find(self.key0[rows], self.key1[rows])
        if np.any(slots < 0):
            raise RuntimeError("a live record is missing from the key table")
        self._table[slots] = _TOMBSTONE
        self._tombstones += len(rows)
        for name, (_, fill) in _FIELDS.items():
            getattr(self, name)[rows] = fill
        self._free_rows = np.concatenate((self._free_rows, rows))
        self.count -= len(rows)

    def key_of(self, row: int) -> bytes:
        return self.key0[row : row + 1].tobytes() + self.key1[row : row + 1].tobytes()

    def row_of(self, key: bytes) -> int | None:
        rows = self.lookup([key]) if type(key) is bytes and len(key) == KEY_BYTES else [-1]
        return int(rows[0]) if rows[0] >= 0 else None

    def used_rows(self, state: State) -> np.ndarray:
        """Rows whose record is in ``state``."""
        return np.flatnonzero(self.state[: self.high_water] == state)
