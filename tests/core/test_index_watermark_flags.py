"""`marucache index --high-watermark/--low-watermark`: the operator's spec.eviction reaches eviction.

A real index process on a small pool with the watermarks at 0.5 and 0.25:
storing past half the pool evicts the oldest objects down to a quarter, and
bad values are refused with a message naming the flag.
"""

from __future__ import annotations

import subprocess
import sys

from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_core.pool import Pool, SlotHeader

OBJECT = 1 << 20


def _store(client, pool, key: bytes) -> None:
    """Reserve, write the slot header (as a connector does), commit."""
    (slot,) = client.reserve([(key, OBJECT)])
    pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=OBJECT))
    assert client.commit([key]) == [True]


def test_watermark_flags_drive_eviction():
    # One writer evicts most of the pool within a second here: above a lease's default eviction window.
    args = ("--high-watermark", "0.5", "--low-watermark", "0.25", "--max-lease-evict-fraction", "1")
    with IndexProcess(pool_size="32Mi", extra_args=args) as index:
        client = index.client()
        try:
            with Pool.attach(index.pool_path) as pool:
                capacity = int(client.stats()["capacity_bytes"])
                count = capacity // OBJECT
                for i in range(count):  # twice what the high watermark allows
                    _store(client, pool, i.to_bytes(16, "little"))
            stats = client.stats()
        finally:
            client.close()
    assert stats["evictions"] > 0
    assert stats["committed_bytes"] <= 0.5 * capacity, stats
    assert stats["keys"] < count // 2


def test_bad_watermarks_are_refused_naming_the_flag():
    base = [sys.executable, "-m", "maru_core.cli", "index", "--pool", unique_pool_path(), "--pool-size", "64Mi",
            "--listen", "tcp://127.0.0.1:0"]
    crossed = subprocess.run(base + ["--high-watermark", "0.5", "--low-watermark", "0.6"], capture_output=True,
                             text=True, timeout=60)
    assert crossed.returncode == 2 and "--low-watermark 0.6 must be below --high-watermark 0.5" in crossed.stderr
    out_of_range = subprocess.run(base + ["--high-watermark", "1.5"], capture_output=True, text=True, timeout=60)
    assert out_of_range.returncode == 2 and "--high-watermark" in out_of_range.stderr
    assert "fraction of the pool" in out_of_range.stderr
