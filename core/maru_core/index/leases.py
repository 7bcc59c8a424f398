"""Leases: every client of the index holds one; what it holds lapses with it.

A lease holds pins (rows pinned by its retrieves, as arrays so a batch of
thousands of keys costs a few vectorised operations) and owns reservations
(recorded in the records' ``owner`` column by lease number). When it lapses,
both are released.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


#: Pins are kept in arrays of at most this many rows, so that releasing or
#: searching them runs in slices of bounded time (see ``Registry.unpin_sliced``).
PIN_CHUNK_ROWS = 65536


class Lease:
    """One client's lease. ``number`` is its compact id in the records' ``owner`` column."""

    __slots__ = ("lease_id", "client", "number", "expires_at", "held_pages", "_pins", "_distinct", "_batch_keys")

    def __init__(self, lease_id: str, client: str, number: int, expires_at: float) -> None:
        self.lease_id = lease_id
        self.client = client
        self.number = number
        self.expires_at = expires_at
        self.held_pages = 0  # pool pages it holds reserved or fenced: what its quota bounds
        # Arrays of pinned rows (a retrieve's rows, split into chunks of at most
        # PIN_CHUNK_ROWS), and whether the rows of each are distinct.
        self._pins: list[np.ndarray] = []
        self._distinct: list[bool] = []
        # The keys of each retrieve whose rows are distinct, joined, with its
        # chunks: an unpin of the same keys (the usual case) is then found
        # without a lookup. Filed under a cheap fingerprint (hashing 128 KB of
        # keys would cost more than the lookup it saves) and confirmed by
        # comparing the keys.
        self._batch_keys: dict[tuple[int, bytes, bytes], tuple[bytes, list[np.ndarray]]] = {}

    @staticmethod
    def _fingerprint(joined_keys: bytes) -> tuple[int, bytes, bytes]:
        return len(joined_keys), joined_keys[:16], joined_keys[-16:]

    @property
    def pin_count(self) -> int:
        return sum(len(chunk) for chunk in self._pins)

    def add_pins(self, rows: np.ndarray, distinct: bool, joined_keys: bytes) -> None:
        if not len(rows):
            return
        chunks = [rows[i : i + PIN_CHUNK_ROWS] for i in range(0, len(rows), PIN_CHUNK_ROWS)]
        self._pins += chunks
        self._distinct += [distinct] * len(chunks)
        if distinct:
            self._batch_keys.setdefault(self._fingerprint(joined_keys), (joined_keys, chunks))

    def take_batch(self, joined_keys: bytes) -> np.ndarray | None:
        """The rows of an earlier retrieve of exactly these keys (joined), unpinned; else ``None``."""
        fingerprint = self._fingerprint(joined_keys)
        entry = self._batch_keys.get(fingerprint)
        if entry is None or entry[0] != joined_keys:
            return None
        del self._batch_keys[fingerprint]
        chunks = entry[1]
        held = {id(chunk): i for i, chunk in enumerate(self._pins)}
        if any(id(chunk) not in held or self._pins[held[id(chunk)]] is not chunk for chunk in chunks):
            return None  # partly unpinned by a general unpin since: take the general path
        for i in sorted((held[id(chunk)] for chunk in chunks), reverse=True):
            del self._pins[i], self._distinct[i]
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def take_pins_sliced(self, rows: np.ndarray) -> Generator[np.ndarray, None, None]:
        """Drop one pin per occurrence of a row in ``rows`` that this lease holds.

        Yields, chunk by chunk, the rows whose pin was dropped (once per
        dropped pin), so the caller can decrement their counts and let other
        work run between chunks. Chunks are searched in the order they were
        pinned; the search stops once every wanted pin was found.
        """
        self._batch_keys.clear()  # chunks are about to change
        if not len(rows):
            return
        want_rows, remaining = np.unique(rows, return_counts=True)
        i = 0
        while i < len(self._pins) and remaining.any():
            chunk = self._pins[i]
            taken = _take_from_chunk(chunk, want_rows, remaining)
            if len(taken):
                keep = np.ones(len(chunk), dtype=bool)
                keep[taken] = False
                self._pins[i] = chunk[keep]
                yield chunk[taken]
            if not len(self._pins[i]):
                del self._pins[i], self._distinct[i]
            else:
                i += 1

    def pop_pin_chunks(self) -> list[np.ndarray]:
        """Every pinned row, as chunks (a row pinned twice appears twice); the lease then holds none."""
        chunks = self._pins
        self._pins, self._distinct = [], []
        self._batch_keys.clear()
        return chunks

    def clear_pins(self) -> np.ndarray:
        chunks = self.pop_pin_chunks()
        return np.concatenate(chunks) if chunks else _EMPTY


def _take_from_chunk(chunk: np.ndarray, want_rows: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Positions in ``chunk`` of pins to drop: for each row of ``want_rows`` (sorted),
    up to ``remaining`` of its occurrences; ``remaining`` is decremented in place."""
    candidates = np.flatnonzero(np.isin(chunk, want_rows[remaining > 0]))
    if not len(candidates):
        return candidates
    values = chunk[candidates]
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    rank = np.arange(len(ordered)) - np.searchsorted(ordered, ordered, side="left")
    slot = np.searchsorted(want_rows, ordered)
    take = rank < remaining[slot]
    np.subtract.at(remaining, slot[take], 1)
    return np.sort(candidates[order[take]])


def new_lease_id() -> str:
    return uuid.uuid4().hex
