"""One client connection of the index server: frames in, replies out, in order,
within the limits of ``maru_core.index.limits``.

The connection is an ``asyncio.BufferedProtocol``: the kernel writes its
bytes straight into the connection's ``FrameBuffer``, and each complete
frame is decoded from there and answered in the same callback, with one
``write`` per reply. Requests of one connection are answered in arrival
order, so a pipelined client gets its replies in the order it sent them.

Fairness: a connection answers buffered frames for at most its peer's
share of event-loop time (``maru_core.index.turns``: every waiting peer
gets one share per round, however many connections it has; 1 ms while it
is served alone, 0.05 ms while others are too), then stops reading and
waits for its peer's next turn; a sliced request (see ``IndexServer``)
likewise runs slices while one more would fit its turn (one at least). So a peer that
pipelines thousands of requests, on one connection or on twenty, delays
the others by one turn, not by its whole backlog.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Generator, Iterator, Protocol

from maru_core.index.turns import TurnEnd
from maru_core.protocol import ErrorType, FrameError, FrameTooLarge, ProtocolError, error_reply
from maru_core.protocol.framing import MAX_FRAME_BYTES, FrameBuffer, FrameWriter, Message

if TYPE_CHECKING:
    from maru_core.index.heap import HeapTrimmer
    from maru_core.index.limits import ServerLimits
    from maru_core.index.listen import RateLimitedLog
    from maru_core.index.turns import PeerTurns

#: Pending reply bytes above which a connection stops reading until its peer has read them.
WRITE_HIGH_WATER = 4 * 1024 * 1024
#: A connection's receive buffer starts this small (an idle connection costs a few KiB).
#: Grown for large frames, it is kept while they keep coming (growing it again for each
#: one would cost an allocation and a copy of megabytes per frame), and given back to
#: ``_KEEP_BYTES`` once the connection has sent nothing for ``_BUFFER_IDLE_S``.
_INITIAL_BYTES = 4096
_KEEP_BYTES = 1024 * 1024
_BUFFER_IDLE_S = 1.0
#: Bytes received per read callback at most (a tenth of a millisecond of copying; a peer
#: over its budget of bytes received then owes at most about that much per connection,
#: which is what its neighbours' large frames may wait for: 4 ms at 64 MiB/s, 16 ms with
#: reads of 1 MiB), and received bytes in one callback above which the frames they
#: complete are decoded in the loop's next pass, not in the same callback.
_READ_BYTES = 256 * 1024
_DECODE_LATER_BYTES = 256 * 1024
#: While other peers are served too (``PeerTurns.contended``), a reply larger than this is
#: written a piece per turn: over loopback the kernel delivers what one ``send`` sends within
#: that call, on the event loop's time (a 320 KiB reply took 2 ms of it in one call).
WRITE_PIECE_BYTES = 64 * 1024
#: A connection holding fewer bytes than this (a read included) is never held back by its peer's
#: budget of bytes received, only charged: heartbeats and an engine's usual requests go on
#: whatever a neighbour behind the same address sends; large frames wait for the budget.
NEVER_HELD_BYTES = 64 * 1024

Reply = Message
#: A sliced request: yields between slices, returns its reply (``None``: a reply written
#: a piece per step, already sent).
Job = Generator[None, None, "Reply | None"]


class ConnectionHost(Protocol):
    """What a connection needs of the server that accepted it (``IndexServer``)."""

    limits: "ServerLimits"
    refusals: "RateLimitedLog"
    heap: "HeapTrimmer"

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def turns(self) -> "PeerTurns": ...

    def handle(self, conn: "Connection", message: Any) -> Reply | Job: ...

    def admit(self, conn: "Connection") -> None: ...

    def forget(self, conn: "Connection") -> None: ...

    def closing(self, conn: "Connection", reason: str) -> None: ...

    def check_receive_growth(self, current: int, wanted: int) -> None: ...

    def received(self, conn: "Connection", nbytes: int) -> float: ...


class Connection(asyncio.BufferedProtocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: ConnectionHost, peer_key: str = "unknown") -> None:
        self._server = server
        self.peer_key = peer_key  # whose budgets and turns it uses (``maru_core.index.peers``, ``turns``)
        self.received_bytes = 0  # a peer that closes before sending a byte costs its budget nothing
        self.closed_by_server = False
        limits = server.limits
        self._frames = FrameBuffer(_INITIAL_BYTES, _INITIAL_BYTES, limits.pre_auth_frame_bytes, 2 * MAX_FRAME_BYTES,
                                   may_grow=server.check_receive_growth, views=True)
        self._writer = FrameWriter()
        self._transport: asyncio.Transport | None = None
        self._job: Job | None = None  # a sliced request under way: read nothing more meanwhile
        self._yielded = False  # its turn is over: read nothing more until the loop comes back
        self._held = False  # over its peer's received-bytes budget: read nothing until it refills
        self._write_paused = False
        self.peer = "unix"
        self.lease_id: str | None = None
        self.client: str | None = None
        self.opened_leases: list[str] = []  # every lease this connection opened or resumed
        self.close_after_reply: str | None = None  # the reason, once a reply must be the last one
        self.hold_last_reply_s = 0.0  # how long that last reply waits (a failing peer's back-off)
        self.connected_at = self.last_active = time.monotonic()
        # When the frame under way began to arrive, and when replies began to
        # wait for the peer to read them: deadlines run from there.
        self.frame_started_at = self.write_paused_at = self.connected_at

    # -- asyncio callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream socket's
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._transport = transport
        self.peer = str(transport.get_extra_info("peername") or "unix")
        self._server.admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # The peer went away; its lease lives on until it lapses.
        self._server.forget(self)
        self._server.turns.forget(self)
        self._job = None
        self._transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self._frames.writable()[:_READ_BYTES]
        except FrameError as exc:  # a header above the limit, seen before the frame completes
            self._frame_error(exc)
            return memoryview(bytearray(_INITIAL_BYTES))  # asyncio needs somewhere to put these bytes

    def buffer_updated(self, nbytes: int) -> None:
        if self._transport is None or self._transport.is_closing():
            return  # closed on a bad header: these bytes went to a throwaway buffer
        now = time.monotonic()
        if not self._frames.pending_bytes:
            self.frame_started_at = now
        self._frames.advance(nbytes)
        self.received_bytes += nbytes
        self._server.heap.note(nbytes)
        self.last_active = now
        hold_s = self._server.received(self, nbytes)
        if hold_s > 0 and self._frames.pending_bytes >= NEVER_HELD_BYTES:
            self._hold_reading(hold_s)
        if nbytes >= _DECODE_LATER_BYTES:
            self._yield_turn()  # this callback copied a lot already: decode in the next pass
        elif self._job is not None or self._yielded:
            return  # its next turn answers these bytes too
        elif self._has_complete_frame():
            # now, or at its peer's next turn when the peer used its share of this round
            self._server.turns.run_or_wait(self, self._answer_buffered, self._yield_turn)

    def _hold_reading(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (the frames already received are answered as usual)."""
        self._held = True
        self._update_reading()
        self._server.loop.call_later(seconds, self._release_reading, seconds)

    def _release_reading(self, held_s: float) -> None:
        self._held = False
        if self._frames.pending_bytes:
            self.frame_started_at += held_s  # the frame's deadline does not count our wait
        self._update_reading()

    def _has_complete_frame(self) -> bool:
        try:
            return self._frames.complete()
        except FrameError as exc:
            self._frame_error(exc)
            return False

    def eof_received(self) -> bool:
        return False  # close our side too

    def pause_writing(self) -> None:
        self._write_paused = True
        self.write_paused_at = time.monotonic()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.last_active = time.monotonic()
        self._update_reading()

    # -- state for the server's deadline sweep -------------------------------

    @property
    def authenticated(self) -> bool:
        return self.lease_id is not None or bool(self.opened_leases)

    def stalled(self) -> bool:
        """Whether the peer owes us something: the rest of a frame, or reading its replies."""
        if self._job is not None or self._yielded or self._held:
            return False  # the wait is ours, not the peer's
        return self._write_paused or self._frames.pending_bytes > 0

    def stalled_since(self) -> float:
        """When what the peer owes began: the first byte of the frame under way
        (a byte a second does not extend its deadline), or the replies it stopped reading."""
        if self._frames.pending_bytes > 0:
            return self.frame_started_at if not self._write_paused else min(self.frame_started_at,
                                                                            self.write_paused_at)
        return self.write_paused_at

    @property
    def receive_bytes(self) -> int:
        """Bytes this connection's receive buffer holds room for."""
        return self._frames.capacity

    def release_idle_buffer(self, now: float) -> bool:
        """Give back a grown receive buffer once the peer has sent nothing for a while."""
        return now - self.last_active > _BUFFER_IDLE_S and self._frames.shrink(_KEEP_BYTES)

    def opened(self, lease_id: str) -> None:
        """``hello`` succeeded: the connection may now send frames of full size."""
        self.lease_id = lease_id
        if lease_id not in self.opened_leases:
            self.opened_leases.append(lease_id)
        self._frames.set_max_frame(MAX_FRAME_BYTES)

    # -- requests ------------------------------------------------------------

    def _answer_buffered(self) -> None:
        """Answer complete frames in order until one starts a sliced job or the turn is over."""
        turn_ends = time.perf_counter() + self._server.turns.share_s
        answered = 0  # at least one frame per turn, however short the turn
        try:
            while self._transport is not None and self._job is None and self._frames.complete():
                if answered and time.perf_counter() > turn_ends:
                    self._yield_turn()
                    return
                answered += 1
                message = self._frames.pop()
                self.frame_started_at = self.last_active  # the next frame's first bytes came with the last read
                outcome = self._server.handle(self, message)
                if isinstance(outcome, dict):
                    if self.close_after_reply is not None:
                        self._last_reply(outcome)
                        return
                    self._send(outcome)
                    if self._job is not None:  # a large reply, written a piece per turn
                        self._update_reading()
                        self._after_ready_io(self._step_job)
                        return
                else:
                    self._job = outcome
                    self._update_reading()
                    self._after_ready_io(self._step_job)
                    return
        except FrameError as exc:
            self._frame_error(exc)

    def _last_reply(self, reply: Reply) -> None:
        """Send the connection's last reply and close it: at once, or once
        ``hold_last_reply_s`` has passed (a failing peer's back-off), reading nothing meanwhile."""
        delay, self.hold_last_reply_s = self.hold_last_reply_s, 0.0
        if delay > 0 and self._transport is not None:
            self._yielded = True  # the wait is ours: no deadline runs on the peer meanwhile
            self._update_reading()
            self._server.loop.call_later(delay, self._last_reply, reply)
            return
        self._send(reply, whole=True)
        assert self.close_after_reply is not None
        self._server.closing(self, self.close_after_reply)
        self.close()

    def _frame_error(self, exc: FrameError) -> None:
        self._server.refusals.warning("closing connection from %s: %s", self.peer, exc)
        if isinstance(exc, FrameTooLarge):
            self._send(error_reply(None, ProtocolError(ErrorType.TOO_LARGE, str(exc))), whole=True)
        self._server.closing(self, "bad_frame")
        self.close()

    def _yield_turn(self) -> None:
        self._yielded = True
        self._update_reading()
        self._after_ready_io(self._resume_turn)

    def _after_ready_io(self, callback) -> None:
        """Run ``callback`` at this connection's next turn: its peer's next turn in the
        next round, which runs after the connections that became readable meanwhile."""
        self._server.turns.wait_turn(self, callback)

    def _resume_turn(self) -> None:
        # Reading resumes after the turn, only if it answered every frame buffered: a
        # pipelining peer's connection that yields again stays paused, where resuming first
        # cost two epoll calls a turn (about a fifth of such a turn's time).
        self._yielded = False
        self._answer_buffered()
        self._update_reading()

    def _step_job(self) -> None:
        """Run the job's next slices until this turn is used (one at least: the first
        ran in ``handle``), beginning none that would likely end past it (``TurnEnd``);
        when it is done, send its reply and go on reading."""
        job = self._job
        if job is None:
            return  # the connection closed meanwhile
        turn = TurnEnd(self._server.turns.share_s, time.perf_counter)
        try:
            next(job)
            while turn.another_fits():
                next(job)
        except StopIteration as done:
            self._job = None
            if done.value is not None:
                if _payload_bytes(done.value) > WRITE_PIECE_BYTES and not turn.another_fits():
                    # Encoding a large reply and writing its first piece is a step of its own,
                    # begun in this turn only if it would likely end within it (as any step).
                    self._job = _reply_job(done.value)
                    self._after_ready_io(self._step_job)
                    return
                self._send(done.value)
            if self._job is None:
                self._answer_buffered()
                self._update_reading()  # after the frames buffered, as in ``_resume_turn``
                return
        self._after_ready_io(self._step_job)

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._write_paused or self._job is not None or self._yielded or self._held:
            if transport.is_reading():
                transport.pause_reading()
        elif not transport.is_reading():
            transport.resume_reading()

    def _send(self, reply: Reply, whole: bool = False) -> None:
        """Write ``reply``: at once, or (a large one while the loop is contended, unless
        ``whole``) its first piece now and the rest a piece per turn, as this connection's job."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not whole and self._server.turns.contended:
            parts = self._writer.parts(reply)
            length = sum(map(len, parts))
            if length > WRITE_PIECE_BYTES:
                self._server.heap.note(length)
                self._job = self._write_pieces(parts)
                next(self._job)  # the first piece, in this turn
                return
            frame: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
        else:
            frame = self._writer.frame(reply)
        self._server.heap.note(len(frame))
        transport.write(frame)
        if isinstance(frame, memoryview) and transport.get_write_buffer_size():
            self._writer.release()  # the transport may still hold the view: the next frame gets a new buffer

    def _write_pieces(self, parts: list[bytes | memoryview]) -> Job:
        """Write the frame made of ``parts`` (``FrameWriter.parts``) a ``WRITE_PIECE_BYTES``
        piece per step, straight from the reply's own bins: assembling a 480 KiB reply
        first was a copy into a fresh buffer, page faults included, in one turn."""
        for i, piece in enumerate(_pieces(parts, WRITE_PIECE_BYTES)):
            if i:
                yield
            if self._transport is None or self._transport.is_closing():
                return None
            for view in piece:  # a few bytes of header and field names, the rest one view
                self._transport.write(view)
        return None

    def close(self) -> None:
        self._closing()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Close now, dropping unsent replies (a peer that does not read them)."""
        self._closing()
        if self._transport is not None:
            self._transport.abort()

    def _closing(self) -> None:
        """Stop all work at once. The receive buffer goes now, not at ``connection_lost``:
        asyncio calls that in a later pass of the loop, and until then a refused
        frame's buffer counted against the cap on all of them, so the connections
        read in the same pass were refused too (sometimes every one)."""
        self._job = None
        self.closed_by_server = True
        self._frames.discard()


def _pieces(parts: list[bytes | memoryview], size: int) -> Iterator[list[memoryview]]:
    """``parts`` cut into consecutive pieces of ``size`` bytes (the last one shorter), each a
    list of views of the parts it covers."""
    piece: list[memoryview] = []
    room = size
    for part in parts:
        view = memoryview(part)
        while len(view):
            piece.append(view[:room])
            room -= len(piece[-1])
            view = view[len(piece[-1]) :]
            if not room:
                yield piece
                piece, room = [], size
    if piece:
        yield piece


def _reply_job(reply: Reply) -> Job:
    """A job whose one step returns ``reply``: a finished job's large reply, sent at its next turn."""
    return reply
    yield  # a generator: ``_step_job`` runs it as any job


def _payload_bytes(reply: Reply) -> int:
    """The bytes of a reply's binary fields (keys, locations, slots): most of what encoding it costs."""
    return sum(value.nbytes if isinstance(value, memoryview) else len(value)
               for value in reply.values() if isinstance(value, (bytes, bytearray, memoryview)))  # fmt: skip
