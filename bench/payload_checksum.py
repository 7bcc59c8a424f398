"""What the payload checksum costs per GB, against the copy it guards (CPU backend).

A pool file in /dev/shm holds objects of a Llama-shaped model in vLLM's CPU
KV layout (``--layerwise`` for one object per layer). In one run and on the
same bytes, it times:

- ``checksum``: ``Pool.payload_checksum`` over every object (the position
  sum, numpy, one thread: what a store adds after its copy);
- ``load``: the CPU transfer engine copying the same objects into a paged
  KV cache (what a hit costs the connector without the check);
- ``verified load``: the same loads verified as the connector runs them
  (``submit_load(..., check=...)``: the copy thread sums the blocks it
  copied, run by run, and compares before it marks each layer);
- ``xxh3``: the older writers' XXH3-64 over the same objects, for reference
  (only with ``xxhash`` installed).

and prints both per GB and their ratio, plus what the check adds to the
4096-token hit of the TTFT table (``--hit-ms``, ``--hit-bytes``), and what
one batch of every object costs on 1, 2, ... ``--threads`` checksum threads
(``payload_checksums``, as a store and a verified load compute them).

    .venv/bin/python bench/payload_checksum.py        # --mib 256 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid

import torch
from maru_core.pool import ChecksumKind, Pool
from maru_core.pool.checksum import payload_checksums

from maru_connector.transfer import ChunkLoad, PayloadCheck, TransferEngine, create_engine

LAYERS, HEADS, HEAD, BLOCK, CHUNK = 4, 8, 64, 32, 256  # BENCH_SPEC of the TTFT table


def make_kv(blocks: int) -> dict[str, torch.Tensor]:
    shape = (blocks, HEADS, BLOCK, 2 * HEAD)
    backing = torch.randn((LAYERS, *shape), dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": backing[i] for i in range(LAYERS)}


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes of objects to check and load")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hit-ms", type=float, default=63.4, help="a measured hit's TTFT")
    parser.add_argument("--hit-bytes", type=int, default=4096 * 8192, help="bytes that hit loaded")
    parser.add_argument("--threads", type=int, default=2, help="most checksum threads to time a batch on")
    parser.add_argument("--layerwise", action="store_true", help="one object per (chunk, layer)")
    args = parser.parse_args()

    bpc = CHUNK // BLOCK
    kv = make_kv(blocks=4 * bpc)
    fmt = TransferEngine.detect(kv, CHUNK, args.layerwise, BLOCK)
    per = fmt.objects_per_chunk
    n_objects = max(1, (args.mib << 20) // fmt.object_bytes)
    path = f"/dev/shm/maru-bench-checksum-{uuid.uuid4().hex}"
    pool = Pool.create(path, n_objects * fmt.object_bytes + (64 << 20), page_size=64 << 10)
    try:
        g = pool.geometry
        offsets = [g.data_offset + i * fmt.object_bytes for i in range(n_objects)]
        for off in offsets:
            pool.view(off, fmt.object_bytes)[:] = os.urandom(fmt.object_bytes)
        nbytes = n_objects * fmt.object_bytes
        # Normal priority: at idle priority (the default) the load thread runs only
        # where the other processes of a busy machine leave a core idle.
        engine = create_engine(pool.buffer, kv, fmt, copy_priority="normal")

        def checksum_all() -> None:
            for off in offsets:
                pool.payload_checksum(off, fmt.object_bytes)

        sums = dict(zip(offsets, pool.payload_checksums(offsets, fmt.object_bytes)))

        def load_all(verify: bool = False) -> None:
            for start in range(0, n_objects - n_objects % per, 4 * per):  # 4 chunks a load
                group = offsets[start : start + 4 * per]
                chunks = [ChunkLoad(tuple(range(i * bpc, (i + 1) * bpc)), tuple(group[i * per : (i + 1) * per]))
                          for i in range(len(group) // per)]
                check = PayloadCheck.of([sums[o] for o in group]) if verify else None
                handle = engine.submit_load(chunks, check=check)
                handle.wait_all()
                if handle.error is not None:
                    raise RuntimeError(repr(handle.error))

        checksum_all(), load_all()  # warm up
        views = [pool.view(off, fmt.object_bytes) for off in offsets]
        batch_s = {n: median_s(lambda: payload_checksums(views, threads=n), args.repeats)
                   for n in range(1, args.threads + 1)}
        for view in views:
            view.release()
        check_s = median_s(checksum_all, args.repeats)
        plain, verified = [], []
        for _ in range(args.repeats):  # alternating, so both see the same machine
            plain.append(median_s(load_all, 1))
            verified.append(median_s(lambda: load_all(verify=True), 1))
        load_s, verified_s = statistics.median(plain), statistics.median(verified)
        paired = statistics.median(v / p for p, v in zip(plain, verified))
        try:
            xxh3_s = median_s(lambda: pool.payload_checksums(offsets, fmt.object_bytes, kind=ChecksumKind.XXH3_64),
                              args.repeats)
        except ImportError:
            xxh3_s = None
        engine.close()
    finally:
        pool.close()
        os.unlink(path)
    gb = nbytes / 1e9
    hit_check_ms = args.hit_bytes / 1e9 * check_s / gb * 1000
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytes": nbytes,
        "object_bytes": fmt.object_bytes,
        "checksum_gb_per_s": round(gb / check_s, 2),
        "checksum_s_per_gb": round(check_s / gb, 4),
        "batch_gb_per_s_by_threads": {n: round(gb / t, 2) for n, t in batch_s.items()},
        "load_gb_per_s": round(gb / load_s, 2),
        "load_s_per_gb": round(load_s / gb, 4),
        "checksum_over_load": round(check_s / load_s, 3),
        "verified_load_s_per_gb": round(verified_s / gb, 4),
        "verified_over_plain_load": round(paired, 3),  # median of the alternating pairs' ratios
        "layerwise": args.layerwise,
        "xxh3_s_per_gb": round(xxh3_s / gb, 4) if xxh3_s else None,
        "hit_ms": args.hit_ms,
        "checksum_ms_for_that_hit": round(hit_check_ms, 2),
        "checksum_share_of_hit": round(hit_check_ms / args.hit_ms, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
