"""The index unreachable: the engine keeps serving, and hits resume by themselves.

A private index (its own pool) is stopped while an engine serves: lookups
miss within the short lookup timeout, stores are skipped, outputs stay
correct. When the index comes back on the same address, stores and hits
resume without restarting anything.
"""

from __future__ import annotations

import pytest

from maru_tools.cluster import wait_until
from maru_tools.stats_reader import failures
from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, connector_config

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
LOOKUP_TIMEOUT_S = 0.2
# Far below any connect or load timeout: an engine that waited on the dead
# index would exceed it; one that treats it as a miss stays far below.
NO_STALL_BOUND_S = 5.0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_engine_serves_through_an_index_outage(farm, private_index, reference, async_load):
    make = connector_config(private_index, async_load=async_load, park_lone_hits=async_load,
                            lookup_timeout_s=LOOKUP_TIMEOUT_S)
    writer = farm.get(f"outage-writer-{async_load}", make)
    reader = farm.get(f"outage-reader-{async_load}", make)
    seed = 3000 + 100 * int(async_load)
    stored = random_tokens(3 * CHUNK_TOKENS + 7, seed=seed)
    writer.outputs([stored], MAX_TOKENS)
    wait_until(lambda: private_index.stats()["keys"] >= 3, 30, what="first store")

    private_index.stop()
    try:
        fresh = [random_tokens(3 * CHUNK_TOKENS + 5, seed=seed + 1 + i) for i in range(3)]
        before = writer.counters()
        results = writer.run([stored, *fresh], MAX_TOKENS)
        results += reader.run([stored], MAX_TOKENS)
        outputs = [r.token_ids for r in results]
        assert outputs == reference.outputs([stored, *fresh, stored], MAX_TOKENS)
        slowest = max(r.ttft_s for r in results)
        assert slowest < NO_STALL_BOUND_S, f"a request waited {slowest:.1f}s on the dead index"
        # The fresh prompts' stores were skipped and counted.
        skipped = wait_until(
            lambda: sum(failures(writer.counters(), "maru_store_failures_total").values())
            > sum(failures(before, "maru_store_failures_total").values()),
            30, what="a counted skipped store",
        )
        assert skipped
    finally:
        private_index.start()

    # Back: the reader hits what the writer stored before the outage, or stores
    # and then hits again, without any restart of either engine.
    again = random_tokens(3 * CHUNK_TOKENS + 9, seed=seed + 50)

    def hits_resumed() -> bool:
        writer.outputs([again], MAX_TOKENS)
        before_hit = reader.counters()["maru_lookup_hit_tokens_total"]
        out = reader.outputs([again], MAX_TOKENS)[0]
        assert out == reference.outputs([again], MAX_TOKENS)[0]
        return reader.counters()["maru_lookup_hit_tokens_total"] > before_hit

    wait_until(hits_resumed, 60, interval_s=1.0, what="hits after the index came back")
    farm.close_one(f"outage-writer-{async_load}")
    farm.close_one(f"outage-reader-{async_load}")
