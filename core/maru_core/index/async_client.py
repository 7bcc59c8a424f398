"""``AsyncIndexClient``: the index client for asyncio code.

Same operations, errors and lease policy as ``IndexClient``
(``maru_core.index.client``). One reader task per connection matches replies
to their requests by id, so any number of coroutines may have requests in
flight at once; a heartbeat task keeps the lease alive.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Iterable

from maru_core.index.client_ops import (
    DEFAULT_RECONNECT_BACKOFF_S,
    DEFAULT_TIMEOUT_S,
    LEASE_STATE_OPS,
    IndexError_,
    IndexRejected,
    IndexUnavailable,
    Keys,
    WrongPool,
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
    parse_slots,
    prefix_request,
    rejected_prefix_pinned,
    rejected_retrieve_pinned,
    request_size,
    reserve_request,
    while_backing_off as _while_backing_off,
)
from maru_core.protocol import (
    KEY_BYTES,
    ErrorType,
    FrameError,
    LocationList,
    SlotList,
    TcpAddress,
    parse_url,
    read_frame,
)
from maru_core.protocol.framing import FrameWriter

log = logging.getLogger(__name__)


class _AsyncChannel:
    """One connection: requests written whole, replies matched by id by a reader task."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._ids = itertools.count(1)
        self._frames = FrameWriter()
        self.failure: IndexUnavailable | None = None
        self.lease_state_unknown = False
        self._reader_task = asyncio.create_task(self._read_replies(reader))

    async def call(self, message: dict[str, Any], timeout_s: float) -> Any:
        if self.failure is not None:
            raise self.failure
        rid = next(self._ids)
        message["id"] = rid
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = (message["op"], future)
        try:
            frame = self._frames.frame(message)
            self._writer.write(frame)
            if isinstance(frame, memoryview) and self._writer.transport.get_write_buffer_size():
                self._frames.release()  # the transport may still hold the view
            return await asyncio.wait_for(asyncio.shield(future), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            self.fail(IndexUnavailable(f"no reply to {message['op']} within the timeout"))
            raise self.failure from None
        except (OSError, RuntimeError) as exc:
            self.fail(IndexUnavailable(f"sending {message['op']} to the index failed: {exc}"))
            raise self.failure from exc

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader)
                if message is None:
                    raise ConnectionError("the index closed the connection")
                rid = message.get("id") if type(message) is dict else None
                op_future = self._pending.pop(rid, None)
                if op_future is None:
                    raise ConnectionError(f"the index dropped the connection: {message!r:.200}")
                if not op_future[1].done():
                    op_future[1].set_result(message)
        except (OSError, EOFError, FrameError, asyncio.IncompleteReadError) as exc:
            self.fail(IndexUnavailable(f"connection to the index failed: {exc}"))

    def fail(self, error: IndexUnavailable) -> None:
        if self.failure is not None:
            return
        self.failure = error
        self.lease_state_unknown = any(op in LEASE_STATE_OPS for op, _ in self._pending.values())
        for _, future in self._pending.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # mark retrieved: a timed-out caller no longer awaits it
        self._pending.clear()
        self._writer.close()

    async def close(self) -> None:
        self.fail(IndexUnavailable("the client was closed"))
        if self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)


class AsyncIndexClient:
    """The asyncio twin of ``IndexClient``; every operation is a coroutine.

    Create it inside a running loop (its heartbeat is a task of that loop),
    and ``await close()`` when done. ``pool``: as ``IndexClient``'s, the pool
    region this process mapped, which every ``hello`` checks (``WrongPool``).
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
        pool: Any = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = parse_url(url)
        self.url = url
        self.timeout_s = timeout_s
        self.client_name = client_name or default_client_name()
        self._token = token
        self._pool = pool
        self._backoff_s = reconnect_backoff_s
        self._lock = asyncio.Lock()
        self._channel: _AsyncChannel | None = None
        self._lease_id: str | None = None
        self._lease_ttl_s: float | None = None
        self.geometry: dict[str, Any] | None = None
        self._retry_at = 0.0
        self._last_error: IndexError_ | None = None
        self._closed = False
        self._want_heartbeat = heartbeat
        self._heartbeat_task: asyncio.Task | None = None

    @property
    def lease_id(self) -> str | None:
        return self._lease_id

    @property
    def lease_ttl_s(self) -> float | None:
        return self._lease_ttl_s

    async def connect(self) -> "AsyncIndexClient":
        await self._ensure_channel(time.monotonic() + self.timeout_s)
        return self

    async def heartbeat(self) -> float:
        return float((await self._call({"op": "heartbeat"}))["lease_ttl_s"])

    async def match_prefix(self, keys: Keys, *, timeout_s: float | None = None) -> int:
        request = keys_request("match_prefix", keys)
        return parse_count("match_prefix", await self._call(request, timeout_s), "matched", request_size(request))

    async def retrieve(self, keys: Keys, *, timeout_s: float | None = None) -> LocationList:
        request = keys_request("retrieve", keys)
        try:
            return parse_locations(await self._call(request, timeout_s), request_size(request))
        except IndexRejected as exc:
            await self._release_rejected_retrieve(request["keys"], exc)
            raise

    async def retrieve_prefix(
        self, keys: Keys, group: int = 1, *, timeout_s: float | None = None
    ) -> tuple[int, LocationList | None]:
        request = prefix_request(keys, group)
        try:
            return parse_prefix(await self._call(request, timeout_s), request_size(request), group)
        except IndexRejected as exc:
            if rejected_prefix_pinned(exc) is not False:
                await self._abandon_lease(f"retrieve_prefix reply rejected ({exc.message})")
            raise

    async def unpin(self, keys: Keys) -> int:
        request = keys_request("unpin", keys)
        return parse_count("unpin", await self._call(request), "unpinned", request_size(request))

    async def reserve(self, items: Iterable[tuple[bytes, int]]) -> SlotList:
        request = reserve_request(items)
        return parse_slots(await self._call(request), request_size(request))

    async def commit(self, keys: Keys) -> list[bool]:
        request = keys_request("commit", keys)
        return parse_committed(await self._call(request), request_size(request))

    async def abort(self, keys: Keys) -> int:
        request = keys_request("abort", keys)
        return parse_count("abort", await self._call(request), "aborted", request_size(request))

    async def stats(self) -> dict[str, Any]:
        reply = dict(await self._call({"op": "stats"}))
        for name in ("id", "ok"):
            reply.pop(name, None)
        return reply

    async def close(self) -> None:
        self._closed = True
        if self._heartbeat_task is not None and self._heartbeat_task is not asyncio.current_task():
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        channel, self._channel = self._channel, None
        if channel is not None:
            if channel.failure is None:
                try:  # end the lease now; if the index cannot be told, it lapses there
                    await channel.call({"op": "bye"}, min(self.timeout_s, 0.5))
                except IndexUnavailable:
                    pass
            await channel.close()

    async def __aenter__(self) -> "AsyncIndexClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- calls, connection and lease -----------------------------------------

    async def _release_rejected_retrieve(self, packed_keys: bytes, exc: IndexRejected) -> None:
        """As ``IndexClient._release_rejected_retrieve``: unpin what the
        rejected reply shows pinned, else leave the lease to lapse."""
        pinned = rejected_retrieve_pinned(exc, len(packed_keys) // KEY_BYTES)
        if pinned is False:
            return
        if pinned:
            try:
                await self.unpin(packed_keys)
                return
            except IndexError_ as unpin_exc:
                log.warning("unpin after a rejected retrieve reply failed: %s", unpin_exc)
        await self._abandon_lease(f"retrieve reply rejected ({exc.message})")

    async def _abandon_lease(self, why: str) -> None:
        log.warning("leaving lease %s to lapse on the index: %s", self._lease_id, why)
        self._lease_id = None
        channel = self._channel
        if channel is None or channel.failure is not None:
            return
        try:
            async with self._lock:
                await self._hello(channel, None, time.monotonic() + self.timeout_s)
        except IndexError_:
            channel.fail(IndexUnavailable(f"could not open a fresh lease after: {why}"))
            await self._drop(channel)

    async def _call(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for attempt in (1, 2):
            channel = await self._ensure_channel(deadline)
            try:
                reply = await channel.call(dict(message), deadline - time.monotonic())
            except IndexUnavailable:
                await self._drop(channel)
                raise
            try:
                return check_reply(message["op"], reply)
            except IndexRejected as exc:
                if exc.error_type != ErrorType.NO_LEASE.value or attempt == 2:
                    raise
                async with self._lock:
                    await self._hello(channel, None, deadline)
        raise AssertionError("unreachable")

    async def _ensure_channel(self, deadline: float) -> _AsyncChannel:
        async with self._lock:
            if self._closed:
                raise IndexUnavailable("the index client was closed")
            if self._channel is not None and self._channel.failure is None:
                return self._channel
            if self._channel is not None:
                await self._forget(self._channel)
            if time.monotonic() < self._retry_at and self._last_error is not None:
                raise _while_backing_off(self._last_error)
            try:
                self._channel = await self._open(deadline)
            except IndexError_ as exc:
                self._retry_at = time.monotonic() + self._backoff_s
                self._last_error = exc
                raise
        if self._want_heartbeat and self._heartbeat_task is None:
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        return self._channel

    async def _open(self, deadline: float) -> _AsyncChannel:
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            if isinstance(self.address, TcpAddress):
                opening = asyncio.open_connection(self.address.host, self.address.port)
            else:
                opening = asyncio.open_unix_connection(self.address.path)
            reader, writer = await asyncio.wait_for(opening, remaining)
        except (OSError, asyncio.TimeoutError) as exc:
            raise IndexUnavailable(f"cannot connect to the index at {self.address}: {exc!r}") from exc
        channel = _AsyncChannel(reader, writer)
        try:
            await self._hello(channel, self._lease_id, deadline)
        except BaseException:
            await channel.close()
            raise
        return channel

    async def _hello(self, channel: _AsyncChannel, lease_id: str | None, deadline: float) -> None:
        request = hello_request(self.client_name, self._token, lease_id)
        reply = check_reply("hello", await channel.call(request, deadline - time.monotonic()))
        parsed = parse_hello(reply)
        if self._pool is not None:
            try:
                check_served_pool(self._pool, reply, self.url)
            except WrongPool:
                self._lease_id = None  # the lease just opened there lapses by itself
                raise
        self._lease_id, self._lease_ttl_s, self.geometry = parsed

    async def _drop(self, channel: _AsyncChannel) -> None:
        async with self._lock:
            if self._channel is channel:
                await self._forget(channel)

    async def _forget(self, channel: _AsyncChannel) -> None:
        if channel.lease_state_unknown:
            self._lease_id = None  # see client_ops.LEASE_STATE_OPS
        await channel.close()
        self._channel = None

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            ttl = self._lease_ttl_s or 3.0
            await asyncio.sleep(max(0.05, min(ttl / 3.0, 5.0)))
            try:
                await self.heartbeat()
            except IndexError_ as exc:
                log.debug("index heartbeat failed: %s", exc)
