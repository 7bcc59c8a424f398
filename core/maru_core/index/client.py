"""The client of the index: ``IndexClient`` (blocking, thread-safe), an
implementation of ``maru_core.index.api.IndexApi``.

It connects lazily, holds a lease that a background heartbeat keeps alive,
and reconnects by itself: a lost connection is re-established on the next
call (or by the heartbeat), resuming the same lease when that is safe. Calls
that fail raise ``IndexUnavailable`` (unreachable; ``IndexTimeout`` when
timed out) or ``IndexRejected`` (an error reply); none ever blocks past
``timeout_s``.

Typical use by a reader::

    locations = client.retrieve(keys)      # pins every key, or none
    if None in locations: ...              # a miss: recompute
    # check slot headers, copy, then
    client.unpin(keys)
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from maru_core.index.alias_requests import (
    match_alias_request,
    parse_match_alias,
    parse_stored,
    put_aliases_request,
)
from maru_core.index.api import (
    IndexError_,
    IndexRejected,
    IndexTimeout,
    IndexUnavailable,
    Keys,
    WrongPool,
)
from maru_core.index.channel import Channel, open_socket
from maru_core.index.client_ops import (
    DEFAULT_RECONNECT_BACKOFF_S,
    DEFAULT_TIMEOUT_S,
    check_reply,
    check_served_pool,
    default_client_name,
    hello_request,
    keys_request,
    parse_committed,
    parse_count,
    parse_hello,
    parse_locations,
    parse_prefix,
    parse_prefixes,
    parse_slots,
    prefix_request,
    prefixes_requests,
    rejected_prefix_pinned,
    rejected_retrieve_pinned,
    request_size,
    reserve_request,
    while_backing_off as _while_backing_off,
)
from maru_core.index.inventory import (
    DEFAULT_SCAN_ROWS,
    FlushPage,
    ObjectsPage,
    flush_request,
    list_objects_request,
    parse_flush_page,
    parse_objects_page,
)
from maru_core.protocol import (
    KEY_BYTES,
    Address,
    ErrorType,
    Location,
    LocationList,
    Op,
    Slot,
    SlotList,
    TcpAddress,
    parse_url,
)

if TYPE_CHECKING:
    from maru_core.pool.pool_identity import PoolIdentity

__all__ = [
    "IndexClient",
    "IndexError_",
    "IndexRejected",
    "IndexTimeout",
    "IndexUnavailable",
    "Location",
    "LocationList",
    "Slot",
    "SlotList",
    "WrongPool",
]

log = logging.getLogger(__name__)

#: How long ``close`` waits for the index to acknowledge the end of the lease.
_BYE_TIMEOUT_S = 0.5


class IndexClient:
    """A blocking, thread-safe client of one index.

    ``url`` is ``tcp://HOST:PORT`` or ``unix:///PATH``; ``token`` the
    cache's token (``None`` when the index runs without one); ``timeout_s``
    bounds every call, connecting included. ``heartbeat=False`` leaves lease
    renewal to the caller's own traffic (tests of lease expiry use it).
    ``pool``, a ``maru_core.pool.pool_identity.PoolIdentity``, is the pool
    region this process mapped: every ``hello`` checks that the index serves
    that region and otherwise fails with ``WrongPool`` (``None``: no check,
    for clients that map no pool). Nothing connects until the first call or
    ``connect()``. ``source_address``, an IP address of this host, is the
    one its TCP connections leave from (``None``: the system's choice): the
    index tells clients apart by address (``docs/security.md``, What
    identifies a client), so a client bound to another address, e.g.
    another loopback address, is another peer with quotas of its own.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        client_name: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        heartbeat: bool = True,
        reconnect_backoff_s: float = DEFAULT_RECONNECT_BACKOFF_S,
        pool: PoolIdentity | None = None,
        source_address: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = parse_url(url)
        self.source_address = _checked_source_address(source_address, self.address)
        self.url = url
        self.timeout_s = timeout_s
        self.client_name = client_name or default_client_name()
        self._token = token
        self._pool = pool
        self._refused_before = False  # an index serving another pool was refused (logged once)
        self._backoff_s = reconnect_backoff_s
        self._lock = threading.Lock()  # guards the channel and the lease fields
        self._channel: Channel | None = None
        self._lease_id: str | None = None
        self._lease_ttl_s: float | None = None
        self.geometry: dict[str, Any] | None = None
        self._retry_at = 0.0
        self._last_error: IndexError_ | None = None
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._want_heartbeat = heartbeat

    # -- public operations ---------------------------------------------------

    @property
    def lease_id(self) -> str | None:
        return self._lease_id

    @property
    def lease_ttl_s(self) -> float | None:
        return self._lease_ttl_s

    def connect(self) -> "IndexClient":
        """Connect and open the lease now rather than on the first call."""
        self._ensure_channel(time.monotonic() + self.timeout_s)
        return self

    def heartbeat(self) -> float:
        """Renew the lease now; return its TTL in seconds."""
        return float(self._call({"op": Op.HEARTBEAT})["lease_ttl_s"])

    def match_prefix(self, keys: Keys, *, timeout_s: float | None = None) -> int:
        """How many leading ``keys`` are committed (pins nothing)."""
        request = keys_request(Op.MATCH_PREFIX, keys)
        return parse_count(Op.MATCH_PREFIX, self._call(request, timeout_s), "matched", request_size(request))

    def match_prefixes(self, key_lists: Sequence[Keys], *, timeout_s: float | None = None) -> list[int]:
        """``match_prefix`` of each list, in one round trip (pins nothing).

        An index older than this op raises ``IndexRejected`` with
        ``error_type`` ``ErrorType.UNKNOWN_OP``: ask ``match_prefix`` per list instead.
        """
        matched: list[int] = []
        for request in prefixes_requests(key_lists):
            matched += parse_prefixes(self._call(request, timeout_s), request)
        return matched

    def retrieve(self, keys: Keys, *, timeout_s: float | None = None) -> LocationList:
        """One ``Location`` or ``None`` per key, in order, as a ``LocationList``.

        Every key is pinned when all hit; nothing is pinned when any misses.
        The answer always has exactly one entry per key. A retrieve that
        raises leaves nothing pinned either: a reply rejected as malformed
        (e.g. a location count that differs from the keys) or an ``internal``
        error is undone here (``_release_rejected_retrieve``), and after a
        timeout or a lost connection the old lease lapses on the index.
        """
        request = keys_request(Op.RETRIEVE, keys)
        try:
            return parse_locations(self._call(request, timeout_s), request_size(request))
        except IndexRejected as exc:
            self._release_rejected_retrieve(request["keys"], exc)
            raise

    def retrieve_prefix(
        self, keys: Keys, group: int = 1, *, timeout_s: float | None = None
    ) -> tuple[int, LocationList | None]:
        """``match_prefix`` and ``retrieve`` in one round trip: how many leading
        ``keys`` are committed, and the pinned locations of the first
        ``matched - matched % group`` of them (``None``: nothing pinned).

        Unpin exactly those keys when done. Raising leaves nothing pinned, as
        a retrieve's failure does: a reply that may have pinned something but
        is rejected ends the lease's use here (the old lease lapses on the index).
        """
        request = prefix_request(keys, group)
        try:
            return parse_prefix(self._call(request, timeout_s), request_size(request), group)
        except IndexRejected as exc:
            if rejected_prefix_pinned(exc) is not False:
                self._abandon_lease(f"retrieve_prefix reply rejected ({exc.message})")
            raise

    def unpin(self, keys: Keys) -> int:
        """Release this lease's pins on ``keys``; return how many were released."""
        request = keys_request(Op.UNPIN, keys)
        return parse_count(Op.UNPIN, self._call(request), "unpinned", request_size(request))

    def reserve(self, items: Iterable[tuple[bytes, int]]) -> SlotList:
        """Reserve a slot per ``(key, length)``: a ``Slot``, or ``None`` when the
        key is already committed or reserved. Raises ``IndexRejected`` with
        type ``no_space`` when the pool cannot hold them even after eviction."""
        request = reserve_request(items)
        return parse_slots(self._call(request), request_size(request))

    def commit(self, keys: Keys) -> list[bool]:
        """Make reserved keys visible, once their data and slot headers are
        written. ``False`` for a key that could not be committed (a duplicate,
        an expired reservation or a slot header that does not name it)."""
        request = keys_request(Op.COMMIT, keys)
        return parse_committed(self._call(request), request_size(request))

    def abort(self, keys: Keys) -> int:
        """Release reservations that will not be committed; return how many."""
        request = keys_request(Op.ABORT, keys)
        return parse_count(Op.ABORT, self._call(request), "aborted", request_size(request))

    def put_aliases(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store block aliases, ``(alias key, target chunk key)`` pairs; return how many
        were stored (all, or the table's capacity when more). At most
        ``MAX_ALIAS_ITEMS`` per call (``too_large`` beyond); an index older than this
        op raises ``IndexRejected`` with ``error_type`` ``ErrorType.UNKNOWN_OP``."""
        request = put_aliases_request(items)
        return parse_stored(self._call(request), request)

    def match_alias(self, candidates: bytes | Sequence[bytes], layers: Sequence[int] | None = None, *,
                    timeout_s: float | None = None) -> tuple[int, bytes] | None:  # fmt: skip
        """The position of the first of ``candidates`` (alias keys, in order of preference)
        whose target chunk's objects are all committed, and that target key; ``None``
        when none is. ``layers`` ``None``: the target key is the object's (chunkwise);
        else its objects are ``maru_core.keys.packed_layer_keys(target, layers)``.
        Pins nothing: retrieve the target's objects to load them."""
        request = match_alias_request(candidates, layers)
        return parse_match_alias(self._call(request, timeout_s), request)

    def stats(self) -> dict[str, Any]:
        """The index's counters and pool bytes by state."""
        reply = dict(self._call({"op": Op.STATS}))
        for name in ("id", "ok"):
            reply.pop(name, None)
        return reply

    def close(self) -> None:
        """Stop the heartbeat, end the lease (releasing this client's pins and
        reservations) and close the connection. If the index cannot be told,
        the lease lapses there by itself."""
        self._stop.set()
        with self._lock:
            self._closed = True
            channel, self._channel = self._channel, None
        if channel is not None:
            if not channel.failed:
                try:
                    channel.call({"op": Op.BYE}, time.monotonic() + min(self.timeout_s, _BYE_TIMEOUT_S))
                except IndexUnavailable:
                    pass
            channel.close()
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout_s)

    def __enter__(self) -> "IndexClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls, connection and lease -----------------------------------------

    def _release_rejected_retrieve(self, packed_keys: bytes, exc: IndexRejected) -> None:
        """Give back what a retrieve with a rejected reply may have pinned.

        The caller gets no locations, so it cannot unpin them itself: when
        the reply shows every key hit, unpin them; when it cannot be told
        (or the unpin fails), end the lease's use here and open a fresh one,
        so the old lease lapses on the index with its pins.
        """
        pinned = rejected_retrieve_pinned(exc, len(packed_keys) // KEY_BYTES)
        if pinned is False:
            return
        if pinned:
            try:
                self.unpin(packed_keys)
                return
            except IndexError_ as unpin_exc:
                log.warning("unpin after a rejected retrieve reply failed: %s", unpin_exc)
        self._abandon_lease(f"retrieve reply rejected ({exc.message})")

    def _abandon_lease(self, why: str) -> None:
        with self._lock:
            channel = self._channel
            log.warning("leaving lease %s to lapse on the index: %s", self._lease_id, why)
            self._lease_id = None
        if channel is None or channel.failed:
            return
        try:
            self._reopen_lease(channel, time.monotonic() + self.timeout_s)
        except IndexError_:
            channel.fail(IndexUnavailable(f"could not open a fresh lease after: {why}"))
            self._drop(channel)

    def _call(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        op = message["op"]
        for attempt in (1, 2):
            channel = self._ensure_channel(deadline)
            try:
                reply = channel.call(dict(message), deadline)
            except IndexUnavailable:
                self._drop(channel)
                raise
            try:
                return check_reply(op, reply)
            except IndexRejected as exc:
                if exc.error_type is not ErrorType.NO_LEASE or attempt == 2:
                    raise
                self._reopen_lease(channel, deadline)  # the lease lapsed: open a fresh one, retry once
        raise AssertionError("unreachable")

    def _ensure_channel(self, deadline: float) -> Channel:
        with self._lock:
            if self._closed:
                raise IndexUnavailable("the index client was closed")
            if self._channel is not None and not self._channel.closed_by_peer():
                return self._channel
            if self._channel is not None:
                self._forget(self._channel)
            if time.monotonic() < self._retry_at and self._last_error is not None:
                raise _while_backing_off(self._last_error)
            try:
                self._channel = self._open(deadline)
            except IndexError_ as exc:
                self._retry_at = time.monotonic() + self._backoff_s
                self._last_error = exc
                raise
        self._start_heartbeat()
        return self._channel

    def _open(self, deadline: float) -> Channel:
        remaining = max(deadline - time.monotonic(), 0.001)
        channel = Channel(open_socket(self.address, remaining, self.source_address), self.timeout_s)
        try:
            self._hello(channel, self._lease_id, deadline)
        except BaseException:
            channel.close()
            raise
        return channel

    def _hello(self, channel: Channel, lease_id: str | None, deadline: float) -> None:
        reply = check_reply(Op.HELLO, channel.call(hello_request(self.client_name, self._token, lease_id), deadline))
        parsed = parse_hello(reply)
        if self._pool is not None:
            try:
                check_served_pool(self._pool, reply, self.url)
            except WrongPool as exc:
                (log.debug if self._refused_before else log.error)("%s", exc)  # once per client, not per retry
                self._refused_before = True
                self._lease_id = None
                try:  # end the lease just opened there rather than leave it to lapse
                    channel.call({"op": Op.BYE}, time.monotonic() + min(self.timeout_s, _BYE_TIMEOUT_S))
                except IndexError_:
                    pass
                raise
        self._lease_id, self._lease_ttl_s, self.geometry = parsed

    def _reopen_lease(self, channel: Channel, deadline: float) -> None:
        with self._lock:
            log.info("lease %s lapsed on the index; opening a new one", self._lease_id)
            self._hello(channel, None, deadline)

    def _drop(self, channel: Channel) -> None:
        with self._lock:
            if self._channel is channel:
                self._forget(channel)

    def _forget(self, channel: Channel) -> None:
        # Called with the lock held, for a failed channel.
        if channel.lease_state_unknown:
            # A pin or reservation may have been granted without us hearing of
            # it: let that lease lapse on the index rather than resume it.
            self._lease_id = None
        channel.close()
        self._channel = None

    # -- heartbeat -----------------------------------------------------------

    def _start_heartbeat(self) -> None:
        if not self._want_heartbeat or self._heartbeat_thread is not None:
            return
        with self._lock:
            if self._heartbeat_thread is None and not self._closed:
                self._heartbeat_thread = threading.Thread(
                    target=self._heartbeat_loop, name="maru-index-heartbeat", daemon=True
                )
                self._heartbeat_thread.start()

    def _heartbeat_interval(self) -> float:
        ttl = self._lease_ttl_s or 3.0
        return max(0.05, min(ttl / 3.0, 5.0))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_interval()):
            try:
                self.heartbeat()
            except IndexError_ as exc:
                log.debug("index heartbeat failed: %s", exc)


    # -- what the cache holds, and its flush (marucache inspect / flush) -------

    def list_objects(self, cursor: int = 0, limit: int = DEFAULT_SCAN_ROWS) -> ObjectsPage:
        """The committed objects among the index's record rows ``[cursor, cursor + limit)``,
        grouped by layout fingerprint and storage format; call again from its
        ``next_cursor`` until that is ``None``. An index older than this op raises
        ``IndexRejected`` with ``error_type`` ``ErrorType.UNKNOWN_OP``."""
        return parse_objects_page(self._call(list_objects_request(cursor, limit)), cursor)

    def flush(self, cursor: int = 0, limit: int = DEFAULT_SCAN_ROWS, *, layout: int | None = None,
              fmt: str | None = None) -> FlushPage:  # fmt: skip
        """Evict the unpinned committed objects among rows ``[cursor, cursor + limit)`` of
        ``layout`` and ``fmt`` (``None``: any); call again from its ``next_cursor``
        (after ``retry_after_s`` when an eviction window held objects back)."""
        return parse_flush_page(self._call(flush_request(cursor, limit, layout, fmt)), cursor)


def _checked_source_address(source_address: str | None, address: Address) -> str | None:
    """``source_address`` once checked: an IP address, for a TCP index only."""
    if source_address is None:
        return None
    if not isinstance(address, TcpAddress):
        raise ValueError(f"source_address={source_address!r} binds a TCP connection, but the index's URL is "
                         f"{address}: use a tcp:// URL, or no source_address for a Unix socket")  # fmt: skip
    try:
        ipaddress.ip_address(source_address)
    except ValueError:
        raise ValueError(f"source_address must be an IP address of this host (e.g. 127.0.0.2), "
                         f"got {source_address!r}") from None  # fmt: skip
    return source_address
