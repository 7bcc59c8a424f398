"""Per-peer budgets of the index: how many new connections, and how many
failed ``hello``s, one peer may cost.

A peer is one client address: the IP address of a TCP connection, the user
id (``SO_PEERCRED``) of a Unix socket connection. Each peer has two token
buckets, for new connections and for auth failures. A connection is
accepted while both hold a token (it spends a connection token); a peer
whose auth failures have emptied its bucket, or that connects faster than
its connection budget, has its new connections closed at accept, before a
byte of them is read. A peer that failed recently also pays for each new
connection's ``hello`` when it is admitted (refunded if the token is right),
so it cannot open a batch of connections on one token. So a brute-force
guesser gets a guess per refill, and a connection storm from one address
costs the index an ``accept`` and a ``close`` per attempt, nothing more.

The table holds at most ``max_peers`` peers (least recently seen dropped
first): its memory is bounded whatever the number of addresses. A peer
dropped from it comes back with full buckets.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import socket
import struct
import time
from typing import Callable

#: Why a connection was refused at accept (the ``reason`` label of ``maru_index_rate_limited_total``).
RATE_LIMIT_REASONS = ("connections", "auth_failures")
#: Peers remembered at once (about 100 bytes each).
DEFAULT_MAX_PEERS = 4096


@dataclasses.dataclass(frozen=True)
class Budget:
    """A token bucket's shape: ``burst`` tokens at most, refilled at ``rate_per_s``."""

    rate_per_s: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)):
            raise ValueError(f"a rate must be a positive, finite number per second, got {self.rate_per_s}")
        if self.burst < 1:
            raise ValueError(f"a burst must be at least 1, got {self.burst}")


class _Buckets:
    """One peer's two buckets, refilled lazily when the peer is seen."""

    __slots__ = ("connections", "auth_failures", "updated")

    def __init__(self, connections: float, auth_failures: float, now: float) -> None:
        self.connections = connections
        self.auth_failures = auth_failures
        self.updated = now


class PeerLimiter:
    """Token buckets per peer (see the module docstring)."""

    def __init__(
        self,
        connections: Budget,
        auth_failures: Budget,
        max_peers: int = DEFAULT_MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.connections = connections
        self.auth_failures = auth_failures
        self.max_peers = max_peers
        self._clock = clock
        self._peers: collections.OrderedDict[str, _Buckets] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def _buckets(self, peer: str) -> _Buckets:
        """The peer's buckets, refilled up to now, and marked most recently seen."""
        now = self._clock()
        buckets = self._peers.get(peer)
        if buckets is None:
            buckets = _Buckets(self.connections.burst, self.auth_failures.burst, now)
            self._peers[peer] = buckets
            if len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
            return buckets
        self._peers.move_to_end(peer)
        elapsed = max(0.0, now - buckets.updated)
        buckets.updated = now
        buckets.connections = min(self.connections.burst, buckets.connections + elapsed * self.connections.rate_per_s)
        buckets.auth_failures = min(
            self.auth_failures.burst, buckets.auth_failures + elapsed * self.auth_failures.rate_per_s
        )
        return buckets

    def admit(self, peer: str) -> str | None:
        """A new connection from ``peer``: ``None`` if it may be served (a connection
        token is spent), else the reason it is refused (``RATE_LIMIT_REASONS``)."""
        buckets = self._buckets(peer)
        if buckets.auth_failures < 1:
            return "auth_failures"
        if buckets.connections < 1:
            return "connections"
        buckets.connections -= 1
        return None

    def prepay_hello(self, peer: str) -> bool:
        """For a connection just admitted: a peer that failed auth recently (its
        bucket not full) pays for the connection's ``hello`` up front, so that it
        cannot open many connections on one token before their failures count.
        Returns whether it paid (then ``hello_succeeded`` refunds it)."""
        buckets = self._buckets(peer)
        if buckets.auth_failures >= self.auth_failures.burst:
            return False
        buckets.auth_failures = max(0.0, buckets.auth_failures - 1)
        return True

    def hello_succeeded(self, peer: str) -> None:
        """A prepaid ``hello`` presented the right token: its token comes back."""
        buckets = self._buckets(peer)
        buckets.auth_failures = min(self.auth_failures.burst, buckets.auth_failures + 1)

    def auth_failed(self, peer: str) -> None:
        """``peer`` presented a wrong or missing token (on a connection that did not prepay)."""
        buckets = self._buckets(peer)
        buckets.auth_failures = max(0.0, buckets.auth_failures - 1)


def peer_of(sock: socket.socket, address: object) -> str:
    """The peer a newly accepted socket belongs to: its IP address (TCP), or
    ``uid N`` of the process at the other end of a Unix socket."""
    if sock.family == socket.AF_UNIX:
        try:
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except (OSError, AttributeError):  # no SO_PEERCRED here: every local client is one peer
            return "unix"
        return f"uid {uid}"
    if isinstance(address, tuple) and address:
        return str(address[0])
    return str(address)
