"""An engine whose pool is not the one its index serves (a pod left on a cache's old region) keeps
serving: vLLM's own scheduler with MaruCache's halves refuses the index, every lookup misses,
every store is skipped, and its blocks hold exactly the computed KV."""

from __future__ import annotations

import logging
import os

from maru_connector.config import make_kv_transfer_config
from maru_tools.index_process import unique_pool_path
from maru_tools.stepper import SteppedEngine, expected_next_token
from maru_tools.workload import random_tokens
from maru_core.pool import Pool

from .conftest import index_keys, wait_for_keys, wait_settled

CHUNK = 32
BLOCK = 16


def _config(index, pool_path):
    return make_kv_transfer_config(index.url, pool_path=pool_path, token=index.token, kv_chunk_tokens=CHUNK,
                                   load_timeout_s=5.0, lookup_timeout_s=2.0)


def _serve(engine, req_id, prompt):
    engine.add(req_id, prompt, 2)
    engine.run(until=lambda: req_id in engine.finished)
    tokens = list(prompt)
    for _ in range(2):
        tokens.append(expected_next_token(tokens, engine.num_layers))
    assert engine.finished[req_id].output == tokens[len(prompt):]


def test_an_engine_on_another_pool_than_its_index_serves_misses_and_stores_nothing(model_dir, index, caplog):
    prompt = random_tokens(4 * CHUNK + 5, seed=9731)  # a prefix no other test stores (keys are shared)
    writer = SteppedEngine(model_dir, _config(index, index.pool_path), block_size=BLOCK)
    try:
        before = index_keys(index)
        _serve(writer, "w", prompt)
        stored = wait_for_keys(index, before + len(prompt) // CHUNK)
    finally:
        writer.close()
    old_region = unique_pool_path("maru-old-region")  # same size as the index's pool, another UUID
    with Pool.attach(index.pool_path) as served:
        Pool.create(old_region, served.geometry.size, page_size=served.geometry.page_size).close()
    try:
        with caplog.at_level(logging.WARNING):
            stale = SteppedEngine(model_dir, _config(index, old_region), block_size=BLOCK)
            try:
                stale.add("r", prompt, 2)
                stale.run(until=lambda: stale.requests.get("r") is None or stale.requests["r"].output)
                assert stale.wrong_positions("r", prompt) == []  # everything computed, nothing loaded
                stale.run(until=lambda: "r" in stale.finished)
                _serve(stale, "r2", random_tokens(3 * CHUNK + 1, seed=9732))  # and it goes on serving
                counters = stale.worker.worker_half.stats.snapshot()["counters"]
                assert counters["load_bytes"] == 0 and counters["store_bytes"] == 0, counters
            finally:
                stale.close()
        assert index_keys(index) == stored  # the stale engine committed nothing
        refusals = [r.getMessage() for r in caplog.records if "serves pool" in r.getMessage()]
        assert refusals and "re-create this pod" in refusals[0], [r.getMessage() for r in caplog.records][-5:]
        wait_settled(index)
    finally:
        os.unlink(old_region)
