"""Fencing of lapsed writers: pages of a lapsed reservation are not reused at once.

A reservation lapses when its writer does not commit it within the
reservation TTL, or when the writer's lease lapses. The writer may still be
copying into those pages (a slow copy, a stalled process that resumes): if
the pages went to another writer at once, the late copy would land inside a
committed object that a valid slot header describes. So the registry hands a
lapsed reservation's pages to this fence instead of freeing them. They stay
allocated (counted as reserved) until

- the writer says it is done with the key (its ``commit`` or ``abort`` of it,
  which it sends only once its copy has ended), or
- its lease has ended (lapsed or closed) and ``grace_s`` has passed since, or
- ``max_hold_s`` has passed since the lapse, even while its lease lives: a
  writer that heartbeats but never commits must not hold pages for ever.
  Loads check each object's payload against its writer's checksum (on by
  default), so a copy that lands later still is caught at read time.

Entries are columns of arrays, and every operation is vectorised: a
client whose 60,000 reservations lapse at once must not make every later
commit, or the expiry task's every pass, walk them one by one.
Pure: no I/O; every time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

#: A key as one comparable element (its two 64-bit words), for ``np.isin``.
_KEY = np.dtype([("w0", "<u8"), ("w1", "<u8")])
#: Fenced runs taken out: ``(first pages, page counts, numbers of the leases that held them)``.
OwnedRuns = tuple[np.ndarray, np.ndarray, np.ndarray]


def as_key_elements(words: np.ndarray) -> np.ndarray:
    """``(n, 2)`` key words as ``n`` elements of ``_KEY``."""
    return np.ascontiguousarray(words, dtype="<u8").view(_KEY).reshape(-1)


class LapsedFence:
    """The pages of lapsed reservations, held back from reuse (see the module docstring)."""

    def __init__(self, grace_s: float, max_hold_s: float = math.inf) -> None:
        if grace_s < 0 or not max_hold_s >= grace_s:
            raise ValueError(f"the fence needs 0 <= grace ({grace_s}) <= longest hold ({max_hold_s})")
        self.grace_s = float(grace_s)
        self.max_hold_s = float(max_hold_s)
        self._keys = np.zeros(0, dtype=_KEY)
        self._page = np.zeros(0, dtype=np.int64)
        self._pages = np.zeros(0, dtype=np.int64)
        self._owner = np.zeros(0, dtype=np.int64)  # number of the lease that held the reservation
        self._until = np.zeros(0, dtype=np.float64)  # when the pages may be reused
        self.pages = 0

    def __len__(self) -> int:
        return len(self._page)

    def hold(
        self,
        keys: np.ndarray,
        pages: np.ndarray,
        counts: np.ndarray,
        owners: np.ndarray,
        lease_alive: Callable[[int], bool],
        now: float,
    ) -> None:
        """Fence the runs ``pages[i]``/``counts[i]`` of lapsed reservations of the
        keys ``keys[i]`` (``(n, 2)`` words) held by leases ``owners[i]``."""
        if not len(pages):
            return
        owners = np.asarray(owners, dtype=np.int64)
        alive = {int(owner) for owner in np.unique(owners) if lease_alive(int(owner))}
        until = np.full(len(owners), now + self.grace_s)
        if alive:
            until[np.isin(owners, list(alive))] = now + self.max_hold_s
        self._keys = np.concatenate((self._keys, as_key_elements(keys)))
        self._page = np.concatenate((self._page, np.asarray(pages, dtype=np.int64)))
        self._pages = np.concatenate((self._pages, np.asarray(counts, dtype=np.int64)))
        self._owner = np.concatenate((self._owner, owners))
        self._until = np.concatenate((self._until, until))
        self.pages += int(np.sum(counts))

    def lease_ended(self, owner: int, now: float) -> None:
        """The lease numbered ``owner`` lapsed or closed: its runs go after the grace."""
        mine = self._owner == owner
        self._until[mine] = np.minimum(self._until[mine], now + self.grace_s)

    def writer_done(self, owner: int, keys: np.ndarray) -> OwnedRuns:
        """The runs lease ``owner`` fenced for ``keys`` (``(n, 2)`` words), taken out:
        it committed or aborted them, so it no longer writes there."""
        if not len(self) or not len(keys):
            return self._take(np.zeros(len(self), dtype=bool))
        mine = self._owner == owner
        if mine.any():
            mine[mine] = np.isin(self._keys[mine], as_key_elements(keys))
        return self._take(mine)

    def due(self, now: float) -> OwnedRuns:
        """The runs whose grace has passed, taken out."""
        return self._take(self._until <= now)

    def _take(self, chosen: np.ndarray) -> OwnedRuns:
        taken = self._page[chosen], self._pages[chosen], self._owner[chosen]
        if len(taken[0]):
            keep = ~chosen
            self._keys, self._page, self._pages = self._keys[keep], self._page[keep], self._pages[keep]
            self._owner, self._until = self._owner[keep], self._until[keep]
            self.pages -= int(taken[1].sum())
        return taken
