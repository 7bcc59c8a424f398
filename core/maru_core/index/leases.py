"""Leases: every client of the index holds one; what it holds lapses with it.

A lease holds pins (rows pinned by its retrieves, as arrays so a batch of
thousands of keys costs a few vectorised operations) and owns reservations
(recorded in the records' ``owner`` column by lease number). When it lapses,
both are released.
"""

from __future__ import annotations

import uuid

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


class Lease:
    """One client's lease. ``number`` is its compact id in the records' ``owner`` column."""

    __slots__ = ("lease_id", "client", "number", "expires_at", "_pins", "_distinct", "_batch_keys")

    def __init__(self, lease_id: str, client: str, number: int, expires_at: float) -> None:
        self.lease_id = lease_id
        self.client = client
        self.number = number
        self.expires_at = expires_at
        # One array of rows per retrieve (or one merged array), and whether its rows are distinct.
        self._pins: list[np.ndarray] = []
        self._distinct: list[bool] = []
        # The keys of each retrieve whose rows are distinct, joined: an unpin
        # of the same keys (the usual case) is then found without a lookup.
        # Filed under a cheap fingerprint (hashing 128 KB of keys would cost
        # more than the lookup it saves) and confirmed by comparing the keys.
        self._batch_keys: dict[tuple[int, bytes, bytes], tuple[bytes, np.ndarray]] = {}

    @staticmethod
    def _fingerprint(joined_keys: bytes) -> tuple[int, bytes, bytes]:
        return len(joined_keys), joined_keys[:16], joined_keys[-16:]

    def add_pins(self, rows: np.ndarray, distinct: bool, joined_keys: bytes) -> None:
        if len(rows):
            self._pins.append(rows)
            self._distinct.append(distinct)
            if distinct:
                self._batch_keys.setdefault(self._fingerprint(joined_keys), (joined_keys, rows))

    def take_batch(self, joined_keys: bytes) -> np.ndarray | None:
        """The rows of an earlier retrieve of exactly these keys (joined), unpinned; else ``None``."""
        fingerprint = self._fingerprint(joined_keys)
        entry = self._batch_keys.get(fingerprint)
        if entry is None or entry[0] != joined_keys:
            return None
        del self._batch_keys[fingerprint]
        rows = entry[1]
        for i, batch in enumerate(self._pins):
            if batch is rows:
                del self._pins[i], self._distinct[i]
                return rows
        return None  # merged away by a general unpin: take the general path

    def pinned_rows(self) -> np.ndarray:
        """Every row this lease pins, once per pin (a row pinned twice appears twice)."""
        if len(self._pins) > 1:
            self._pins = [np.concatenate(self._pins)]
            self._distinct = [False]
            self._batch_keys.clear()
        return self._pins[0] if self._pins else _EMPTY

    def take_pins(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
        """Drop one pin per occurrence of a row in ``rows`` that this lease holds.

        Returns ``(distinct rows unpinned, pins dropped per row)``. Unpinning
        exactly the rows of one earlier retrieve (the usual case) costs one
        comparison; anything else is a multiset difference.
        """
        for i, (batch, distinct) in enumerate(zip(self._pins, self._distinct)):
            if distinct and len(batch) == len(rows) and np.array_equal(batch, rows):
                del self._pins[i], self._distinct[i]
                return batch, 1
        self._batch_keys.clear()  # batches are about to be merged
        held = self.pinned_rows()
        if not len(held) or not len(rows):
            return _EMPTY, 0
        held_rows, held_counts = np.unique(held, return_counts=True)
        want_rows, want_counts = np.unique(rows, return_counts=True)
        pos = np.minimum(np.searchsorted(held_rows, want_rows), len(held_rows) - 1)
        match = held_rows[pos] == want_rows
        pos, taken_rows = pos[match], want_rows[match]
        taken = np.minimum(want_counts[match], held_counts[pos])
        held_counts[pos] -= taken
        self._pins = [np.repeat(held_rows, held_counts)]
        self._distinct = [False]
        return taken_rows, taken

    def clear_pins(self) -> np.ndarray:
        rows = self.pinned_rows()
        self._pins, self._distinct = [], []
        self._batch_keys.clear()
        return rows


def new_lease_id() -> str:
    return uuid.uuid4().hex
