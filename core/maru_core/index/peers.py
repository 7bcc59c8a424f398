"""Per-peer budgets of the index: how many new connections, how many failed
``hello``s and how many bytes a second one peer may cost.

A peer is one client address: the IP address of a TCP connection, the user
id (``SO_PEERCRED``) of a Unix socket connection. Clients behind one address
(a NAT, hostNetwork pods, one node's pods on a Unix socket) are one peer, so
a budget must ration what a *misbehaving* client costs without shutting out
its honest neighbours. (A ``hello`` with a pod credential makes its pod the
peer of that connection from then on.) Each peer has three token buckets:

- new connections: a connection is accepted while its peer holds a token
  (it spends one), and reset at accept, before a byte of it is read,
  otherwise. A connection that its peer closed before sending a byte gets
  its token back (a connect/close flood costs an ``accept`` and a ``close``,
  bounded by the acceptor's pacing, and never empties the bucket); one that
  sent something, or that the index closed, keeps it spent. So the budget
  rations connections that send something: guesses, garbage, idle floods.
- auth failures: each wrong-token ``hello`` spends one. They never refuse a
  connection at accept (that locked every client of a shared address out
  for a neighbour's two guesses a second). Once the bucket is empty, the
  *failing connection* pays: its ``auth`` answer is held back for the time
  the bucket needs to hold a token again, which grows with the failures
  beyond the budget (up to the hello deadline). A client with the right
  token is answered at once whatever its neighbours fail.
- received bytes: every byte read from a peer's connections spends one.
  Nothing is refused for it either: once the bucket is empty, a connection
  that read into a large frame (``connection.NEVER_HELD_BYTES``) stops
  being read until the bucket has refilled (the peer's sends block, TCP's
  own back-pressure); one with only small frames is never held. Receiving
  and decoding a frame cost the index about a millisecond per 3 MiB
  whatever the frame asks, so a client that sends large frames back to
  back (a reserve flood, frames of nils) would otherwise hold the index as
  long as it likes; an engine sends about a MB a second at most.

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

#: What a peer was held to (the ``reason`` label of ``maru_index_rate_limited_total``): a connection
#: refused at accept, over its peer's connection budget; a wrong-token answer held back, over its
#: peer's auth-failure budget; a connection's reading paused, over its peer's received-bytes budget.
RATE_LIMIT_REASONS = ("connections", "auth_failures", "received_bytes")
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
    """One peer's buckets, refilled lazily when the peer is seen."""

    __slots__ = ("connections", "auth_failures", "received_bytes", "updated")

    def __init__(self, connections: float, auth_failures: float, received_bytes: float, now: float) -> None:
        self.connections = connections
        self.auth_failures = auth_failures
        self.received_bytes = received_bytes
        self.updated = now


class PeerLimiter:
    """Token buckets per peer (see the module docstring)."""

    def __init__(
        self,
        connections: Budget,
        auth_failures: Budget,
        received_bytes: Budget,
        max_peers: int = DEFAULT_MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.connections = connections
        self.auth_failures = auth_failures
        self.received_bytes = received_bytes
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
            buckets = _Buckets(self.connections.burst, self.auth_failures.burst, self.received_bytes.burst, now)
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
        buckets.received_bytes = min(
            self.received_bytes.burst, buckets.received_bytes + elapsed * self.received_bytes.rate_per_s
        )
        return buckets

    def admit(self, peer: str) -> str | None:
        """A new connection from ``peer``: ``None`` if it may be served (a connection
        token is spent), else the reason it is refused (``"connections"``)."""
        buckets = self._buckets(peer)
        if buckets.connections < 1:
            return "connections"
        buckets.connections -= 1
        return None

    def refund(self, peer: str) -> None:
        """A connection admitted from ``peer`` went away before sending a byte: its token comes back."""
        buckets = self._buckets(peer)
        buckets.connections = min(self.connections.burst, buckets.connections + 1)

    def auth_failed(self, peer: str) -> float:
        """``peer`` presented a wrong or missing token: how long the failing connection's
        answer is held back (0 while the peer's failures are within budget)."""
        buckets = self._buckets(peer)
        buckets.auth_failures = max(-float(self.auth_failures.burst), buckets.auth_failures - 1)
        if buckets.auth_failures >= 0:
            return 0.0
        return -buckets.auth_failures / self.auth_failures.rate_per_s

    def received(self, peer: str, nbytes: int) -> float:
        """``peer``'s connection read ``nbytes``: how long it must not be read again (0 while the
        peer's bytes are within budget; else until its bucket holds a byte again)."""
        buckets = self._buckets(peer)
        buckets.received_bytes -= nbytes
        if buckets.received_bytes >= 0:
            return 0.0
        return -buckets.received_bytes / self.received_bytes.rate_per_s


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
