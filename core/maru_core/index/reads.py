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
from typing import TYPE_CHECKING, NamedTuple, NoReturn

import numpy as np

from maru_core.index.leases import PinMerge, SortedBatch
from maru_core.index.records import KEY_BYTES, RecordTable, State
from maru_core.index.registry_types import Keys, QuotaExceeded, joined_keys, run_to_end
from maru_core.protocol.locations import LocationList

if TYPE_CHECKING:
    from maru_core.index.leases import Lease
    from maru_core.pool.geometry import PoolGeometry

#: A retrieve of more than this many slices makes its rows most recently used and reads
#: their locations in two steps: for 20,000 keys the two took three times a lookup
#: slice's time on the index's loop. An engine's largest retrieve (a 64k-token prompt,
#: 8,000 keys) keeps them in one step, and its rounds.
SPLIT_TOUCH_SLICES = 4


class Reads:
    """Readers and pins of a ``Registry`` (which provides the state below)."""

    geometry: "PoolGeometry"
    max_lease_pin_pages: int
    max_peer_pin_pages: int
    _records: RecordTable
    _tick: int
    _pinned_keys: int  # objects some lease pins (all committed: a pinned object is never removed)
    _pinned_pages: int
    _lease: Callable[[str], "Lease"]
    _refuse: Callable[["Lease", QuotaExceeded], NoReturn]

    def _lookup_in_state(self, keys: Keys, state: State) -> tuple[np.ndarray, np.ndarray]:
        return self._records.lookup_in_state(joined_keys(keys), state)

    def match_prefix(self, keys: Keys) -> int:
        """How many leading ``keys`` are committed (no pin, no lease needed)."""
        joined = joined_keys(keys)
        return run_to_end(self.match_prefix_sliced(joined, max(1, len(joined) // KEY_BYTES)))

    def committed(self, keys: Keys) -> np.ndarray:
        """Whether each of ``keys`` is committed, as a bool array (no pin, no lease needed)."""
        return self._lookup_in_state(keys, State.COMMITTED)[1]

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
        ahead = (yield from self._planned_ahead(lease_id, joined, rows, slice_keys)) if committed.all() else None
        if self._records.removals != removals and committed.all():
            # records went meanwhile (evicted, expired): their rows may hold other keys now
            committed = self._records.still_in_state(rows, joined, State.COMMITTED)
        if not committed.all():
            return self._locations(rows, committed)
        return self._pin_and_locate(lease_id, rows, joined, ahead)

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
        ahead = yield from self._planned_ahead(lease_id, prefix, found, slice_keys)
        if self._records.removals != removals:
            # records went meanwhile: a row found before may hold another key now
            still = self._records.still_in_state(found, prefix, State.COMMITTED)
            if not still.all():
                return matched, None
        return matched, self._pin_and_locate(lease_id, found, prefix, ahead)

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

    def _planned_ahead(self, lease_id: str, joined: bytes, rows: np.ndarray,
                       slice_keys: int) -> Generator[None, None, PinAhead | None]:  # fmt: skip
        """For a retrieve of more than one slice, what its pin (``rows``, of ``joined``'s
        keys, all committed) can do before the step that pins, in steps of their own:
        the sort of its rows (none when the lease pinned exactly these keys before
        and still does: ``LeasePins.remembered``), their search among the lease's pins,
        ``slice_keys`` rows a step, then the rows made most recently used and their
        locations read (in a step each, past ``SPLIT_TOUCH_SLICES`` slices). Only the
        pin must be one step with the checks it depends on. ``None`` for a smaller
        one: all of it done in the step that pins."""
        if len(rows) <= slice_keys:
            return None
        yield
        pins = self._lease(lease_id).pins
        batch = pins.remembered(joined) or SortedBatch(rows)
        yield
        merge = yield from pins.plan_sliced(batch, slice_keys)
        yield
        self._touch(rows)  # a record removed before the pin makes it a miss; a touch of its row is harmless
        if len(rows) > SPLIT_TOUCH_SLICES * slice_keys:
            yield
        ahead = PinAhead(merge, self._locations(rows, None), self._records.removals)
        yield
        return ahead

    def _pin_and_locate(self, lease_id: str, rows: np.ndarray, joined: bytes, ahead: PinAhead | None) -> LocationList:
        """Pin ``rows`` (``_pin``) and return their locations: those read ahead, unless a
        record was removed since (its row may hold another object now, at another place)."""
        self._pin(lease_id, rows, joined, ahead.merge if ahead else None, touch=ahead is None)
        if ahead is not None and ahead.removals == self._records.removals:
            return ahead.locations
        return self._locations(rows, None)

    def _pin(self, lease_id: str, rows: np.ndarray, joined: bytes, merge: PinMerge | None,
             touch: bool = True) -> None:  # fmt: skip
        """Pin ``rows`` (committed records of ``joined``'s keys, in order) for the lease,
        counted once per object (``leases.LeasePins``); ``QuotaExceeded`` and nothing
        pinned when its distinct objects would pass ``max_lease_pin_pages``, or
        those of all its peer's leases (each lease's distinct objects) ``max_peer_pin_pages``.
        ``merge``: the plan made a step ahead, used unless the lease's pins changed since;
        ``touch``: make ``rows`` most recently used (unless that was done ahead)."""
        lease = self._lease(lease_id)  # still live after the slices, or nothing is pinned
        if merge is None or not lease.pins.still_fits(merge):
            merge = lease.pins.plan(lease.pins.remembered(joined) or SortedBatch(rows))
        new = merge.new_rows
        rec = self._records
        new_pages = int(rec.pages.take(new).sum())
        if lease.pins.pages + new_pages > self.max_lease_pin_pages:
            self._refuse(lease, QuotaExceeded(
                f"this lease pins {len(lease.pins)} objects ({lease.pins.pages} pages) and this retrieve would "
                f"pin {len(new)} more ({new_pages} pages); a lease may pin {self.max_lease_pin_pages} of the "
                f"pool's {self.geometry.num_pages} pages (--max-lease-pin-fraction): unpin what it has read",
                quota="pins"))  # fmt: skip
        account = lease.account
        # Summed over leases (two that pin one object count it twice), so the whole pool is no bound: none.
        if self.max_peer_pin_pages < self.geometry.num_pages and account.pin_pages + new_pages > self.max_peer_pin_pages:
            self._refuse(lease, QuotaExceeded(
                f"the {account.leases} leases of peer {account.peer} pin {account.pin_pages} pages and this "
                f"retrieve would pin {new_pages} more; one peer's leases together may pin "
                f"{self.max_peer_pin_pages} of the pool's {self.geometry.num_pages} pages "
                "(--max-peer-pin-fraction): unpin what they have read", quota="peer_pins"))  # fmt: skip
        if touch:
            self._touch(rows)
        lease.pins.add(merge, joined)
        self._add_pins(new)  # the leases pinning each object: one more for the new ones
        lease.pins.pages += new_pages

    def _add_pins(self, rows: np.ndarray) -> None:
        """One more lease pins each object at ``rows`` (distinct); those no lease pinned
        before are counted as pinned (``stats`` reads the counts: no look over every record)."""
        pins = self._records.pins
        first = rows[pins[rows] == 0]
        pins[rows] += 1
        self._pinned_keys += len(first)
        self._pinned_pages += int(self._records.pages[first].sum())

    def _drop_pins(self, rows: np.ndarray) -> None:
        """One lease fewer pins each object at ``rows`` (distinct); uncount those left unpinned."""
        pins = self._records.pins
        pins[rows] -= 1
        last = rows[pins[rows] == 0]
        self._pinned_keys -= len(last)
        self._pinned_pages -= int(self._records.pages[last].sum())

    def _unpinned(self, lease: "Lease", rows: np.ndarray) -> None:
        """``lease`` no longer pins the objects at ``rows`` (distinct)."""
        if len(rows):
            self._drop_pins(rows)
            lease.pins.pages -= int(self._records.pages.take(rows).sum())

    def _release_pins(self, leases: list["Lease"]) -> Generator[None, None, int]:
        """Release the pins of ended ``leases``, a chunk of distinct objects per step;
        return how many objects were unpinned. Whatever is left when the steps are
        abandoned (the connection of a ``bye`` gone) is released at once: an ended
        lease's pin would otherwise keep its object from eviction for ever."""
        chunks = [chunk for lease in leases for chunk in lease.pins.pop_all()]  # the leases pin nothing now
        released = 0
        try:
            while chunks:
                chunk = chunks.pop(0)
                self._drop_pins(chunk)  # distinct rows: this lease's one count each
                released += len(chunk)
                yield
        finally:
            for chunk in chunks:
                self._drop_pins(chunk)
        return released

    def retrieve(self, lease_id: str, keys: Keys) -> LocationList:
        """One ``Location`` per key, in order, ``None`` for a key not committed.

        All or nothing: when every key is committed, each is pinned (its
        lease's count of it grows by each occurrence; see ``leases.LeasePins``)
        for ``lease_id`` until ``unpin`` or the lease ends, and
        becomes most recently used (earlier keys more recent than later ones,
        so a prefix's tail is evicted before its head). When any key is
        missing, nothing is pinned and the locations returned must not be
        read. ``QuotaExceeded`` (nothing pinned) when the lease would pin more
        than ``max_lease_pin_pages`` pages of distinct objects.
        """
        joined = joined_keys(keys)
        return run_to_end(self.retrieve_sliced(lease_id, joined, max(1, len(joined) // KEY_BYTES)))

    def unpin(self, lease_id: str, keys: Keys) -> int:
        """Drop one of ``lease_id``'s pins per key occurrence; return how many were dropped."""
        joined = joined_keys(keys)
        return run_to_end(self.unpin_sliced(lease_id, joined, max(1, len(joined) // KEY_BYTES)))

    def unpin_sliced(self, lease_id: str, keys: Keys, slice_keys: int) -> Generator[None, None, int]:
        """``unpin`` with its keys looked up a slice of ``slice_keys`` per step;
        the last step drops the pins (a sort of the keys' rows and a search in
        the lease's); returns how many were dropped.

        Unpinning exactly the keys of one earlier retrieve (the usual case)
        needs no lookup: one step. A record removed between slices may have
        its row reused by another key: rows are then checked again, as a
        retrieve's are, so a pin is never taken for another key.
        """
        lease = self._lease(lease_id)
        joined = joined_keys(keys)
        taken = lease.pins.take_batch(joined)
        if taken is None:
            removals = self._records.removals
            rows, committed = yield from self._committed_sliced(joined, slice_keys, stop_at_miss=False)
            if self._records.removals != removals:
                committed &= self._records.still_in_state(rows, joined, State.COMMITTED)
            lease = self._lease(lease_id)
            taken = lease.pins.take(np.where(committed, rows, -1))
        dropped, released = taken
        self._unpinned(lease, released)
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


class PinAhead(NamedTuple):
    """What a large retrieve did before the step that pins (``Reads._planned_ahead``)."""

    merge: PinMerge  # the pin's plan among the lease's pins
    locations: LocationList  # the rows' locations, read when ...
    removals: int  # ... the record table had removed this many records


def _leading(committed: np.ndarray) -> int:
    """How many leading entries of ``committed`` are true."""
    return len(committed) if committed.all() else int(np.argmin(committed))
