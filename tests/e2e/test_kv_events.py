"""KV events for routers, from vLLM's own scheduler and a real engine's ZMQ stream.

A router joins these events with vLLM's own on vLLM's block hashes, so each
check compares the published hashes with the block hashes vLLM computes for
the prompt. The stepped engines (vLLM's ``Scheduler``, real index) show what
is published when: a chunk once it is committed, a removal once a lookup
finds an evicted chunk gone; the real engine shows that the events reach a
ZMQ subscriber through vLLM's publisher.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from maru_connector.config import make_kv_transfer_config
from maru_tools.index_process import IndexProcess
from maru_tools.stepper import SteppedEngine
from maru_tools.workload import random_tokens

from .conftest import BLOCK_SIZE, CHUNK_TOKENS, connector_config, index_keys, wait_for_keys

CHUNK = 32
BLOCK = 16
_seeds = itertools.count(97_000)  # a range of its own: tests isolate themselves by prompt


def _vllm_block_hashes(prompt: list[int], block_size: int) -> list[Any]:
    """The block hashes vLLM gives this prompt (sha256, vLLM's default), as its events carry them."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    request = Request("h", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(block_size, hash_fn))
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def _chunk_hashes(prompt: list[int], block_size: int, chunk_tokens: int) -> list[list[Any]]:
    hashes = _vllm_block_hashes(prompt, block_size)
    per = chunk_tokens // block_size
    return [hashes[c * per:(c + 1) * per] for c in range(len(prompt) // chunk_tokens)]


class _Recorder:
    """Stands in for vLLM's publisher: keeps every batch the scheduler publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def stepped(model_dir):
    made: list[SteppedEngine] = []

    def make(index: IndexProcess, **knobs: Any) -> tuple[SteppedEngine, _Recorder]:
        config = make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token,
                                         kv_chunk_tokens=CHUNK, load_timeout_s=5.0, lookup_timeout_s=2.0,
                                         **knobs)  # fmt: skip
        engine = SteppedEngine(model_dir, config, block_size=BLOCK,
                               kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
        made.append(engine)
        recorder = engine.scheduler.kv_event_publisher = _Recorder()
        return engine, recorder

    yield make
    for engine in made:
        engine.close()


def _serve(engine: SteppedEngine, req_id: str, prompt: list[int]) -> None:
    engine.add(req_id, prompt, max_tokens=2)
    engine.run(until=lambda: req_id in engine.finished)


@pytest.mark.parametrize("async_store", [False, True], ids=["sync-store", "async-store"])
def test_committed_chunks_are_published_with_vllms_block_hashes(stepped, index, async_store):
    engine, recorder = stepped(index, async_store=async_store)
    prompt = random_tokens(3 * CHUNK + 5, seed=next(_seeds))
    keys = index_keys(index)
    _serve(engine, "w", prompt)
    # The engine keeps stepping until every rank settled the stores (has_pending_push_work).
    engine.run(max_steps=2000, until=lambda: not engine.scheduler.connector.has_pending_push_work())
    wait_for_keys(index, keys + 3)
    stored = recorder.of(BlockStored)
    assert [e.block_hashes for e in stored] == _chunk_hashes(prompt, BLOCK, CHUNK)
    hashes = _vllm_block_hashes(prompt, BLOCK)
    assert [e.parent_block_hash for e in stored] == [None, hashes[1], hashes[3]]
    assert all(e.medium == "CPU" and e.block_size == BLOCK for e in stored)
    assert [e.token_ids for e in stored] == [prompt[c * CHUNK:(c + 1) * CHUNK] for c in range(3)]
    # A second engine loads the chunks: it stores none of them, so it publishes nothing
    # (the events name the engine that stored a chunk).
    other, other_events = stepped(index, async_store=async_store)
    _serve(other, "again", prompt + [1])
    other.run(max_steps=2000, until=lambda: not other.scheduler.connector.has_pending_push_work())
    assert other_events.of(BlockStored) == []


def test_a_chunk_a_lookup_finds_evicted_is_published_removed_then_stored_again(stepped, workdir):
    # A pool of a few dozen chunks: storing more evicts the least recently used. One engine
    # turns it over many times in seconds, past the index's eviction window: lifted here.
    with IndexProcess(pool_size="4Mi", log_dir=workdir, extra_args=("--evict-window", "0.001")) as small:
        engine, recorder = stepped(small, async_store=False)
        first = random_tokens(4 * CHUNK + 5, seed=next(_seeds))
        _serve(engine, "first", first)
        engine.run(max_steps=2000, until=lambda: not engine.scheduler.connector.has_pending_push_work())
        first_chunks = _chunk_hashes(first, BLOCK, CHUNK)
        assert [e.block_hashes for e in recorder.of(BlockStored)] == first_chunks
        for n in range(40):
            _serve(engine, f"fill-{n}", random_tokens(4 * CHUNK + 5, seed=next(_seeds)))
        engine.run(max_steps=2000, until=lambda: not engine.scheduler.connector.has_pending_push_work())
        assert int(small.stats().get("evictions", 0)) > 0, small.stats()
        assert recorder.of(BlockRemoved) == []  # nobody looked the evicted chunks up yet
        before = len(recorder.events)
        _serve(engine, "again", first)
        engine.run(max_steps=2000, until=lambda: not engine.scheduler.connector.has_pending_push_work())
        after = recorder.events[before:]
        removed = [e for e in after if isinstance(e, BlockRemoved)]
        assert len(removed) == 1 and removed[0].block_hashes in first_chunks and removed[0].medium == "CPU"
        # The engine recomputed the chunk and stored it again: published again, after its removal.
        restored = [e.block_hashes for e in after if isinstance(e, BlockStored)]
        assert removed[0].block_hashes in restored
        assert after.index(removed[0]) < next(i for i, e in enumerate(after) if isinstance(e, BlockStored)
                                              and e.block_hashes == removed[0].block_hashes)


def _subscribe(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # before the engine binds: zmq connects once it does, so nothing is missed
    return ctx, sub


def _receive_until(sub: zmq.Socket, done, timeout_s: float = 60.0) -> list[Any]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not done(events) and time.monotonic() < deadline:
        if sub.poll(200):
            _topic, _seq, payload = sub.recv_multipart()
            events.extend(decoder.decode(payload).events)
    return events


@pytest.mark.vllm
def test_a_real_engine_publishes_its_pool_stores_to_a_zmq_subscriber(farm, index, workdir):
    endpoint = f"ipc://{workdir}/kv-events.sock"
    ctx, sub = _subscribe(endpoint)
    try:
        # vLLM's own engine-core process, whose loop keeps stepping while the
        # connector has stores to settle (an in-process engine steps only for requests).
        engine = farm.get("kv-events", connector_config(index), multiprocessing=True,
                          kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                            "endpoint": endpoint})
        prompt = random_tokens(3 * CHUNK_TOKENS + 7, seed=next(_seeds))
        keys = index_keys(index)
        engine.outputs([prompt], max_tokens=2)
        wait_for_keys(index, keys + 3)
        expected = _chunk_hashes(prompt, BLOCK_SIZE, CHUNK_TOKENS)

        def stored(events: list[Any]) -> list[list[Any]]:
            return [e.block_hashes for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]

        events = _receive_until(sub, lambda ev: len(stored(ev)) >= len(expected))
        assert stored(events) == expected
    finally:
        sub.close(linger=0)
        ctx.term()
