"""Hits at vLLM's block granularity, with vLLM's own ``Scheduler`` over the
toy model of :mod:`maru_tools.stepper` (its KV is exact) and a real index.

The writer stores a prompt, and with each chunk its block aliases (and the
whole blocks of its last chunk as its tail). The reader's prompt shares two
chunks and one more block of it, then diverges:
without aliases the pool would give it the two chunks; it gets the block
too, from the writer's chunk 2, whose first block is all it writes (the
whole object is verified, its second block summed where it lies). Any
doubt (a corrupted byte in the block left out, the chunk gone before the
load) is a recompute, and the KV is always the computed KV.
"""

from __future__ import annotations

import itertools

import pytest

from maru_connector.transfer.plan import SKIP_BLOCK
from maru_tools.cluster import wait_until

from .conftest import wait_settled
from .test_partial_chunk_hits import (_counters, _record_plans, _serve_to_output, assert_recomputed_exactly,
                                      corrupting)
from .test_vllm_scheduler import BLOCK, CHUNK, _config, _expected_tokens, _serve, engines  # noqa: F401 (a fixture)
from maru_tools.workload import random_tokens

SHARED = 2 * CHUNK + BLOCK + 3  # two chunks, one block of the third and three tokens more
STORED_CHUNKS = 4
ORDERS = {"finalize-in-step": False, "deferred-finalize": True}
MODES = {"sync": {}, "async": {"async_load": True, "park_lone_hits": True},
         "sync-overlap": {"overlap_load_with_compute": True}}

_seeds = itertools.count(62_000)  # a range of its own: tests isolate themselves by prompt


def _prompts():
    stored = random_tokens(STORED_CHUNKS * CHUNK + 5, seed=next(_seeds))
    reader = stored[:SHARED] + random_tokens(2 * CHUNK, seed=next(_seeds))
    return stored, reader


def _store(engines, index, prompt):
    """Serve ``prompt`` on a writer; wait until its chunks, its tail and their aliases are in."""
    aliases = index.stats()["aliases"]
    writer = engines(_config(index))
    assert _serve(writer, "w", prompt) == _expected_tokens(prompt, writer.num_layers, 2)
    expected = (CHUNK // BLOCK - 1) * (len(prompt) // CHUNK) + len(prompt) % CHUNK // BLOCK  # chunks', tail's
    wait_until(lambda: index.stats()["aliases"] >= aliases + expected, 30.0, what="the writer's aliases registered")


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_prompt_sharing_part_of_a_chunk_loads_that_chunk_s_first_blocks(engines, index, mode, defer_finalize):
    stored, prompt = _prompts()
    _store(engines, index, stored)
    reader = engines(_config(index, **MODES[mode]), defer_finalize=defer_finalize)
    planned = _record_plans(reader)
    _serve_to_output(reader, "r", prompt)
    assert reader.wrong_positions("r", prompt) == []  # the KV bytes are the computed KV
    ids = reader.block_ids("r")
    (spec,) = planned
    assert spec.block_ids[-1] == (ids[2 * CHUNK // BLOCK], SKIP_BLOCK)  # the block after it is not written
    assert spec.all_block_ids() == ids[:SHARED // BLOCK]
    assert _counters(reader)["lookup_hit_tokens"] == SHARED // BLOCK * BLOCK  # vLLM's granularity, not 2 chunks
    assert not any(r.invalid_block_ids or r.failed_recving for r in reader.history)
    reader.run(until=lambda: "r" in reader.finished)
    assert reader.finished["r"].output == _expected_tokens(prompt, reader.num_layers, 2)
    wait_settled(index)


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_prompt_that_goes_on_from_a_stored_prompt_loads_its_tail(engines, index, mode, defer_finalize):
    """The stored prompt's last, partial chunk holds a whole block: it is
    stored as the prompt's tail, and a prompt that goes on from the stored
    one (a conversation's next turn) loads it."""
    stored = random_tokens(STORED_CHUNKS * CHUNK + BLOCK + 5, seed=next(_seeds))
    _store(engines, index, stored)
    prompt = stored[:STORED_CHUNKS * CHUNK + BLOCK] + random_tokens(CHUNK, seed=next(_seeds))
    reader = engines(_config(index, **MODES[mode]), defer_finalize=defer_finalize)
    planned = _record_plans(reader)
    _serve_to_output(reader, "r", prompt)
    assert reader.wrong_positions("r", prompt) == []
    (spec,) = planned
    assert spec.block_ids[-1] == (reader.block_ids("r")[STORED_CHUNKS * CHUNK // BLOCK], SKIP_BLOCK)
    assert _counters(reader)["lookup_hit_tokens"] == STORED_CHUNKS * CHUNK + BLOCK
    reader.run(until=lambda: "r" in reader.finished)
    assert reader.finished["r"].output == _expected_tokens(prompt, reader.num_layers, 2)
    wait_settled(index)


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_corrupted_byte_in_the_block_left_out_fails_the_load_and_it_is_recomputed(
        engines, index, mode, defer_finalize):
    stored, prompt = _prompts()
    _store(engines, index, stored)
    wrapped, wrap = corrupting("tail")
    reader = engines(_config(index, **MODES[mode]), wrap_resources=wrap, defer_finalize=defer_finalize)
    assert _serve(reader, "r", prompt) == _expected_tokens(prompt, reader.num_layers, 2)
    assert_recomputed_exactly(reader, index, prompt, wrapped)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_prompt_shorter_than_a_chunk_loads_a_stored_prompt_s_tail(engines, index, mode):
    stored = random_tokens(CHUNK - 5, seed=next(_seeds))  # one whole block, no whole chunk
    _store(engines, index, stored)
    prompt = stored[:BLOCK + 3] + random_tokens(8, seed=next(_seeds))
    reader = engines(_config(index, **MODES[mode]))
    _serve_to_output(reader, "r", prompt)
    assert reader.wrong_positions("r", prompt) == []
    assert _counters(reader)["lookup_hit_tokens"] == BLOCK
    reader.run(until=lambda: "r" in reader.finished)
    assert reader.finished["r"].output == _expected_tokens(prompt, reader.num_layers, 2)
    wait_settled(index)


def test_the_aliased_chunk_gone_before_the_load_is_recomputed(engines, index, proxy):
    stored, prompt = _prompts()
    _store(engines, index, stored)
    reader = engines(_config(index, url=proxy.url))
    planned = _record_plans(reader)
    proxy.arm("miss", count=1, op="retrieve", position=2)  # the aliased chunk's object
    try:
        assert _serve(reader, "r", prompt) == _expected_tokens(prompt, reader.num_layers, 2)
    finally:
        proxy.disarm()
    assert proxy.fired == 1
    assert reader.worker.worker_half.stats.snapshot()["load_failures"].get("miss") == 1
    (spec,) = planned
    (invalid,) = [r.invalid_block_ids for r in reader.history if r.invalid_block_ids]
    assert invalid == set(spec.all_block_ids())
    wait_settled(index)
