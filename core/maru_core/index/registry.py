"""The index's pure core: keys -> slots, pins, leases, eviction.

No I/O and no asyncio: the server wraps a ``Registry`` and calls it from one
thread. Every time comes from the injected ``clock``, so tests drive leases,
reservation timeouts and quarantine by hand. This module holds the writers and
the quotas; the leases are in ``maru_core.index.lease_book``, the readers and
pins in ``maru_core.index.reads``, placement and eviction in
``maru_core.index.placement``, listing and flushing by row range in
``maru_core.index.maintenance`` (its base classes).

Rules it keeps:

- Write-once: ``reserve`` hands out a slot only for a key that is neither
  committed nor reserved; an uncommitted key is invisible; ``commit`` makes a
  reserved key visible once, and only for the lease that reserved it.
- A pinned object is never evicted and its pages never reused; pins belong to
  a lease, counted once per object and lease (``leases.LeasePins``), and go
  when it is closed or lapses, in time set by the distinct objects it pins.
- Reservations go when aborted, when their lease lapses, or
  ``reservation_ttl_s`` after ``reserve`` if still uncommitted. The pages of
  a reservation that lapsed are fenced (``maru_core.index.fencing``): not
  reused while its writer's lease lives, nor for ``fence_grace_s`` after it
  ends, unless the writer commits or aborts the key first; a late copy of a
  lapsed writer can never land in another writer's object.
- Eviction: when a reserve would push used pages (reserved + committed) above
  ``high_watermark`` of the capacity, committed unpinned objects are evicted
  until used pages plus the reserve fit under ``low_watermark``, by fair
  share among the peers (``maru_core.index.ownership``: each object's owner
  is the peer that committed it): the least recently used of those above
  their owners' shares (or whose owner holds no lease) first, then the
  reserving peer's own, then anyone's only while that peer is within its
  share. A peer alone has the whole pool, least recently used first. When
  free space is fragmented, more are evicted until each object fits. One reserve never evicts more than
  ``max_evict_fraction`` of the pool's pages, and one lease's reserves never
  more than ``max_lease_evict_fraction`` of them within ``evict_window_s``:
  the items that do not fit then get no slot, so neither one batch nor a few
  in a row can wipe the cache.
- Quotas per lease (``maru_core.index.quotas``): pages held reserved or
  fenced, pages of the objects pinned, pages evicted lately; the same three
  per peer, summed over the leases it opened (``peer_accounts``: the peer
  given to ``open_lease``, whose account a resumed lease keeps). A call past one
  raises ``QuotaExceeded``; one cut short by one answers what fit. Both are
  told to ``quota_listener`` (the server counts and logs them).
- After ``restore`` (an index restarted over a pool that was in use) no slot
  is handed out for ``quarantine_s``: copies that were in flight across the
  restart, whose pins and reservations died with the old index, finish first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import NoReturn

import numpy as np

from maru_core.index.allocator import ExtentAllocator
from maru_core.index.fencing import LapsedFence
from maru_core.index.lease_book import LeaseBook
from maru_core.index.leases import Lease
from maru_core.index.maintenance import Maintenance
from maru_core.index.ownership import RESTORED, Owners
from maru_core.index.peer_accounts import DEFAULT_MAX_IDLE_ACCOUNTS, PeerAccounts
from maru_core.index.placement import Placement
from maru_core.index.quotas import EVICT_WINDOW_S
from maru_core.index.reads import Reads
from maru_core.index.restore import select_restorable
from maru_core.index.records import RecordTable, State
from maru_core.index.records import KEY_BYTES
from maru_core.index.registry_types import (
    BadRequest,
    ExpiryReport,
    Keys,
    checked_lengths,
    first_occurrences,
    joined_keys,
    select_keys,
    split_items,
    NoLease,
    NoSpace,
    ObjectInfo,
    Quarantined,
    QuotaExceeded,
    RegistryError,
    RegistryStats,
)
from maru_core.pool.geometry import PoolGeometry
from maru_core.protocol.locations import Location, SlotList

#: The largest share of the pool's pages one ``reserve`` may evict.
MAX_EVICT_FRACTION = 0.25
#: The share of the pool's pages one lease may hold reserved or fenced: an
#: engine reserves one step's stores at a time, far below it; a client that
#: reserves without committing cannot take the pool from the others.
MAX_LEASE_POOL_FRACTION = 0.5
#: How long a lapsed reservation's pages stay fenced while its writer's lease
#: lives (after the lease ends: ``fence_grace_s``). Loads verify payloads, so a
#: copy that lands later is caught at read time (``fencing.py``).
MAX_FENCE_S = 120.0

#: ``verify(keys, offsets, generations) -> one bool per key`` (see ``Registry.commit``).
Verify = Callable[[bytes, np.ndarray, np.ndarray], Sequence[bool] | np.ndarray]

#: ``record(offsets)``: record the commit of the objects at these data offsets (see ``Registry.commit``).
Record = Callable[[np.ndarray], object]

#: ``listener(quota, client, message)``: a quota refused or cut short a call of ``client``'s lease.
QuotaListener = Callable[[str, str, str], object]

__all__ = [
    "BadRequest",
    "ExpiryReport",
    "NoLease",
    "NoSpace",
    "ObjectInfo",
    "Quarantined",
    "Registry",
    "RegistryError",
    "RegistryStats",
]


class Registry(LeaseBook, Reads, Placement, Maintenance):
    """Keys -> slots of one pool (see the module docstring for the rules).

    ``geometry`` is the pool's; ``lease_ttl_s`` how long a lease lives
    without a call or ``renew``; ``reservation_ttl_s`` how long a reservation
    may stay uncommitted; ``high_watermark``/``low_watermark`` (fractions of
    capacity, ``0 < low <= high <= 1``) drive eviction; ``quarantine_s``
    (default ``lease_ttl_s``) is how long no slot is handed out after
    ``restore``; ``fence_grace_s`` (default ``reservation_ttl_s``) how long
    the pages of a lapsed reservation stay fenced after its lease ends;
    ``clock`` returns seconds; ``first_generation`` seeds the generation
    counter; ``max_evict_fraction`` bounds what one reserve may evict (a
    share of the pool's pages); ``max_lease_pages_fraction`` the share of the
    pool's pages one lease may hold reserved or fenced, and ``max_fence_s`` how
    long a lapsed reservation stays fenced while its writer's lease lives;
    ``max_lease_pin_fraction`` the share of the pool's pages one lease may pin
    (its distinct objects' pages); ``max_lease_evict_fraction`` the share one
    lease's reserves may evict within ``evict_window_s`` (``None``: no window);
    ``max_peer_pages_fraction``, ``max_peer_pin_fraction`` and
    ``max_peer_evict_fraction`` the same for all the leases of one peer
    together (``open_lease``'s ``peer``), whose accounts outlive their last
    lease by ``evict_window_s`` (``max_idle_peer_accounts`` of them at most).
    No quota binds by default here; the index's defaults
    (``MAX_LEASE_POOL_FRACTION``, ``MAX_FENCE_S`` and those of
    ``maru_core.index.quotas``, per lease and per peer) are set by ``build_service``.
    """

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        lease_ttl_s: float = 10.0,
        reservation_ttl_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        quarantine_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_generation: int = 1,
        fence_grace_s: float | None = None,
        max_evict_fraction: float = MAX_EVICT_FRACTION,
        max_fence_s: float = math.inf,
        max_lease_pages_fraction: float = 1.0,
        max_lease_pin_fraction: float = 1.0,
        max_lease_evict_fraction: float | None = None,
        evict_window_s: float = EVICT_WINDOW_S,
        max_peer_pages_fraction: float = 1.0,
        max_peer_pin_fraction: float = 1.0,
        max_peer_evict_fraction: float | None = None,
        max_idle_peer_accounts: int = DEFAULT_MAX_IDLE_ACCOUNTS,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={low_watermark}, high={high_watermark}"
            )
        if lease_ttl_s <= 0 or reservation_ttl_s <= 0:
            raise ValueError("lease_ttl_s and reservation_ttl_s must be positive")
        if not 0 < max_evict_fraction <= 1:
            raise ValueError(f"max_evict_fraction must be in (0, 1], got {max_evict_fraction}")
        fractions = {"max_lease_pages_fraction": max_lease_pages_fraction,
                     "max_lease_pin_fraction": max_lease_pin_fraction,
                     "max_lease_evict_fraction": max_lease_evict_fraction,
                     "max_peer_pages_fraction": max_peer_pages_fraction,
                     "max_peer_pin_fraction": max_peer_pin_fraction,
                     "max_peer_evict_fraction": max_peer_evict_fraction}  # fmt: skip
        for name, fraction in fractions.items():
            if fraction is not None and not 0 < fraction <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {fraction}")
        if not 0 < evict_window_s < math.inf:
            raise ValueError(f"evict_window_s must be a positive number of seconds, got {evict_window_s}")
        if first_generation < 1:
            raise ValueError(f"first_generation must be at least 1, got {first_generation}")
        self.geometry = geometry
        self.lease_ttl_s = float(lease_ttl_s)
        self.reservation_ttl_s = float(reservation_ttl_s)
        self.quarantine_s = self.lease_ttl_s if quarantine_s is None else float(quarantine_s)
        self._high_pages = math.floor(high_watermark * geometry.num_pages)
        self._low_pages = math.floor(low_watermark * geometry.num_pages)
        self._max_evict_pages = max(1, math.floor(max_evict_fraction * geometry.num_pages))
        self.max_lease_pages = max(1, math.floor(max_lease_pages_fraction * geometry.num_pages))
        self.max_lease_pin_pages = max(1, math.floor(max_lease_pin_fraction * geometry.num_pages))
        self.max_lease_evict_pages = self._pages_of(max_lease_evict_fraction)
        self.max_peer_pages = max(1, math.floor(max_peer_pages_fraction * geometry.num_pages))
        self.max_peer_pin_pages = max(1, math.floor(max_peer_pin_fraction * geometry.num_pages))
        self.max_peer_evict_pages = self._pages_of(max_peer_evict_fraction)
        self._peers = PeerAccounts(max_idle_peer_accounts)
        self._owners = Owners()
        self.evict_window_s = float(evict_window_s)
        self.quota_listener: QuotaListener | None = None
        self._clock = clock
        self._records = RecordTable(geometry.num_pages)  # an object spans a page at least
        self._alloc = ExtentAllocator(geometry.num_pages)
        self._leases: dict[str, Lease] = {}
        self._lease_by_number: dict[int, Lease] = {}
        self._next_lease_number = 0
        self._next_generation = first_generation
        self._tick = 1
        self._reserved_pages = 0
        self._reserved_keys = 0
        self._committed_pages = 0
        self._committed_keys = 0
        self._pinned_keys = 0
        self._pinned_pages = 0
        self._evictions = 0
        self._evicted_pages = 0
        self._quarantine_until = -math.inf
        self._stale_from = math.inf  # no reservation lapses before this (a lower bound: expiry looks no sooner)
        grace = self.reservation_ttl_s if fence_grace_s is None else fence_grace_s
        self._fence = LapsedFence(grace, max(grace, max_fence_s))
        self._additions = 0

    def _pages_of(self, fraction: float | None) -> int | None:
        return None if fraction is None else max(1, math.floor(fraction * self.geometry.num_pages))

    # -- quotas ---------------------------------------------------------------------------------

    def _refuse(self, lease: Lease, error: QuotaExceeded) -> NoReturn:
        """A quota refuses a call of ``lease``: tell the listener, raise ``error``."""
        self._cut_short(lease, error)
        raise error

    def _cut_short(self, lease: Lease, error: QuotaExceeded) -> None:
        """A quota cut a call of ``lease`` short (it answers what fit): tell the listener."""
        if self.quota_listener is not None:
            self.quota_listener(error.quota, lease.client, str(error))

    @property
    def peer_accounts(self) -> PeerAccounts:
        """The peers' accounts (``peer_accounts``), for inspection."""
        return self._peers

    def owned_pages(self) -> dict[str, int]:
        """Committed pages by owner: the peer that committed them, or ``ownership.RESTORED``."""
        return self._owners.owned()

    # -- writers --------------------------------------------------------------------------------

    def reserve(self, lease_id: str, items: Sequence[tuple[bytes, int]]) -> SlotList:
        """A slot per ``(key, length)`` item, in order (see ``reserve_packed``)."""
        keys, lengths = split_items(items)
        return self.reserve_packed(lease_id, keys, lengths)

    def reserve_packed(self, lease_id: str, keys: Keys, lengths: Sequence[int] | np.ndarray,
                       candidates: np.ndarray | None = None) -> SlotList:  # fmt: skip
        """A slot per key, of ``lengths[i]`` bytes for ``keys[i]``, in order, or
        ``None`` for a key already committed or reserved (or repeated in the
        batch) or that does not fit even after eviction.

        The batch's objects are placed contiguously, in order, when one free
        extent holds them all, so a reader can copy adjacent objects at once.
        Raises ``NoSpace`` when no new item could be placed, ``BadRequest``
        for a key that is not 16 bytes or a length that is not positive.
        ``candidates`` may carry ``absent_keys(keys) & first_occurrences(keys)``
        computed earlier (in slices) while ``additions`` stayed the same: it is
        then exact but for keys removed since, which are answered as present (a
        miss, never a duplicate).
        """
        lease = self._lease(lease_id)
        joined = joined_keys(keys)
        lengths = checked_lengths(lengths, len(joined) // KEY_BYTES)
        if candidates is None or len(candidates) != len(lengths):
            candidates = (self._records.lookup(joined) < 0) & first_occurrences(joined)
        if not candidates.any():
            return SlotList(bytes(len(joined)))
        idx, starts, pages = self._place_candidates(lease, candidates, lengths)
        chosen = joined if len(idx) == len(candidates) else select_keys(joined, idx)
        rows = self._add_reserved(lease, chosen, starts, pages, lengths[idx])
        words = np.zeros((len(candidates), 2), dtype="<u8")
        self._fill_slots(words, idx, starts, rows)
        return SlotList(words.data.cast("B") if len(words) else b"")  # no copy: the words are this call's own

    def absent_keys(self, keys: Keys) -> np.ndarray:
        """Which of ``keys`` no record holds (a read, for a reserve looked up in slices)."""
        return self._records.lookup(joined_keys(keys)) < 0

    @property
    def additions(self) -> int:
        """Counts batches of records added: unchanged, an ``absent_keys`` answer still holds."""
        return self._additions

    def _add_reserved(self, lease: Lease, keys: bytes, starts: np.ndarray, pages: np.ndarray,
                      lengths: np.ndarray) -> np.ndarray:  # fmt: skip
        rec = self._records
        self._additions += 1
        rows = rec.add(keys)
        n = len(rows)
        rec.page[rows] = starts
        rec.offset[rows] = starts * self.geometry.page_size + self.geometry.data_offset
        rec.pages[rows] = pages
        rec.length[rows] = lengths
        rec.generation[rows] = np.arange(self._next_generation, self._next_generation + n, dtype=np.int64)
        self._next_generation += n
        rec.state[rows] = State.RESERVED
        rec.owner[rows] = lease.number
        deadline = self._clock() + self.reservation_ttl_s
        rec.deadline[rows] = deadline
        self._stale_from = min(self._stale_from, deadline)
        self._reserved_pages += int(pages.sum())
        self._reserved_keys += n
        lease.held_pages += int(pages.sum())
        return rows

    def commit(self, lease_id: str, keys: Keys, verify: Verify | None = None,
               record: Record | None = None) -> list[bool]:  # fmt: skip
        """Make reserved keys visible; one bool per key, in order.

        ``False`` for a key this lease has not reserved (never reserved,
        aborted, expired, already committed: commits are write-once, the
        first one stands) and for a key that ``verify`` rejects (the server's
        check of the slot headers): its slot is released. ``verify(keys,
        offsets, generations)`` gets the keys about to be committed (packed),
        their slots' data offsets and generations (int64 arrays), and returns
        one bool per key. ``record(offsets)`` then gets the data offsets of
        exactly the keys this call commits, before any of them becomes
        visible (the server marks their slot headers committed: what a
        restart restores).
        """
        lease = self._lease(lease_id)
        rec = self._records
        joined = joined_keys(keys)
        rows, ok = self._lookup_in_state(joined, State.RESERVED)
        ok &= rec.owner.take(rows) == lease.number
        if ok.any():
            ok &= first_occurrences(joined)
        if verify is not None and ok.any():
            idx = np.flatnonzero(ok)
            mine = rows.take(idx)
            offsets, generations = rec.offset[mine], rec.generation[mine]
            good = np.asarray(verify(select_keys(joined, idx), offsets, generations), dtype=bool)
            if good.shape != idx.shape:
                raise RegistryError(f"verify answered {good.shape} for {len(idx)} keys")
            ok[idx[~good]] = False
            lease.held_pages -= int(rec.pages.take(mine[~good]).sum())
            self._release(mine[~good], State.RESERVED)
        done = rows[ok]
        if record is not None and len(done):
            record(rec.offset[done])
        pages = int(rec.pages.take(done).sum())
        rec.state[done] = State.COMMITTED
        rec.owner[done] = -1
        self._owners.own(rec.peer, done, lease.account.peer, pages)
        lease.held_pages -= pages
        self._reserved_pages -= pages
        self._reserved_keys -= len(done)
        self._committed_pages += pages
        self._committed_keys += len(done)
        self._touch(done)
        self._end_fence_of_writer(lease, joined, ok)
        return ok.tolist()

    def abort(self, lease_id: str, keys: Keys) -> int:
        """Release this lease's reservations of ``keys``; return how many."""
        lease = self._lease(lease_id)
        rec = self._records
        rows, reserved = self._lookup_in_state(keys, State.RESERVED)
        held = reserved & (rec.owner[rows] == lease.number)
        mine = np.unique(rows[held])
        lease.held_pages -= int(rec.pages[mine].sum())
        self._release(mine, State.RESERVED)
        self._end_fence_of_writer(lease, joined_keys(keys), held)
        return len(mine)

    # -- space ----------------------------------------------------------------------------------

    def _release(self, rows: np.ndarray, state: State) -> None:
        """Free the pages and records at ``rows`` (distinct, all in ``state``)."""
        if not len(rows):
            return
        rec = self._records
        pages = int(rec.pages[rows].sum())
        self._alloc.free_runs(rec.page[rows], rec.pages[rows])
        if state == State.COMMITTED:
            self._owners.disown(rec.peer[rows], rec.pages[rows])
        rec.remove(rows)
        if state == State.RESERVED:
            self._reserved_pages -= pages
            self._reserved_keys -= len(rows)
        else:
            self._committed_pages -= pages
            self._committed_keys -= len(rows)

    # -- fencing of lapsed writers ------------------------------------------------------------

    def _fence_lapsed(self, rows: np.ndarray) -> None:
        """Drop the lapsed reservations at ``rows`` (distinct, reserved) but keep their pages
        allocated, in the fence: their writer may still be copying into them."""
        if not len(rows):
            return
        rec = self._records
        self._fence.hold(rec.keys.take(rows, axis=0), rec.page[rows], rec.pages[rows], rec.owner[rows],
                         lambda number: number in self._lease_by_number, self._clock())  # fmt: skip
        rec.remove(rows)
        self._reserved_keys -= len(rows)  # the pages stay counted as reserved until freed

    def _free_fenced(self, runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        starts, counts, owners = runs
        if not len(starts):
            return
        self._alloc.free_runs(starts, counts)
        self._reserved_pages -= int(counts.sum())
        for owner, pages in zip(owners.tolist(), counts.tolist()):
            lease = self._lease_by_number.get(owner)
            if lease is not None:  # a live writer's quota gets the pages back
                lease.held_pages -= pages

    def _end_fence_of_writer(self, lease: Lease, joined: bytes, handled: np.ndarray) -> None:
        """The writer committed or aborted ``joined``'s keys: fenced runs of those it no
        longer holds (``handled`` false) can go, since it sends those calls after its copy."""
        if not len(self._fence):
            return
        words = np.frombuffer(joined, dtype="<u8").reshape(-1, 2)
        self._free_fenced(self._fence.writer_done(lease.number, words[~np.asarray(handled, dtype=bool)]))

    @property
    def fenced_pages(self) -> int:
        """Pages of lapsed reservations held back from reuse (part of ``reserved_bytes``)."""
        return self._fence.pages

    # -- a truncated pool file ------------------------------------------------------------------

    def drop_pages_from(self, first_page: int) -> tuple[np.ndarray, np.ndarray]:
        """The pool's pages from ``first_page`` on were lost (a truncated file,
        ``maru_core.pool.truncation``): drop the unpinned committed objects
        there, fence the reservations (their writers may still copy), and
        return ``(offsets, lengths)`` of every committed object there, pinned
        ones included, whose slot headers the caller clears: a pinned one stays
        until unpinned and evicted, and its readers find no header (a miss)."""
        rec, hw = self._records, self._records.high_water
        lost = rec.page[:hw] + rec.pages[:hw] > first_page
        committed = np.flatnonzero(lost & (rec.state[:hw] == State.COMMITTED))
        offsets, lengths = rec.offset[committed].copy(), rec.length[committed].copy()
        self._release(committed[rec.pins[committed] == 0], State.COMMITTED)
        self._fence_lapsed(np.flatnonzero(lost & (rec.state[:hw] == State.RESERVED)))
        return offsets, lengths

    # -- restart --------------------------------------------------------------------------------

    def restore(self, objects: Iterable[tuple[bytes, Location]]) -> int:
        """Rebuild from the pool's slot headers after a restart; return how many objects were kept.

        ``objects`` are ``(key, Location)`` pairs of committed objects only
        (``Pool.iter_slot_headers(SlotState.COMMITTED)``: a header the
        writer wrote records no commit). Objects that lie outside the data area
        are skipped; of two with one key, or two that overlap, the higher
        generation wins. Must be called before any reserve. Starts the
        quarantine: no slot is handed out for ``quarantine_s``.
        """
        if len(self._records):
            raise RegistryError("restore rebuilds an empty registry; this one already holds objects")
        keys, pages, counts, lengths, gens = select_restorable(objects, self.geometry)
        self._quarantine_until = self._clock() + self.quarantine_s
        if not keys:
            return 0
        self._alloc = ExtentAllocator.from_occupied(self.geometry.num_pages, pages, counts)
        rec = self._records
        self._additions += 1
        rows = rec.add(keys)
        rec.page[rows], rec.pages[rows], rec.length[rows], rec.generation[rows] = pages, counts, lengths, gens
        rec.offset[rows] = pages * self.geometry.page_size + self.geometry.data_offset
        rec.state[rows] = State.COMMITTED
        self._owners.own(rec.peer, rows, RESTORED, int(counts.sum()))  # the headers name no peer
        # Older generations count as less recently used.
        order = np.argsort(gens, kind="stable")
        rec.last_used[rows[order]] = self._tick + np.arange(len(rows), dtype=np.int64)
        self._tick += len(rows) + 1
        self._committed_pages = int(counts.sum())
        self._committed_keys = len(rows)
        self._next_generation = max(self._next_generation, int(gens.max()) + 1)
        return len(rows)

    # -- inspection -----------------------------------------------------------------------------

    def describe(self, key: bytes) -> ObjectInfo | None:
        """The record of ``key``, or ``None`` when the index does not know it."""
        row = self._records.row_of(key)
        if row is None:
            return None
        rec = self._records
        owner = self._lease_by_number.get(int(rec.owner[row]))
        pins = sum(lease.pins.count_of(row) for lease in self._leases.values()) if rec.pins[row] else 0
        return ObjectInfo(
            state="committed" if rec.state[row] == State.COMMITTED else "reserved",
            offset=int(rec.offset[row]),
            length=int(rec.length[row]),
            generation=int(rec.generation[row]),
            pins=pins,
            lease_id=owner.lease_id if owner else None,
        )

    def stats(self) -> RegistryStats:
        page = self.geometry.page_size
        return RegistryStats(
            capacity_bytes=self.geometry.num_pages * page,
            free_bytes=self._alloc.free_pages * page,
            reserved_bytes=self._reserved_pages * page,
            committed_bytes=self._committed_pages * page,
            pinned_bytes=self._pinned_pages * page,
            largest_free_bytes=self._alloc.largest_free * page,
            keys=self._committed_keys,
            reserved_keys=self._reserved_keys,
            pinned_keys=self._pinned_keys,
            evictions=self._evictions,
            leases=len(self._leases),
            quarantined=self._clock() < self._quarantine_until,
        )

