"""A real `marucache index` process on a temporary pool in `/dev/shm`.

Tests, the demo and the benchmark use it the way a user would: the pool is a
tmpfs file, the index is its own process listening on loopback, and the
connector reaches it over TCP with a token.
"""

from __future__ import annotations

import os
import secrets
import signal
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

SHM_DIR = "/dev/shm"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the
    ephemeral range: a port is bound by the process it is for some time after
    it was picked, and a port from the ephemeral range (what binding port 0
    gives) may by then be the local end of an outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's pick
        low = 0
    candidates = random.sample(range(20000, low), min(400, low - 20000)) if low > 20400 else []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique_pool_path(prefix: str = "marucache-test") -> str:
    return os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


class IndexProcess:
    """`marucache index` on `pool_path`, listening on `127.0.0.1:port`.

    The pool file is created by the index on first start and removed by
    `close()`. `kill()` ends the index abruptly (SIGKILL) and `start()` brings
    it back on the same port and pool, as a restarted index would come back.
    """

    def __init__(
        self,
        pool_path: str | None = None,
        pool_size: str = "256Mi",
        port: int | None = None,
        log_dir: str | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.pool_path = pool_path or unique_pool_path()
        self.pool_size = pool_size
        self.port = port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self._workdir = tempfile.mkdtemp(prefix="marucache-index-")
        self.log_path = Path(log_dir or self._workdir) / f"index-{self.port}.log"
        self.token = secrets.token_hex(16)
        self.token_file = os.path.join(self._workdir, "token")
        with open(self.token_file, "w", encoding="utf-8") as fh:
            fh.write(self.token)
        os.chmod(self.token_file, 0o600)
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 30.0) -> "IndexProcess":
        """Start the index and wait until it accepts connections."""
        if self.alive():
            return self
        self._log = open(self.log_path, "ab")
        cmd = [
            sys.executable, "-m", "maru_core.cli", "index",
            "--pool", self.pool_path, "--pool-size", self.pool_size,
            "--listen", self.url, "--token-file", self.token_file, *self.extra_args,
        ]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                message = f"index exited with {self._proc.returncode}: {' '.join(cmd)}\n{self.log_tail()}"
                self.close()  # the pool file it may have created goes too
                raise RuntimeError(message)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        message = f"index did not listen on {self.url} within {timeout_s}s\n{self.log_tail()}"
        self.close()
        raise RuntimeError(message)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown, pins and leases lost."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        if self._log:
            self._log.close()
            self._log = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait: the clean shutdown path."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop the index and remove its pool and token."""
        self.stop()
        owned_log = self.log_path.parent == Path(self._workdir)
        for path in (self.pool_path, self.token_file, *( [self.log_path] if owned_log else [])):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self._workdir)
        except OSError:
            pass

    def client(self, timeout_s: float = 5.0, url: str | None = None):
        from maru_core.index.client import IndexClient

        return IndexClient(url or self.url, token=self.token, client_name="marucache-testing", timeout_s=timeout_s)

    def stats(self) -> dict[str, Any]:
        """The index's `stats` reply (pool bytes by state, keys, leases, ...)."""
        client = self.client()
        try:
            return client.stats()
        finally:
            client.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "IndexProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
