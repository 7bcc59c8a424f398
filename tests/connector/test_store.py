"""Async stores: never block, keep finished requests' blocks until done, drain on preemption."""

from __future__ import annotations

import time

import pytest

from maru_connector.metadata import MaruConnectorMetadata

from worker_env import WorkerEnv, blocks_equal, finished, load_meta, report, save, store_meta, tokens


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _finished_sending(half, held, timeout=5.0):
    deadline = time.monotonic() + timeout
    reported = set()
    while time.monotonic() < deadline:
        sending, _ = finished(half, held=held)
        reported |= sending
        held = set()
        if reported:
            return reported
        time.sleep(0.005)
    return reported


def test_async_store_does_not_block_and_reports_the_finished_request_once(env):
    writer, kv_w = env.worker(seed=1)  # maru_async_store defaults to on
    env.index.delay_s = 0.2  # a slow index must not slow the step
    keys = env.keys(tokens(64))
    start = time.monotonic()
    save(writer, store_meta("w", keys, first_block=0))
    assert time.monotonic() - start < 0.1
    # The request finishes while its store is in flight: reported only when done.
    assert finished(writer, held={"w"}) == (set(), set())
    assert _finished_sending(writer, set()) == {"w"}
    deadline = time.monotonic() + 5  # committed once the verdict on its step is applied
    while len(env.index.committed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(env.index.committed) == 2
    assert finished(writer) == (set(), set())  # once, then forgotten
    env.index.delay_s = 0
    reader, kv_r = env.worker(seed=2, maru_async_store=False)
    reader.start_load_kv(load_meta("r", keys, first_block=20))
    assert blocks_equal(kv_w, range(4), kv_r, range(20, 24))


def test_preemption_cancels_queued_stores_before_blocks_are_reused(env):
    writer, _ = env.worker(seed=1)
    env.index.delay_s = 0.3
    save(writer, store_meta("a", env.keys(tokens(64)), first_block=0))
    save(writer, store_meta("b", env.keys(tokens(64, start=100)), first_block=8))
    time.sleep(0.05)  # "a" is reserving on the store thread, "b" is queued
    start = time.monotonic()
    writer.handle_preemptions(MaruConnectorMetadata(preempted_req_ids={"a", "b"}))
    assert time.monotonic() - start < 0.2  # nothing copying: cancelled, not waited for
    deadline = time.monotonic() + 5
    while (env.index.reserved or env.index.calls["abort"] == 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env.index.committed == {} and env.index.reserved == {}  # reservation aborted
    assert env.index.calls["reserve"] == 1  # "b" never reached the index
    assert writer.stats.snapshot()["counters"]["store_bytes"] == 0


def test_failed_store_is_counted_and_leaves_nothing_reserved(env):
    writer, _ = env.worker(seed=1)
    env.index.down = True
    save(writer, store_meta("w", env.keys(tokens(64)), first_block=0))
    assert _finished_sending(writer, {"w"}) == {"w"}  # blocks are freed even so
    assert writer.stats.snapshot()["store_failures"]["index_error"] == 1
    assert env.index.reserved == {} and env.index.committed == {}


def test_store_state_does_not_grow_with_requests(env):
    writer, _ = env.worker(seed=1)
    for i in range(300):
        save(writer, store_meta(f"r{i}", env.keys(tokens(32, start=i * 40)), 0))
        finished(writer, held={f"r{i - 1}"} if i else set())
    _finished_sending(writer, {"r299"})
    deadline = time.monotonic() + 5
    while writer._storer.num_tracked and time.monotonic() < deadline:
        finished(writer)
        time.sleep(0.01)
    assert writer._storer.num_tracked == 0
    assert len(env.index.committed) == 300


def test_a_store_refused_for_lack_of_room_is_counted_as_no_space(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    env.index._next_page = env.pool.geometry.num_pages  # the pool is full
    writer.wait_for_save(store_meta("w", env.keys(tokens(64)), first_block=0))
    failures = writer.stats.snapshot()["store_failures"]
    assert failures["no_space"] == 1 and failures["index_error"] == 0
    assert env.index.reserved == {} and env.index.committed == {}


def test_a_store_refused_by_a_restarted_index_is_counted_as_quarantined(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    env.index.quarantined = True
    writer.wait_for_save(store_meta("w", env.keys(tokens(64)), first_block=0))
    failures = writer.stats.snapshot()["store_failures"]
    assert failures["quarantined"] == 1 and failures["no_space"] == 0 and failures["index_error"] == 0
    assert env.index.committed == {}


def test_a_commit_the_index_refuses_is_counted_not_lost_silently(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    keys = env.keys(tokens(64))
    writer.wait_for_save(store_meta("w", keys, first_block=0))
    assert len(env.index.reserved) == 2
    env.index.reserved.clear()  # the reservations lapsed before the verdict came
    writer.wait_for_save(MaruConnectorMetadata(step=1, store_verdicts={0: True}))
    snapshot = writer.stats.snapshot()
    assert snapshot["store_failures"]["commit_error"] == 1
    assert snapshot["counters"]["store_bytes"] == 0 and env.index.committed == {}
