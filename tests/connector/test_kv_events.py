"""KV events for routers: which stores and removals the connector publishes, and how they are named.

The ledger (scheduler side) publishes a chunk's ``BlockStored`` only when
every tensor-parallel rank settled its store job and committed the chunk,
and a ``BlockRemoved`` only for a chunk it published that a lookup found
gone. The workers' settlements come from the real ``Storer`` on a real pool
(fake index); the names are vLLM's own block hashes of a real ``Request``.
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from maru_connector import kv_events
from maru_connector.kv_events import MARU_MEDIUM, ChunkPayload, StoreEventLedger, chunk_payloads
from maru_connector.metadata import MaruWorkerMetadata

from worker_env import WorkerEnv, report, save, store_meta, tokens

BLOCK = 16
CHUNK = 32


def _payload(n: int) -> ChunkPayload:
    return ChunkPayload(chunk_key=bytes([n]) * 16, block_hashes=(b"h%da" % n, b"h%db" % n),
                        parent_block_hash=None, token_ids=tuple(range(CHUNK)), block_size=BLOCK)


def _request(prompt: list[int]) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request("r", prompt, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


# ---- the ledger -------------------------------------------------------------


def test_a_chunk_is_published_once_every_rank_committed_it():
    ledger = StoreEventLedger(num_ranks=2)
    ledger.plan(step=3, req_id="a", payloads=[_payload(0), _payload(1)])
    ledger.settle([(3, "a", (0, 1))])  # rank 0 committed both
    assert ledger.take_events() == [] and ledger.unsettled
    ledger.settle([(3, "a", (0,))])  # rank 1 only the first
    events = ledger.take_events()
    assert not ledger.unsettled
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == [b"h0a", b"h0b"] and events[0].medium == MARU_MEDIUM == MEDIUM_CPU
    assert ledger.take_events() == []  # taken once


def test_nothing_is_published_for_stores_that_committed_nothing_or_cannot_be_named():
    ledger = StoreEventLedger(num_ranks=1)
    ledger.plan(1, "aborted", [_payload(0)])
    ledger.plan(1, "unnamed", None)  # vLLM had not hashed the blocks
    ledger.settle([(1, "aborted", ()), (1, "unnamed", (0,))])
    ledger.settle([(9, "never-planned", (0,))])
    assert ledger.take_events() == [] and not ledger.unsettled


def test_a_removal_is_published_only_for_a_chunk_published_as_stored():
    ledger = StoreEventLedger(num_ranks=1)
    ledger.chunk_gone(_payload(0).chunk_key, [b"h0a", b"h0b"])  # never stored by this engine
    assert ledger.take_events() == []
    ledger.plan(1, "a", [_payload(0)])
    ledger.settle([(1, "a", (0,))])
    ledger.take_events()
    ledger.chunk_gone(_payload(0).chunk_key, [b"h0a", b"h0b"])
    ledger.chunk_gone(_payload(0).chunk_key, [b"h0a", b"h0b"])  # once only
    events = ledger.take_events()
    assert events == [BlockRemoved(block_hashes=[b"h0a", b"h0b"], medium="CPU", group_idx=0)]


def test_plans_whose_settlement_never_comes_are_dropped():
    ledger = StoreEventLedger(num_ranks=2)
    ledger.plan(1, "a", [_payload(0)])
    ledger.expire(1 + kv_events._MAX_STEPS_UNSETTLED)
    assert ledger.unsettled
    ledger.expire(2 + kv_events._MAX_STEPS_UNSETTLED)
    assert not ledger.unsettled


def test_published_chunks_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(kv_events, "_MAX_PUBLISHED_CHUNKS", 2)
    ledger = StoreEventLedger(num_ranks=1)
    ledger.plan(1, "a", [_payload(0), _payload(1), _payload(2)])
    ledger.settle([(1, "a", (0, 1, 2))])
    ledger.take_events()
    for n in range(3):
        ledger.chunk_gone(_payload(n).chunk_key, [b"x"])
    assert len(ledger.take_events()) == 2  # the oldest was forgotten


# ---- the names --------------------------------------------------------------


def test_payloads_name_chunks_by_vllms_block_hashes():
    prompt = tokens(3 * CHUNK + 5)
    request = _request(prompt)
    payloads = chunk_payloads(request, 1, [b"k1", b"k2"], CHUNK, BLOCK)
    assert payloads is not None and len(payloads) == 2
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    first = payloads[0].stored()
    assert first.block_hashes == hashes[2:4] and first.parent_block_hash == hashes[1]
    assert first.token_ids == prompt[CHUNK:2 * CHUNK] and first.block_size == BLOCK
    assert payloads[1].stored().block_hashes == hashes[4:6]
    assert chunk_payloads(request, 0, [b"k0"], CHUNK, BLOCK)[0].parent_block_hash is None
    # Blocks vLLM has not hashed (a request without a hasher) name nothing.
    assert chunk_payloads(Request("u", prompt, SamplingParams(max_tokens=1), None), 0, [b"k0"], CHUNK, BLOCK) is None


# ---- the workers' settlements -----------------------------------------------


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def test_each_store_job_is_settled_once_with_the_chunks_it_committed(env):
    writer, _ = env.worker(seed=1, maru_async_store=False, report_settled_stores=True)
    keys = env.keys(tokens(2 * CHUNK))
    save(writer, store_meta("w", keys, first_block=0))  # step 0, committed in the next step
    assert report(writer).settled_stores == ((0, "w", (0, 1)),)
    assert report(writer).settled_stores == ()
    # Another engine's store of the same chunks finds them stored: it commits nothing.
    other, _ = env.worker(seed=2, maru_async_store=False, report_settled_stores=True)
    save(other, store_meta("o", keys, first_block=4))
    assert report(other).settled_stores == ((0, "o", ()),)
    # A step whose verdict is "drop" settles with nothing committed.
    dropped = env.keys(tokens(CHUNK, start=500))
    save(writer, store_meta("d", dropped, first_block=8), commit=False)
    assert report(writer).settled_stores == ((0, "d", ()),)


def test_stores_refused_while_asleep_are_settled(env):
    writer, _ = env.worker(seed=1, maru_async_store=False, report_settled_stores=True)
    writer.unregister_kv_caches()
    writer.wait_for_save(store_meta("s", env.keys(tokens(CHUNK)), first_block=0))
    assert report(writer).settled_stores == ((0, "s", ()),)


def test_without_kv_events_the_workers_report_no_settlement(env):
    writer, _ = env.worker(seed=1, maru_async_store=False)
    save(writer, store_meta("w", env.keys(tokens(CHUNK)), first_block=0))
    assert report(writer).settled_stores == ()


def test_the_ranks_settlements_are_all_kept_when_vllm_aggregates_their_reports():
    rank0 = MaruWorkerMetadata(5, settled_stores=((4, "a", (0, 1)),))
    rank1 = MaruWorkerMetadata(5, settled_stores=((4, "a", (0,)), (3, "b", ())))
    assert rank0.aggregate(rank1).settled_stores == ((4, "a", (0, 1)), (4, "a", (0,)), (3, "b", ()))
