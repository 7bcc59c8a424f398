"""Scheduler-side prefix lookups that never hold the engine thread for long.

``get_num_new_matched_tokens`` runs on the engine's scheduling thread. A
lookup is one batched ``match_prefix`` on a helper thread; the engine waits at
most ``maru_lookup_timeout_s`` for it and otherwise answers vLLM's "ask me
again later" (``None``) until the reply lands. A lookup that takes longer than
``give_up_s`` or fails counts as a miss, and the index is then treated as
down for ``retry_after_s``: lookups answer "miss" at once instead of queueing
behind a dead connection. After that the next lookup tries again (the client
reconnects by itself), so hits resume without a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

logger = logging.getLogger(__name__)


class LookupService:
    """Batched, time-bounded ``match_prefix`` with at most one lookup per request.

    Args:
        client_factory: builds the index client, called on the lookup thread
            (and again after a failure, so a dead connection is replaced).
        timeout_s: how long the engine thread waits for a reply.
        give_up_s: after this long a pending lookup counts as a miss.
        retry_after_s: how long lookups answer "miss" after a failure.
    """

    def __init__(
        self,
        client_factory: Callable[[], Any],
        timeout_s: float,
        give_up_s: float = 2.0,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client_factory = client_factory
        self._client: Any = None
        self._timeout_s = timeout_s
        self._give_up_s = give_up_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maru-lookup")
        # One entry per live request at most; dropped by forget() at request end.
        self._pending: dict[str, tuple[Future[int], float]] = {}
        self._down_until = 0.0

    def match(self, req_id: str, key_lists: Sequence[bytes | Sequence[bytes]]) -> int | None:
        """Leading keys committed for every key list (min over TP ranks); a
        list is a sequence of keys or the keys packed end to end.

        Returns the count, or ``None`` while the lookup is still in flight.
        An unreachable or failing index yields 0 (a miss).
        """
        now = self._clock()
        pending = self._pending.get(req_id)
        if pending is not None:
            future, started = pending
            if future.done():
                del self._pending[req_id]
                return self._result(future)
            if now - started > self._give_up_s:
                del self._pending[req_id]
                self._mark_down(f"lookup took longer than {self._give_up_s}s")
                return 0
            return None
        if now < self._down_until:
            return 0
        lists = [k if type(k) is bytes else list(k) for k in key_lists]  # a snapshot
        future = self._executor.submit(self._match_all, lists)
        try:
            future.result(timeout=self._timeout_s)
        except FutureTimeout:
            self._pending[req_id] = (future, now)
            return None
        except Exception:  # reported by _result below
            pass
        return self._result(future)

    def forget(self, req_id: str) -> None:
        """Drop a request's pending lookup (called when the request ends)."""
        self._pending.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _match_all(self, key_lists: list[bytes | list[bytes]]) -> int:
        if self._client is None:
            self._client = self._client_factory()
        matched = min(
            (self._client.match_prefix(keys) if keys else 0) for keys in key_lists
        )
        return max(0, int(matched))

    def _result(self, future: Future[int]) -> int:
        exc = future.exception()
        if exc is None:
            return future.result()
        self._mark_down(f"{type(exc).__name__}: {exc}")
        return 0

    def _mark_down(self, why: str) -> None:
        logger.warning("MaruCache index lookup failed (%s); treating lookups as misses "
                       "for %.1fs", why, self._retry_after_s)
        self._down_until = self._clock() + self._retry_after_s
