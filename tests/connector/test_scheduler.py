"""The scheduler half driven with vLLM's own Request and SchedulerOutput."""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc

import pytest
from maru_core.keys import KeyNamespace, layer_key
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from maru_connector.config import parse_config
from maru_connector.lookup import LookupService
from maru_connector.metadata import MaruWorkerMetadata
from maru_connector.scheduler import MaruSchedulerHalf

from fake_index import FakeIndex, Location

BLOCK, CHUNK = 16, 32


class Geometry:  # what the fake index allocates over
    page_size, num_pages, data_offset = 4096, 4096, 0


class Blocks:
    """vLLM's KVCacheBlocks as the connector sees it: one group of block ids."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def make_half(index, num_layers=1, **knobs):
    cfg = parse_config({"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/x",
                        "maru_kv_chunk_tokens": CHUNK, **knobs}, BLOCK)
    ns = (KeyNamespace(model="m", dtype="bfloat16", kv_dtype="auto", layout="cpu/x",
                       block_size=BLOCK, chunk_tokens=CHUNK),)
    ns = (dataclasses.replace(ns[0], fmt=cfg.fmt_name),)
    return MaruSchedulerHalf(cfg, ns, BLOCK, LookupService(index.client, timeout_s=0.2),
                             num_layers=num_layers)


def request(req_id, n_tokens, start=1):
    return Request(req_id, list(range(start, start + n_tokens)), SamplingParams(max_tokens=4), None)


def commit_prefix(index, half, req, n_chunks):
    keys = half._keys(half._state(req)).by_rank[0]
    for i, key in enumerate(keys[:n_chunks]):
        index.committed[key] = Location(i * 4096, 4096, 1)
    half._reqs.pop(req.request_id)


def step_output(scheduled: dict, block_ids: dict, preempted=(), finished=()):
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = dict(scheduled)
    out.preempted_req_ids = set(preempted)
    out.finished_req_ids = set(finished)
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids=set(scheduled), resolve_block_ids=lambda r: (block_ids[r],),
        boundary_state_offloads={})
    return out


@pytest.fixture
def index():
    return FakeIndex(Geometry())


def test_partial_hit_loads_whole_chunks_into_the_allocated_blocks(index):
    half = make_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 2)
    assert half.get_num_new_matched_tokens(req, 0) == (64, False)
    half.update_state_after_alloc(req, Blocks(range(10, 17)), 64)
    meta = half.build_connector_meta(step_output({"a": 36}, {"a": list(range(10, 17))}))
    (load,) = meta.loads
    assert load.block_ids == ((10, 11), (12, 13)) and not load.is_async
    assert load.new_tokens == 36  # what the forward computes beside it
    assert half.stats.snapshot()["counters"]["lookup_hit_tokens"] == 64


@pytest.mark.parametrize("async_load", [False, True])
def test_full_prompt_hit_holds_back_one_token(index, async_load):
    half = make_half(index, maru_async_load=async_load, maru_park_lone_hits=True)
    req = request("a", 96)  # a round length: three whole chunks
    commit_prefix(index, half, req, 3)
    assert half.get_num_new_matched_tokens(req, 0) == (95, async_load)
    half.update_state_after_alloc(req, Blocks(range(6)), 95)
    (load,) = half.build_connector_meta(step_output({}, {})).loads
    assert load.num_chunks == 3  # the whole last chunk is loaded, one token recomputed
    assert load.new_tokens == 1


def test_async_hit_parks_only_while_another_request_is_live(index):
    """Parking costs the hit an engine step and buys nothing when no other
    request could run meanwhile: a lone hit loads in the step computing it."""
    half = make_half(index, maru_async_load=True)
    first, second = request("a", 100), request("b", 100)
    commit_prefix(index, half, first, 2)
    assert half.get_num_new_matched_tokens(first, 0) == (64, False)  # alone: in the step
    half.update_state_after_alloc(first, Blocks(range(7)), 64)
    assert half.get_num_new_matched_tokens(second, 0) == (64, True)  # "a" is live: parked
    half.update_state_after_alloc(second, Blocks(range(7, 14)), 64)
    loads = half.build_connector_meta(step_output({"a": 36}, {"a": list(range(7))})).loads
    assert [(load.req_id, load.is_async) for load in loads] == [("a", False), ("b", True)]
    assert half.stats.snapshot()["counters"]["parked_loads"] == 1
    assert half.stats.snapshot()["gauges"]["parked_requests"] == 1
    half.request_finished(first, list(range(7)))
    half.request_finished(second, [])
    third = request("c", 100)
    assert half.get_num_new_matched_tokens(third, 0) == (64, False)  # alone again


def test_local_hit_not_on_a_chunk_boundary_asks_for_nothing(index):
    half = make_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 3)
    assert half.get_num_new_matched_tokens(req, BLOCK) == (0, False)
    assert half.get_num_new_matched_tokens(req, CHUNK)[0] == 64


def test_failed_load_is_a_miss_for_that_request_next_time(index):
    half = make_half(index, maru_async_load=True, maru_park_lone_hits=True)
    req = request("a", 100)
    commit_prefix(index, half, req, 3)
    assert half.get_num_new_matched_tokens(req, 0) == (96, True)
    half.update_state_after_alloc(req, Blocks(range(7)), 96)
    half.build_connector_meta(step_output({}, {}))
    half.update_connector_output(KVConnectorOutput(
        finished_recving={"a"}, kv_connector_worker_meta=MaruWorkerMetadata(failed_load_req_ids={"a"})))
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # no livelock
    assert half.stats.snapshot()["counters"]["recomputed_tokens"] == 96
    other = request("b", 100)  # the same prefix for another request still hits
    assert half.get_num_new_matched_tokens(other, 0) == (96, True)


def test_slow_index_answers_ask_again_then_the_result(index):
    half = make_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 1)
    index.delay_s = 0.5
    start = time.monotonic()
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)
    assert time.monotonic() - start < 0.4  # the engine thread waited only the lookup timeout
    time.sleep(0.5)
    assert half.get_num_new_matched_tokens(req, 0) == (32, False)


def test_lookup_in_flight_answers_for_its_own_chunks_when_the_local_hit_grows(index):
    # The lookup asked from chunk 0 finds chunks 0-1 stored; meanwhile vLLM's
    # own prefix cache grew to chunk 1. The hit ends after chunk 1, not chunk 3.
    half = make_half(index)
    req = request("a", 130)
    commit_prefix(index, half, req, 2)
    index.delay_s = 0.5
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.6)
    assert half.get_num_new_matched_tokens(req, CHUNK) == (CHUNK, False)


def test_unreachable_index_is_a_miss_and_hits_resume_when_it_is_back(index):
    half = make_half(index)
    half._lookup._retry_after_s = 0.2
    req = request("a", 100)
    commit_prefix(index, half, req, 2)
    index.down = True
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    calls = index.calls["match_prefix"]
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert index.calls["match_prefix"] == calls  # no RPC queued behind a dead index
    index.down = False
    time.sleep(0.25)
    assert half.get_num_new_matched_tokens(req, 0) == (64, False)


def test_every_chunked_prefill_step_stores_its_new_chunks(index):
    half = make_half(index)
    req = request("a", 150)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = {"a": list(range(10))}
    stores = []
    for computed, scheduled in ((0, 40), (40, 40), (80, 70)):
        req.num_computed_tokens = computed
        meta = half.build_connector_meta(step_output({"a": scheduled}, blocks))
        stores.append([s.block_ids for s in meta.stores])
    assert stores == [
        [((0, 1),)],
        [((2, 3),)],
        [((4, 5), (6, 7))],  # tokens 64..127; the partial last chunk is not stored
    ]
    assert half.request_finished(req, list(range(10))) == (True, None)  # async store in flight


def test_request_finishing_while_parked_leaves_the_blocks_to_vllm(index):
    half = make_half(index, maru_async_load=True, maru_park_lone_hits=True)
    req = request("a", 100)
    commit_prefix(index, half, req, 2)
    assert half.get_num_new_matched_tokens(req, 0) == (64, True)
    half.update_state_after_alloc(req, Blocks(range(7)), 64)
    half.build_connector_meta(step_output({}, {}))
    assert half.stats.snapshot()["gauges"]["parked_requests"] == 1
    assert half.request_finished(req, []) == (False, None)
    meta = half.build_connector_meta(step_output({}, {}, finished={"a"}))
    assert meta.finished_req_ids == {"a"}
    assert half.stats.snapshot()["gauges"]["parked_requests"] == 0


def test_memory_does_not_grow_with_the_number_of_requests(index):
    half = make_half(index)

    def run(n, offset):
        for i in range(n):
            req = request(f"r{offset + i}", 70, start=offset + i)
            half.get_num_new_matched_tokens(req, 0)
            req.num_computed_tokens = 0
            meta = half.build_connector_meta(step_output({req.request_id: 70},
                                                         {req.request_id: list(range(5))}))
            half.update_connector_output(KVConnectorOutput(  # every step's report, as vLLM sends it
                kv_connector_worker_meta=MaruWorkerMetadata(step=meta.step)))
            half.request_finished(req, list(range(5)))

    run(200, 0)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    run(2000, 10_000)
    gc.collect()  # reference cycles of the test's scheduler outputs are garbage, not state
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename")
                 if "maru_connector" in str(s.traceback))
    assert half.num_tracked_requests == 0 and half._lookup.num_pending == 0
    assert growth < 64 * 1024


def test_layerwise_chunk_hits_only_when_every_layer_is_stored(index):
    half = make_half(index, num_layers=3, maru_use_layerwise=True)
    req = request("a", 100)
    keys = half._keys(half._state(req)).by_rank[0]
    half._reqs.pop("a")
    for c in range(2):
        for layer in range(3):
            index.committed[layer_key(keys[c], layer)] = Location(0, 1, 1)
    index.committed[layer_key(keys[2], 0)] = Location(0, 1, 1)  # chunk 2 is incomplete
    assert half.get_num_new_matched_tokens(req, 0) == (64, False)


def asking(req_id, n_tokens, mode):
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"maru_load": mode}})
    return Request(req_id, list(range(1, 1 + n_tokens)), params, None)


@pytest.mark.parametrize("mode, parked, whole", [("sync", False, True), ("overlap", False, False),
                                                 ("park", True, False)])
def test_a_request_picks_its_own_load_mode(index, mode, parked, whole):
    """``maru_load`` in a request's kv_transfer_params overrides the engine's
    choice for that request: here a lone hit (the engine would load it in its
    step, overlapped) and one beside another live request (the engine would park it)."""
    half = make_half(index, maru_async_load=True, maru_overlap_load_with_compute=True)
    commit_prefix(index, half, request("x", 100), 2)
    lone = asking("a", 100, mode)
    assert half.get_num_new_matched_tokens(lone, 0) == (64, parked)
    half.update_state_after_alloc(lone, Blocks(range(7)), 64)
    beside = asking("b", 100, mode)
    assert half.get_num_new_matched_tokens(beside, 0) == (64, parked)
    half.update_state_after_alloc(beside, Blocks(range(7, 14)), 64)
    loads = half.build_connector_meta(step_output({}, {})).loads
    assert [(load.is_async, load.wait_whole) for load in loads] == [(parked, whole)] * 2


@pytest.mark.parametrize("choice, stored_chunks", [(False, 0), (True, 2), ("false", 0)])
def test_a_request_that_asks_not_to_be_stored_still_loads_its_hit(index, choice, stored_chunks, caplog):
    """``maru_store: false`` keeps what the request computes out of the pool, and its cached
    prefix still loads; a value that is not a boolean is warned about and read as false."""
    half = make_half(index)
    commit_prefix(index, half, request("x", 100), 1)
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"maru_store": choice}})
    req = Request("a", list(range(1, 101)), params, None)
    with caplog.at_level("WARNING", logger="vllm.maru_connector.request_params"):
        assert half.get_num_new_matched_tokens(req, 0) == (CHUNK, False)
    half.update_state_after_alloc(req, Blocks(range(7)), CHUNK)
    req.num_computed_tokens = CHUNK
    meta = half.build_connector_meta(step_output({"a": 100 - CHUNK}, {"a": list(range(7))}))
    assert len(meta.loads) == 1
    assert sum(len(store.block_ids) for store in meta.stores) == stored_chunks
    assert ("maru_store" in caplog.text) == (not isinstance(choice, bool))


@pytest.mark.parametrize("mode, knobs", [("overlap", {"maru_async_load": True}),
                                         ("park", {"maru_overlap_load_with_compute": True}),
                                         ("later", {"maru_async_load": True}),
                                         (["sync"], {"maru_async_load": True})])
def test_a_load_mode_the_engine_cannot_honour_falls_back_to_the_engine_s_choice(index, mode, knobs, caplog):
    half = make_half(index, **knobs)
    commit_prefix(index, half, request("x", 100), 2)
    half.get_num_new_matched_tokens(request("other", 100, start=500), 0)  # a live request beside it
    req = asking("a", 100, mode)
    with caplog.at_level("WARNING", logger="vllm.maru_connector.request_params"):
        matched = half.get_num_new_matched_tokens(req, 0)
    assert matched == (64, knobs.get("maru_async_load", False))  # the engine's choice: park if async
    half.update_state_after_alloc(req, Blocks(range(7)), 64)
    (load,) = half.build_connector_meta(step_output({}, {})).loads
    assert not load.wait_whole
    assert "maru_load" in caplog.text and ("needs the engine" in caplog.text or "unknown" in caplog.text)


def make_partial_half(index, **knobs):
    """A half whose workers' engines load part of a chunk (both backends do)."""
    half = make_half(index, **knobs)
    half._partial_chunk_loads = True
    return half


def test_local_hit_inside_a_chunk_loads_the_rest_of_that_chunk_and_the_later_ones(index):
    from maru_connector.transfer.plan import SKIP_BLOCK

    half = make_partial_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 3)
    keys = half._keys(half._state(req)).by_rank[0]
    assert half.get_num_new_matched_tokens(req, BLOCK) == (3 * CHUNK - BLOCK, False)  # block-aligned
    half.update_state_after_alloc(req, Blocks(range(10, 17)), 3 * CHUNK - BLOCK)
    (load,) = half.build_connector_meta(step_output({"a": 4}, {"a": list(range(10, 17))})).loads
    assert load.keys(0) == tuple(keys[:3])  # the boundary chunk is loaded (and verified) whole
    assert load.block_ids == ((SKIP_BLOCK, 11), (12, 13), (14, 15))  # vLLM's own block is not written
    assert load.all_block_ids() == [11, 12, 13, 14, 15]  # what a failure would report
    assert load.new_tokens == 4
    assert half.stats.snapshot()["counters"]["lookup_hit_tokens"] == 3 * CHUNK - BLOCK


def test_local_hit_inside_a_chunk_whose_chunk_is_not_stored_asks_for_nothing(index):
    half = make_partial_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 1)  # chunk 0 only: the hit ends inside chunk 1
    assert half.get_num_new_matched_tokens(req, CHUNK + BLOCK) == (0, False)


def test_local_hit_off_a_block_boundary_asks_for_nothing(index):
    half = make_partial_half(index)
    req = request("a", 100)
    commit_prefix(index, half, req, 3)
    assert half.get_num_new_matched_tokens(req, BLOCK + 1) == (0, False)  # vLLM's hits are whole blocks
