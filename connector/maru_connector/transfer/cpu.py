"""CPU backend: copies between a view of the pool mapping and the KV cache
tensors, on one load thread and one store thread (no CUDA needed, so CI
exercises every path). Each copy runs on its own thread only, without the
GIL (numpy), never in an OpenMP team of its own: see :func:`_copy`. The
pool's pages are mapped into the process in the background at start, so the
copies of hits and stores do not fault them in (``prefault.py``). The copy
threads run on cores of their own when vLLM leaves any out of the forward's
OpenMP team (``copy_cpus.py``), and the load thread at idle priority, so
that on cores it shares with the forward it takes only the time the forward
leaves idle. The store thread stays at normal priority: nothing waits for
a store, so at idle priority it could wait without end behind other busy
processes (an idle vLLM worker polls its queue), its reservation lapse, and
the store be lost."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from maru_core.pool.checksum import position_sum, position_sum_rows, warm_up

from ..object_format import ObjectFormat
from .backend import LoadJob, StoreJob, TransferBackend
from .checks import checkable, describe, objects_due, piece_of
from .copy_cpus import idle_this_thread, pin_this_thread
from .engine import TransferEngine
from .handles import ChecksumMismatch
from .plan import Run, skipped_spans
from .prefault import PoolPrefaulter

__all__ = ["CpuTransferEngine"]


class CpuTransferEngine(TransferEngine):
    backend = TransferBackend.CPU

    def __init__(self, pool_buffer: memoryview, kv_caches: dict[str, torch.Tensor], fmt: ObjectFormat,
                 prefault: bool = True,
                 copy_cpus: frozenset[int] | None = None, copy_priority: str = "idle") -> None:
        """``prefault``: map the pool's pages ahead of the first hits, in the
        background (``prefault.py``). ``copy_cpus``: the cores the copy
        threads (and that background work) run on; None: unpinned.
        ``copy_priority``: ``"idle"`` runs the load thread only where a
        core is otherwise idle (``copy_cpus.idle_this_thread``), ``"normal"``
        as any other thread."""
        super().__init__(pool_buffer, kv_caches, fmt)
        warm_up()  # the checksums' compiled pass (stores always sum, verified loads too)
        self.copy_cpus = copy_cpus
        self.copy_priority = copy_priority
        self.prefaulter = (PoolPrefaulter(self.pool.data_ptr(), self.pool_size, cpus=copy_cpus)
                           if prefault else None)

    def _copy_thread_started(self, loads: bool) -> None:
        pin_this_thread(self.copy_cpus)
        if loads and self.copy_priority == "idle":
            idle_this_thread()

    def _release(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.stop()  # before the mapping can go

    def _rows(self, run: Run) -> list[torch.Tensor]:
        """Pool views ``[blocks, segments, segment_bytes]`` of a run: one view
        when its rows are adjacent, else one per row."""
        layout = self.layout
        shape_tail = (layout.block_segments, layout.segment_bytes)
        stride_tail = (layout.segment_bytes, 1)
        bpc = self.fmt.blocks_per_chunk
        row = self.fmt.layer_bytes
        if run.stride == row:
            starts, blocks = [run.offset], run.rows * bpc
        else:
            starts, blocks = [run.offset + r * run.stride for r in range(run.rows)], bpc
        return [
            torch.as_strided(
                self.pool, (blocks, *shape_tail),
                (layout.block_bytes_per_layer, *stride_tail), start,
            )
            for start in starts
        ]

    def _block_ranges(self, run: Run, views: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, int, int]]:
        first = run.first_block
        for view in views:
            yield view, first, first + view.shape[0]
            first += view.shape[0]

    def _run_load(self, job: LoadJob) -> None:
        # One copy per run of consecutive block ids: a byte-wise index_copy_
        # moves about 0.1 GB/s on the CPU, a copy of whole blocks GB/s. A
        # verified load sums each run's blocks as they lie in the KV cache
        # right after copying them (the bytes the forward will read), and a
        # layer is marked only once the objects due at it matched. The
        # blocks left out of a load that begins or ends inside a chunk
        # (``SKIP_BLOCK``) are not copied: they are summed where they lie in
        # the pool, so their object is still verified whole.
        sums = [0] * len(job.check) if job.check is not None else None
        for layer in range(self.layout.num_layers):
            dst = self.block_views[layer]
            for run in self._runs(job, layer):
                views = self._rows(run)
                for src, a, b in self._block_ranges(run, views):
                    for lo, hi, skipped in skipped_spans(job.block_ids, a, b):
                        part = src[lo - a : hi - a]
                        if skipped:
                            if sums is not None:
                                self._sum_blocks(sums, layer, part, lo)
                            continue
                        for first, n, offset in _consecutive(job.block_ids, lo, hi):
                            _copy(dst[first:first + n], part[offset:offset + n])
                            if sums is not None:
                                self._sum_blocks(sums, layer, dst[first:first + n], lo + offset)
            if sums is not None:
                self._verify(job, sums, layer)
            job.handle._mark_layer(layer)

    def _sum_blocks(self, sums: list[int], layer: int, blocks: torch.Tensor, position: int) -> None:
        """Add ``blocks`` (the load's blocks ``position`` on, as they lie in the
        KV cache or the pool) to the sums of the objects they belong to."""
        bpc = self.fmt.blocks_per_chunk
        block_words = self.layout.block_bytes_per_layer // 4
        segment = self.layout.segment_bytes
        done, n = 0, blocks.shape[0]
        while done < n:
            chunk, k = divmod(position + done, bpc)
            take = min(n - done, bpc - k)  # a run may go on into the next chunk's object
            obj, base = piece_of(self.fmt, chunk, layer)
            rows = blocks[done:done + take].numpy().reshape(-1, segment)
            sums[obj] += position_sum_rows(rows, base + k * block_words)
            done += take

    def _verify(self, job: LoadJob, sums: list[int], layer: int) -> None:
        check = job.check
        assert check is not None, "only a verified load is checked"
        for obj in objects_due(self.fmt, len(job.offsets), layer).tolist():
            if check.verify[obj] and sums[obj] % 2**64 != int(check.expected[obj]):
                raise ChecksumMismatch(f"{describe(self.fmt, obj)} does not match the checksum its writer recorded")

    def _run_store(self, job: StoreJob) -> None:
        # A gather on one thread, like the loads' copies (see _copy); the ids
        # were checked against the KV cache at submit, so "clip" never clips
        # (and spares numpy the bounds-checking buffered path).
        ids = np.asarray(job.block_ids, dtype=np.int64)
        for layer in range(self.layout.num_layers):
            src = self.block_views[layer].numpy()
            for run in self._runs(job, layer):
                views = self._rows(run)
                for dst, a, b in self._block_ranges(run, views):
                    np.take(src, ids[a:b], axis=0, out=dst.numpy(), mode="clip")
        if checkable(self.fmt):  # over the bytes it wrote, as they lie in the pool
            size = self.fmt.object_bytes
            job.handle.checksums = [position_sum(self.pool[o:o + size].numpy())
                                    for chunk in job.offsets for o in chunk]
        job.handle._finish()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One thread's memcpy, without the GIL. A torch copy on this thread would
    start an OpenMP team of its own, whose threads fight the forward's for the
    cores while an overlapped load lands, and whose mere existence changes how
    the engine's OpenMP threads wait (libgomp stops spinning once a process
    runs more of them than there are cores)."""
    np.copyto(dst.numpy(), src.numpy())


def _consecutive(block_ids: list[int], a: int, b: int) -> Iterator[tuple[int, int, int]]:
    """``(first block id, count, offset from a)`` for each run of consecutive
    ids in ``block_ids[a:b]``."""
    start = a
    for i in range(a + 1, b + 1):
        if i == b or block_ids[i] != block_ids[i - 1] + 1:
            yield block_ids[start], i - start, start - a
            start = i
