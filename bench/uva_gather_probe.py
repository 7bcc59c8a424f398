"""Can the GPU gather a hit's KV straight from the registered pool?

The CUDA backend copies with the copy engine into staging and scatters from
there: two operations and several host calls per layer. A kernel reading
the pool through its registered (unified-address) mapping would land each
layer with one launch and no staging. This probe measures what such a
gather gets over PCIe before anything is built on it:

- the pinned host-to-device peak (one ``cudaMemcpy`` of the same bytes);
- a Triton gather, one launch per layer, of a 4k-token chunkwise hit laid
  out as the stand-in model's (32 layers, 64 KiB per block and layer, 16
  blocks per 256-token chunk, chunks at scattered pool offsets), with the
  whole grid and with a capped, persistent grid (fewer multiprocessors);
- the host time of issuing those launches;
- how much a decode-like forward (matrix-vector products reading 13 GiB of
  weights) and the gather slow each other when they run together.

Every gathered block is compared with its source bytes.

    PYTHONPATH=connector:core python3 bench/uva_gather_probe.py
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from gpu_probe_common import (  # noqa: E402
    BLOCK_BYTES, BLOCKS_PER_CHUNK, CHUNKS, LAYER_IN_CHUNK, LAYERS, OBJECT_BYTES,
    beside, decode_like_forward, elapsed_ms, registered_pool,
)


class HostPointer:
    """The registered pool as Triton sees a tensor: a device-usable address."""

    def __init__(self, ptr: int, dtype=torch.int64):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


@triton.jit
def gather_layer(src, dst, src_off, dst_off, layer_off, n_blocks,
                 ELEMS: tl.constexpr, CHUNK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Copy ``n_blocks`` blocks of ``ELEMS`` int64s: block i from
    ``src + src_off[i] + layer_off`` to ``dst + dst_off[i]``."""
    pid = tl.program_id(0)
    parts = ELEMS // CHUNK
    total = n_blocks * parts
    for work in range(pid, total, PROGRAMS):
        b = work // parts
        p = work % parts
        so = tl.load(src_off + b) + layer_off + p * CHUNK
        do = tl.load(dst_off + b) + p * CHUNK
        so = tl.multiple_of(so, 16)
        do = tl.multiple_of(do, 16)
        idx = tl.arange(0, CHUNK)
        tl.store(dst + do + idx, tl.load(src + so + idx))


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    with registered_pool(OBJECT_BYTES * CHUNKS * 4) as (pool, ptr):
        rng = random.Random(0)
        slots = rng.sample(range(CHUNKS * 4), CHUNKS)  # chunk c's object sits in slot slots[c]
        n_blocks = CHUNKS * BLOCKS_PER_CHUNK
        kv_blocks = n_blocks * 4
        kv = [torch.zeros(kv_blocks, BLOCK_BYTES // 8, dtype=torch.int64, device=dev)
              for _ in range(LAYERS)]
        dst_ids = torch.tensor(rng.sample(range(kv_blocks), n_blocks), dtype=torch.int64)
        src_off = torch.tensor([slots[b // BLOCKS_PER_CHUNK] * OBJECT_BYTES
                                + (b % BLOCKS_PER_CHUNK) * BLOCK_BYTES for b in range(n_blocks)],
                               dtype=torch.int64) // 8
        src_off_d = src_off.to(dev)
        dst_off_d = (dst_ids * (BLOCK_BYTES // 8)).to(dev)
        src = HostPointer(ptr)
        load_bytes = n_blocks * BLOCK_BYTES * LAYERS
        stream = torch.cuda.Stream(priority=-1)

        # 1. The copy engine's peak from the same registered pool.
        flat = torch.empty(load_bytes, dtype=torch.uint8, device=dev)
        host = pool[:load_bytes]

        def copy_engine():
            flat.copy_(host, non_blocking=True)

        peak = statistics.median(elapsed_ms(copy_engine))
        print(f"device {torch.cuda.get_device_name()}, {sms} SMs; load {load_bytes >> 20} MiB")
        print(f"copy engine, one cudaMemcpy: {peak:.2f} ms = {load_bytes / peak / 1e6:.1f} GB/s")

        def gather(programs: int, chunk: int, warps: int, events: bool = False):
            for layer in range(LAYERS):
                gather_layer[(programs,)](src, kv[layer], src_off_d, dst_off_d,
                                          layer * (LAYER_IN_CHUNK // 8), n_blocks,
                                          ELEMS=BLOCK_BYTES // 8, CHUNK=chunk, PROGRAMS=programs,
                                          num_warps=warps)
                if events:
                    torch.cuda.Event().record()

        results = {}
        for programs in (sms * 4, sms, 64, 32, 16):
            for chunk, warps in ((1024, 4), (2048, 8)):
                gather(programs, chunk, warps)  # compile
                med = statistics.median(elapsed_ms(lambda: gather(programs, chunk, warps)))
                results[(programs, chunk, warps)] = med
                print(f"gather, {programs:4d} programs, {chunk} x 8 B, {warps} warps: "
                      f"{med:.2f} ms = {load_bytes / med / 1e6:.1f} GB/s "
                      f"({peak / med:.2f} of the copy engine)")
        best = min(results, key=results.get)

        # Bit check of the best variant.
        for t in kv:
            t.zero_()
        gather(*best)
        torch.cuda.synchronize()
        ok = True
        for layer in (0, 13, LAYERS - 1):
            for b in range(0, n_blocks, 37):
                off = int(src_off[b]) * 8 + layer * LAYER_IN_CHUNK
                want = pool[off:off + BLOCK_BYTES].view(torch.int64)
                ok &= torch.equal(kv[layer][int(dst_ids[b])].cpu(), want)
        print(f"bits equal: {ok}")

        # Host cost of issuing one load's launches (the copies are not waited for).
        issue = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                gather(*best, events=True)
            issue.append((time.perf_counter() - t0) * 1e3)
        print(f"issue, {LAYERS} launches + events: {statistics.median(issue[5:]):.3f} ms host")

        forward = decode_like_forward(dev)
        fwd_alone = statistics.median(elapsed_ms(forward))
        print(f"decode-like forward alone: {fwd_alone:.2f} ms")
        for programs in sorted({best[0], sms, 32, 16}):
            cfg = (programs, best[1], best[2])
            if cfg not in results:
                continue
            total, alone = beside(lambda: gather(*cfg), forward, stream)
            print(f"together ({programs} programs): both done {total:.2f} ms; gather {alone:.2f} ms "
                  f"(alone {results[cfg]:.2f}); forward alone {fwd_alone:.2f}")
        total, alone = beside(copy_engine, forward, stream)
        print(f"together (copy engine): both done {total:.2f} ms; copy {alone:.2f} ms (alone {peak:.2f})")


if __name__ == "__main__":
    main()
