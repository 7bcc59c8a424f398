"""Readiness: is the index reachable with this cache's token? A real `hello` with a short timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable


class IndexProbe:
    """Checks the index with a fresh client: its `hello` (address, token, protocol version) and one `heartbeat`.

    A fresh connection per probe tells the truth about the index as a new
    connector would meet it (address, token, protocol version), at the cost of
    one short-lived lease per probe, which lapses after the index's lease TTL.
    """

    def __init__(self, url: str, read_token: Callable[[], str | None], timeout_s: float, client_name: str):
        self._url, self._read_token = url, read_token
        self._timeout_s, self._client_name = timeout_s, client_name
        self._lock = threading.Lock()  # probes run one at a time, whatever the scrape rate

    def check(self) -> tuple[bool, str]:
        """(reachable, a sentence saying what was found)."""
        from maru_core.index.client import IndexClient, IndexRejected, IndexUnavailable

        with self._lock:
            try:
                client = IndexClient(self._url, token=self._read_token(), client_name=self._client_name,
                                     timeout_s=self._timeout_s, heartbeat=False)  # fmt: skip
                try:
                    client.heartbeat()  # connects: hello, then heartbeat
                finally:
                    client.close()
            except IndexRejected as exc:
                return False, f"index {self._url} refused the sidecar: {exc}"
            except (IndexUnavailable, OSError, ValueError) as exc:
                return False, f"index {self._url} unreachable: {exc}"
        return True, f"index {self._url} answered"

    def close(self) -> None:
        """Nothing is held between probes."""
