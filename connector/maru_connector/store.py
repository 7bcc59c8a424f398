"""Stores: freshly computed chunks go from vLLM's KV cache into the pool.

A store job is one :class:`StoreSpec` (one request, one step): one batched
``reserve`` for all its objects, one ``submit_store`` of the copies into the
reserved slots, then — once the copy completed — the slot headers (each with
the checksum of its object's payload and the worker's layout fingerprint),
pending: only the index marks a header committed, when it commits the key,
and only committed headers are restored after an index restart or read.
The job then waits for the scheduler's verdict on its step
(:meth:`Storer.apply_verdicts`): a step whose forward used a failed load on
any rank is never committed; the others are committed with one batched
``commit`` per step. Any failure aborts the reservation and only costs a
future miss (counted by reason). With ``maru_async_store`` the jobs run on the
store thread and never block the forward; vLLM keeps a finished request's
blocks until :meth:`Storer.finished_requests` reports that no job reads them
any more, and a
preempted request's jobs are cancelled or finished before its blocks are
reused (:meth:`Storer.drain`).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from maru_core.index.api import IndexApi, IndexRejected
from maru_core.keys import split_keys
from maru_core.pool.slots import SlotHeader
from maru_core.protocol import ErrorType
from maru_core.stats import ConnectorStats

from maru_connector.log import get_logger
from maru_connector.metadata import StoreSpec
from maru_connector.resolve import object_keys
from maru_connector.transfer import ChunkStore

logger = get_logger(__name__)

#: (scheduler step, request id, indices of the store's chunks this rank committed):
#: one per store job, once its outcome is final on the rank that reports it.
SettledStore = tuple[int, str, tuple[int, ...]]


class JobState(enum.Enum):
    """Where a store job is: its blocks are read while queued, reserving or
    copying; after that it waits for its step's verdict, then is done.
    A job cancelled before it read a block is skipped."""

    QUEUED = enum.auto()
    RESERVING = enum.auto()
    COPYING = enum.auto()
    AWAITING_VERDICT = enum.auto()
    DONE = enum.auto()
    CANCELLED = enum.auto()


_READING_BLOCKS = (JobState.QUEUED, JobState.RESERVING, JobState.COPYING)


@dataclass
class _StoreJob:
    spec: StoreSpec
    state: JobState = JobState.QUEUED
    done: threading.Event = field(default_factory=threading.Event)
    blocks_read: threading.Event = field(default_factory=threading.Event)  # no block read any more
    started: float = 0.0
    nbytes: int = 0
    to_commit: list[bytes] = field(default_factory=list)  # reserved keys, copied and headed
    planned: list[tuple[int, list[bytes]]] = field(default_factory=list)  # chunk index, its keys
    committed: tuple[int, ...] = ()  # indices of the chunks the index committed


class _Cancelled(Exception):
    """The request was preempted before the copy started: skip, not a failure."""


class StoreFailure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _reserve_failure(exc: BaseException) -> str:
    """The failure reason of a reserve the index refused or that broke."""
    if isinstance(exc, IndexRejected) and exc.error_type in (ErrorType.NO_SPACE, ErrorType.QUARANTINED):
        return exc.error_type.value  # a full pool, or an index that restarted and hands out no slot yet
    return "index_error"


class Storer:
    """Runs store jobs, inline (sync) or on its own thread (``async_store``)."""

    def __init__(
        self,
        client_factory: Callable[[], IndexApi],
        pool: Any,
        engine: Any,
        tp_rank: int,
        stats: ConnectorStats,
        async_store: bool,
        report_settled: bool = False,
    ) -> None:
        """``report_settled``: keep, for :meth:`take_settled`, each job's
        outcome once it is final (the KV events of ``kv_events.py``)."""
        self._client_factory = client_factory
        self._client: IndexApi | None = None
        self._pool = pool
        self._engine = engine
        self._fmt = engine.fmt
        self._slot_fmt = engine.fmt.strategy.slot_format
        self._tp_rank = tp_rank
        self._stats = stats
        self._async = async_store
        self._lock = threading.Lock()
        self._jobs: dict[str, list[_StoreJob]] = {}  # live jobs of live requests
        self._held: set[str] = set()  # finished requests vLLM keeps blocks for
        self._by_step: dict[int, list[_StoreJob]] = {}  # copied, awaiting their step's verdict
        self._inbox: queue.Queue[_StoreJob | dict[int, bool] | None] = queue.Queue()
        self._report_settled = report_settled
        self._aliases = True  # False once the index said it knows no put_aliases
        self._settled: list[SettledStore] = []  # since the last take_settled
        self._thread: threading.Thread | None = None
        if async_store:
            self._thread = threading.Thread(target=self._serve, name="maru-storer", daemon=True)
            self._thread.start()

    def submit(self, spec: StoreSpec) -> None:
        job = _StoreJob(spec)
        with self._lock:
            self._jobs.setdefault(spec.req_id, []).append(job)
        if self._async:
            self._inbox.put(job)
        else:
            self._run(job)

    def apply_verdicts(self, verdicts: dict[int, bool]) -> None:
        """The scheduler's verdicts (step -> commit?) on stores already submitted.

        Queued behind the jobs of those steps, so every job is copied before
        its verdict is applied.
        """
        if self._async:
            self._inbox.put(dict(verdicts))
        else:
            self._apply(verdicts)

    def drain(self, req_ids: Iterable[str]) -> None:
        """Cancel queued jobs of these requests and wait for their copies in progress."""
        waits = []
        with self._lock:
            for req_id in req_ids:
                for job in self._jobs.get(req_id, ()):
                    if job.state in (JobState.QUEUED, JobState.RESERVING):
                        job.state = JobState.CANCELLED  # no block read yet: skip it
                    elif job.state == JobState.COPYING:
                        waits.append(job.blocks_read)
        for event in waits:
            event.wait()

    def drain_all(self) -> None:
        """:meth:`drain` every live request: no job reads a block afterwards."""
        with self._lock:
            live = list(self._jobs)
        self.drain(live)

    def finished_requests(self, held_req_ids: Iterable[str]) -> set[str]:
        """Held requests (finished; vLLM keeps their blocks for us) whose store
        jobs no longer read their blocks: report them as ``finished_sending``.

        Only requests the scheduler half said are held are ever reported: vLLM
        frees the blocks of every id it gets here.
        """
        with self._lock:
            self._held.update(held_req_ids)
            ready = {
                r for r in self._held
                if not any(job.state in _READING_BLOCKS for job in self._jobs.get(r, ()))
            }
            self._held -= ready
        return ready

    def take_settled(self) -> list[SettledStore]:
        """The jobs settled since the last call: (step, request, chunks committed)."""
        with self._lock:
            settled, self._settled = self._settled, []
        return settled

    def settle_unrun(self, specs: Iterable[StoreSpec]) -> None:
        """Stores that were never submitted (sleep mode) settle with nothing committed."""
        if self._report_settled:
            with self._lock:
                self._settled.extend((spec.step, spec.req_id, ()) for spec in specs)

    @property
    def num_tracked(self) -> int:
        with self._lock:
            jobs = len(self._jobs) + sum(len(j) for j in self._by_step.values())
            return jobs + len(self._held)

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=30)
        with self._lock:  # no verdict will come for these any more
            awaiting, self._by_step = self._by_step, {}
        self._abort([k for jobs in awaiting.values() for job in jobs for k in job.to_commit])
        if self._client is not None:
            self._client.close()

    # ---- job execution ----------------------------------------------------

    def _serve(self) -> None:
        while (item := self._inbox.get()) is not None:
            if isinstance(item, dict):
                self._apply(item)
            else:
                self._run(item)

    def _run(self, job: _StoreJob) -> None:
        """Reserve and copy one job; it then waits for its step's verdict."""
        job.started = time.monotonic()
        reserved: list[bytes] = []
        try:
            if self._set_state(job, JobState.QUEUED, JobState.RESERVING):
                self._copy(job, reserved)
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
        job.blocks_read.set()
        if job.to_commit and self._set_state(job, JobState.COPYING, JobState.AWAITING_VERDICT):
            with self._lock:
                self._by_step.setdefault(job.spec.step, []).append(job)
        else:
            self._finish(job)

    def _copy(self, job: _StoreJob, reserved: list[bytes]) -> None:
        """Reserve, copy and write the slot headers; the keys wait in ``job.to_commit``."""
        keys = object_keys(self._fmt, job.spec.keys(self._tp_rank))
        slots = self._reserve(keys)
        chunks, chunk_keys = self._plan(job.spec, keys, slots, job.planned)
        if not chunks:
            return
        reserved.extend(k for k, _ in chunk_keys)
        if not self._set_state(job, JobState.RESERVING, JobState.COPYING):
            raise _Cancelled()
        for _, slot in chunk_keys:  # an old header must never describe half-new data
            self._pool.invalidate_slot(slot.offset, self._fmt.object_bytes)
        handle = self._engine.submit_store(chunks)
        if not handle.wait():
            raise StoreFailure("copy_error", repr(handle.error))
        # The engine's checksums of the bytes it copied out (on CUDA summed on
        # the device over its staging), else over the bytes in the pool.
        checksums = handle.checksums
        if checksums is None:
            checksums = self._pool.payload_checksums([slot.offset for _, slot in chunk_keys], self._fmt.object_bytes)
        for (key, slot), checksum in zip(chunk_keys, checksums):
            header = SlotHeader(key, slot.generation, self._fmt.object_bytes, self._slot_fmt, checksum,
                                self._fmt.fingerprint)  # fmt: skip
            self._pool.write_slot_header(slot.offset, header)
        job.nbytes = handle.nbytes
        job.to_commit = list(reserved)

    def _apply(self, verdicts: dict[int, bool]) -> None:
        """Commit (one batch per step) or abort the jobs awaiting these verdicts."""
        for step in sorted(verdicts):
            with self._lock:
                jobs = self._by_step.pop(step, [])
            if not jobs:
                continue
            keys = [k for job in jobs for k in job.to_commit]
            if not verdicts[step]:
                for _ in jobs:
                    self._stats.record_store_failure("load_failed")
                self._abort(keys)
            else:
                self._commit(jobs, keys)
            for job in jobs:
                self._finish(job)

    def _commit(self, jobs: list[_StoreJob], keys: list[bytes]) -> None:
        try:
            assert self._client is not None, "keys were reserved, so the client exists"
            committed = list(self._client.commit(keys))
        except Exception as exc:  # the reservations lapse with the lease
            logger.warning("commit of %d objects failed (%s)", len(keys), exc)
            for _ in jobs:
                self._stats.record_store_failure("commit_error")
            return
        done = dict(zip(keys, committed))
        refused = sum(not ok for ok in committed)
        if refused:
            # Our reservation held each key, so a refusal means it lapsed
            # (reservation_ttl_s: the verdict came too late) or a header did not
            # name its key: a lost store, never a silent one.
            logger.warning("the index refused %d of %d committed objects; they are not stored",
                           refused, len(keys))
        for job in jobs:
            job.committed = tuple(i for i, chunk in job.planned if all(done.get(k) for k in chunk))
            if any(done.get(k) for k in job.to_commit):
                self._stats.record_store(job.nbytes, time.monotonic() - job.started)
            else:
                self._stats.record_store_failure("commit_error")
        self._put_aliases(jobs)

    def _put_aliases(self, jobs: list[_StoreJob]) -> None:
        """Register the block aliases of the chunks just committed. Best effort:
        an alias not registered costs only a hit shorter by part of a chunk."""
        pairs = []
        for job in jobs:
            aliases, chunk_keys = job.spec.aliases(self._tp_rank), job.spec.keys(self._tp_rank)
            if aliases:
                pairs += [(alias, chunk_keys[i]) for i in job.committed for alias in split_keys(aliases[i])]
        if not pairs or not self._aliases:
            return
        try:
            assert self._client is not None, "keys were committed, so the client exists"
            self._client.put_aliases(pairs)
        except Exception as exc:
            if isinstance(exc, IndexRejected) and exc.error_type is ErrorType.UNKNOWN_OP:
                logger.info("the index has no put_aliases (an older version); no block aliases are registered")
                self._aliases = False
            else:
                logger.warning("%d block aliases not registered (%s)", len(pairs), exc)

    def _finish(self, job: _StoreJob) -> None:
        job.blocks_read.set()
        with self._lock:
            if self._report_settled:
                self._settled.append((job.spec.step, job.spec.req_id, job.committed))
            job.state = JobState.DONE
            jobs = self._jobs.get(job.spec.req_id)
            if jobs is not None and job in jobs:
                jobs.remove(job)
                if not jobs:
                    del self._jobs[job.spec.req_id]
        job.done.set()

    def _reserve(self, keys: list[bytes]) -> list[Any]:
        try:
            if self._client is None:
                self._client = self._client_factory()
            slots = list(self._client.reserve([(k, self._fmt.object_bytes) for k in keys]))
        except Exception as exc:
            raise StoreFailure(_reserve_failure(exc), f"{type(exc).__name__}: {exc}") from exc
        if len(slots) != len(keys):
            raise StoreFailure("index_error", f"{len(slots)} slots for {len(keys)} keys")
        return slots

    def _plan(
        self, spec: StoreSpec, keys: list[bytes], slots: list[Any], planned: list[tuple[int, list[bytes]]]
    ) -> tuple[list[ChunkStore], list[tuple[bytes, Any]]]:
        """Copies for chunks whose every object got a slot; the rest is skipped
        (already stored or being stored by another engine). ``planned`` gets
        the index and keys of each chunk copied."""
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
                planned.append((i, chunk_keys))
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

    def _set_state(self, job: _StoreJob, expected: JobState, new: JobState) -> bool:
        with self._lock:
            if job.state != expected:
                return False
            job.state = new
            return True
