"""Benchmark of the sidecar's paths: recording a counter, scraping N regions, one pool hand-off.

    python -m maru_sidecar.bench [--regions 1 8 64] [--handoffs 200]

Prints one line per figure. Everything runs on this machine in temporary
directories; the pool is a small file in /dev/shm, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from maru_core.handoff import fetch_pool
from maru_core.pool import Pool
from maru_core.stats import ConnectorStats
from maru_core.stats_aggregate import RegionAggregator
from maru_sidecar.collector import ConnectorCollector
from maru_sidecar.handoff_server import HandoffServer, PoolOffer


def per_call_ns(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def bench_recording(directory: Path, calls: int) -> None:
    for label, stats in (("in memory", ConnectorStats()), ("shared region", ConnectorStats(directory))):
        lookup = per_call_ns(lambda: stats.record_lookup(128), calls)
        load = per_call_ns(lambda: stats.record_load(1 << 20, 0.004), calls)
        wait = per_call_ns(lambda: stats.record_layer_wait(0.0001), calls)
        print(f"record, {label}: lookup {lookup:.0f} ns, load {load:.0f} ns, layer wait {wait:.0f} ns per call")
        stats.close()


def bench_scrape(directory: Path, counts: list[int], scrapes: int) -> None:
    labels = {"cache": "bench", "namespace": "bench", "pod": "bench"}
    for count in counts:
        sub = directory / f"regions-{count}"
        sub.mkdir()
        writers = [ConnectorStats(sub) for _ in range(count)]
        for w in writers:
            w.record_lookup(1)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ConnectorCollector(RegionAggregator(sub).scan, labels))
        ms = per_call_ns(lambda: generate_latest(registry), scrapes) / 1e6
        print(f"scrape of /metrics with {count} live regions: {ms:.2f} ms")
        for w in writers:
            w.close()


def bench_handoff(directory: Path, handoffs: int) -> None:
    """A pool that is its whole file, and a pool that is the second 64 MiB region of a file (a shared device)."""
    size = 64 * 1024 * 1024
    pool_path = f"/dev/shm/maru-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    device_path = pool_path + ".device"
    with open(device_path, "wb") as device:
        device.truncate(2 * size)
    pools = {"whole file": Pool.create(pool_path, size=size),
             "region at offset 64 MiB": Pool.create(device_path, size, offset=size)}  # fmt: skip
    try:
        for label, pool in pools.items():
            _bench_one_handoff(directory, label, pool, handoffs)
    finally:
        for pool in pools.values():
            pool.close()
        os.unlink(pool_path)
        os.unlink(device_path)


def _bench_one_handoff(directory: Path, label: str, pool: Pool, handoffs: int) -> None:
    offer = PoolOffer(fd=pool.fileno(), geometry=pool.geometry.to_dict(), pool_path=pool.where,
                      pool_offset=pool.offset)  # fmt: skip
    sock = directory / "h.sock"
    server = HandoffServer(sock, cache="bench", index_url="tcp://127.0.0.1:1", stats_dir=directory,
                           offer=lambda: offer, read_token=lambda: "t")  # fmt: skip
    server.start()
    try:

        def one() -> None:
            fetch_pool(str(sock), "t", "bench", timeout_s=5.0).open_pool().close()

        ms = per_call_ns(one, handoffs) / 1e6
        print(f"hand-off of a {label} (connect, request, receive fd, map and validate): {ms:.3f} ms")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--handoffs", type=int, default=200)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="maru-bench-", dir="/tmp") as tmp:
        directory = Path(tmp)
        bench_recording(directory, args.calls)
        bench_scrape(directory, args.regions, args.scrapes)
        bench_handoff(directory, args.handoffs)


if __name__ == "__main__":
    main()
