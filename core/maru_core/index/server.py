"""The index service: one asyncio server in front of one pool's ``Registry``.

Every connection speaks the framed protocol of ``maru_core.protocol``. A
connection is an ``asyncio.BufferedProtocol``: the kernel writes its bytes
straight into the connection's ``FrameBuffer``, and each complete frame is
decoded from there and answered in the same callback, with one ``write``
per reply (no task, no stream reader, no copy of the request in between).
Requests of one connection are answered in arrival order, so a pipelined
client gets its replies in the order it sent them. A malformed frame closes
only its own connection; a well-framed request with wrong types or an
unknown op gets a typed error reply and the connection stays open.

Large batches do not stall other clients: a ``commit`` or ``abort`` of more
than ``SLICE_KEYS`` keys runs as consecutive slices, each one registry call
(atomic), with the event loop free to answer other connections between
slices; the connection reads nothing more until the last slice has
answered, which keeps its order. Both ops act on each key on its own, so a
batch sliced means exactly what it means whole (a key repeated across
slices is committed once, by its first occurrence); only what others see
in between differs: part of the batch already committed. ``retrieve`` (its
all-or-nothing pin), ``reserve`` (one placement for the whole batch), and
``unpin``, ``match_prefix`` (vectorised, fast) always run whole.

Leases: ``hello`` opens (or resumes) the connection's lease; every later
request renews it. A connection that drops keeps its lease until it lapses,
so a client that reconnects in time resumes it with its pins and
reservations. A periodic task expires lapsed leases and stale reservations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
from collections.abc import Generator
from typing import Any, Callable

from maru_core.index.registry import RegistryError
from maru_core.index.slot_check import SlotHeaderCheck
from maru_core.protocol import (
    KEY_BYTES,
    PROTOCOL_VERSION,
    Address,
    ErrorType,
    FrameError,
    FrameTooLarge,
    ProtocolError,
    TcpAddress,
    UnixAddress,
    error_reply,
    ok_reply,
    pack_locations,
    pack_slots,
    parse_request,
    request_id,
)
from maru_core.protocol.framing import FrameBuffer, FrameWriter

log = logging.getLogger(__name__)

#: Pending reply bytes above which a connection stops reading until its peer has read them.
_WRITE_HIGH_WATER = 4 * 1024 * 1024
#: Keys per slice of a large ``commit`` or ``abort`` (a slice is about a millisecond of work).
SLICE_KEYS = 2048

Reply = dict[str, Any]
#: A sliced request: yields between slices, returns its reply.
Job = Generator[None, None, Reply]


class _Connection(asyncio.BufferedProtocol):
    """One client connection: frames in through a ``FrameBuffer``, replies out, in order."""

    def __init__(self, server: "IndexServer") -> None:
        self._server = server
        self._frames = FrameBuffer()
        self._writer = FrameWriter()
        self._transport: asyncio.Transport | None = None
        self._job: Job | None = None  # a sliced request under way: read nothing more meanwhile
        self._write_paused = False
        self.peer = "unix"
        self.lease_id: str | None = None
        self.client: str | None = None

    # -- asyncio callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.peer = str(transport.get_extra_info("peername") or "unix")
        self._server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # The peer went away; its lease lives on until it lapses.
        self._server._connections.discard(self)
        self._job = None
        self._transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.writable()

    def buffer_updated(self, nbytes: int) -> None:
        self._frames.advance(nbytes)
        self._answer_buffered()

    def eof_received(self) -> bool:
        return False  # close our side too

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # -- requests ------------------------------------------------------------

    def _answer_buffered(self) -> None:
        """Answer every complete frame in the buffer, in order, until one starts a sliced job."""
        try:
            while self._transport is not None and self._job is None and self._frames.complete():
                outcome = self._server.handle(self, self._frames.pop())
                if isinstance(outcome, dict):
                    self._send(outcome)
                else:
                    self._job = outcome
                    self._update_reading()
                    self._server._loop.call_soon(self._step_job)
                    return
        except FrameError as exc:
            log.warning("closing connection from %s: %s", self.peer, exc)
            if isinstance(exc, FrameTooLarge):
                self._send(error_reply(None, ProtocolError(ErrorType.TOO_LARGE, str(exc))))
            self.close()

    def _step_job(self) -> None:
        """Run the next slice of the job; when it is done, send its reply and go on reading."""
        job = self._job
        if job is None:
            return  # the connection closed meanwhile
        try:
            next(job)
        except StopIteration as done:
            self._job = None
            self._send(done.value)
            self._update_reading()
            self._answer_buffered()
        else:
            self._server._loop.call_soon(self._step_job)

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._write_paused or self._job is not None:
            if transport.is_reading():
                transport.pause_reading()
        elif not transport.is_reading():
            transport.resume_reading()

    def _send(self, reply: Reply) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        frame = self._writer.frame(reply)
        transport.write(frame)
        if isinstance(frame, memoryview) and transport.get_write_buffer_size():
            self._writer.release()  # the transport may still hold the view: the next frame gets a new buffer

    def close(self) -> None:
        self._job = None
        if self._transport is not None:
            self._transport.close()


class IndexServer:
    """Serves one ``Registry`` over TCP or a Unix socket.

    ``registry`` is a ``maru_core.index.registry.Registry``; ``pool`` the
    attached ``Pool`` (the server reads slot headers through it to verify
    commits); ``token``, when set, must be presented by ``hello``;
    ``metrics`` an optional ``IndexMetrics`` that records every request;
    ``slice_keys`` the keys per slice of a large commit or abort.
    """

    def __init__(
        self,
        registry: Any,
        pool: Any,
        *,
        token: str | None = None,
        expiry_interval_s: float = 1.0,
        metrics: Any = None,
        slice_keys: int = SLICE_KEYS,
    ) -> None:
        if slice_keys < 1:
            raise ValueError(f"slice_keys must be at least 1, got {slice_keys}")
        self.registry = registry
        self.pool = pool
        self._token = token.encode() if token else None
        self._expiry_interval_s = expiry_interval_s
        self._metrics = metrics
        self._slice_bytes = slice_keys * KEY_BYTES
        self._verify = SlotHeaderCheck(pool)
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expiry_task: asyncio.Task | None = None
        self._connections: set[_Connection] = set()
        self._unix_path: str | None = None
        self._handlers: dict[str, Callable[[_Connection, dict], Reply]] = {
            "hello": self._hello,
            "heartbeat": self._heartbeat,
            "match_prefix": self._match_prefix,
            "retrieve": self._retrieve,
            "unpin": self._unpin,
            "reserve": self._reserve,
            "commit": self._commit,
            "abort": self._abort,
            "stats": self._stats,
            "bye": self._bye,
        }
        self._sliced: dict[str, Callable[[_Connection, dict], Generator[None, None, dict]]] = {
            "commit": self._commit_sliced,
            "abort": self._abort_sliced,
        }

    # -- lifecycle -----------------------------------------------------------

    async def start(self, address: Address) -> Address:
        """Listen on ``address``; return the bound address (a TCP port 0 becomes the real port)."""
        self._loop = asyncio.get_running_loop()
        protocol = lambda: _Connection(self)  # noqa: E731
        if isinstance(address, UnixAddress):
            if os.path.exists(address.path):
                os.unlink(address.path)  # a socket left by a previous run
            self._server = await self._loop.create_unix_server(protocol, path=address.path)
            self._unix_path = address.path
            bound: Address = address
        else:
            self._server = await self._loop.create_server(protocol, host=address.host, port=address.port)
            port = self._server.sockets[0].getsockname()[1]
            bound = TcpAddress(address.host, port)
        self._expiry_task = asyncio.create_task(self._expire_periodically())
        return bound

    async def close(self) -> None:
        """Stop listening, drop every connection, stop the expiry task."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            await asyncio.gather(self._expiry_task, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._unix_path and os.path.exists(self._unix_path):
            os.unlink(self._unix_path)

    async def _expire_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._expiry_interval_s)
            try:
                report = self.registry.expire()
            except Exception:  # the loop must survive a registry bug
                log.exception("lease expiry failed")
                continue
            if report.lapsed_leases or report.reservations_released:
                log.info(
                    "expired %d lapsed lease(s), released %d pin(s) and %d reservation(s)",
                    len(report.lapsed_leases), report.pins_released, report.reservations_released,
                )

    # -- requests ------------------------------------------------------------

    def handle(self, conn: _Connection, message: Any) -> Reply | Job:
        """Answer one decoded request: a reply map, or a job whose slices
        end in one (never an exception)."""
        started = time.perf_counter()
        op = "invalid"
        try:
            request = parse_request(message)
            op = request.op
            if op != "hello" and conn.lease_id is None:
                raise ProtocolError(ErrorType.NO_LEASE, "no lease on this connection: send hello first")
            keys = request.args.get("keys")
            if op in self._sliced and len(keys) > self._slice_bytes:
                return self._job(conn, request, started)
            reply = ok_reply(request.id, **self._handlers[op](conn, request.args))
        except Exception as exc:
            reply = self._error(message, op, exc)
        self._observe(op, started, reply)
        return reply

    def _job(self, conn: _Connection, request: Any, started: float) -> Job:
        try:
            result = yield from self._sliced[request.op](conn, request.args)
            reply = ok_reply(request.id, **result)
        except Exception as exc:
            reply = self._error({"id": request.id}, request.op, exc)
        self._observe(request.op, started, reply)
        return reply

    def _error(self, message: Any, op: str, exc: Exception) -> Reply:
        if isinstance(exc, ProtocolError):
            return error_reply(request_id(message), exc)
        if isinstance(exc, RegistryError):
            return error_reply(request_id(message), ProtocolError(ErrorType(exc.error_type), str(exc)))
        log.error("op %s failed", op, exc_info=exc)
        error = ProtocolError(ErrorType.INTERNAL, f"the index failed on {op}: {type(exc).__name__}: {exc}")
        return error_reply(request_id(message), error)

    def _observe(self, op: str, started: float, reply: Reply) -> None:
        if self._metrics is not None:
            error_type = None if reply["ok"] else reply["error"]["type"]
            self._metrics.observe_rpc(op, time.perf_counter() - started, error_type)

    # -- operations ----------------------------------------------------------

    def _hello(self, conn: _Connection, args: dict) -> dict:
        if args["protocol"] != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorType.BAD_REQUEST,
                f"client speaks protocol {args['protocol']}, this index speaks {PROTOCOL_VERSION}; "
                "run matching MaruCache versions",
            )
        if self._token is not None:
            offered = (args["token"] or "").encode()
            if not hmac.compare_digest(offered, self._token):
                raise ProtocolError(
                    ErrorType.AUTH,
                    "wrong or missing token; use the token of this cache's index (its token file or Secret)",
                )
        conn.lease_id = self.registry.open_lease(args["client"], args["lease_id"])
        conn.client = args["client"]
        return {
            "lease_id": conn.lease_id,
            "lease_ttl_s": self.registry.lease_ttl_s,
            "geometry": self.pool.geometry.to_dict(),
            "protocol": PROTOCOL_VERSION,
        }

    def _renewed(self, conn: _Connection) -> str:
        self.registry.renew(conn.lease_id)
        return conn.lease_id

    def _heartbeat(self, conn: _Connection, args: dict) -> dict:
        self._renewed(conn)
        return {"lease_ttl_s": self.registry.lease_ttl_s}

    def _match_prefix(self, conn: _Connection, args: dict) -> dict:
        self._renewed(conn)
        return {"matched": self.registry.match_prefix(args["keys"])}

    def _retrieve(self, conn: _Connection, args: dict) -> dict:
        locations = self.registry.retrieve(self._renewed(conn), args["keys"])
        return {"locations": pack_locations(locations)}

    def _unpin(self, conn: _Connection, args: dict) -> dict:
        return {"unpinned": self.registry.unpin(self._renewed(conn), args["keys"])}

    def _reserve(self, conn: _Connection, args: dict) -> dict:
        slots = self.registry.reserve_packed(self._renewed(conn), args["keys"], args["lengths"])
        return {"slots": pack_slots(slots)}

    def _commit(self, conn: _Connection, args: dict) -> dict:
        committed = self.registry.commit(self._renewed(conn), args["keys"], verify=self._verify)
        return {"committed": committed}

    def _abort(self, conn: _Connection, args: dict) -> dict:
        return {"aborted": self.registry.abort(self._renewed(conn), args["keys"])}

    def _slices(self, keys: bytes) -> Generator[bytes, None, None]:
        for start in range(0, len(keys), self._slice_bytes):
            yield keys[start : start + self._slice_bytes]

    def _commit_sliced(self, conn: _Connection, args: dict) -> Generator[None, None, dict]:
        committed: list[bool] = []
        for i, keys in enumerate(self._slices(args["keys"])):
            if i:
                yield  # let other connections in
            committed += self.registry.commit(self._renewed(conn), keys, verify=self._verify)
        return {"committed": committed}

    def _abort_sliced(self, conn: _Connection, args: dict) -> Generator[None, None, dict]:
        aborted = 0
        for i, keys in enumerate(self._slices(args["keys"])):
            if i:
                yield
            aborted += self.registry.abort(self._renewed(conn), keys)
        return {"aborted": aborted}

    def _stats(self, conn: _Connection, args: dict) -> dict:
        self._renewed(conn)
        return stats_to_wire(self.registry.stats())

    def _bye(self, conn: _Connection, args: dict) -> dict:
        """End the lease now (a client closing cleanly): its pins and reservations go at once."""
        closed = self.registry.close_lease(conn.lease_id)
        conn.lease_id = None
        return {"closed": closed}


def stats_to_wire(stats: Any) -> dict[str, Any]:
    """``RegistryStats`` as the stats reply's fields."""
    return dataclasses.asdict(stats)
