"""Can the copy engine land a hit's KV straight in its paged blocks?

The CUDA backend stages each layer (one strided copy into a device buffer)
and scatters it into the blocks with ``index_copy_``: per layer a copy, a
kernel and several host calls, which make a 4k-token hit's issue take about
2.4 ms on the engine thread. ``cudaMemcpyBatchAsync`` (CUDA 12.8 and newer)
queues many copies in one call, so a layer could go straight from the pool
into its blocks with one call and no staging or scatter. Copied one by one,
block-sized pieces are about 18x slower than staging; whether the batched
call keeps the copy engine at its peak with such pieces is what this
measures, before anything is built on it:

- the pinned host-to-device peak (one ``cudaMemcpy`` of the same bytes);
- a 4k-token chunkwise hit (32 layers, chunks of 16 blocks at scattered
  pool offsets) copied with one batched call per layer into randomly
  placed blocks, with 64 KiB pieces (a block's K and V side by side) and
  32 KiB pieces (K and V apart, as in vLLM's flash-attention layout);
- the host time to issue those calls (pointer arrays built with numpy);
- the same beside a decode-like forward on the GPU.

Every copied block is compared with its source bytes.

    PYTHONPATH=connector:core python3 bench/batch_copy_probe.py
"""

from __future__ import annotations

import ctypes
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))

from gpu_probe_common import (  # noqa: E402
    BLOCK_BYTES, BLOCKS_PER_CHUNK, CHUNKS, LAYER_IN_CHUNK, LAYERS, OBJECT_BYTES,
    beside, decode_like_forward, elapsed_ms, registered_pool,
)
from maru_connector.transfer.cudart import _loaded_cudart  # noqa: E402

SRC_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", ctypes.c_uint)]


def batch_memcpy():
    """``cudaMemcpyBatchAsync`` of the process's runtime, as
    ``copy(dsts, srcs, sizes, count, stream)`` (numpy uint64 arrays)."""
    lib = ctypes.CDLL(_loaded_cudart())
    version = ctypes.c_int()
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    fn = lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    attrs = MemcpyAttributes(SRC_ORDER_STREAM, MemLocation(0, 0), MemLocation(0, 0), 0)
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t()
    p = ctypes.c_void_p
    if version.value >= 13000:  # 13.0 dropped the failIdx argument
        fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p]

        def copy(dsts, srcs, sizes, count, stream):
            return fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                      ctypes.byref(attrs), idx, 1, stream)
    else:
        fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p, p]

        def copy(dsts, srcs, sizes, count, stream):
            return fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count,
                      ctypes.byref(attrs), idx, 1, ctypes.byref(fail), stream)
    return version.value, copy


def main() -> None:
    dev = torch.device("cuda")
    torch.cuda.init()
    version, copy = batch_memcpy()
    with registered_pool(OBJECT_BYTES * CHUNKS * 4) as (pool, ptr):
        rng = random.Random(0)
        slots = rng.sample(range(CHUNKS * 4), CHUNKS)
        n_blocks = CHUNKS * BLOCKS_PER_CHUNK
        kv_blocks = n_blocks * 4
        load_bytes = n_blocks * BLOCK_BYTES * LAYERS
        # One backing buffer, layers side by side, as vLLM allocates them.
        backing = torch.zeros(LAYERS, kv_blocks, BLOCK_BYTES, dtype=torch.uint8, device=dev)
        dst_ids = np.array(rng.sample(range(kv_blocks), n_blocks), dtype=np.uint64)
        blocks = np.arange(n_blocks, dtype=np.uint64)
        src_block = (np.array(slots, dtype=np.uint64)[blocks // BLOCKS_PER_CHUNK] * OBJECT_BYTES
                     + (blocks % BLOCKS_PER_CHUNK) * BLOCK_BYTES)
        stream = torch.cuda.Stream(priority=-1)
        print(f"device {torch.cuda.get_device_name()}, CUDA runtime {version}; "
              f"load {load_bytes >> 20} MiB")

        flat = torch.empty(load_bytes, dtype=torch.uint8, device=dev)
        host = pool[:load_bytes]
        peak = statistics.median(elapsed_ms(lambda: flat.copy_(host, non_blocking=True)))
        print(f"copy engine, one cudaMemcpy: {peak:.2f} ms = {load_bytes / peak / 1e6:.1f} GB/s")
        flat = None  # freed before the blocks are filled

        def plan(piece: int):
            """Per layer: destination and source addresses of every piece."""
            parts = BLOCK_BYTES // piece
            part = np.arange(parts, dtype=np.uint64) * piece
            base = backing.data_ptr()
            dsts, srcs = [], []
            for layer in range(LAYERS):
                d = (base + layer * kv_blocks * BLOCK_BYTES + dst_ids * BLOCK_BYTES)[:, None] + part
                s = (ptr + src_block + layer * LAYER_IN_CHUNK)[:, None] + part
                dsts.append(np.ascontiguousarray(d.ravel()))
                srcs.append(np.ascontiguousarray(s.ravel()))
            sizes = np.full(n_blocks * parts, piece, dtype=np.uint64)
            return dsts, srcs, sizes

        def load(dsts, srcs, sizes, events=False):
            s = stream.cuda_stream
            for layer in range(LAYERS):
                err = copy(dsts[layer], srcs[layer], sizes, len(sizes), s)
                if err:
                    raise RuntimeError(f"cudaMemcpyBatchAsync failed with CUDA error {err}")
                if events:
                    torch.cuda.Event().record(stream)

        def on_stream(fn):
            stream.wait_stream(torch.cuda.current_stream())
            fn()
            torch.cuda.current_stream().wait_stream(stream)

        forward = decode_like_forward(dev)
        print(f"decode-like forward alone: {statistics.median(elapsed_ms(forward)):.2f} ms")

        for piece in (BLOCK_BYTES, BLOCK_BYTES // 2, BLOCK_BYTES // 4):
            t0 = time.perf_counter()
            dsts, srcs, sizes = plan(piece)
            plan_ms = (time.perf_counter() - t0) * 1e3
            backing.zero_()
            ms = statistics.median(elapsed_ms(lambda: on_stream(lambda: load(dsts, srcs, sizes))))
            torch.cuda.synchronize()
            ok = True
            for layer in (0, 17, LAYERS - 1):
                for b in range(0, n_blocks, 29):
                    off = int(src_block[b]) + layer * LAYER_IN_CHUNK
                    ok &= torch.equal(backing[layer, int(dst_ids[b])].cpu(), pool[off:off + BLOCK_BYTES])
            issue = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                load(dsts, srcs, sizes, events=True)
                issue.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            total, alone = beside(lambda: load(dsts, srcs, sizes), forward, stream)
            print(f"batched, {piece >> 10} KiB pieces ({len(sizes)} per layer): {ms:.2f} ms = "
                  f"{load_bytes / ms / 1e6:.1f} GB/s ({peak / ms:.2f} of one cudaMemcpy); "
                  f"issue {statistics.median(issue[5:]):.3f} ms host for {LAYERS} calls + events "
                  f"(plan {plan_ms:.2f} ms, numpy); beside the forward {alone:.2f} ms "
                  f"(both done {total:.2f}); bits equal: {ok}")


if __name__ == "__main__":
    main()
