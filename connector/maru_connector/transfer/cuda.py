"""CUDA backend: the pool mapping registered once with ``cudaHostRegister``;
loads copy runs of contiguous (or evenly strided) pool bytes into a device
staging buffer on the one load stream, then scatter them into the paged
blocks with ``index_copy_`` on a scatter stream, so the scatter of one piece
overlaps the copy of the next (two staging buffers, used in turn). Stores
gather blocks with ``index_select`` into staging and copy them out on the
store stream. Copying straight into paged blocks piece by piece is about 18x
slower than this on an H200."""

from __future__ import annotations

import torch

from .cudart import D2H, H2D, find_memcpy2d, register_host, unregister_host
from .engine import TransferEngine, _Job
from .plan import Run, split_runs

__all__ = ["CudaTransferEngine"]

DEFAULT_STAGING_BYTES = 64 << 20  # per buffer; >= 64 MiB copies reach peak


class CudaTransferEngine(TransferEngine):
    backend = "cuda"

    def __init__(self, pool_buffer, kv_caches, fmt, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 copy_2d: bool = True, timing: bool = False) -> None:
        super().__init__(pool_buffer, kv_caches, fmt)
        self.device = self.kv_caches[0].device
        self._pool_ptr = self.pool.data_ptr()
        with torch.cuda.device(self.device):
            # Registered already (another engine in this process): leave it
            # to its owner. is_pinned() asks the driver and clears its error.
            self._registered = (not self.pool.is_pinned()
                                and register_host(self._pool_ptr, self.pool_size))
            try:
                self._setup(fmt, staging_bytes, copy_2d)
            except BaseException:
                self._release()
                raise
        self._staging_free: list[torch.cuda.Event | None] = [None, None]
        self._next_staging = 0
        self._timing = timing

    def _setup(self, fmt, staging_bytes: int, copy_2d: bool) -> None:
        self.load_stream = torch.cuda.Stream(self.device)
        self.scatter_stream = torch.cuda.Stream(self.device)
        self.store_stream = torch.cuda.Stream(self.device)
        self.copy_2d_backend, self._memcpy2d = find_memcpy2d() if copy_2d else ("rows", None)
        row = fmt.layer_bytes
        self._rows_cap = max(1, staging_bytes // row)
        self._staging = [
            torch.empty(self._rows_cap * row, dtype=torch.uint8, device=self.device)
            for _ in range(2)
        ]
        self._store_staging: torch.Tensor | None = None

    # ---------------------------------------------------------------- helpers
    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self._timing)

    def _prepare(self, job: _Job) -> None:
        job.ready = self._event()
        job.ready.record(torch.cuda.current_stream(self.device))
        if self._timing:
            job.handle._device_start = job.ready

    def _device_ids(self, job: _Job, stream: torch.cuda.Stream) -> torch.Tensor:
        host = torch.tensor(job.block_ids, dtype=torch.int64).pin_memory()
        job.host_ids = host  # alive until the copy below has run
        with torch.cuda.stream(stream):
            return host.to(self.device, non_blocking=True)

    def _copy(self, run: Run, device_ptr: int, device_pitch: int, kind: int,
              stream: torch.cuda.Stream) -> None:
        """Copy one run between the pool and device memory at ``device_ptr``
        (rows ``device_pitch`` apart) on ``stream``."""
        row = self.fmt.layer_bytes
        contiguous = run.rows == 1 or (run.stride == row and device_pitch == row)
        rows = [(run.offset, device_ptr, run.rows * row)] if contiguous else None
        if rows is None and self._memcpy2d is not None:
            host = self._pool_ptr + run.offset
            if kind == H2D:
                self._memcpy2d(device_ptr, device_pitch, host, run.stride, row, run.rows,
                               kind, stream.cuda_stream)
            else:
                self._memcpy2d(host, run.stride, device_ptr, device_pitch, row, run.rows,
                               kind, stream.cuda_stream)
            return
        if rows is None:
            rows = [(run.offset + r * run.stride, device_ptr + r * device_pitch, row)
                    for r in range(run.rows)]
        for offset, ptr, nbytes in rows:
            self._copy_1d(offset, ptr, nbytes, kind, stream)

    def _copy_1d(self, offset: int, ptr: int, nbytes: int, kind: int,
                 stream: torch.cuda.Stream) -> None:
        host = self.pool[offset:offset + nbytes]
        dev = self._device_slice(ptr, nbytes)
        with torch.cuda.stream(stream):
            if kind == H2D:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)

    def _device_slice(self, ptr: int, nbytes: int) -> torch.Tensor:
        for buf in (*self._staging, self._store_staging):
            if buf is not None and buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel():
                start = ptr - buf.data_ptr()
                return buf[start:start + nbytes]
        raise AssertionError("device pointer outside the staging buffers")

    def _piece_view(self, staging: torch.Tensor, blocks: int) -> torch.Tensor:
        layout = self.layout
        used = blocks * layout.block_bytes_per_layer
        return staging[:used].view(blocks, layout.block_segments, layout.segment_bytes)

    # ------------------------------------------------------------------- load
    def _run_load(self, job: _Job) -> None:
        torch.cuda.set_device(self.device)
        ids = self._device_ids(job, self.scatter_stream)
        self.scatter_stream.wait_event(job.ready)
        bpc = self.fmt.blocks_per_chunk
        row = self.fmt.layer_bytes
        for layer in range(self.layout.num_layers):
            view = self.block_views[layer]
            for piece in split_runs(self._runs(job, layer), self._rows_cap, bpc):
                slot = self._next_staging
                self._next_staging ^= 1
                staging = self._staging[slot]
                if self._staging_free[slot] is not None:
                    self.load_stream.wait_event(self._staging_free[slot])
                pos = 0
                for run in piece:
                    self._copy(run, staging.data_ptr() + pos, row, H2D, self.load_stream)
                    pos += run.rows * row
                filled = self._event()
                filled.record(self.load_stream)
                self.scatter_stream.wait_event(filled)
                first, blocks = piece[0].first_block, pos // self.layout.block_bytes_per_layer
                with torch.cuda.stream(self.scatter_stream):
                    view.index_copy_(0, ids[first:first + blocks], self._piece_view(staging, blocks))
                freed = self._event()
                freed.record(self.scatter_stream)
                self._staging_free[slot] = freed
            landed = self._event()
            landed.record(self.scatter_stream)
            job.handle._mark_layer(layer, landed)

    # ------------------------------------------------------------------ store
    def _run_store(self, job: _Job) -> None:
        torch.cuda.set_device(self.device)
        stream = self.store_stream
        row = self.fmt.layer_bytes
        if self._store_staging is None:
            self._store_staging = torch.empty(self._rows_cap * row, dtype=torch.uint8,
                                              device=self.device)
        staging = self._store_staging
        ids = self._device_ids(job, stream)
        stream.wait_event(job.ready)
        for layer in range(self.layout.num_layers):
            view = self.block_views[layer]
            for piece in split_runs(self._runs(job, layer), self._rows_cap,
                                    self.fmt.blocks_per_chunk):
                blocks = sum(r.rows for r in piece) * self.fmt.blocks_per_chunk
                first = piece[0].first_block
                with torch.cuda.stream(stream):
                    torch.index_select(view, 0, ids[first:first + blocks],
                                       out=self._piece_view(staging, blocks))
                pos = 0
                for run in piece:
                    self._copy(run, staging.data_ptr() + pos, row, D2H, stream)
                    pos += run.rows * row
        done = self._event()
        done.record(stream)
        done.synchronize()
        job.handle._finish()

    # ------------------------------------------------------------------ close
    def _release(self) -> None:
        for name in ("load_stream", "scatter_stream", "store_stream"):
            if hasattr(self, name):
                getattr(self, name).synchronize()
        if self._registered:
            unregister_host(self._pool_ptr)
            self._registered = False
