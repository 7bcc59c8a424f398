"""``marucache bench index``: latency of the index over loopback, and its memory per key.

Starts a real ``marucache index`` process on a temporary pool in
``/dev/shm``, stores the objects of a 64k-token prompt (250 chunks of 256
tokens; layerwise, 32 layers: 8,000 keys), then times round trips from this
process through ``IndexClient`` — request encoding, the socket, the server's
validation and registry, the reply and its decoding:

- ``retrieve_layerwise_8000`` / ``retrieve_chunkwise_250``: retrieve (pins;
  the unpin that follows is not timed);
- ``match_prefix_layerwise_8000`` / ``match_prefix_chunkwise_250``;
- ``reserve_layerwise_8000`` / ``commit_layerwise_8000``: a store of 8,000
  new objects (up to 12 times, not ``--repeats``);
- ``memory_per_key``: bytes the registry holds per committed key at one
  million keys (``maru_core.index.memory_bench.bytes_per_key``).

``keys_per_s`` is ``keys / p50``. Targets: retrieve of 8,000 keys under
1 ms p50; at most 256 bytes per key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from maru_core.keys import Key

TARGET_RETRIEVE_8000_P50_MS = 1.0
TARGET_BYTES_PER_KEY = 256.0
CHUNKS = 250  # a 64k-token prompt in 256-token chunks
LAYERS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=["index"], help="what to benchmark")
    parser.add_argument("--json", action="store_true", help="one JSON object per line and case on stdout")
    parser.add_argument("--repeats", type=int, default=300, help="timed round trips per case (default 300)")
    parser.add_argument("--memory-keys", type=int, default=1_000_000,
                        help="keys for the memory-per-key figure (default 1,000,000; 0 skips it)")


def bench_keys() -> tuple[list[Key], list[Key]]:
    """(chunk keys, layerwise keys) of a fixed 64k-token prompt, derived as the connector does."""
    from maru_core.keys import KeyNamespace, chunk_keys, layer_key

    ns = KeyNamespace(model="marucache-bench", dtype="bfloat16", kv_dtype="bfloat16", layout="bench",
                      block_size=16, chunk_tokens=256, fmt="layerwise")  # fmt: skip
    chunks = chunk_keys(ns, [(i * 31) % 50000 for i in range(CHUNKS * 256)])
    return chunks, [layer_key(c, layer) for c in chunks for layer in range(LAYERS)]


def _store(client: Any, pool: Any, keys: Sequence[bytes], length: int) -> None:
    from maru_core.pool import SlotHeader

    for start in range(0, len(keys), 4000):
        batch = keys[start : start + 4000]
        slots = client.reserve([(k, length) for k in batch])
        for k, slot in zip(batch, slots):
            pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=length))
        if not all(client.commit(batch)):
            raise RuntimeError("the benchmark could not store its objects")


def _time(fn: Callable[[], Any], after: Callable[[], Any] | None, repeats: int, progress: Any) -> list[float]:
    for _ in range(10):  # warm-up: caches, allocator, branch predictors
        fn()
        if after:
            after()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if after:
            after()
        progress.update(1)
    return samples


def _case(name: str, keys: int, samples: list[float], target_ms: float | None = None) -> dict[str, Any]:
    samples = sorted(samples)
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    row = {"case": name, "keys": keys, "p50_ms": round(p50 * 1e3, 4), "p99_ms": round(p99 * 1e3, 4),
           "keys_per_s": round(keys / p50)}  # fmt: skip
    if target_ms is not None:
        row["target_p50_ms"] = target_ms
        row["p50_to_target"] = round(p50 * 1e3 / target_ms, 3)
    return row


def _store_cases(client: Any, pool: Any, repeats: int) -> list[dict[str, Any]]:
    """``reserve_layerwise_8000`` / ``commit_layerwise_8000``: round trips of a
    store of 8,000 new objects (slot headers written in between, not timed;
    the commit checks them); each batch is evicted by the next ones' reserves."""
    from maru_core.pool import SlotHeader

    reserve, commit = [], []
    for r in range(repeats):
        keys = [hashlib.blake2b(b"bench-store-%d-%d" % (r, i), digest_size=16).digest() for i in range(8000)]
        t0 = time.perf_counter()
        slots = client.reserve([(k, 4096) for k in keys])
        reserve.append(time.perf_counter() - t0)
        if None in slots:
            raise RuntimeError(f"the benchmark's index gave {slots.count(None)} of 8,000 reserves no slot: "
                               f"{client.stats()}")
        for k, slot in zip(keys, slots):
            pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=4096))
        t0 = time.perf_counter()
        if not all(client.commit(keys)):
            raise RuntimeError("the benchmark could not store its objects")
        commit.append(time.perf_counter() - t0)
    return [_case("reserve_layerwise_8000", 8000, reserve), _case("commit_layerwise_8000", 8000, commit)]


def run_latency(repeats: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from maru_core.index.client import IndexClient
    from maru_core.index.launcher import IndexProcess, unique_shm_path
    from maru_core.pool import Pool

    chunks, layered = bench_keys()
    path = unique_shm_path("marucache-bench")
    # The store cases turn the pool over several times in a few seconds (their reserves evict the
    # earlier objects), faster than the eviction quotas let an engine: those are lifted (the whole
    # pool per call and per 0.1 s window); round trips are what is timed.
    index = IndexProcess(path, pool_size="128Mi", extra_args=[
        "--page-size", "4Ki", "--log-level", "WARNING", "--max-evict-fraction", "1",
        "--max-lease-evict-fraction", "1", "--max-peer-evict-fraction", "1", "--evict-window", "0.1"])
    rows = []
    try:
        index.start()
        assert index.url is not None  # start() raises unless the index printed its address
        with Pool.attach(path) as pool, IndexClient(index.url, client_name="bench") as client:
            _store(client, pool, layered, 4096)
            _store(client, pool, chunks, 4096)
            cases = [
                ("retrieve_layerwise_8000", layered, "retrieve", TARGET_RETRIEVE_8000_P50_MS),
                ("retrieve_chunkwise_250", chunks, "retrieve", None),
                ("match_prefix_layerwise_8000", layered, "match_prefix", None),
                ("match_prefix_chunkwise_250", chunks, "match_prefix", None),
            ]
            with tqdm(total=repeats * len(cases), desc="index round trips", unit="rt", file=sys.stderr,
                      leave=False) as progress:  # fmt: skip
                for name, keys, op, target in cases:
                    call = (lambda k=keys: client.retrieve(k)) if op == "retrieve" else (lambda k=keys: client.match_prefix(k))
                    after = (lambda k=keys: client.unpin(k)) if op == "retrieve" else None
                    rows.append(_case(name, len(keys), _time(call, after, repeats, progress), target))
            rows += _store_cases(client, pool, max(3, min(repeats, 12)))  # last: its stores evict the rest
    finally:
        index.stop()
        if os.path.exists(path):
            os.unlink(path)
    return rows


def run_memory(n_keys: int) -> dict[str, Any]:
    from maru_core.index.memory_bench import bytes_per_key

    print(f"measuring registry memory at {n_keys:,} keys ...", file=sys.stderr, flush=True)
    per_key = bytes_per_key(n_keys)
    return {"case": "memory_per_key", "keys": n_keys, "p50_ms": None, "p99_ms": None, "keys_per_s": None,
            "bytes_per_key": round(per_key, 1), "target_bytes_per_key": TARGET_BYTES_PER_KEY,
            "bytes_per_key_to_target": round(per_key / TARGET_BYTES_PER_KEY, 3)}  # fmt: skip


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"index benchmark on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    for row in rows:
        if row["case"] == "memory_per_key":
            print(f"  {row['case']:<30} {row['bytes_per_key']:>8.1f} B/key at {row['keys']:,} keys "
                  f"({row['bytes_per_key_to_target']:.2f} x the {TARGET_BYTES_PER_KEY:.0f} B target)")
            continue
        target = f"  ({row['p50_to_target']:.2f} x the {row['target_p50_ms']} ms target)" if "target_p50_ms" in row else ""
        print(f"  {row['case']:<30} {row['keys']:>6} keys  p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms"
              f"  {row['keys_per_s']:>12,} keys/s{target}")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.memory_keys < 0:
        print("marucache bench: error: --repeats must be at least 1 and --memory-keys at least 0", file=sys.stderr)
        return 2
    rows = run_latency(args.repeats)
    if args.json:  # stream the latency lines before the slower memory figure
        for row in rows:
            print(json.dumps(row), flush=True)
    if args.memory_keys:
        rows.append(run_memory(args.memory_keys))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        _print_table(rows)
    return 0
