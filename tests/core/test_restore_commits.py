"""A restarted index serves only objects whose commit an index acknowledged.

A writer's slot header says only that bytes were written; the index marks it
committed when it commits the key. Here a real index process is SIGKILLed
with objects in every state a writer can leave (committed, aborted as the
scheduler's "drop" verdict does, still reserved when the index died, and
released with the writer's lease), then a second index process starts over
the same ``/dev/shm`` pool: only the committed ones come back, byte for byte.
"""

from __future__ import annotations

import numpy as np

from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slots import SlotState
from maru_core.pool.slot_check import SlotHeaderCheck

TOKEN = "restore-token-0123456789"
OBJECT_BYTES = 4096
INDEX_ARGS = ["--page-size", "4096", "--lease-ttl", "2"]


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def _write(client: IndexClient, pool: Pool, keys: list[bytes], seed: int) -> dict[bytes, bytes]:
    """Reserve, copy and head every key as a connector's store does; return the bytes written."""
    slots = list(client.reserve([(k, OBJECT_BYTES) for k in keys]))
    assert None not in slots
    rng = np.random.default_rng(seed)
    payloads = {}
    for key, slot in zip(keys, slots):
        pool.invalidate_slot(slot.offset, OBJECT_BYTES)
        payloads[key] = rng.bytes(OBJECT_BYTES)
        pool.view(slot.offset, OBJECT_BYTES)[:] = payloads[key]
        checksum = pool.payload_checksum(slot.offset, OBJECT_BYTES)
        pool.write_slot_header(slot.offset, SlotHeader(key, slot.generation, OBJECT_BYTES, checksum=checksum))
    return payloads


def test_only_committed_objects_come_back_after_a_sigkill(pool_path, token_file):
    committed, aborted, unanswered, released = _keys(1, 500), _keys(2, 500), _keys(3, 500), _keys(4, 500)
    first = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool:
            writer = IndexClient(first.url, token=TOKEN)
            payloads = _write(writer, pool, committed + aborted + unanswered, seed=1)
            other = IndexClient(first.url, token=TOKEN)
            _write(other, pool, released, seed=2)  # before the abort: no pages reused
            assert writer.commit(committed) == [True] * len(committed)
            assert writer.abort(aborted) == len(aborted)  # a "drop" verdict: written, headed, aborted
            other.close()  # its lease ends: the reservations go
            stats = writer.stats()
            assert (stats["keys"], stats["reserved_keys"]) == (len(committed), len(unanswered))
            first.kill()  # SIGKILL, the writer's `unanswered` still reserved
            writer.close()
    finally:
        first.kill()
    second = IndexProcess(pool_path, token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool, IndexClient(second.url, token=TOKEN) as reader:
            assert reader.stats()["keys"] == len(committed)
            never = aborted + unanswered + released
            assert reader.retrieve(never).misses() == len(never)
            found = reader.retrieve(committed)
            assert found.misses() == 0
            offsets = np.array([loc.offset for loc in found], dtype=np.int64)
            generations = np.array([loc.generation for loc in found], dtype=np.uint64)
            assert SlotHeaderCheck(pool)(b"".join(committed), offsets, generations).all()
            for key, loc in zip(committed, found):
                assert bytes(pool.view(loc.offset, loc.length)) == payloads[key]
            # The others' headers are still in the table, pending: a header is not a commit record.
            assert len(list(pool.iter_slot_headers(SlotState.PENDING))) == len(never)
            reader.unpin(committed)
    finally:
        second.stop()
