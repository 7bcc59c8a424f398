"""Starting an index from Python: as its own process (``IndexProcess``, what
the benchmark, the quickstart and the process tests use) or on a thread of
this process (``ThreadedIndex``, for tests that need the server's internals).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any, Sequence

from maru_core.protocol import TcpAddress, parse_url

_READY = re.compile(r"listening on (\S+)")


class IndexProcess:
    """``marucache index`` in a child process.

    ``start()`` returns once the index prints its ``listening on`` line (the
    real address, so ``tcp://127.0.0.1:0`` picks a free port) and raises
    ``RuntimeError`` with the index's own error when it exits instead.
    """

    def __init__(
        self,
        pool: str,
        *,
        pool_size: str | None = None,
        listen: str = "tcp://127.0.0.1:0",
        token_file: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.pool = pool
        self.args = [sys.executable, "-m", "maru_core.cli", "index", "--pool", pool, "--listen", listen]
        if pool_size:
            self.args += ["--pool-size", pool_size]
        if token_file:
            self.args += ["--token-file", token_file]
        self.args += list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.metrics_url: str | None = None

    def start(self, timeout_s: float = 30.0) -> "IndexProcess":
        self.proc = proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        assert proc.stdout is not None and proc.stderr is not None  # both piped
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("marucache index: metrics on "):
                    self.metrics_url = line.split(" on ", 1)[1].strip()
                match = _READY.search(line)
                if match:
                    self.url = match.group(1)
                    break
        finally:
            timer.cancel()
        if self.url is None:
            proc.wait()
            raise RuntimeError(f"the index did not start: {proc.stderr.read().strip()}")
        # Keep draining its output so a chatty index never blocks on a full pipe.
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=stream.read, daemon=True).start()
        return self

    @property
    def port(self) -> int:
        address = parse_url(self.url or "")
        assert isinstance(address, TcpAddress)
        return address.port

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then wait; return the exit status (SIGKILL if it does not stop in time)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """End the index abruptly, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "IndexProcess":
        if self.proc is not None and self.proc.poll() is None:
            return self  # already started: ``with IndexProcess(...).start():``
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ThreadedIndex:
    """An index service on an event loop in a background thread of this process.

    ``service_kwargs`` go to ``maru_core.index.service.build_service``; the
    pool is the caller's (it stays open after ``stop``). One lease may hold,
    pin and evict the whole pool unless ``max_lease_pool_fraction``,
    ``max_lease_pin_fraction`` and ``max_lease_evict_fraction`` say otherwise,
    nor one peer's leases together unless the ``max_peer_*`` ones do (the
    clients of a test share one address):
    the small pools this runs on are often filled by one writer on purpose.
    """

    def __init__(self, pool: Any, listen: str = "tcp://127.0.0.1:0", **service_kwargs: Any) -> None:
        self.pool = pool
        self._listen = parse_url(listen)
        self._kwargs = {"token": None, "lease_ttl_s": 10.0, "reservation_ttl_s": 30.0,
                        "with_metrics": False, "fresh_pool": True, "max_lease_pool_fraction": 1.0,
                        "max_lease_pin_fraction": 1.0, "max_lease_evict_fraction": None,
                        "max_peer_pool_fraction": 1.0, "max_peer_pin_fraction": 1.0, "max_peer_evict_fraction": None,
                        **service_kwargs}  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="maru-index", daemon=True)
        self.service: Any = None
        self.url: str | None = None

    def start(self) -> "ThreadedIndex":
        from maru_core.index.service import build_service

        self._thread.start()

        async def start() -> str:
            self.service = build_service(self.pool, **self._kwargs)
            return str(await self.service.server.start(self._listen))

        self.url = self.call(start())
        return self

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        """Run ``coro`` on the index's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def on_loop(self, fn: Any, *args: Any) -> Any:
        """Call ``fn(*args)`` on the index's loop (e.g. to read the registry) and return its result."""

        async def run() -> Any:
            return fn(*args)

        return self.call(run())

    def stop(self) -> None:
        if self.service is not None:
            self.call(self.service.close())
            self.service = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> "ThreadedIndex":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def unique_shm_path(prefix: str = "marucache") -> str:
    """A fresh pool path under ``/dev/shm`` (nothing is created)."""
    return f"/dev/shm/{prefix}-{os.getpid()}-{os.urandom(4).hex()}"
