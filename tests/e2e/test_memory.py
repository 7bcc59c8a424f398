"""The connector's memory does not grow with the requests it serves.

An engine serves many requests (hits, misses and stores mixed). After a
warm-up, the count of live objects of every MaruCache type in the engine
process stays flat, and so does its private resident memory.
"""

from __future__ import annotations

import pytest

from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, connector_config

pytestmark = pytest.mark.vllm

WARM_UP_ROUNDS = 5
ROUNDS = 18
PER_ROUND = 10
# A leak of one request's KV (158 tokens x 4 layers x 2 KV heads x 128 x 4 B
# = 0.65 MiB) per request adds 117 MiB over the measured 180 requests;
# Python-level leaks of the connector show in the object counts as well.
# Private memory, read after glibc hands its free arenas back (malloc_trim),
# is flat to the MiB once warm; RSS is not, as it grows with every pool page
# the engine's stores and loads touch.
PRIVATE_MARGIN_BYTES = 16 * 1024 * 1024
OBJECT_SLACK = 16  # objects of a request in flight at the moment of counting


def _round(engine, round_no: int) -> None:
    # Half the prompts repeat an earlier round's (hits), half are new (misses + stores).
    prompts = [
        random_tokens(2 * CHUNK_TOKENS + 30, seed=4000 + (round_no // 2) * PER_ROUND + i if i % 2 else 4000 + round_no * PER_ROUND + i)
        for i in range(PER_ROUND)
    ]
    engine.outputs(prompts, 4, concurrent=True)


def _private_bytes(engine) -> int:
    engine.process.call("trim_heap")
    return engine.process.private_bytes()


def test_connector_memory_is_flat(farm, index):
    engine = farm.get("memory", connector_config(index, async_load=True, overlap_load_with_compute=True))
    for r in range(WARM_UP_ROUNDS):
        _round(engine, r)
    objects_before = engine.process.call("object_counts", prefix="maru_")
    private_before = _private_bytes(engine)
    hits_before = engine.counters()["maru_lookup_hit_tokens_total"]
    for r in range(WARM_UP_ROUNDS, WARM_UP_ROUNDS + ROUNDS):
        _round(engine, r)
    objects_after = engine.process.call("object_counts", prefix="maru_")
    private_after = _private_bytes(engine)

    assert engine.counters()["maru_lookup_hit_tokens_total"] > hits_before, "the workload never hit"
    grown = {
        name: (objects_before.get(name, 0), count)
        for name, count in objects_after.items()
        if count > objects_before.get(name, 0) + OBJECT_SLACK
    }
    assert not grown, f"object counts grew over {ROUNDS * PER_ROUND} requests: {grown}"
    assert private_after - private_before < PRIVATE_MARGIN_BYTES, (
        f"private memory grew by {(private_after - private_before) / 2**20:.1f} MiB over {ROUNDS * PER_ROUND} requests"
    )
    farm.close_one("memory")
