"""A pod whose index is away keeps serving: its sidecar stays Ready, vLLM recomputes.

Readiness means "the hand-off works", never "the index answers": an index
restart or a node drain must not pull every vLLM pod out of its Service. A
real engine gets the pool through a real sidecar, the index is stopped, and
while it is away the sidecar's `/readyz` stays 200 (its text and
`maru_sidecar_index_reachable` say the index is unreachable), the pool is
still handed out, and the engine's outputs equal recompute.
"""

from __future__ import annotations

import pytest

from maru_tools.cluster import wait_until
from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, SIDECAR_CACHE, Sidecars

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6


def test_sidecar_stays_ready_and_engine_recomputes_while_the_index_is_down(farm, private_index, reference):
    sidecars = Sidecars(private_index)
    try:
        engine = farm.get("ready-without-index", sidecars.config("pod-r", lookup_timeout_s=0.2))
        sidecar = sidecars.of(engine)
        stored = random_tokens(3 * CHUNK_TOKENS + 7, seed=4242)
        engine.outputs([stored], MAX_TOKENS)
        wait_until(lambda: private_index.stats()["keys"] >= 3, 30, what="first store")
        reachable = ("maru_sidecar_index_reachable", tuple(sorted(
            {"cache": SIDECAR_CACHE, "namespace": "e2e-ns", "pod": "pod-r"}.items())))
        wait_until(lambda: sidecar.metrics().get(reachable) == 1, 15, what="index seen reachable")

        private_index.stop()
        try:
            wait_until(lambda: sidecar.metrics().get(reachable) == 0, 15, what="index seen unreachable")
            code, body = sidecar.get("/readyz")
            assert code == 200, body
            assert "hand-off served" in body and "unreachable" in body
            before = engine.counters()["maru_lookup_hit_tokens_total"]
            fresh = random_tokens(3 * CHUNK_TOKENS + 5, seed=4243)
            outputs = engine.outputs([stored, fresh], MAX_TOKENS)
            assert outputs == reference.outputs([stored, fresh], MAX_TOKENS)
            assert engine.counters()["maru_lookup_hit_tokens_total"] == before  # recomputed, not loaded
            assert sidecar.get("/readyz")[0] == 200
        finally:
            private_index.start()
        wait_until(lambda: sidecar.metrics().get(reachable) == 1, 15, what="index seen reachable again")
    finally:
        farm.close_one("ready-without-index")
        sidecars.close()
