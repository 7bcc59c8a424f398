"""Two real vLLM engines, each with its own real sidecar (as in two pods): the pool
reaches the connector through the sidecar's hand-off, and the connector's
counters reach the sidecar's `/metrics` through the stats regions.

Engine A computes a prompt and stores it; engine B serves it from the pool.
B's output must equal recompute token for token, and B's sidecar must export
the hit and the loaded bytes under the `cache`, `namespace` and `pod` labels.
"""

from __future__ import annotations

import pytest

from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, SIDECAR_CACHE, SIDECAR_NAMESPACE, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


def _labels(pod: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"cache": SIDECAR_CACHE, "namespace": SIDECAR_NAMESPACE, "pod": pod, **extra}.items()))


def test_hit_through_sidecars_equals_recompute_and_reaches_metrics(farm, index, reference, sidecars):
    engine_a = farm.get("sidecar-A", sidecars.config("pod-a", async_load=True, overlap_load_with_compute=True))
    engine_b = farm.get("sidecar-B", sidecars.config("pod-b", async_load=True, overlap_load_with_compute=True))
    prompt = random_tokens(4 * CHUNK_TOKENS + 11, seed=707)
    keys_before = index_keys(index)

    out_a = engine_a.outputs([prompt], MAX_TOKENS)[0]
    wait_for_keys(index, keys_before + 4)
    out_b = engine_b.outputs([prompt], MAX_TOKENS)[0]

    expected = reference.outputs([prompt], MAX_TOKENS)[0]
    assert out_a == expected, "engine A (storing through its sidecar's pool) diverged from recompute"
    assert out_b == expected, "engine B (hit through its sidecar's pool) diverged from recompute"

    b = sidecars.of(engine_b).metrics()
    assert b[("maru_lookup_hit_tokens_total", _labels("pod-b"))] == 4 * CHUNK_TOKENS
    assert b[("maru_load_bytes_total", _labels("pod-b"))] > 0
    assert b[("maru_load_duration_seconds_count", _labels("pod-b"))] >= 1
    assert b[("maru_load_failures_total", _labels("pod-b", reason="miss"))] == 0
    # Scheduler and worker halves each write a region, and both are counted.
    assert b[("maru_sidecar_stats_regions", _labels("pod-b", state="live"))] == 2
    # Four hand-offs: the configuration check before the KV cache is sized
    # (the token and cache name, and the index address), the scheduler half's
    # (its stats directory), its lookup client's (the pool's identity, to check
    # the index serves that region) and the worker's (the pool itself).
    assert b[("maru_sidecar_handoffs_total", _labels("pod-b", result="ok"))] == 4

    a = sidecars.of(engine_a).metrics()
    assert a[("maru_store_bytes_total", _labels("pod-a"))] > 0
    assert a[("maru_lookup_hit_tokens_total", _labels("pod-a"))] == 0
    assert a[("maru_lookups_total", _labels("pod-a"))] >= 1

    # The harness reads the same directory the same way.
    assert engine_b.counters()["maru_lookup_hit_tokens_total"] == 4 * CHUNK_TOKENS
    wait_settled(index)
