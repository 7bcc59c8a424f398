"""Load bandwidth of the CUDA transfer engine for a long prefix hit.

Llama-3-8B geometry by default (32 layers, 8 KV heads, head 128, bf16, block
16): a 16k-token hit is 2 GiB of KV, 64 MiB per layer. For each object format
the pool is filled by a store, then loaded into random, non-contiguous blocks;
the result is compared with a plain pinned host-to-device copy measured in the
same run. Also per-layer copy time with 1 and with N concurrent loads on the
shared load stream. Needs torch with CUDA; no vLLM.

    python bench/transfer_gpu.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import statistics
import threading
import time
import uuid

import torch

from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChunkLoad, ChunkStore, create_engine

GB = 1e9
# physical order of [L, *logical per-layer dims]
ORDERS = {
    "cpu": ((0, 1, 2, 3, 4), "packed"),
    "packed_lbnhc": ((0, 1, 3, 2, 4), "packed"),
    "flash_nhd": ((0, 1, 2, 3, 4, 5), "flash"),
    "flash_hnd": ((0, 1, 2, 4, 3, 5), "flash"),
}


def make_kv(kind, layers, blocks, heads, block, head):
    order, family = ORDERS[kind]
    shape = ((blocks, heads, block, 2 * head) if family == "packed"
             else (2, blocks, block, heads, head))
    full = (layers, *shape)
    strides, step = [0] * len(full), 1
    for dim in reversed(order):
        strides[dim], step = step, step * full[dim]
    backing = torch.empty(step, dtype=torch.bfloat16, device="cuda")
    backing.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    return {f"model.layers.{i}.self_attn.attn":
            torch.as_strided(backing, shape, strides[1:], i * strides[0])
            for i in range(layers)}


class Pool:
    """A shared mapping like the real pool: a /dev/shm file when it fits."""

    def __init__(self, size):
        self.path = None
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        if st and st.f_bavail * st.f_frsize > size + (1 << 30):
            self.path = f"/dev/shm/maru-bench-{uuid.uuid4().hex}"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED)
            os.close(fd)
        else:
            self.map = mmap.mmap(-1, size, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.buffer = memoryview(self.map)
        self.kind = "tmpfs file" if self.path else "anonymous shared mapping"

    def close(self):
        self.buffer.release()
        self.map.close()
        if self.path:
            os.unlink(self.path)


def timed_copy_gbps(dst, src, repeat):
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return src.numel() / best / GB


def pinned_peak(nbytes):
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gbps = timed_copy_gbps(dev, host, 5)
    del host, dev
    return gbps


def place(fmt, chunks, layer_major=False):
    """Objects back to back in key order, as one store's reserve places them
    (layerwise: chunk-major, each chunk's layer objects side by side); with
    ``layer_major``, each layer's objects of all chunks side by side instead."""
    size = fmt.object_bytes
    if fmt.layerwise:
        layers = fmt.num_layers
        return [tuple((l * chunks + c if layer_major else c * layers + l) * size
                      for l in range(layers)) for c in range(chunks)]
    return [(c * size,) for c in range(chunks)]


def chunks_of(ids, offsets, bpc, cls):
    return [cls(tuple(ids[c * bpc:(c + 1) * bpc]), offsets[c]) for c in range(len(offsets))]


def layer_ms(handle):
    times = handle.device_layer_times_s()
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def run_loads(engine, requests, threads):
    """Submit ``requests`` (lists of ChunkLoad) at once; per request: wall
    seconds to completion, device seconds, per-layer ms."""
    torch.cuda.synchronize()
    handles = [None] * len(requests)
    barrier = threading.Barrier(len(requests)) if threads else None
    start = time.perf_counter()

    def submit(i):
        if barrier:
            barrier.wait()
        handles[i] = engine.submit_load(requests[i])

    if threads:
        pool = [threading.Thread(target=submit, args=(i,)) for i in range(len(requests))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    else:
        for i in range(len(requests)):
            submit(i)
    done_at = []
    for h in handles:
        assert h.wait_all(120) and h.error is None, h.error
        done_at.append(time.perf_counter() - start)
    return handles, done_at, time.perf_counter() - start


def verify(engine, src_ids, dst_ids):
    s = torch.tensor(src_ids, device="cuda")
    d = torch.tensor(dst_ids, device="cuda")
    return all(torch.equal(v.index_select(0, s), v.index_select(0, d))
               for v in engine.block_views)


def bench_format(engine_for, fmt, src_ids, dst_ids, chunks, repeat, layer_major=False):
    offsets = place(fmt, chunks, layer_major)
    bpc = fmt.blocks_per_chunk
    engine = engine_for(fmt)
    t = time.perf_counter()
    store = engine.submit_store(chunks_of(src_ids, offsets, bpc, ChunkStore))
    assert store.wait(120), store.error
    store_s = time.perf_counter() - t
    load = chunks_of(dst_ids, offsets, bpc, ChunkLoad)
    walls, devs, per_layer = [], [], []
    for _ in range(repeat):
        handles, _, wall = run_loads(engine, [load], threads=False)
        walls.append(wall)
        devs.append(handles[0].device_layer_times_s()[-1])
        per_layer.extend(layer_ms(handles[0]))
    ok = verify(engine, src_ids, dst_ids)
    nbytes = handles[0].nbytes
    issue = getattr(engine, "last_issue_s", None)  # copy thread's host time, last load
    return engine, load, {
        "bytes": nbytes,
        "store_gbps": nbytes / store_s / GB,
        "load_wall_s_best": min(walls),
        "load_gbps_wall": nbytes / min(walls) / GB,
        "load_gbps_device": nbytes / min(devs) / GB,
        "per_layer_ms_median": statistics.median(per_layer),
        "bytes_verified": ok,
        "copy_2d": engine.copy_2d_backend,
        "copy_thread_issue_ms": None if issue is None else issue * 1000,
    }


def concurrency(engine, fmt, offsets, perm, tokens_blocks, n, repeat):
    """``n`` loads at once, submitted one after another from one thread (as
    the worker half's ``start_load_kv`` and its loader thread submit them),
    and from ``n`` threads at once (keys ``"<n>_threads"``)."""
    bpc = fmt.blocks_per_chunk
    out = {}
    for count, threads in ((1, False), (n, False), (n, True)):
        requests = [chunks_of(perm[(i + 1) * tokens_blocks:(i + 2) * tokens_blocks],
                              offsets, bpc, ChunkLoad) for i in range(count)]
        best = None
        for _ in range(repeat):
            handles, done_at, wall = run_loads(engine, requests, threads=threads)
            layers = [statistics.median(layer_ms(h)) for h in handles]
            total = sum(h.nbytes for h in handles)
            row = {
                "per_layer_ms_median": statistics.median(layers),
                "per_layer_ms_max": max(layers),
                "first_done_s": min(done_at),
                "last_done_s": max(done_at),
                "aggregate_gbps": total / wall / GB,
            }
            if best is None or row["last_done_s"] < best["last_done_s"]:
                best = row
        out[f"{count}_threads" if threads else str(count)] = best
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--kind", default="packed_lbnhc", choices=sorted(ORDERS))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--group-below-mib", type=float, default=None,
                   help="experiment: load layers smaller than this in groups (the engine's "
                        "GROUP_BELOW_BYTES, 8 MiB)")
    args = ap.parse_args()
    if args.group_below_mib is not None:
        import maru_connector.transfer.cuda as cuda_engine
        cuda_engine.GROUP_BELOW_BYTES = int(args.group_below_mib * (1 << 20))

    tokens_blocks = args.tokens // args.block_size
    num_blocks = tokens_blocks * (args.concurrency + 1)
    result = {
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "args": vars(args),
    }
    result["pinned_peak_gbps"] = pinned_peak(1 << 30)
    kv = make_kv(args.kind, args.layers, num_blocks, args.kv_heads, args.block_size,
                 args.head_size)
    layout = detect_kv_layout(kv)
    chunks = args.tokens // args.chunk_tokens
    probe = ObjectFormat(layout, args.chunk_tokens, False)
    pool = Pool(chunks * probe.object_bytes + (2 << 20))
    result["pool"] = {"kind": pool.kind, "bytes": pool.map.size()}
    perm = list(range(num_blocks))
    random.Random(0).shuffle(perm)
    src_ids, dst_ids = perm[:tokens_blocks], perm[tokens_blocks:2 * tokens_blocks]
    engines = []

    def engine_for(fmt, **options):
        t = time.perf_counter()
        engines.append(create_engine(pool.buffer, kv, fmt, timing=True, **options))
        if len(engines) == 1:
            result["register_and_create_s"] = time.perf_counter() - t
        return engines[-1]

    try:
        formats = {}
        for name, layerwise, layer_major in (("chunkwise", False, False),
                                             ("layerwise", True, False),
                                             ("layerwise_layer_major", True, True)):
            fmt = ObjectFormat(layout, args.chunk_tokens, layerwise)
            engine, _, row = bench_format(engine_for, fmt, src_ids, dst_ids, chunks, args.repeat,
                                          layer_major)
            row["ratio_to_pinned_peak"] = row["load_gbps_wall"] / result["pinned_peak_gbps"]
            formats[name] = row
            if name == "chunkwise":
                result["registered_pool_64MiB_gbps"] = timed_copy_gbps(
                    torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                    engine.pool[: 64 << 20], 10)
                result["concurrency_chunkwise"] = concurrency(
                    engine, fmt, place(fmt, chunks), perm, tokens_blocks, args.concurrency,
                    args.repeat)
        fmt = ObjectFormat(layout, args.chunk_tokens, False)
        _, _, row = bench_format(lambda f: engine_for(f, copy_2d=False), fmt, src_ids,
                                 dst_ids, chunks, args.repeat)
        row["ratio_to_pinned_peak"] = row["load_gbps_wall"] / result["pinned_peak_gbps"]
        formats["chunkwise_row_copies"] = row
        result["formats"] = formats
    finally:
        for engine in reversed(engines):
            engine.close()
        pool.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
