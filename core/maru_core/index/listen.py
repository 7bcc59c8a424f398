"""Small pieces of the index server's edge: its Unix socket path, and a log
that a flood of bad clients cannot flood."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from typing import Any


class ListenError(OSError):
    """The listener cannot take its address; the message says what to change."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnixListenerPath:
    """The Unix socket path of a listener: taken only when free or when it holds
    a stale socket (one nobody accepts on), and removed on close only while it
    is still the socket this listener made."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._identity: tuple[int, int] | None = None

    def bind(self) -> socket.socket:
        """A listening socket bound at the path; ``ListenError`` if the path is someone else's."""
        self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise ListenError(f"cannot listen on unix://{self.path}: {exc.strerror or exc}") from exc
        st = os.lstat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        sock.setblocking(False)
        return sock

    def _clear_stale(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ListenError(
                f"--listen unix://{self.path}: something that is not a socket is there; "
                "remove it or choose another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(self.path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ListenError(f"--listen unix://{self.path}: cannot tell whether it is in use ({exc})") from exc
            os.unlink(self.path)  # a stale socket: its server is gone
            return
        finally:
            probe.close()
        raise ListenError(
            f"--listen unix://{self.path}: another process is listening there; stop it or choose another path"
        )

    def remove(self) -> None:
        """Unlink the path if it is still this listener's socket."""
        if self._identity is None:
            return
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            os.unlink(self.path)
        self._identity = None


class RateLimitedLog:
    """Logs at most one message per ``interval_s`` per level; the next one says
    how many were held back. A flood of bad connections costs a log line a second."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._next_at: dict[int, float] = {}
        self._held: dict[int, int] = {}

    def warning(self, message: str, *args: Any) -> None:
        self._emit(logging.WARNING, message, args)

    def info(self, message: str, *args: Any) -> None:
        self._emit(logging.INFO, message, args)

    def _emit(self, level: int, message: str, args: tuple) -> None:
        now = time.monotonic()
        if now < self._next_at.get(level, 0.0):
            self._held[level] = self._held.get(level, 0) + 1
            return
        self._next_at[level] = now + self._interval_s
        held = self._held.pop(level, 0)
        if held:
            message += f" (and {held} more like it held back)"
        self._log.log(level, message, *args)
