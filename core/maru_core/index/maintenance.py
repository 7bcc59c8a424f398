"""The registry's part for an operator's inspection and flush: committed
records read a range of rows at a time, and evicted on request.

A part of ``maru_core.index.registry.Registry`` (its base class). Rows are
the record table's row numbers, a stable order to page through: a listing or
a flush walks ``[cursor, cursor + n)`` ranges of them, each range read (and
acted on) in one step, so what a step sees is consistent; between steps the
index serves others, and objects stored or evicted meanwhile may be counted
(or flushed) or not.

A flush removes committed, unpinned records only: a reservation (a store in
flight) is no committed record, a pinned object is skipped and counted, and
the fenced pages of lapsed writers are no records at all (they stay until
the fence lets them go). What it evicts is charged to the lease's and its
peer's eviction windows like a reserve's evictions, so a token holder cannot
wipe the cache faster than its quotas let a reserve.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np

from maru_core.index.records import RecordTable, State
from maru_core.index.registry_types import QuotaExceeded

if TYPE_CHECKING:
    from maru_core.index.leases import Lease
    from maru_core.index.quotas import EvictionWindow
    from maru_core.pool.geometry import PoolGeometry


@dataclasses.dataclass(frozen=True)
class CommittedRows:
    """The committed records of a range of rows, as parallel arrays (one entry per object)."""

    rows: np.ndarray
    keys: bytes  # packed, 16 bytes each
    offsets: np.ndarray
    generations: np.ndarray
    lengths: np.ndarray
    pages: np.ndarray
    pinned: np.ndarray  # bool: pinned by some lease
    next_cursor: int | None  # the row to read from next; None: the range reached the table's end


@dataclasses.dataclass(frozen=True)
class FlushOutcome:
    """What one ``flush_rows`` did: objects and pages evicted, pinned objects skipped,
    objects left because an eviction window was used up (``quota`` names it)."""

    evicted: int
    evicted_pages: int
    pinned: int
    held_back: int
    quota: str | None


class Maintenance:
    """Reads and flushes of committed records by row range (state of a ``Registry``)."""

    geometry: "PoolGeometry"
    evict_window_s: float
    max_lease_evict_pages: int | None
    max_peer_evict_pages: int | None
    _records: RecordTable
    _clock: Callable[[], float]
    _lease: Callable[[str], "Lease"]
    _release: Callable[[np.ndarray, State], None]
    _cut_short: Callable[["Lease", QuotaExceeded], None]

    def committed_rows(self, cursor: int, count: int) -> CommittedRows:
        """The committed records among rows ``[cursor, cursor + count)``."""
        rec = self._records
        end = min(cursor + count, rec.high_water)
        start = min(cursor, end)
        rows = start + np.flatnonzero(rec.state[start:end] == State.COMMITTED)
        return CommittedRows(
            rows=rows,
            keys=rec.keys.take(rows, axis=0).tobytes(),
            offsets=rec.offset[rows],
            generations=rec.generation[rows],
            lengths=rec.length[rows],
            pages=rec.pages.take(rows),
            pinned=rec.pins.take(rows) > 0,
            next_cursor=cursor + count if cursor + count < rec.high_water else None,
        )

    def flush_rows(self, lease_id: str, found: CommittedRows, chosen: np.ndarray) -> FlushOutcome:
        """Evict the objects of ``found`` (read by ``committed_rows`` in this same step)
        where ``chosen`` is true, but those pinned, in row order, within what the
        lease and its peer may still evict in their windows."""
        lease = self._lease(lease_id)
        rec = self._records
        rows = found.rows[chosen]
        # Read in this step, so still committed and unpinned as read; checked again all the same.
        rows = rows[rec.state.take(rows) == State.COMMITTED]
        pinned = rec.pins.take(rows) > 0
        rows = rows[~pinned]
        pages = rec.pages.take(rows)
        budget, window = self._flush_budget(lease)
        held_back = 0
        if budget is not None:
            fits = np.cumsum(pages) <= budget
            held_back = int((~fits).sum())
            rows, pages = rows[fits], pages[fits]
        freed = int(pages.sum())
        self._release(rows, State.COMMITTED)
        now = self._clock()
        for evicted in (lease.evicted, lease.account.evicted):
            evicted.add(freed, now, self.evict_window_s)
        if held_back:
            assert window is not None
            self._cut_short(lease, self._flush_refusal(lease, window, held_back))
        return FlushOutcome(len(rows), freed, int(pinned.sum()), held_back, window if held_back else None)

    def _flush_budget(self, lease: Lease) -> tuple[int | None, str | None]:
        """Pages the lease may still evict, and the quota that bounds it (``None``: no window binds)."""
        now, window_s = self._clock(), self.evict_window_s
        bounds: list[tuple[EvictionWindow, int | None, str]] = [
            (lease.evicted, self.max_lease_evict_pages, "evictions"),
            (lease.account.evicted, self.max_peer_evict_pages, "peer_evictions"),
        ]
        lefts = [(max(0, limit - evicted.pages(now, window_s)), quota)
                 for evicted, limit, quota in bounds if limit is not None]  # fmt: skip
        if not lefts:
            return None, None
        return min(lefts)

    def _flush_refusal(self, lease: Lease, quota: str, held_back: int) -> QuotaExceeded:
        if quota == "evictions":
            limit, flag = self.max_lease_evict_pages, "--max-lease-evict-fraction"
        else:
            limit, flag = self.max_peer_evict_pages, "--max-peer-evict-fraction"
        return QuotaExceeded(
            f"flush left {held_back} objects: this {'lease' if quota == 'evictions' else 'peer'} may evict "
            f"{limit} of the pool's {self.geometry.num_pages} pages per {self.evict_window_s:g} s ({flag} per "
            "--evict-window); the flush goes on once the window allows", quota)  # fmt: skip
