"""What one lease, and one peer's leases together, may hold or do to the
pool: the quotas' names, the index's defaults, and the window that counts
evictions.

Three quotas, each refused with the error type ``quota`` naming its flag,
counted in ``maru_index_quota_refusals_total{quota}`` and logged at most a
line per ten seconds (``docs/security.md``, Reservations and Eviction):

- ``reservations``: pages held reserved, or fenced after a lapse
  (``--max-lease-pool-fraction``);
- ``pins``: pages of the distinct objects pinned (``--max-lease-pin-fraction``);
- ``evictions``: pages its reserves evicted within a sliding window
  (``--max-lease-evict-fraction`` per ``--evict-window`` seconds), on top of
  the bound on one reserve (``--max-evict-fraction``).

The same three bound the sum over the leases one peer opened
(``peer_reservations``, ``peer_pins``, ``peer_evictions``: flags
``--max-peer-pool-fraction``, ``--max-peer-pin-fraction``,
``--max-peer-evict-fraction``, by default as large as a lease's: an
engine's few leases hold a step's stores and its loads in flight at once,
far below them, and evict what it stores), kept in
``maru_core.index.peer_accounts``: a client cannot multiply its quotas by
opening more leases. Engines that share one address share these
(``docs/security.md``, What identifies a client).

Pure: no I/O; every time is passed in.
"""

from __future__ import annotations

import collections

#: The ``quota`` label of ``maru_index_quota_refusals_total``.
QUOTAS = ("reservations", "pins", "evictions", "peer_reservations", "peer_pins", "peer_evictions")

#: The share of the pool's pages one lease may pin (its distinct objects'
#: pages). An engine pins what its loads in flight read, at most its GPU's KV
#: cache and usually a small part of it; a client that pins without end
#: cannot take the pool (nothing pinned can be evicted) from the others.
MAX_LEASE_PIN_FRACTION = 0.5
#: The share of the pool's pages one lease's reserves may evict within
#: ``EVICT_WINDOW_S``: an engine whose stores turn the whole pool over in
#: less than 40 s gains little from the cache; a client cannot wipe it in a
#: few calls.
MAX_LEASE_EVICT_FRACTION = 0.25
EVICT_WINDOW_S = 10.0
#: Evictions within ``window / WINDOW_SLOTS`` of an entry's first share it (it
#: expires with its last: counted up to that much longer, never shorter), so a
#: window holds at most about that many entries however many reserves evict.
WINDOW_SLOTS = 64


class EvictionWindow:
    """Pages one lease's (or one peer's) reserves evicted, by time, over the last window."""

    __slots__ = ("_entries", "_pages")

    def __init__(self) -> None:
        # [first, last, pages] per entry, oldest first
        self._entries: collections.deque[list[float]] = collections.deque()
        self._pages = 0

    def pages(self, now: float, window_s: float) -> int:
        """Pages evicted in the ``window_s`` seconds up to ``now``."""
        entries = self._entries
        while entries and entries[0][1] <= now - window_s:
            self._pages -= int(entries.popleft()[2])
        return self._pages

    def add(self, pages: int, now: float, window_s: float) -> None:
        """Record ``pages`` evicted at ``now``."""
        if pages <= 0:
            return
        if self._entries and now - self._entries[-1][0] < window_s / WINDOW_SLOTS:
            entry = self._entries[-1]
            entry[1], entry[2] = now, entry[2] + pages
        else:
            self._entries.append([now, now, pages])
        self._pages += pages
