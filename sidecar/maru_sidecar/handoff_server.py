"""The sidecar's side of the pool hand-off: a Unix socket that gives the pool's descriptor to connectors.

The wire format and the client live in `maru_core.handoff`. Each connection
carries one request and one reply; a refusal is logged here and sent back with
a message that says what to change, so both sides tell the same story.

One thread serves every connection from a selector: a connection costs
nothing but its socket until its whole request has arrived, and is then
answered at once (a request and its reply are a few hundred bytes). A
connection whose request is not whole within `CONNECTION_TIMEOUT_S` is closed,
and at `MAX_PENDING_HANDOFFS` waiting connections a new one displaces the
oldest, answered first if its whole request is in: a connector sends its
request as soon as it connects, so the oldest waiting connection is a slow
or idle peer's, and a local flood of idle connections cannot keep connectors
from their pool (with 16 threads of 2 s each, it could). A connector's
connection is thus answered even when a flood of newer ones reaches it
before the loop has read it.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maru_core.index.listen import RateLimitedLog
from maru_core.pod_credentials import is_credential, pod_of
from maru_core.handoff import (ERROR_TYPES, HANDOFF_PROTOCOL, MAX_FRAME_BYTES, MIN_HANDOFF_PROTOCOL, HandoffError,
                               handoff_protocol, recv_frame, send_frame)

log = logging.getLogger(__name__)

#: A connection's whole request must arrive within this, however the peer spaces its bytes.
CONNECTION_TIMEOUT_S = 2.0
#: Connections waiting for their request at once; at the cap a new one displaces the oldest.
MAX_PENDING_HANDOFFS = 256
#: Mode of the hand-off socket: the sidecar's user and group (``--socket-group``) only.
SOCKET_MODE = 0o660
#: Every result a hand-off is counted under: a closed set, exported at zero from the start.
RESULTS = ("ok", *ERROR_TYPES, "send_failed")
_PEERCRED = struct.Struct("3i")
_LENGTH = struct.Struct(">I")  # the frame header of `maru_core.handoff`


@dataclass(frozen=True)
class PoolOffer:
    """What the sidecar hands out: its own descriptor of the pool's file or device (sent as a copy),
    where the pool starts in it, and the pool's geometry."""

    fd: int
    geometry: dict[str, Any]
    pool_path: str
    pool_offset: int = 0


class PoolNotReady(Exception):
    """The sidecar has not attached its pool (yet); the message says why."""


class Refusal(Exception):
    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.type = error_type


class HandoffServer:
    """Serves `maru_core.handoff.fetch_pool` requests on `socket_path`, one thread per connection.

    `offer()` returns the current `PoolOffer` or raises `PoolNotReady`;
    `read_token()` returns the expected token (None: no auth); a request
    presents that token or the credential of ``pod`` (this sidecar's pod,
    ``namespace/name``; None: the cache token only). `results` counts
    answers by result (one of `RESULTS`) for the metrics.
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        cache: str,
        index_url: str,
        stats_dir: Path,
        offer: Callable[[], PoolOffer],
        read_token: Callable[[], str | None],
        socket_gid: int | None = None,
        pod: str | None = None,
    ):
        self.socket_path = socket_path
        self._socket_gid, self._pod = socket_gid, pod
        self._refusals = RateLimitedLog(log)  # a flood of bad clients costs a log line a second
        self._cache, self._index_url, self._stats_dir = cache, index_url, str(stats_dir)
        self._offer, self._read_token = offer, read_token
        self.results: collections.Counter[str] = collections.Counter()
        self._results_lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the socket (replacing a stale one left by a killed sidecar) and start serving."""
        _remove_stale_socket(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.socket_path))
        # Who may connect: the sidecar's user and the socket's group (the vLLM
        # container's group, --socket-group), then the token.
        if self._socket_gid is not None:
            os.chown(self.socket_path, -1, self._socket_gid)
        os.chmod(self.socket_path, SOCKET_MODE)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve_loop, args=(sock,), name="maru-handoff", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the socket and remove its file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.socket_path.unlink(missing_ok=True)

    def _serve_loop(self, sock: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        waiting: dict[socket.socket, float] = {}  # connection -> accepted at, oldest first
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.1):
                    if key.fileobj is sock:
                        self._accept_all(sock, selector, waiting)
                    else:
                        self._on_readable(key.fileobj, selector, waiting)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, at in waiting.items() if now - at > CONNECTION_TIMEOUT_S]:
                    self._drop(conn, selector, waiting, "its request was not whole at the deadline")
        finally:
            for conn in list(waiting):
                selector.unregister(conn)
                conn.close()
            selector.close()

    def _accept_all(self, sock: socket.socket, selector: selectors.BaseSelector,
                    waiting: dict[socket.socket, float]) -> None:  # fmt: skip
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if not self._stop.is_set():
                    log.error("hand-off socket failed: %s", exc)
                return
            if len(waiting) >= MAX_PENDING_HANDOFFS:
                self._make_room(selector, waiting)
            conn.setblocking(False)
            waiting[conn] = time.monotonic()
            selector.register(conn, selectors.EVENT_READ)

    def _make_room(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, float]) -> None:
        """At the cap, the oldest waiting connection goes: answered, when its whole request is in
        (a connector sends it as soon as it connects), else closed as a slow or idle peer's."""
        oldest = next(iter(waiting))
        self._on_readable(oldest, selector, waiting)
        if oldest in waiting:
            self._drop(oldest, selector, waiting, "displaced by a newer connection")

    def _on_readable(self, conn: socket.socket, selector: selectors.BaseSelector,
                     waiting: dict[socket.socket, float]) -> None:  # fmt: skip
        """Answer the connection once its whole request (or its end) has arrived."""
        try:
            head = conn.recv(_LENGTH.size + MAX_FRAME_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        if head and not _request_whole(head):
            return  # more to come
        accepted = waiting.pop(conn)
        selector.unregister(conn)
        conn.setblocking(True)
        self._serve(conn, accepted + CONNECTION_TIMEOUT_S)

    def _drop(self, conn: socket.socket, selector: selectors.BaseSelector, waiting: dict[socket.socket, float],
              why: str) -> None:  # fmt: skip
        waiting.pop(conn, None)
        selector.unregister(conn)
        self._refusals.warning("hand-off from %s: closed, %s", _peer_description(conn), why)
        self._count("bad_request")
        conn.close()

    def _serve(self, conn: socket.socket, deadline: float) -> None:
        """Read the request (all of it has arrived), answer it, close."""
        with conn:
            peer = _peer_description(conn)
            try:
                request, _ = recv_frame(conn, max_fds=0, deadline=deadline)
            except (OSError, EOFError, HandoffError) as exc:
                self._refusals.warning("hand-off from %s: unreadable request (%s)", peer, exc)
                self._count("bad_request")
                return
            try:
                offer = self._answer(request)
            except Refusal as refusal:
                log.warning("refused the pool to %s: %s", peer, refusal)
                self._count(refusal.type)
                conn.settimeout(max(deadline - time.monotonic(), 0.05))
                reply = {"ok": False, "protocol": HANDOFF_PROTOCOL,
                         "error": {"type": refusal.type, "message": str(refusal)}}  # fmt: skip
                self._send(conn, reply, (), peer)
                return
            reply = {
                "ok": True,
                "protocol": handoff_protocol(request["protocol"]),
                "cache": self._cache,
                "geometry": offer.geometry,
                "index_url": self._index_url,
                "stats_dir": self._stats_dir,
                "pool_path": offer.pool_path,
                "pool_offset": offer.pool_offset,
            }
            conn.settimeout(max(deadline - time.monotonic(), 0.05))  # the reply is small: a short grace at most
            if self._send(conn, reply, (offer.fd,), peer):
                log.info("handed the pool to %s (%s)", peer, request.get("client", "?"))
                self._count("ok")

    def _answer(self, request: Any) -> PoolOffer:
        if not isinstance(request, dict) or request.get("op") != "handoff":
            raise Refusal("bad_request", "expected a hand-off request ({'op': 'handoff', ...})")
        protocol = request.get("protocol")
        if handoff_protocol(protocol) is None:
            raise Refusal(
                "protocol",
                f"the connector speaks hand-off protocol {protocol}, this sidecar speaks "
                f"{MIN_HANDOFF_PROTOCOL} to {HANDOFF_PROTOCOL} and answers {HANDOFF_PROTOCOL + 1} in "
                f"{HANDOFF_PROTOCOL}; upgrade MaruCache one release at a time (the sidecar's image and the "
                "vLLM image)",
            )
        if request.get("cache") != self._cache:
            raise Refusal(
                "wrong_cache",
                f"this sidecar serves cache {self._cache!r}, the connector asked for "
                f"{request.get('cache')!r}; point maru_sidecar_socket at the sidecar of that cache",
            )
        try:
            expected = self._read_token()
        except ValueError as exc:  # the token file vanished or was emptied
            log.error("%s", exc)
            raise Refusal("unavailable", "the sidecar cannot read its token file; see its log") from exc
        if expected is not None:
            self._authenticate(request.get("token"), expected)
        try:
            return self._offer()
        except PoolNotReady as exc:
            raise Refusal("unavailable", f"the pool is not attached yet: {exc}") from exc

    def _authenticate(self, offered: object, expected: str) -> None:
        """Accept the cache token, or the credential of this sidecar's own pod; refuse anything else."""
        if not isinstance(offered, str):
            raise Refusal("auth", f"the token does not match the token of cache {self._cache!r}")
        if not is_credential(offered):
            if not hmac.compare_digest(offered.encode(), expected.encode()):
                raise Refusal("auth", f"the token does not match the token of cache {self._cache!r}")
            return
        if self._pod is None:
            raise Refusal("auth", "a pod credential was presented, but this sidecar does not know its pod "
                                  "(set --pod NAMESPACE/NAME, or POD_NAMESPACE and POD_NAME); present the cache token")
        pod = pod_of(expected, offered)  # checks the MAC in constant time
        if pod is None:
            raise Refusal("auth", f"the pod credential was not minted with the token of cache {self._cache!r} "
                                  f"(forged, altered, or from before a token rotation); this sidecar serves "
                                  f"pod {self._pod!r}: read its credential file again")  # fmt: skip
        if pod != self._pod:
            raise Refusal("auth", f"the credential names pod {pod!r}; this sidecar serves pod {self._pod!r}: "
                                  "present this pod's own credential file")  # fmt: skip

    def _send(self, conn: socket.socket, reply: dict[str, Any], fds: tuple[int, ...], peer: str) -> bool:
        try:
            send_frame(conn, reply, fds)
            return True
        except OSError as exc:
            log.warning("hand-off to %s: could not send the reply (%s)", peer, exc)
            self._count("send_failed")
            return False

    def _count(self, result: str) -> None:
        if result not in RESULTS:  # the metric's label set is closed
            raise ValueError(f"hand-off result {result!r} is not one of {RESULTS}")
        with self._results_lock:
            self.results[result] += 1


def _request_whole(head: bytes) -> bool:
    """Whether the bytes received so far hold a whole request frame, or a header
    announcing one too large (refused by reading it: no need to wait for more)."""
    if len(head) < _LENGTH.size:
        return False
    (length,) = _LENGTH.unpack_from(head)
    return length > MAX_FRAME_BYTES or len(head) >= _LENGTH.size + length


def _peer_description(conn: socket.socket) -> str:
    try:
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return "a peer"
    # pid 0: the peer lives in another PID namespace (another container).
    return f"pid {pid} uid {uid}" if pid else f"uid {uid} (another PID namespace)"


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"--socket {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except OSError:
        log.info("removing the stale socket %s left by a previous sidecar", path)
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise FileExistsError(f"another sidecar already serves {path}; stop it or choose another --socket")
