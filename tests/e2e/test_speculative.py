"""A real vLLM engine with speculative decoding reads and writes the pool.

With a speculative config, vLLM's model runner collects each step's
connector report (transfer results, load errors, worker metadata) before it
calls ``wait_for_save`` (``defer_kv_connector_finalize``). The stepped tests
(``test_vllm_scheduler.py``, ``deferred-finalize``) inject failures in that
order; this one runs the real engine with an n-gram speculator and the
operator's default load mode (async with overlap): every hit holds byte for
byte the KV its writer computed, its tokens equal those of the same engine
without the connector, and what it stores serves a third engine exactly.
"""

from __future__ import annotations

import pytest

from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, assert_same_prefix_kv, connector_config, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
KNOBS = {"async_load": True, "overlap_load_with_compute": True}  # the operator's default


def _repetitive(seed: int, chunks: int) -> list[int]:
    """A prompt whose n-grams repeat, so the speculator proposes drafts."""
    phrase = random_tokens(CHUNK_TOKENS // 4, seed=seed)
    return (phrase * (4 * chunks + 1))[: chunks * CHUNK_TOKENS + 11]


def test_speculative_engine_hits_and_stores_exact_kv(farm, index):
    writer = farm.get("chunkwise-A", connector_config(index, use_layerwise=False))
    spec = farm.get("speculative", connector_config(index, **KNOBS), speculative_config=NGRAM)
    reference = farm.get("reference-speculative", None, speculative_config=NGRAM)

    stored = _repetitive(seed=4100, chunks=3)
    keys = index_keys(index)
    wrote = writer.run([stored], MAX_TOKENS, dump_kv=True)[0]
    wait_for_keys(index, keys + 3)
    before = spec.counters()
    read = spec.run([stored], MAX_TOKENS, dump_kv=True)[0]
    after = spec.counters()
    assert after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == 3 * CHUNK_TOKENS
    assert_same_prefix_kv(wrote.prompt_kv, read.prompt_kv, len(stored), 3 * CHUNK_TOKENS)
    assert read.token_ids == reference.outputs([stored], MAX_TOKENS)[0]

    # What the speculative engine computes and stores is exact for the next reader.
    fresh = _repetitive(seed=4200, chunks=2)
    keys = index_keys(index)
    computed = spec.run([fresh], MAX_TOKENS, dump_kv=True)[0]
    assert computed.token_ids == reference.outputs([fresh], MAX_TOKENS)[0]
    wait_for_keys(index, keys + 2)
    before = writer.counters()
    loaded = writer.run([fresh], MAX_TOKENS, dump_kv=True)[0]
    assert writer.counters()["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == 2 * CHUNK_TOKENS
    assert_same_prefix_kv(computed.prompt_kv, loaded.prompt_kv, len(fresh), 2 * CHUNK_TOKENS)
    wait_settled(index)
