"""A local prefix-cache hit that ends inside a chunk, on the real vLLM CPU
engine (prefix caching on, vLLM's default): the rest of that chunk and the
later chunks come from the pool, and the KV and the greedy tokens equal a
recompute's (the test model is float32: see test_combinations.py)."""

from __future__ import annotations

import pytest

from maru_tools.stats_reader import failures
from maru_tools.workload import random_tokens

from .conftest import (BLOCK_SIZE, CHUNK_TOKENS, assert_same_prefix_kv, connector_config, index_keys,
                       wait_for_keys, wait_settled)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
STORED_CHUNKS = 4
LOCAL = 3 * BLOCK_SIZE  # the reader's own hit: ends inside chunk 1


def test_a_local_hit_ending_inside_a_chunk_loads_the_rest_and_equals_recompute(farm, index):
    assert LOCAL % CHUNK_TOKENS, "the local hit must end inside a chunk"
    stored = random_tokens(STORED_CHUNKS * CHUNK_TOKENS + 11, seed=61_900)
    sibling = stored[:LOCAL] + random_tokens(2 * CHUNK_TOKENS + 5, seed=61_901)
    writer = farm.get("chunkwise-A", connector_config(index, use_layerwise=False))
    keys_before = index_keys(index)
    (written,) = writer.run([stored], MAX_TOKENS, dump_kv=True)
    wait_for_keys(index, keys_before + STORED_CHUNKS)

    reader = farm.get("chunkwise-prefix-caching", connector_config(index), enable_prefix_caching=True)
    reader.run([sibling], MAX_TOKENS)  # vLLM's own cache now holds the first LOCAL tokens
    wait_settled(index)
    before = reader.counters()
    (read,) = reader.run([stored], MAX_TOKENS, dump_kv=True)
    after = reader.counters()

    hit = after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"]
    assert hit == STORED_CHUNKS * CHUNK_TOKENS - LOCAL  # from the local hit on, block-aligned
    assert failures(after) == failures(before)
    assert_same_prefix_kv(written.prompt_kv, read.prompt_kv, len(stored), STORED_CHUNKS * CHUNK_TOKENS)
    assert read.token_ids == farm.get("reference-a", None).outputs([stored], MAX_TOKENS)[0]
    assert read.token_ids == written.token_ids
    wait_settled(index)
