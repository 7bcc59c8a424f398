"""Who owns each committed object, and eviction by fair share among the peers.

Within its eviction quotas (``maru_core.index.quotas``) a peer's stores used
to evict whatever was least recently used: a token holder storing without
end aged out every other client's objects. So each committed object records
its owner, the peer whose lease committed it (the records' ``peer`` column,
an owner id of ``Owners``), and ``Owners`` keeps the committed pages of each.

Fair share: the pages up to the low watermark (what eviction brings the pool
down to) divided among the peers that hold a live lease (or did within the
eviction window: they have a ``PeerAccount``) and own committed objects, the
reserving peer always counted. A peer's use is its committed pages plus the
pages its leases hold reserved or fenced, plus, for the reserving peer, the
pages of the batch being placed. A reserve that must evict takes
(``fair_victims``):

1. the least recently used of the objects above their owners' shares: for
   each peer over its share the oldest of its unpinned objects that cover
   the excess (the last may take it below its share by less than one
   object's pages), together with every object of owners that hold no
   lease, merged and taken oldest first;
2. then the reserving peer's own objects, oldest first;
3. then, only if the reserving peer is not over its share, the least
   recently used objects of anyone (free space held by fenced pages, or
   fragmentation: the eviction that existed before).

So a peer storing without end evicts its own objects once over its share,
and nobody else's below theirs; a peer alone has the whole pool, as before.
Objects of owners without a lease go first: an engine's pod that went away
(a pod that comes back has a new address, another peer) keeps no share of
the pool, and neither do the objects ``restore`` brings back after a restart
(their slot headers name no peer): they belong to the one owner
``RESTORED``, which never holds a lease.

Cost: the records stay columns; a reserve that evicts reads the evictable
rows once (as eviction did before) and sorts the oldest candidates only,
more of them while too few fit the excesses (at worst all candidates, as a
full LRU eviction did). Per owner: a dict entry and an int64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from maru_core.index.records import RecordTable

#: The owner of the objects ``restore`` brought back (no address or user looks like it).
RESTORED = "(restored)"

_EMPTY = np.zeros(0, dtype=np.int64)


class Owners:
    """Owner ids of the peers that own committed objects, and each one's committed pages.

    An id is given on a peer's first commit and taken back once it owns no
    page (ids are reused): memory follows the owners, at most one per object.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._names: list[str | None] = []  # by id; None: a free id
        self._free: list[int] = []
        self.pages = np.zeros(16, dtype=np.int64)  # committed pages by id

    def __len__(self) -> int:
        return len(self._ids)

    def own(self, column: np.ndarray, rows: np.ndarray, peer: str, pages: int) -> None:
        """``peer`` committed the objects at ``rows`` (``pages`` pages in all): mark them its own
        in the records' ``column``."""
        if not len(rows):
            return
        oid = self._ids.get(peer)
        if oid is None:
            oid = self._free.pop() if self._free else len(self._names)
            if oid == len(self._names):
                self._names.append(None)
                if oid >= len(self.pages):
                    self.pages = np.concatenate((self.pages, np.zeros(len(self.pages), dtype=np.int64)))
            self._ids[peer], self._names[oid] = oid, peer
        column[rows] = oid
        self.pages[oid] += pages

    def disown(self, owners: np.ndarray, pages: np.ndarray) -> None:
        """Committed objects of these owner ids, of these pages each, went."""
        if not len(owners):
            return
        n = len(self._names)
        gone = np.bincount(owners, weights=pages, minlength=n).astype(np.int64)
        self.pages[:n] -= gone
        for oid in np.flatnonzero((gone > 0) & (self.pages[:n] == 0)).tolist():
            name = self._names[oid]
            assert name is not None
            del self._ids[name]
            self._names[oid] = None
            self._free.append(oid)

    def owned(self) -> dict[str, int]:
        """Committed pages by owner (a peer, or ``RESTORED``), for inspection."""
        return {peer: int(self.pages[oid]) for peer, oid in self._ids.items()}

    def shares(self, holdings: Callable[[str], int | None], claimant: str, incoming: int,
               low_pages: int) -> Shares:  # fmt: skip
        """The fair shares when ``claimant`` places ``incoming`` pages (see the module docstring).
        ``holdings(peer)``: the pages the peer's leases hold reserved or fenced, or ``None``
        when it holds no lease (its objects are kept for nobody)."""
        excess = np.zeros(max(1, len(self._names)), dtype=np.int64)
        claimant_id = self._ids.get(claimant)
        use: dict[int, int] = {}  # owner id -> pages used, of the owners with a lease
        for peer, oid in self._ids.items():
            held = holdings(peer)
            if held is None and oid != claimant_id:
                excess[oid] = self.pages[oid]  # no lease: nothing is kept for it
            else:
                use[oid] = int(self.pages[oid]) + (held or 0)
        share = low_pages // (len(use) + (claimant_id is None))
        claimant_use = (use[claimant_id] if claimant_id is not None else holdings(claimant) or 0) + incoming
        if claimant_id is not None:
            use[claimant_id] = claimant_use
        for oid, pages in use.items():
            excess[oid] = max(0, pages - share)
        return Shares(excess, share, claimant_id, claimant_use - share)


@dataclasses.dataclass(frozen=True)
class Shares:
    """What ``Owners.shares`` computed for one eviction."""

    excess: np.ndarray  # by owner id: pages of its objects that go before anyone is below its share
    share: int  # pages kept for each peer with a lease that owns objects
    claimant: int | None  # the reserving peer's owner id (None: it owns nothing)
    claimant_excess: int  # how far the reserving peer is over its share, its batch included


def oldest(rec: RecordTable, rows: np.ndarray, min_pages: int) -> np.ndarray:
    """The least recently used of ``rows`` totalling at least ``min_pages`` pages (or all),
    oldest first; sorts only about as many as needed."""
    if not len(rows) or min_pages <= 0:
        return _EMPTY
    k = min(len(rows), max(16, int(1.25 * min_pages / rec.pages.take(rows).mean()) + 1))
    while True:
        chosen = rows[np.argpartition(rec.last_used.take(rows), k - 1)[:k]] if k < len(rows) else rows
        chosen = chosen[np.argsort(rec.last_used.take(chosen), kind="stable")]
        total = np.cumsum(rec.pages.take(chosen))
        if total[-1] >= min_pages or k == len(rows):
            return chosen[: int(np.searchsorted(total, min_pages)) + 1]
        k = min(len(rows), 2 * k)


def within_excess(rec: RecordTable, rows: np.ndarray, excess: np.ndarray, min_pages: int) -> np.ndarray:
    """Of ``rows``, oldest first, those that lie within their owner's excess (each
    owner's oldest, until the pages before one reach its ``excess``), totalling at
    least ``min_pages`` pages or all there are.

    Whether an object lies within depends only on its owner's older objects,
    all among the ``k`` oldest candidates when it is: those are sorted, more
    of them while too few lie within."""
    candidates = rows[excess.take(rec.peer.take(rows)) > 0]
    if not len(candidates) or min_pages <= 0:
        return _EMPTY
    k = min(len(candidates), max(16, int(1.25 * min_pages / rec.pages.take(candidates).mean()) + 1))
    while True:
        if k < len(candidates):
            chosen = candidates[np.argpartition(rec.last_used.take(candidates), k - 1)[:k]]
        else:
            chosen = candidates
        chosen = chosen[np.argsort(rec.last_used.take(chosen), kind="stable")]
        owners, pages = rec.peer.take(chosen), rec.pages.take(chosen)
        within = chosen[_pages_before_by_owner(owners, pages) < excess.take(owners)]
        total = np.cumsum(rec.pages.take(within))
        if (len(total) and total[-1] >= min_pages) or k == len(candidates):
            return within[: int(np.searchsorted(total, min_pages)) + 1]
        k = min(len(candidates), 2 * k)


def _pages_before_by_owner(owners: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """For each entry, the pages of the entries before it with the same owner."""
    by_owner = np.argsort(owners, kind="stable")  # grouped by owner, in order within each
    grouped_pages = pages[by_owner]
    before = np.cumsum(grouped_pages) - grouped_pages
    grouped = owners[by_owner]
    starts = np.concatenate(([True], grouped[1:] != grouped[:-1]))
    before -= before[starts][np.cumsum(starts) - 1]
    out = np.empty_like(before)
    out[by_owner] = before
    return out


def fair_victims(rec: RecordTable, victims: np.ndarray, min_pages: int, shares: Shares) -> np.ndarray:
    """Which of ``victims`` (committed, unpinned rows) to evict for ``min_pages`` pages, in
    the order of the module docstring; fewer when the rest belongs to peers within their
    shares and the reserving peer is over its own."""
    taken = [within_excess(rec, victims, shares.excess, min_pages)]
    left = min_pages - int(rec.pages.take(taken[0]).sum())
    if left <= 0:
        return taken[0]
    rest = victims[~np.isin(victims, taken[0], assume_unique=True)]
    claimant_over = shares.claimant_excess
    if shares.claimant is not None:
        own = oldest(rec, rest[rec.peer.take(rest) == shares.claimant], left)
        taken.append(own)
        left -= int(rec.pages.take(own).sum())
        first = taken[0]
        claimant_over -= int(rec.pages.take(first[rec.peer.take(first) == shares.claimant]).sum())
        claimant_over -= int(rec.pages.take(own).sum())
        rest = rest[~np.isin(rest, own, assume_unique=True)]
    if left > 0 and claimant_over <= 0:
        taken.append(oldest(rec, rest, left))
    return np.concatenate(taken)
