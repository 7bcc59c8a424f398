"""A local prefix-cache hit that ends inside a chunk, with vLLM's own
``Scheduler`` (prefix caching on) over the toy model of
:mod:`maru_tools.stepper`, whose KV is exact.

The reader first serves a prompt that shares 1.5 chunks with the stored
one, so vLLM's own prefix cache holds 3 blocks of it; the stored prompt
then hits 48 tokens locally, which ends inside chunk 1. The pool gives the
rest: the second block of chunk 1 and the whole later chunks, verified per
whole object (the skipped first block of chunk 1 too), never written over
vLLM's own blocks. Any doubt (a corrupted byte in the skipped head, the
boundary chunk gone) is a recompute, and the KV is always the computed KV.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from maru_connector.transfer.plan import SKIP_BLOCK
from maru_tools.cluster import wait_until
from maru_tools.stepper import LAYER_NAME
from maru_tools.workload import random_tokens

from .conftest import index_keys, wait_for_keys, wait_settled
from .test_vllm_scheduler import BLOCK, CHUNK, _config, _expected_tokens, _serve, engines  # noqa: F401 (a fixture)

LOCAL = 3 * BLOCK  # vLLM's own hit: ends inside chunk 1
STORED_CHUNKS = 4
ORDERS = {"finalize-in-step": False, "deferred-finalize": True}
MODES = {"sync": {}, "async": {"async_load": True, "park_lone_hits": True},
         "sync-overlap": {"overlap_load_with_compute": True}}

_seeds = itertools.count(61_000)  # a range of its own: tests isolate themselves by prompt


def _prompts():
    """The stored prompt, and one sharing its first ``LOCAL`` tokens only."""
    stored = random_tokens(STORED_CHUNKS * CHUNK + 5, seed=next(_seeds))
    sibling = stored[:LOCAL] + random_tokens(2 * CHUNK, seed=next(_seeds))
    return stored, sibling


def _store(engines, index, prompt):
    keys = index_keys(index)
    writer = engines(_config(index))
    assert _serve(writer, "w", prompt) == _expected_tokens(prompt, writer.num_layers, 2)
    wait_for_keys(index, keys + len(prompt) // CHUNK)


def _reader(engines, index, sibling, **kwargs):
    """A reader whose own prefix cache holds the first ``LOCAL`` tokens of
    ``sibling`` (and so of the stored prompt)."""
    reader = engines(_config(index, url=kwargs.pop("url", None), **kwargs.pop("knobs", {})),
                     prefix_caching=True, **kwargs)
    assert _serve(reader, "sibling", sibling) == _expected_tokens(sibling, reader.num_layers, 2)
    wait_settled(index)
    return reader


def _counters(reader):
    half = reader.scheduler.connector.scheduler_half
    return half.stats.snapshot()["counters"]


def _serve_to_output(reader, req_id, prompt):
    """Serve ``prompt`` until its first token; its KV is then all in its blocks."""
    reader.add(req_id, prompt, max_tokens=2)
    reader.run(until=lambda: reader.requests.get(req_id) is None or reader.requests[req_id].output)


def _record_plans(reader) -> list:
    """The load plans the reader's scheduler half makes from now on."""
    half = reader.scheduler.connector.scheduler_half
    planned: list = []
    plan = half._plan_load

    def recording(request, blocks, num_external_tokens):
        spec = plan(request, blocks, num_external_tokens)
        if spec is not None:
            planned.append(spec)
        return spec

    half._plan_load = recording
    return planned


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_local_hit_ending_inside_a_chunk_gets_the_rest_from_the_pool(engines, index, mode, defer_finalize):
    stored, sibling = _prompts()
    _store(engines, index, stored)
    reader = _reader(engines, index, sibling, knobs=MODES[mode], defer_finalize=defer_finalize)
    hit_before = _counters(reader)["lookup_hit_tokens"]
    loaded_before = reader.worker.worker_half.stats.snapshot()["counters"]["load_bytes"]
    planned = _record_plans(reader)
    _serve_to_output(reader, "r", stored)
    assert reader.wrong_positions("r", stored) == []  # the KV bytes are the computed KV
    # vLLM's own hit, then the pool's: the rest of chunk 1 and chunks 2-3, block-aligned
    ids = reader.block_ids("r")
    (spec,) = planned
    assert spec.block_ids[0] == (SKIP_BLOCK, ids[LOCAL // BLOCK])  # vLLM's own block is not written
    assert spec.all_block_ids() == ids[LOCAL // BLOCK:STORED_CHUNKS * CHUNK // BLOCK]
    assert _counters(reader)["lookup_hit_tokens"] - hit_before == STORED_CHUNKS * CHUNK - LOCAL
    assert not any(r.invalid_block_ids or r.failed_recving for r in reader.history)
    reader.run(until=lambda: "r" in reader.finished)
    assert reader.finished["r"].output == _expected_tokens(stored, reader.num_layers, 2)
    stats = reader.worker.worker_half.stats
    written = len(spec.all_block_ids()) * reader.kv_caches[LAYER_NAME.format(0)][0].nbytes
    wait_until(lambda: stats.snapshot()["counters"]["load_bytes"] - loaded_before == written * reader.num_layers,
               10.0, what="the load counted with the bytes it wrote")
    wait_settled(index)


class CorruptLeftOutBlock:
    """The worker's engine, flipping one byte of a block a load leaves out
    (``SKIP_BLOCK``) before the copies: the first block of the load's first
    object (``end="head"``: the block vLLM holds already) or the last block
    of its last (``end="tail"``: a block a block alias does not cover)."""

    def __init__(self, real, end: str):
        self.real = real
        self.end = end
        self.flipped = 0

    def submit_load(self, chunks, *args, **kwargs):
        ids, sources = chunks[0] if self.end == "head" else chunks[-1]
        position = 0 if self.end == "head" else len(ids) - 1
        if ids[position] == SKIP_BLOCK:
            block = self.real.layout.block_bytes_per_layer
            self.real.pool[self.real.fmt.layer_source(tuple(sources), 0) + position * block + 5] ^= 0x01
            self.flipped += 1
        return self.real.submit_load(chunks, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def corrupting(end: str) -> tuple[list, Callable]:
    """A ``wrap_resources`` hook putting a ``CorruptLeftOutBlock`` before the
    worker's engine, and the list it puts each one made into."""
    made: list[CorruptLeftOutBlock] = []

    def wrap(resources):
        resources.engine = CorruptLeftOutBlock(resources.engine, end)
        made.append(resources.engine)
        return resources

    return made, wrap


def assert_recomputed_exactly(reader, index, prompt, wrapped) -> None:
    """The corrupted load ran once, failed its check, was reported once, and
    what the reader recomputed is exact (checked in a fresh request's blocks,
    the corrupted object now refused on every load)."""
    assert wrapped[0].flipped == 1
    failures = reader.worker.worker_half.stats.snapshot()["load_failures"]
    assert failures.get("header_mismatch") == 1  # the whole object was verified
    assert len([r for r in reader.history if r.invalid_block_ids]) == 1
    wait_settled(index)
    _serve_to_output(reader, "again", prompt)
    assert reader.wrong_positions("again", prompt) == []


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_corrupted_byte_in_the_skipped_head_fails_the_load_and_it_is_recomputed(
        engines, index, mode, defer_finalize):
    stored, sibling = _prompts()
    _store(engines, index, stored)
    wrapped, wrap = corrupting("head")
    reader = _reader(engines, index, sibling, knobs=MODES[mode], wrap_resources=wrap,
                     defer_finalize=defer_finalize)
    assert _serve(reader, "r", stored) == _expected_tokens(stored, reader.num_layers, 2)
    assert_recomputed_exactly(reader, index, stored, wrapped)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_boundary_chunk_gone_before_the_load_is_recomputed(engines, index, proxy, mode):
    """The boundary chunk is evicted between the lookup and the load: the
    load fails, the request is recomputed from vLLM's own blocks on, and
    none of those shared blocks is reported as failed."""
    stored, sibling = _prompts()
    _store(engines, index, stored)
    reader = _reader(engines, index, sibling, url=proxy.url, knobs={**MODES[mode], "early_pins": False})
    planned = _record_plans(reader)
    proxy.arm("miss", count=1, op="retrieve", position=0)  # the boundary chunk's object
    try:
        assert _serve(reader, "r", stored) == _expected_tokens(stored, reader.num_layers, 2)
    finally:
        proxy.disarm()
    assert proxy.fired == 1
    assert reader.worker.worker_half.stats.snapshot()["load_failures"].get("miss") == 1
    (spec,) = planned
    assert spec.block_ids[0][0] == SKIP_BLOCK
    (invalid,) = [r.invalid_block_ids for r in reader.history if r.invalid_block_ids]
    assert invalid == set(spec.all_block_ids())  # not vLLM's own block of the boundary chunk
    assert len(invalid) == STORED_CHUNKS * CHUNK // BLOCK - LOCAL // BLOCK
    wait_settled(index)


def test_a_boundary_chunk_missing_at_the_lookup_asks_the_pool_for_nothing(engines, index):
    """Only the chunks before the boundary are stored: nothing is loaded."""
    stored, sibling = _prompts()
    _store(engines, index, stored[:CHUNK + 1])  # chunk 0 only
    reader = _reader(engines, index, sibling)
    hit_before = _counters(reader)["lookup_hit_tokens"]
    _serve_to_output(reader, "r", stored)
    assert _counters(reader)["lookup_hit_tokens"] == hit_before
    assert reader.wrong_positions("r", stored) == []
