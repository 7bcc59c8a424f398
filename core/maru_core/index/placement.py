"""Where a reserve's objects go: placing a batch in the pool's pages,
evicting for it within its budget (whose objects, by fair share among the
peers: ``maru_core.index.ownership``), and the large reserve done a slice per
step. A part of ``maru_core.index.registry.Registry`` (its base class), kept
apart because it is the one part that decides about space.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Callable, NoReturn

import numpy as np

from maru_core.index import ownership
from maru_core.index.records import KEY_BYTES, RecordTable, State
from maru_core.index.registry_types import (
    Keys,
    NoSpace,
    Quarantined,
    QuotaExceeded,
    checked_lengths,
    first_occurrences_sliced,
    joined_keys,
    key_count,
    select_keys,
)
from maru_core.protocol.locations import SlotList

if TYPE_CHECKING:
    from maru_core.index.allocator import ExtentAllocator
    from maru_core.index.leases import Lease
    from maru_core.index.peer_accounts import PeerAccounts
    from maru_core.index.quotas import EvictionWindow
    from maru_core.pool.geometry import PoolGeometry


class Placement:
    """Placement and eviction of a ``Registry`` (which provides the state below)."""

    geometry: "PoolGeometry"
    quarantine_s: float
    _records: RecordTable
    _alloc: "ExtentAllocator"
    _clock: Callable[[], float]
    _quarantine_until: float
    _reserved_pages: int
    _evictions: int
    _evicted_pages: int
    _max_evict_pages: int
    max_lease_pages: int
    max_lease_evict_pages: int | None
    max_peer_pages: int
    max_peer_evict_pages: int | None
    evict_window_s: float
    _high_pages: int
    _low_pages: int
    _owners: ownership.Owners
    _peers: "PeerAccounts"
    _lease: Callable[[str], "Lease"]
    absent_keys: Callable[[Keys], np.ndarray]
    _add_reserved: Callable[..., np.ndarray]
    _release: Callable[[np.ndarray, State], None]
    _refuse: Callable[["Lease", QuotaExceeded], NoReturn]
    _cut_short: Callable[["Lease", QuotaExceeded], None]

    def reserve_sliced(self, lease_id: str, keys: Keys, lengths: Sequence[int] | np.ndarray,
                       slice_keys: int) -> Generator[None, None, SlotList]:  # fmt: skip
        """``reserve_packed`` of a large batch, a step of about ``slice_keys`` keys at a time
        (a generator that yields between steps; the last returns the slots).

        Its repeated keys are found a part per step, its keys looked up a
        slice per step, then the whole batch is placed in one step (so it is
        contiguous when one free extent holds it, and evicts within one
        reserve's budget), the record table grown for it in another, then its
        records are added a slice per step. Each
        slice is looked up again in the step that adds it: a key another
        lease reserved meanwhile gets no slot (its pages go back), so a key is
        never reserved twice; a key removed meanwhile is answered as present
        (a miss). Pages placed for records not added yet are freed should the
        generator be closed before its end.
        """
        n = key_count(keys)
        lengths = checked_lengths(lengths, n)
        self._refuse_at_quota(self._lease(lease_id), lengths)
        self._refuse_when_full(self._lease(lease_id), n)
        joined = joined_keys(keys)  # a copy when they came as a view of a frame: not for a refusal
        first = yield from first_occurrences_sliced(joined, 4 * slice_keys)
        candidates = np.empty(n, dtype=bool)
        for start in range(0, n, slice_keys):
            candidates[start : start + slice_keys] = self.absent_keys(joined[start * KEY_BYTES : (start + slice_keys) * KEY_BYTES])
            yield
        candidates &= first
        if not candidates.any():
            return SlotList(bytes(len(joined)))
        idx, starts, pages = self._place_candidates(self._lease(lease_id), candidates, lengths)
        self._reserved_pages += int(pages.sum())  # placed, not recorded yet: counted as reserved meanwhile
        done = 0
        try:
            yield
            words = np.zeros((n, 2), dtype="<u8")  # megabytes of fresh memory: a step of its own
            yield
            yield from self._records.make_room(len(idx))  # the key table readied for the batch, in steps
            while done < len(idx):
                yield
                end = done + slice_keys
                self._add_slice(self._lease(lease_id), joined, lengths, words, idx[done:end], starts[done:end],
                                pages[done:end])  # fmt: skip
                done = end
        finally:
            self._unplace(starts[done:], pages[done:])
        return SlotList(words.data.cast("B") if len(words) else b"")  # no copy: the words are this call's own

    def _add_slice(self, lease: Lease, joined: bytes, lengths: np.ndarray, words: np.ndarray,
                   idx: np.ndarray, starts: np.ndarray, pages: np.ndarray) -> None:  # fmt: skip
        """Add the records of one slice of a sliced reserve (placed at ``starts``), but for keys
        reserved or committed since they were looked up, whose pages go back."""
        keys = select_keys(joined, idx)
        still = self.absent_keys(keys)
        self._unplace(starts[~still], pages[~still])
        self._reserved_pages -= int(pages[still].sum())  # counted again by _add_reserved
        if still.all():
            rows = self._add_reserved(lease, keys, starts, pages, lengths[idx])
        else:
            keys = select_keys(joined, idx[still])
            rows = self._add_reserved(lease, keys, starts[still], pages[still], lengths[idx[still]])
        self._fill_slots(words, idx[still], starts[still], rows)

    def _unplace(self, starts: np.ndarray, pages: np.ndarray) -> None:
        """Give back pages placed for a sliced reserve's records that will never be added."""
        if len(starts):
            self._alloc.free_runs(starts, pages)
            self._reserved_pages -= int(pages.sum())

    def _fill_slots(self, words: np.ndarray, idx: np.ndarray, starts: np.ndarray, rows: np.ndarray) -> None:
        g = self.geometry
        words[idx, 0] = starts * g.page_size + g.data_offset
        words[idx, 1] = self._records.generation[rows]

    def _place_candidates(self, lease: Lease, candidates: np.ndarray,
                          lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """``(idx, starts, pages)`` of the candidates that were given pages (allocated, not
        recorded); ``Quarantined`` in quarantine, ``QuotaExceeded`` past the lease's
        or its peer's quota of pages or of evictions, ``NoSpace`` when none could be placed."""
        if self._clock() < self._quarantine_until:
            raise Quarantined(
                f"the index restarted over a pool in use; it hands out no slot for {self.quarantine_s:g} s "
                "so that copies in flight across the restart finish (stores are skipped meanwhile)"
            )
        g = self.geometry
        too_large = lengths > g.capacity_bytes
        cand_idx = np.flatnonzero(candidates & ~too_large)
        if not len(cand_idx):
            raise NoSpace(
                f"an object of {int(lengths[too_large].max())} bytes is larger than the pool's "
                f"{g.capacity_bytes} bytes of data: use a larger pool or smaller chunks"
            )
        rooms = self._reservation_rooms(lease)
        # Every object takes a page at least: no more of them than the pages left under the
        # quotas (or in the pool) can be placed, so the rest of a larger batch is not counted.
        # Counting all of a flood's 131,072 one-page objects against a room of 32,768 pages
        # made its placement a step of 2-4 ms of the index's loop (2-core VM, bench/RESULTS.md).
        most = min([g.num_pages, *(room for room, _ in rooms)])
        beyond = max(0, len(cand_idx) - max(1, most))  # objects not counted: a page each at least
        cand_idx = cand_idx[: len(cand_idx) - beyond]
        pages = -(-lengths[cand_idx] // g.page_size)
        # The quotas of the lease and its peer, when below the whole pool: the prefix of the batch that fits both.
        cumulative = np.cumsum(pages)
        for room, quota in rooms:
            within = cumulative <= room
            if within.all() and not (beyond and room == most):
                continue
            asked = int(pages.sum()) + beyond
            error = self._reservation_refusal(lease, quota, f"at least {asked}" if beyond else str(asked))
            beyond = 0  # told once, by the quota that cut the batch
            if not within.any():
                self._refuse(lease, error)
            self._cut_short(lease, error)
            cand_idx, pages, cumulative = cand_idx[within], pages[within], cumulative[within]
        starts = self._place_in_window(lease, pages)
        placed = starts >= 0
        if not placed.any():
            raise NoSpace(
                f"no room for any of {len(cand_idx)} objects ({int(pages.sum())} pages) in a pool of "
                f"{g.num_pages} pages: the rest is pinned or reserved, or kept for other peers (their fair "
                "share of the pool)"
            )
        return cand_idx[placed], starts[placed], pages[placed]

    def _refuse_at_quota(self, lease: Lease, lengths: np.ndarray) -> None:
        """Refuse a large batch before its keys are looked up when the lease or its peer has no
        page left under its quota (``QuotaExceeded``): a flood of reserves at the quota then
        costs a step each, not a look-up of every key. The refusal gives what the batch asks
        for at least, a page per object: summing its exact pages took 0.4 ms for 131,072 objects."""
        for room, quota in self._reservation_rooms(lease):
            if room <= 0:
                self._refuse(lease, self._reservation_refusal(lease, quota, f"at least {len(lengths)}"))

    def _refuse_when_full(self, lease: Lease, n: int) -> None:
        """Refuse a large batch before its keys are looked up when the pool has no free page
        and nothing ``lease`` may evict (``NoSpace``): none of its keys could be given a slot,
        and a flood of such reserves would cost a hash and a look-up of every key each (13 ms
        of the index for 131,072 keys on the 2-core VM, bench/RESULTS.md). What it may evict is
        what one page of its own would evict (its windows' budget, fair shares): a larger batch
        may evict no more. A batch of keys all stored already gets this answer too, not "all
        present": either way its writer stores nothing."""
        if self._alloc.free_pages or self._clock() < self._quarantine_until:
            return
        if self._evict_budget(lease)[0] >= 1 and len(self._victims(1, lease, 1)):
            return
        raise NoSpace(
            f"no room for any of {n} objects: every page of the pool's {self.geometry.num_pages} is "
            "reserved, pinned or fenced, and what is committed is kept for other peers (their fair "
            "share of the pool) or past this lease's eviction window"
        )

    def _reservation_rooms(self, lease: Lease) -> list[tuple[int, str]]:
        """``(pages left, quota)`` of the lease's and its peer's quotas of pages held,
        those below the whole pool (the lease's first)."""
        total, rooms = self.geometry.num_pages, []
        if self.max_lease_pages < total:
            rooms.append((self.max_lease_pages - lease.held_pages, "reservations"))
        if self.max_peer_pages < total:
            rooms.append((self.max_peer_pages - lease.account.held_pages, "peer_reservations"))
        return rooms

    def _reservation_refusal(self, lease: Lease, quota: str, asked: str) -> QuotaExceeded:
        """The refusal of a batch over the lease's or its peer's quota; ``asked``: the pages it asks for."""
        total, account = self.geometry.num_pages, lease.account
        if quota == "reservations":
            return QuotaExceeded(
                f"this lease holds {lease.held_pages} pages reserved or fenced and asks for {asked} more; a "
                f"lease may hold {self.max_lease_pages} of the pool's {total} pages (--max-lease-pool-fraction): "
                "commit or abort what it holds first")  # fmt: skip
        return QuotaExceeded(
            f"the {account.leases} leases of peer {account.peer} hold {account.held_pages} pages reserved or "
            f"fenced and this one asks for {asked} more; one peer's leases together may hold "
            f"{self.max_peer_pages} of the pool's {total} pages (--max-peer-pool-fraction): commit or abort "
            "what they hold first", quota)  # fmt: skip

    def _place_in_window(self, lease: Lease, pages: np.ndarray) -> np.ndarray:
        """``_place`` within what the lease and its peer may still evict in their
        windows: the pages evicted are charged to both; a batch the windows left
        without room is cut short, or refused (``QuotaExceeded``, naming the
        window that bound) when nothing of it fit while there were objects to
        evict."""
        now, window_s, account = self._clock(), self.evict_window_s, lease.account
        budget, windows, lefts = self._evict_budget(lease)
        before = self._evicted_pages
        starts = self._place(pages, budget, lease)
        for evicted, _ in windows:
            evicted.add(self._evicted_pages - before, now, window_s)
        if budget >= self._max_evict_pages or (starts >= 0).all():
            return starts
        missed = f"{int((starts < 0).sum())} of {len(pages)} objects got no slot; store them later"
        if windows[lefts.index(budget)][0] is lease.evicted:
            error = QuotaExceeded(
                f"this lease's reserves evicted {lease.evicted.pages(now, window_s)} pages in the last "
                f"{window_s:g} s; a lease may evict {self.max_lease_evict_pages} of the pool's "
                f"{self.geometry.num_pages} pages per window (--max-lease-evict-fraction per --evict-window): "
                f"{missed}", quota="evictions")  # fmt: skip
        else:
            error = QuotaExceeded(
                f"the reserves of peer {account.peer}'s leases evicted {account.evicted.pages(now, window_s)} pages "
                f"in the last {window_s:g} s, whatever leases or connections they came from; one peer may evict "
                f"{self.max_peer_evict_pages} of the pool's {self.geometry.num_pages} pages per window "
                f"(--max-peer-evict-fraction per --evict-window): {missed}", quota="peer_evictions")  # fmt: skip
        if not (starts >= 0).any() and self._evictable():
            self._refuse(lease, error)
        self._cut_short(lease, error)
        return starts

    def _evict_budget(self, lease: Lease) -> tuple[int, list[tuple[EvictionWindow, int]], list[int]]:
        """The pages ``lease``'s reserve may evict now (one reserve's bound, and what its
        lease's and its peer's windows have left), with those windows and what each has left."""
        now, window_s, account = self._clock(), self.evict_window_s, lease.account
        bounds = [(lease.evicted, self.max_lease_evict_pages), (account.evicted, self.max_peer_evict_pages)]
        windows = [(evicted, limit) for evicted, limit in bounds if limit is not None]
        lefts = [max(0, limit - evicted.pages(now, window_s)) for evicted, limit in windows]
        return min([self._max_evict_pages, *lefts]), windows, lefts

    def _evictable(self) -> bool:
        """Whether any object could be evicted (committed, unpinned)."""
        rec, hw = self._records, self._records.high_water
        return bool(np.any((rec.state[:hw] == State.COMMITTED) & (rec.pins[:hw] == 0)))

    # -- space --------------------------------------------------------------------------------

    def _evict(self, min_pages: int, claimant: Lease | None = None, incoming: int = 0) -> int:
        """Evict unpinned committed objects totalling at least ``min_pages`` pages, or all
        there may be; return the pages freed. For a reserve of ``claimant``'s placing
        ``incoming`` pages: by fair share (``maru_core.index.ownership``); else (``None``)
        least recently used first."""
        rec = self._records
        chosen = self._victims(min_pages, claimant, incoming)
        if not len(chosen):
            return 0
        freed = int(rec.pages[chosen].sum())
        self._release(chosen, State.COMMITTED)
        self._evictions += len(chosen)
        self._evicted_pages += freed
        return freed

    def _victims(self, min_pages: int, claimant: Lease | None = None, incoming: int = 0) -> np.ndarray:
        """The rows ``_evict`` would evict (nothing evicted here)."""
        rec, hw = self._records, self._records.high_water
        victims = np.flatnonzero((rec.state[:hw] == State.COMMITTED) & (rec.pins[:hw] == 0))
        if not len(victims) or min_pages <= 0:
            return victims[:0]
        if claimant is None:
            return ownership.oldest(rec, victims, min_pages)
        shares = self._owners.shares(self._holdings, claimant.account.peer, incoming, self._low_pages)
        return ownership.fair_victims(rec, victims, min_pages, shares)

    def _holdings(self, peer: str) -> int | None:
        """The pages ``peer``'s leases hold reserved or fenced; ``None`` when it has no
        account (no live lease, nor one within the eviction window)."""
        account = self._peers.get(peer)
        return None if account is None else account.held_pages

    def _place(self, pages: np.ndarray, budget: int, lease: Lease) -> np.ndarray:
        """First page for each object (-1 where none fits) of ``lease``'s batch, evicting
        as the watermarks say but never more than ``budget`` pages (at most
        ``max_evict_pages``)."""
        need = int(pages.sum())
        used = self._alloc.used_pages
        if used + need > self._high_pages:
            wanted = min(used + need - self._low_pages, budget)
            freed = self._evict(wanted, lease, need)
            budget = budget - freed if freed >= wanted else 0  # less than asked: nothing is left to evict
        start = self._alloc.allocate(need) if need <= self._alloc.largest_free else None
        if start is not None:
            return start + np.concatenate(([0], np.cumsum(pages)[:-1]))
        return self._place_each(pages, budget, lease)

    def _place_each(self, pages: np.ndarray, budget: int, lease: Lease) -> np.ndarray:
        """Place the objects of a batch that fits nowhere whole, in order: as many
        consecutive objects as the largest free extent holds go there with one
        allocation; an object that fits in no extent is given room by eviction,
        within ``budget`` pages. Once an object of ``n`` pages fits nowhere (and
        nothing more may be evicted for it), only smaller ones are tried. The
        work is thus bounded by what fits, not by the batch's length."""
        starts = np.full(len(pages), -1, dtype=np.int64)
        if budget < 1 and not self._alloc.largest_free:
            return starts  # a full pool with nothing to evict: a flood of reserves stops here, cheaply
        todo = np.arange(len(pages))
        while len(todo):
            largest = self._alloc.largest_free
            if not largest and budget < 1:
                break  # nothing fits any more and nothing may be evicted
            window = pages[todo[: largest + 1]]  # every object has a page at least: no more fit
            fit = int(np.searchsorted(np.cumsum(window), largest, side="right"))
            if fit > 1:
                run = todo[:fit]
                first = self._alloc.allocate(int(window[:fit].sum()))
                starts[run] = first + np.concatenate(([0], np.cumsum(window[: fit - 1])))
                todo = todo[fit:]
                continue
            i, count = int(todo[0]), int(pages[todo[0]])
            first = self._alloc.allocate(count)
            while first is None and budget >= count:
                freed = self._evict(count, lease, int(pages.sum()))
                if not freed:
                    break
                budget -= freed
                first = self._alloc.allocate(count)
            if first is None:
                rest = todo[1:]
                todo = rest[pages[rest] < count]
            else:
                starts[i] = first
                todo = todo[1:]
        return starts
