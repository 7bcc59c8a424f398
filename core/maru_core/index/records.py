"""The index's object records: parallel numpy arrays behind a vectorised hash table.

One million keys must cost at most 256 bytes each, and a retrieve of 8,000
keys well under a millisecond. A Python dict from key to record would cost
about 130 bytes per key before any field (the key object, the dict entry,
an int per row) and a Python-level hash and probe per key. Here a record is
a row number; each field, the key included (two little-endian u64 words),
is one numpy array (the key's two words side by side, and the location
fields side by side, as they travel); and the key -> row index is an
open-addressing table of row numbers probed for a whole batch at once
(``maru_core.index.key_table``).

The columns never grow: they are allocated once for the most rows the table
may hold (an object spans at least one page, so the pool's page count) as
zeroed memory, which the kernel maps only where rows are used. Grown by half
at a time instead, each growth copied every column in one step of the
index's loop: up to 0.2 s near a million keys on the 2-core VM.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Sequence

import numpy as np

from maru_core.index.key_table import REBUILD_SLICE_SLOTS, KeyIndex
from maru_core.keys import KEY_BYTES

_MIN_ROWS = 1024  # the key table's first size


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

# Bytes of the columns per row (the key table comes on top: 48-64 bytes per live row, more during a rebuild).
ROW_BYTES = sum(np.dtype(dtype).itemsize for dtype, _ in _FIELDS.values()) + sum(
    np.dtype(dtype).itemsize * len(columns) for dtype, columns in _GROUPS.values())


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
    long; rows ``>= high_water`` were never used, and hold zeros but for the
    last, which holds a free row's values for lookups that read row -1).
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

    def __init__(self, capacity: int, *, first_key_rows: int = _MIN_ROWS,
                 rebuild_slice_slots: int = REBUILD_SLICE_SLOTS) -> None:  # fmt: skip
        """``capacity``: the most rows it may hold; the key table is first sized for
        ``first_key_rows``, and rebuilt ``rebuild_slice_slots`` a step at the least (``KeyIndex``)."""
        if capacity < 1:
            raise ValueError(f"a record table holds at least one row, got capacity {capacity}")
        self.count = 0
        self.removals = 0  # calls of remove(): a row found before may hold another key since
        self.high_water = 0
        self.capacity = capacity
        self._free_rows = np.zeros(0, dtype=np.int64)
        try:
            for name, (dtype, _) in _FIELDS.items():
                setattr(self, name, np.zeros(capacity, dtype=dtype))
            for name, (dtype, columns) in _GROUPS.items():
                self._set_group(name, np.zeros((capacity, len(columns)), dtype=dtype))
        except MemoryError:
            raise MemoryError(
                f"the index's records for {capacity} pool pages need {capacity * ROW_BYTES / 2**30:.1f} GiB of "
                "address space (touched only as objects are stored), which this machine refuses: give the "
                "pool larger pages (fewer of them) or the index's machine more memory") from None
        self._make_free(capacity - 1, capacity)
        self._index = KeyIndex(self.keys, min(capacity, first_key_rows), rebuild_slice_slots)

    def __len__(self) -> int:
        return self.count

    @property
    def key_slots(self) -> int:
        """Slots of the key table in use (it is rebuilt larger as rows are added)."""
        return self._index.slots

    @property
    def key_table_rebuilding(self) -> bool:
        """Whether a rebuild of the key table is under way."""
        return self._index.rebuilding

    def _set_group(self, name: str, array: np.ndarray) -> None:
        setattr(self, name, array)
        for i, column in enumerate(_GROUPS[name][1]):
            setattr(self, column, array[:, i])

    def _make_free(self, start: int, end: int) -> None:
        """Give rows ``[start, end)`` a free row's values (zero but where ``_FIELDS`` says)."""
        for name, (_, fill) in _FIELDS.items():
            if fill:
                getattr(self, name)[start:end] = fill

    # -- records ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes] | bytes) -> np.ndarray:
        """Row of each key (-1 for an unknown key), as an int64 array; ``keys``
        may be given joined (``join_keys``)."""
        return self._index.rows_of(key_words(keys if isinstance(keys, bytes) else join_keys(keys)))

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
        fresh = n - len(reused)
        if self.high_water + fresh > self.capacity:
            raise RuntimeError(f"the record table holds at most {self.capacity} rows (one per pool page)")
        self._free_rows = self._free_rows[: len(self._free_rows) - len(reused)]
        rows = np.concatenate((reused, np.arange(self.high_water, self.high_water + fresh, dtype=np.int64)))
        self._make_free(self.high_water, self.high_water + fresh)
        self.high_water += fresh
        self.keys[rows] = words
        self.state[rows] = State.RESERVED
        self.count += n
        self._index.enter(rows, self.count)
        return rows

    def make_room(self, n: int) -> Generator[None, None, None]:
        """Get the key table ready, in steps (a generator), for ``n`` more rows: a large
        batch then added a slice at a time begins no rebuild in its slices, and does no
        share of one. Rebuilt at once, the key table took 0.6 s at two million keys on
        the 2-core VM, a single step of the index's loop."""
        yield from self._index.finish_sliced()
        if self._index.needs_rebuild(self.count + n):
            self._index.begin_rebuild(self.count + n, self.count)
            yield from self._index.finish_sliced()

    def finish_rebuild_sliced(self) -> Generator[None, None, None]:
        """Finish a rebuild of the key table under way, in steps (a generator)."""
        yield from self._index.finish_sliced()

    def remove(self, rows: np.ndarray) -> None:
        """Forget the records at ``rows`` (distinct, live) and make the rows free."""
        self._index.forget(self.keys.take(rows, axis=0))
        for name, (_, fill) in _FIELDS.items():
            getattr(self, name)[rows] = fill
        for name in _GROUPS:
            getattr(self, name)[rows] = 0
        self._free_rows = np.concatenate((self._free_rows, rows))
        self.count -= len(rows)
        self.removals += 1

    def key_of(self, row: int) -> bytes:
        return self.keys[row].tobytes()

    def row_of(self, key: bytes) -> int | None:
        rows = self.lookup([key]) if type(key) is bytes and len(key) == KEY_BYTES else [-1]
        return int(rows[0]) if rows[0] >= 0 else None

    def used_rows(self, state: State) -> np.ndarray:
        """Rows whose record is in ``state``."""
        return np.flatnonzero(self.state[: self.high_water] == state)
