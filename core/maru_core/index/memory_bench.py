"""How much memory and time the registry needs per key (called by the index benchmark).

``bytes_per_key`` measures with ``tracemalloc`` (numpy's arrays are traced
too) everything the registry holds for ``n_keys`` committed keys: the keys
themselves (created inside the measurement, as the server's decoder would,
and then held by the registry alone), the index dict, the record arrays,
the allocator and the leases.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import time
import tracemalloc

import numpy as np

from maru_core.index.registry import Registry
from maru_core.pool.geometry import PoolGeometry

_BATCH = 8192
_OBJECT_BYTES = 64 * 1024
_SMALL_BATCH = 64  # keys of a small store: a step's few chunks


def _keys(start: int, count: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(start, start + count)]


def _geometry(n_keys: int, object_bytes: int) -> PoolGeometry:
    # Room for every object below the high watermark, so nothing is evicted.
    size = int(n_keys * object_bytes / 0.9) + 64 * 1024 * 1024
    return PoolGeometry.plan(size, page_size=object_bytes)


def filled_registry(n_keys: int, object_bytes: int = _OBJECT_BYTES) -> tuple[Registry, str]:
    """A registry holding ``n_keys`` committed objects of ``object_bytes``, and an open lease."""
    registry = Registry(_geometry(n_keys, object_bytes))
    lease = registry.open_lease("bench")
    for start in range(0, n_keys, _BATCH):
        keys = _keys(start, min(_BATCH, n_keys - start))
        registry.reserve(lease, [(k, object_bytes) for k in keys])
        registry.commit(lease, keys)
    return registry, lease


def bytes_per_key(n_keys: int) -> float:
    """Bytes of traced memory the registry holds per committed key, with ``n_keys`` keys."""
    if n_keys <= 0:
        raise ValueError(f"n_keys must be positive, got {n_keys}")
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        registry, _ = filled_registry(n_keys)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    if registry.stats().keys != n_keys:
        raise RuntimeError(f"expected {n_keys} committed keys, the registry holds {registry.stats().keys}")
    return held / n_keys


def retrieve_seconds(n_keys: int, batch: int = 8000, repeats: int = 50) -> dict[str, float]:
    """Registry time of ``retrieve`` (keys as a list, and packed) and ``unpin`` of ``batch`` keys out
    of ``n_keys``, and of ``reserve`` + ``commit`` of ``batch`` new keys and of 64 (with the checks
    the server passes): medians (and the best retrieve)."""
    registry, lease = filled_registry(n_keys)
    keys = _keys(n_keys // 2, batch)
    packed = b"".join(keys)
    retrieve, unpin, retrieve_packed = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        registry.retrieve(lease, packed)
        retrieve_packed.append(time.perf_counter() - t0)
        registry.unpin(lease, packed)
        t0 = time.perf_counter()
        locations = registry.retrieve(lease, keys)
        t1 = time.perf_counter()
        registry.unpin(lease, keys)
        t2 = time.perf_counter()
        if locations.misses():
            raise RuntimeError("benchmark keys missing from the registry")
        retrieve.append(t1 - t0)
        unpin.append(t2 - t1)
    store = []
    for r in range(repeats):
        fresh = _keys(10**9 + r * batch, batch)
        t0 = time.perf_counter()
        registry.reserve(lease, [(k, _OBJECT_BYTES) for k in fresh])
        registry.commit(lease, fresh)
        store.append(time.perf_counter() - t0)
    small = []  # a step's few stores, checked and recorded as the server commits them
    for r in range(repeats):
        fresh = _keys(2 * 10**9 + r * _SMALL_BATCH, _SMALL_BATCH)
        t0 = time.perf_counter()
        registry.reserve(lease, [(k, _OBJECT_BYTES) for k in fresh])
        registry.commit(lease, fresh, verify=_all_good, record=lambda offsets: None)
        small.append(time.perf_counter() - t0)
    retrieve.sort()
    unpin.sort()
    store.sort()
    small.sort()
    retrieve_packed.sort()
    return {
        "retrieve_packed_median_s": retrieve_packed[len(retrieve_packed) // 2],
        "retrieve_median_s": retrieve[len(retrieve) // 2],
        "retrieve_best_s": retrieve[0],
        "unpin_median_s": unpin[len(unpin) // 2],
        "reserve_commit_median_s": store[len(store) // 2],
        f"reserve_commit_{_SMALL_BATCH}_median_s": small[len(small) // 2],
    }


def growth_steps(n_keys: int, batch: int = _BATCH) -> dict:
    """Fill a registry with ``n_keys`` committed keys, ``batch`` at a time,
    timing each reserve + commit (each a single step of the index's loop,
    which serves no one else meanwhile): the batches during which the key
    table began a rebuild or did a share of one, the median of the
    batches that did neither, for scale, and the longest batch of all."""
    registry = Registry(_geometry(n_keys, _OBJECT_BYTES))
    lease = registry.open_lease("bench")
    records = registry._records  # read for its state only
    steps: list[dict] = []
    plain: list[float] = []
    longest = 0.0
    for start in range(0, n_keys, batch):
        keys = _keys(start, min(batch, n_keys - start))
        slots, under_way = records.key_slots, records.key_table_rebuilding
        t0 = time.perf_counter()
        registry.reserve(lease, [(k, _OBJECT_BYTES) for k in keys])
        registry.commit(lease, keys)
        seconds = time.perf_counter() - t0
        longest = max(longest, seconds)
        began = records.key_table_rebuilding or records.key_slots != slots
        did = "worked on a rebuild" if under_way else "began a rebuild" if began else None
        if did:
            steps.append({"rows_before": start, "key_slots": records.key_slots, "did": did, "seconds": seconds})
        else:
            plain.append(seconds)
    plain.sort()
    return {"keys": n_keys, "batch": batch, "rebuild_steps": steps,
            "plain_batch_median_s": plain[len(plain) // 2] if plain else None, "longest_batch_s": longest}


def _all_good(joined: bytes, offsets: np.ndarray, generations: np.ndarray) -> np.ndarray:
    return np.ones(len(offsets), dtype=bool)


def main(argv: list[str] | None = None) -> None:
    """``python -m maru_core.index.memory_bench``: print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="committed keys in the registry")
    parser.add_argument("--batch", type=int, default=8000, help="keys per retrieve / reserve")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--growth", action="store_true",
                        help="instead: time each batch of a fill, those that rebuilt the key table listed")
    args = parser.parse_args(argv)
    if args.growth:
        print(json.dumps(growth_steps(args.keys, args.batch), indent=1))
        return
    figures = {"keys": args.keys, "batch": args.batch, "bytes_per_key": bytes_per_key(args.keys)}
    figures.update(retrieve_seconds(args.keys, args.batch, args.repeats))
    figures.update(python=platform.python_version(), cpu=platform.processor() or platform.machine())
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
