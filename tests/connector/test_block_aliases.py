"""Hits at vLLM's block granularity: the scheduler half looks past the whole
chunks a lookup matched to the block aliases of the chunk it missed, and
plans a load of that stored chunk's first blocks only; every store plans the
aliases of its chunks. Driven with vLLM's own Request and SchedulerOutput
over the fake index (``test_vllm_scheduler.py`` and the e2e tests drive a
real index and engine)."""

from __future__ import annotations

import dataclasses

import pytest
from maru_core.keys import KeyNamespace, block_alias_keys, chunk_keys, layer_key, split_keys
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from maru_connector.config import parse_config
from maru_connector.early_pins import PinHandoff
from maru_connector.lookup import LookupService
from maru_connector.scheduler import MaruSchedulerHalf
from maru_connector.transfer.plan import SKIP_BLOCK

from fake_index import FakeIndex, Location
from test_scheduler import Blocks, Geometry, step_output

BLOCK, CHUNK = 16, 64  # four blocks per chunk: three aliases each
PER = CHUNK // BLOCK
LAYERS = 3


def make_half(index, alias_loads=True, layerwise=False, handoff=None, **knobs):
    cfg = parse_config({"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/x",
                        "maru_kv_chunk_tokens": CHUNK, "maru_format": "layerwise" if layerwise else "chunkwise",
                        **knobs}, BLOCK)
    ns = KeyNamespace(model="m", dtype="bfloat16", kv_dtype="auto", layout="cpu/x", block_size=BLOCK,
                      chunk_tokens=CHUNK, fmt=cfg.fmt_name)
    return MaruSchedulerHalf(cfg, (ns,), BLOCK, LookupService(index.client, timeout_s=0.5),
                             num_layers=LAYERS, handoff=handoff, partial_chunk_loads=True,
                             block_alias_loads=alias_loads)


def request(req_id, tokens):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4), None)


SHARED = list(range(1, 1 + CHUNK + 2 * BLOCK))  # one chunk and two blocks of the next
WRITER = SHARED + list(range(5000, 5000 + 2 * CHUNK))  # goes on past them
READER = SHARED + list(range(9000, 9000 + CHUNK))  # diverges after them


def store_writer(index, half, layerwise=False):
    """The writer's chunks committed and their aliases registered, as its workers would."""
    req = request("w", WRITER)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    half.update_state_after_alloc(req, Blocks(range(20)), 0)
    (store,) = half.build_connector_meta(step_output({"w": len(WRITER)}, {"w": list(range(20))})).stores
    keys = store.keys(0)
    objects = [obj for key in keys for obj in ([layer_key(key, layer) for layer in range(LAYERS)]
                                               if layerwise else [key])]
    for i, obj in enumerate(objects, start=1):
        index.committed[obj] = Location(i * 4096, 4096, 1)
    for chunk, packed in zip(keys, store.aliases(0)):
        index.aliases.update((alias, chunk) for alias in split_keys(packed))
    half.request_finished(req, [])
    return keys


def test_every_stored_chunk_carries_its_block_aliases_and_the_prompt_its_tail(index):
    half = make_half(index)
    *keys, tail = store_writer(index, half)
    ns = half._namespaces[0]
    assert keys == chunk_keys(ns, WRITER)  # three chunks, then two whole blocks and no more
    want = [b"".join(block_alias_keys(ns, keys[c - 1] if c else None, WRITER[c * CHUNK:(c + 1) * CHUNK], PER - 1))
            for c in range(len(keys))]
    assert [b"".join(a for a, k in index.aliases.items() if k == key) for key in keys] == want
    tail_aliases = block_alias_keys(ns, keys[-1], WRITER[3 * CHUNK:], 2)
    assert tail == tail_aliases[-1]  # stored under its longest alias, which names it too
    assert [a for a, k in index.aliases.items() if k == tail] == tail_aliases
    assert len(index.aliases) == len(keys) * (PER - 1) + 2


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_prompt_that_shares_part_of_a_chunk_loads_that_chunk_s_first_blocks(index, layerwise):
    half = make_half(index, layerwise=layerwise)
    keys = store_writer(index, half, layerwise)
    req = request("r", READER)
    assert half.get_num_new_matched_tokens(req, 0) == (len(SHARED), False)  # 96: not just the 64 of a chunk
    ids = list(range(40, 40 + len(READER) // BLOCK + 1))
    half.update_state_after_alloc(req, Blocks(ids), len(SHARED))
    req.num_computed_tokens = len(SHARED)  # as vLLM counts a hit
    meta = half.build_connector_meta(step_output({"r": len(READER) - len(SHARED)}, {"r": ids}))
    (load,) = meta.loads
    assert load.keys(0) == (keys[0], keys[1])  # the writer's chunk 1: its first two blocks are ours
    assert load.block_ids == (tuple(ids[:PER]), (ids[4], ids[5], SKIP_BLOCK, SKIP_BLOCK))
    assert load.all_block_ids() == ids[:6]
    assert half.stats.snapshot()["counters"]["lookup_hit_tokens"] == len(SHARED)
    # The reader's own chunk 1 is not the writer's: it stores it once computed, and its tail.
    (store,) = meta.stores
    ns = half._namespaces[0]
    reader_keys = chunk_keys(ns, READER)
    assert store.keys(0) == (reader_keys[1], block_alias_keys(ns, reader_keys[1], READER[2 * CHUNK:], 2)[-1])
    assert store.block_ids[-1] == (ids[8], ids[9], ids[9], ids[9])  # two whole blocks, the last repeated


def test_the_longest_alias_whose_chunk_is_committed_wins(index):
    half = make_half(index)
    keys = store_writer(index, half)
    del index.committed[keys[1]]  # evicted: its aliases name nothing loadable
    other = request("o", SHARED[:CHUNK + BLOCK] + list(range(7000, 7000 + 3 * CHUNK)))
    store_other = make_half(index)
    assert store_other.get_num_new_matched_tokens(other, 0) == (CHUNK, False)  # chunk 0 only
    store_other.update_state_after_alloc(other, Blocks(range(60, 80)), CHUNK)
    store_other.build_connector_meta(step_output({"o": 10}, {"o": list(range(60, 80))}))
    (store,) = store_other.build_connector_meta(
        step_output({"o": len(other.prompt_token_ids) - CHUNK - 10}, {"o": list(range(60, 80))})).stores
    for i, (chunk, packed) in enumerate(zip(store.keys(0), store.aliases(0)), start=100):
        index.committed[chunk] = Location(i * 4096, 4096, 1)
        index.aliases.update((alias, chunk) for alias in split_keys(packed))
    # The reader shares two blocks with the writer's evicted chunk, one with the other's stored one.
    assert half.get_num_new_matched_tokens(request("r", READER), 0) == (CHUNK + BLOCK, False)


def test_an_alias_is_asked_for_only_beyond_vllm_s_own_hit(index):
    half = make_half(index)
    keys = store_writer(index, half)
    req = request("r", READER)
    assert half.get_num_new_matched_tokens(req, CHUNK + BLOCK) == (BLOCK, False)  # block 1 of chunk 1
    ids = list(range(40, 48))
    half.update_state_after_alloc(req, Blocks(ids), BLOCK)
    (load,) = half.build_connector_meta(step_output({"r": 10}, {"r": ids})).loads
    assert load.keys(0) == (keys[1],)
    assert load.block_ids == ((SKIP_BLOCK, ids[5], SKIP_BLOCK, SKIP_BLOCK),)
    index.calls.clear()
    assert half.get_num_new_matched_tokens(request("r2", READER), CHUNK + 3 * BLOCK) == (0, False)
    assert index.calls["match_alias"] == 0  # nothing beyond vLLM's own blocks to ask for


def test_an_engine_that_loads_whole_chunks_only_still_stores_aliases(index):
    half = make_half(index, alias_loads=False)
    store_writer(index, half)
    assert index.aliases  # for engines that load them
    assert half.get_num_new_matched_tokens(request("r", READER), 0) == (CHUNK, False)
    assert index.calls["match_alias"] == 0


def test_aliases_off_neither_stores_nor_asks(index):
    half = make_half(index, maru_block_aliases=False)
    store_writer(index, half)
    assert not index.aliases
    assert half.get_num_new_matched_tokens(request("r", READER), 0) == (CHUNK, False)
    assert index.calls["match_alias"] == 0


def test_an_index_without_aliases_gives_whole_chunk_hits_and_is_asked_once(index):
    half = make_half(index)
    store_writer(index, half)
    index.knows_aliases = False
    index.calls.clear()
    assert half.get_num_new_matched_tokens(request("r", READER), 0) == (CHUNK, False)
    assert half.get_num_new_matched_tokens(request("r2", READER), 0) == (CHUNK, False)
    assert index.calls["match_alias"] == 1


def test_a_lookup_that_finds_an_alias_keeps_no_early_pin(index):
    handoff = PinHandoff()
    handoff.attach_worker()
    half = make_half(index, handoff=handoff)
    keys = store_writer(index, half)
    req = request("r", READER)
    assert half.get_num_new_matched_tokens(req, 0) == (len(SHARED), False)
    assert half._lookup.early_pin("r") is None
    assert index.pins[keys[0]] == 0  # the chunk-0 pin of the match was given back
    half.update_state_after_alloc(req, Blocks(range(40, 48)), len(SHARED))
    (load,) = half.build_connector_meta(step_output({"r": 10}, {"r": list(range(40, 48))})).loads
    assert load.early_pin == 0  # the worker pins both chunks itself


def test_a_request_without_aliases_asks_for_whole_chunks(index):
    half = make_half(index)
    store_writer(index, half)
    req = request("r", READER)
    state = half._state(req)
    state.keys = dataclasses.replace(state.keys, namespaces=None)  # as for multimodal input
    assert half.get_num_new_matched_tokens(req, 0) == (CHUNK, False)


def test_a_prompt_that_ends_where_a_stored_prompt_ends_loads_its_tail(index):
    half = make_half(index)
    *keys, tail = store_writer(index, half)
    req = request("r", WRITER[:3 * CHUNK + BLOCK] + [7] * 40)  # the writer's tail's first block, then others
    assert half.get_num_new_matched_tokens(req, 0) == (3 * CHUNK + BLOCK, False)
    ids = list(range(40, 56))
    half.update_state_after_alloc(req, Blocks(ids), 3 * CHUNK + BLOCK)
    (load,) = half.build_connector_meta(step_output({"r": 40}, {"r": ids})).loads
    assert load.keys(0) == (*keys, tail)
    assert load.block_ids[-1] == (ids[12], SKIP_BLOCK, SKIP_BLOCK, SKIP_BLOCK)


def test_a_prompt_shorter_than_a_chunk_loads_a_stored_prompt_s_tail(index):
    half = make_half(index)
    short = WRITER[:2 * BLOCK + 5]  # no whole chunk: only its tail can hold it
    req = request("w", short)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)  # asked: nothing stored yet
    half.update_state_after_alloc(req, Blocks(range(4)), 0)
    (store,) = half.build_connector_meta(step_output({"w": len(short)}, {"w": list(range(4))})).stores
    (tail,) = store.keys(0)
    index.committed[tail] = Location(4096, 4096, 1)
    index.aliases.update((a, tail) for a in split_keys(store.aliases(0)[0]))
    half.request_finished(req, [])
    reader = request("r", short[:BLOCK + 3] + [9] * 20)
    assert half.get_num_new_matched_tokens(reader, 0) == (BLOCK, False)
    index.calls.clear()
    assert half.get_num_new_matched_tokens(request("r2", short[:BLOCK - 1]), 0) == (0, False)
    assert not index.calls  # not even a whole block: the index is not asked


@pytest.mark.parametrize("length", [3 * CHUNK, 3 * CHUNK + BLOCK - 1])
def test_a_prompt_without_a_whole_block_past_its_chunks_stores_no_tail(index, length):
    half = make_half(index)
    req = request("w", WRITER[:length])
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, Blocks(range(20)), 0)
    (store,) = half.build_connector_meta(step_output({"w": length}, {"w": list(range(20))})).stores
    assert store.keys(0) == tuple(chunk_keys(half._namespaces[0], WRITER[:length]))


def test_the_tail_is_stored_once_when_the_prompt_is_computed(index):
    half = make_half(index)
    req = request("w", WRITER)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, Blocks(range(20)), 0)
    stores = []
    for computed, tokens in ((0, 2 * CHUNK), (2 * CHUNK, CHUNK + BLOCK), (3 * CHUNK + BLOCK, BLOCK), (len(WRITER), 1)):
        req.num_computed_tokens = computed  # chunked prefill, then a decode step
        stores += half.build_connector_meta(step_output({"w": tokens}, {"w": list(range(20))})).stores
    # chunks 0-1, chunk 2, then the tail once the prompt is computed; nothing while decoding
    assert [len(s.keys(0)) for s in stores] == [2, 1, 1]
    assert stores[-1].block_ids == ((12, 13, 13, 13),)


def test_an_engine_that_loads_no_alias_stores_no_tail(index):
    half = make_half(index, alias_loads=False)
    keys = store_writer(index, half)
    assert keys == tuple(chunk_keys(half._namespaces[0], WRITER))  # chunks only (their aliases are metadata)


@pytest.fixture
def index():
    return FakeIndex(Geometry())


# ---- the worker half: registers the aliases of what it committed, loads a chunk's first blocks


def _worker_store(env, n_tokens, commit=True):
    from maru_connector.metadata import MaruConnectorMetadata, StoreSpec
    from worker_env import BLOCK as W_BLOCK, spec_blocks, tokens as make_tokens

    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    prompt = make_tokens(n_tokens)
    keys = env.keys(prompt)
    per = env.ns.chunk_tokens // W_BLOCK
    aliases = tuple(b"".join(block_alias_keys(env.ns, keys[c - 1] if c else None,
                                              prompt[c * env.ns.chunk_tokens:], per - 1))
                    for c in range(len(keys)))
    spec = StoreSpec(req_id="w", keys_by_rank=(tuple(keys),), block_ids=spec_blocks(0, len(keys)),
                     step=1, aliases_by_rank=(aliases,))
    writer.wait_for_save(MaruConnectorMetadata(step=1, stores=[spec]))
    writer.wait_for_save(MaruConnectorMetadata(step=2, store_verdicts={1: commit}))
    return keys, aliases, kv_w, writer


@pytest.fixture
def env():
    from worker_env import WorkerEnv

    env = WorkerEnv()
    yield env
    env.close()


def test_the_worker_registers_the_aliases_of_the_chunks_it_committed_only(env):
    keys, aliases, _, _ = _worker_store(env, 64)
    assert {a: k for k, packed in zip(keys, aliases) for a in split_keys(packed)} == env.index.aliases
    assert env.index.calls["put_aliases"] == 1  # one call for the step's chunks


def test_a_dropped_store_registers_no_alias(env):
    _worker_store(env, 64, commit=False)
    assert not env.index.committed and not env.index.aliases
    assert env.index.calls["put_aliases"] == 0


def test_an_index_without_aliases_still_commits_the_store(env):
    env.index.knows_aliases = False
    keys, _, _, writer = _worker_store(env, 64)
    assert set(keys) <= set(env.index.committed) and not env.index.aliases
    assert not any(writer.stats.snapshot()["store_failures"].values())


def test_a_load_of_a_chunk_s_first_blocks_writes_them_and_nothing_after(env):
    from maru_connector.metadata import LoadSpec, MaruConnectorMetadata
    from worker_env import blocks_equal

    keys, _, kv_w, _ = _worker_store(env, 64)  # two chunks of two blocks: blocks 0-3 of the writer
    reader, kv_r = env.worker(seed=2, maru_async_store=False)
    before = {name: t.clone() for name, t in kv_r.items()}
    spec = LoadSpec(req_id="r", keys_by_rank=((keys[0], keys[1]),), block_ids=((20, 21), (22, SKIP_BLOCK)))
    reader.start_load_kv(MaruConnectorMetadata(loads=[spec]))
    assert not reader.get_block_ids_with_load_errors()
    assert blocks_equal(kv_w, range(3), kv_r, range(20, 23))
    assert blocks_equal(before, [23], kv_r, [23])  # the block the alias does not cover is untouched
