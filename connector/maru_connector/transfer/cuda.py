"""CUDA backend: the pool mapping registered once with ``cudaHostRegister``;
loads copy runs of contiguous (or evenly strided) pool bytes into a device
staging buffer on the one load stream, then scatter them into the paged
blocks with ``index_copy_`` on a scatter stream, so the scatter of one fill
overlaps the copies of the next (the staging buffer is a ring: a fill's
copies wait only for the scatters of the earlier fills whose bytes they
reuse). Stores gather blocks with ``index_select`` into staging and copy
them out on the store stream. Copying straight into paged blocks piece by piece is about 18x
slower than this on an H200.

Load and scatter streams run at high priority: a scatter queued while the
forward's kernels fill the GPU must not wait behind them, or the load stream
stalls on a staging buffer that is not yet free. Stores stay at the default
(lowest) priority so they take nothing from the forward. The copy thread's
work per layer is kept to a few raw runtime calls, and layers under 8 MiB
go in groups (1, 2, 4, ... layers: one copy where their extents sit side by
side in the pool, one scatter into all of them through their common stride,
one event): for a small hit (a few MiB per layer) the copy thread, not PCIe,
would otherwise set the pace.

A verified load (``check``) sums each fill in staging on the scatter stream,
right before its scatter (fills of single layers side by side in batches,
one launch each: ``_joins``), and, in the same kernel launch, compares the
objects due once the fill completes its layers into a pinned host flag
(``device_checksum.py``); the layers carry that check, which every wait
reads first. A store sums its staging the same way before copying it out."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import cast

import numpy as np
import torch

from . import device_checksum
from .checks import checkable
from .cudart import D2H, H2D, find_memcpy, find_memcpy2d, register_host, unregister_host
from ..object_format import ObjectFormat
from .backend import HeadStart, LoadJob, StoreJob, TransferBackend
from .engine import TransferEngine
from .handles import LoadHandle, TransferError
from .plan import Run, layer_pieces, skipped_head, skipped_tail

__all__ = ["CudaTransferEngine"]


DEFAULT_STAGING_BYTES = 64 << 20  # the largest fill; >= 64 MiB copies reach peak
STAGING_FILLS = 2  # the ring holds this many of the largest fills
HIGH_PRIORITY = -1  # above the default 0 (lower numbers are served first)
# Layers smaller than this load in groups: below it a copy's fixed cost and
# the copy thread's calls per layer show (on an H200 a 4 MiB strided copy
# ran at 0.94 of the pinned peak, a 64 MiB one at 1.0).
GROUP_BELOW_BYTES = 8 << 20
# A verified load sums fills of single layers side by side in staging in one
# launch (``_joins``): each launch is host time on the thread that issues
# the load, 32 of them for a 4k-token hit of 16 MiB layers (a benchmark
# turns this off to measure a launch per fill).
SUM_BATCHES = True
# Such a batch is scattered as one group of its layers (one index copy through
# their common stride, where the layers are evenly spaced), not a copy per
# fill: each scatter is 50-65 us of host time, and a full hit's issue on the
# engine thread comes before its forward starts: a verified 4k-token hit's
# cost fell from +4.4-6.2 % to +1.6-2.6 % (bench/RESULTS.md, round 10). Not
# for a load beside a long forward (a partial hit), which the forward
# overtakes only at its first layers: there it cost 1.6-1.7 % more. (False:
# a scatter per fill always, as before, for the A/B.)
SCATTER_BATCHES = True
# A fill joins the fills waiting for their scatter once the copies of this
# many later fills are queued (head-start fills count as queued before all);
# a batch is scattered when the fill after it joins, so the host's calls for
# it (one scatter per fill; for a verified load's batch, its sum too) run
# while the copy engine has the copies of 1 + COPIES_AHEAD fills to do. With
# none ahead, a verified 4k-token hit's copy engine sat idle 0.9 ms after its
# first fill while the host set up its checks, summed and scattered the four
# head-start fills (bench/RESULTS.md, round 9): about 1 ms of host time under
# the profiler, the copies of three 16 MiB fills. The staging ring (two
# 64 MiB fills) bounds it: a fill that needs a span still waiting for its
# scatter has every fill before it scattered first.
COPIES_AHEAD = 2
# Loads up to this size are issued on the submitting thread when nothing is
# queued before them. Issuing is host work only (the copies are queued, not
# waited for): on the copy thread it shares the interpreter lock with the
# forward it overlaps, which is host-bound for a small batch, and a 4k-token
# hit's forward ended 2-4 ms after its last layer landed (bench/RESULTS.md).
# A larger load's first fills are issued there too, the rest on the copy
# thread: the copy engine starts at once (the copy thread took 0.5-0.7 ms to
# pick a load up beside a busy forward), and a long prefill's compute is held
# up only by those few calls.
INLINE_LOAD_BYTES = 512 << 20
INLINE_HEAD_FILLS = 2  # two fills keep the copy engine busy >= 2 ms for a 16k-token hit
# A load submitted beside a long forward (a partial hit) has only its head
# issued inline, whatever its size: issuing a 4k-token hit's 32 layers took
# 2.0-2.6 ms, all of it before that forward's first kernel (False: the
# engine before, for `bench/h200_ab.sh head`).
HEAD_ONLY_BESIDE_LONG_FORWARD = True
# Only the head inline for every load, a full hit's too (an experiment:
# `bench/h200_ab.sh fullhead`; off as shipped).
HEAD_ONLY_ALWAYS = False
# A head start (``start_head``) copies at most this much of a load before
# vLLM has allocated its blocks: about 1.2 ms of copies at the PCIe peak,
# more than the 0.7-1.4 ms from a lookup's answer to its load's submit on an
# H200 host (bench/RESULTS.md).
HEAD_START_BYTES = 64 << 20


class _StagingRing:
    """Device staging for loads, handed out as spans in ring order.

    A fill takes the next span of its size (wrapping to the start at the
    end of the buffer, and at each new load, so a load's spans repeat and
    their views can be kept). The load stream waits for the scatters of the
    earlier fills that span reuses; a span still held by a fill whose scatter
    is not queued yet cannot be taken (``take`` returns None: queue that
    scatter first). Two fixed halves made a small load's third fill wait for
    its first fill's scatter, which leaves the copy engine idle for a while
    at the start of every small hit.
    """

    def __init__(self, nbytes: int, device) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._head = 0
        # spans in the order taken: [start, end, freed event or None (scatter not queued)]
        self._held: list[list] = []

    def restart(self) -> None:
        """A new load starts at the beginning. Spans of a load that failed
        before queueing their scatters are dropped: nothing will read them,
        and the load stream orders the next copies into them after the
        copies still in flight."""
        self._head = 0
        self._held = [span for span in self._held if span[2] is not None]

    def take(self, nbytes: int, stream: torch.cuda.Stream) -> int | None:
        start = 0 if self._head + nbytes > self.nbytes else self._head
        end = start + nbytes
        overlapping = [span for span in self._held if span[0] < end and start < span[1]]
        if any(span[2] is None for span in overlapping):
            return None
        for span in overlapping:
            stream.wait_event(span[2])
            self._held.remove(span)
        self._held.append([start, end, None])
        self._head = end
        return start

    def freed(self, start: int, event: torch.cuda.Event) -> None:
        for span in self._held:
            if span[0] == start and span[2] is None:
                span[2] = event
                return
        raise AssertionError(f"no staging span held at {start}")


class _CudaHeadStart(HeadStart):
    """Fills copied into the engine's one head buffer ahead of their load.

    States: started (the engine's head owner), claimed by the load of the
    same sources (the load releases the buffer once it queued their
    scatters), or dropped (the buffer is free; copies into it by a later
    head start are queued behind these on the same stream).
    """

    def __init__(self, engine: "CudaTransferEngine", sources: list[tuple[int, ...]], fills: list) -> None:
        self._engine = engine
        self.sources = sources
        self.fills = fills  # [(unit, copied)] in the order the load's units come
        self.state = "started"

    def claim(self, sources: list[tuple[int, ...]]) -> "HeadStart | None":
        with self._engine._head_lock:
            if self.state == "started" and sources == self.sources:
                self.state = "claimed"
                return self
        self.drop()
        return None

    def drop(self) -> None:
        with self._engine._head_lock:
            if self.state != "started":
                return
            self.state = "dropped"
            if self._engine._head_owner is self:
                self._engine._head_owner = None


class _IdsRing:
    """Two pinned host buffers used in turn and one device buffer of block ids."""

    def __init__(self, capacity: int, device) -> None:
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.next = 0
        self.device = torch.empty(capacity, dtype=torch.int64, device=device)


def _widest_element(views: list[torch.Tensor], layer_stride: int | None) -> torch.dtype:
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if layer_stride and layer_stride % size:
            continue
        try:
            for v in views:
                v.view(dtype)
        except RuntimeError:
            continue
        return dtype
    return torch.uint8


def _evenly_spaced(views: list[torch.Tensor], stride: int | None) -> bool:
    if not stride or stride <= 0 or len(views) < 2:
        return False
    first = views[0]
    return all(
        v.data_ptr() - first.data_ptr() == i * stride and v.stride() == first.stride()
        and v.shape == first.shape and v.untyped_storage().data_ptr()
        == first.untyped_storage().data_ptr()
        for i, v in enumerate(views)
    )


def staging_sizes(fmt, staging_bytes: int = DEFAULT_STAGING_BYTES,
                  head_start_bytes: int = HEAD_START_BYTES) -> tuple[int, int, int]:
    """Bytes of the load staging ring, the store staging and the head buffer
    for objects of ``fmt``: whole layer rows of at most ``staging_bytes`` per
    fill, the ring holding ``STAGING_FILLS`` fills."""
    row = fmt.layer_bytes
    rows = max(1, staging_bytes // row)
    return STAGING_FILLS * rows * row, rows * row, head_start_bytes


class CudaTransferEngine(TransferEngine):
    backend = TransferBackend.CUDA

    def __init__(self, pool_buffer: memoryview, kv_caches: dict[str, torch.Tensor], fmt: ObjectFormat,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 copy_2d: bool = True, timing: bool = False,
                 load_priority: int = HIGH_PRIORITY,
                 inline_load_bytes: int = INLINE_LOAD_BYTES,
                 inline_head_fills: int = INLINE_HEAD_FILLS,
                 head_start_bytes: int | None = None) -> None:
        super().__init__(pool_buffer, kv_caches, fmt)
        self.device = self.kv_caches[0].device
        self._pool_ptr = self.pool.data_ptr()
        with torch.cuda.device(self.device):
            # Registered already (another engine in this process): leave it
            # to its owner. is_pinned() asks the driver and clears its error.
            self._registered = (not self.pool.is_pinned()
                                and register_host(self._pool_ptr, self.pool_size))
            try:
                try:
                    self._setup(fmt, staging_bytes, copy_2d, load_priority)
                except torch.cuda.OutOfMemoryError as exc:
                    ring, store, head = staging_sizes(fmt, staging_bytes)
                    raise RuntimeError(
                        f"MaruCache needs {(ring + store + head) >> 20} MiB of GPU memory beside vLLM's "
                        "KV cache (staging for its copies) and the device has too little left: lower "
                        "vLLM's gpu_memory_utilization (docs/connector.md, 'GPU memory')") from exc
                if checkable(fmt):  # compile the checksum kernel now, not in the first hit
                    device_checksum.warm_up(self.device, fmt.layerwise)
            except BaseException:
                self._release()
                raise
        self._timing = timing
        self._inline_load_bytes = inline_load_bytes
        self._inline_head_fills = inline_head_fills
        self._issue_lock = threading.Lock()  # one load issued at a time: ring, ids, order
        self._head_start_bytes = HEAD_START_BYTES if head_start_bytes is None else head_start_bytes
        self._head_lock = threading.Lock()
        self._head_buffer: torch.Tensor | None = None  # allocated at the first head start
        self._head_owner: _CudaHeadStart | None = None  # started or claimed, buffer not yet free
        self._head_freed: torch.cuda.Event | None = None  # the last scatter that read the buffer
        self.heads_used = 0  # loads that reused a head start's copies
        self.last_issue_s = 0.0  # host time spent queueing the last load's copies
        self._compare_counter: torch.Tensor | None = None  # see _ticket_counter

    def _setup(self, fmt, staging_bytes: int, copy_2d: bool, load_priority: int) -> None:
        self.load_stream = torch.cuda.Stream(self.device, priority=load_priority)
        self.scatter_stream = torch.cuda.Stream(self.device, priority=load_priority)
        self.store_stream = torch.cuda.Stream(self.device)
        self.copy_2d_backend, self._memcpy2d = find_memcpy2d() if copy_2d else ("rows", None)
        self._memcpy = find_memcpy()
        row = fmt.layer_bytes
        self._rows_cap = max(1, staging_bytes // row)
        ring, store, _ = staging_sizes(fmt, staging_bytes, 0)
        self._staging = _StagingRing(ring, self.device)
        # Taken now, beside the KV cache vLLM sized before: an allocation
        # that does not fit fails at start-up, not at the first store.
        self._store_staging = torch.empty(store, dtype=torch.uint8, device=self.device)
        self._views: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._ids = {s.cuda_stream: _IdsRing(self.layout.num_blocks, self.device)
                     for s in (self.scatter_stream, self.store_stream)}
        # Scatters and gathers move 8-byte elements where the layout allows:
        # torch's index kernels are several times slower on single bytes,
        # and a slow scatter takes the GPU from the forward it overlaps.
        self._elem = _widest_element(self.block_views, self.layout.layer_stride_bytes)
        self._wide_views = [v.view(self._elem) for v in self.block_views]
        # Layers evenly spaced in one buffer (vLLM allocates them so) can be
        # scattered together; None: one layer at a time.
        self._stacked: dict[tuple[int, int], torch.Tensor] | None = (
            {} if _evenly_spaced(self.block_views, self.layout.layer_stride_bytes) else None)

    def device_bytes(self, with_head_start: bool = True) -> int:
        """Device memory this engine takes beside vLLM's KV cache: the load
        staging ring, the store staging, the block-id buffers and (once a
        head start ran, or ``with_head_start``) the head buffer."""
        held = self._staging.buffer.nbytes + self._store_staging.nbytes
        held += sum(ids.device.nbytes for ids in self._ids.values())
        if self._head_buffer is not None or with_head_start:
            held += self._head_start_bytes
        return held

    # ---------------------------------------------------------------- helpers
    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self._timing)

    def _prepare(self, job: LoadJob | StoreJob) -> None:
        job.ready = ready = self._event()
        ready.record(torch.cuda.current_stream(self.device))
        if self._timing and isinstance(job.handle, LoadHandle):
            job.handle._device_start = ready

    def _device_ids(self, job: LoadJob | StoreJob, stream: torch.cuda.Stream) -> torch.Tensor:
        """The job's block ids on the device, copied on ``stream`` (the one
        that reads them), through pinned buffers kept for the engine: a
        fresh pinned allocation costs a small load a good part of its time."""
        ring = self._ids[stream.cuda_stream]
        n = len(job.block_ids)
        if n > ring.capacity:
            host = torch.tensor(job.block_ids, dtype=torch.int64).pin_memory()
            job.host_ids = host  # alive until the copy below has run
            with torch.cuda.stream(stream):
                return host.to(self.device, non_blocking=True)
        slot = ring.next
        ring.next ^= 1
        last_copy = ring.copied[slot]
        if last_copy is not None:
            last_copy.synchronize()  # the copy from this buffer two jobs ago
        host = ring.host[slot][:n]
        host.numpy()[:] = job.block_ids
        # One device buffer per stream: the next job's ids are written after
        # this job's scatters, which are queued on the same stream before.
        dev = ring.device[:n]
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        ring.copied[slot] = copied = self._event()
        copied.record(stream)
        return dev

    def _check(self, pieces: list[list[Run]], layer: int) -> None:
        row = self.fmt.layer_bytes
        for piece in pieces:
            for run in piece:
                if run.offset < 0 or run.end(row) > self.pool_size:
                    raise TransferError(
                        f"layer {layer}: pool extent [{run.offset}, {run.end(row)}) is "
                        f"outside the {self.pool_size}-byte pool"
                    )

    def _copy(self, run: Run, device_ptr: int, device_pitch: int, kind: int,
              stream: torch.cuda.Stream, width: int | None = None) -> None:
        """Copy one run (rows of ``width`` bytes, a layer extent by default)
        between the pool and device memory at ``device_ptr`` (rows
        ``device_pitch`` apart) on ``stream``."""
        row = width or self.fmt.layer_bytes
        host = self._pool_ptr + run.offset
        if run.rows == 1 or (run.stride == row and device_pitch == row):
            self._copy_1d(host, device_ptr, run.rows * row, kind, stream)
        elif self._memcpy2d is not None:
            if kind == H2D:
                self._memcpy2d(device_ptr, device_pitch, host, run.stride, row, run.rows,
                               kind, stream.cuda_stream)
            else:
                self._memcpy2d(host, run.stride, device_ptr, device_pitch, row, run.rows,
                               kind, stream.cuda_stream)
        else:
            for r in range(run.rows):
                self._copy_1d(host + r * run.stride, device_ptr + r * device_pitch, row,
                              kind, stream)

    def _copy_1d(self, host: int, device: int, nbytes: int, kind: int,
                 stream: torch.cuda.Stream) -> None:
        if self._memcpy is not None:
            dst, src = (device, host) if kind == H2D else (host, device)
            self._memcpy(dst, src, nbytes, kind, stream.cuda_stream)
            return
        offset = host - self._pool_ptr
        pool = self.pool[offset:offset + nbytes]
        dev = self._device_slice(device, nbytes)
        with torch.cuda.stream(stream):
            if kind == H2D:
                dev.copy_(pool, non_blocking=True)
            else:
                pool.copy_(dev, non_blocking=True)

    def _device_slice(self, ptr: int, nbytes: int) -> torch.Tensor:
        for buf in (self._staging.buffer, self._store_staging, self._head_buffer):
            if buf is not None and buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel():
                start = ptr - buf.data_ptr()
                return buf[start:start + nbytes]
        raise AssertionError("device pointer outside the staging buffers")

    def _piece_view(self, buffer: torch.Tensor, offset: int, blocks: int,
                    layers: int = 1) -> torch.Tensor:
        """``buffer`` from ``offset`` as ``[layers,] blocks`` blocks of wide
        elements (kept: a view costs a small load's copy thread time)."""
        key = (buffer.data_ptr(), offset, blocks, layers)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 1024:  # many load shapes: start over
                self._views.clear()
            layout = self.layout
            used = layers * blocks * layout.block_bytes_per_layer
            shape = (blocks, layout.block_segments, layout.segment_bytes // self._elem.itemsize)
            view = buffer[offset:offset + used].view(self._elem).view(
                *(((layers,) if layers > 1 else ()) + shape))
            self._views[key] = view
        return view

    # ------------------------------------------------------------------- load
    def start_head(self, sources) -> HeadStart | None:
        """Queue the copies of a load's first fills (up to HEAD_START_BYTES)
        into the head buffer, before the load's blocks exist: a hit's copies
        start when its lookup answers, not once vLLM has allocated blocks and
        prepared the step. Only scatters need the block ids; the load that
        claims this head scatters these fills first.

        ``None`` (nothing queued) while another load is being issued (this
        one would queue behind it anyway), the head buffer is taken, or the
        first fill does not fit it (``head_start_bytes``; 0: never).
        """
        sources = [tuple(s) for s in sources]
        if not sources or not self._head_start_bytes or not self._issue_lock.acquire(blocking=False):
            return None
        try:
            with self._head_lock:
                if self._head_owner is not None or self._closed:
                    return None
            with torch.cuda.device(self.device):
                if self._head_buffer is None:
                    self._head_buffer = torch.empty(self._head_start_bytes, dtype=torch.uint8,
                                                    device=self.device)
                if self._head_freed is not None:  # the last load's scatters read it
                    self.load_stream.wait_event(self._head_freed)
                fills, used = [], 0
                try:
                    for unit in self._units(layer_pieces(self.fmt, sources, self._rows_cap)):
                        nbytes = self._unit_bytes(unit)
                        if used + nbytes > self._head_buffer.numel():
                            break
                        fills.append((unit, self._copy_unit(unit, used, self._head_buffer)))
                        used += nbytes
                except TransferError:  # a bad extent: the load itself reports it
                    return None
            if not fills:
                return None
            head = _CudaHeadStart(self, sources, fills)
            with self._head_lock:
                self._head_owner = head
            return head
        finally:
            self._issue_lock.release()

    def _claim_head(self, head: HeadStart, job: LoadJob) -> HeadStart | None:
        return head.claim(job.offsets)

    def _release_head(self, head: _CudaHeadStart) -> None:
        with self._head_lock:
            if self._head_owner is head:
                self._head_owner = None

    def _issue_here(self, job: LoadJob) -> bool:
        """Issue a load on the submitting thread when nothing is queued before
        it: all of it up to ``inline_load_bytes`` (see INLINE_LOAD_BYTES)
        unless a long forward follows, else its first ``inline_head_fills``
        fills, and the rest on the copy thread. True when this thread issued
        (some of) it."""
        whole = job.handle.nbytes <= self._inline_load_bytes and not (
            (job.beside_long_forward and HEAD_ONLY_BESIDE_LONG_FORWARD) or HEAD_ONLY_ALWAYS)
        if not whole and self._inline_head_fills <= 0:
            return False
        with self._submit_lock:
            if self._closed:
                raise TransferError("the transfer engine is closed")
            if self._loads_queued:  # keep submission order
                return False
            self._issue_lock.acquire()
            if not whole:
                # Its place in the queue is taken now, before any later load:
                # the copy thread picks it up once this thread has issued the
                # head and released the issue lock.
                self._loads_queued += 1
                self._load_queue.put(job)
        try:
            fills = self._issue_fills(job)
            if not whole:  # the copy thread looks only once the issue lock is free
                job.rest = fills
            with torch.cuda.device(self.device), torch.cuda.stream(self.scatter_stream):
                # the caller's current device and stream are restored
                for done, _ in enumerate(fills, 1):
                    if not whole and done >= self._inline_head_fills:
                        break
        except BaseException as exc:  # as on the copy thread: the handle fails
            job.issue_failed = True
            self._fail(job, exc)
        finally:
            self._issue_lock.release()
        return True

    def _run_load(self, job: LoadJob) -> None:
        with self._issue_lock:
            if job.issue_failed:
                return
            rest = job.rest
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.scatter_stream)  # the scatters run on this stream
            for _ in rest if rest is not None else self._issue_fills(job):
                pass

    def _issue_fills(self, job: LoadJob) -> Iterator[None]:
        """Queue a load's copies and scatters, yielding after each fill's
        copies, so that issuing can stop after any fill and go on later on
        another thread (under the issue lock, nothing else issued between).

        A fill's scatter is queued once the copies of ``1 + COPIES_AHEAD``
        later fills are (or the ring needs its span), so the copy engine
        never waits for the host's scatter calls: a verified load's batch of
        four fills, summed and scattered, with the first batch's set-up, took
        the host longer than one fill's copy (bench/RESULTS.md). A layer
        is marked (the forward may queue its attention) once its scatter is
        queued. The staging ring has room for the fills a small load starts
        with, so their copies never wait for a scatter. The block ids go up
        just before the first scatter."""
        job.handle.issue_started_at = time.monotonic()
        busy, resumed = 0.0, time.perf_counter()
        ids = None
        pending: deque = deque()  # fills copied, not yet scattered
        head = cast("_CudaHeadStart | None", job.head)  # this engine's heads are its own
        head_fills = deque(head.fills if head is not None else ())  # copied already
        if head_fills:
            self.heads_used += 1

        def scatter(keep_newest: bool = False):
            """Scatter the fills pending (all but the newest, if asked): one
            fill, or a verified load's batch summed in one launch."""
            nonlocal ids
            if ids is None:  # needed from the first scatter on, not before
                assert job.ready is not None, "set at submit (_prepare)"
                ids = self._device_ids(job, self.scatter_stream)
                self.scatter_stream.wait_event(job.ready)
            batch = [pending.popleft() for _ in range(len(pending) - keep_newest)]
            self._scatter_fills(job, ids, batch)

        ahead: deque = deque()  # (fill, copies queued by this issue once it was) not yet admitted
        queued = admitted = 0  # copies this issue queued; bytes of the fills admitted

        def admit():
            """The oldest fill ahead joins the pending fills: scatter those
            before it, unless a verified load's sum batch takes it in (``_joins``)."""
            nonlocal admitted
            fill, _ = ahead.popleft()
            pending.append(fill)
            admitted += fill[1][1]
            if len(pending) > 1 and not self._joins(job, pending, job.handle.nbytes - admitted):
                scatter(keep_newest=True)

        def copied(fill, by_this_issue: bool = True):
            """A fill's copies are queued (or were, by a head start): admit
            the fills with ``COPIES_AHEAD`` copies queued after them."""
            nonlocal queued
            queued += by_this_issue
            ahead.append((fill, queued))
            while ahead and queued - ahead[0][1] >= COPIES_AHEAD:
                admit()

        def scatter_all():
            while ahead:
                admit()
            if pending:
                scatter()

        self._staging.restart()
        try:
            for unit in self._units(layer_pieces(self.fmt, job.offsets, self._rows_cap)):
                if head_fills:
                    head_unit, head_copied = head_fills.popleft()
                    if head_unit != unit:  # same sources, same units: a bug if not
                        raise AssertionError("a head start's fills differ from its load's")
                    copied((unit, head_copied), by_this_issue=False)
                    continue
                nbytes = self._unit_bytes(unit)
                offset = self._staging.take(nbytes, self.load_stream)
                while offset is None:  # the ring is full of fills not yet scattered
                    if not pending and not ahead:
                        raise AssertionError("the staging ring is full with no fill to scatter")
                    scatter_all()
                    offset = self._staging.take(nbytes, self.load_stream)
                copied((unit, self._copy_unit(unit, offset)))
                busy += time.perf_counter() - resumed
                yield
                resumed = time.perf_counter()
            scatter_all()
        except TransferError:  # a bad extent: the layers before it still land
            scatter_all()
            raise
        finally:
            if head is not None:  # its scatters are queued (or never will be)
                self._release_head(head)
        self.last_issue_s = busy + time.perf_counter() - resumed
        job.handle.issued_at = time.monotonic()

    def _unit_bytes(self, unit) -> int:
        _, pieces, _ = unit
        return sum(run.rows for piece in pieces for run in piece) * self.fmt.layer_bytes

    def _units(self, pieces_of):
        """Staging fills in order: (layers, pieces, whether the fill
        completes its layers). A group of small layers is one fill; a layer
        larger than a staging buffer is several."""
        for group in self._groups(pieces_of):
            if len(group) > 1:
                yield [layer for layer, _ in group], [p for _, ps in group for p in ps], True
                continue
            layer, pieces = group[0]
            for i, piece in enumerate(pieces):
                yield [layer], [piece], i == len(pieces) - 1

    def _groups(self, pieces_of):
        """Layers in groups whose bytes fit one staging buffer together: 1,
        2, 4, ... consecutive layers, so the first layer lands early and a
        small load costs the copy thread a few calls per group, not per
        layer. A layer of several pieces is a group of its own."""
        group: list = []
        rows = 0
        want = 1
        for layer, pieces in enumerate(pieces_of):
            try:
                self._check(pieces, layer)
            except TransferError:
                if group:  # the layers before the bad one still land
                    yield group
                raise
            n = sum(r.rows for r in pieces[0]) if len(pieces) == 1 else None
            if n is not None and n * self.fmt.layer_bytes >= GROUP_BELOW_BYTES:
                n = None  # copies this large already run at full speed alone
            if group and (n is None or rows + n > self._rows_cap or len(group) >= want):
                yield group
                want *= 2
                group, rows = [], 0
            if n is None or self._stacked is None:
                yield [(layer, pieces)]
                continue
            group.append((layer, pieces))
            rows += n
        if group:
            yield group

    def _copy_unit(self, unit, offset: int, buffer: torch.Tensor | None = None) -> tuple:
        """Queue one fill's copies into ``buffer`` (the staging ring's by
        default) at ``offset`` on the load stream: (offset, bytes, filled,
        rows interleaved, buffer). Layers whose
        extents sit side by side in each object (chunkwise; layerwise objects
        stored chunk by chunk) go in one strided copy of wide rows, staged
        chunk-major: ``rows`` chunks, each the group's layers in turn;
        otherwise layer-major (``rows`` 0)."""
        layers, pieces, _ = unit
        row = self.fmt.layer_bytes
        buffer = self._staging.buffer if buffer is None else buffer
        base, pos = buffer.data_ptr() + offset, 0
        wide = self._wide_run(pieces) if len(layers) > 1 else None
        span = self._span(pieces) if len(layers) > 1 and wide is None else None
        if wide is not None:
            self._copy(wide, base, len(layers) * row, H2D, self.load_stream,
                       width=len(layers) * row)
            pos = wide.rows * len(layers) * row
        elif span is not None:  # the layers' extents back to back: one plain copy
            pos = span[1]
            self._copy_1d(self._pool_ptr + span[0], base, pos, H2D, self.load_stream)
        else:
            for piece in pieces:
                for run in piece:
                    self._copy(run, base + pos, row, H2D, self.load_stream)
                    pos += run.rows * row
        filled = self._event()
        filled.record(self.load_stream)
        return offset, pos, filled, wide.rows if wide is not None else 0, buffer

    def _span(self, pieces: list[list[Run]]) -> tuple[int, int] | None:
        """(pool offset, bytes) when the pieces' runs are contiguous and
        follow one another in the pool, as staged (layer-major)."""
        row = self.fmt.layer_bytes
        start = end = None
        for piece in pieces:
            for run in piece:
                if run.rows > 1 and run.stride != row:
                    return None
                if end is not None and run.offset != end:
                    return None
                start = run.offset if start is None else start
                end = run.offset + run.rows * row
        return (start, end - start) if start is not None and end is not None else None

    def _wide_run(self, pieces: list[list[Run]]) -> Run | None:
        """One run of rows ``len(pieces)`` layers wide, when every layer is
        one run and the next layer's extents follow the previous one's."""
        if self._memcpy2d is None or any(len(p) != 1 for p in pieces):
            return None
        first = pieces[0][0]
        row, count = self.fmt.layer_bytes, len(pieces)
        if first.rows < 2 or (first.stride < count * row):
            return None
        for i, piece in enumerate(pieces):
            run = piece[0]
            if (run.rows, run.stride, run.first_block) != (first.rows, first.stride,
                                                           first.first_block) \
                    or run.offset != first.offset + i * row:
                return None
        return first

    def _joins(self, job: LoadJob, pending: deque, left: int) -> bool:
        """Whether the newest pending fill joins the verified load's sum batch
        of those before it: one launch sums them all, as one fill of their
        layers (see ``_sum_fills``). Only whole single layers, staged layer-major
        side by side in one buffer with the same chunks, up to half the ring
        (the copies after them go on into the other half) and up to the
        ``left`` bytes still to copy after them: a batch's layers wait for its
        last copy, so batches shrink towards a load's end, where the forward
        may already be waiting. (Batches that grow from one layer beside a
        long forward were measured and did not pay: bench/RESULTS.md, round 12.)"""
        if job.check is None or not SUM_BATCHES:
            return False
        ((layers0, pieces0, whole0), copied0), ((layers1, pieces1, whole1), copied1) = pending[-2], pending[-1]
        offset0, used0, _, interleaved0, staging0 = copied0
        offset1, _, _, interleaved1, staging1 = copied1
        single_whole_layers = len(layers0) == len(layers1) == len(pieces0) == len(pieces1) == 1 and whole0 and whole1
        side_by_side = (not interleaved0 and not interleaved1 and staging1 is staging0
                        and offset1 == offset0 + used0 and layers1[0] == layers0[0] + 1)
        same_chunks = single_whole_layers and [(r.first_block, r.rows) for r in pieces1[0]] == [
            (r.first_block, r.rows) for r in pieces0[0]]
        total = sum(copied[1] for _, copied in pending)
        return (single_whole_layers and side_by_side and same_chunks
                and total <= min(self._staging.buffer.numel() // 2, left))

    def _scatter_fills(self, job: LoadJob, ids: torch.Tensor, batch: list) -> None:
        """Scatter fills in order; a verified load's are summed first (one
        launch for the batch), comparing the objects the batch completes."""
        self.scatter_stream.wait_event(batch[-1][1][2])  # copies land in order: the last covers all
        due = None
        if job.check is not None:  # the bytes as they landed, before anything reads them
            last_unit = batch[-1][0]
            layers = [layer for unit, _ in batch for layer in unit[0]]
            due = self._due(job, layers) if last_unit[2] else None
            self._sum_fills(job, batch, due)
        if len(batch) > 1 and SCATTER_BATCHES and self._stacked is not None and not job.beside_long_forward:
            # side by side in staging, the same chunks (``_joins``): a group
            # fill of their layers; its comparison lands all of them
            (_, pieces, _), (offset, _, _, _, staging) = batch[0]
            layers = [unit[0][0] for unit, _ in batch]
            used = sum(copied[1] for _, copied in batch)
            self._scatter_unit(job, ids, (layers, pieces, True), (offset, used, None, 0, staging), due,
                               spans=[copied[0] for _, copied in batch])
            return
        for i, (unit, copied) in enumerate(batch):
            # layerwise, the batch's comparison checks every layer in it;
            # chunkwise, it checks whole objects, due at the last layer only
            last = i == len(batch) - 1
            self._scatter_unit(job, ids, unit, copied, due if self.fmt.layerwise or last else None)

    def _scatter_unit(self, job: LoadJob, ids: torch.Tensor, unit, copied, due=None,
                      spans: list[int] | None = None) -> None:
        """Scatter one fill into the blocks of its layers (one index copy
        through the layers' common stride for a group), then free the
        staging buffer (its ``spans`` of the ring: the fill's own by
        default); the fill's last event lands its layers, with the
        comparison ``due`` (if any) for them to read. The scatter stream waits
        for the fill's copies first (``_scatter_fills``)."""
        layers, pieces, completes = unit
        offset, used, _, interleaved, staging = copied
        count = len(layers)
        blocks = used // count // self.layout.block_bytes_per_layer
        first = pieces[0][0].first_block  # the same for every layer of a group
        index = ids[first:first + blocks]
        # The blocks a load leaves out (``SKIP_BLOCK``: vLLM's own at the head
        # of its first chunk, those a block alias does not cover at the end
        # of its last) are summed above with their object, not written.
        head = skipped_head(job.block_ids) if first == 0 else 0
        tail = skipped_tail(job.block_ids) if first + blocks == len(job.block_ids) else 0
        end = blocks - tail
        if interleaved:  # staged [chunk][layer][block]: index by (chunk, block)
            per = blocks // interleaved
            source = self._piece_view(staging, offset, per, count * interleaved)
            source = source.view(interleaved, count, *source.shape[1:]).transpose(0, 1)
            rows, stacked = index.view(interleaved, per), self._stacked_view(layers[0], count)
            if head or tail:  # the first and last chunks in part, then the whole ones between
                last = interleaved - 1
                for c in sorted({0, last}):
                    a, b = (head if c == 0 else 0), per - (tail if c == last else 0)
                    stacked[:, rows[c, a:b]] = source[:, c, a:b]
                rows, source = rows[1:last], source[:, 1:last]
            if rows.numel():
                stacked[:, rows] = source
        elif count > 1:
            self._stacked_view(layers[0], count).index_copy_(
                1, index[head:end], self._piece_view(staging, offset, blocks, count)[:, head:end])
        else:
            self._wide_views[layers[0]].index_copy_(0, index[head:end],
                                                    self._piece_view(staging, offset, blocks)[head:end])
        freed = self._event()
        freed.record(self.scatter_stream)
        if staging is self._head_buffer:
            self._head_freed = freed
        else:
            for start in spans or [offset]:
                self._staging.freed(start, freed)
        if completes:
            # the comparison ran before the scatter on this stream: ``freed`` covers it
            # the flags as numpy: a wait reads one for each layer (a tensor's item is microseconds)
            check = (freed, due[0].flags.numpy(), due[0].flag_index, due[1]) if due is not None else None
            for layer in layers:
                job.handle._mark_layer(layer, freed, check)

    # ------------------------------------------------------------ checksums
    def _check_state(self, job: LoadJob) -> list:
        """A verified load's device state, made at its first fill: [sums,
        expected, verify, pinned flags, comparisons so far], the first three
        one int64 per object of the load, from one pinned host array in one
        copy on the scatter stream."""
        state = job.check_state
        if state is None:
            check = job.check
            if check is None:
                raise AssertionError("a load without a check has no check state")
            n = len(check)
            # Pinned: a pageable copy would hold the issuing thread until the
            # scatter stream reached it, behind the load's first fill. Taken
            # from torch's caching host allocator and filled in place (13 us
            # on an H100 host; a numpy array pinned with ``pin_memory()``, 14 us:
            # bench/check_state_alloc.py).
            staged = torch.empty(3 * n, dtype=torch.int64, pin_memory=True)
            host = staged.numpy()
            host[:n] = 0  # sums start at 0
            host[n:2 * n] = check.expected.view(np.int64)
            host[2 * n:] = check.verify
            device = staged.to(self.device, non_blocking=True)
            flags = torch.zeros(self.layout.num_layers, dtype=torch.int32, pin_memory=True)
            state = job.check_state = [device[:n], device[n:2 * n], device[2 * n:], flags, 0]
        return state

    def _ticket_counter(self) -> torch.Tensor:
        """The fused comparison's ticket counter (``device_checksum.Compare``),
        made at the first verified load: the scatter stream runs one fill at a time."""
        if self._compare_counter is None:
            self._compare_counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        return self._compare_counter

    def _due(self, job: LoadJob, layers: list[int]) -> "tuple[device_checksum.Compare, str] | None":
        """What to compare once the fill completing ``layers`` is summed
        (``checks.objects_due``): the comparison and what it checks, or None
        when no object is due (a chunkwise load before its last layer)."""
        sums, expected, verify, flags, index = state = self._check_state(job)
        nl = self.layout.num_layers
        n = len(sums)
        if self.fmt.layerwise:  # each chunk's objects of these layers
            rows, stride, first, cols = n // nl, nl, layers[0], layers[-1] - layers[0] + 1
            what = f"a payload of layer {layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else "")
        elif nl - 1 in layers:  # every object: all its layers are in
            rows, stride, first, cols = n, 1, 0, 1
            what = "a chunkwise payload"
        else:
            return None
        state[4] = index + 1
        compare = device_checksum.Compare(expected=expected, verify=verify, flags=flags, flag_index=index,
                                          counter=self._ticket_counter(), rows=rows, stride=stride,
                                          first=first, cols=cols)
        return compare, what

    def _sum_fills(self, job: LoadJob, batch: list, due) -> None:
        """Add the rows of a batch of fills (one fill, or single layers
        side by side: ``_joins``) to their objects' sums, then compare the
        objects ``due`` (if any), on the scatter stream (one launch with Triton)."""
        (layers, pieces, _), (offset, _, _, interleaved, staging) = batch[0]
        if len(batch) > 1:  # as one layer-major fill of all their layers
            layers = [layer for unit, _ in batch for layer in unit[0]]
            pieces = [piece for unit, _ in batch for piece in unit[1]]
        used = sum(copied[1] for _, copied in batch)
        bpc, row = self.fmt.blocks_per_chunk, self.fmt.layer_bytes
        first_chunk = pieces[0][0].first_block // bpc
        n_chunks = interleaved or sum(run.rows for run in pieces[0])
        for piece in pieces:  # each piece: consecutive chunks from first_chunk, as staged
            expect = first_chunk * bpc
            for run in piece:
                if run.first_block != expect:
                    raise AssertionError("a fill's rows are not consecutive chunks")
                expect += run.rows * bpc
        if used != n_chunks * len(layers) * row:
            raise AssertionError("a fill's bytes are not its rows")
        if len(layers) > 1 and layers != list(range(layers[0], layers[0] + len(layers))):
            raise AssertionError("a fill's layers are not consecutive")
        sums = self._check_state(job)[0]  # one per object of the load
        device_checksum.add_row_sums(
            sums, staging, offset, row, first_chunk=first_chunk, n_chunks=n_chunks, first_layer=layers[0],
            n_layers=len(layers), chunk_major=bool(interleaved), layerwise=self.fmt.layerwise,
            total_layers=self.layout.num_layers, compare=due[0] if due is not None else None,
            stream=self.scatter_stream.cuda_stream)

    def _stacked_view(self, layer0: int, count: int) -> torch.Tensor:
        """Layers ``layer0 .. layer0 + count - 1`` as one view
        ``[count, blocks, segments, segment_bytes]`` (their common stride)."""
        key = (layer0, count)
        stacked, layer_stride = self._stacked, self.layout.layer_stride_bytes
        assert stacked is not None and layer_stride is not None, "only evenly spaced layers stack"
        view = stacked.get(key)
        if view is None:
            first = self._wide_views[layer0]
            stride = layer_stride // self._elem.itemsize
            view = torch.as_strided(first, (count, *first.shape), (stride, *first.stride()),
                                    first.storage_offset())
            stacked[key] = view
        return view

    # ------------------------------------------------------------------ store
    def _run_store(self, job: StoreJob) -> None:
        torch.cuda.set_device(self.device)
        stream = self.store_stream
        row = self.fmt.layer_bytes
        staging = self._store_staging
        ids = self._device_ids(job, stream)
        assert job.ready is not None, "set at submit (_prepare)"
        stream.wait_event(job.ready)
        torch.cuda.set_stream(stream)
        pieces_of = layer_pieces(self.fmt, job.offsets, self._rows_cap)
        bpc = self.fmt.blocks_per_chunk
        sums = (torch.zeros(len(job.offsets) * self.fmt.objects_per_chunk, dtype=torch.int64, device=self.device)
                if checkable(self.fmt) else None)
        for layer, pieces in enumerate(pieces_of):
            self._check(pieces, layer)
            view = self._wide_views[layer]
            for piece in pieces:
                blocks = sum(r.rows for r in piece) * self.fmt.blocks_per_chunk
                first = piece[0].first_block
                torch.index_select(view, 0, ids[first:first + blocks],
                                   out=self._piece_view(staging, 0, blocks))
                if sums is not None:  # the bytes it copies out, on the store stream
                    device_checksum.add_row_sums(
                        sums, staging, 0, row, first_chunk=first // bpc, n_chunks=blocks // bpc,
                        first_layer=layer, n_layers=1, chunk_major=False, layerwise=self.fmt.layerwise,
                        total_layers=self.layout.num_layers, stream=stream.cuda_stream)
                pos = 0
                for run in piece:
                    self._copy(run, staging.data_ptr() + pos, row, D2H, stream)
                    pos += run.rows * row
        done = self._event()
        done.record(stream)
        done.synchronize()
        if sums is not None:
            job.handle.checksums = device_checksum.as_uint64(sums.cpu())
        job.handle._finish()

    # ------------------------------------------------------------------ close
    def _release(self) -> None:
        for name in ("load_stream", "scatter_stream", "store_stream"):
            if hasattr(self, name):
                getattr(self, name).synchronize()
        if self._registered:
            unregister_host(self._pool_ptr)
            self._registered = False
