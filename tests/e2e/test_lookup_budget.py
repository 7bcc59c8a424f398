"""Lookups against a slow index hold vLLM's scheduling pass one lookup timeout at most.

vLLM's own ``Scheduler`` (``SteppedEngine``) asks the connector about every
new request on its engine thread. Here the real index sits behind a real TCP
proxy that holds every lookup reply back: twenty requests arriving in one
pass must cost that pass about one ``maru_lookup_timeout_s`` (each lookup
waiting its own timeout in turn cost twenty), the lookups queued meanwhile
must reach the index as one ``match_prefixes`` round trip, and every request
must still get its hit, its early pin and exactly the computed KV.
"""

from __future__ import annotations

import time

import pytest

from maru_connector.config import make_kv_transfer_config
from maru_tools.stepper import SteppedEngine, expected_next_token
from maru_tools.workload import random_tokens

from .conftest import index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

CHUNK, BLOCK = 32, 16
REQUESTS = 20
LOOKUP_TIMEOUT_S = 0.1
INDEX_DELAY_S = 0.3  # every lookup reply, held back by the proxy
LOOKUP_OPS = ("match_prefix", "match_prefixes", "retrieve_prefix")


def _config(url, index, **knobs):
    return make_kv_transfer_config(url, pool_path=index.pool_path, token=index.token, kv_chunk_tokens=CHUNK,
                                   load_timeout_s=5.0, lookup_timeout_s=LOOKUP_TIMEOUT_S, **knobs)


def _engine(model_dir, config):
    return SteppedEngine(model_dir, config, block_size=BLOCK, num_blocks=512, max_num_batched_tokens=8192,
                         max_num_seqs=32)


class LookupClock:
    """Time the engine thread spends in ``get_num_new_matched_tokens``, per pass,
    and the pass in which each request first got an answer (not "ask me later")."""

    def __init__(self, engine: SteppedEngine):
        self.passes: list[float] = []
        self.answered: dict[str, int] = {}
        self._spent = 0.0
        connector = engine.scheduler.connector
        ask = connector.get_num_new_matched_tokens

        def timed(request, num_computed_tokens):
            started = time.perf_counter()
            try:
                answer = ask(request, num_computed_tokens)
            finally:
                self._spent += time.perf_counter() - started
            if answer[0] is not None:
                self.answered.setdefault(request.request_id, len(self.passes))
            return answer

        connector.get_num_new_matched_tokens = timed

    def end_pass(self) -> None:
        self.passes.append(self._spent)
        self._spent = 0.0


def _expected_tokens(prompt, num_layers, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(expected_next_token(tokens, num_layers))
    return tokens[len(prompt):]


def test_twenty_new_requests_against_a_slow_index_hold_a_pass_one_lookup_timeout(model_dir, index, proxy):
    shared = random_tokens(3 * CHUNK, seed=9100)
    writer = _engine(model_dir, _config(index.url, index))
    keys = index_keys(index)
    writer.add("w", shared + random_tokens(7, seed=9101), max_tokens=2)
    writer.run(until=lambda: "w" in writer.finished)
    wait_for_keys(index, keys + 3)
    writer.close()

    reader = _engine(model_dir, _config(proxy.url, index))
    clock = LookupClock(reader)
    prompts = {f"r{i}": shared + random_tokens(5 + i, seed=9200 + i) for i in range(REQUESTS)}
    before = {op: proxy.replies_seen.get(op, 0) for op in LOOKUP_OPS}
    proxy.arm("delay", count=10_000, delay_s=INDEX_DELAY_S, op=LOOKUP_OPS)
    try:
        for req_id, prompt in prompts.items():
            reader.add(req_id, prompt, max_tokens=2)
        started = time.monotonic()
        while len(clock.answered) < REQUESTS and time.monotonic() - started < 10:
            reader.step()
            clock.end_pass()
            time.sleep(0.02)  # a step of the model
        answered_s = time.monotonic() - started
    finally:
        proxy.disarm()
    round_trips = {op: proxy.replies_seen.get(op, 0) - before[op] for op in LOOKUP_OPS}

    # The first pass asked about all twenty and waited for one lookup's timeout; no pass waited more.
    assert clock.passes[0] >= LOOKUP_TIMEOUT_S * 0.9
    assert max(clock.passes) < LOOKUP_TIMEOUT_S + 0.15, clock.passes[:5]
    # All answered: the lone first lookup, then the nineteen queued behind it, in one round trip.
    assert sorted(clock.answered) == sorted(prompts)
    assert answered_s < 2 * INDEX_DELAY_S + 1.0, (answered_s, clock.answered)
    assert round_trips == {"match_prefix": 0, "match_prefixes": 1, "retrieve_prefix": 1}, round_trips

    stats = reader.worker.worker_half.stats
    reader.run(until=lambda: not reader.requests)
    for req_id, prompt in prompts.items():
        assert reader.finished[req_id].output == _expected_tokens(prompt, reader.num_layers, 2), req_id
    counters = stats.snapshot()["counters"]
    assert counters["early_pinned_loads"] == REQUESTS  # the batch's pins were taken after its answer
    assert reader.scheduler.connector.scheduler_half.stats.snapshot()["counters"]["lookup_hit_tokens"] \
        == REQUESTS * 3 * CHUNK
    reader.close()
    wait_settled(index)
