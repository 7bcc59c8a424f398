"""Stores: freshly computed chunks go from vLLM's KV cache into the pool.

A store job is one :class:`StoreSpec` (one request, one step): one batched
``reserve`` for all its objects, one ``submit_store`` of the copies into the
reserved slots, then — once the copy completed — the slot headers (each with
the checksum of its object's payload and the worker's layout fingerprint)
and one batched ``commit``. Any failure aborts the reservation and only
costs a future miss (counted by reason). With ``maru_async_store`` the jobs run on the
store thread and never block the forward; vLLM keeps a finished request's
blocks until :meth:`Storer.finished_requests` reports its jobs done, and a
preempted request's jobs are cancelled or finished before its blocks are
reused (:meth:`Storer.drain`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from maru_core.pool.slots import SlotFormat, SlotHeader
from maru_core.protocol import ErrorType
from maru_core.stats import ConnectorStats

from maru_connector.metadata import StoreSpec
from maru_connector.resolve import object_keys
from maru_connector.transfer import ChunkStore

logger = logging.getLogger(__name__)

_QUEUED, _RESERVING, _COPYING, _DONE, _CANCELLED = range(5)


@dataclass
class _StoreJob:
    spec: StoreSpec
    state: int = _QUEUED
    done: threading.Event = field(default_factory=threading.Event)


class _Cancelled(Exception):
    """The request was preempted before the copy started: skip, not a failure."""


class StoreFailure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _is_no_space(exc: BaseException) -> bool:
    """Whether a reserve failed for lack of room (``IndexRejected`` of type ``no_space``)."""
    return getattr(exc, "error_type", None) == ErrorType.NO_SPACE.value


class Storer:
    """Runs store jobs, inline (sync) or on its own thread (``async_store``)."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        pool: Any,
        engine: Any,
        tp_rank: int,
        stats: ConnectorStats,
        async_store: bool,
    ) -> None:
        self._client_factory = client_factory
        self._client: Any = None
        self._pool = pool
        self._engine = engine
        self._fmt = engine.fmt
        self._slot_fmt = SlotFormat.LAYERWISE if engine.fmt.layerwise else SlotFormat.CHUNKWISE
        self._tp_rank = tp_rank
        self._stats = stats
        self._async = async_store
        self._lock = threading.Lock()
        self._jobs: dict[str, list[_StoreJob]] = {}  # live jobs of live requests
        self._stored_reqs: set[str] = set()  # live requests that had a store job
        self._awaiting: set[str] = set()  # finished, waiting for their jobs
        self._inbox: queue.Queue[_StoreJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if async_store:
            self._thread = threading.Thread(target=self._serve, name="maru-storer", daemon=True)
            self._thread.start()

    def submit(self, spec: StoreSpec) -> None:
        job = _StoreJob(spec)
        with self._lock:
            self._jobs.setdefault(spec.req_id, []).append(job)
            self._stored_reqs.add(spec.req_id)
        if self._async:
            self._inbox.put(job)
        else:
            self._run(job)

    def drain(self, req_ids: Iterable[str]) -> None:
        """Cancel queued jobs of these requests and wait for their copies in progress."""
        waits = []
        with self._lock:
            for req_id in req_ids:
                for job in self._jobs.get(req_id, ()):
                    if job.state in (_QUEUED, _RESERVING):
                        job.state = _CANCELLED  # no block read yet: skip it
                    elif job.state == _COPYING:
                        waits.append(job.done)
        for event in waits:
            event.wait()

    def finished_requests(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Finished requests whose stores are all done (async mode: report them
        as ``finished_sending``); each id is reported once, then forgotten."""
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._stored_reqs:
                    self._stored_reqs.discard(req_id)
                    self._awaiting.add(req_id)
            ready = {r for r in self._awaiting if not self._jobs.get(r)}
            self._awaiting -= ready
            for req_id in ready:
                self._jobs.pop(req_id, None)
        return ready if self._async else set()

    @property
    def num_tracked(self) -> int:
        with self._lock:
            return len(self._jobs) + len(self._stored_reqs) + len(self._awaiting)

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=30)
        if self._client is not None:
            self._client.close()

    # ---- job execution ----------------------------------------------------

    def _serve(self) -> None:
        while (job := self._inbox.get()) is not None:
            self._run(job)

    def _run(self, job: _StoreJob) -> None:
        started = time.monotonic()
        reserved: list[bytes] = []
        try:
            if self._set_state(job, _QUEUED, _RESERVING):
                nbytes = self._store(job, reserved)
                if nbytes:
                    self._stats.record_store(nbytes, time.monotonic() - started)
        except _Cancelled:
            self._stats.record_store_failure("aborted")
            self._abort(reserved)
        except StoreFailure as exc:
            logger.warning("store for %s skipped (%s)", job.spec.req_id, exc)
            self._stats.record_store_failure(exc.reason)
            self._abort(reserved)
        except Exception:  # never let a store take the engine down
            logger.exception("store for %s failed", job.spec.req_id)
            self._stats.record_store_failure("other")
            self._abort(reserved)
        finally:
            with self._lock:
                job.state = _DONE
                jobs = self._jobs.get(job.spec.req_id)
                if jobs is not None:
                    jobs.remove(job)
                    if not jobs:
                        del self._jobs[job.spec.req_id]
            job.done.set()

    def _store(self, job: _StoreJob, reserved: list[bytes]) -> int:
        """Reserve, copy, write headers, commit; returns bytes stored."""
        keys = object_keys(self._fmt, job.spec.keys(self._tp_rank))
        slots = self._reserve(keys)
        chunks, chunk_keys = self._plan(job.spec, keys, slots)
        if not chunks:
            return 0
        reserved.extend(k for k, _ in chunk_keys)
        if not self._set_state(job, _RESERVING, _COPYING):
            raise _Cancelled()
        for _, slot in chunk_keys:  # an old header must never describe half-new data
            self._pool.invalidate_slot(slot.offset, self._fmt.object_bytes)
        handle = self._engine.submit_store(chunks)
        if not handle.wait():
            raise StoreFailure("copy_error", repr(handle.error))
        for key, slot in chunk_keys:
            # The checksum of the bytes as they lie in the pool, which is what readers check.
            checksum = self._pool.payload_checksum(slot.offset, self._fmt.object_bytes)
            header = SlotHeader(key, slot.generation, self._fmt.object_bytes, self._slot_fmt, checksum,
                                self._fmt.fingerprint)  # fmt: skip
            self._pool.write_slot_header(slot.offset, header)
        try:
            committed = self._client.commit([k for k, _ in chunk_keys])
        except Exception as exc:
            raise StoreFailure("commit_error", f"{type(exc).__name__}: {exc}") from exc
        reserved.clear()  # committed or released by the index: nothing to abort
        return handle.nbytes if any(committed) else 0

    def _reserve(self, keys: list[bytes]) -> list[Any]:
        try:
            if self._client is None:
                self._client = self._client_factory()
            slots = list(self._client.reserve([(k, self._fmt.object_bytes) for k in keys]))
        except Exception as exc:
            reason = "no_space" if _is_no_space(exc) else "index_error"
            raise StoreFailure(reason, f"{type(exc).__name__}: {exc}") from exc
        if len(slots) != len(keys):
            raise StoreFailure("index_error", f"{len(slots)} slots for {len(keys)} keys")
        return slots

    def _plan(
        self, spec: StoreSpec, keys: list[bytes], slots: list[Any]
    ) -> tuple[list[ChunkStore], list[tuple[bytes, Any]]]:
        """Copies for chunks whose every object got a slot; the rest is skipped
        (already stored or being stored by another engine)."""
        per = self._fmt.objects_per_chunk
        chunks: list[ChunkStore] = []
        to_commit: list[tuple[bytes, Any]] = []
        partial: list[bytes] = []
        for i, blocks in enumerate(spec.block_ids):
            chunk_slots = slots[i * per : (i + 1) * per]
            chunk_keys = keys[i * per : (i + 1) * per]
            if all(s is not None for s in chunk_slots):
                chunks.append(ChunkStore(tuple(blocks), tuple(s.offset for s in chunk_slots)))
                to_commit.extend(zip(chunk_keys, chunk_slots))
            else:
                partial.extend(k for k, s in zip(chunk_keys, chunk_slots) if s is not None)
        self._abort(partial)
        return chunks, to_commit

    def _abort(self, keys: list[bytes]) -> None:
        if not keys or self._client is None:
            return
        try:
            self._client.abort(keys)
        except Exception as exc:  # reservations also lapse with the lease
            logger.warning("abort of %d reservations failed (%s)", len(keys), exc)

    def _set_state(self, job: _StoreJob, expected: int, new: int) -> bool:
        with self._lock:
            if job.state != expected:
                return False
            job.state = new
            return True
