"""What one peer's leases hold or did to the pool, summed: the per-peer
side of the quotas (``maru_core.index.quotas``).

The quotas per lease alone are multiplied at will by one token holder: a
connection may hold several leases, a peer many connections, and a ``bye``
then ``hello`` gives a fresh lease with a fresh eviction window. So each
lease also charges the account of the peer that opened it (the peer whose
budgets and turns the server already keeps, ``maru_core.index.peers``: a TCP
connection's source address, a Unix socket's user), and the same three
quotas bound the account:

- ``peer_reservations``: pages its live leases hold reserved or fenced;
- ``peer_pins``: pages its live leases pin, each lease's distinct objects
  summed over its leases (an object pinned by two of its leases counts
  twice: exact per lease, simple to keep, and an honest engine pins with one
  lease);
- ``peer_evictions``: pages its leases' reserves evicted within the window.
  The window lives here, not with the lease: a new lease, a new connection
  or a ``bye`` and ``hello`` do not reset it.

An account lives while a lease of its peer does, then ``window`` seconds
more (its evictions count that long), then is dropped. At most
``max_idle`` accounts without a live lease are kept (the oldest dropped
first), so memory is bounded by the live leases plus that cap whatever the
number of addresses.

Pure: no I/O; every time is passed in.
"""

from __future__ import annotations

import collections

from maru_core.index.quotas import EvictionWindow

#: Accounts of peers without a live lease kept at once (about 300 bytes each).
DEFAULT_MAX_IDLE_ACCOUNTS = 4096


class PeerAccount:
    """What one peer's live leases hold and what its leases evicted lately."""

    __slots__ = ("peer", "held_pages", "pin_pages", "evicted", "leases")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.held_pages = 0  # pages its live leases hold reserved or fenced
        self.pin_pages = 0  # pages its live leases pin (each lease's distinct objects)
        self.evicted = EvictionWindow()  # pages its leases' reserves evicted lately
        self.leases = 0  # its live leases


class PeerAccounts:
    """The accounts of the peers that opened leases (see the module docstring)."""

    def __init__(self, max_idle: int = DEFAULT_MAX_IDLE_ACCOUNTS) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be at least 0, got {max_idle}")
        self.max_idle = max_idle
        self._accounts: dict[str, PeerAccount] = {}
        # Accounts without a live lease, by when their last lease ended (oldest first).
        self._idle: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._accounts)

    def get(self, peer: str) -> PeerAccount | None:
        """The account of ``peer``, if one is kept (for inspection)."""
        return self._accounts.get(peer)

    def join(self, peer: str) -> PeerAccount:
        """A lease of ``peer`` opens: its account (kept, or a fresh one)."""
        account = self._accounts.get(peer)
        if account is None:
            account = self._accounts[peer] = PeerAccount(peer)
        self._idle.pop(peer, None)
        account.leases += 1
        return account

    def leave(self, account: PeerAccount, now: float) -> None:
        """A lease of ``account``'s peer ended (its holdings were taken off already)."""
        account.leases -= 1
        if account.leases <= 0 and self._accounts.get(account.peer) is account:
            self._idle[account.peer] = now
            if len(self._idle) > self.max_idle:
                self._drop_oldest_idle()

    def prune(self, now: float, window_s: float) -> None:
        """Drop the accounts whose last lease ended ``window_s`` ago or more: their
        evictions no longer count, and their live leases hold nothing."""
        while self._idle:
            peer, since = next(iter(self._idle.items()))
            if since > now - window_s:
                break
            self._drop_oldest_idle()

    def _drop_oldest_idle(self) -> None:
        peer, _ = self._idle.popitem(last=False)
        del self._accounts[peer]
