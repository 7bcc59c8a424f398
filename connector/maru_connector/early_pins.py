"""Pins taken right after a lookup, handed to a worker half in the same process.

A hit used to cost two round trips to the index before its first copy: the
scheduler half's ``match_prefix`` and, once vLLM had allocated blocks, the
worker half's ``retrieve`` (pin and locate). When vLLM runs the scheduler and
its one worker in one process (one device, no tensor parallelism: vLLM's
uni-process executor), the lookup service pins the matched objects right after
answering the match (on a thread of its own, with the lookup's client), while
the engine allocates blocks, and the worker starts copying without a round
trip of its own. In every other case (several ranks, workers in other
processes) the worker retrieves, as before.

An :class:`EarlyPin` always has one owner, and the owner releases it:

- the lookup service, from the lookup until the scheduler half plans the
  request's load (a new lookup, a request that ends first or a planned load
  of nothing release it there);
- the :class:`PinHandoff` of the engine, from the plan (which names the pin
  by a token) until the worker half claims it at ``start_load_kv``;
- the worker half, which uses it for that load and releases it after the
  load's copies, as it would its own pins.

The worker checks an early pin exactly as its own retrieve: the reply's
length, misses and lengths, then every slot header, before any copy. A pin
whose retrieve failed or found a miss fails the load, as the worker's own
retrieve would have, and so does one not back within the worker's own
retrieve timeout (retrieving again would let a hit wait twice that long); one
that does not start at the load's first chunk is released, and the worker
retrieves itself.

A hit's copies can start before vLLM has allocated its blocks: once the
lookup answers with the pin, the scheduler half asks the worker half (through
the handoff) for a head start, the transfer engine's copies of the load's
first layers into device staging (``TransferEngine.start_head``). The pin
carries the head start; its load scatters those fills first, and a pin
released without a load drops it. Nothing reaches the KV cache before the
load's own checks: only the scatters write blocks, and they are queued by the
load, after its slot-header checks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, ClassVar, Union

from maru_core.index.api import IndexApi
from maru_core.keys import KEY_BYTES
from maru_core.protocol import LocationList

from maru_connector.held_pins import LoadFailure, forget_held, index_failure, unpin_quietly
from maru_connector.log import get_logger

if TYPE_CHECKING:
    from maru_connector.transfer.engine import HeadStart

logger = get_logger(__name__)

# An offered pin no worker claimed for this long is released: its plan never
# reached a worker of this process (it cannot, short of a bug), and a pinned
# object cannot be evicted.
_UNCLAIMED_TTL_S = 60.0

class _Missed:
    """The type of ``MISSED``."""


#: An early pin's retrieve found a key missing: all-or-nothing, nothing is pinned.
MISSED = _Missed()

#: What an early pin's retrieve answers: the pinned locations, or ``MISSED``.
PinReply = Union[LocationList, _Missed]


class EarlyPin:
    """The objects one request's lookup pinned: ``object_keys`` (packed end to
    end) and the ``retrieve`` reply for them, pinned under ``client``'s lease.

    ``run`` schedules a call on the thread that pins with ``client`` (the
    lookup service's), so a release never waits for the index on the
    caller's thread.
    """

    def __init__(
        self, client: IndexApi, object_keys: bytes, run: Callable[[Callable[[], None]], Future[None]]
    ) -> None:
        self.client = client
        self.object_keys = object_keys
        self.created = time.monotonic()
        self._reply: Future[PinReply] | None = None
        self._run = run
        self._lock = threading.Lock()
        self._released = False
        self.head: HeadStart | None = None  # its load's head start (a TransferEngine's), if one was started

    def start(self, reply: Future[PinReply]) -> None:
        """The retrieve, queued on the owning thread: its result is the reply,
        or ``MISSED`` (nothing pinned); if it raises, nothing is pinned either."""
        self._reply = reply

    def reply(self, timeout_s: float) -> LocationList:
        """The retrieve's reply, once back.

        Raises:
            LoadFailure: the retrieve failed or is not back within
                ``timeout_s`` (the caller's own retrieve timeout), or an
                object had left the pool by the time it was pinned: what the
                caller's own retrieve would have raised.
        """
        assert self._reply is not None, "EarlyPin.start was not called"
        try:
            answer = self._reply.result(timeout=timeout_s)
        except FutureTimeout:
            raise LoadFailure("timeout", f"the lookup's pin of {len(self.object_keys) // KEY_BYTES} "
                              f"objects was not back within {timeout_s:.3f}s") from None
        except Exception as exc:
            raise index_failure(exc) from exc
        if isinstance(answer, _Missed):
            raise LoadFailure("miss", "an object left the pool between the lookup and its pin")
        return answer

    def attach_head(self, head: HeadStart | None) -> None:
        """Carry ``head`` (its load's head start) to the load; dropped at once
        when the pin was released meanwhile (its buffer would stay taken)."""
        if head is None:
            return
        with self._lock:
            if not self._released:
                self.head = head
                return
        head.drop()

    def reply_if_back(self) -> LocationList | None:
        """The retrieve's reply if it is back and pinned everything, else None
        (never waits)."""
        reply = self._reply
        if reply is None or not reply.done() or reply.cancelled() or reply.exception() is not None:
            return None
        answer = reply.result()
        return None if isinstance(answer, _Missed) else answer

    def release(self) -> None:
        """Unpin, on the owning thread, once the retrieve is back (at most once).

        A retrieve that failed pinned nothing: the index client gives back what
        a reply it rejects shows pinned, and the pinning thread what a reply
        with a miss might hide.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            head, self.head = self.head, None
        if head is not None:
            head.drop()  # a no-op once its load claimed it
        assert self._reply is not None, "EarlyPin.start was not called"
        self._reply.add_done_callback(self._unpin_if_pinned)

    @property
    def released(self) -> bool:
        return self._released

    def _unpin_if_pinned(self, reply: Future[PinReply]) -> None:
        if reply.cancelled() or reply.exception() is not None or reply.result() is MISSED:
            return  # nothing pinned

        def unpin() -> None:
            forget_held(self.client, self)
            unpin_quietly(self.client, self.object_keys)

        try:
            self._run(unpin)
        except RuntimeError:  # the pinning thread is gone: closing its client ended the lease
            pass


class PinHandoff:
    """Early pins on their way from one engine's scheduler half to its worker
    half in this process; one per engine (vLLM's ``engine_id``).

    The scheduler half pins early only while a worker half of the same engine
    is attached here, that is, lives in this process.
    """

    _by_engine: ClassVar[dict[str, "PinHandoff"]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offered: dict[int, EarlyPin] = {}
        self._tokens = itertools.count(1)
        self._workers = 0
        self._head_start: Callable[[EarlyPin, int], None] | None = None

    @classmethod
    def for_engine(cls, engine_id: str) -> "PinHandoff":
        with cls._registry_lock:
            handoff = cls._by_engine.get(engine_id)
            if handoff is None:
                handoff = cls._by_engine[engine_id] = cls()
            return handoff

    def attach_worker(self, head_start: Callable[[EarlyPin, int], None] | None = None) -> None:
        """``head_start(pin, num_chunks)``: the worker's way to start copying
        a pinned hit's first chunks' layers before its blocks are allocated."""
        with self._lock:
            self._workers += 1
            self._head_start = head_start

    def start_head(self, pin: EarlyPin, num_chunks: int) -> None:
        """Have the worker start copying the load ``pin`` is for (its first
        ``num_chunks`` chunks); the head start rides on the pin."""
        head_start = self._head_start
        if head_start is not None and self.worker_attached:
            head_start(pin, num_chunks)

    def detach_worker(self) -> None:
        """The worker half is closing: nothing it has not claimed will be."""
        with self._lock:
            self._workers = max(0, self._workers - 1)
            self._head_start = None
            dropped = list(self._offered.values()) if not self._workers else []
            if dropped:
                self._offered.clear()
        for pin in dropped:
            pin.release()

    @property
    def worker_attached(self) -> bool:
        return self._workers == 1  # two workers of one engine here: not a one-worker engine

    def offer(self, pin: EarlyPin) -> int:
        """Hand ``pin`` over; returns the token the load plan carries."""
        now = time.monotonic()
        with self._lock:
            stale = [t for t, p in self._offered.items() if now - p.created > _UNCLAIMED_TTL_S]
            lost = [self._offered.pop(t) for t in stale]
            token = next(self._tokens)
            self._offered[token] = pin
        for old in lost:
            logger.warning("an early pin was never claimed by a worker; released")
            old.release()
        return token

    def claim(self, token: int) -> EarlyPin | None:
        """The pin offered under ``token``, now the caller's to release."""
        with self._lock:
            return self._offered.pop(token, None)

    @property
    def num_offered(self) -> int:
        with self._lock:
            return len(self._offered)
