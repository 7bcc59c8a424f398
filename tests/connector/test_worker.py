"""The worker half's synchronous loads and stores on a real pool and CPU engine."""

from __future__ import annotations

import threading
import time

import pytest
from maru_core.pool.commit_records import CommitRecords
from maru_core.pool.slots import SlotHeader, SlotState

from maru_connector.metadata import LoadSpec, MaruConnectorMetadata

from maru_tools.cluster import wait_until
from worker_env import (LAYERS, WorkerEnv, blocks_equal, finished, load_meta, same_bytes, save, spec_blocks, step,
                        store_meta, tokens, wait_unpinned)


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()




@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_store_then_load_copies_exact_bytes(env, layerwise, overlap):
    writer, kv_w = env.worker(seed=1, maru_use_layerwise=layerwise, maru_async_store=False)
    reader, kv_r = env.worker(seed=2, maru_use_layerwise=layerwise,
                              maru_overlap_load_with_compute=overlap)
    keys = env.keys(tokens(96))  # three chunks
    step(writer, store_meta("w", keys, first_block=0))
    assert len(env.index.committed) == 3 * (LAYERS if layerwise else 1)
    assert not blocks_equal(kv_w, range(6), kv_r, range(10, 16))

    errors, meta = step(reader, load_meta("r", keys, first_block=10))

    assert errors == set() and not meta.failed_load_req_ids and not meta.tainted
    assert blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    wait_unpinned(env)  # every pin released after the copies
    assert reader.stats.snapshot()["counters"]["load_bytes"] > 0
    assert writer.stats.snapshot()["counters"]["store_bytes"] > 0


@pytest.mark.parametrize("wait_whole", [False, True])
def test_a_load_asked_for_whole_lands_before_the_forward_on_an_overlapping_engine(env, wait_whole):
    """``maru_load="sync"`` on an engine that overlaps: ``start_load_kv`` returns
    with the load landed and its pins released; an overlapped one is still in
    flight (pinned) until ``wait_for_save``."""
    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    reader, kv_r = env.worker(seed=2, maru_overlap_load_with_compute=True)
    keys = env.keys(tokens(96))
    step(writer, store_meta("w", keys, first_block=0))
    spec = LoadSpec(req_id="r", keys_by_rank=(tuple(keys),), block_ids=spec_blocks(10, 3), wait_whole=wait_whole)
    meta = MaruConnectorMetadata(loads=[spec])

    reader.handle_preemptions(meta)
    reader.start_load_kv(meta)

    if wait_whole:  # landed, and its pins on their way back, before the forward
        assert blocks_equal(kv_w, range(6), kv_r, range(10, 16))
        wait_unpinned(env)
    else:  # still copying under its pins
        assert +env.index.pins
    for i in range(LAYERS):
        reader.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    reader.wait_for_save(meta)
    assert blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    wait_unpinned(env)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sync_load_gives_its_pins_back_off_the_engine_thread(env, overlap):
    """The unpin's round trip is no part of the step: an index that holds the
    unpin holds no step, and shutting down waits for it (the pins go back
    before the lease ends)."""
    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    reader, kv_r = env.worker(seed=2, maru_overlap_load_with_compute=overlap)
    keys = env.keys(tokens(96))
    step(writer, store_meta("w", keys, first_block=0))
    gate = env.index.unpin_gate = threading.Event()

    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    assert errors == set() and not meta.tainted and blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    assert len(+env.index.pins) == 3, "the step waited for the unpin"
    errors, _ = step(reader, load_meta("r2", keys, first_block=20))  # the next hit is not held either
    assert errors == set() and set((+env.index.pins).values()) == {2}

    threading.Timer(0.2, gate.set).start()
    reader.shutdown()
    assert +env.index.pins == {}


class RecordingEngine:
    """The real engine, recording each load's submit options."""

    def __init__(self, real):
        self.real, self.options = real, []

    def submit_load(self, chunks, **options):
        self.options.append(options)
        return self.real.submit_load(chunks, **options)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("overlap, new_tokens, wait_whole, beside", [
    (True, 32, False, True),  # a partial hit computing a chunk or more: its forward should not wait
    (True, 31, False, False),
    (True, 1, False, False),  # a full hit
    (True, 32, True, False),  # asked for whole: the forward waits for it anyway
    (False, 32, False, False),
])
def test_a_sync_load_tells_the_engine_whether_a_long_forward_follows(env, overlap, new_tokens, wait_whole, beside):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    keys = env.keys(tokens(64))
    step(writer, store_meta("w", keys, first_block=0))
    recorded = []
    reader, _ = env.worker(seed=2, maru_overlap_load_with_compute=overlap,
                           wrap_engine=lambda e: recorded.append(RecordingEngine(e)) or recorded[-1])
    spec = LoadSpec(req_id="r", keys_by_rank=(tuple(keys),), block_ids=spec_blocks(10, 2),
                    wait_whole=wait_whole, new_tokens=new_tokens)
    errors, meta = step(reader, MaruConnectorMetadata(loads=[spec]))
    assert errors == set() and not meta.tainted
    (options,) = recorded[0].options
    assert options.pop("check") is not None  # the bytes are verified (maru_verify_payload's default)
    assert options == {"beside_long_forward": beside, "head": None}


def _stored(env, n_tokens=64):
    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    keys = env.keys(tokens(n_tokens))
    step(writer, store_meta("w", keys, first_block=0))
    return keys


def _assert_failed_untouched(env, reader, kv_r, before, errors, meta, reason):
    assert errors == set(range(10, 14))
    assert meta.failed_load_req_ids == {"r"}
    assert reader.stats.snapshot()["load_failures"][reason] == 1
    assert blocks_equal(before, range(10, 14), kv_r, range(10, 14))  # no block touched
    assert +env.index.pins == {}


def _snapshot(kv):
    return {name: t.clone() for name, t in kv.items()}


@pytest.mark.parametrize(
    "hook, reason",
    [
        (lambda locs: locs[:-1], "short_reply"),
        (lambda locs: locs + locs[-1:], "long_reply"),
    ],
)
def test_bad_reply_length_fails_the_load_before_any_copy(env, hook, reason):
    keys = _stored(env)
    reader, kv_r = env.worker(seed=2)
    before = _snapshot(kv_r)
    env.index.retrieve_hook = hook
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    _assert_failed_untouched(env, reader, kv_r, before, errors, meta, reason)


def test_miss_fails_the_load(env):
    keys = _stored(env)
    reader, kv_r = env.worker(seed=2)
    before = _snapshot(kv_r)
    missing = keys[:1] + env.keys(tokens(64, start=500))[1:]
    errors, meta = step(reader, load_meta("r", missing, first_block=10))
    _assert_failed_untouched(env, reader, kv_r, before, errors, meta, "miss")


def test_slot_header_naming_another_generation_fails_the_load(env):
    keys = _stored(env)
    loc = env.index.committed[keys[1]]
    env.pool.write_slot_header(loc.offset, SlotHeader(keys[1], loc.generation + 7, loc.length))
    CommitRecords(env.pool)([loc.offset])  # committed, but of another generation
    reader, kv_r = env.worker(seed=2)
    before = _snapshot(kv_r)
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    _assert_failed_untouched(env, reader, kv_r, before, errors, meta, "header_mismatch")


def test_a_slot_header_that_records_no_commit_fails_the_load(env):
    """A head still pending (its commit never recorded, e.g. by an index that
    records none) names the right key and generation, and is refused all the same."""
    keys = _stored(env)
    loc = env.index.committed[keys[1]]
    header = env.pool.read_slot_header(loc.offset)
    env.pool.write_slot_header(loc.offset, header)  # the writer's pending head, as before the commit
    assert env.pool.read_slot_header(loc.offset, SlotState.PENDING) == header
    reader, kv_r = env.worker(seed=2)
    before = _snapshot(kv_r)
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    _assert_failed_untouched(env, reader, kv_r, before, errors, meta, "header_mismatch")


def test_unreachable_index_is_a_failed_load_not_a_crash(env):
    keys = _stored(env)
    reader, kv_r = env.worker(seed=2)
    before = _snapshot(kv_r)
    env.index.down = True
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    _assert_failed_untouched(env, reader, kv_r, before, errors, meta, "index_error")
    # The next step reports nothing again: errors are per step.
    env.index.down = False
    errors, meta = step(reader, MaruConnectorMetadata())
    assert errors == set() and not meta.failed_load_req_ids and not meta.tainted


def test_store_with_index_down_is_a_skipped_store(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    env.index.down = True
    step(writer, store_meta("w", env.keys(tokens(64)), first_block=0))
    assert env.index.committed == {} and env.index.reserved == {}
    assert writer.stats.snapshot()["store_failures"]["index_error"] == 1


def test_second_store_of_the_same_chunks_is_skipped(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    keys = env.keys(tokens(64))
    step(writer, store_meta("a", keys, first_block=0))
    first = dict(env.index.committed)
    step(writer, store_meta("b", keys, first_block=8))
    assert env.index.committed == first and env.index.reserved == {}


class _SlowStores:
    """A CPU engine whose store copies take ``delay_s`` (to catch a release under them)."""

    def __init__(self, real, delay_s: float):
        self.real, self.fmt, self.delay_s = real, real.fmt, delay_s
        self.copying = threading.Event()

    def submit_store(self, chunks, **options):
        self.copying.set()
        time.sleep(self.delay_s)
        return self.real.submit_store(chunks, **options)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_sleep_mode_finishes_copies_before_the_cache_goes_and_touches_nothing_until_restored(env):
    """vLLM's sleep mode releases the KV cache after ``unregister_kv_caches``:
    a store copying out of it finishes first; until ``restore_kv_caches``
    loads fail (recompute) and stores are skipped; afterwards both work."""
    slow = []
    writer, kv_w = env.worker(seed=1, maru_async_store=True,
                              wrap_engine=lambda e: slow.append(_SlowStores(e, 0.3)) or slow[0])
    keys = env.keys(tokens(96))
    writer.handle_preemptions(store_meta("w", keys, first_block=0))
    writer.wait_for_save(store_meta("w", keys, first_block=0))
    assert slow[0].copying.wait(5)
    started = time.monotonic()
    writer.unregister_kv_caches()
    assert time.monotonic() - started > 0.1  # it waited for the copy out of the blocks
    assert writer._storer.finished_requests(["w"]) == {"w"}  # no job reads a block any more

    reader, kv_r = env.worker(seed=2, maru_async_store=False)
    save(writer, MaruConnectorMetadata(step=0), commit=True)  # the copied store commits
    wait_until(lambda: len(env.index.committed) == 3, 5.0, what="the store committed")
    reader.unregister_kv_caches()
    before = kv_r["model.layers.0.self_attn.attn"].clone()
    errors, report_ = step(reader, load_meta("r", keys, first_block=10))
    assert errors == set(range(10, 16)) and report_.failed_load_req_ids == {"r"}
    assert same_bytes(kv_r["model.layers.0.self_attn.attn"], before)  # nothing written
    step(reader, store_meta("s", env.keys(tokens(64, start=500)), first_block=20))
    assert len(env.index.committed) == 3  # nothing stored

    reader.restore_kv_caches()
    errors, report_ = step(reader, load_meta("r2", keys, first_block=10))
    assert errors == set() and blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    wait_unpinned(env)


def test_sleep_mode_lets_a_parked_load_land_and_reports_one_planned_while_asleep(env):
    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    reader, kv_r = env.worker(seed=2, maru_async_load=True)
    keys = env.keys(tokens(96))
    step(writer, store_meta("w", keys, first_block=0))
    reader.start_load_kv(load_meta("a", keys, first_block=10, is_async=True))
    reader.unregister_kv_caches()  # waits for the parked load to land
    assert blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    assert finished(reader) == (set(), {"a"})
    reader.start_load_kv(load_meta("b", keys, first_block=20, is_async=True))
    meta = MaruConnectorMetadata()
    _, recving, failed = reader.get_finished(meta)
    assert recving == failed == {"b"}  # vLLM recomputes it
    assert reader.get_block_ids_with_load_errors() == set(range(20, 26))
    wait_unpinned(env)
