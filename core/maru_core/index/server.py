"""The index service: one asyncio server in front of one pool's ``Registry``.

Every connection speaks the framed protocol of ``maru_core.protocol``
(``maru_core.index.connection`` receives and answers its frames). A
malformed frame closes only its own connection; a well-framed request with
wrong types or an unknown op gets a typed error reply and the connection
stays open; a wrong token is answered, logged, counted and the connection
closed.

No request holds the event loop for long. A ``commit`` or ``abort`` of more
than ``SLICE_KEYS`` keys runs as consecutive slices, each one registry call
(atomic), with the event loop free to answer other connections between
slices; the connection reads nothing more until the last slice has
answered, which keeps its order. Both ops act on each key on its own, so a
batch sliced means exactly what it means whole (a key repeated across
slices is committed once, by its first occurrence); only what others see
in between differs: part of the batch already committed. ``unpin`` and
``bye`` release a lease's pins chunk by chunk (``Registry.unpin_sliced``,
``close_lease_sliced``), and lapsed leases are released the same way. A
large ``reserve`` looks its keys up a slice per step, places the whole
batch (its eviction bounded) in one step, then adds its records a slice per
step (``Registry.reserve_sliced``). A large ``retrieve`` or ``match_prefix``
looks its keys up a slice per step; a retrieve then checks, in its last
step, that every key found is still there, committed, and pins them all at
once (``Registry.retrieve_sliced``), so it stays all or nothing; a large
``retrieve_prefix`` likewise, its lookups stopping at the first slice with
a miss.

A job that starts while other peers are served (``PeerTurns.contended``)
takes slices ``CONTENDED_SLICE_DIVISOR`` times smaller, so that one slice
fits the shorter share of a contended loop.

``list_objects`` and ``flush`` (``maru_core.index.object_ops``) walk the
record table a range of rows per request, a slice of rows per step.
``put_aliases`` and ``match_alias`` (``maru_core.index.alias_ops``) run in
steps too, over the index's table of block aliases.

Connections are accepted a few per event-loop callback
(``maru_core.index.accept``); one whose peer already closed it is dropped
there, costing nothing more. The per-peer budgets and ``hello``'s
authentication are ``maru_core.index.admission``'s: a peer (an IP address,
a Unix socket's user, or a pod by its credential) over its budget of new
connections has them closed at accept, unread; one over its budget of auth
failures has its failing connections' answers held back, never its other
connections refused; one over its budget of bytes received has its
connection read no more until the budget refills. Turns on the event loop
are shared out per peer (``maru_core.index.turns``).

Limits (``maru_core.index.limits``): a connection cap, a small frame limit
until ``hello`` succeeds, deadlines for ``hello``, for a frame under way and
for an idle connection, a cap on the leases one connection opens, and the
per-peer budgets. A periodic sweep enforces the deadlines. The registry's
quotas per lease, and per peer over its leases (``maru_core.index.quotas``:
a lease is its connection's peer's) answer ``quota``; each refusal,
and each call one cut short, is counted by quota and logged at most a line
per ten seconds.

Leases: ``hello`` opens (or resumes) the connection's lease; every later
request renews it. A connection that drops keeps its lease until it lapses,
so a client that reconnects in time resumes it with its pins and
reservations. A periodic task expires lapsed leases and stale reservations.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import struct
import time
from collections.abc import Generator
from typing import Any, Callable, cast

from maru_core.index.accept import Acceptor, bind_tcp
from maru_core.index.admission import Admission
from maru_core.index.alias_ops import AliasOps, MatchAliasArgs, PutAliasesArgs
from maru_core.index.aliases import AliasTable
from maru_core.index.connection import Connection, Job, Reply
from maru_core.index.heap import HeapTrimmer
from maru_core.index.limits import SMALL_RECEIVE_BYTES, ServerLimits
from maru_core.index.listen import RateLimitedLog, UnixListenerPath
from maru_core.index.object_ops import FlushArgs, ListArgs, ObjectOps
from maru_core.index.peers import peer_of
from maru_core.index.registry import RegistryError
from maru_core.index.registry_types import RegistryStats, joined_keys
from maru_core.index.turns import PeerTurns
from maru_core.index.pool_watch import PoolSizeWatch
from maru_core.pool.commit_records import CommitRecords
from maru_core.pool.pool_identity import PoolIdentity
from maru_core.pool.slot_check import SlotHeaderCheck
from maru_core.pool.slots import SlotState
from maru_core.protocol.framing import VIEW_BINS_FROM
from maru_core.protocol import (
    KEY_BYTES,
    Address,
    ErrorType,
    FrameTooLarge,
    LocationList,
    Op,
    ProtocolError,
    TcpAddress,
    UnixAddress,
    error_reply,
    negotiate,
    ok_reply,
    pack_locations,
    pack_slots,
    parse_request,
    request_id,
)

log = logging.getLogger(__name__)

# run as jobs whatever their size
_ALWAYS_SLICED = frozenset({Op.UNPIN, Op.BYE, Op.MATCH_PREFIXES, Op.LIST_OBJECTS, Op.FLUSH, Op.PUT_ALIASES,
                            Op.MATCH_ALIAS})

#: Keys per slice of a large ``commit`` or ``abort`` (a slice is about a millisecond of work).
SLICE_KEYS = 2048
#: While other peers are served too (``PeerTurns.contended``), a large request that starts then
#: runs in slices this many times smaller (a slice about 0.2 ms, a few shares), at some cost in
#: its own time: the others wait for a slice at most.
CONTENDED_SLICE_DIVISOR = 4
#: A retrieve with this many bytes of keys or more (16,384 keys) looks up none in the turn
#: that received and decoded it: with its first slice that turn was the longest of a
#: retrieve. An engine's largest (a 64k-token prompt: 8,000 keys) is not delayed so.
LOOKUP_NEXT_TURN_FROM = VIEW_BINS_FROM
#: SO_LINGER on, zero seconds: close() resets the connection.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class IndexServer:
    """Serves one ``Registry`` over TCP or a Unix socket.

    ``registry`` is a ``maru_core.index.registry.Registry``; ``pool`` the
    attached ``Pool``, mapped writable (the server reads slot headers
    through it to verify commits, and marks them committed); ``token``, when set, must be presented by ``hello``;
    ``metrics`` an optional ``IndexMetrics`` that records every request;
    ``slice_keys`` the keys per slice of a large commit or abort;
    ``limits`` what one connection may cost (``ServerLimits``);
    ``aliases`` the table of block aliases (``None``: one of the default capacity).
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
        limits: ServerLimits | None = None,
        aliases: AliasTable | None = None,
    ) -> None:
        if slice_keys < 1:
            raise ValueError(f"slice_keys must be at least 1, got {slice_keys}")
        self.registry = registry
        self.pool = pool
        self.limits = limits or ServerLimits()
        self._expiry_interval_s = expiry_interval_s
        self._metrics = metrics
        self._slice_keys = slice_keys
        self._slice_bytes = slice_keys * KEY_BYTES  # requests of more keys run as jobs
        # A commit checks the writer's pending header, then marks it committed
        # before the reply: a restart restores committed headers only.
        self._verify = SlotHeaderCheck(pool, state=SlotState.PENDING)
        self._record = CommitRecords(pool)
        self.pool_watch = PoolSizeWatch(pool, registry, metrics)
        # What ``hello`` says this index serves: clients refuse an index whose region is not the one they mapped.
        self._served_pool = PoolIdentity.of_pool(pool)
        self._acceptors: list[Acceptor] = []
        self._handshakes: dict[asyncio.Task, socket.socket] = {}  # accepted sockets becoming connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turns: PeerTurns | None = None
        self._tasks: list[asyncio.Task] = []
        self._connections: dict[Connection, None] = {}  # insertion order: oldest first
        self._unix_listener: Any = None
        self.closed_connections: collections.Counter[str] = collections.Counter()
        self.refusals = RateLimitedLog(log)  # at most a line a second about bad peers
        self.heap = HeapTrimmer()  # gives back the heap that large frames freed (from the sweep)
        self.admission = Admission(self.limits, token, metrics, self.refusals)  # per-peer budgets, hello's auth
        self.quota_refusals: collections.Counter[str] = collections.Counter()
        self._quota_logs: dict[str, RateLimitedLog] = {}  # a line per 10 s and quota
        registry.quota_listener = self._quota_refused
        self._objects = ObjectOps(registry, pool, slice_keys, self._count_flushed)
        self.alias_ops = alias_ops = AliasOps(aliases if aliases is not None else AliasTable(), registry)
        flush = alias_ops.clearing_after(self._objects.flush)
        self._handlers: dict[Op, Callable[[Connection, dict], Reply]] = {
            Op.HELLO: self._hello,
            Op.HEARTBEAT: self._heartbeat,
            Op.MATCH_PREFIX: self._match_prefix,
            Op.RETRIEVE: self._retrieve,
            Op.RETRIEVE_PREFIX: self._retrieve_prefix,
            Op.RESERVE: self._reserve,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.STATS: self._stats,
        }
        # Ops that may run in slices: commit, abort, reserve, the retrieves and
        # match_prefix when large; unpin, bye, match_prefixes and the rest below always.
        self._sliced: dict[Op, Callable[[Connection, dict], Generator[None, None, dict]]] = {
            Op.MATCH_PREFIX: self._match_prefix_sliced,
            Op.MATCH_PREFIXES: self._match_prefixes_sliced,
            Op.RETRIEVE: self._retrieve_sliced,
            Op.RETRIEVE_PREFIX: self._retrieve_prefix_sliced,
            Op.COMMIT: self._commit_sliced,
            Op.ABORT: self._abort_sliced,
            Op.RESERVE: self._reserve_sliced,
            Op.UNPIN: self._unpin_sliced,
            Op.BYE: self._bye_sliced,
            # the arguments as their schemas (protocol.messages.SCHEMAS) checked them
            Op.LIST_OBJECTS: lambda conn, args: self._objects.list_objects(self._renewed(conn), cast(ListArgs, args)),
            Op.FLUSH: lambda conn, args: flush(self._renewed(conn), cast(FlushArgs, args)),
            Op.PUT_ALIASES: lambda conn, args: alias_ops.put_aliases(self._renewed(conn), cast(PutAliasesArgs, args)),
            Op.MATCH_ALIAS: lambda conn, args: alias_ops.match_alias(self._renewed(conn), cast(MatchAliasArgs, args)),
        }

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the server has not started"
        return self._loop

    @property
    def turns(self) -> PeerTurns:
        assert self._turns is not None, "the server has not started"
        return self._turns

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    # -- lifecycle -----------------------------------------------------------

    async def start(self, address: Address) -> Address:
        """Listen on ``address``; return the bound address (a TCP port 0 becomes the real port).

        A Unix socket path must be free or hold a stale socket (one nobody
        listens on); anything else raises ``ListenError`` with a one-line message.
        """
        self._loop = asyncio.get_running_loop()
        self._turns = turns = PeerTurns(self._loop, self.limits.turn_s, self.limits.shared_turn_s)
        if isinstance(address, UnixAddress):
            self._unix_listener = UnixListenerPath(address.path)
            sockets = [self._unix_listener.bind()]
            bound: Address = address
        else:
            sockets = bind_tcp(address.host, address.port)
            bound = TcpAddress(address.host, sockets[0].getsockname()[1])
        self._acceptors = [Acceptor(self._loop, sock, self._accepted, lambda: turns.accept_share_s)
                           for sock in sockets]
        for acceptor in self._acceptors:
            acceptor.start()
        self._tasks = [
            asyncio.create_task(self._expire_periodically()),
            asyncio.create_task(self._sweep_periodically()),
        ]
        return bound

    async def close(self) -> None:
        """Stop listening, drop every connection, stop the periodic tasks."""
        for acceptor in self._acceptors:
            acceptor.close()
        self._acceptors = []
        handshakes = dict(self._handshakes)
        for task in handshakes:
            task.cancel()
        await asyncio.gather(*handshakes, return_exceptions=True)
        for task, sock in handshakes.items():
            if task.cancelled():
                sock.close()  # it may have had no transport yet to close it
        for conn in list(self._connections):
            conn.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._unix_listener is not None:
            self._unix_listener.remove()

    def _accepted(self, sock: socket.socket, address: object) -> bool | None:
        """A socket just accepted: dropped (``None``) when its peer closed it already
        (a connect/close flood: no budget spent); reset at once (``False``) when its
        peer is over budget (nothing of it read; no TIME_WAIT left here); else made a
        ``Connection`` (``True``)."""
        if _closed_by_peer(sock):
            sock.close()
            return None
        peer = peer_of(sock, address)
        if not self.admission.admit(peer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            sock.close()
            return False
        sock.setblocking(False)
        protocol = lambda: Connection(self, peer)  # noqa: E731
        task = self.loop.create_task(self.loop.connect_accepted_socket(protocol, sock))
        self._handshakes[task] = sock
        task.add_done_callback(self._handshake_done)
        return True

    def _handshake_done(self, task: asyncio.Task) -> None:
        self._handshakes.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a connection failed before it started: %s", task.exception())

    def received(self, conn: Connection, nbytes: int) -> float:
        """``conn`` read ``nbytes``: how long it must not be read again, over its peer's budget."""
        return self.admission.received(conn, nbytes)

    @property
    def rate_limited(self) -> collections.Counter[str]:
        """Times a peer was held to a budget, by reason (``peers.RATE_LIMIT_REASONS``)."""
        return self.admission.rate_limited

    def _count_flushed(self, objects: int) -> None:
        if self._metrics is not None and objects:
            self._metrics.count_flushed(objects)

    def _quota_refused(self, quota: str, client: str, message: str) -> None:
        """A lease's or its peer's quota refused a call or cut it short: count it, log it (rate-limited)."""
        self.quota_refusals[quota] += 1
        if self._metrics is not None:
            self._metrics.count_quota_refusal(quota)
        quota_log = self._quota_logs.setdefault(quota, RateLimitedLog(log, interval_s=10.0))
        quota_log.warning("quota %s of client %r: %s", quota, client[:64], message)

    async def _expire_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._expiry_interval_s)
            try:
                steps = self.registry.expire_sliced()
                while True:
                    next(steps)
                    await asyncio.sleep(0)  # other connections between chunks of released pins
            except StopIteration as done:
                report = done.value
            except Exception:  # the loop must survive a registry bug
                log.exception("lease expiry failed")
                continue
            if report.lapsed_leases or report.reservations_released:
                log.info(
                    "expired %d lapsed lease(s), released the pins on %d object(s) and %d reservation(s)",
                    len(report.lapsed_leases), report.pins_released, report.reservations_released,
                )

    # -- connections and their limits ----------------------------------------

    def check_receive_growth(self, current: int, wanted: int) -> None:
        """Before a connection's receive buffer grows from ``current`` to ``wanted``
        bytes: refuse (``FrameTooLarge``) when the large buffers of all connections
        together would pass ``limits.max_receive_bytes``."""
        if wanted <= SMALL_RECEIVE_BYTES:
            return
        held = sum(size for size in (c.receive_bytes for c in self._connections) if size > SMALL_RECEIVE_BYTES)
        if held + wanted - max(current, SMALL_RECEIVE_BYTES) > self.limits.max_receive_bytes:
            raise FrameTooLarge(
                f"the index's receive buffers hold {held >> 20} MiB for frames under way, at its cap of "
                f"{self.limits.max_receive_bytes >> 20} MiB (--max-receive-mib): send frames under "
                f"{SMALL_RECEIVE_BYTES >> 10} KiB, or retry once others have arrived")

    def admit(self, conn: Connection) -> None:
        """A new connection. At the cap it displaces the oldest one without a
        lease; else, when one peer holds more connections than the newcomer's
        would after it (its fair share), that peer's oldest one; else it is
        closed itself. So no peer holding the token can take every connection
        from the others (a client whose connection is displaced reconnects on
        its next call, its lease intact)."""
        if len(self._connections) >= self.limits.max_connections:
            victim = self._displaced_by(conn)
            self.refusals.warning(
                "at the connection cap (%d, --max-connections): closing %s from %s",
                self.limits.max_connections, "a new connection" if victim is conn else "an older one",
                victim.peer,
            )  # fmt: skip
            self.closing(victim, "connection_limit")
            victim.abort()
            if victim is conn:
                return
            self._connections.pop(victim, None)
        self._connections[conn] = None

    def _displaced_by(self, new: Connection) -> Connection:
        """Whom a new connection at the cap displaces (``new`` itself: nobody)."""
        unauthenticated = next((c for c in self._connections if not c.authenticated), None)
        if unauthenticated is not None:
            return unauthenticated
        held = collections.Counter(c.peer_key for c in self._connections)
        hog, most = held.most_common(1)[0]
        if most > held[new.peer_key] + 1:
            return next(c for c in self._connections if c.peer_key == hog)  # its oldest
        return new

    def forget(self, conn: Connection) -> None:
        """``conn`` closed. If its peer closed it before sending a byte, its connection token comes back."""
        self._connections.pop(conn, None)
        if not conn.received_bytes and not conn.closed_by_server:
            self.admission.refund(conn.peer_key)

    def closing(self, conn: Connection, reason: str) -> None:
        """Count a connection the server closes, by reason."""
        self.closed_connections[reason] += 1
        if self._metrics is not None:
            self._metrics.count_closed(reason)

    async def _sweep_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                self.pool_watch.check()
                for _ in self._sweep(time.monotonic()):
                    await asyncio.sleep(0)  # other connections between batches of closes
                self.heap.trim_if_due()
            except Exception:  # the loop must survive a bug here
                log.exception("connection sweep failed")

    def _sweep(self, now: float) -> Generator[None, None, None]:
        """Close connections past a deadline (``ServerLimits``), yielding every 64 closes
        and every 256 connections looked at (thousands of idle ones took milliseconds)."""
        limits = self.limits
        closed = 0
        for seen, conn in enumerate(list(self._connections), 1):
            if seen % 256 == 0:
                yield
            if conn not in self._connections:
                continue  # gone while we yielded
            if not conn.authenticated and now - conn.connected_at > limits.hello_timeout_s:
                reason = "hello_timeout"
            elif conn.stalled() and now - conn.stalled_since() > limits.frame_timeout_s:
                reason = "stalled"
            elif now - conn.last_active > limits.idle_timeout_s:
                reason = "idle"
            else:
                conn.release_idle_buffer(now)
                continue
            self.refusals.info("closing connection from %s: %s", conn.peer, reason.replace("_", " "))
            self.closing(conn, reason)
            self._connections.pop(conn, None)
            conn.abort()
            closed += 1
            if closed % 64 == 0:
                yield

    # -- requests ------------------------------------------------------------

    def handle(self, conn: Connection, message: Any) -> Reply | Job:
        """Answer one decoded request: a reply map, or a job whose further slices
        end in one (never an exception). The first slice runs here."""
        started = time.perf_counter()
        op: str = "invalid"
        try:
            request = parse_request(message)
            op = request.op
            if request.op is not Op.HELLO and conn.lease_id is None:
                raise ProtocolError(ErrorType.NO_LEASE, "no lease on this connection: send hello first")
            if request.op in self._sliced and (
                request.op in _ALWAYS_SLICED or len(request.args["keys"]) > self._slice_bytes
            ):
                job = self._job(conn, request, started)
                try:
                    next(job)
                except StopIteration as done:
                    return done.value
                return job
            reply = ok_reply(request.id, **self._handlers[request.op](conn, request.args))
        except Exception as exc:
            reply = self._error(message, op, exc)
        self._observe(op, started, reply)
        return reply

    def _job(self, conn: Connection, request: Any, started: float) -> Job:
        try:
            result = yield from self._sliced[request.op](conn, request.args)
            reply = ok_reply(request.id, **result)
        except Exception as exc:
            reply = self._error({"id": request.id}, request.op, exc)
        self._observe(request.op, started, reply)
        return reply

    def _error(self, message: Any, op: str, exc: Exception) -> Reply:
        """The error reply for ``exc``; its traceback is dropped (see ``_drop_tracebacks``)."""
        try:
            if isinstance(exc, ProtocolError):
                return error_reply(request_id(message), exc)
            if isinstance(exc, RegistryError):
                return error_reply(request_id(message), ProtocolError(ErrorType(exc.error_type), str(exc)))
            log.error("op %s failed", op, exc_info=exc)
            error = ProtocolError(ErrorType.INTERNAL, f"the index failed on {op}: {type(exc).__name__}: {exc}")
            return error_reply(request_id(message), error)
        finally:
            _drop_tracebacks(exc)

    def _observe(self, op: str, started: float, reply: Reply) -> None:
        if self._metrics is not None:
            error_type = None if reply["ok"] else reply["error"]["type"]
            self._metrics.observe_rpc(op, time.perf_counter() - started, error_type)

    # -- operations ----------------------------------------------------------

    def _hello(self, conn: Connection, args: dict) -> dict:
        protocol = negotiate(args["protocol"])
        peer = self.admission.authenticate(conn, args)
        self._check_lease_cap(conn, args["lease_id"])
        self.admission.charge_pod(conn, peer)
        conn.peer_key = peer
        conn.opened(self.registry.open_lease(args["client"], args["lease_id"], peer=peer))
        conn.client = args["client"]
        return {
            "lease_id": conn.lease_id,
            "lease_ttl_s": self.registry.lease_ttl_s,
            "geometry": self.pool.geometry.to_dict(),
            "pool": self._served_pool.to_wire(),
            "protocol": protocol,
        }

    def _check_lease_cap(self, conn: Connection, resume: str | None) -> None:
        """Refuse a ``hello`` that would give ``conn`` more live leases than the cap, and close
        the connection after the answer: no honest client gets there, and one that pipelines
        hellos past it then pays a new connection (rationed per peer) every few, not a
        refusal a turn (7,000 a second on the 2-core VM)."""
        live = [lease for lease in conn.opened_leases if self.registry.lease_is_live(lease)]
        conn.opened_leases[:] = live
        if resume in live or len(live) < self.limits.max_leases_per_connection:
            return
        conn.close_after_reply = "lease_cap"
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"this connection already opened {len(live)} live leases (--max-leases-per-connection "
            f"{self.limits.max_leases_per_connection}); this connection is closed: connect again and resume "
            "one of its leases (hello with its lease_id), or let them lapse",
        )

    def _renewed(self, conn: Connection) -> str:
        lease_id = conn.lease_id
        assert lease_id is not None  # dispatch answers NO_LEASE before a handler runs
        self.registry.renew(lease_id)
        return lease_id

    def _heartbeat(self, conn: Connection, args: dict) -> dict:
        self._renewed(conn)
        return {"lease_ttl_s": self.registry.lease_ttl_s}

    def _match_prefix(self, conn: Connection, args: dict) -> dict:
        self._renewed(conn)
        return {"matched": self.registry.match_prefix(args["keys"])}

    def _retrieve(self, conn: Connection, args: dict) -> dict:
        locations = self.registry.retrieve(self._renewed(conn), args["keys"])
        return {"locations": pack_locations(locations)}

    def _retrieve_prefix(self, conn: Connection, args: dict) -> dict:
        matched, locations = self.registry.retrieve_prefix(self._renewed(conn), args["keys"], args["group"])
        return prefix_reply(matched, locations)

    def _reserve(self, conn: Connection, args: dict) -> dict:
        self.pool_watch.check()
        slots = self.registry.reserve_packed(self._renewed(conn), args["keys"], args["lengths"])
        return {"slots": pack_slots(slots)}

    def _commit(self, conn: Connection, args: dict) -> dict:
        self.pool_watch.check()
        committed = self.registry.commit(self._renewed(conn), args["keys"], verify=self._verify, record=self._record)
        return {"committed": committed}

    def _abort(self, conn: Connection, args: dict) -> dict:
        return {"aborted": self.registry.abort(self._renewed(conn), args["keys"])}

    def _slice_keys_now(self) -> int:
        """Keys per slice of a job that starts now: ``slice_keys``, or less while the loop is contended."""
        if self.turns.contended:
            return max(1, self._slice_keys // CONTENDED_SLICE_DIVISOR)
        return self._slice_keys

    def _lookup_slice_keys(self) -> int:
        """Keys per slice of a lookup that starts now: a key's lookup costs about a quarter of its commit."""
        return 4 * self._slice_keys_now()

    def _match_prefix_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        self._renewed(conn)
        matched = yield from self.registry.match_prefix_sliced(args["keys"], self._lookup_slice_keys())
        return {"matched": matched}

    def _match_prefixes_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        """Several lists' ``match_prefix`` in one request (a scheduler's queued
        lookups), each list looked up as ``match_prefix`` looks up its keys,
        with other connections let in between lists and large lists' slices."""
        self._renewed(conn)
        keys, matched, start = args["keys"], [], 0
        slice_keys = self._lookup_slice_keys()
        for i, count in enumerate(args["counts"]):
            if i:
                yield
            end = start + count * KEY_BYTES
            matched.append((yield from self.registry.match_prefix_sliced(keys[start:end], slice_keys)))
            start = end
        return {"matched": matched}

    def _retrieve_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        keys = yield from _copied_keys(args)
        lease_id = self._renewed(conn)
        locations = yield from self.registry.retrieve_sliced(lease_id, keys, self._lookup_slice_keys())
        return {"locations": pack_locations(locations)}

    def _retrieve_prefix_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        keys = yield from _copied_keys(args)
        lease_id = self._renewed(conn)
        matched, locations = yield from self.registry.retrieve_prefix_sliced(
            lease_id, keys, args["group"], self._lookup_slice_keys()
        )
        return prefix_reply(matched, locations)

    def _slices(self, keys: bytes) -> Generator[bytes, None, None]:
        step = self._slice_keys_now() * KEY_BYTES
        for start in range(0, len(keys), step):
            yield keys[start : start + step]

    def _commit_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        committed: list[bool] = []
        for i, keys in enumerate(self._slices(args["keys"])):
            if i:
                yield  # let other connections in
            self.pool_watch.check()
            committed += self.registry.commit(self._renewed(conn), keys, verify=self._verify, record=self._record)
        return {"committed": committed}

    def _abort_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        aborted = 0
        for i, keys in enumerate(self._slices(args["keys"])):
            if i:
                yield
            aborted += self.registry.abort(self._renewed(conn), keys)
        return {"aborted": aborted}

    def _reserve_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        """A large reserve: looked up, then its records added, a slice per step
        (``Registry.reserve_sliced``), placed as one batch."""
        yield  # receiving and decoding the request was this turn's work
        lease_id = self._renewed(conn)
        self.pool_watch.check()
        slots = yield from self.registry.reserve_sliced(lease_id, args["keys"], args["lengths"],
                                                        self._slice_keys_now())  # fmt: skip
        return {"slots": pack_slots(slots)}

    def _unpin_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        unpinned = yield from self.registry.unpin_sliced(self._renewed(conn), args["keys"], self._lookup_slice_keys())
        return {"unpinned": unpinned}

    def _stats(self, conn: Connection, args: dict) -> dict:
        self._renewed(conn)
        return {**stats_to_wire(self.registry.stats()), "aliases": len(self.alias_ops.table)}

    def _bye_sliced(self, conn: Connection, args: dict) -> Generator[None, None, dict]:
        """End the lease now (a client closing cleanly): its pins and reservations go at once
        (no call can use them any more), released chunk by chunk."""
        lease_id, conn.lease_id = conn.lease_id, None
        closed = yield from self.registry.close_lease_sliced(lease_id)
        return {"closed": closed}


def _copied_keys(args: dict) -> Generator[None, None, bytes]:
    """A retrieve's keys copied out of the receive buffer (free then for the next request),
    ending the turn that decoded them when they are ``LOOKUP_NEXT_TURN_FROM`` bytes or more."""
    keys = joined_keys(args["keys"])
    if len(keys) >= LOOKUP_NEXT_TURN_FROM:
        yield
    return keys


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it was raised from or during.

    A traceback holds the frames it went through, and a frame that holds the
    exception in a local (``error = QuotaExceeded(...)``, then raised) closes a
    reference cycle: the frames' locals, a large request's keys and arrays of
    megabytes among them, then live until the cyclic garbage collector's next
    full pass, seconds or minutes later (a flood of refused 2 MiB reserves
    held hundreds of megabytes so). Once answered, nothing reads them again.
    """
    seen = 0
    while exc is not None and seen < 8:
        exc.__traceback__ = None
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer of a just accepted socket has closed it already (or reset it)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing sent yet
    except OSError:
        return True


def prefix_reply(matched: int, locations: LocationList | None) -> dict[str, Any]:
    """A ``retrieve_prefix`` reply: the count, and the pinned prefix's packed
    locations (an empty bin when nothing was pinned)."""
    return {"matched": matched, "locations": pack_locations(locations) if locations is not None else b""}


def stats_to_wire(stats: RegistryStats) -> dict[str, int | bool]:
    """``RegistryStats`` as the stats reply's fields: its ints and bools as they are
    (``dataclasses.asdict`` deep-copies each one: 31 µs a reply on the 2-core VM, against 1)."""
    return dict(vars(stats))
