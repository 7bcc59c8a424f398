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
- its lease has ended (lapsed or closed) and ``grace_s`` has passed since.

Entries are few (only reservations that lapsed), so plain lists suffice.
Pure: no I/O; every time is passed in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class _Fenced:
    key: bytes
    page: int
    pages: int
    owner: int  # number of the lease that held the reservation
    until: float  # when the pages may be reused; inf while the owner's lease lives


class LapsedFence:
    """The pages of lapsed reservations, held back from reuse (see the module docstring)."""

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"the fence grace must be non-negative, got {grace_s}")
        self.grace_s = float(grace_s)
        self._entries: list[_Fenced] = []
        self.pages = 0

    def __len__(self) -> int:
        return len(self._entries)

    def hold(
        self,
        keys: list[bytes],
        pages: np.ndarray,
        counts: np.ndarray,
        owners: np.ndarray,
        lease_alive: Callable[[int], bool],
        now: float,
    ) -> None:
        """Fence the runs ``pages[i]``/``counts[i]`` of lapsed reservations of ``keys[i]``."""
        for key, page, count, owner in zip(keys, pages.tolist(), counts.tolist(), owners.tolist()):
            until = math.inf if lease_alive(owner) else now + self.grace_s
            self._entries.append(_Fenced(key, page, count, owner, until))
            self.pages += count

    def lease_ended(self, owner: int, now: float) -> None:
        """The lease numbered ``owner`` lapsed or closed: its runs go after the grace."""
        for entry in self._entries:
            if entry.owner == owner and entry.until == math.inf:
                entry.until = now + self.grace_s

    def writer_done(self, owner: int, keys: set[bytes]) -> list[tuple[int, int]]:
        """The runs lease ``owner`` fenced for ``keys``, taken out: it committed or
        aborted them, so it no longer writes there."""
        if not self._entries:
            return []
        return self._take(lambda e: e.owner == owner and e.key in keys)

    def due(self, now: float) -> list[tuple[int, int]]:
        """The runs whose grace has passed, taken out."""
        return self._take(lambda e: e.until <= now)

    def _take(self, chosen: Callable[[_Fenced], bool]) -> list[tuple[int, int]]:
        taken = [(e.page, e.pages) for e in self._entries if chosen(e)]
        if taken:
            self._entries = [e for e in self._entries if not chosen(e)]
            self.pages -= sum(count for _, count in taken)
        return taken
