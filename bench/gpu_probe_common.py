"""What the GPU load probes share: the hit they load (the stand-in model's
4k-token chunkwise hit), a registered pool in ``/dev/shm``, event timing,
and a decode-like forward to run beside the loads."""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import tempfile

import torch

from maru_connector.transfer.cudart import register_host, unregister_host

# 32 layers, 64 KiB per block and layer, 16 blocks per 256-token chunk, 16 chunks.
LAYERS, BLOCK_BYTES, BLOCKS_PER_CHUNK, CHUNKS = 32, 64 << 10, 16, 16
LAYER_IN_CHUNK = BLOCK_BYTES * BLOCKS_PER_CHUNK  # one layer's extent in a chunk object
OBJECT_BYTES = LAYER_IN_CHUNK * LAYERS


def elapsed_ms(fn, repeats: int = 7) -> list[float]:
    """GPU milliseconds of ``fn()`` for ``repeats`` runs after a warm-up."""
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times[1:]


@contextlib.contextmanager
def registered_pool(nbytes: int):
    """A random ``/dev/shm`` pool of ``nbytes``, registered with CUDA as the
    connector registers it: ``(uint8 tensor over it, its address)``."""
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    pool = torch.frombuffer(mm, dtype=torch.uint8)
    pool.random_(0, 256)
    ptr = pool.data_ptr()
    assert register_host(ptr, nbytes)
    try:
        yield pool, ptr
    finally:
        torch.cuda.synchronize()
        unregister_host(ptr)
        del pool
        mm.close()
        os.close(fd)
        os.unlink(path)


def decode_like_forward(dev):
    """One token through 32 layers of matrix-vector products reading about
    13 GiB of bf16 weights (a memory-bound forward, as a full hit's is)."""
    weights = [torch.randn(4 * 4096, 4096, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    mlp = [torch.randn(14336 * 3, 4096, dtype=torch.bfloat16, device=dev) for _ in range(8)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)

    def forward():
        for layer in range(LAYERS):
            torch.matmul(x, weights[layer].t())
            torch.matmul(x, mlp[layer % 8].t())

    return forward


def beside(load, forward, stream) -> tuple[float, float]:
    """Medians (ms) of ``load()`` queued on ``stream`` beside ``forward()`` on
    the current stream: both done, and the load itself."""
    marks = []

    def both():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        start.record(stream)
        with torch.cuda.stream(stream):
            load()
        end.record(stream)
        forward()
        torch.cuda.current_stream().wait_stream(stream)
        marks.append((start, end))

    total = statistics.median(elapsed_ms(both))
    torch.cuda.synchronize()
    return total, statistics.median(a.elapsed_time(b) for a, b in marks[1:])
