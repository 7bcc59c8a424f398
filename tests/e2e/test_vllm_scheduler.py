"""The connector driven by vLLM's own scheduler, step by step, over a toy model.

Each engine here is vLLM's real ``Scheduler`` with MaruCache's scheduler half
(created by vLLM), a worker-role connector on a CPU KV cache and the toy
forward of :mod:`maru_tools.stepper`, whose KV is exact and
depends on the KV stored before it. So every check is exact: the blocks a
request holds equal the KV computed from its tokens alone, and a store made
on top of wrong KV would hand the next engine wrong KV (which a third engine
then shows).

The paths covered are the ones that let wrong KV through before: a failed
sync load whose step still stored (or whose dropped store a restarted index
brought back), a copy that fails after an overlapped
release, an abort while parked after a preemption, a loader thread that
raises, and chunked prefills longer than one step's budget.
"""

from __future__ import annotations

import itertools
import time

import pytest
from maru_core.pool import Pool
from maru_core.pool.slots import SlotState

from maru_connector.config import make_kv_transfer_config
from maru_tools.cluster import wait_until
from maru_tools.index_process import IndexProcess
from maru_tools.stepper import SteppedEngine, expected_next_token
from maru_tools.workload import random_tokens
from maru_connector.transfer.handles import LoadHandle, TransferError

from .conftest import index_keys, wait_for_keys, wait_settled
from .fault_proxy import FaultProxy

CHUNK = 32
BLOCK = 16
MODES = {  # name -> knobs; the "async" modes park every hit, "async-auto" only beside others
    "sync": {},
    "sync-overlap": {"overlap_load_with_compute": True},
    "async": {"async_load": True, "park_lone_hits": True},
    "async-overlap": {"async_load": True, "park_lone_hits": True, "overlap_load_with_compute": True,
                      "overlap_release_after_layers": 1},
    "async-auto": {"async_load": True, "overlap_load_with_compute": True},
}
# vLLM's two call orders: wait_for_save before the step's report, or (with a
# speculative config) after it (SteppedEngine's defer_finalize).
ORDERS = {"finalize-in-step": False, "deferred-finalize": True}


def _config(index, url=None, **knobs):
    return make_kv_transfer_config(url or index.url, pool_path=index.pool_path, token=index.token,
                                   kv_chunk_tokens=CHUNK, load_timeout_s=5.0, lookup_timeout_s=2.0,
                                   **knobs)


@pytest.fixture
def engines(model_dir):
    """A factory of stepped engines, all closed after the test."""
    made: list[SteppedEngine] = []

    def make(config, **kwargs) -> SteppedEngine:
        engine = SteppedEngine(model_dir, config, block_size=BLOCK, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _serve(engine, req_id, prompt, max_tokens=2):
    engine.add(req_id, prompt, max_tokens)
    engine.run(until=lambda: req_id in engine.finished)
    return engine.finished[req_id].output


def _expected_tokens(prompt, num_layers, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(expected_next_token(tokens, num_layers))
    return tokens[len(prompt):]


def _store(engines, index, prompt, layerwise=False):
    writer = engines(_config(index, use_layerwise=layerwise))
    keys = index_keys(index)
    out = _serve(writer, "w", prompt)
    assert out == _expected_tokens(prompt, writer.num_layers, 2)
    per_chunk = writer.num_layers if layerwise else 1
    wait_for_keys(index, keys + per_chunk * (len(prompt) // CHUNK))
    return writer


def _wait_loaded(engine, more_than=0):
    """The worker's counters once it has counted a load beyond ``more_than``
    bytes: an async load is counted when its copies end, which can come
    after its request finished."""
    stats = engine.worker.worker_half.stats
    wait_until(lambda: stats.snapshot()["counters"]["load_bytes"] > more_than, 10.0, what="a load counted")
    return stats.snapshot()["counters"]


_seeds = itertools.count(7000)


@pytest.mark.parametrize("early_pins", [True, False], ids=["early-pins", "worker-retrieves"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("mode", list(MODES))
def test_hit_blocks_hold_exactly_the_computed_kv(engines, index, mode, layerwise, early_pins):
    """Whether the load copies under its lookup's early pins (the scheduler
    and the worker share this process) or retrieves its own, the blocks hold
    exactly the computed KV, and every pin is given back."""
    prompt = random_tokens(4 * CHUNK + 5, seed=next(_seeds))
    _store(engines, index, prompt, layerwise)
    reader = engines(_config(index, use_layerwise=layerwise, early_pins=early_pins, **MODES[mode]))
    reader.add("r", prompt, max_tokens=2)
    stats = reader.worker.worker_half.stats
    hit_before = stats.snapshot()["counters"]["load_bytes"]
    reader.run(until=lambda: reader.requests.get("r") is None or reader.requests["r"].output)
    assert reader.wrong_positions("r", prompt) == []  # loaded prefix and computed tail
    reader.run(until=lambda: "r" in reader.finished)
    assert reader.finished["r"].output == _expected_tokens(prompt, reader.num_layers, 2)
    counters = _wait_loaded(reader, more_than=hit_before)
    assert counters["early_pinned_loads"] == (1 if early_pins else 0)
    wait_settled(index)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("mode", list(MODES))
def test_hits_are_exact_in_the_deferred_finalize_order(engines, index, mode, layerwise):
    """vLLM's order with a speculative config (the step's report before
    ``wait_for_save``): every load mode's hit still holds exactly the
    computed KV, and its stores still commit."""
    prompt = random_tokens(4 * CHUNK + 5, seed=next(_seeds))
    _store(engines, index, prompt, layerwise)
    reader = engines(_config(index, use_layerwise=layerwise, **MODES[mode]), defer_finalize=True)
    keys = index_keys(index)
    assert _serve(reader, "r", prompt) == _expected_tokens(prompt, reader.num_layers, 2)
    _wait_loaded(reader)
    extended = prompt + random_tokens(2 * CHUNK, seed=next(_seeds))  # two new chunks to store
    assert _serve(reader, "s", extended) == _expected_tokens(extended, reader.num_layers, 2)
    wait_for_keys(index, keys + 2 * (reader.num_layers if layerwise else 1))
    wait_settled(index)


def test_async_hit_parks_only_beside_another_request(engines, index):
    """A lone hit loads in the step that computes it (parking would add a
    step); one that arrives while another request runs parks. Both hold
    exactly the computed KV."""
    first = random_tokens(3 * CHUNK + 5, seed=next(_seeds))
    second = random_tokens(2 * CHUNK + 7, seed=next(_seeds))
    writer = _store(engines, index, first)
    keys = index_keys(index)
    _serve(writer, "w2", second)
    wait_for_keys(index, keys + 2)
    reader = engines(_config(index, **MODES["async-auto"]))
    stats = reader.scheduler.connector.scheduler_half.stats

    reader.add("a", first, max_tokens=8)
    reader.run(until=lambda: reader.requests["a"].output)
    assert len(reader.history) == 1 and stats.snapshot()["counters"]["parked_loads"] == 0
    assert reader.wrong_positions("a", first) == []

    reader.add("b", second, max_tokens=2)  # "a" is still decoding
    reader.run(until=lambda: reader.requests["b"].output)
    assert stats.snapshot()["counters"]["parked_loads"] == 1
    assert reader.wrong_positions("b", second) == []
    reader.run(until=lambda: {"a", "b"} <= set(reader.finished))
    assert reader.finished["a"].output == _expected_tokens(first, reader.num_layers, 8)
    assert reader.finished["b"].output == _expected_tokens(second, reader.num_layers, 2)
    assert stats.snapshot()["counters"]["lookup_hit_tokens"] == 5 * CHUNK
    wait_settled(index)


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", ["sync", "sync-overlap"])
def test_failed_sync_load_stores_nothing_computed_on_it(engines, index, proxy, mode, defer_finalize):
    """The load fails in the step whose forward also computes the rest of the
    prompt: that step's stores must never be committed."""
    prefix = random_tokens(2 * CHUNK, seed=next(_seeds))
    prompt = prefix + random_tokens(2 * CHUNK + 3, seed=next(_seeds))
    _store(engines, index, prefix + [1])
    failing = engines(_config(index, url=proxy.url, **MODES[mode]), defer_finalize=defer_finalize)
    proxy.arm("miss", count=1, op="retrieve_prefix")  # the lookup's pin (early pins, as shipped)
    try:
        out = _serve(failing, "b", prompt)
    finally:
        proxy.disarm()
    assert proxy.fired == 1
    assert out == _expected_tokens(prompt, failing.num_layers, 2)  # recomputed
    assert any(r.worker_meta.tainted for r in failing.history)
    wait_settled(index)
    # A third engine loads every chunk of the prompt: all of it must be right.
    reader = engines(_config(index))
    reader.add("c", prompt, max_tokens=2)
    reader.run(until=lambda: reader.requests["c"].output)
    assert reader.worker.worker_half.stats.snapshot()["counters"]["load_bytes"] > 0
    assert reader.wrong_positions("c", prompt) == []


@pytest.fixture
def restartable(workdir):
    """An index process of the test's own (it is SIGKILLed and restarted) and a fault proxy before it."""
    with IndexProcess(pool_size="128Mi", log_dir=workdir) as index, FaultProxy(index.port, index.pool_path) as proxy:
        yield index, proxy


def test_a_dropped_store_stays_dropped_across_an_index_crash_and_restart(engines, restartable):
    """A store whose step used a failed load is copied and headed, then dropped
    by the verdict: its slot headers stay in the pool. The index is SIGKILLed
    and restarted over the pool: a third engine must load none of it."""
    index, proxy = restartable
    prefix = random_tokens(2 * CHUNK, seed=next(_seeds))
    prompt = prefix + random_tokens(2 * CHUNK + 3, seed=next(_seeds))
    _store(engines, index, prefix + [1])
    committed = index_keys(index)
    failing = engines(_config(index, url=proxy.url, async_store=False))
    proxy.arm("miss", count=1, op="retrieve_prefix")
    failing.add("b", prompt, max_tokens=2)
    failing.step()  # the load fails; the forward computes the rest on it; its store is copied and headed
    assert proxy.fired == 1 and failing.history[-1].worker_meta.tainted
    assert index.stats()["reserved_keys"] == 2
    # The recompute's own store gets no slot, so nothing writes over the dropped store's pages.
    proxy.arm("drop", count=1, op="reserve")
    failures = failing.worker.worker_half.stats.snapshot
    failing.run(max_steps=20, until=lambda: proxy.fired and failures()["store_failures"]["load_failed"])
    assert index_keys(index) == committed  # dropped: never committed
    index.kill()  # SIGKILL: a crash
    index.start()
    assert index_keys(index) == committed
    reader = engines(_config(index))
    reader.add("c", prompt, max_tokens=2)
    reader.run(until=lambda: "c" in reader.finished or reader.requests["c"].output)
    assert reader.worker.worker_half.stats.snapshot()["counters"]["load_bytes"] > 0  # the prefix came back
    assert reader.wrong_positions("c", prompt) == []
    reader.run(until=lambda: "c" in reader.finished)
    assert reader.finished["c"].output == _expected_tokens(prompt, reader.num_layers, 2)
    with Pool.attach(index.pool_path) as pool:  # the dropped objects are there still, never committed
        assert len(list(pool.iter_slot_headers(SlotState.PENDING))) == 2
        assert len(list(pool.iter_slot_headers())) == committed


class _FailingHandle(LoadHandle):
    """Its first ``ok_layers`` layers landed; the copy of the others fails as
    soon as the forward waits for one of them (so after the release)."""

    def __init__(self, num_layers, nbytes, ok_layers, on_fail):
        super().__init__(num_layers, nbytes)
        self._ok_layers, self._on_fail = ok_layers, on_fail
        for layer in range(ok_layers):
            self._mark_layer(layer)

    def wait_layer_on_device(self, layer, timeout=None):
        if layer >= self._ok_layers and self.error is None:
            self._fail(TransferError("injected: copy failed after release"))
            self._on_fail()
        return super().wait_layer_on_device(layer, timeout)


class _FailAfterRelease:
    """Transfer engine wrapper whose loads land ``ok_layers`` layers; the
    blocks of the other layers keep garbage and their copy fails."""

    def __init__(self, real, ok_layers: int):
        self.real, self.ok_layers, self.fmt = real, ok_layers, real.fmt
        self.failed = 0

    def submit_load(self, chunks, **options):
        real = self.real.submit_load(chunks, **options)
        real.wait_all()
        blocks = [b for c in chunks for b in c[0]]
        for layer in range(self.ok_layers, real.num_layers):
            self.real.kv_caches[layer][blocks] = 4242.0  # the bytes that never landed
        return _FailingHandle(real.num_layers, real.nbytes, self.ok_layers, self._count)

    def _count(self):
        self.failed += 1

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("release_after", [0, 1])
def test_copy_failing_after_release_is_reported_and_not_stored(engines, index, release_after, defer_finalize):
    """Released after ``release_after`` layers landed (0: once pinned, before
    any copy); the first layer copied after the release fails under the forward."""
    prefix = random_tokens(2 * CHUNK, seed=next(_seeds))
    prompt = prefix + random_tokens(2 * CHUNK + 3, seed=next(_seeds))
    _store(engines, index, prefix + [1])
    wrapped = []

    def wrap(resources):
        resources.engine = _FailAfterRelease(resources.engine, ok_layers=release_after)
        wrapped.append(resources.engine)
        return resources

    knobs = {**MODES["async-overlap"], "overlap_release_after_layers": release_after}
    failing = engines(_config(index, **knobs), wrap_resources=wrap, defer_finalize=defer_finalize)
    out = _serve(failing, "b", prompt)
    assert wrapped[0].failed == 1
    assert out == _expected_tokens(prompt, failing.num_layers, 2)
    reported = [r for r in failing.history if r.invalid_block_ids]
    assert reported and "b" in reported[0].scheduled  # in the step that computed it
    assert reported[0].worker_meta.tainted
    wait_settled(index)
    reader = engines(_config(index))
    reader.add("c", prompt, max_tokens=2)
    reader.run(until=lambda: reader.requests["c"].output)
    assert reader.wrong_positions("c", prompt) == []


@pytest.mark.parametrize("defer_finalize", list(ORDERS.values()), ids=list(ORDERS))
@pytest.mark.parametrize("mode", ["sync-overlap", "async-auto"])
def test_overlapped_sync_load_failing_under_the_forward_is_in_that_steps_report(
        engines, index, mode, defer_finalize):
    """A sync load overlapped with its forward (``async-auto``: a lone async
    hit loads so) whose copy of a later layer fails under the forward. With a
    speculative config vLLM collects the step's report before it calls
    ``wait_for_save``: the failure must still be in that report, so vLLM
    drops the token sampled from the unloaded blocks and the step's stores."""
    prefix = random_tokens(2 * CHUNK, seed=next(_seeds))
    prompt = prefix + random_tokens(2 * CHUNK + 3, seed=next(_seeds))
    _store(engines, index, prefix + [1])
    wrapped = []

    def wrap(resources):
        resources.engine = _FailAfterRelease(resources.engine, ok_layers=1)
        wrapped.append(resources.engine)
        return resources

    failing = engines(_config(index, **MODES[mode]), wrap_resources=wrap, defer_finalize=defer_finalize)
    out = _serve(failing, "b", prompt)
    assert wrapped[0].failed == 1
    assert out == _expected_tokens(prompt, failing.num_layers, 2)
    reported = [r for r in failing.history if r.invalid_block_ids]
    assert reported and "b" in reported[0].scheduled  # in the step whose forward used the blocks
    assert reported[0].worker_meta.tainted
    wait_settled(index)
    reader = engines(_config(index))  # loads every chunk of the prompt the failing engine stored
    reader.add("c", prompt, max_tokens=2)
    reader.run(until=lambda: reader.requests["c"].output)
    assert reader.wrong_positions("c", prompt) == []


def test_loader_exception_fails_that_load_and_the_thread_serves_the_next(engines, index):
    first = random_tokens(2 * CHUNK + 1, seed=next(_seeds))
    second = random_tokens(2 * CHUNK + 1, seed=next(_seeds))
    _store(engines, index, first)
    _store(engines, index, second)
    raised = []

    def wrap(resources):
        real_submit = resources.engine.submit_load

        def submit_load(chunks, **options):
            if not raised:
                raised.append(True)
                raise RuntimeError("injected: the engine refused the load")
            return real_submit(chunks, **options)

        resources.engine.submit_load = submit_load
        return resources

    reader = engines(_config(index, **MODES["async-overlap"]), wrap_resources=wrap)
    assert _serve(reader, "a", first) == _expected_tokens(first, reader.num_layers, 2)
    assert raised
    assert reader.worker.worker_half.stats.snapshot()["load_failures"].get("copy_error") == 1
    assert _serve(reader, "b", second) == _expected_tokens(second, reader.num_layers, 2)
    assert reader.worker.worker_half.stats.snapshot()["counters"]["load_bytes"] > 0
    wait_settled(index)


def test_abort_while_parked_after_preemption_keeps_blocks_until_the_load_ends(engines, index):
    """Stores, preemption, an async hit on its own chunks, abort while parked:
    vLLM must keep the blocks until the load reports, and never hear of the
    request from the storer (which would free them twice)."""
    prompt = random_tokens(3 * CHUNK + 1, seed=next(_seeds))
    engine = engines(_config(index, **MODES["async-overlap"]), max_num_batched_tokens=CHUNK)
    keys = index_keys(index)
    engine.add("r", prompt, max_tokens=40)
    engine.run(until=lambda: engine.requests["r"].output)
    wait_for_keys(index, keys + 3)
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "r"
    engine.run(until=lambda: engine.status("r") == "WAITING_FOR_REMOTE_KVS", max_steps=50)
    engine.abort("r")
    other = random_tokens(CHUNK + 1, seed=next(_seeds))
    engine.add("x", other, max_tokens=2)  # the engine goes on serving
    engine.run(max_steps=500)  # before the fix: vLLM's `assert req_id in self.requests`
    assert engine.finished["x"].output == _expected_tokens(other, engine.num_layers, 2)
    assert engine.scheduler.requests == {}
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back, once
    wait_settled(index)


@pytest.mark.parametrize("mode", ["sync", "async-overlap"])
def test_preempted_request_resumes_from_its_own_chunks(engines, index, mode):
    prompt = random_tokens(3 * CHUNK + 1, seed=next(_seeds))
    engine = engines(_config(index, **MODES[mode]))
    keys = index_keys(index)
    engine.add("r", prompt, max_tokens=6)
    engine.run(until=lambda: len(engine.requests["r"].output) >= 2)
    wait_for_keys(index, keys + 3)
    hits = engine.scheduler.connector.scheduler_half.stats.snapshot()["counters"]["lookup_hit_tokens"]
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "r"
    engine.run(until=lambda: "r" in engine.finished)
    assert engine.finished["r"].output == _expected_tokens(prompt, engine.num_layers, 6)
    after = engine.scheduler.connector.scheduler_half.stats.snapshot()["counters"]["lookup_hit_tokens"]
    assert after - hits == 3 * CHUNK  # it came back through the pool
    wait_settled(index)


def test_chunked_prefill_longer_than_a_step_stores_every_chunk(engines, index):
    prompt = random_tokens(8 * CHUNK + 3, seed=next(_seeds))
    writer = engines(_config(index), max_num_batched_tokens=2 * CHUNK)
    keys = index_keys(index)
    assert _serve(writer, "w", prompt) == _expected_tokens(prompt, writer.num_layers, 2)
    assert sum(1 for r in writer.history if "w" in r.scheduled) >= 4  # really split
    wait_for_keys(index, keys + 8)
    reader = engines(_config(index, **MODES["async"]))
    reader.add("r", prompt, max_tokens=2)
    reader.run(until=lambda: reader.requests["r"].output)
    assert reader.wrong_positions("r", prompt) == []
    hit = reader.scheduler.connector.scheduler_half.stats.snapshot()["counters"]["lookup_hit_tokens"]
    assert hit == 8 * CHUNK


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_load_is_recomputed_and_not_tried_again(engines, index, proxy, mode):
    prompt = random_tokens(3 * CHUNK + 2, seed=next(_seeds))
    _store(engines, index, prompt)
    reader = engines(_config(index, url=proxy.url, **MODES[mode]))
    proxy.arm("short", count=1, op="retrieve_prefix")  # the lookup's pin (early pins, as shipped)
    try:
        assert _serve(reader, "r", prompt, max_tokens=3) == _expected_tokens(prompt, reader.num_layers, 3)
    finally:
        proxy.disarm()
    assert proxy.fired == 1  # one failed load, then recompute: no second attempt
    assert sum(bool(r.invalid_block_ids) for r in reader.history) == 1
    # A parked load that fails is also named in vLLM's failed_recving, which
    # recomputes it whatever its blocks (and works where block ids do not).
    assert [r.failed_recving for r in reader.history if r.failed_recving] == ([{"r"}] if mode == "async" else [])
    wait_settled(index)


@pytest.mark.parametrize("mode", ["sync", "async-auto"])
def test_may_load_async_says_whether_a_lookup_can_park(engines, index, mode):
    """vLLM asks before any lookup; the answer follows the load mode, the
    request's own ``maru_load`` and a failed load (a miss from then on)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    engine = engines(_config(index, **MODES[mode]))
    connector = engine.scheduler.connector

    def request(req_id, params=None):
        extra = {"kv_transfer_params": params} if params else None
        return Request(req_id, [1, 2, 3], SamplingParams(max_tokens=1, extra_args=extra), None)

    assert connector.may_load_async(request("plain")) == (mode == "async-auto")
    assert not connector.may_load_async(request("asks-sync", {"maru_load": "sync"}))
    assert connector.may_load_async(request("asks-park", {"maru_load": "park"})) == (mode == "async-auto")
    assert connector.scheduler_half.num_tracked_requests == 0  # no state for requests never looked up


def test_parked_hit_starts_loading_while_the_running_batch_is_full(engines, index):
    """With vLLM's ``--max-num-inflight-kv-loads`` (0.34 on), a hit the
    connector says may park loads while the running batch is full instead of
    waiting in the plain queue behind it."""
    from vllm.config import SchedulerConfig

    if "max_num_inflight_kv_loads" not in SchedulerConfig.__dataclass_fields__:
        pytest.skip("this vLLM has no --max-num-inflight-kv-loads; make test runs this against the "
                    "pinned newest release (scripts/test_vllm_release.sh)")
    prompt = random_tokens(3 * CHUNK + 5, seed=next(_seeds))
    _store(engines, index, prompt)
    engine = engines(_config(index, **MODES["async-auto"]), max_num_seqs=1,
                     scheduler_options={"max_num_inflight_kv_loads": 2})
    engine.add("busy", random_tokens(CHUNK + 3, seed=next(_seeds)), max_tokens=40)
    engine.run(until=lambda: engine.requests["busy"].output)
    engine.add("hit", prompt, max_tokens=2)
    engine.run(until=lambda: engine.status("hit") != "WAITING", max_steps=50)
    assert engine.status("hit") == "WAITING_FOR_REMOTE_KVS" and "busy" in engine.requests
    engine.run(until=lambda: "hit" in engine.finished)
    assert engine.finished["hit"].output == _expected_tokens(prompt, engine.num_layers, 2)
    wait_settled(index)


def test_round_prompt_full_hit_leaves_one_token_to_compute(engines, index):
    prompt = random_tokens(4 * CHUNK, seed=next(_seeds))  # a multiple of the chunk
    _store(engines, index, prompt)
    time.sleep(0.1)
    reader = engines(_config(index, **MODES["async-overlap"]))
    assert _serve(reader, "r", prompt) == _expected_tokens(prompt, reader.num_layers, 2)
