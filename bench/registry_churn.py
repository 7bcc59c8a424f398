"""A full cache's registry as it stores: what each small store holds the event loop for.

The registry is filled to its high watermark, then stores (reserve + commit of
``--batch`` keys) go on for ``--stores`` rounds, so the pool evicts a tenth of
itself (the watermarks' gap) every so often and its key table sees as many
removals as additions. Printed: the stores' p50, p99.9 and longest, the
evictions, and how often a rebuild of the key table began (each drained over
the stores after it, so its cost shows in their times).

    PYTHONPATH=core .venv/bin/python bench/registry_churn.py [--keys 1000000] [--stores 6000] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from maru_core.index.memory_bench import _keys
from maru_core.index.registry import Registry
from maru_core.pool.geometry import PoolGeometry

_PAGE = 4096


def churn(n_keys: int, stores: int, batch: int) -> dict:
    geometry = PoolGeometry.plan(n_keys * _PAGE + 64 * 1024 * 1024, page_size=_PAGE)
    registry = Registry(geometry)  # the default watermarks: 0.95 / 0.85
    lease = registry.open_lease("bench")
    full, start = int(0.95 * geometry.num_pages) - 100, 0
    while (held := registry.stats().keys) < full:
        keys = _keys(start, min(8192, full - held))
        start += len(keys)
        registry.reserve(lease, [(k, _PAGE) for k in keys])
        registry.commit(lease, keys)
    index, rebuilds = registry._records._index, []
    begin = index._begin_rebuild

    def counted_rebuild(rows: int, live: int) -> None:
        rebuilds.append(rows)
        begin(rows, live)

    index._begin_rebuild = counted_rebuild  # type: ignore[method-assign]
    times = []
    for i in range(stores):
        keys = _keys(start, batch)
        start += batch
        began = time.perf_counter()
        registry.reserve(lease, [(k, _PAGE) for k in keys])
        registry.commit(lease, keys)
        times.append(time.perf_counter() - began)
        if (i + 1) % 1000 == 0:
            print(f"  {i + 1} stores, {registry.stats().evictions} evicted", file=sys.stderr, flush=True)
    times.sort()
    return {"keys": n_keys, "stores": stores, "batch": batch,
            "p50_ms": 1e3 * times[len(times) // 2], "p999_ms": 1e3 * times[int(len(times) * 0.999)],
            "max_ms": 1e3 * times[-1], "evictions": registry.stats().evictions,
            "rebuilds_begun": len(rebuilds), "tombstones_left": index.table.tombstones}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="objects the pool holds when full")
    parser.add_argument("--stores", type=int, default=6000, help="stores after the pool is full")
    parser.add_argument("--batch", type=int, default=64, help="keys per store")
    args = parser.parse_args(argv)
    print(json.dumps(churn(args.keys, args.stores, args.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
