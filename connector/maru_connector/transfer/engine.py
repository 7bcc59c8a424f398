"""The transfer engine: one per worker, moving KV bytes between the pool and
vLLM's paged KV cache, per layer and in true layer order.

Loads from every request share one queue (one copy thread on the CPU, one
load stream on CUDA) and run in submission order; stores share another. A
backend may issue a load on the submitting thread instead, when nothing is
queued before it (CUDA: small loads, whose copies it only queues). The
connector calls the same interface whatever the device.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable
from typing import ClassVar, Sequence

import torch

from maru_core.storage_format import StorageFormat

from ..kv_layout import KVCacheLayout, detect_kv_layout
from ..object_format import ObjectFormat
from .backend import HeadStart, LoadJob, StoreJob, TransferBackend, TransferJob
from .checks import PayloadCheck, checkable
from .handles import LoadHandle, StoreHandle, TransferError
from .plan import SKIP_BLOCK, ChunkLoad, ChunkStore, Run, TransferRequestError, check_chunks, layer_runs

__all__ = ["HeadStart", "TransferEngine"]

_STOP = object()


class TransferEngine(abc.ABC):
    """Copies chunks between the pool and the KV cache; see the module doc.

    Build one with ``factory.create_engine``. A backend subclasses it: it
    implements ``_run_load`` and ``_run_store`` (one job, on the copy
    thread) and may override the hooks below (``_prepare``, ``_issue_here``,
    ``_claim_head``, ``_copy_thread_started``, ``_release``).
    """

    backend: ClassVar[TransferBackend]

    def __init__(self, pool_buffer: memoryview, kv_caches: dict[str, torch.Tensor],
                 fmt: ObjectFormat) -> None:
        if pool_buffer.readonly:
            raise ValueError("the pool buffer is read-only; map the pool writable")
        self.fmt = fmt
        self.layout: KVCacheLayout = fmt.layout
        self.pool_size = pool_buffer.nbytes
        self._pool_buffer = pool_buffer
        self.pool = torch.frombuffer(pool_buffer, dtype=torch.uint8)
        self.kv_caches = [kv_caches[name] for name in self.layout.layer_names]
        self.block_views = [self.layout.block_view(t) for t in self.kv_caches]
        self._closed = False
        self._submit_lock = threading.Lock()
        self._load_queue: queue.Queue[LoadJob | object] = queue.Queue()
        self._loads_queued = 0  # queued or running on the copy thread
        self._store_queue: queue.Queue[StoreJob | object] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._serve, args=(self._load_queue, self._run_load),
                             name="maru-load", daemon=True),
            threading.Thread(target=self._serve, args=(self._store_queue, self._run_store),
                             name="maru-store", daemon=True),
        ]

    def _start(self) -> None:
        for thread in self._threads:
            thread.start()

    @staticmethod
    def detect(kv_caches: dict[str, torch.Tensor], chunk_tokens: int, storage: StorageFormat | bool,
               block_size: int | None = None) -> ObjectFormat:
        """Shortcut: the object format for these KV caches (``storage``: the
        storage format, or a layerwise flag)."""
        return ObjectFormat(detect_kv_layout(kv_caches, block_size), chunk_tokens, storage)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- submit
    def start_head(self, sources: Sequence[tuple[int, ...]]) -> HeadStart | None:
        """Start copying the first layers of a load of ``sources`` (its
        chunks' pool offsets, as its ``ChunkLoad``s will carry them) before
        its blocks are allocated; ``None`` when the backend does not or
        cannot now. Only ever pinned objects: the copies read the pool.

        The load that follows passes the result to ``submit_load`` (used only
        if it loads exactly these sources); anything else ``drop``s it.
        """
        return None

    def submit_load(self, chunks: Sequence[ChunkLoad], beside_long_forward: bool = False,
                    head: HeadStart | None = None, check: PayloadCheck | None = None) -> LoadHandle:
        """Queue copies pool -> KV cache for ``chunks``; returns at once.

        On CUDA the writes into the blocks are ordered after the work queued
        so far on the caller's current stream. ``beside_long_forward``: the
        caller goes on to a forward that computes much beside this load (a
        partial hit), so it should be held up only by the load's first
        copies (see ``CudaTransferEngine``).

        Raises ``TransferRequestError`` when a chunk does not fit the format
        (wrong number of block ids or offsets, block id out of range). The
        first chunk's leading block ids and the last chunk's trailing ones
        may be ``plan.SKIP_BLOCK``: those blocks are verified with their
        objects but not written.
        Problems found while copying (e.g. an offset outside the pool) end
        in ``handle.error`` instead. ``head``: this load's ``start_head``,
        whose copies it then reuses when the sources match (else dropped).
        ``check``: verify the bytes received against these checksums, one
        per object (``checks.py`` says when each is due); a mismatch fails
        the load with ``ChecksumMismatch``.
        """
        try:
            blocks = check_chunks(self.fmt, chunks, "load", skip_ends=True)
            if check is not None:
                self._check_request(check, len(chunks))
        except BaseException:
            if head is not None:
                head.drop()
            raise
        written = sum(b != SKIP_BLOCK for b in blocks)
        nbytes = written * self.layout.block_bytes_per_layer * self.layout.num_layers
        handle = LoadHandle(self.layout.num_layers if chunks else 0, nbytes)
        if chunks:
            job = TransferJob(handle, blocks, [c[1] for c in chunks], beside_long_forward,
                              check=check if check is not None and check.verify.any() else None)
            job.head = self._claim_head(head, job) if head is not None else None
            handle.head_start = job.head is not None
            self._prepare(job)
            if not self._issue_here(job):
                self._enqueue(self._load_queue, job)
        elif head is not None:
            head.drop()
        return handle

    def _check_request(self, check: PayloadCheck, num_chunks: int) -> None:
        objects = num_chunks * self.fmt.objects_per_chunk
        if len(check) != objects:
            raise TransferRequestError(f"{len(check)} checksums for a load of {objects} objects")
        if not checkable(self.fmt):
            raise TransferRequestError(
                f"layout {self.layout.kind} has segments of {self.layout.segment_bytes} bytes: payload "
                "checksums need whole 32-bit words; set maru_verify_payload: false for this model")

    def _claim_head(self, head: HeadStart, job: LoadJob) -> HeadStart | None:
        """Backend hook: ``head`` for ``job``, or None (and dropped)."""
        head.drop()
        return None

    def _issue_here(self, job: LoadJob) -> bool:
        """Backend hook: run ``job`` on the submitting thread instead of the
        copy thread; True when it did (its failures end in its handle)."""
        return False

    def submit_store(self, chunks: Sequence[ChunkStore]) -> StoreHandle:
        """Queue copies KV cache -> pool for ``chunks``; returns at once.

        On CUDA the store is ordered after all work queued so far on the
        caller's current stream (the forward that wrote the KV). Once done,
        ``handle.checksums`` holds each object's checksum, computed over the
        bytes the engine copied out (where the layout allows, ``checkable``).
        """
        blocks = check_chunks(self.fmt, chunks, "store")
        nbytes = len(blocks) * self.layout.block_bytes_per_layer * self.layout.num_layers
        handle = StoreHandle(nbytes)
        if chunks:
            store = TransferJob(handle, blocks, [c[1] for c in chunks])
            self._prepare(store)
            self._enqueue(self._store_queue, store)
        return handle

    def _prepare(self, job: LoadJob | StoreJob) -> None:
        """Hook run on the caller's thread at submit (CUDA records an event
        on the caller's current stream that the copies wait for)."""

    def _enqueue(self, q: "queue.Queue[LoadJob | object] | queue.Queue[StoreJob | object]",
                 job: LoadJob | StoreJob) -> None:
        with self._submit_lock:  # nothing may queue behind the stop marker
            if self._closed:
                raise TransferError("the transfer engine is closed")
            if q is self._load_queue:
                self._loads_queued += 1
            q.put(job)

    # ------------------------------------------------------------ copy thread
    def _serve(self, q: "queue.Queue[LoadJob | object] | queue.Queue[StoreJob | object]",
               run: Callable[..., None]) -> None:
        self._copy_thread_started(loads=q is self._load_queue)
        while True:
            job = q.get()
            if job is _STOP:
                return
            assert isinstance(job, TransferJob)
            try:
                run(job)
            except BaseException as exc:  # every waiter must be released
                self._fail(job, exc)
            finally:
                if q is self._load_queue:
                    with self._submit_lock:
                        self._loads_queued -= 1

    def _copy_thread_started(self, loads: bool) -> None:
        """Runs first on each copy thread, the load thread's with ``loads``
        (CPU: pins it to its cores, and sets the load thread's priority)."""

    @staticmethod
    def _fail(job: LoadJob | StoreJob, exc: BaseException) -> None:
        if isinstance(job.handle, LoadHandle):
            job.handle._fail(exc)
        else:
            job.handle._finish(exc)

    def _runs(self, job: LoadJob | StoreJob, layer: int) -> list[Run]:
        runs = layer_runs(self.fmt, job.offsets, layer)
        row = self.fmt.layer_bytes
        for run in runs:
            if run.offset < 0 or run.end(row) > self.pool_size:
                raise TransferError(
                    f"layer {layer}: pool extent [{run.offset}, {run.end(row)}) is "
                    f"outside the {self.pool_size}-byte pool"
                )
        return runs

    @abc.abstractmethod
    def _run_load(self, job: LoadJob) -> None:
        """Copy a load job's layers, pool -> KV cache, completing each layer's event."""

    @abc.abstractmethod
    def _run_store(self, job: StoreJob) -> None:
        """Copy a store job's chunks, KV cache -> pool, then finish its handle."""

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish queued copies, stop the copy threads, release the pool."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            for q in (self._load_queue, self._store_queue):
                q.put(_STOP)
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        self._release()
        # Drop every view of the mapping so the pool can be unmapped.
        self.pool = None  # type: ignore[assignment]  # closed: nothing reads the pool after this
        self.block_views = []

    def _release(self) -> None:
        """Backend hook: undo what the constructor set up."""

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
