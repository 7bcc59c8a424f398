"""Scheduler-side prefix lookups that never hold the engine thread for long.

``get_num_new_matched_tokens`` runs on the engine's scheduling thread. A
lookup is one batched ``match_prefix`` on a helper thread; the engine waits at
most ``maru_lookup_timeout_s`` for it and otherwise answers vLLM's "ask me
again later" (``None``) until the reply lands. A lookup that takes longer than
``give_up_s`` or fails counts as a miss, and the index is then treated as
down for ``retry_after_s``: lookups answer "miss" at once instead of queueing
behind a dead connection. After that the next lookup tries again (the client
reconnects by itself), so hits resume without a restart.

Asked to (``pin_group``), the service also pins what a lookup matched: an
early pin (``early_pins.py``) that the scheduler half hands to a worker half
in the same process, which then copies without a retrieve of its own. The
lookup and the pin are one round trip, the index's ``retrieve_prefix``
(match, then pin the matched whole chunks), so the pin is back with the
answer. An index that does not know that op (an older version) gets a
``match_prefix`` and then a ``retrieve`` on the pins' thread, as before.
Unpins run on that thread too, sharing the lookup's client (and lease): a
lookup never queues behind another request's unpin. The service owns a pin
until ``take_early_pin`` and releases it when the request looks up again or
is forgotten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from maru_core.index.client_ops import IndexRejected
from maru_core.keys import KEY_BYTES
from maru_core.protocol import ErrorType

from maru_connector.early_pins import MISSED, EarlyPin
from maru_connector.resolve import hold, misses_in, unpin_hidden

logger = logging.getLogger(__name__)


class LookupService:
    """Batched, time-bounded ``match_prefix`` with at most one lookup per request.

    Args:
        client_factory: builds the index client, called on the lookup thread
            (and again after a failure, so a dead connection is replaced).
        timeout_s: how long the engine thread waits for a reply.
        give_up_s: after this long a pending lookup counts as a miss.
        retry_after_s: how long lookups answer "miss" after a failure.
        one_round_trip: pin early with ``retrieve_prefix`` (``False``: always
            a ``match_prefix`` and then a ``retrieve``, as an index without
            that op needs; benchmarks compare the two).
    """

    def __init__(
        self,
        client_factory: Callable[[], Any],
        timeout_s: float,
        give_up_s: float = 2.0,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        one_round_trip: bool = True,
    ) -> None:
        self._client_factory = client_factory
        self._client: Any = None
        self._timeout_s = timeout_s
        self._give_up_s = give_up_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maru-lookup")
        self._pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maru-early-pins")
        # One entry per live request at most; dropped by forget() at request end.
        self._pending: dict[str, tuple[Future[_Answer], float]] = {}
        self._early: dict[str, EarlyPin] = {}  # early pins not yet taken
        self._down_until = 0.0
        self._one_round_trip = one_round_trip

    def match(self, req_id: str, key_lists: Sequence[bytes | Sequence[bytes]],
              pin_group: int = 0) -> int | None:
        """Leading keys committed for every key list (min over TP ranks); a
        list is a sequence of keys or the keys packed end to end.

        ``pin_group`` > 0 (one key list only): then also pin the matched keys,
        in whole groups of that many (a chunk's objects), as an early pin for
        ``take_early_pin``; a new lookup releases the request's last one.

        Returns the count, or ``None`` while the lookup is still in flight.
        An unreachable or failing index yields 0 (a miss).
        """
        now = self._clock()
        pending = self._pending.get(req_id)
        if pending is not None:
            future, started = pending
            if future.done():
                del self._pending[req_id]
                return self._result(req_id, future)
            if now - started > self._give_up_s:
                self._drop_pending(req_id)
                self._mark_down(f"lookup took longer than {self._give_up_s}s")
                return 0
            return None
        self._release_early(req_id)
        if now < self._down_until:
            return 0
        lists = [k if type(k) is bytes else list(k) for k in key_lists]  # a snapshot
        group = pin_group if len(lists) == 1 else 0
        future = self._executor.submit(self._match_all, lists, group)
        try:
            future.result(timeout=self._timeout_s)
        except FutureTimeout:
            self._pending[req_id] = (future, now)
            return None
        except Exception:  # reported by _result below
            pass
        return self._result(req_id, future)

    def early_pin(self, req_id: str) -> EarlyPin | None:
        """The request's early pin, still the service's."""
        return self._early.get(req_id)

    def take_early_pin(self, req_id: str) -> EarlyPin | None:
        """The request's early pin, now the caller's to hand on or release."""
        return self._early.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop a request's pending lookup and early pin (the request ended)."""
        self._drop_pending(req_id)
        self._release_early(req_id)

    @property
    def num_early_pins(self) -> int:
        return len(self._early)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        for req_id in list(self._early):
            self._release_early(req_id)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._pinner.shutdown(wait=False, cancel_futures=True)
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _match_all(self, key_lists: list[bytes | list[bytes]], pin_group: int) -> "_Answer":
        if self._client is None:
            self._client = self._client_factory()
        client = self._client
        if pin_group and self._one_round_trip and key_lists[0]:
            try:
                return self._match_and_pin(client, key_lists[0], pin_group)
            except IndexRejected as exc:
                if exc.error_type != ErrorType.UNKNOWN_OP.value:
                    raise
                logger.info("the index has no retrieve_prefix (an older version); early pins "
                            "take a match_prefix and a retrieve")
                self._one_round_trip = False
        matched = max(0, int(min((client.match_prefix(keys) if keys else 0) for keys in key_lists)))
        pinned = matched - matched % pin_group if pin_group else 0
        if not pinned:
            return matched, None
        pin = self._early_pin(client, key_lists[0], pinned)
        # The engine has its answer now and allocates blocks while the pins are taken.
        pin.start(self._pinner.submit(self._retrieve_early, client, pin))
        return matched, pin

    def _match_and_pin(self, client: Any, keys: bytes | list[bytes], pin_group: int) -> "_Answer":
        """The lookup and its early pin in one ``retrieve_prefix``.

        A reply the client rejected (it has seen to any pins of it) is not
        trusted for the count either: a ``match_prefix`` gives the count, and
        the pin carries the error, so the load fails and is counted and
        recomputed, as after a failed retrieve.
        """
        reply: Future[Any] = Future()
        try:
            matched, locations = client.retrieve_prefix(keys, pin_group)
        except IndexRejected as exc:
            if exc.error_type == ErrorType.UNKNOWN_OP.value:
                raise
            matched = client.match_prefix(keys)
            pinned = matched - matched % pin_group
            if not pinned:
                return matched, None
            pin = self._early_pin(client, keys, pinned)
            reply.set_exception(exc)
        else:
            if locations is None:
                return matched, None
            pin = self._early_pin(client, keys, len(locations))
            hold(client, pin)
            reply.set_result(locations)
        pin.start(reply)
        return matched, pin

    def _early_pin(self, client: Any, keys: bytes | list[bytes], count: int) -> EarlyPin:
        packed = keys if type(keys) is bytes else b"".join(keys)
        return EarlyPin(client, packed[: count * KEY_BYTES], run=self._pinner.submit)

    @staticmethod
    def _retrieve_early(client: Any, pin: EarlyPin) -> Any:
        """The early pin's retrieve (on the pins' thread): the reply, or
        ``MISSED``; a retrieve that raises pins nothing (the index client sees
        to that), and the load that claims the pin fails with its error."""
        reply = client.retrieve(pin.object_keys)
        if misses_in(reply):  # evicted since the match: all-or-nothing, nothing pinned
            unpin_hidden(client, pin.object_keys)
            return MISSED
        hold(client, pin)
        return reply

    def _result(self, req_id: str, future: "Future[_Answer]") -> int:
        exc = future.exception()
        if exc is None:
            matched, pin = future.result()
            if pin is not None:
                self._early[req_id] = pin
            return matched
        self._mark_down(f"{type(exc).__name__}: {exc}")
        return 0

    def _drop_pending(self, req_id: str) -> None:
        """Nobody will read this lookup: its early pin, if any, goes when it lands."""
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending[0].add_done_callback(_release_answer)

    def _release_early(self, req_id: str) -> None:
        pin = self._early.pop(req_id, None)
        if pin is not None:
            pin.release()

    def _mark_down(self, why: str) -> None:
        logger.warning("MaruCache index lookup failed (%s); treating lookups as misses "
                       "for %.1fs", why, self._retry_after_s)
        self._down_until = self._clock() + self._retry_after_s


_Answer = tuple[int, EarlyPin | None]  # matched keys, and the early pin taken for them


def _release_answer(future: "Future[_Answer]") -> None:
    if not future.cancelled() and future.exception() is None:
        pin = future.result()[1]
        if pin is not None:
            pin.release()
