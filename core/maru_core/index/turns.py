"""Turns on the index's event loop, shared out per peer, not per connection.

A connection answers its requests in turns (``maru_core.index.connection``):
at most ``turn_s`` of pipelined frames, or one slice of a sliced request.
Were every connection to queue its own next turn, a peer with twenty busy
connections would get twenty turns for every one of a peer with one, and
could make the others wait twenty turns per request. So a connection that
wants another turn waits here, in its peer's queue (a peer:
``maru_core.index.peers.peer_of``), and each *round* gives every waiting
peer one turn: its queue's first connection runs, and goes to the back of
the queue if it wants more. Round robin over peers, then over a peer's
connections.

Fresh work (frames that arrived on a connection that had nothing under way)
runs at once, as before, when its peer has had no turn this round and none
of its connections waits; otherwise it waits for the peer's next turn. A
round runs in the loop's next pass, after the I/O that became ready
meanwhile, so a request that arrives while others hold turns is answered
before any of them has a second turn.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Hashable, Protocol

log = logging.getLogger(__name__)


class TurnTaker(Hashable, Protocol):
    """What waits for a turn: a connection, with the peer whose share it uses."""

    peer_key: str


class PeerTurns:
    """The turns of one event loop (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # per peer, its connections waiting for a turn, oldest first; peers in the order they began to wait
        self._waiting: dict[str, collections.OrderedDict[TurnTaker, Callable[[], None]]] = {}
        self._had_turn: set[str] = set()  # peers that had their turn this round
        self._round: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Connections waiting for a turn."""
        return sum(len(queue) for queue in self._waiting.values())

    def may_run_now(self, conn: TurnTaker) -> bool:
        """Whether ``conn``'s fresh work may run now (it then counts as its peer's turn this round)."""
        peer = conn.peer_key
        if peer in self._had_turn or peer in self._waiting:
            return False
        self._had_turn.add(peer)
        self._schedule_round()  # the round that ends this one
        return True

    def wait(self, conn: TurnTaker, turn: Callable[[], None]) -> None:
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

    def _schedule_round(self) -> None:
        if self._round is None:
            # a timer due now runs after the I/O of the loop's next pass (``call_soon`` would run before it)
            self._round = self._loop.call_later(0, self._next_round)

    def _next_round(self) -> None:
        """One turn to every waiting peer (a peer whose fresh work ran in this pass may thus have two
        in it; from the next pass on, one per round)."""
        self._round = None
        self._had_turn = set()
        try:
            for peer in list(self._waiting):
                queue = self._waiting.get(peer)
                if not queue:
                    continue
                conn, turn = queue.popitem(last=False)
                if not queue:
                    del self._waiting[peer]
                self._had_turn.add(peer)
                try:
                    turn()
                except Exception:  # one connection's bug must not take the others' turns
                    log.exception("a connection's turn failed")
        finally:
            if self._waiting or self._had_turn:
                self._schedule_round()
