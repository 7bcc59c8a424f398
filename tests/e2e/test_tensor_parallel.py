"""Tensor parallelism 2 on the real CPU engine: both ranks hit together, and a hit equals recompute.

Each rank stores and loads its own shard of the KV under its own keys; the
scheduler half reports a hit only for chunks every rank has stored, so both
ranks load or neither does. One engine serves the prompts twice: the first
time they are computed (and stored by both ranks), the second time they come
from the pool (vLLM's own prefix cache is off), and the float32 tokens must
be the same.
"""

from __future__ import annotations

import pytest

from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, MODEL_SPEC, NUM_LAYERS, connector_config, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

TP = 2
MAX_TOKENS = 6


def test_both_ranks_hit_together_and_equal_recompute(farm, index):
    engine = farm.get("tp2", connector_config(index, async_load=True, overlap_load_with_compute=True,
                                              overlap_release_after_layers=2),
                      tensor_parallel_size=TP, multiprocessing=True)  # fmt: skip
    prompts = [random_tokens((3 + i) * CHUNK_TOKENS + 7, seed=9100 + i) for i in range(2)]
    chunks = sum(len(p) // CHUNK_TOKENS for p in prompts)
    keys_before = index_keys(index)
    computed = engine.outputs(prompts, MAX_TOKENS)
    wait_for_keys(index, keys_before + TP * chunks)  # each rank stores its own shard
    before = engine.counters()
    loaded = engine.outputs(prompts, MAX_TOKENS)
    after = engine.counters()
    assert loaded == computed
    assert after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == chunks * CHUNK_TOKENS
    assert sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("maru_load_failures_total")) == 0
    # Both ranks loaded their shard of every layer of every chunk (float32 K and V).
    shard = CHUNK_TOKENS * NUM_LAYERS * (MODEL_SPEC.num_kv_heads // TP) * 2 * MODEL_SPEC.head_dim * 4
    assert after["maru_load_bytes_total"] - before["maru_load_bytes_total"] == TP * chunks * shard
    wait_settled(index)
    farm.close_one("tp2")
