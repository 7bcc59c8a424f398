"""Turns on the index's event loop, shared out per peer, not per connection.

A connection answers its requests in turns (``maru_core.index.connection``):
at most ``turn_s`` of pipelined frames, or one slice of a sliced request.
Were every connection to queue its own next turn, a peer with twenty busy
connections would get twenty turns for every one of a peer with one, and
could make the others wait twenty turns per request. So a connection that
wants another turn waits here, in its peer's queue (a peer:
``maru_core.index.peers.peer_of``), and each *round* gives every waiting
peer one share of ``turn_s``: its queue's connections run in order, each
one turn, until the peer has used its share (one connection at least); a
connection that wants more goes to the back of the queue. Round robin over
peers, then over a peer's connections: many clients behind one address (a
NAT) with a request each are answered many a round, a peer's twenty
pipelining connections one turn a round.

Fresh work (frames that arrived on a connection that had nothing under way)
runs at once, as before, when its peer has share left this round and none
of its connections waits; otherwise it waits for the peer's next turn. A
round runs in the loop's next pass, after the I/O that became ready
meanwhile, so a request that arrives while others hold turns is answered
before any of them has a second turn.

How long a share is depends on who else is served. While one peer has the
index to itself, a share is ``turn_s`` (1 ms): a lone engine's large
lookups and pipelines run with few passes of the loop, none of them spent
waiting for nobody. Once another peer has run within the last
``CONTENDED_WINDOW_S``, a share is ``shared_turn_s`` (0.05 ms): a request
that arrives while a peer keeps the index busy (pipelined requests, a large
request's slices, a large reply's pieces; the acceptor's bursts take no
longer either) waits for at most about that, plus the request or slice
under way. At 0.2 ms a token holder pipelining cheap requests took an
honest heartbeat's p99 on 16 cores to 2.8-3.2 times its baseline; at 0.05
ms, 1.2-1.6 times (``bench/RESULTS.md``).
A peer cannot keep its shares long by itself: the other peers' requests
are what shortens them.

Work done for no peer, the acceptor's (``maru_core.index.accept``), takes
turns of ``accept_share_s``: ``shared_turn_s`` as soon as any peer has run
within ``CONTENDED_WINDOW_S``, not only once two have. A flood of
connections that never send (refused at accept, or idle) runs no turn of a
peer, yet a served client's request that arrives during an accept turn
waits for the rest of it: with turns of 1 ms, an idle flood's accepts ran
in callbacks of 1 ms for a fifth of the loop's time (on 2 cores), and a
lone client's heartbeats waited for them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Hashable, Protocol

log = logging.getLogger(__name__)

#: A peer that ran within this long of another makes the loop contended (shares of ``shared_turn_s``).
CONTENDED_WINDOW_S = 0.5


class TurnEnd:
    """When one turn's steps (accepts, a job's slices) stop: no step begins that would
    likely end past ``seconds`` from now, judged by the longest step of the turn so far
    (a step begun with a little time left ran a whole step past the turn, and another
    peer's request waited for it). ``clock`` is the caller's ``time.perf_counter``."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.started = self._before = clock()
        self._ends = self.started + seconds
        self._longest = 0.0

    def another_fits(self) -> bool:
        """Whether one more step, as long as the longest so far, ends within the turn (call it
        after each step)."""
        now = self._clock()
        self._longest = max(self._longest, now - self._before)
        self._before = now
        return now + self._longest <= self._ends


class TurnTaker(Hashable, Protocol):
    """What waits for a turn: a connection, with the peer whose share it uses."""

    peer_key: str


class PeerTurns:
    """The turns of one event loop (see the module docstring); ``turn_s`` is a peer's
    share of a round while it is served alone, ``shared_turn_s`` while others are
    too (``ServerLimits``; the smaller of the two then)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, turn_s: float, shared_turn_s: float | None = None) -> None:
        self._loop = loop
        self._alone_s = turn_s
        self._shared_s = min(turn_s, shared_turn_s if shared_turn_s is not None else turn_s)
        self._last_peer: str | None = None
        self._contended_until = 0.0  # perf_counter time until which shares are ``shared_turn_s``
        self._served_until = 0.0  # perf_counter time until which accept turns are ``shared_turn_s``
        # per peer, its connections waiting for a turn, oldest first; peers in the order they began to wait
        self._waiting: dict[str, collections.OrderedDict[TurnTaker, Callable[[], None]]] = {}
        self._used: dict[str, float] = {}  # loop time each peer used this round
        self._round: asyncio.TimerHandle | None = None

    @property
    def contended(self) -> bool:
        """Whether two turn-takers ran within ``CONTENDED_WINDOW_S`` of each other lately."""
        return time.perf_counter() < self._contended_until

    @property
    def share_s(self) -> float:
        """A peer's share of a round now: ``shared_turn_s`` while the loop is contended, else ``turn_s``."""
        return self._shared_s if self.contended else self._alone_s

    @property
    def accept_share_s(self) -> float:
        """How long the acceptor may take a callback now: ``shared_turn_s`` while any peer was
        served within ``CONTENDED_WINDOW_S`` (its requests would wait for the acceptor), else ``turn_s``."""
        return self._shared_s if time.perf_counter() < self._served_until else self._alone_s

    def _note(self, peer: str, now: float) -> None:
        self._served_until = now + CONTENDED_WINDOW_S
        if peer != self._last_peer:
            if self._last_peer is not None:
                self._contended_until = now + CONTENDED_WINDOW_S
            self._last_peer = peer

    def __len__(self) -> int:
        """Connections waiting for a turn."""
        return sum(len(queue) for queue in self._waiting.values())

    def run_or_wait(self, conn: TurnTaker, turn: Callable[[], None], wait: Callable[[], None]) -> None:
        """``conn`` has fresh work: ``turn`` runs it now when its peer has share left this round and
        none of its connections waits; else ``wait`` (which stops the connection and calls ``wait_turn``)."""
        peer = conn.peer_key
        if peer in self._waiting or self._used.get(peer, 0.0) >= self.share_s:
            wait()
            return
        self._run(peer, turn)
        self._schedule_round()  # the round that ends this one

    def wait_turn(self, conn: TurnTaker, turn: Callable[[], None]) -> None:
        """Run ``turn`` at ``conn``'s next turn (a connection waits once at most: a second call replaces the first)."""
        queue = self._waiting.setdefault(conn.peer_key, collections.OrderedDict())
        queue.pop(conn, None)
        queue[conn] = turn
        self._schedule_round()

    def forget(self, conn: TurnTaker) -> None:
        """``conn`` closed: it waits no more."""
        queue = self._waiting.get(conn.peer_key)
        if queue is not None and queue.pop(conn, None) is not None and not queue:
            del self._waiting[conn.peer_key]

    def _run(self, peer: str, turn: Callable[[], None]) -> None:
        started = time.perf_counter()
        self._note(peer, started)
        try:
            turn()
        except Exception:  # one connection's bug must not take the others' turns
            log.exception("a connection's turn failed")
        self._used[peer] = self._used.get(peer, 0.0) + time.perf_counter() - started

    def _schedule_round(self) -> None:
        if self._round is None:
            # a timer due now runs after the I/O of the loop's next pass (``call_soon`` would run before it)
            self._round = self._loop.call_later(0, self._next_round)

    def _next_round(self) -> None:
        """Every waiting peer's turn: its waiting connections, in order, until it has used its share
        (one at least; each connection once at most). A peer whose fresh work ran in this pass may
        thus have had up to two shares in it; from the next pass on, one per round."""
        self._round = None
        self._used = {}
        try:
            for peer in list(self._waiting):
                queue = self._waiting.get(peer)
                for _ in range(len(queue) if queue else 0):
                    if not queue or self._used.get(peer, 0.0) >= self.share_s:
                        break
                    _, turn = queue.popitem(last=False)
                    if not queue:
                        del self._waiting[peer]
                    self._run(peer, turn)  # a connection that wants more goes to the back of the queue
                    queue = self._waiting.get(peer)
        finally:
            if self._waiting or self._used:
                self._schedule_round()
