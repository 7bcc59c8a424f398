"""What a hit's load and a store cost in a process whose mapping of the
pool is cold, and with the pool's pages mapped ahead (``maru_prefault_pool``,
CPU backend).

A pool file in /dev/shm holds chunkwise objects of a Llama-shaped model in
vLLM's CPU KV layout, written through another mapping (as another engine
stores them). Each round attaches the pool afresh, as a new worker does, so
its page tables are empty, builds the CPU transfer engine with the prefault
off or on (then waits until it has mapped the pool, as in an engine that has
been up for a moment), and times one hit of ``--tokens`` tokens: the payload
checksums and the copy, as a verified load (the CPU default) runs them; the
copy alone; or a store of as many tokens into the same slots (a miss's
copies into the pool), each in rounds of its own. Rounds alternate off and
on.

    .venv/bin/python bench/prefault_cpu.py --tokens 4096 16384 --rounds 6
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
from maru_core.pool import Pool
from payload_checksum import BLOCK, CHUNK, make_kv  # the layout of the CPU TTFT table

from maru_connector.transfer import ChunkLoad, TransferEngine, create_engine


def timed_round(path: str, fmt, kv, offsets: list[int], prefault: bool, what: str) -> dict:
    """One hit (``verified`` or ``copy``) or ``store`` in a fresh mapping:
    seconds to map the pool ahead, seconds of the copies."""
    pool = Pool.attach(path)
    start = time.perf_counter()
    engine = create_engine(pool.buffer, kv, fmt, prefault=prefault)
    try:
        ahead_s = 0.0
        if prefault:  # from the engine's start until the whole pool is mapped
            engine.prefaulter.wait()
            ahead_s = time.perf_counter() - start
        bpc = CHUNK // BLOCK
        chunks = [ChunkLoad(tuple(range(i * bpc, (i + 1) * bpc)), (off,))
                  for i, off in enumerate(offsets)]
        start = time.perf_counter()
        if what == "verified":
            for off in offsets:
                pool.payload_checksum(off, fmt.object_bytes)
        if what == "store":
            handle = engine.submit_store(chunks)
            handle.wait()
        else:
            handle = engine.submit_load(chunks)
            handle.wait_all()
        copies_s = time.perf_counter() - start
        if handle.error is not None:
            raise RuntimeError(repr(handle.error))
        return {"ahead_s": ahead_s, "copies_s": copies_s, "pool_bytes": engine.pool_size}
    finally:
        engine.close()
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each variant, alternating")
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()

    most = max(args.tokens) // CHUNK
    kv = make_kv(blocks=most * (CHUNK // BLOCK))
    fmt = TransferEngine.detect(kv, CHUNK, False, BLOCK)
    path = f"/dev/shm/maru-bench-prefault-{uuid.uuid4().hex}"
    writer = Pool.create(path, args.pool_mib << 20, page_size=64 << 10)
    rows = {}
    try:
        g = writer.geometry
        # the hit's objects spread over the pool, as stores of many prompts leave them
        step = max(1, (g.size - g.data_offset) // fmt.object_bytes // most)
        offsets = [g.data_offset + i * step * fmt.object_bytes for i in range(most)]
        for off in offsets:
            writer.view(off, fmt.object_bytes)[:] = os.urandom(fmt.object_bytes)
        for tokens in args.tokens:
            n = tokens // CHUNK
            for what in ("verified", "copy", "store"):
                runs = {False: [], True: []}
                for r in range(args.rounds):
                    for prefault in ((False, True) if r % 2 == 0 else (True, False)):
                        runs[prefault].append(timed_round(path, fmt, kv, offsets[:n], prefault, what))
                cold = statistics.median(x["copies_s"] for x in runs[False])
                warm = statistics.median(x["copies_s"] for x in runs[True])
                ahead = statistics.median(x["ahead_s"] for x in runs[True])
                pool_gib = runs[True][0]["pool_bytes"] / (1 << 30)
                key = f"{tokens}/{what}"
                rows[key] = {
                    "bytes": n * fmt.object_bytes,
                    "cold_ms": [round(x["copies_s"] * 1e3, 2) for x in runs[False]],
                    "prefaulted_ms": [round(x["copies_s"] * 1e3, 2) for x in runs[True]],
                    "cold_median_ms": round(cold * 1e3, 2),
                    "prefaulted_median_ms": round(warm * 1e3, 2),
                    "prefaulted_over_cold": round(warm / cold, 3),
                    "map_ahead_s_per_gib": round(ahead / pool_gib, 3),
                }
                print(f"{key:>16}: cold {cold * 1e3:7.2f} ms, prefaulted {warm * 1e3:7.2f} ms "
                      f"({warm / cold:.2f}); mapping ahead took {ahead / pool_gib:.2f} s/GiB",
                      flush=True)
    finally:
        writer.close()
        os.unlink(path)
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, kernel {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pool_mib": args.pool_mib,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
