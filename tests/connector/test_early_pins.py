"""Early pins: a lookup pins what it matched, and the load copies under those pins.

Driven on the real CPU transfer engine and a real pool, with the in-memory
index of ``fake_index.py`` (it counts every pin per key and every call per
op). What must hold: a lookup pins in the same round trip as it matches
(``retrieve_prefix``), or, with an index that lacks that op, in a
``retrieve`` right after; a load that uses an early pin copies exactly the
stored bytes with no retrieve of its own; an early pin of other chunks is
given back and the load retrieves; one that failed, missed or is not back
within the load's timeout fails the load as a retrieve would have; a lookup
never waits behind another request's separate pin; and every early pin is
given back exactly once, whoever ends up owning it.
"""

from __future__ import annotations

import threading
import time

import pytest
from maru_core.keys import KeyNamespace, packed_layer_keys
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from maru_connector.config import parse_config
from maru_connector.early_pins import PinHandoff
from maru_connector.lookup import LookupService
from maru_connector.metadata import LoadSpec, MaruConnectorMetadata
from maru_connector.scheduler import MaruSchedulerHalf
from maru_tools.cluster import wait_until

from fake_index import FakeClient
from worker_env import (BLOCK, CHUNK, LAYERS, WorkerEnv, blocks_equal, finished, spec_blocks, step,
                        store_meta, tokens, wait_unpinned)


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _store(env, n_tokens: int, layerwise: bool = False):
    writer, kv_w = env.worker(seed=1, maru_async_store=False, maru_use_layerwise=layerwise)
    keys = env.keys(tokens(n_tokens))
    step(writer, store_meta("w", keys, first_block=0))
    return keys, kv_w


def _early_pin(env, keys, layerwise=False, one_round_trip=True):
    """What the scheduler half's lookup does: match and pin (``one_round_trip``:
    in one ``retrieve_prefix``; else a ``match_prefix``, then a ``retrieve`` on
    the pins' thread)."""
    lookup = LookupService(env.index.client, timeout_s=1.0, one_round_trip=one_round_trip)
    packed = packed_layer_keys(keys, range(LAYERS)) if layerwise else b"".join(keys)
    group = LAYERS if layerwise else 1
    assert lookup.match("r", [packed], pin_group=group) == len(packed) // 16
    pin = lookup.take_early_pin("r")
    assert pin is not None
    return lookup, pin


def _load(keys, first_block, token, is_async=False):
    spec = LoadSpec(req_id="r", keys_by_rank=(tuple(keys),), block_ids=spec_blocks(first_block, len(keys)),
                    is_async=is_async, early_pin=token)
    return MaruConnectorMetadata(loads=[spec], scheduled_req_ids=frozenset() if is_async else frozenset({"r"}))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "parked"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_load_copies_under_its_lookups_early_pin_with_no_retrieve_of_its_own(env, layerwise, is_async):
    keys, kv_w = _store(env, 96, layerwise)
    handoff = PinHandoff()
    reader, kv_r = env.worker(seed=2, handoff=handoff, maru_use_layerwise=layerwise, maru_async_load=is_async)
    lookup, pin = _early_pin(env, keys, layerwise)
    assert env.index.calls["retrieve_prefix"] == 1 and env.index.calls["match_prefix"] == 0
    meta = _load(keys, 10, handoff.offer(pin), is_async)
    if is_async:  # parked: released by the loader, read by a later step's forward
        reader.start_load_kv(meta)
        wait_until(lambda: "r" in finished(reader)[1], 5.0, interval_s=0.01, what="the parked load released")
        meta = MaruConnectorMetadata(scheduled_req_ids=frozenset({"r"}))
    errors, report = step(reader, meta)
    assert errors == set() and not report.failed_load_req_ids
    assert blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    assert env.index.calls["retrieve"] == 0  # the worker sent none
    assert reader.stats.snapshot()["counters"]["early_pinned_loads"] == 1
    wait_unpinned(env)
    lookup.close()


def test_an_early_pin_of_other_chunks_is_given_back_and_the_worker_retrieves(env):
    keys, kv_w = _store(env, 96)
    handoff = PinHandoff()
    reader, kv_r = env.worker(seed=2, handoff=handoff)
    lookup, pin = _early_pin(env, keys[1:])  # as if vLLM's own hit covered chunk 0 at lookup time
    errors, _ = step(reader, _load(keys, 10, handoff.offer(pin)))
    assert errors == set() and blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    assert env.index.calls["retrieve"] == 1  # the worker's own, after the lookup's retrieve_prefix
    assert reader.stats.snapshot()["counters"]["early_pinned_loads"] == 0
    wait_unpinned(env)
    lookup.close()


def test_an_index_without_retrieve_prefix_gets_a_match_then_a_retrieve(env):
    keys, kv_w = _store(env, 96)
    env.index.knows_retrieve_prefix = False  # an index of the version before
    handoff = PinHandoff()
    reader, kv_r = env.worker(seed=2, handoff=handoff)
    lookup, pin = _early_pin(env, keys)
    assert pin.reply(5.0) is not None
    assert [env.index.calls[op] for op in ("retrieve_prefix", "match_prefix", "retrieve")] == [1, 1, 1]
    errors, _ = step(reader, _load(keys, 10, handoff.offer(pin)))
    assert errors == set() and blocks_equal(kv_w, range(6), kv_r, range(10, 16))
    assert env.index.calls["retrieve"] == 1  # the early pin's: the worker sent none
    assert lookup.match("again", [b"".join(keys)], pin_group=1) == 3
    assert env.index.calls["retrieve_prefix"] == 1  # not asked again
    lookup.take_early_pin("again").release()
    wait_unpinned(env)
    lookup.close()


SPOILED = [
    (lambda locs: [None] + locs[1:], "miss"),  # evicted between the match and the pin
    (lambda locs: locs[:-1], "short_reply"),
]


@pytest.mark.parametrize("one_round_trip", [True, False], ids=["retrieve_prefix", "match_then_retrieve"])
@pytest.mark.parametrize("hook, reason", SPOILED, ids=[reason for _, reason in SPOILED])
def test_an_early_pin_that_cannot_be_trusted_fails_the_load_before_any_copy(env, hook, reason, one_round_trip):
    """A spoilt separate retrieve fails the load with its own reason; a spoilt
    ``retrieve_prefix`` reply is rejected by the client (an index error), the
    count comes from a ``match_prefix``, and the load fails all the same."""
    keys, _ = _store(env, 64)
    handoff = PinHandoff()
    reader, kv_r = env.worker(seed=2, handoff=handoff)
    before = {name: t.clone() for name, t in kv_r.items()}
    env.index.retrieve_hook = hook
    lookup, pin = _early_pin(env, keys, one_round_trip=one_round_trip)
    env.index.retrieve_hook = None
    errors, report = step(reader, _load(keys, 10, handoff.offer(pin)))
    assert errors == set(range(10, 14)) and report.failed_load_req_ids == {"r"} and report.tainted
    assert reader.stats.snapshot()["load_failures"][reason if not one_round_trip else "index_error"] == 1
    assert blocks_equal(before, range(10, 14), kv_r, range(10, 14))  # no block touched
    # failed as a retrieve fails: not tried again
    assert env.index.calls["retrieve"] + env.index.calls["retrieve_prefix"] == 1
    wait_unpinned(env)
    lookup.close()


def test_an_early_pin_not_back_within_the_load_timeout_fails_the_load(env, monkeypatch):
    """A slow index answers the lookup's separate pin too late: the load fails
    as its own retrieve would have timed out (no second retrieve doubling the
    wait), and the pin is given back once its reply lands. (With
    ``retrieve_prefix`` the pin is back with the lookup's answer.)"""
    keys, _ = _store(env, 64)
    handoff = PinHandoff()
    reader, kv_r = env.worker(seed=2, handoff=handoff)
    monkeypatch.setattr(FakeClient, "timeout_s", 0.2, raising=False)  # the worker's retrieve timeout
    before = {name: t.clone() for name, t in kv_r.items()}
    landed = threading.Event()

    def slow(locations):
        time.sleep(0.6)
        landed.set()
        return locations

    env.index.retrieve_hook = slow
    lookup, pin = _early_pin(env, keys, one_round_trip=False)
    errors, report = step(reader, _load(keys, 10, handoff.offer(pin)))
    assert errors == set(range(10, 14)) and report.failed_load_req_ids == {"r"} and report.tainted
    assert not landed.is_set(), "the load waited past its timeout for the pin"
    assert reader.stats.snapshot()["load_failures"]["timeout"] == 1
    assert blocks_equal(before, range(10, 14), kv_r, range(10, 14))  # no block touched
    assert landed.wait(5.0)
    assert env.index.calls["retrieve"] == 1  # the early pin's only
    wait_unpinned(env)  # unpinned once the late reply landed
    lookup.close()


def test_a_lookup_never_queues_behind_another_requests_early_pin(env):
    """A miss is not held up by a hit: while the index sits on one request's
    separate pin, another request's lookup is answered."""
    keys, _ = _store(env, 64)
    release = threading.Event()
    env.index.retrieve_hook = lambda locations: release.wait(10.0) and locations
    lookup = LookupService(env.index.client, timeout_s=0.5, one_round_trip=False)
    try:
        assert lookup.match("hit", [b"".join(keys)], pin_group=1) == 2
        other = [b"".join(env.keys(tokens(64, start=500)))]
        assert lookup.match("miss", other, pin_group=1) == 0  # answered, not "ask me later"
    finally:
        release.set()
    pin = lookup.take_early_pin("hit")
    assert pin.reply(5.0) is not None
    pin.release()
    wait_unpinned(env)
    lookup.close()


# ---- the scheduler half: who gives an early pin back -----------------------

class _Blocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def _scheduler(env, handoff, layerwise=False):
    cfg = parse_config({"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/x",
                        "maru_kv_chunk_tokens": CHUNK, "maru_use_layerwise": layerwise}, BLOCK)
    ns = env.ns  # the keys the test stored under, in either format (worker_env.WorkerEnv.keys)
    assert isinstance(ns, KeyNamespace)
    return MaruSchedulerHalf(cfg, (ns,), BLOCK, LookupService(env.index.client, timeout_s=1.0),
                             num_layers=LAYERS if layerwise else None, handoff=handoff)


def _request(n_tokens):
    return Request("r", tokens(n_tokens), SamplingParams(max_tokens=2), None)


def _pinned_after_lookup(env, half, req):
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * CHUNK
    wait_until(lambda: len(+env.index.pins) == 3, 5.0, interval_s=0.01, what="the early pin taken")


@pytest.fixture
def scheduler(env):
    _store(env, 100)
    handoff = PinHandoff()
    handoff.attach_worker()  # a worker half of this engine lives in this process
    half = _scheduler(env, handoff)
    yield env, half, handoff
    half.shutdown()


def test_a_planned_load_carries_the_early_pin_to_the_worker(scheduler):
    env, half, handoff = scheduler
    req = _request(100)
    _pinned_after_lookup(env, half, req)
    half.update_state_after_alloc(req, _Blocks(range(8)), 3 * CHUNK)
    (spec,) = half.build_connector_meta(_empty_output()).loads
    pin = handoff.claim(spec.early_pin)
    assert pin is not None and half._lookup.num_early_pins == 0
    assert len(+env.index.pins) == 3  # still pinned: now the worker's
    pin.release()
    wait_unpinned(env)


@pytest.mark.parametrize("how", ["no_load_planned", "request_ended", "looked_up_again"])
def test_an_early_pin_no_load_takes_is_given_back(scheduler, how):
    env, half, handoff = scheduler
    req = _request(100)
    _pinned_after_lookup(env, half, req)
    if how == "no_load_planned":  # e.g. vLLM allocated without the external tokens
        half.update_state_after_alloc(req, _Blocks(range(8)), 0)
    elif how == "request_ended":  # aborted while waiting for blocks
        half.request_finished(req, [])
    else:  # not allocated this step: vLLM asks again next step
        _pinned_after_lookup(env, half, req)
        wait_until(lambda: env.index.calls["unpin"] >= 1, 5.0, interval_s=0.01, what="the old pin given back")
        assert set((+env.index.pins).values()) == {1}  # one pin per key: the new lookup's
        half.request_finished(req, [])
    wait_unpinned(env)
    assert half._lookup.num_early_pins == 0 and handoff.num_offered == 0


def test_pins_offered_to_a_worker_that_closes_are_given_back(scheduler):
    env, half, handoff = scheduler
    req = _request(100)
    _pinned_after_lookup(env, half, req)
    half.update_state_after_alloc(req, _Blocks(range(8)), 3 * CHUNK)
    assert handoff.num_offered == 1
    handoff.detach_worker()  # the worker half shut down before the plan reached it
    wait_unpinned(env)
    assert handoff.num_offered == 0


def test_no_early_pin_without_a_worker_of_the_engine_in_this_process(env):
    _store(env, 100)
    half = _scheduler(env, PinHandoff())  # no worker attached: TP ranks in other processes
    req = _request(100)
    assert half.get_num_new_matched_tokens(req, 0)[0] == 3 * CHUNK
    half.update_state_after_alloc(req, _Blocks(range(8)), 3 * CHUNK)
    (spec,) = half.build_connector_meta(_empty_output()).loads
    assert spec.early_pin == 0 and env.index.calls["retrieve"] == 0 and not +env.index.pins
    half.shutdown()


def _empty_output():
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.kv_connector_block_state = None
    return out
