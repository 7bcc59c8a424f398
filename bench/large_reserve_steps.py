"""The longest steps of a large reserve, as the index runs it a slice per step
(``Registry.reserve_sliced``): the step that places the whole batch, the one that
grows the record table, the slices that add records. Each is a turn of the index's
loop that every other peer's request may wait for.

A reserve of ``--keys`` one-page objects (a flood's: 131,072) into a pool of
``--pages`` pages, at the served index's quotas (a lease and a peer may hold half
the pool), slices of 512 keys (a contended loop's), from a fresh registry that
holds ``--stored`` committed objects; ``--runs`` times after one to warm up.
Printed per run: the five longest steps in ms, each with the line its generator
stood at before it (the placement's step follows the last look-up slice).

    PYTHONPATH=core .venv/bin/python bench/large_reserve_steps.py [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from maru_core.index.registry import MAX_LEASE_POOL_FRACTION, Registry
from maru_core.pool.geometry import PoolGeometry
from loop_steps import where

_PAGE = 4096


def longest_steps(keys: int, pages: int, stored: int, slice_keys: int, seed: int) -> list[tuple[float, str]]:
    """The five longest steps of one large reserve, in ms, with where each began."""
    geometry = PoolGeometry.plan(pages * _PAGE + 64 * 1024 * 1024, page_size=_PAGE)
    registry = Registry(geometry, max_lease_pages_fraction=MAX_LEASE_POOL_FRACTION,
                        max_peer_pages_fraction=MAX_LEASE_POOL_FRACTION)  # fmt: skip
    writer = registry.open_lease("writer", peer="writer")
    kept = np.random.default_rng(seed).bytes(16 * stored)
    registry.reserve_packed(writer, kept, np.full(stored, _PAGE))
    registry.commit(writer, kept)
    flood = registry.open_lease("flood", peer="flood")
    batch = np.random.default_rng(seed + 1).bytes(16 * keys)
    steps = registry.reserve_sliced(flood, batch, np.ones(keys, dtype=np.int64), slice_keys)
    timed, running = [], True
    while running:
        stood = where(steps)
        began = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            running = False
        timed.append((round(1000 * (time.perf_counter() - began), 3), stood))
    return sorted(timed, reverse=True)[:5]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=131_072)
    parser.add_argument("--pages", type=int, default=65_536)
    parser.add_argument("--stored", type=int, default=10_000)
    parser.add_argument("--slice-keys", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    longest_steps(args.keys, args.pages, args.stored, args.slice_keys, seed=99)  # warm-up: numpy's first calls
    runs = []
    for run in range(args.runs):
        runs.append(longest_steps(args.keys, args.pages, args.stored, args.slice_keys, seed=2 * run))
        print(f"run {run + 1}: {runs[-1]}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "runs": runs}, fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
