"""Scheduler-side prefix lookups that never hold the engine thread for long.

``get_num_new_matched_tokens`` runs on the engine's scheduling thread. A
lookup runs on a helper thread; the engine waits for replies at most
``maru_lookup_timeout_s`` *in total per scheduling pass* (vLLM's
``schedule()``, which ends with ``build_connector_meta``: :meth:`end_pass`).
A lookup not answered within what is left of the pass's wait answers vLLM's
"ask me again later" (``None``); vLLM asks again at its next pass, which
reads the reply without waiting once it landed. So a pass costs the engine
one lookup timeout at most, however many requests arrive in it.

The helper thread sends each lookup that finds it idle at once (a lone
lookup against a healthy index is answered in the pass that asked), and
every lookup queued while it was busy in one ``match_prefixes`` round trip
(all their key lists, one count each). An index older than that op gets one
``match_prefix`` per list, as before.

A lookup that takes longer than ``give_up_s`` (from when it was queued) or
fails counts as a miss, and the index is then treated as down for
``retry_after_s``: lookups answer "miss" at once instead of queueing behind
a dead connection. After that the next lookup tries again (the client
reconnects by itself), so hits resume without a restart.

Asked to (``pin_group``), the service also pins what a lookup matched: an
early pin (``early_pins.py``) that the scheduler half hands to a worker half
in the same process, which then copies without a retrieve of its own. A
lookup sent alone and its pin are one round trip, the index's
``retrieve_prefix`` (match, then pin the matched whole chunks), so the pin is
back with the answer. A lookup answered by a batched ``match_prefixes``, or
asked of an index that does not know ``retrieve_prefix`` (an older version),
gets its pin from a ``retrieve`` on the pins' thread, after the engine has
its answer. Unpins run on that thread too, sharing the lookup's client (and
lease): a lookup never queues behind another request's unpin. The service
owns a pin until ``take_early_pin`` and releases it when the request looks
up again or is forgotten.

Asked to (``tail``), a lookup that stops before the end of the prompt goes
on at block granularity: one ``match_alias`` for the block aliases of the
first chunk it missed (``maru_core.keys.block_alias_keys``), longest prefix
first. What it finds waits for ``take_tail``; such a lookup keeps no early
pin (the worker pins the whole load, the found chunk included, itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from maru_core.index.api import IndexApi, IndexRejected
from maru_core.keys import KEY_BYTES
from maru_core.protocol import ErrorType

from maru_connector.early_pins import MISSED, EarlyPin, PinReply
from maru_connector.log import get_logger
from maru_connector.resolve import hold, misses_in, unpin_hidden

logger = get_logger(__name__)


#: One key list of a lookup: keys, or the keys packed end to end.
_KeyList = bytes | list[bytes]


@dataclass(frozen=True)
class TailQuery:
    """Where a lookup may go on past the whole chunks it matches.

    ``candidates(chunks_matched)``: ``(blocks, alias key)`` of the first
    chunk missed, longest prefix first (empty: none worth asking for);
    ``layers``: the layerwise format's layers (the index checks that each
    layer object of the found chunk is committed), ``None`` for chunkwise.
    """

    objects_per_chunk: int
    layers: tuple[int, ...] | None
    candidates: Callable[[int], list[tuple[int, bytes]]]


@dataclass(frozen=True)
class TailHit:
    """A block alias a lookup found: the first ``blocks`` blocks of the
    committed chunk ``target`` hold the KV of the prompt's chunk that follows
    the ``chunks`` it matched whole."""

    chunks: int
    blocks: int
    target: bytes


@dataclass(eq=False)
class _Lookup:
    """One request's lookup, from the engine thread to the lookup thread."""

    req_id: str
    key_lists: list[_KeyList]
    pin_group: int
    queued_at: float
    tail: TailQuery | None = None
    future: "Future[_Answer]" = field(default_factory=Future)


class LookupService:
    """Batched, time-bounded prefix lookups with at most one lookup per request.

    Args:
        client_factory: builds the index client, called on the lookup thread
            (and again after a failure, so a dead connection is replaced).
        timeout_s: how long the engine thread waits for replies, in total,
            per scheduling pass.
        give_up_s: after this long a pending lookup counts as a miss.
        retry_after_s: how long lookups answer "miss" after a failure.
        one_round_trip: pin early with ``retrieve_prefix`` (``False``: always
            a ``match_prefix`` and then a ``retrieve``, as an index without
            that op needs; benchmarks compare the two).
    """

    def __init__(
        self,
        client_factory: Callable[[], IndexApi],
        timeout_s: float,
        give_up_s: float = 2.0,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        one_round_trip: bool = True,
    ) -> None:
        self._client_factory = client_factory
        self._client: IndexApi | None = None
        self._timeout_s = timeout_s
        self._give_up_s = give_up_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maru-lookup")
        self._pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maru-early-pins")
        # One entry per live request at most; dropped by forget() at request end.
        self._pending: dict[str, _Lookup] = {}
        self._early: dict[str, EarlyPin] = {}  # early pins not yet taken
        self._tails: dict[str, TailHit] = {}  # block aliases found, not yet taken
        self._aliases = True  # False once the index said it knows no match_alias
        self._down_until = 0.0
        self._one_round_trip = one_round_trip
        self._batched = True  # False once the index said it knows no match_prefixes
        self._waited_s = 0.0  # the engine thread's wait in this scheduling pass
        self._queue_lock = threading.Lock()
        self._queue: list[_Lookup] = []  # lookups the lookup thread has not taken yet
        self._draining = False  # a drain of the queue is submitted and not finished

    def match(self, req_id: str, key_lists: Sequence[bytes | Sequence[bytes]],
              pin_group: int = 0, tail: TailQuery | None = None) -> int | None:
        """Leading keys committed for every key list (min over TP ranks); a
        list is a sequence of keys or the keys packed end to end.

        ``pin_group`` > 0 (one key list only): then also pin the matched keys,
        in whole groups of that many (a chunk's objects), as an early pin for
        ``take_early_pin``; a new lookup releases the request's last one.
        ``tail`` (one key list only): then also look for a block alias of the
        first chunk missed, for ``take_tail``.

        Returns the count, or ``None`` while the lookup is still in flight
        (it waited what was left of this pass's ``timeout_s``, or was already
        pending). An unreachable or failing index yields 0 (a miss).
        """
        now = self._clock()
        pending = self._pending.get(req_id)
        if pending is not None:
            if pending.future.done():
                del self._pending[req_id]
                return self._result(req_id, pending.future)
            if now - pending.queued_at > self._give_up_s:
                self._drop_pending(req_id)
                self._mark_down(f"lookup took longer than {self._give_up_s}s")
                return 0
            return None
        self._release_early(req_id)
        self._tails.pop(req_id, None)
        if now < self._down_until:
            return 0
        lists: list[_KeyList] = [k if isinstance(k, bytes) else list(k) for k in key_lists]  # a snapshot
        one = len(lists) == 1
        lookup = self._submit(_Lookup(req_id, lists, pin_group if one else 0, now, tail if one else None))
        if not self._wait(lookup.future):
            self._pending[req_id] = lookup
            return None
        return self._result(req_id, lookup.future)

    @property
    def index_down(self) -> bool:
        """Lookups answer "miss" without asking the index (it failed lately):
        the last answer may have been such a miss."""
        return self._clock() < self._down_until

    def end_pass(self) -> None:
        """A scheduling pass ended: the next one may wait ``timeout_s`` again."""
        self._waited_s = 0.0

    def early_pin(self, req_id: str) -> EarlyPin | None:
        """The request's early pin, still the service's."""
        return self._early.get(req_id)

    def take_early_pin(self, req_id: str) -> EarlyPin | None:
        """The request's early pin, now the caller's to hand on or release."""
        return self._early.pop(req_id, None)

    def take_tail(self, req_id: str) -> TailHit | None:
        """The block alias the request's last answered lookup found, if any."""
        return self._tails.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop a request's pending lookup and early pin (the request ended)."""
        self._drop_pending(req_id)
        self._release_early(req_id)
        self._tails.pop(req_id, None)

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

    # ---- the engine thread's side ------------------------------------------

    def _submit(self, lookup: _Lookup) -> _Lookup:
        """Queue the lookup; start a drain unless one is running (it takes this one too)."""
        with self._queue_lock:
            self._queue.append(lookup)
            start, self._draining = not self._draining, True
        if start:
            self._executor.submit(self._drain)
        return lookup

    def _wait(self, future: "Future[_Answer]") -> bool:
        """Wait for the reply within what is left of this pass's budget; whether it came."""
        left = self._timeout_s - self._waited_s
        if left <= 0:
            return future.done()
        started = time.monotonic()
        try:
            future.result(timeout=left)
        except FutureTimeout:
            pass
        except Exception:  # reported by _result
            pass
        self._waited_s += time.monotonic() - started
        return future.done()

    # ---- the lookup thread -------------------------------------------------

    def _drain(self) -> None:
        """Answer every queued lookup: those queued while a round trip was out go together."""
        while True:
            with self._queue_lock:
                queued, self._queue = self._queue, []
                if not queued:
                    self._draining = False
                    return
            batch = [q for q in queued if q.future.set_running_or_notify_cancel()]  # forgotten: skipped
            if batch:
                self._answer(batch)

    def _answer(self, batch: list[_Lookup]) -> None:
        try:
            if self._client is None:
                self._client = self._client_factory()
            client = self._client
            if len(batch) == 1:
                answers = [self._match_all(client, batch[0].key_lists, batch[0].pin_group)]
            else:
                answers = self._match_batch(client, batch)
        except Exception as exc:  # the index failed them all: each counts as a miss
            for lookup in batch:
                lookup.future.set_exception(exc)
            return
        for lookup, (matched, pin) in zip(batch, answers):
            try:
                tail = self._find_tail(client, lookup.tail, matched)
            except Exception as exc:  # a failed index: the lookup is a miss, as any other failure
                if pin is not None:
                    pin.release()
                lookup.future.set_exception(exc)
                continue
            lookup.future.set_result((matched, pin, tail))

    def _find_tail(self, client: IndexApi, query: TailQuery | None, matched: int) -> TailHit | None:
        """The longest block alias of the first chunk missed whose chunk is committed."""
        if query is None or not self._aliases:
            return None
        chunks = matched // query.objects_per_chunk
        candidates = query.candidates(chunks)
        if not candidates:
            return None
        try:
            found = client.match_alias(b"".join(key for _, key in candidates), query.layers)
        except IndexRejected as exc:
            if exc.error_type is ErrorType.UNKNOWN_OP:
                logger.info("the index has no match_alias (an older version); hits stay whole chunks")
                self._aliases = False
            else:  # the whole chunks found stand: only the part beyond them is lost
                logger.warning("match_alias refused (%s); this lookup's hit stays whole chunks", exc)
            return None
        if found is None:
            return None
        position, target = found
        return TailHit(chunks, candidates[position][0], target)

    def _match_batch(self, client: IndexApi, batch: list[_Lookup]) -> list["_Matched"]:
        """Several requests' lookups in one ``match_prefixes``; their early pins follow
        on the pins' thread."""
        counts = iter(self._match_lists(client, [keys for q in batch for keys in q.key_lists]))
        answers = []
        for lookup in batch:
            matched = min((next(counts) for _ in lookup.key_lists), default=0)
            answers.append(self._pin_after_match(client, lookup.key_lists[0] if lookup.key_lists else b"",
                                                 lookup.pin_group, max(0, matched)))
        return answers

    def _match_lists(self, client: IndexApi, key_lists: list[_KeyList]) -> list[int]:
        if self._batched:
            try:
                return client.match_prefixes(key_lists)
            except IndexRejected as exc:
                if exc.error_type is not ErrorType.UNKNOWN_OP:
                    raise
                logger.info("the index has no match_prefixes (an older version); queued lookups "
                            "take a match_prefix each")
                self._batched = False
        return [client.match_prefix(keys) if keys else 0 for keys in key_lists]

    def _match_all(self, client: IndexApi, key_lists: list[_KeyList], pin_group: int) -> "_Matched":
        """One request's lookup, sent alone: with an early pin, one ``retrieve_prefix``."""
        if pin_group and self._one_round_trip and key_lists[0]:
            try:
                return self._match_and_pin(client, key_lists[0], pin_group)
            except IndexRejected as exc:
                if exc.error_type is not ErrorType.UNKNOWN_OP:
                    raise
                logger.info("the index has no retrieve_prefix (an older version); early pins "
                            "take a match_prefix and a retrieve")
                self._one_round_trip = False
        matched = max(0, int(min((client.match_prefix(keys) if keys else 0) for keys in key_lists)))
        return self._pin_after_match(client, key_lists[0], pin_group, matched)

    def _pin_after_match(self, client: IndexApi, keys: _KeyList, pin_group: int,
                         matched: int) -> "_Matched":
        """The early pin of ``matched`` keys, taken by a ``retrieve`` on the pins' thread."""
        pinned = matched - matched % pin_group if pin_group else 0
        if not pinned:
            return matched, None
        pin = self._early_pin(client, keys, pinned)
        # The engine has its answer now and allocates blocks while the pins are taken.
        pin.start(self._pinner.submit(self._retrieve_early, client, pin))
        return matched, pin

    def _match_and_pin(self, client: IndexApi, keys: _KeyList, pin_group: int) -> "_Matched":
        """The lookup and its early pin in one ``retrieve_prefix``.

        A reply the client rejected (it has seen to any pins of it) is not
        trusted for the count either: a ``match_prefix`` gives the count, and
        the pin carries the error, so the load fails and is counted and
        recomputed, as after a failed retrieve.
        """
        reply: Future[PinReply] = Future()
        try:
            matched, locations = client.retrieve_prefix(keys, pin_group)
        except IndexRejected as exc:
            if exc.error_type is ErrorType.UNKNOWN_OP:
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

    def _early_pin(self, client: IndexApi, keys: _KeyList, count: int) -> EarlyPin:
        packed = keys if isinstance(keys, bytes) else b"".join(keys)
        return EarlyPin(client, packed[: count * KEY_BYTES], run=self._pinner.submit)

    @staticmethod
    def _retrieve_early(client: IndexApi, pin: EarlyPin) -> PinReply:
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
            matched, pin, tail = future.result()
            if tail is not None:
                self._tails[req_id] = tail
                if pin is not None:  # the load's keys are not the pin's: the worker pins them all
                    pin.release()
            elif pin is not None:
                self._early[req_id] = pin
            return matched
        self._mark_down(f"{type(exc).__name__}: {exc}")
        return 0

    def _drop_pending(self, req_id: str) -> None:
        """Nobody will read this lookup: not sent yet, it never is; else its
        early pin, if any, goes when it lands."""
        pending = self._pending.pop(req_id, None)
        if pending is not None and not pending.future.cancel():
            pending.future.add_done_callback(_release_answer)

    def _release_early(self, req_id: str) -> None:
        pin = self._early.pop(req_id, None)
        if pin is not None:
            pin.release()

    def _mark_down(self, why: str) -> None:
        logger.warning("MaruCache index lookup failed (%s); treating lookups as misses "
                       "for %.1fs", why, self._retry_after_s)
        self._down_until = self._clock() + self._retry_after_s


_Matched = tuple[int, EarlyPin | None]  # matched keys, and the early pin taken for them
_Answer = tuple[int, EarlyPin | None, TailHit | None]  # and the block alias found after them


def _release_answer(future: "Future[_Answer]") -> None:
    if not future.cancelled() and future.exception() is None:
        pin = future.result()[1]
        if pin is not None:
            pin.release()
