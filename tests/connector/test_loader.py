"""Async loads: parking, release after N layers, per-layer waits, failures while parked."""

from __future__ import annotations

import threading
import time

import pytest

from maru_connector.metadata import MaruConnectorMetadata

from worker_env import LAYERS, WorkerEnv, blocks_equal, finished, load_meta, report, save, store_meta, tokens

LAYER = "model.layers.{}.self_attn.attn"


class GatedHandle:
    """A real load handle whose layers become visible only when the test says so."""

    def __init__(self, real):
        real.wait_all()
        self.real = real
        self.nbytes = real.nbytes
        self.submitted_at = real.submitted_at
        self.error = None
        self.gates = [threading.Event() for _ in range(real.num_layers)]

    def land(self, layer):
        self.gates[layer].set()

    def layer_ready(self, layer):
        return self.gates[layer].is_set()

    def wait_layer(self, layer, timeout=None):
        return self.gates[layer].wait(timeout)

    wait_layer_on_device = wait_layer

    def wait_all(self, timeout=None):
        return all(g.wait(timeout) for g in self.gates)

    def done(self):
        return all(g.is_set() for g in self.gates)


class GatedEngine:
    def __init__(self, real):
        self.real = real
        self.fmt, self.backend = real.fmt, real.backend
        self.handles: list[GatedHandle] = []

    def submit_load(self, chunks, **options):
        self.handles.append(GatedHandle(self.real.submit_load(chunks, **options)))
        return self.handles[-1]

    def submit_store(self, chunks):
        return self.real.submit_store(chunks)

    def close(self):
        self.real.close()


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _stored(env, n_tokens=64):
    writer, kv_w = env.worker(seed=1, maru_async_store=False)
    keys = env.keys(tokens(n_tokens))
    meta = store_meta("w", keys, first_block=0)
    save(writer, meta)
    return keys, kv_w


def _poll_finished(half, held=frozenset(), timeout=5.0):
    """get_finished + load errors of one step, polled until something is reported."""
    deadline = time.monotonic() + timeout
    while True:
        _, recving = finished(half, held=held)
        errors = half.get_block_ids_with_load_errors()
        if recving or errors or time.monotonic() > deadline:
            return recving, errors, report(half)
        time.sleep(0.005)


def _wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.002)


@pytest.mark.parametrize("layerwise", [False, True])
def test_async_load_releases_with_exact_bytes(env, layerwise):
    keys, kv_w = _stored(env) if not layerwise else (None, None)
    if layerwise:
        writer, kv_w = env.worker(seed=1, maru_async_store=False, maru_use_layerwise=True)
        keys = env.keys(tokens(64))
        save(writer, store_meta("w", keys, first_block=0))
    reader, kv_r = env.worker(seed=2, maru_async_load=True, maru_use_layerwise=layerwise)
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    recving, errors, meta = _poll_finished(reader)
    assert recving == {"r"} and errors == set() and not meta.failed_load_req_ids and not meta.tainted
    assert blocks_equal(kv_w, range(4), kv_r, range(10, 14))
    _wait_until(lambda: reader._loader.num_in_flight == 0)
    assert +env.index.pins == {}


@pytest.mark.parametrize("release_after", [0, 1, 2, 3])
def test_overlap_releases_after_n_layers_and_forward_waits_per_layer(env, release_after):
    keys, _ = _stored(env)
    gated: list[GatedEngine] = []
    reader, _ = env.worker(
        seed=2, wrap_engine=lambda e: gated.append(GatedEngine(e)) or gated[-1],
        maru_async_load=True, maru_overlap_load_with_compute=True,
        maru_overlap_release_after_layers=release_after,
    )
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    _wait_until(lambda: gated[0].handles)
    handle = gated[0].handles[0]
    for layer in range(release_after):
        assert finished(reader) == (set(), set())  # still parked
        handle.land(layer)
    recving, errors, _ = _poll_finished(reader)
    assert recving == {"r"} and errors == set()
    assert env.index.pins  # pins held while layers are still copying

    # The resumed forward waits for each remaining layer, keyed by true layer index.
    waited = threading.Event()

    def forward_layer(i):
        reader.wait_for_layer_load(LAYER.format(i))
        waited.set()

    if release_after < LAYERS:
        last = LAYERS - 1
        t = threading.Thread(target=forward_layer, args=(last,))
        t.start()
        for layer in range(release_after, last):
            handle.land(layer)
        assert not waited.wait(0.1)  # layer `last` has not landed yet
        handle.land(last)
        t.join(5)
        assert waited.is_set()
    _wait_until(lambda: not env.index.pins)  # unpinned once every layer landed
    waits = reader.stats.snapshot()["histograms"]["layer_wait_seconds"]["count"]
    assert waits >= (1 if release_after < LAYERS else 0)


def test_forward_waits_only_for_the_loads_of_the_requests_it_computes(env):
    """A load released beside a step (release after 0 layers) belongs to a
    request that step does not compute: its copies must not hold the forward."""
    keys, _ = _stored(env)
    gated: list[GatedEngine] = []
    reader, _ = env.worker(seed=2, wrap_engine=lambda e: gated.append(GatedEngine(e)) or gated[-1],
                           maru_async_load=True, maru_overlap_load_with_compute=True,
                           maru_overlap_release_after_layers=0)
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    recving, _, _ = _poll_finished(reader)
    assert recving == {"r"}  # released, no layer landed
    layer = LAYER.format(0)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (reader.wait_for_layer_load(layer, {"miss"}), done.set()))
    waiter.start()
    assert done.wait(2), "a forward computing only 'miss' waited for r's copies"
    waiter = threading.Thread(target=lambda: (reader.wait_for_layer_load(layer, {"miss", "r"}), done.clear()))
    waiter.start()
    time.sleep(0.05)
    assert done.is_set()  # r is computed: its layer 0 must land first
    for i in range(LAYERS):
        gated[0].handles[0].land(i)
    waiter.join(5)
    assert not done.is_set()


def test_without_overlap_release_waits_for_every_layer(env):
    keys, _ = _stored(env)
    gated: list[GatedEngine] = []
    reader, _ = env.worker(seed=2, wrap_engine=lambda e: gated.append(GatedEngine(e)) or gated[-1],
                           maru_async_load=True)
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    _wait_until(lambda: gated[0].handles)
    for layer in range(LAYERS - 1):
        gated[0].handles[0].land(layer)
    time.sleep(0.05)
    assert finished(reader) == (set(), set())
    gated[0].handles[0].land(LAYERS - 1)
    recving, _, _ = _poll_finished(reader)
    assert recving == {"r"}


def test_abort_while_parked_finishes_every_layer_before_reporting(env):
    keys, _ = _stored(env)
    gated: list[GatedEngine] = []
    reader, _ = env.worker(seed=2, wrap_engine=lambda e: gated.append(GatedEngine(e)) or gated[-1],
                           maru_async_load=True, maru_overlap_load_with_compute=True)
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    _wait_until(lambda: gated[0].handles)
    reader.handle_preemptions(MaruConnectorMetadata(finished_req_ids={"r"}))  # aborted
    gated[0].handles[0].land(0)  # would release a live request
    time.sleep(0.05)
    assert finished(reader) == (set(), set())
    for layer in range(1, LAYERS):
        gated[0].handles[0].land(layer)
    recving, _, _ = _poll_finished(reader)
    assert recving == {"r"}  # vLLM frees the blocks now: no copy is left


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("short", "short_reply"),
        ("long", "long_reply"),
        ("miss", "miss"),
        ("down", "index_error"),
    ],
)
def test_failure_while_parked_reports_blocks_no_later_than_release(env, fault, reason):
    keys, _ = _stored(env)
    reader, _ = env.worker(seed=2, maru_async_load=True)
    if fault == "short":
        env.index.retrieve_hook = lambda locs: locs[:-1]
    elif fault == "long":
        env.index.retrieve_hook = lambda locs: locs + locs[:1]
    elif fault == "miss":
        keys = keys[:1] + env.keys(tokens(64, start=900))[1:]
    else:
        env.index.down = True
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    recving, errors, meta = _poll_finished(reader)
    assert recving == {"r"}  # the request leaves the parked state ...
    assert errors == set(range(10, 14))  # ... with its blocks reported in the same step
    assert meta.failed_load_req_ids == {"r"}
    assert reader.stats.snapshot()["load_failures"][reason] == 1
    assert +env.index.pins == {}


def test_loader_keeps_no_state_after_many_requests(env):
    keys, _ = _stored(env)
    reader, _ = env.worker(seed=2, maru_async_load=True)
    for i in range(200):
        reader.start_load_kv(load_meta(f"r{i}", keys, first_block=10, is_async=True))
        _poll_finished(reader)
    _wait_until(lambda: reader._loader.num_in_flight == 0)
    assert reader._loader.take_results().released == set()
    assert +env.index.pins == {}


def test_a_loader_thread_that_dies_stops_the_engine_loudly(env):
    keys, _ = _stored(env)
    reader, _ = env.worker(seed=2, maru_async_load=True)

    class Crash(BaseException):  # not an Exception: no per-load guard catches it
        pass

    def crash(load, active):
        raise Crash("bug in the loader loop")

    reader._loader._start = crash
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    _wait_until(lambda: reader._loader._dead is not None)
    with pytest.raises(RuntimeError, match="loader thread died"):
        finished(reader)  # parked requests would never be released: no silent hang


def test_step_that_computed_nothing_waits_for_the_release_instead_of_returning(env, monkeypatch):
    """An engine whose every request is parked must sleep until the loader
    releases one, not step again at once (it would hold the GIL the loader
    and the copies need): that step's get_finished reports the release."""
    import maru_connector.worker as worker_module

    monkeypatch.setattr(worker_module, "_IDLE_STEP_MAX_WAIT_S", 30.0)
    keys, kv_w = _stored(env)
    reader, kv_r = env.worker(seed=2, maru_async_load=True)
    gated = GatedEngine(reader._res.engine)
    reader._loader._engine = gated
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    _wait_until(lambda: gated.handles)
    # A step that computed something never waits: nothing is released yet.
    assert finished(reader, scheduled={"other"}) == (set(), set())
    threading.Timer(0.2, lambda: [gated.handles[0].land(i) for i in range(LAYERS)]).start()
    # Copies of gated handles are only looked at every few ms: the wait ends with the release.
    assert finished(reader) == (set(), {"r"})
    assert blocks_equal(kv_w, range(4), kv_r, range(10, 14))
    _wait_until(lambda: reader._loader.num_in_flight == 0)
    # Nothing left to release: a step that computed nothing returns at once.
    started = time.monotonic()
    assert finished(reader) == (set(), set())
    assert time.monotonic() - started < 10.0


def test_landed_layers_wake_the_loader_thread(env, monkeypatch):
    """On the CPU the loader thread is woken by each landed layer, never by a
    timer: with the timer out of reach the load is still released."""
    import maru_connector.loader as loader_module

    monkeypatch.setattr(loader_module, "_HOST_WAKE_S", 3600.0)
    keys, kv_w = _stored(env)
    reader, kv_r = env.worker(seed=2, maru_async_load=True)
    reader.start_load_kv(load_meta("r", keys, first_block=10, is_async=True))
    assert reader._loader.wait_for_results(30.0)
    recving, errors, _ = _poll_finished(reader, timeout=1.0)
    assert recving == {"r"} and errors == set()
    assert blocks_equal(kv_w, range(4), kv_r, range(10, 14))
    _wait_until(lambda: reader._loader.num_in_flight == 0, timeout=30.0)
    assert +env.index.pins == {}
