"""The longest event-loop step of the largest retrieve and match_prefix.

    PYTHONPATH=core .venv/bin/python bench/index_large_reads.py [--keys 131072]

Drives a ``Registry`` directly (no sockets): a pool of committed one-page
objects, then the whole calls and their sliced forms (``retrieve_sliced``,
``match_prefix_sliced``, 8,192 keys per step, as the server runs a request
of more than 2,048 keys), printing each one's time and its longest step.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from maru_core.index.registry import Registry
from maru_core.pool.geometry import DATA_ALIGN, PoolGeometry

PAGE = 4096


def steps(gen) -> list[float]:
    """Seconds of each step of a sliced call, run to its end."""
    times = []
    while True:
        start = time.perf_counter()
        try:
            next(gen)
        except StopIteration:
            times.append(time.perf_counter() - start)
            return times
        times.append(time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.keys
    geometry = PoolGeometry.plan(4 * DATA_ALIGN + (n + 100) * PAGE + (64 << 20), PAGE)
    reg = Registry(geometry, lease_ttl_s=1000, reservation_ttl_s=1000, high_watermark=1.0,
                   low_watermark=1.0)
    lease = reg.open_lease("bench")
    keys = os.urandom(16 * n)
    reg.reserve_packed(lease, keys, np.ones(n, dtype=np.int64))
    reg.commit(lease, keys)
    for _ in range(args.repeats):
        t = time.perf_counter()
        reg.match_prefix(keys)
        match_whole = time.perf_counter() - t
        t = time.perf_counter()
        reg.retrieve(lease, keys)
        retrieve_whole = time.perf_counter() - t
        reg.unpin(lease, keys)
        match = steps(reg.match_prefix_sliced(keys, 8192))
        retrieve = steps(reg.retrieve_sliced(lease, keys, 8192))
        reg.unpin(lease, keys)
        print(f"{n} keys: whole match_prefix {match_whole * 1e3:.1f} ms, retrieve "
              f"{retrieve_whole * 1e3:.1f} ms | sliced: match_prefix {len(match)} steps, "
              f"longest {max(match) * 1e3:.2f} ms; retrieve {len(retrieve)} steps, longest "
              f"{max(retrieve) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
