"""A restarted index serves only objects whose commit an index acknowledged.

A writer's slot header says only that bytes were written; the index marks it
committed when it commits the key. Here a real index process is SIGKILLed
with objects in every state a writer can leave (committed, aborted as the
scheduler's "drop" verdict does, still reserved when the index died, and
released with the writer's lease), then a second index process starts over
the same ``/dev/shm`` pool: only the committed ones come back, byte for byte.
"""

from __future__ import annotations

from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.pool import Pool
from maru_core.pool.slots import SlotState
from store_as_a_writer import assert_served_exactly, numbered_keys, write_objects

TOKEN = "restore-token-0123456789"
INDEX_ARGS = ["--page-size", "4096", "--lease-ttl", "2"]


def test_only_committed_objects_come_back_after_a_sigkill(pool_path, token_file):
    committed, aborted, unanswered, released = (numbered_keys(tag, 500) for tag in (1, 2, 3, 4))
    first = IndexProcess(pool_path, pool_size="64Mi", token_file=token_file, extra_args=INDEX_ARGS).start()
    try:
        with Pool.attach(pool_path) as pool:
            writer = IndexClient(first.url, token=TOKEN)
            payloads, _ = write_objects(writer, pool, committed + aborted + unanswered, seed=1)
            other = IndexClient(first.url, token=TOKEN)
            write_objects(other, pool, released, seed=2)  # before the abort: no pages reused
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
            assert_served_exactly(reader, pool, committed, payloads)
            # The others' headers are still in the table, pending: a header is not a commit record.
            assert len(list(pool.iter_slot_headers(SlotState.PENDING))) == len(never)
    finally:
        second.stop()
