"""The leases of ``maru_core.index.registry.Registry`` (its base class): opened,
resumed, renewed by every call, closed, and lapsed.

A lease is a client's hold on the index: its pins and reservations live as
long as it does. Ending one (``close_lease``, or lapsing unrenewed for
``lease_ttl_s``) takes it out of use at once, then releases its pins and
its reservations a chunk per step (the ``_sliced`` forms, run by the server
between other clients' requests); the reservations' pages go to the fence
(``maru_core.index.fencing``), since their writers may still be copying.
All of it runs on the registry's one thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import numpy as np

from maru_core.index.leases import Lease, new_lease_id
from maru_core.index.records import RecordTable, State
from maru_core.index.registry_types import ExpiryReport, NoLease, run_to_end

if TYPE_CHECKING:
    from maru_core.index.fencing import LapsedFence
    from maru_core.index.peer_accounts import PeerAccounts

#: Reservations of an ended lease released per step.
RESERVATION_CHUNK_ROWS = 8192


class LeaseBook:
    """The leases of a ``Registry`` (which provides the state below)."""

    lease_ttl_s: float
    evict_window_s: float
    _clock: Callable[[], float]
    _records: RecordTable
    _leases: dict[str, Lease]
    _lease_by_number: dict[int, Lease]
    _next_lease_number: int
    _peers: "PeerAccounts"
    _fence: "LapsedFence"
    _reserved_keys: int
    _stale_from: float
    _release_pins: Callable[[list[Lease]], Generator[None, None, int]]
    _fence_lapsed: Callable[[np.ndarray], None]
    _free_fenced: Callable[[tuple[np.ndarray, np.ndarray, np.ndarray]], None]

    def open_lease(self, client: str, lease_id: str | None = None, peer: str = "local") -> str:
        """Resume ``lease_id`` if it is live (renewing it), else open a new lease of
        ``peer`` (whose account its holdings are charged to); return its id.

        A resumed lease keeps the peer that opened it, whoever resumes it: what
        it holds stays charged where it was taken, a client that reconnects
        from another address (a new pod IP, a Unix socket then TCP) keeps its
        lease, and a peer cannot shed its charges by handing a lease over. The
        lease id is a secret of its holder: resuming it needs it and the token."""
        now = self._clock()
        lease = self._leases.get(lease_id) if lease_id else None
        if lease is not None and lease.expires_at > now:
            lease.expires_at = now + self.lease_ttl_s
            return lease.lease_id
        if lease is not None:
            self._drop_lease(lease)
        self._peers.prune(now, self.evict_window_s)
        lease = Lease(new_lease_id(), client, self._next_lease_number, now + self.lease_ttl_s,
                      self._peers.join(peer))  # fmt: skip
        self._next_lease_number += 1
        self._leases[lease.lease_id] = lease
        self._lease_by_number[lease.number] = lease
        return lease.lease_id

    def renew(self, lease_id: str) -> None:
        """Extend the lease by ``lease_ttl_s``; ``NoLease`` if it is unknown or lapsed."""
        self._lease(lease_id)

    def close_lease(self, lease_id: str) -> bool:
        """Release the lease's pins and reservations now; ``False`` if it was not live."""
        return run_to_end(self.close_lease_sliced(lease_id))

    def lease_is_live(self, lease_id: str) -> bool:
        """Whether ``lease_id`` is a lease that has not lapsed (nothing is renewed)."""
        lease = self._leases.get(lease_id)
        return lease is not None and lease.expires_at > self._clock()

    def _lease(self, lease_id: str) -> Lease:
        """The live lease, renewed: every call made under a lease counts as a heartbeat."""
        lease = self._leases.get(lease_id)
        now = self._clock()
        if lease is not None and lease.expires_at <= now:
            self._drop_lease(lease)
            lease = None
        if lease is None:
            raise NoLease(f"lease {lease_id!r} is unknown or has lapsed: open a new one (hello)")
        lease.expires_at = now + self.lease_ttl_s
        return lease

    def _drop_lease(self, lease: Lease) -> tuple[int, int]:
        return run_to_end(self._drop_leases_sliced([lease]))

    def close_lease_sliced(self, lease_id: str) -> Generator[None, None, bool]:
        """``close_lease`` in slices (see ``_drop_leases_sliced``); returns whether the lease was live."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        yield from self._drop_leases_sliced([lease])
        return True

    def _drop_leases_sliced(self, leases: list[Lease]) -> Generator[None, None, tuple[int, int]]:
        """End ``leases`` at once (no call can use them any more), then release
        their pins a chunk per step, then their reservations a chunk per step.
        Returns (pins released, reservations released)."""
        ended = self._clock()
        # A lease holding no page reserved or fenced has no reservation: no need to look for them
        # (a look over every record: 1.6 ms of a lease's end at a million keys).
        reserving = [lease for lease in leases if lease.held_pages]
        for lease in leases:
            del self._leases[lease.lease_id]
            del self._lease_by_number[lease.number]
            # Off its peer's account now, even should the steps below be abandoned: an
            # ended lease's pages are charged to no one (its reservations go to the fence).
            lease.held_pages = 0
            self._peers.leave(lease.account, ended)
        pins = yield from self._release_pins(leases)
        rec = self._records
        numbers = np.fromiter((lease.number for lease in reserving), dtype=rec.owner.dtype, count=len(reserving))
        reservations = 0
        while len(numbers):  # a chunk per step; looked for again each time (expiry may have taken some meanwhile)
            hw = rec.high_water
            owners = rec.owner[:hw]
            mine = owners == numbers[0] if len(numbers) == 1 else np.isin(owners, numbers)
            owned = np.flatnonzero(mine & (rec.state[:hw] == State.RESERVED))[:RESERVATION_CHUNK_ROWS]
            # Their writers may still be copying: the pages wait in the fence.
            self._fence_lapsed(owned)
            reservations += len(owned)
            if len(owned) < RESERVATION_CHUNK_ROWS:
                break
            yield
        now = self._clock()
        for lease in leases:
            self._fence.lease_ended(lease.number, now)
        return pins, reservations

    def expire(self) -> ExpiryReport:
        """Release lapsed leases (their pins and reservations) and reservations past their deadline."""
        return run_to_end(self.expire_sliced())

    def expire_sliced(self) -> Generator[None, None, ExpiryReport]:
        """``expire`` in slices: lapsed leases end at once, their pins are released
        a chunk per step (see ``_drop_leases_sliced``); a rebuild of the key table
        that additions left under way is finished, a slice per step."""
        now = self._clock()
        lapsed = [lease for lease in self._leases.values() if lease.expires_at <= now]
        pins = reservations = 0
        if lapsed:
            pins, reservations = yield from self._drop_leases_sliced(lapsed)
        if self._reserved_keys and now >= self._stale_from:  # else none can have lapsed: no look over every record
            rec, hw = self._records, self._records.high_water
            deadlines = rec.deadline[:hw]
            reserved = rec.state[:hw] == State.RESERVED
            overdue = reserved & (deadlines <= now)
            stale = np.flatnonzero(overdue)
            left = deadlines[reserved & ~overdue]  # before the overdue ones' rows are freed
            self._fence_lapsed(stale)
            reservations += len(stale)
            self._stale_from = float(left.min()) if len(left) else math.inf
        self._free_fenced(self._fence.due(now))
        self._peers.prune(now, self.evict_window_s)
        yield from self._records.finish_rebuild_sliced()
        return ExpiryReport(tuple(lease.lease_id for lease in lapsed), pins, reservations)
