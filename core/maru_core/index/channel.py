"""One blocking connection to the index, shared by many threads.

Requests are pipelined: any thread may send at any time (frames are written
whole under a lock), and replies are matched to their request by id. No
reader thread sits in between: the first waiting thread becomes the reader,
reads until its own reply has arrived, hands the replies it met on the way
to their threads, and passes the reading role on. A lone caller thus pays
no thread hand-off, which keeps a retrieve round trip within a few hundred
microseconds.
"""

from __future__ import annotations

import itertools
import math
import select
import socket
import threading
import time
from typing import Any

from maru_core.index.api import IndexTimeout, IndexUnavailable
from maru_core.protocol import LEASE_STATE_OPS, Address, FrameError, TcpAddress
from maru_core.protocol.framing import FrameBuffer, FrameWriter


class _Waiter:
    __slots__ = ("op", "reply")

    def __init__(self, op: str) -> None:
        self.op = op
        self.reply: Any = None


def _failure(message: str, exc: BaseException) -> IndexUnavailable:
    """The failure of a socket operation that raised ``exc``: a socket timeout is an ``IndexTimeout``."""
    return IndexTimeout(message) if isinstance(exc, TimeoutError) else IndexUnavailable(message)


def open_socket(address: Address, timeout_s: float, source_address: str | None = None) -> socket.socket:
    """A connected, blocking socket (TCP_NODELAY for TCP); ``IndexUnavailable`` on failure
    (``IndexTimeout`` when the connect timed out). ``source_address``: the local IP
    address a TCP connection leaves from (any free port), or ``None`` for the system's choice."""
    try:
        if isinstance(address, TcpAddress):
            source = (source_address, 0) if source_address is not None else None
            sock = socket.create_connection((address.host, address.port), timeout=timeout_s, source_address=source)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(address.path)
            except OSError:
                sock.close()
                raise
    except OSError as exc:
        origin = f" from {source_address}" if source_address is not None else ""
        raise _failure(f"cannot connect to the index at {address}{origin}: {exc}", exc) from exc
    return sock


class Channel:
    """A pipelined request/reply channel over one socket.

    ``call`` raises ``IndexUnavailable`` when the connection fails, and
    ``IndexTimeout`` when a reply misses its deadline; the channel is then
    failed for every caller, and ``lease_state_unknown`` says whether a
    request that changes pins or reservations was in flight (see
    ``maru_core.protocol.LEASE_STATE_OPS``).
    """

    def __init__(self, sock: socket.socket, send_timeout_s: float) -> None:
        self._sock = sock
        sock.settimeout(send_timeout_s)
        self._send_lock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._pending: dict[int, _Waiter] = {}
        self._reading = False
        self._ids = itertools.count(1)
        # poll, not select: select() fails for descriptors >= 1024, which large
        # processes such as vLLM hand out routinely.
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._frames = FrameBuffer(keep_bytes=4 * 1024 * 1024)  # retrieve replies reach 3.2 MB: keep room for one
        self._writer = FrameWriter()  # used under the send lock; sendall finishes with its view
        self.failure: IndexUnavailable | None = None
        self.lease_state_unknown = False

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def closed_by_peer(self) -> bool:
        """Whether the index closed this idle channel (its idle timeout, a restart):
        checked without blocking before a call, so that the call reconnects
        instead of failing. A channel with requests in flight is left to its readers."""
        with self._cv:
            if self.failure is not None or self._pending or self._reading:
                return self.failure is not None
            if not self._poller.poll(0):
                return False
            try:
                peeked = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError as exc:
                peeked = b""
                reason = f"the connection to the index failed while idle: {exc}"
            else:
                reason = "the index closed the idle connection"
            if peeked:
                return False  # bytes of a reply-less frame: the next reader decodes and reports it
            self._fail_locked(IndexUnavailable(reason))
            return True

    def call(self, message: dict[str, Any], deadline: float) -> Any:
        """Send ``message`` (its ``id`` is assigned here) and return the decoded reply."""
        waiter = _Waiter(message["op"])
        with self._send_lock:
            if self.failure is not None:
                raise self.failure
            rid = next(self._ids)
            message["id"] = rid
            frame = self._writer.frame(message)
            with self._cv:
                self._pending[rid] = waiter
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                self.fail(_failure(f"sending {waiter.op} to the index failed: {exc}", exc))
                raise self._failed() from exc
        return self._await(rid, waiter, deadline)

    def _await(self, rid: int, waiter: _Waiter, deadline: float) -> Any:
        with self._cv:
            while waiter.reply is None and self.failure is None and self._reading:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            if waiter.reply is not None:
                return waiter.reply
            if self.failure is None and not self._reading:
                self._reading = True
            elif self.failure is None:
                self._fail_locked(IndexTimeout(f"no reply to {waiter.op} within the timeout"))
        if self.failure is not None and waiter.reply is None:
            raise self.failure
        try:
            self._read_until(waiter, deadline)
        finally:
            with self._cv:
                self._reading = False
                self._cv.notify_all()
        if waiter.reply is None:
            raise self._failed()
        return waiter.reply

    def _read_until(self, waiter: _Waiter, deadline: float) -> None:
        # Replies are received in place (recv_into) and decoded from the buffer.
        while waiter.reply is None and self.failure is None:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0 or not self._poller.poll(math.ceil(remaining * 1000)):
                    self.fail(IndexTimeout(f"no reply to {waiter.op} within the timeout"))
                    return
                count = self._sock.recv_into(self._frames.writable())
                if not count:
                    self.fail(IndexUnavailable("the index closed the connection"))
                    return
                self._frames.advance(count)
                messages = []
                while self._frames.complete():
                    messages.append(self._frames.pop())
            except (OSError, ValueError, FrameError) as exc:
                self.fail(_failure(f"connection to the index failed: {exc}", exc))
                return
            if messages:
                self._deliver(messages)

    def _deliver(self, messages: list[Any]) -> None:
        with self._cv:
            for message in messages:
                rid = message.get("id") if type(message) is dict else None
                waiter = self._pending.pop(rid, None) if rid is not None else None
                if waiter is None:
                    # An error about the stream itself (id nil): the index closes it next.
                    self._fail_locked(IndexUnavailable(f"the index dropped the connection: {message!r:.200}"))
                    return
                waiter.reply = message
            self._cv.notify_all()

    def _failed(self) -> IndexUnavailable:
        """The failure that ended the channel: set once a send failed or a read
        stopped without the reply."""
        assert self.failure is not None
        return self.failure

    def fail(self, error: IndexUnavailable) -> None:
        with self._cv:
            self._fail_locked(error)

    def _fail_locked(self, error: IndexUnavailable) -> None:
        if self.failure is None:
            self.failure = error
            self.lease_state_unknown = any(w.op in LEASE_STATE_OPS for w in self._pending.values())
            self._pending.clear()
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._cv.notify_all()

    def close(self) -> None:
        self.fail(IndexUnavailable("the client was closed"))
        self._sock.close()
