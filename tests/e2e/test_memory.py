"""The connector's memory does not grow with the requests it serves.

An engine serves many requests (hits, misses and stores mixed). After a
warm-up, the count of live objects of every MaruCache type in the engine
process stays flat, and so does the process's resident memory (within a
margin for the allocator).
"""

from __future__ import annotations

import pytest

from maru_connector.testing.workload import random_tokens

from .conftest import CHUNK_TOKENS, connector_config

pytestmark = pytest.mark.vllm

WARM_UP_ROUNDS = 5
ROUNDS = 18
PER_ROUND = 10
# The float32 engine's allocator arenas (a batch's activations and logits)
# settle over the first rounds and then wander by tens of MiB. A leak of one
# request's KV (158 tokens x 4 layers x 2 KV heads x 128 x 4 B = 0.65 MiB)
# per request would add 117 MiB over the measured 180 requests; Python-level
# leaks of the connector show in the object counts below.
RSS_MARGIN_BYTES = 80 * 1024 * 1024
OBJECT_SLACK = 16  # objects of a request in flight at the moment of counting


def _round(engine, round_no: int) -> None:
    # Half the prompts repeat an earlier round's (hits), half are new (misses + stores).
    prompts = [
        random_tokens(2 * CHUNK_TOKENS + 30, seed=4000 + (round_no // 2) * PER_ROUND + i if i % 2 else 4000 + round_no * PER_ROUND + i)
        for i in range(PER_ROUND)
    ]
    engine.outputs(prompts, 4, concurrent=True)


def test_connector_memory_is_flat(farm, index):
    engine = farm.get("memory", connector_config(index, async_load=True, overlap_load_with_compute=True))
    for r in range(WARM_UP_ROUNDS):
        _round(engine, r)
    objects_before = engine.process.call("object_counts", prefix="maru_")
    rss_before = engine.process.rss_bytes()
    hits_before = engine.counters()["maru_lookup_hit_tokens_total"]
    for r in range(WARM_UP_ROUNDS, WARM_UP_ROUNDS + ROUNDS):
        _round(engine, r)
    objects_after = engine.process.call("object_counts", prefix="maru_")
    rss_after = engine.process.rss_bytes()

    assert engine.counters()["maru_lookup_hit_tokens_total"] > hits_before, "the workload never hit"
    grown = {
        name: (objects_before.get(name, 0), count)
        for name, count in objects_after.items()
        if count > objects_before.get(name, 0) + OBJECT_SLACK
    }
    assert not grown, f"object counts grew over {ROUNDS * PER_ROUND} requests: {grown}"
    assert rss_after - rss_before < RSS_MARGIN_BYTES, (
        f"RSS grew by {(rss_after - rss_before) / 2**20:.1f} MiB over {ROUNDS * PER_ROUND} requests"
    )
    farm.close_one("memory")
