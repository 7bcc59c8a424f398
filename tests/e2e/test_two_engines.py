"""Two real vLLM engines on one pool and one index: a hit equals recompute.

Engine A computes a prompt and stores its KV; engine B, a separate process,
serves the same prompt from the pool. B's greedy output must equal, token for
token, that of an engine without the connector, and B must really have hit
(its connector's own hit-token counter).
"""

from __future__ import annotations

import pytest

from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, NUM_LAYERS, connector_config, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
FORMATS = {"chunkwise": False, "layerwise": True}
SEED = {"chunkwise": 0, "layerwise": 1}


def _pair(farm, index, fmt: str, **knobs):
    """Engines A and B of one format (separate processes, same config)."""
    make = connector_config(index, use_layerwise=FORMATS[fmt], **knobs)
    return farm.get(f"{fmt}-A", make), farm.get(f"{fmt}-B", make)


def _objects(tokens: int, fmt: str) -> int:
    chunks = tokens // CHUNK_TOKENS
    return chunks * NUM_LAYERS if fmt == "layerwise" else chunks


def _store_then_hit(farm, index, reference, fmt: str, prompt: list[int]):
    """A stores `prompt`; B serves it. Returns B's hit tokens and output."""
    engine_a, engine_b = _pair(farm, index, fmt)
    keys_before = index_keys(index)
    out_a = engine_a.outputs([prompt], MAX_TOKENS)[0]
    wait_for_keys(index, keys_before + _objects(len(prompt), fmt))
    before = engine_b.counters()
    out_b = engine_b.outputs([prompt], MAX_TOKENS)[0]
    after = engine_b.counters()
    expected = reference.outputs([prompt], MAX_TOKENS)[0]
    assert out_a == expected, "engine A (storing) diverged from the engine without the connector"
    assert out_b == expected, "engine B (hit) diverged from recompute"
    return after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"], after, before


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_hit_in_second_engine_equals_recompute(farm, index, reference, fmt):
    prompt = random_tokens(5 * CHUNK_TOKENS + 17, seed=101 + SEED[fmt])
    hit, after, before = _store_then_hit(farm, index, reference, fmt, prompt)
    assert hit == 5 * CHUNK_TOKENS
    assert after["maru_load_bytes_total"] > before["maru_load_bytes_total"]
    wait_settled(index)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_full_prompt_hit_holds_back_a_token(farm, index, reference, fmt):
    """A prompt of exactly 4 chunks: everything is cached, yet one token is computed."""
    prompt = random_tokens(4 * CHUNK_TOKENS, seed=202 + SEED[fmt] * 1000)
    hit, _, _ = _store_then_hit(farm, index, reference, fmt, prompt)
    assert 3 * CHUNK_TOKENS <= hit < len(prompt)
    wait_settled(index)


def test_partial_prefix_hit(farm, index, reference):
    """Same document, another question: the document's chunks hit, the rest is computed."""
    engine_a, engine_b = _pair(farm, index, "chunkwise")
    document = random_tokens(3 * CHUNK_TOKENS, seed=303)
    first = document + random_tokens(40, seed=304)
    second = document + random_tokens(90, seed=305)
    keys_before = index_keys(index)
    engine_a.outputs([first], MAX_TOKENS)
    wait_for_keys(index, keys_before + 3)
    before = engine_b.counters()
    out = engine_b.outputs([second], MAX_TOKENS)[0]
    after = engine_b.counters()
    assert out == reference.outputs([second], MAX_TOKENS)[0]
    assert after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == 3 * CHUNK_TOKENS


def test_chunked_prefill_stores_every_step(farm, index, reference):
    """A prompt longer than max_num_batched_tokens is stored whole, then hits whole."""
    make = connector_config(index)
    small = {"max_num_batched_tokens": 128}
    engine_a = farm.get("chunked-A", make, **small)
    engine_b = farm.get("chunked-B", make, **small)
    prompt = random_tokens(9 * CHUNK_TOKENS + 20, seed=404)  # 596 tokens, 5 prefill steps
    keys_before = index_keys(index)
    engine_a.outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + 9)
    assert index_keys(index) - keys_before == 9, "every full chunk of every prefill step is stored, once"
    before = engine_b.counters()
    out = engine_b.outputs([prompt], MAX_TOKENS)[0]
    after = engine_b.counters()
    assert out == reference.outputs([prompt], MAX_TOKENS)[0]
    assert after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == 9 * CHUNK_TOKENS


def test_two_models_never_share_keys(farm, index, reference, other_model_dir):
    """A second model on the same pool misses on a prompt the first model stored."""
    engine_a, _ = _pair(farm, index, "chunkwise")
    other = farm.get("other-model", connector_config(index), model_dir=other_model_dir)
    prompt = random_tokens(4 * CHUNK_TOKENS + 5, seed=505)
    keys_before = index_keys(index)
    engine_a.outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + 4)
    before = other.counters()
    out = other.outputs([prompt], MAX_TOKENS)[0]
    after = other.counters()
    assert after["maru_lookup_hit_tokens_total"] == before["maru_lookup_hit_tokens_total"], "a foreign model's KV hit"
    assert out == reference.outputs([prompt], MAX_TOKENS, model="b", model_dir=other_model_dir)[0]
    # And the other model's own store of the same prompt is a new set of keys.
    wait_for_keys(index, keys_before + 8)


def test_three_process_engines(farm, index, reference):
    """vLLM's default process layout: scheduler and worker halves in separate processes."""
    make = connector_config(index)
    engine_a = farm.get("mp-A", make, multiprocessing=True)
    engine_b = farm.get("mp-B", make, multiprocessing=True)
    prompt = random_tokens(3 * CHUNK_TOKENS + 9, seed=606)
    keys_before = index_keys(index)
    engine_a.outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + 3)
    before = engine_b.counters()
    out = engine_b.outputs([prompt], MAX_TOKENS)[0]
    after = engine_b.counters()
    assert out == reference.outputs([prompt], MAX_TOKENS)[0]
    assert after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"] == 3 * CHUNK_TOKENS
    farm.close_one(engine_a.name)
    farm.close_one(engine_b.name)
