"""What one client may cost the index: the limits that keep one hostile,
broken or slow client from taking the index away from the others, per
connection and per peer (``maru_core.index.peers``).

Every limit has a flag of ``marucache index`` (``docs/security.md`` lists
them with their defaults and says why each exists).
"""

from __future__ import annotations

import dataclasses
import math
import resource

from maru_core.index.peers import DEFAULT_MAX_PEERS, Budget, PeerLimiter

#: Largest frame accepted from a connection that has not said ``hello`` yet.
#: A hello is a few hundred bytes; an unauthenticated peer gets no more.
PRE_AUTH_FRAME_BYTES = 16 * 1024
#: Per-peer budgets: generous enough for a pod of workers (or several hundred behind
#: one address) reconnecting at once after an index restart; far below a flood.
PEER_CONNECTION_RATE = 64.0
PEER_CONNECTION_BURST = 256
PEER_AUTH_FAILURE_RATE = 1.0
PEER_AUTH_FAILURE_BURST = 16
#: Bytes one peer may send a second, and at once: an engine's requests take a few MB a
#: second at most (``docs/security.md``, The budgets), a client sending large frames back
#: to back hundreds of MB.
PEER_RECEIVE_RATE = 64 * 1024 * 1024
PEER_RECEIVE_BURST = 64 * 1024 * 1024
#: All connections' receive buffers together, beyond the small ones every
#: connection may hold (``SMALL_RECEIVE_BYTES``): what slow senders of large
#: frames can make the index hold at once.
MAX_RECEIVE_BYTES = 256 * 1024 * 1024
#: A receive buffer up to this size never counts against MAX_RECEIVE_BYTES, so a
#: client that sends the frames an engine sends (a few KiB to a few hundred) is
#: never refused because others hold large buffers.
SMALL_RECEIVE_BYTES = 1024 * 1024
#: File descriptors kept free for the pool, the metrics server and logs.
_SPARE_FDS = 32


def default_max_connections() -> int:
    """1024, or fewer when the process may open fewer files than that (so the
    cap is hit before ``accept()`` runs out of descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(1, min(1024, soft - _SPARE_FDS))


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-connection and per-peer limits of the index server.

    - ``max_connections``: connections served at once. At the cap a new
      connection displaces the oldest one that has not said ``hello``; when
      every connection holds a lease, the new one is closed at once.
    - ``hello_timeout_s``: a connection must open its lease (``hello``) this
      soon after connecting, or it is closed.
    - ``frame_timeout_s``: a frame must be complete this soon after its first
      byte arrived (bytes trickling in do not extend it), and replies held
      back because the peer does not read them must drain this soon, or the
      connection is closed.
    - ``max_receive_bytes``: all connections' receive buffers larger than
      ``SMALL_RECEIVE_BYTES`` together; a connection whose frame would need
      more is refused (``too_large``) and closed.
    - ``idle_timeout_s``: a connection that sends nothing for this long is
      closed (clients heartbeat every few seconds; the lease itself lives on
      until it lapses).
    - ``max_leases_per_connection``: live leases one connection may have
      opened; another ``hello`` beyond it is refused (``bad_request``).
    - ``pre_auth_frame_bytes``: the largest frame before ``hello`` succeeds.
    - ``turn_s``: one peer's share of the event loop per round
      (``maru_core.index.turns``): how long its pipelined requests, or a
      large request's slices, may hold the loop before the other peers get
      a turn, while it is the only peer the index serves.
    - ``shared_turn_s``: the same share while other peers are served too
      (``turns.CONTENDED_WINDOW_S``): how long a request that arrives while
      another peer keeps the index busy may wait for the loop.
    - ``peer_connection_rate``/``peer_connection_burst``: new connections one
      peer (an IP address, or a Unix socket's user id) may open per second,
      and at once (one that the peer closes before sending a byte is not
      counted); beyond, its connections are closed at accept.
    - ``peer_auth_failure_rate``/``peer_auth_failure_burst``: wrong-token
      ``hello``s one peer may send per second, and at once; beyond, each
      failing connection's answer is held back (the time the budget needs
      to refill, up to ``hello_timeout_s``); no connection is refused for it.
    - ``peer_receive_rate``/``peer_receive_burst``: bytes one peer's
      connections together may send per second, and at once; beyond, a
      connection holding a large frame is not read again until the budget
      has refilled (its frame's deadline waits as long; one of small frames
      is never held: ``connection.NEVER_HELD_BYTES``); nothing is refused.
    - ``max_peers``: peers whose budgets are remembered (least recently seen
      forgotten first).
    """

    max_connections: int = dataclasses.field(default_factory=default_max_connections)
    hello_timeout_s: float = 5.0
    frame_timeout_s: float = 10.0
    max_receive_bytes: int = MAX_RECEIVE_BYTES
    idle_timeout_s: float = 60.0
    max_leases_per_connection: int = 4
    pre_auth_frame_bytes: int = PRE_AUTH_FRAME_BYTES
    turn_s: float = 0.001
    shared_turn_s: float = 0.00005
    peer_connection_rate: float = PEER_CONNECTION_RATE
    peer_connection_burst: int = PEER_CONNECTION_BURST
    peer_auth_failure_rate: float = PEER_AUTH_FAILURE_RATE
    peer_auth_failure_burst: int = PEER_AUTH_FAILURE_BURST
    peer_receive_rate: float = PEER_RECEIVE_RATE
    peer_receive_burst: int = PEER_RECEIVE_BURST
    max_peers: int = DEFAULT_MAX_PEERS

    def __post_init__(self) -> None:
        integers = ("max_connections", "max_leases_per_connection", "pre_auth_frame_bytes", "max_receive_bytes",
                    "peer_connection_burst", "peer_auth_failure_burst", "peer_receive_burst", "max_peers")  # fmt: skip
        for name in integers:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("hello_timeout_s", "frame_timeout_s", "idle_timeout_s", "turn_s", "shared_turn_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
        for name in ("peer_connection_rate", "peer_auth_failure_rate", "peer_receive_rate"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive, finite number per second, got {value}")

    def peer_limiter(self) -> PeerLimiter:
        """The per-peer budgets these limits describe."""
        return PeerLimiter(Budget(self.peer_connection_rate, self.peer_connection_burst),
                           Budget(self.peer_auth_failure_rate, self.peer_auth_failure_burst),
                           Budget(self.peer_receive_rate, self.peer_receive_burst),
                           self.max_peers)  # fmt: skip

    @property
    def sweep_interval_s(self) -> float:
        """How often deadlines are checked: often enough to close within about a quarter of the shortest."""
        return min(1.0, self.hello_timeout_s / 4, self.frame_timeout_s / 4, self.idle_timeout_s / 4)
