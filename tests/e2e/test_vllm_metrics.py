"""MaruCache's figures in vLLM's own metrics: ``vllm:maru_*`` on ``vllm serve``'s ``/metrics``.

Engine A computes a prompt and stores it; a real ``vllm serve`` (the CPU
build, the connector in its engine-core process) completes the same prompt
from the pool, then a prompt of its own, which it stores. Its ``/metrics``
must count the hit tokens and loaded bytes, then the stored bytes, exactly as
the connector's own counters (the ones the sidecar exports) did, and its
periodic ``KV Transfer metrics`` log line must name the hit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from maru_tools.cluster import wait_until
from maru_tools.stats_reader import read_connector_stats
from maru_tools.vllm_server import VllmServer
from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, connector_config, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

MAX_TOKENS = 4


def _maru(metrics: dict) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The ``vllm:maru_*`` samples of engine 0, labels other than model_name and engine kept."""
    kept = {}
    for (name, labels), value in metrics.items():
        if name.startswith("vllm:maru_") and ("engine", "0") in labels:
            kept[(name, tuple(kv for kv in labels if kv[0] not in ("engine", "model_name")))] = value
    return kept


def _value(metrics: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in metrics, f"{name}{labels or ''} not in vLLM's /metrics"
    return metrics[key]


def test_vllm_serve_metrics_count_the_pool_hit_and_store_as_the_connector_does(farm, index, workdir):
    writer = farm.get("chunkwise-A", connector_config(index))
    prompt = random_tokens(5 * CHUNK_TOKENS + 17, seed=1701)
    keys_before = index_keys(index)
    writer.outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + 5)

    stats_dir = Path(workdir) / "vllm-serve-maru-metrics"
    stats_dir.mkdir(exist_ok=True)
    spec = dataclasses.replace(
        farm.base_spec, kv_transfer_config=connector_config(index, overlap_load_with_compute=True)(str(stats_dir)),
        env={"VLLM_LOG_STATS_INTERVAL": "1"},  # vLLM's log line every second, not every ten
    )  # fmt: skip
    with VllmServer(spec, Path(workdir) / f"vllm-serve-maru-metrics-{os.getpid()}.log") as server:
        start = _maru(server.metrics())
        counted_start = read_connector_stats(stats_dir)
        for reason in ("miss", "timeout", "copy_error", "header_mismatch", "index_error"):
            assert _value(start, "vllm:maru_load_failures_total", reason=reason) == 0

        server.complete(prompt, MAX_TOKENS)

        def hit_reached_vllm():
            scraped, counted = _maru(server.metrics()), read_connector_stats(stats_dir)
            loaded = _value(scraped, "vllm:maru_loaded_bytes_total")
            return loaded > 0 and loaded == counted["maru_load_bytes_total"] and (scraped, counted)

        # The front end records a step's stats as it hands out the step's outputs.
        after_hit, counted = wait_until(hit_reached_vllm, 30.0, interval_s=0.2, what="the hit in /metrics")
        moved = {key: after_hit[key] - start[key] for key in after_hit}
        assert moved[("vllm:maru_hit_tokens_total", ())] == 5 * CHUNK_TOKENS
        assert counted["maru_lookup_hit_tokens_total"] - counted_start["maru_lookup_hit_tokens_total"] == 5 * CHUNK_TOKENS
        assert moved[("vllm:maru_layer_waits_total", ())] == counted["maru_layer_wait_seconds_count"] > 0
        assert moved[("vllm:maru_recomputed_tokens_total", ())] == 0
        assert not [key for key, n in moved.items() if key[0] == "vllm:maru_load_failures_total" and n]
        wait_until(lambda: f"hit_tokens={5 * CHUNK_TOKENS}," in server.log_tail(400), 30.0, interval_s=0.5,
                   what="vLLM's KV Transfer metrics log line naming the hit")  # fmt: skip

        # A prompt of the server's own is stored; the commit comes back after
        # the step that computed it, so a later request carries it to vLLM.
        own = random_tokens(3 * CHUNK_TOKENS + 5, seed=1702)
        keys_before = index_keys(index)
        server.complete(own, MAX_TOKENS)
        wait_for_keys(index, keys_before + 3)

        def store_reached_vllm():
            server.complete(random_tokens(20, seed=1703), 1)
            stored = _value(_maru(server.metrics()), "vllm:maru_stored_bytes_total")
            return stored > 0 and stored == read_connector_stats(stats_dir)["maru_store_bytes_total"]

        wait_until(store_reached_vllm, 30.0, interval_s=0.2, what="the store in /metrics")
    wait_settled(index)
