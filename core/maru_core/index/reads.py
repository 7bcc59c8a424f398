"""The read side of ``maru_core.index.registry.Registry`` (its base class):
prefix matches, retrieves that pin, unpins, and the recency a read gives.
Kept apart from the writers (reserve, commit, abort, leases, restore) and
from placement (``maru_core.index.placement``); all of it runs on the
registry's one thread.

A committed record leaves that state only when removed (evicted, expired),
so a lookup done a slice per step is checked again, against the record
table's removal count, before it pins.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import numpy as np

from maru_core.index.records import KEY_BYTES, RecordTable, State
from maru_core.index.registry_types import Keys, joined_keys, run_to_end
from maru_core.protocol.locations import LocationList

if TYPE_CHECKING:
    from maru_core.index.leases import Lease


class Reads:
    """Readers and pins of a ``Registry`` (which provides the state below)."""

    _records: RecordTable
    _tick: int
    _lease: Callable[[str], "Lease"]

    def _lookup_in_state(self, keys: Keys, state: State) -> tuple[np.ndarray, np.ndarray]:
        return self._records.lookup_in_state(joined_keys(keys), state)

    def match_prefix(self, keys: Keys) -> int:
        """How many leading ``keys`` are committed (no pin, no lease needed)."""
        joined = joined_keys(keys)
        return run_to_end(self.match_prefix_sliced(joined, max(1, len(joined) // KEY_BYTES)))

    def _committed_sliced(
        self, joined: bytes, slice_keys: int, stop_at_miss: bool
    ) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """The rows of ``joined``'s keys and whether each is committed, looked
        up a slice of ``slice_keys`` keys per step (yielding between slices);
        ``stop_at_miss``: no slice after the first one with a key not committed."""
        step = slice_keys * KEY_BYTES
        rows, committed = [], []
        for start in range(0, len(joined), step):
            if start:
                yield
            found, mask = self._lookup_in_state(joined[start : start + step], State.COMMITTED)
            rows.append(found)
            committed.append(mask)
            if stop_at_miss and not mask.all():
                break
        if not rows:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        return np.concatenate(rows), np.concatenate(committed)

    def match_prefix_sliced(self, keys: Keys, slice_keys: int) -> Generator[None, None, int]:
        """``match_prefix`` a slice of ``slice_keys`` keys per step (a large
        batch's lookups are most of its cost); stops at the first slice that
        has a key not committed."""
        _, committed = yield from self._committed_sliced(joined_keys(keys), slice_keys, stop_at_miss=True)
        return _leading(committed)

    def retrieve_sliced(self, lease_id: str, keys: Keys, slice_keys: int) -> Generator[None, None, LocationList]:
        """``retrieve`` with its keys looked up a slice of ``slice_keys`` per step.

        The last step pins them all at once, so a hit is exactly what
        ``retrieve`` would answer at that step: a committed record leaves that
        state only when removed, and if any record was removed since the
        first slice, every row found is checked to still hold its key,
        committed. A key missing when its slice was looked up, or removed
        since, makes it a miss: nothing pinned.
        """
        self._lease(lease_id)  # NoLease before any work, hit or miss
        joined = joined_keys(keys)
        removals = self._records.removals
        rows, committed = yield from self._committed_sliced(joined, slice_keys, stop_at_miss=False)
        if self._records.removals != removals and committed.all():
            # records went meanwhile (evicted, expired): their rows may hold other keys now
            committed = self._records.still_in_state(rows, joined, State.COMMITTED)
        if not committed.all():
            return self._locations(rows, committed)
        self._pin(lease_id, rows, joined)
        return self._locations(rows, None)

    def retrieve_prefix_sliced(
        self, lease_id: str, keys: Keys, group: int, slice_keys: int
    ) -> Generator[None, None, tuple[int, LocationList | None]]:
        """``retrieve_prefix`` with its keys looked up a slice of ``slice_keys``
        per step, stopping at the first slice with a key not committed; the
        last step pins (as ``retrieve_sliced`` does)."""
        self._lease(lease_id)
        joined = joined_keys(keys)
        removals = self._records.removals
        rows, committed = yield from self._committed_sliced(joined, slice_keys, stop_at_miss=True)
        matched = _leading(committed)
        pinned = matched - matched % group
        if not pinned:
            return matched, None
        found = rows[:pinned]
        prefix = joined[: pinned * KEY_BYTES]
        if self._records.removals != removals:
            # records went meanwhile: a row found before may hold another key now
            still = self._records.still_in_state(found, prefix, State.COMMITTED)
            if not still.all():
                return matched, None
        self._pin(lease_id, found, prefix)
        return matched, self._locations(found, None)

    def retrieve_prefix(self, lease_id: str, keys: Keys, group: int) -> tuple[int, LocationList | None]:
        """``match_prefix`` and ``retrieve`` in one call: how many leading
        ``keys`` are committed, and the pinned locations of the first
        ``matched - matched % group`` of them (whole groups of ``group`` keys,
        e.g. a chunk's layer objects).

        ``None`` instead of locations when no whole group matched, or when an
        object of the prefix was removed between a sliced call's steps; then
        nothing is pinned and the count still says what was committed when
        looked up. Pins are counted and released exactly as ``retrieve``'s.
        """
        if group < 1:
            raise ValueError(f"group must be at least 1, got {group}")
        joined = joined_keys(keys)
        return run_to_end(self.retrieve_prefix_sliced(lease_id, joined, group, max(1, len(joined) // KEY_BYTES)))

    def _pin(self, lease_id: str, rows: np.ndarray, joined: bytes) -> None:
        """Pin ``rows`` (committed records of ``joined``'s keys, in order) for the lease."""
        lease = self._lease(lease_id)  # still live after the slices, or nothing is pinned
        distinct = self._touch(rows)
        if distinct:
            self._records.pins[rows] += 1
        else:
            np.add.at(self._records.pins, rows, 1)
        lease.add_pins(rows, distinct, joined)

    def retrieve(self, lease_id: str, keys: Keys) -> LocationList:
        """One ``Location`` per key, in order, ``None`` for a key not committed.

        All or nothing: when every key is committed, each is pinned (once per
        occurrence) for ``lease_id`` until ``unpin`` or the lease ends, and
        becomes most recently used (earlier keys more recent than later ones,
        so a prefix's tail is evicted before its head). When any key is
        missing, nothing is pinned and the locations returned must not be
        read.
        """
        joined = joined_keys(keys)
        return run_to_end(self.retrieve_sliced(lease_id, joined, max(1, len(joined) // KEY_BYTES)))

    def unpin(self, lease_id: str, keys: Keys) -> int:
        """Drop one of ``lease_id``'s pins per key occurrence; return how many were dropped."""
        return run_to_end(self.unpin_sliced(lease_id, keys))

    def unpin_sliced(self, lease_id: str, keys: Keys) -> Generator[None, None, int]:
        """``unpin`` in slices: yields between chunks of the lease's pins
        (``leases.PIN_CHUNK_ROWS`` rows each), returns how many were dropped.

        Unpinning exactly the keys of one earlier retrieve (the usual case)
        costs one step; any other set of keys is searched for chunk by chunk,
        so a lease holding millions of pins never holds the caller for long.
        """
        lease = self._lease(lease_id)
        joined = joined_keys(keys)
        batch = lease.take_batch(joined)
        if batch is not None:
            self._records.pins[batch] -= 1
            return len(batch)
        rows, _ = self._lookup_in_state(joined, State.COMMITTED)
        dropped = 0
        for taken in lease.take_pins_sliced(rows[rows >= 0]):
            np.subtract.at(self._records.pins, taken, 1)
            dropped += len(taken)
            yield
        return dropped

    def _locations(self, rows: np.ndarray, present: np.ndarray | None) -> LocationList:
        """The packed locations of ``rows``; a miss where ``present`` (``None``: everywhere) is false."""
        # One gather: a record's location is stored as it travels. A miss's row
        # is -1, which take() reads as the last row: those entries are zeroed.
        words = self._records.location.take(rows, axis=0)
        if present is not None:
            words[~present] = 0
        return LocationList(words.data.cast("B") if len(words) else b"")

    def _touch(self, rows: np.ndarray) -> bool:
        """Make ``rows`` most recently used; return whether they are distinct.

        Each position gets its own tick, so a row listed twice keeps only its
        later tick: reading the ticks back tells duplicates apart for free.
        """
        n = len(rows)
        ticks = np.arange(self._tick + n, self._tick, -1, dtype=np.int64)
        self._records.last_used[rows] = ticks
        self._tick += n + 1
        return bool(np.array_equal(self._records.last_used.take(rows), ticks))


def _leading(committed: np.ndarray) -> int:
    """How many leading entries of ``committed`` are true."""
    return len(committed) if committed.all() else int(np.argmin(committed))
