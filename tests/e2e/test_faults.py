"""The fault matrix: every failed load ends in recompute, counted, with nothing left pinned.

The engines under test reach the real index through `FaultProxy`, which
tampers with retrieve replies (short, long, a miss at a middle layer, late,
a slot header rewritten in the pool) or holds a retrieve while the index is
killed. Each test checks that the output equals that of an engine without
the connector, that the connector counted the failure, and that the index
shows no pin and no reservation afterwards.

Two paths pin a hit's objects. Most tests take the worker's own `retrieve`
(early pins off: as with tensor parallelism or workers in other processes);
the last ones take the lookup's `retrieve_prefix`, which pins while it
matches when the engine's one worker shares the scheduler's process.
"""

from __future__ import annotations

import threading
import time

import pytest

from maru_tools.stats_reader import failures
from maru_tools.workload import random_tokens

from .conftest import CHUNK_TOKENS, NUM_LAYERS, connector_config, index_keys, wait_for_keys, wait_settled

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
LOAD_TIMEOUT_S = 2.0
LOOKUP_GIVE_UP_S = 2.0  # LookupService's give_up_s: a lookup still pending then is a miss
# 5 prompts of 205 tokens fill 35 of 40 blocks; none needs a new block before
# its 19th generated token, so the first 16 come before any preemption.
PRE_PREEMPTION_TOKENS = 16


def _writer(farm, index, layerwise: bool):
    fmt = "layerwise" if layerwise else "chunkwise"
    return farm.get(f"{fmt}-A", connector_config(index, use_layerwise=layerwise))


def _faulty(farm, index, proxy, layerwise: bool, async_load: bool = True, early_pins: bool = False, **overrides):
    """An engine whose connector reaches the index through the fault proxy;
    its worker retrieves, unless `early_pins` (its lookup pins)."""
    name = f"faulty-{'layerwise' if layerwise else 'chunkwise'}-{'async' if async_load else 'sync'}"
    name += "-early" if early_pins else ""
    # Async engines park every hit, so the faults reach the parked path.
    knobs = dict(use_layerwise=layerwise, async_load=async_load, park_lone_hits=async_load,
                 overlap_load_with_compute=async_load, load_timeout_s=LOAD_TIMEOUT_S,
                 early_pins=early_pins)
    return farm.get(name, connector_config(index, url=proxy.url, **knobs), **overrides)


def _stored_prompt(farm, index, layerwise: bool, seed: int, chunks: int = 4) -> list[int]:
    prompt = random_tokens(chunks * CHUNK_TOKENS + 13, seed=seed)
    keys_before = index_keys(index)
    _writer(farm, index, layerwise).outputs([prompt], MAX_TOKENS)
    wait_for_keys(index, keys_before + chunks * (NUM_LAYERS if layerwise else 1))
    return prompt


FAULTS = [
    # (fault kind, layerwise, accepted failure reasons: the index client may
    # itself refuse a reply whose length does not match, an index error)
    ("miss", True, ("miss",)),
    ("short", False, ("short_reply", "index_error")),
    ("short", True, ("short_reply", "index_error")),
    ("long", False, ("long_reply", "index_error")),
    ("corrupt_header", False, ("header_mismatch",)),
    ("corrupt_header", True, ("header_mismatch",)),
]


@pytest.mark.parametrize("kind,layerwise,reasons", FAULTS, ids=[f"{k}-{'layerwise' if l else 'chunkwise'}" for k, l, _ in FAULTS])
def test_tampered_retrieve_reply_is_recomputed(farm, index, proxy, reference, kind, layerwise, reasons):
    prompt = _stored_prompt(farm, index, layerwise, seed=2000 + 10 * FAULTS.index((kind, layerwise, reasons)))
    _recomputed_once_tampered(_faulty(farm, index, proxy, layerwise), index, proxy, reference, prompt,
                              kind, reasons, op="retrieve")


def _recomputed_once_tampered(engine, index, proxy, reference, prompt, kind, reasons, op) -> None:
    """Serve `prompt` with the next `op` reply tampered: the output equals
    recompute, one failure of `reasons` is counted, nothing stays pinned, and
    the next request hits again."""
    baseline = index.stats()
    before = failures(engine.counters())
    retrieves = proxy.replies_seen.get("retrieve", 0)
    proxy.arm(kind, op=op)
    try:
        out = engine.outputs([prompt], MAX_TOKENS)[0]
    finally:
        proxy.disarm()
        proxy.restore_headers()
    assert proxy.fired == 1, "the fault never reached the connector"
    if op == "retrieve_prefix":
        assert proxy.replies_seen.get("retrieve", 0) == retrieves, "the worker retrieved: the lookup did not pin"
    assert out == reference.outputs([prompt], MAX_TOKENS)[0]
    after = failures(engine.counters())
    counted = sum(after.get(r, 0) - before.get(r, 0) for r in reasons)
    assert counted == 1, f"expected one failure of {reasons}; counted {after}, before {before}"
    wait_settled(index, baseline=baseline)
    # The failed load became a miss for that request; the next request hits again.
    out_again = engine.outputs([prompt], MAX_TOKENS)[0]
    assert out_again == out
    wait_settled(index, baseline=baseline)


@pytest.mark.parametrize("async_load", [True, False], ids=["async", "sync"])
def test_retrieve_timeout_is_recomputed(farm, index, proxy, reference, async_load):
    prompt = _stored_prompt(farm, index, False, seed=2100 + int(async_load))
    engine = _faulty(farm, index, proxy, False, async_load=async_load)
    before = failures(engine.counters())
    baseline = index.stats()
    _recomputed_with_a_late_reply(engine, proxy, reference, prompt, LOAD_TIMEOUT_S + 1.5, op="retrieve")
    after = failures(engine.counters())
    assert sum(after.values()) == sum(before.values()) + 1, f"counted {after}, before {before}"
    # The late reply pinned the objects; the connector must give them back.
    wait_settled(index, timeout_s=30, baseline=baseline)


def _recomputed_with_a_late_reply(engine, proxy, reference, prompt, delay_s: float, op: str) -> None:
    """Serve `prompt` with the next `op` reply held back `delay_s`: the output equals recompute."""
    proxy.arm("delay", delay_s=delay_s, op=op)
    try:
        out = engine.outputs([prompt], MAX_TOKENS)[0]
    finally:
        proxy.disarm()
    assert proxy.fired == 1
    assert out == reference.outputs([prompt], MAX_TOKENS)[0]


def test_abort_while_parked_leaves_nothing_pinned(farm, index, proxy, reference):
    prompt = _stored_prompt(farm, index, False, seed=2200)
    engine = _faulty(farm, index, proxy, False)
    baseline = index.stats()
    proxy.arm("delay", delay_s=2.0)
    try:
        result = engine.run([prompt], MAX_TOKENS, abort_after_s=0.8)[0]
    finally:
        proxy.disarm()
    assert result.aborted and result.state_at_abort == "WAITING_FOR_REMOTE_KVS", result
    time.sleep(1.5)  # let the held retrieve reply arrive after the abort
    wait_settled(index, baseline=baseline)
    # The engine keeps serving, and the same prompt still hits.
    before = engine.counters()
    out = engine.outputs([prompt], MAX_TOKENS)[0]
    after = engine.counters()
    assert out == reference.outputs([prompt], MAX_TOKENS)[0]
    assert after["maru_lookup_hit_tokens_total"] > before["maru_lookup_hit_tokens_total"]
    wait_settled(index, baseline=baseline)


def test_preemption_during_loads(farm, index, proxy, reference):
    """Few KV blocks, long decodes and slow loads: requests are preempted while loads run."""
    prompts = [_stored_prompt(farm, index, False, seed=2300 + i, chunks=3) for i in range(6)]
    # 6 prompts of ~205 tokens decoding 120 tokens need ~66 blocks; 40 force preemptions.
    engine = _faulty(farm, index, proxy, False, num_gpu_blocks_override=40, max_num_seqs=6, max_model_len=1024)
    baseline = index.stats()
    preempted_before = engine.process.call("preemptions")
    proxy.arm("delay", count=3, delay_s=0.3)
    try:
        outputs = engine.outputs(prompts, 120, concurrent=True)
    finally:
        proxy.disarm()
    assert engine.process.call("preemptions") > preempted_before, "the workload never preempted"
    # A preempted request recomputes its generated tokens in a prefill, whose
    # bf16 rounding differs from decode's: preemption alone changes greedy
    # outputs of a random model late in a long decode. Tokens produced before
    # the first preemption must match the engine without preemption exactly.
    expected = reference.outputs(prompts, 120)
    assert [o[:PRE_PREEMPTION_TOKENS] for o in outputs] == [e[:PRE_PREEMPTION_TOKENS] for e in expected]
    # (An engine without the connector preempts at other steps, so its later
    # tokens cannot judge either.) The engine keeps serving correctly.
    fresh = prompts[0][: 2 * CHUNK_TOKENS + 5]
    assert engine.outputs([fresh], MAX_TOKENS) == reference.outputs([fresh], MAX_TOKENS)
    wait_settled(index, baseline=baseline)
    farm.close_one(engine.name)


# ---- the lookup's retrieve_prefix (early pins) ------------------------------

# A reply of retrieve_prefix that fails the client's checks (a miss in it
# included: the index never answers one) is an index error for the load.
LOOKUP_FAULTS = [
    ("short", False, ("index_error",)),
    ("long", False, ("index_error",)),
    ("miss", True, ("index_error",)),
    ("corrupt_header", True, ("header_mismatch",)),
]


@pytest.mark.parametrize("kind,layerwise,reasons", LOOKUP_FAULTS,
                         ids=[f"{k}-{'layerwise' if l else 'chunkwise'}" for k, l, _ in LOOKUP_FAULTS])
def test_tampered_lookup_pin_is_recomputed(farm, index, proxy, reference, kind, layerwise, reasons):
    prompt = _stored_prompt(farm, index, layerwise, seed=2500 + 10 * LOOKUP_FAULTS.index((kind, layerwise, reasons)))
    engine = _faulty(farm, index, proxy, layerwise, early_pins=True)
    _recomputed_once_tampered(engine, index, proxy, reference, prompt, kind, reasons, op="retrieve_prefix")


def test_a_late_lookup_is_a_miss_and_leaves_nothing_pinned(farm, index, proxy, reference):
    """A lookup the index answers after the engine gave up on it is a miss; the
    pins its late reply took are given back."""
    prompt = _stored_prompt(farm, index, False, seed=2600)
    engine = _faulty(farm, index, proxy, False, early_pins=True)
    baseline = index.stats()
    _recomputed_with_a_late_reply(engine, proxy, reference, prompt, LOOKUP_GIVE_UP_S + 1.5, op="retrieve_prefix")
    time.sleep(1.5)  # the late reply has pinned by now
    wait_settled(index, baseline=baseline)


# Last: a restarted index refuses stores for its quarantine after a restart,
# so no test that stores may follow this one.
def test_index_killed_during_load(farm, index, proxy, reference):
    prompt = _stored_prompt(farm, index, False, seed=2400)
    engine = _faulty(farm, index, proxy, False)
    before = failures(engine.counters())
    proxy.arm("hold_request", delay_s=2.0)
    results: list = []
    runner = threading.Thread(target=lambda: results.append(engine.outputs([prompt], MAX_TOKENS)[0]))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while proxy.fired == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.fired == 1, "the retrieve never went out"
        index.kill()
        runner.join(60)
    finally:
        proxy.disarm()
        if not index.alive():
            index.start()
    assert results, "the engine did not answer"
    assert results[0] == reference.outputs([prompt], MAX_TOKENS)[0]
    after = failures(engine.counters())
    assert sum(after.values()) > sum(before.values()), f"counted {after}, before {before}"
    # The restarted index has lost every pin with the old process.
    wait_settled(index)
    # And the engine keeps serving through the restarted index.
    assert engine.outputs([prompt], MAX_TOKENS)[0] == results[0]
