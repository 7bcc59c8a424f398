"""One token holder against the others, on a real index over loopback: pins
without end, and reserves that would wipe the cache.

The memory test runs the index on a thread of this process (``ThreadedIndex``)
so that tracemalloc sees its allocations; the quota tests run ``marucache
index`` as its own process with its flags, and scrape its metrics.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
import urllib.request

import pytest
from quota_objects import numbered, store

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.index.launcher import ThreadedIndex
from maru_core.pool import Pool
from maru_tools.index_process import IndexProcess, free_port

TOKEN = "lease-quota-token-0123456789"


def test_pinning_the_same_keys_again_and_again_keeps_the_index_flat_and_bye_fast(make_pool):
    """Before, the index kept every occurrence of a pin: a client retrieving the
    same keys without unpinning grew it linearly (1,500 retrieves of 131,072
    keys: 1.55 GB), and its ``bye`` walked them all (19.4 s)."""
    pool = make_pool("test-pin-flat", 64 * 1024 * 1024, 4096)
    keys = numbered(1, 8000)
    packed = b"".join(keys)
    with ThreadedIndex(pool, token=TOKEN) as index, IndexClient(index.url, token=TOKEN, heartbeat=False) as writer:
        store(writer, pool, keys)
        pinner = IndexClient(index.url, token=TOKEN, heartbeat=False)
        retrieves = []
        for _ in range(5):
            started = time.perf_counter()
            assert pinner.retrieve(packed).misses() == 0
            retrieves.append(time.perf_counter() - started)
        registry = index.service.server.registry

        def pins_bytes() -> list[int]:  # what each lease's pins take (arrays and remembered batches)
            return index.on_loop(lambda: [lease.pins.nbytes for lease in registry._leases.values()])

        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(150):
                pinner.retrieve(packed)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 1 << 20, grown  # 150 x 8,000 pins kept one by one: 9.6 MB
        assert max(pins_bytes()) < 8000 * 64  # set by the 8,000 distinct objects, not the 1.24 million pins
        assert index.on_loop(lambda: registry.describe(keys[0]).pins) == 155
        started = time.perf_counter()
        pinner.close()  # bye
        bye_s = time.perf_counter() - started
        assert index.on_loop(lambda: registry.stats().pinned_keys) == 0
        # A bye costs what the distinct objects cost, not what 1.24 million pins would.
        assert bye_s < 5 * statistics.median(retrieves) + 0.05, (bye_s, retrieves)


def _two_ports() -> tuple[int, int]:
    """The index's port and its metrics port: two free ports, never the same one."""
    port = metrics_port = free_port()
    while metrics_port == port:
        metrics_port = free_port()
    return port, metrics_port


def _scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _refusals(text: str, quota: str) -> float:
    line = next(line for line in text.splitlines()
                if line.startswith(f'maru_index_quota_refusals_total{{quota="{quota}"}}'))  # fmt: skip
    return float(line.split()[-1])


def test_the_pin_quota_refuses_a_client_that_pins_without_end_while_an_honest_one_keeps_reading():
    port, metrics_port = _two_ports()
    args = ("--page-size", "4Ki", "--max-lease-pin-fraction", "0.25", "--metrics-port", str(metrics_port),
            "--metrics-addr", "127.0.0.1")  # fmt: skip
    with IndexProcess(pool_size="32Mi", port=port, extra_args=args) as index, Pool.attach(index.pool_path) as pool:
        writer, hog, honest = index.client(), index.client(), index.client()
        try:
            pages = pool.geometry.num_pages
            hogged, mine = numbered(1, pages // 2), numbered(2, 200)
            for start in range(0, len(hogged), 1000):
                store(writer, pool, hogged[start : start + 1000])
            store(writer, pool, mine)
            refused = None
            for start in range(0, len(hogged), 500):
                batch = b"".join(hogged[start : start + 500])
                try:
                    for _ in range(20):  # the same objects again and again: counted once
                        hog.retrieve(batch)
                except IndexRejected as exc:
                    refused = exc
                    break
                assert honest.retrieve(mine).misses() == 0  # the others keep reading
                assert honest.unpin(mine) == len(mine)
            assert refused is not None and refused.error_type == "quota"
            assert "--max-lease-pin-fraction" in refused.message
            assert start >= pages // 4 - 500  # refused only once past its quota (a quarter of the pool)
            assert honest.retrieve(mine).misses() == 0 and honest.unpin(mine) == len(mine)
            assert _refusals(_scrape(metrics_port), "pins") >= 1
            assert "quota pins of client" in index.log_path.read_text()  # logged (a line per 10 s at most)
            started = time.perf_counter()
            hog.close()  # bye: its pins go
            assert time.perf_counter() - started < 2.0
            assert writer.stats()["pinned_keys"] == 0
        finally:
            for client in (writer, hog, honest):
                client.close()


def test_reserves_that_would_evict_beyond_the_window_are_refused_and_the_others_objects_survive():
    """Before, four reserves in 0.32 s evicted every object (a quarter of the
    pool each, the bound of one call). Now one lease's reserves evict at most
    a quarter of the pool per window: the rest are refused by name."""
    port, metrics_port = _two_ports()
    args = ("--max-lease-evict-fraction", "0.25", "--evict-window", "60", "--metrics-port", str(metrics_port),
            "--metrics-addr", "127.0.0.1")  # fmt: skip
    with IndexProcess(pool_size="32Mi", port=port, extra_args=args) as index, Pool.attach(index.pool_path) as pool:
        honest, wiper = index.client(), index.client()
        try:
            page, pages = pool.geometry.page_size, pool.geometry.num_pages
            theirs = numbered(1, int(0.94 * pages))  # just under the high watermark
            for start in range(0, len(theirs), 100):  # a step's stores at a time, as an engine stores
                store(honest, pool, theirs[start : start + 100], length=page)
            refusals = []
            for attempt in range(4):
                try:
                    wiper.reserve([(k, page) for k in numbered(10 + attempt, pages // 2)])
                except IndexRejected as exc:
                    refusals.append(exc)
            assert len(refusals) == 3, refusals
            assert all(exc.error_type == "quota" and "--max-lease-evict-fraction" in exc.message
                       for exc in refusals)  # fmt: skip
            kept = honest.stats()["keys"]  # the wiper committed nothing: every key is theirs
            assert kept >= len(theirs) - pages // 4 - 1, (kept, len(theirs))
            assert _refusals(_scrape(metrics_port), "evictions") >= 3
        finally:
            honest.close(), wiper.close()


@pytest.mark.parametrize("flag", ["--max-lease-pin-fraction", "--max-lease-evict-fraction", "--evict-window"])
def test_a_bad_quota_flag_is_refused_naming_it(flag):
    import subprocess
    import sys

    from maru_tools.index_process import unique_pool_path

    run = subprocess.run([sys.executable, "-m", "maru_core.cli", "index", "--pool", unique_pool_path(),
                          "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0", flag, "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and flag in run.stderr and "'0' is not a" in run.stderr
