"""Receiving the pool's file descriptor from the sidecar (the connector's side of the hand-off).

The sidecar opens the pool device (or tmpfs file) and listens on a Unix socket
in a volume shared with the vLLM container. The connector connects, presents
the cache token, the cache name and its protocol version, and receives the
descriptor of the pool's file or device (`SCM_RIGHTS`) with the offset where
the pool starts in it (a pool can be one region of a shared DAX device), the
pool geometry, the index address and the directory for its stats region. It
then maps that region itself (`Pool.from_fd`): the vLLM container needs no
permission on the device, and the mapping stays valid whatever later happens
to the sidecar.

Wire format, both directions: a 4-byte big-endian length, then a msgpack map.
Request: `{"op": "handoff", "protocol": int, "token": str | None,
"cache": str, "client": str, "pid": int}`. Reply: `{"ok": true, "protocol",
"cache", "geometry": map, "index_url", "stats_dir", "pool_path", "pool_offset"}` with one
descriptor attached, or `{"ok": false, "protocol", "error": {"type",
"message"}}`; error types are in `ERROR_TYPES`. The framing never changes
between versions, so a peer of another version always gets a readable refusal.

This module imports nothing beyond the standard library and msgpack (no
prometheus, no vLLM), so any process can use it.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgpack

#: 2: the reply carries `pool_offset`; a connector of protocol 1 would map the wrong region.
HANDOFF_PROTOCOL = 2
#: The oldest hand-off protocol served: 1 never (it has no `pool_offset`). As
#: for the index (``maru_core.protocol.negotiate``), a sidecar also answers a
#: connector of the next protocol, in its own: during a rolling upgrade the
#: vLLM image and the sidecar's are upgraded one after the other.
MIN_HANDOFF_PROTOCOL = 2


def handoff_protocol(offered: object) -> int | None:
    """The protocol a hand-off offered in ``offered`` is answered in; None
    when the two sides are more than one release apart."""
    if type(offered) is int and MIN_HANDOFF_PROTOCOL <= offered <= HANDOFF_PROTOCOL + 1:
        return min(offered, HANDOFF_PROTOCOL)
    return None
MAX_FRAME_BYTES = 64 * 1024
ERROR_TYPES = ("auth", "wrong_cache", "protocol", "unavailable", "bad_request")
_LENGTH = struct.Struct(">I")


class HandoffError(Exception):
    """The pool could not be obtained from the sidecar."""


class HandoffUnavailable(HandoffError):
    """No sidecar answered on the socket in time, or it has not attached its pool yet; retry later."""


class HandoffRefused(HandoffError):
    """The sidecar refused the hand-off (wrong token, cache name or protocol version); `type` says which."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.type = error_type


class HandoffProtocolError(HandoffError):
    """The peer spoke something other than the hand-off protocol."""


@dataclass(frozen=True)
class PoolHandoff:
    """What the sidecar handed over. The caller owns `fd` and must close it (or give it to `Pool.from_fd`)."""

    fd: int
    geometry: dict[str, Any]  # the pool header's geometry as the sidecar read it (uuid as a string)
    index_url: str
    stats_dir: str  # where `maru_core.stats.ConnectorStats` puts this process's region
    cache: str
    pool_path: str  # the path on the sidecar's side, for messages only
    pool_offset: int = 0  # where the pool starts in the file or device of `fd`

    def pool_identity(self) -> Any:
        """The region described, as a ``maru_core.pool.pool_identity.PoolIdentity``, without mapping it
        (a process that only talks to the index checks the index against this)."""
        from maru_core.pool.pool_identity import PoolIdentity

        return PoolIdentity(str(self.geometry.get("uuid")), int(self.geometry.get("size") or 0),
                            self.pool_offset, self.pool_path or None)

    def open_pool(self) -> Any:
        """Map the pool's region of `fd` (`maru_core.pool.Pool.from_fd`), consuming `fd`.

        Checks that the mapped pool is the one the sidecar described (same
        offset, UUID and size), so a pool replaced between the two, or the
        region of another cache, is never used.
        """
        from maru_core.pool import Pool

        try:
            pool = Pool.from_fd(self.fd, expected_size=self.geometry.get("size"), offset=self.pool_offset)
        finally:
            os.close(self.fd)
        if pool.geometry.uuid != self.geometry.get("uuid"):
            pool.close()
            raise HandoffProtocolError(
                f"the sidecar described pool {self.geometry.get('uuid')} but its descriptor maps "
                f"pool {pool.geometry.uuid}; the pool at {self.pool_path} was replaced, fetch it again"
            )
        return pool


RETRY_INTERVAL_S = 0.2


def fetch_pool(socket_path: str, token: str | None, cache_name: str, timeout_s: float = 5.0) -> PoolHandoff:
    """Ask the sidecar listening on `socket_path` for the pool of cache `cache_name`.

    While no sidecar answers yet (the containers of a pod start in any order)
    or it has not attached its pool yet, retries until `timeout_s` has passed,
    then raises `HandoffUnavailable`. Raises `HandoffRefused` at once when the
    sidecar refuses (its message says what to change), and
    `HandoffProtocolError` on garbage. On success the returned `fd` is a new
    descriptor of this process, open read-write on the pool.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _fetch_once(socket_path, token, cache_name, deadline)
        except HandoffUnavailable:
            if time.monotonic() + RETRY_INTERVAL_S >= deadline:
                raise
            time.sleep(RETRY_INTERVAL_S)


def _fetch_once(socket_path: str, token: str | None, cache_name: str, deadline: float) -> PoolHandoff:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HandoffUnavailable(
                f"no sidecar listens on {socket_path} ({exc.strerror}); is `marucache sidecar "
                f"--socket {socket_path}` running and is its directory shared with this container?"
            ) from exc
        except OSError as exc:
            raise HandoffUnavailable(f"cannot connect to the sidecar at {socket_path}: {exc}") from exc
        request = {
            "op": "handoff",
            "protocol": HANDOFF_PROTOCOL,
            "token": token,
            "cache": cache_name,
            "client": f"connector@{socket.gethostname()}",
            "pid": os.getpid(),
        }
        try:
            send_frame(sock, request)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            reply, fds = recv_frame(sock, max_fds=1)
        except TimeoutError as exc:
            raise HandoffUnavailable(f"the sidecar at {socket_path} did not answer in time") from exc
        except (ConnectionError, EOFError) as exc:
            raise HandoffUnavailable(f"the sidecar at {socket_path} closed the connection: {exc}") from exc
    return _parse_reply(reply, fds, socket_path, cache_name)


def _parse_reply(reply: Any, fds: list[int], socket_path: str, cache_name: str) -> PoolHandoff:
    try:
        if not isinstance(reply, dict) or "ok" not in reply:
            raise HandoffProtocolError(f"the peer at {socket_path} is not a MaruCache sidecar (reply {reply!r:.80})")
        if not reply["ok"]:
            error = reply.get("error") or {}
            error_type, message = str(error.get("type", "unknown")), str(error.get("message", ""))
            if error_type == "unavailable":
                raise HandoffUnavailable(f"sidecar at {socket_path}: {message}")
            raise HandoffRefused(error_type, f"sidecar at {socket_path} refused the hand-off: {message}")
        answered = reply.get("protocol")
        if type(answered) is not int or not MIN_HANDOFF_PROTOCOL <= answered <= HANDOFF_PROTOCOL:
            raise HandoffRefused(
                "protocol",
                f"the sidecar at {socket_path} speaks hand-off protocol {answered}, this connector speaks "
                f"{MIN_HANDOFF_PROTOCOL} to {HANDOFF_PROTOCOL}; upgrade MaruCache one release at a time "
                "(the sidecar's image and the vLLM image)",
            )
        if len(fds) != 1:
            raise HandoffProtocolError(f"the sidecar at {socket_path} sent {len(fds)} descriptors, expected 1")
        if reply.get("cache") != cache_name:
            raise HandoffRefused("wrong_cache", f"the sidecar at {socket_path} serves cache {reply.get('cache')!r}")
        handoff = PoolHandoff(
            fd=fds[0],
            geometry=dict(reply["geometry"]),
            index_url=str(reply["index_url"]),
            stats_dir=str(reply["stats_dir"]),
            cache=str(reply["cache"]),
            pool_path=str(reply.get("pool_path", "")),
            pool_offset=_offset(reply.get("pool_offset"), socket_path),
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return handoff


def _offset(value: Any, socket_path: str) -> int:
    if type(value) is not int or value < 0:
        raise HandoffProtocolError(f"the sidecar at {socket_path} sent pool_offset {value!r}, not a byte offset")
    return value


# -- framing, shared with the sidecar's server -------------------------------


def send_frame(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """Send one framed msgpack message, with `fds` attached to its first byte."""
    payload = msgpack.packb(message, use_bin_type=True)
    data = _LENGTH.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket, max_fds: int = 0, deadline: float | None = None) -> tuple[Any, list[int]]:
    """Receive one framed message and any descriptors that came with it.

    Raises `EOFError` if the peer closes before a whole frame, and
    `HandoffProtocolError` for an oversized or undecodable frame or too many
    descriptors; with a `deadline` (a `time.monotonic()` value), `TimeoutError`
    once it passes, however the peer spaces out its bytes. Descriptors are
    closed on every error.
    """
    fds: list[int] = []
    try:
        (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, fds, max_fds, deadline))
        if length > MAX_FRAME_BYTES:
            raise HandoffProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        payload = _recv_exactly(sock, length, fds, max_fds, deadline)
        if len(fds) > max_fds:
            raise HandoffProtocolError(f"peer sent {len(fds)} descriptors, at most {max_fds} expected")
        try:
            return msgpack.unpackb(payload, raw=False), fds
        except (ValueError, msgpack.UnpackException) as exc:
            raise HandoffProtocolError(f"undecodable frame: {exc}") from exc
    except BaseException:
        _close_all(fds)
        raise


def _recv_exactly(sock: socket.socket, size: int, fds: list[int], max_fds: int, deadline: float | None) -> bytes:
    buffer = bytearray()
    while len(buffer) < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"request incomplete at its deadline ({len(buffer)} of {size} bytes)")
            sock.settimeout(remaining)
        chunk, got_fds, _, _ = socket.recv_fds(sock, size - len(buffer), max(max_fds - len(fds), 1))
        fds.extend(got_fds)
        if not chunk:
            raise EOFError(f"connection closed after {len(buffer)} of {size} bytes")
        buffer += chunk
    return bytes(buffer)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
