"""The index service: one asyncio server in front of one pool's ``Registry``.

Every connection speaks the framed protocol of ``maru_core.protocol``.
Requests are handled in arrival order, inline on the event loop: registry
operations are pure and fast, so a pipelined client gets its replies in the
order it sent them. A malformed frame closes only its own connection; a
well-framed request with wrong types or an unknown op gets a typed error
reply and the connection stays open.

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
from typing import Any, Callable

from maru_core.index.registry import RegistryError
from maru_core.protocol import (
    PROTOCOL_VERSION,
    Address,
    ErrorType,
    FrameError,
    FrameTooLarge,
    ProtocolError,
    TcpAddress,
    UnixAddress,
    encode_frame,
    error_reply,
    new_packer,
    ok_reply,
    pack_locations,
    pack_slots,
    parse_request,
    read_frame,
    request_id,
)

log = logging.getLogger(__name__)

#: Pending reply bytes above which a connection waits for its peer to read.
_WRITE_HIGH_WATER = 4 * 1024 * 1024


@dataclasses.dataclass
class _Connection:
    peer: str
    lease_id: str | None = None
    client: str | None = None
    packer: Any = dataclasses.field(default_factory=new_packer)


class IndexServer:
    """Serves one ``Registry`` over TCP or a Unix socket.

    ``registry`` is a ``maru_core.index.registry.Registry``; ``pool`` the
    attached ``Pool`` (the server reads slot headers through it to verify
    commits); ``token``, when set, must be presented by ``hello``;
    ``metrics`` an optional ``IndexMetrics`` that records every request.
    """

    def __init__(
        self,
        registry: Any,
        pool: Any,
        *,
        token: str | None = None,
        expiry_interval_s: float = 1.0,
        metrics: Any = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self._token = token.encode() if token else None
        self._expiry_interval_s = expiry_interval_s
        self._metrics = metrics
        self._server: asyncio.base_events.Server | None = None
        self._expiry_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self._unix_path: str | None = None
        self._handlers: dict[str, Callable[[_Connection, dict], dict]] = {
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

    # -- lifecycle -----------------------------------------------------------

    async def start(self, address: Address) -> Address:
        """Listen on ``address``; return the bound address (a TCP port 0 becomes the real port)."""
        if isinstance(address, UnixAddress):
            if os.path.exists(address.path):
                os.unlink(address.path)  # a socket left by a previous run
            self._server = await asyncio.start_unix_server(self._serve_connection, path=address.path)
            self._unix_path = address.path
            bound: Address = address
        else:
            self._server = await asyncio.start_server(
                self._serve_connection, host=address.host, port=address.port
            )
            port = self._server.sockets[0].getsockname()[1]
            bound = TcpAddress(address.host, port)
        self._expiry_task = asyncio.create_task(self._expire_periodically())
        return bound

    async def close(self) -> None:
        """Stop listening, drop every connection, stop the expiry task."""
        if self._server is not None:
            self._server.close()
        tasks = [t for t in (self._expiry_task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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

    # -- connections ---------------------------------------------------------

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername") or "unix"
        conn = _Connection(peer=str(peer))
        try:
            await self._read_requests(conn, reader, writer)
        except FrameError as exc:
            log.warning("closing connection from %s: %s", conn.peer, exc)
            if isinstance(exc, FrameTooLarge):
                self._send(conn, writer, error_reply(None, ProtocolError(ErrorType.TOO_LARGE, str(exc))))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer went away; its lease lives on until it lapses
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _read_requests(
        self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            message = await read_frame(reader)
            if message is None:
                return
            self._send(conn, writer, self.handle(conn, message))
            transport = writer.transport
            if transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await writer.drain()

    def _send(self, conn: _Connection, writer: asyncio.StreamWriter, reply: dict) -> None:
        if not writer.is_closing():
            writer.write(encode_frame(reply, conn.packer))

    def handle(self, conn: _Connection, message: Any) -> dict:
        """Answer one decoded request: a reply map, never an exception."""
        started = time.perf_counter()
        op = "invalid"
        try:
            request = parse_request(message)
            op = request.op
            if op != "hello" and conn.lease_id is None:
                raise ProtocolError(ErrorType.NO_LEASE, "no lease on this connection: send hello first")
            reply = ok_reply(request.id, **self._handlers[op](conn, request.args))
        except ProtocolError as exc:
            reply = error_reply(request_id(message), exc)
        except RegistryError as exc:
            reply = error_reply(request_id(message), ProtocolError(ErrorType(exc.error_type), str(exc)))
        except Exception as exc:
            log.exception("op %s failed", op)
            error = ProtocolError(ErrorType.INTERNAL, f"the index failed on {op}: {type(exc).__name__}: {exc}")
            reply = error_reply(request_id(message), error)
        if self._metrics is not None:
            error_type = None if reply["ok"] else reply["error"]["type"]
            self._metrics.observe_rpc(op, time.perf_counter() - started, error_type)
        return reply

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
        items = list(zip(args["keys"], args["lengths"]))
        return {"slots": pack_slots(self.registry.reserve(self._renewed(conn), items))}

    def _commit(self, conn: _Connection, args: dict) -> dict:
        committed = self.registry.commit(self._renewed(conn), args["keys"], verify=self._verify)
        return {"committed": committed}

    def _abort(self, conn: _Connection, args: dict) -> dict:
        return {"aborted": self.registry.abort(self._renewed(conn), args["keys"])}

    def _stats(self, conn: _Connection, args: dict) -> dict:
        self._renewed(conn)
        return stats_to_wire(self.registry.stats())

    def _bye(self, conn: _Connection, args: dict) -> dict:
        """End the lease now (a client closing cleanly): its pins and reservations go at once."""
        closed = self.registry.close_lease(conn.lease_id)
        conn.lease_id = None
        return {"closed": closed}

    def _verify(self, key: bytes, slot: Any) -> bool:
        """Whether the slot header the writer wrote names ``key`` and the slot's generation."""
        try:
            header = self.pool.read_slot_header(slot.offset)
        except Exception as exc:  # a corrupt or missing header fails only this commit
            log.warning("slot header at %d unreadable: %s", slot.offset, exc)
            return False
        return header is not None and header.names(key, slot.generation)


def stats_to_wire(stats: Any) -> dict[str, Any]:
    """``RegistryStats`` as the stats reply's fields."""
    return dataclasses.asdict(stats)
