"""A pool file truncated under the index, or while no index ran.

Every engine maps the pool read-write, so any of them can ``ftruncate`` a
pool file. Before, a running index kept acknowledging commits for pages past
the file's end (and could die of SIGBUS writing their commit marks), every
process touching those pages died of SIGBUS, no new client could attach, and
a restarted index refused the pool. Now the index gives the file its size
back, drops exactly the objects whose bytes were lost (misses, never wrong
bytes), refuses the commits of reservations in the lost range, and keeps
everything before it; an index starting over a truncated file does the same.
Real index processes, a real ``/dev/shm`` pool.
"""

from __future__ import annotations

import os
import time

import numpy as np

from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.pool import Pool
from maru_core.pool.slot_check import SlotHeaderCheck
from maru_core.pool.truncation import first_lost_page, missing_bytes
from store_as_a_writer import assert_served_exactly, numbered_keys, write_objects

TOKEN = "truncate-token-0123456789"
INDEX_ARGS = ["--page-size", "4096", "--lease-ttl", "2"]


def _cut(pool: Pool, offsets: dict, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Truncate the pool file in the middle of the object of the middle key;
    return (keys kept, keys lost)."""
    cut_at = offsets[keys[len(keys) // 2]] + 100  # pool byte: inside that object's payload
    os.truncate(pool.where, pool.offset + cut_at)
    first = first_lost_page(pool.geometry, cut_at)
    page = lambda k: (offsets[k] - pool.geometry.data_offset) // pool.geometry.page_size  # noqa: E731
    return [k for k in keys if page(k) + 1 <= first], [k for k in keys if page(k) + 1 > first]


def test_a_pool_truncated_under_a_running_index_gets_its_size_back_and_loses_only_the_cut_objects(
        pool_path, token_file):
    index = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool, IndexClient(index.url, token=TOKEN) as writer, \
                IndexClient(index.url, token=TOKEN) as reader:
            stored = numbered_keys(1, 200)
            payloads, offsets = write_objects(writer, pool, stored, seed=1)
            assert writer.commit(stored) == [True] * len(stored)
            in_flight = numbered_keys(2, 20)  # reserved and written after the stored ones: all past the cut
            write_objects(writer, pool, in_flight, seed=2)
            pinned = reader.retrieve(stored[-10:])  # a reader holds pins on objects that will be lost
            assert pinned.misses() == 0
            kept, lost = _cut(pool, offsets, stored)
            assert len(kept) == 100 and len(lost) == 100
            assert missing_bytes(pool) > 0
            deadline = time.monotonic() + 10
            while missing_bytes(pool) and time.monotonic() < deadline:
                time.sleep(0.05)  # the index's sweep finds it within a second
            assert missing_bytes(pool) == 0 and index.proc.poll() is None
            # The writer's reservations past the cut are refused: its bytes there are gone.
            assert writer.commit(in_flight) == [False] * len(in_flight)
            assert_served_exactly(reader, pool, kept, payloads)
            assert reader.retrieve(lost[:-10]).misses() == len(lost) - 10
            # The pinned ones stay listed until unpinned, but no reader passes their cleared headers.
            offs = np.array([loc.offset for loc in pinned], dtype=np.int64)
            gens = np.array([loc.generation for loc in pinned], dtype=np.uint64)
            assert not SlotHeaderCheck(pool)(b"".join(stored[-10:]), offs, gens).any()
            reader.unpin(stored[-10:])
            # New clients attach and store as before.
            with Pool.attach(pool_path) as again:
                more = numbered_keys(3, 50)
                more_payloads, _ = write_objects(writer, again, more, seed=3)
                assert writer.commit(more) == [True] * len(more)
                assert_served_exactly(reader, again, more, more_payloads)
    finally:
        index.stop()


def test_an_index_starts_over_a_pool_file_truncated_while_it_was_down(pool_path, token_file):
    first = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool, IndexClient(first.url, token=TOKEN) as writer:
            stored = numbered_keys(4, 200)
            payloads, offsets = write_objects(writer, pool, stored, seed=4)
            assert writer.commit(stored) == [True] * len(stored)
            first.kill()
            kept, lost = _cut(pool, offsets, stored)
    finally:
        first.kill()
    second = IndexProcess(pool_path, token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool, IndexClient(second.url, token=TOKEN) as reader:
            assert missing_bytes(pool) == 0
            assert reader.stats()["keys"] == len(kept)
            assert_served_exactly(reader, pool, kept, payloads)
            assert reader.retrieve(lost).misses() == len(lost)
    finally:
        second.stop()
