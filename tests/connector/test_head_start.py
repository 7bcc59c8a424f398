"""Head starts through the connector: when the lookup answers with an early
pin, the scheduler half has the worker half start the load's first copies
(``TransferEngine.start_head``) before vLLM allocates blocks, and the load
planned afterwards claims exactly that head.

The CPU backend starts no heads, so the worker's engine here is the real CPU
engine behind a wrapper that starts heads as the CUDA backend does (what the
CUDA backend does with one: ``test_head_start_cuda.py``). What must hold:
the head is started for precisely the sources the load will copy (else the
load could not use it), the load claims it, and a head no load takes is
dropped, whoever ends up giving the pin back.
"""

from __future__ import annotations

import pytest

from maru_connector.early_pins import PinHandoff
from maru_connector.metadata import MaruConnectorMetadata

from test_early_pins import _Blocks, _empty_output, _request, _scheduler, _store
from worker_env import CHUNK, LAYERS, WorkerEnv, blocks_equal, step, wait_unpinned


class _Head:
    def __init__(self, sources):
        self.sources, self.claimed, self.dropped = sources, False, False

    def claim(self, sources):
        if sources == self.sources and not self.dropped:
            self.claimed = True
            return self
        self.drop()
        return None

    def drop(self):
        self.dropped = self.dropped or not self.claimed


class HeadStartingEngine:
    """The real engine, starting (recorded) heads and claiming them at submit."""

    def __init__(self, real):
        self.real, self.heads, self.submitted = real, [], []

    def start_head(self, sources):
        self.heads.append(_Head([tuple(s) for s in sources]))
        return self.heads[-1]

    def submit_load(self, chunks, head=None, **options):
        claimed = head.claim([c.sources for c in chunks]) if head is not None else None
        self.submitted.append(claimed)
        handle = self.real.submit_load(chunks, **options)
        handle.head_start = claimed is not None  # as the CUDA engine reports a claim
        return handle

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _engine_half(env, layerwise=False):
    keys, kv_w = _store(env, 100, layerwise)
    handoff = PinHandoff()
    engines = []
    reader, kv_r = env.worker(seed=2, handoff=handoff, maru_use_layerwise=layerwise,
                              wrap_engine=lambda e: engines.append(HeadStartingEngine(e)) or engines[-1])
    half = _scheduler(env, handoff, layerwise=layerwise)
    return half, reader, engines[0], kv_w, kv_r


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_hit_s_head_starts_at_its_lookup_and_its_load_claims_it(env, layerwise):
    half, reader, engine, kv_w, kv_r = _engine_half(env, layerwise)
    req = _request(100)
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    assert ext == 3 * CHUNK
    (head,) = engine.heads  # started before any block was allocated
    assert len(head.sources) == 3 and all(len(s) == (LAYERS if layerwise else 1) for s in head.sources)
    half.update_state_after_alloc(req, _Blocks(range(8, 16)), ext)
    loads = half.build_connector_meta(_empty_output()).loads
    errors, report = step(reader, MaruConnectorMetadata(loads=loads, scheduled_req_ids=frozenset({"r"})))
    assert errors == set() and not report.failed_load_req_ids
    assert engine.submitted == [head] and head.claimed and not head.dropped
    assert reader.stats.snapshot()["counters"]["head_start_loads"] == 1
    assert blocks_equal(kv_w, range(6), kv_r, range(8, 14))
    wait_unpinned(env)
    half.shutdown()


def test_a_load_of_fewer_chunks_than_its_head_drops_it(env):
    """vLLM allocated blocks for two chunks only: the load copies two, the
    head was for three, so the load may not use it."""
    half, reader, engine, kv_w, kv_r = _engine_half(env)
    req = _request(100)
    ext, _ = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, _Blocks(range(8, 12)), ext)
    loads = half.build_connector_meta(_empty_output()).loads
    errors, _ = step(reader, MaruConnectorMetadata(loads=loads, scheduled_req_ids=frozenset({"r"})))
    assert errors == set() and engine.submitted == [None]
    assert engine.heads[0].dropped and not engine.heads[0].claimed
    assert reader.stats.snapshot()["counters"]["head_start_loads"] == 0
    assert blocks_equal(kv_w, range(4), kv_r, range(8, 12))
    wait_unpinned(env)
    half.shutdown()


@pytest.mark.parametrize("how", ["request_ended", "looked_up_again", "no_load_planned"])
def test_a_head_no_load_takes_is_dropped(env, how):
    half, reader, engine, _, _ = _engine_half(env)
    req = _request(100)
    half.get_num_new_matched_tokens(req, 0)
    if how == "request_ended":
        half.request_finished(req, [])
    elif how == "looked_up_again":  # not allocated this step: asked again, a new pin and head
        half.get_num_new_matched_tokens(req, 0)
        assert len(engine.heads) == 2 and not engine.heads[1].dropped
        half.request_finished(req, [])
    else:
        half.update_state_after_alloc(req, _Blocks(range(8)), 0)
    assert all(h.dropped for h in engine.heads) and not any(h.claimed for h in engine.heads)
    wait_unpinned(env)
    half.shutdown()


def test_a_head_attached_to_a_pin_already_given_back_is_dropped():
    """The pin can be released (its request aborted) while its head start is
    being queued: the head must not keep the engine's one head buffer."""
    from concurrent.futures import Future

    from maru_connector.early_pins import EarlyPin

    pin = EarlyPin(client=None, object_keys=b"", run=lambda fn: fn())
    reply: Future = Future()
    pin.start(reply)
    pin.release()
    head = _Head([(1,)])
    pin.attach_head(head)
    assert head.dropped and pin.head is None

    kept = EarlyPin(client=None, object_keys=b"", run=lambda fn: fn())
    kept.start(Future())
    other = _Head([(2,)])
    kept.attach_head(other)
    assert kept.head is other and not other.dropped
