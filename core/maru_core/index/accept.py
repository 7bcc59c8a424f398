"""Accepting connections a few per event-loop callback.

asyncio's own servers accept up to ``backlog`` (100) connections in one
callback, each then made into a transport: a storm of connections holds
the loop for tens of milliseconds at a time. An ``Acceptor`` watches a
non-blocking listening socket with ``loop.add_reader`` and takes at most
``batch`` connections per callback; the rest wait in the kernel's backlog
for the loop's next pass, after every other ready connection has had its
turn. What to do with each accepted socket is the caller's: the server
drops one whose peer closed it already (neither taken nor refused), checks
the peer's budget and either makes it a connection (it is taken) or closes
it at once (refused).

A callback also stops after ``ACCEPT_TURN_S`` of work, refusals included
(or less: the server's turns shorten it to their shared share while any peer is served,
``maru_core.index.turns``), and begins no accept that would likely end past
that (one as long as the longest of the callback so far): accepting and
resetting a loopback connection costs about 100 µs of kernel time on a
small VM, and a served client's request that arrives meanwhile waits for
the rest of the callback. When a callback refused every socket it accepted (a
flood from peers over their budgets), accepting pauses for
``REFUSED_PAUSE_S``, so a slow flood costs the index little, unless the
flood filled the kernel's accept queue half or more during a pause
(``queue_fill``, Linux TCP). That queue is one line for every peer: once it
is full the kernel drops every new SYN, an honest peer's too, and that
peer's connect waits a second for its SYN's retransmit, then two, then
four. A 16-core run of wrong-token hellos from one address likely cost 200
honest clients behind another about a second each that way
(``bench/RESULTS.md``). So a callback that finds the queue half full starts
``DRAIN_HOLD_S`` of pauses ten times shorter (``DRAIN_PAUSE_S`` after a whole
``ACCEPT_TURN_S``; after a shorter turn, as much shorter): the flood is
drained a turn at a time between the turns of those already served, ten
times faster, at a bounded cost of the index's spare CPU (half of it at
most), and a neighbour's connect is taken within a few turns.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
import time
from typing import Callable

from maru_core.index.listen import ListenError, RateLimitedLog
from maru_core.index.turns import TurnEnd

log = logging.getLogger(__name__)

#: Connections taken per event-loop callback, at most.
ACCEPT_BATCH = 8
#: Time one callback may spend accepting, taken or refused.
ACCEPT_TURN_S = 0.001
#: Pause after a callback that refused everything it accepted.
REFUSED_PAUSE_S = 0.01
#: Connections the kernel may queue for us (capped by net.core.somaxconn): a fleet
#: reconnecting at once waits there instead of having its SYNs dropped.
LISTEN_BACKLOG = 1024
#: The accept queue's fill (of its length) at a callback's start from which refused floods
#: are drained with pauses of ``DRAIN_PAUSE_S`` only, for ``DRAIN_HOLD_S`` after the last
#: callback that found it so.
DRAIN_FROM_FILL = 0.5
DRAIN_HOLD_S = 1.0
DRAIN_PAUSE_S = 0.001
#: Pause after accept() ran out of descriptors or memory, as asyncio does.
ACCEPT_RETRY_S = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: Where Linux's ``struct tcp_info`` holds ``tcpi_unacked`` and ``tcpi_sacked`` (two u32s after
#: 8 bytes of u8 fields and four u32s), which a listening socket fills with its accept queue's
#: length and capacity.
_TCP_INFO_QUEUE = struct.Struct("=II")
_TCP_INFO_QUEUE_OFFSET = 24

#: ``on_accepted(sock, address) -> taken``: a new connected socket (blocking mode
#: unset: the caller makes a socket it takes non-blocking); false if it refused it,
#: ``None`` if it dropped it because its peer had closed it already (neither).
OnAccepted = Callable[[socket.socket, object], "bool | None"]
#: ``turn() -> seconds``: called as a callback starts accepting, how long it may take.
AcceptTurn = Callable[[], float]


def bind_tcp(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """Non-blocking listening sockets on every address ``host`` resolves to (as
    asyncio's ``create_server`` binds them); a port 0 becomes one free port shared by all."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[0] is not sock and port == 0:  # the others take the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: "
                                         f"{(exc.strerror or str(exc)).lower()}") from None  # fmt: skip
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise ListenError(f"{host!r} resolves to no address to listen on")
    return sockets


def queue_fill(sock: socket.socket) -> float:
    """How full a listening TCP socket's accept queue is (0 to 1): connections the
    kernel completed and holds for ``accept`` over the queue's length, as Linux
    reports them for a listening socket (``tcpi_unacked`` and ``tcpi_sacked`` of
    ``TCP_INFO``). 0 where that cannot be read (a Unix socket, where a connect
    waits for room instead of losing its SYN)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or not hasattr(socket, "TCP_INFO"):
        return 0.0
    end = _TCP_INFO_QUEUE_OFFSET + _TCP_INFO_QUEUE.size
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, end)
    except OSError:
        return 0.0
    if len(info) < end:
        return 0.0
    queued, length = _TCP_INFO_QUEUE.unpack_from(info, _TCP_INFO_QUEUE_OFFSET)
    return queued / length if length else 0.0


class Acceptor:
    """Accepts on one listening socket, ``batch`` connections per callback at most,
    for ``ACCEPT_TURN_S`` or what ``turn`` allows, whichever is less."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, on_accepted: OnAccepted,
                 turn: AcceptTurn | None = None, batch: int = ACCEPT_BATCH) -> None:  # fmt: skip
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.sock = sock
        self._loop = loop
        self._on_accepted = on_accepted
        self._batch = batch
        self._turn = turn
        self._watching = False
        self._retry: asyncio.TimerHandle | None = None
        self._drain_until = 0.0  # refused floods are drained with short pauses until then
        self._errors = RateLimitedLog(log, interval_s=10.0)

    def start(self) -> None:
        if not self._watching and self.sock.fileno() >= 0:
            self._loop.add_reader(self.sock.fileno(), self._accept_some)
            self._watching = True

    def _stop_watching(self) -> None:
        if self._watching:
            self._loop.remove_reader(self.sock.fileno())
            self._watching = False

    def _accept_some(self) -> None:
        if queue_fill(self.sock) >= DRAIN_FROM_FILL:
            self._drain_until = time.monotonic() + DRAIN_HOLD_S
        taken = refused = tried = 0
        turn = TurnEnd(ACCEPT_TURN_S if self._turn is None else min(ACCEPT_TURN_S, self._turn()), time.perf_counter)
        while taken < self._batch:
            if tried and not turn.another_fits():  # an accept, taken or refused: ~0.1 ms
                break  # one try at least
            tried += 1
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break  # the backlog is empty
            except ConnectionAbortedError:
                continue  # the peer gave up before we took it
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                self._errors.warning("accept failed (%s): pausing for %g s", exc, ACCEPT_RETRY_S)
                self._pause(ACCEPT_RETRY_S)
                return
            outcome = self._on_accepted(conn, address)
            if outcome:
                taken += 1
            elif outcome is not None:
                refused += 1
        if refused and not taken:
            if time.monotonic() < self._drain_until:  # as long again as this turn took: the same share
                self._pause(DRAIN_PAUSE_S * min(1.0, (time.perf_counter() - turn.started) / ACCEPT_TURN_S))
            else:
                self._pause(REFUSED_PAUSE_S)

    def _pause(self, seconds: float) -> None:
        self._stop_watching()
        self._retry = self._loop.call_later(seconds, self.start)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self._retry is not None:
            self._retry.cancel()
        if self.sock.fileno() >= 0:
            self._stop_watching()
            self.sock.close()
