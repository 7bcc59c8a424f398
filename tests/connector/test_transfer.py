"""The transfer engine's CPU backend: exact round trips through a shared
memory pool for every layout and both formats, per-layer completion, failure
handling and the shared load queue."""

import mmap
import os
import random
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_builders import ALL_KINDS, block_bytes, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import (
    ChunkLoad,
    ChunkStore,
    LoadHandle,
    TransferBackend,
    TransferError,
    TransferJob,
    TransferRequestError,
    create_engine,
)
from maru_connector.transfer.factory import BACKEND_CLASSES, backend_class
from maru_connector.transfer.plan import Run, layer_pieces, layer_runs, split_runs
from maru_core.keys import packed_layer_keys
from maru_core.storage_format import StorageFormat


def same_bytes(a, b):
    """Bitwise equality (random bytes hold NaNs, which ``torch.equal`` rejects)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class ShmPool:
    """A tmpfs file mapped shared, as the pool is."""

    def __init__(self, size: int):
        self.path = f"/dev/shm/maru-transfer-test-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buffer = memoryview(self.map)

    def close(self):
        self.buffer.release()
        self.map.close()
        os.unlink(self.path)


@pytest.fixture
def make_pool():
    pools = []

    def make(size):
        pools.append(ShmPool(size))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def engines(make_pool):  # engines close before their pools are unmapped
    made = []

    def make(*args, **kwargs):
        made.append(create_engine(*args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def place_objects(fmt, chunks, adjacent, rng, pool_size):
    """Pool offsets for every object of ``chunks`` chunks: packed back to back
    (so runs coalesce) or scattered with gaps (so they do not)."""
    size = fmt.object_bytes
    count = chunks * fmt.objects_per_chunk
    if adjacent:
        starts = [i * size for i in range(count)]
        if fmt.layerwise:  # chunk c's layer l next to chunk c+1's layer l
            starts = [(l * chunks + c) * size for c in range(chunks)
                      for l in range(fmt.num_layers)]
    else:
        slots = rng.sample(range(pool_size // size), count)
        starts = [s * size for s in slots]
    per = fmt.objects_per_chunk
    return [tuple(starts[c * per:(c + 1) * per]) for c in range(chunks)]


def round_trip(engines, pool, kind, layerwise, chunks, rng, adjacent, blocks=16,
               blocks_per_chunk=2, layers=3):
    src = make_kv_caches(kind, layers=layers, blocks=blocks, seed=rng.randrange(1 << 30))
    dst = make_kv_caches(kind, layers=layers, blocks=blocks, seed=rng.randrange(1 << 30))
    before = {n: t.clone() for n, t in dst.items()}
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, chunk_tokens=blocks_per_chunk * layout.block_size,
                       storage=StorageFormat.LAYERWISE if layerwise else StorageFormat.CHUNKWISE)
    need = chunks * fmt.blocks_per_chunk
    src_ids = rng.sample(range(blocks), need)
    dst_ids = rng.sample(range(blocks), need)
    offsets = place_objects(fmt, chunks, adjacent, rng, pool.map.size())
    per = fmt.blocks_per_chunk
    storer = engines(pool.buffer, src, fmt)
    loader = engines(pool.buffer, dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, layerwise))
    stored = storer.submit_store([
        ChunkStore(tuple(src_ids[c * per:(c + 1) * per]), offsets[c]) for c in range(chunks)
    ])
    assert stored.wait(10) and stored.error is None
    loaded = loader.submit_load([
        ChunkLoad(tuple(dst_ids[c * per:(c + 1) * per]), offsets[c]) for c in range(chunks)
    ])
    assert loaded.wait_all(10) and loaded.error is None and loaded.done()
    assert loaded.nbytes == need * layout.block_bytes_per_layer * layers
    moved = dict(zip(dst_ids, src_ids))
    for name in layout.layer_names:
        for b in range(blocks):
            want = block_bytes(kind, src[name], moved[b]) if b in moved \
                else block_bytes(kind, before[name], b)
            assert torch.equal(block_bytes(kind, dst[name], b), want), (name, b)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "scattered"])
def test_store_then_load_round_trips_exactly(engines, make_pool, kind, layerwise, adjacent):
    pool = make_pool(1 << 20)
    round_trip(engines, pool, kind, layerwise, chunks=3, rng=random.Random(kind),
               adjacent=adjacent)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(ALL_KINDS), layerwise=st.booleans(), adjacent=st.booleans(),
       chunks=st.integers(1, 5), blocks_per_chunk=st.integers(1, 3),
       seed=st.integers(0, 1 << 30))
def test_round_trip_property(engines, make_pool, kind, layerwise, adjacent, chunks,
                             blocks_per_chunk, seed):
    pool = make_pool(1 << 20)
    round_trip(engines, pool, kind, layerwise, chunks, random.Random(seed), adjacent,
               blocks=16, blocks_per_chunk=blocks_per_chunk, layers=2)


# --------------------------------------------------------------- coalescing

def fmt_of(layerwise, layers=4, blocks_per_chunk=2):
    layout = detect_kv_layout(make_kv_caches("cpu", layers=layers, blocks=8))
    return ObjectFormat(layout, blocks_per_chunk * layout.block_size, layerwise)


def test_adjacent_layerwise_objects_coalesce_into_one_plain_copy():
    fmt = fmt_of(layerwise=True)
    size = fmt.object_bytes
    offsets = [tuple((l * 3 + c) * size for l in range(4)) for c in range(3)]
    for layer in range(4):
        assert layer_runs(fmt, offsets, layer) == [Run(layer * 3 * size, size, 3, 0)]


def test_adjacent_chunkwise_objects_coalesce_into_one_strided_copy():
    fmt = fmt_of(layerwise=False)
    size = fmt.object_bytes
    offsets = [(c * size,) for c in range(3)]
    assert layer_runs(fmt, offsets, 2) == [Run(2 * fmt.layer_bytes, size, 3, 0)]


def test_scattered_objects_break_runs():
    fmt = fmt_of(layerwise=True, layers=1)
    size = fmt.object_bytes
    offsets = [(0,), (size,), (5 * size,), (3 * size,)]
    assert layer_runs(fmt, offsets, 0) == [
        Run(0, size, 2, 0), Run(5 * size, size, 1, 4), Run(3 * size, size, 1, 6)
    ]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), layerwise=st.booleans(), chunks=st.integers(1, 6), max_rows=st.integers(1, 4))
def test_layer_pieces_are_each_layers_own_runs(data, layerwise, chunks, max_rows):
    """Planned once and shifted, or layer by layer: the same pieces as
    coalescing each layer's extents on its own, for objects placed alike per
    chunk (as one store places them), side by side, or anywhere."""
    fmt = fmt_of(layerwise, layers=3)
    size, per = fmt.object_bytes, fmt.objects_per_chunk
    slots = st.integers(0, 40).map(lambda i: i * size)
    placement = data.draw(st.sampled_from(["alike", "anywhere"]))
    if placement == "alike":
        shifts = data.draw(st.lists(slots, min_size=per, max_size=per))
        bases = data.draw(st.lists(slots, min_size=chunks, max_size=chunks))
        offsets = [tuple(b + sh for sh in shifts) for b in bases]
    else:
        offsets = [tuple(data.draw(st.lists(slots, min_size=per, max_size=per)))
                   for _ in range(chunks)]
    want = [split_runs(layer_runs(fmt, offsets, layer), max_rows, fmt.blocks_per_chunk)
            for layer in range(fmt.num_layers)]
    assert list(layer_pieces(fmt, offsets, max_rows)) == want


def test_split_runs_respects_staging_rows():
    pieces = split_runs([Run(0, 10, 5, 0), Run(100, 10, 2, 10)], max_rows=3,
                        blocks_per_row=2)
    assert pieces == [
        [Run(0, 10, 3, 0)],
        [Run(30, 10, 2, 6), Run(100, 10, 1, 10)],
        [Run(110, 10, 1, 12)],
    ]


# ------------------------------------------------------- per-layer completion

def test_layer_events_fire_in_order_and_after_the_bytes_landed(engines, make_pool):
    layers, blocks = 24, 64
    src = make_kv_caches("cpu", layers=layers, blocks=blocks, heads=4, block_size=32,
                         head_size=64, seed=1)
    dst = make_kv_caches("cpu", layers=layers, blocks=blocks, heads=4, block_size=32,
                         head_size=64, seed=2)
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, 4 * layout.block_size, storage=StorageFormat.CHUNKWISE)
    chunks = blocks // 4
    pool = make_pool(chunks * fmt.object_bytes)
    ids = list(range(blocks))
    random.Random(3).shuffle(ids)
    plan = [(tuple(ids[c * 4:(c + 1) * 4]), (c * fmt.object_bytes,)) for c in range(chunks)]
    storer = engines(pool.buffer, src, fmt)
    assert storer.submit_store([ChunkStore(*p) for p in plan]).wait(30)
    loader = engines(pool.buffer, dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, False))
    handle = loader.submit_load([ChunkLoad(*p) for p in plan])
    names = layout.layer_names
    first_seen = []
    while len(first_seen) < layers:
        # Read the last layer first: a later read of an earlier layer must
        # then see it ready too, whatever lands in between.
        ready = [handle.layer_ready(i) for i in reversed(range(layers))][::-1]
        # Ready layers always form a prefix: layers complete in true order.
        assert ready == sorted(ready, reverse=True)
        for layer in range(len(first_seen), sum(ready)):
            assert same_bytes(dst[names[layer]], src[names[layer]]), layer
            first_seen.append(layer)
    assert first_seen == list(range(layers))
    assert handle.wait_all(5) and handle.done() and handle.elapsed_s is not None


def test_failed_copy_releases_every_waiter_with_an_error(engines, make_pool):
    kv = make_kv_caches("cpu", layers=6, blocks=8)
    fmt = ObjectFormat(detect_kv_layout(kv), 16, storage=StorageFormat.LAYERWISE)
    pool = make_pool(64 * fmt.object_bytes)
    engine = engines(pool.buffer, kv, fmt)
    sources = [i * fmt.object_bytes for i in range(6)]
    sources[2] = pool.map.size() - fmt.object_bytes // 2  # runs past the end of the pool
    handle = engine.submit_load([ChunkLoad((5,), tuple(sources))])
    waiters_done = []

    def wait(layer):
        waiters_done.append((layer, handle.wait_layer(layer)))

    threads = [threading.Thread(target=wait, args=(layer,)) for layer in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(waiters_done) == [(0, True), (1, True)] + [(i, False) for i in range(2, 6)]
    assert handle.wait_all(5) is False and handle.done()
    assert isinstance(handle.error, TransferError)
    assert "layer 2" in str(handle.error) and "outside" in str(handle.error)
    assert [handle.layer_ready(i) for i in range(6)] == [True, True] + [False] * 4
    # The engine goes on serving after a failure.
    good = engine.submit_load([ChunkLoad((5,), tuple(i * fmt.object_bytes for i in range(6)))])
    assert good.wait_all(5) and good.error is None


def test_failed_store_reports_an_error(engines, make_pool):
    kv = make_kv_caches("cpu", layers=2, blocks=8)
    fmt = ObjectFormat(detect_kv_layout(kv), 32, storage=StorageFormat.CHUNKWISE)
    pool = make_pool(2 * fmt.object_bytes)
    engine = engines(pool.buffer, kv, fmt)
    handle = engine.submit_store([ChunkStore((0, 1), (fmt.object_bytes + 1,))])
    assert handle.wait(5) is False and handle.done()
    assert isinstance(handle.error, TransferError)
    assert engine.submit_store([ChunkStore((0, 1), (0,))]).wait(5)


def test_wait_times_out_without_hanging(engines, make_pool):
    layers = 8
    kv = make_kv_caches("cpu", layers=layers, blocks=256, heads=8, block_size=32, head_size=128)
    fmt = ObjectFormat(detect_kv_layout(kv), 32 * 64, storage=StorageFormat.CHUNKWISE)
    pool = make_pool(4 * fmt.object_bytes)
    engine = engines(pool.buffer, kv, fmt)
    # Queue a lot of work; the last layer cannot have landed within 1 ms.
    handles = [engine.submit_load([ChunkLoad(tuple(range(64 * c, 64 * c + 64)),
                                            (c * fmt.object_bytes,)) for c in range(4)])
               for _ in range(3)]
    started = time.monotonic()
    assert handles[-1].wait_layer(layers - 1, timeout=0.001) is False
    assert time.monotonic() - started < 1
    assert all(h.wait_all(60) for h in handles)


# ----------------------------------------------------------- shared queue

def test_concurrent_loads_share_one_queue_in_submission_order(engines, make_pool):
    src = make_kv_caches("packed_lbnhc", layers=4, blocks=64, heads=2, block_size=16,
                         head_size=64, seed=5)
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, 4 * layout.block_size, storage=StorageFormat.LAYERWISE)
    pool = make_pool(16 * 4 * fmt.object_bytes)
    storer = engines(pool.buffer, src, fmt)
    plans = []
    for c in range(16):
        ids = tuple(range(4 * c, 4 * c + 4))
        offsets = tuple((c * 4 + l) * fmt.object_bytes for l in range(4))
        plans.append((ids, offsets))
    assert storer.submit_store([ChunkStore(*p) for p in plans]).wait(10)

    dst = make_kv_caches("packed_lbnhc", layers=4, blocks=64, heads=2, block_size=16,
                         head_size=64, seed=6)
    loader = engines(pool.buffer, dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, True))
    handles = [None] * 8
    barrier = threading.Barrier(8)

    def request(i):  # eight requests, each loading two chunks, at once
        barrier.wait()
        handles[i] = loader.submit_load([ChunkLoad(*plans[2 * i]), ChunkLoad(*plans[2 * i + 1])])

    threads = [threading.Thread(target=request, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(h.wait_all(10) for h in handles)
    for name in layout.layer_names:
        assert same_bytes(dst[name], src[name])
    # One copy thread serves every request: loads finish in queue order.
    order = sorted(range(8), key=lambda i: handles[i].finished_at)
    starts = sorted(range(8), key=lambda i: handles[i].submitted_at)
    assert order == starts
    load_threads = [t for t in threading.enumerate() if t.name == "maru-load"]
    assert len(load_threads) == 2  # one per engine: storer and loader


# -------------------------------------------------------------- bad input

def test_requests_that_do_not_fit_the_format_are_refused(engines, make_pool):
    kv = make_kv_caches("cpu", layers=2, blocks=8)
    fmt = ObjectFormat(detect_kv_layout(kv), 32, storage=StorageFormat.LAYERWISE)
    pool = make_pool(1 << 16)
    engine = engines(pool.buffer, kv, fmt)
    with pytest.raises(TransferRequestError, match="needs 2"):
        engine.submit_load([ChunkLoad((1,), (0, 4096))])
    with pytest.raises(TransferRequestError, match="2 object"):
        engine.submit_load([ChunkLoad((1, 2), (0,))])
    with pytest.raises(TransferRequestError, match="outside the KV cache's 8 blocks"):
        engine.submit_store([ChunkStore((1, 8), (0, 4096))])
    empty = engine.submit_load([])
    assert empty.done() and empty.wait_all(0)
    assert engine.submit_store([]).wait(0)


def test_create_checks_device_and_buffer(make_pool):
    kv = make_kv_caches("cpu", layers=2, blocks=8)
    fmt = ObjectFormat(detect_kv_layout(kv), 32, storage=StorageFormat.CHUNKWISE)
    pool = make_pool(1 << 16)
    with pytest.raises(ValueError, match="KV cache is on the CPU"):
        create_engine(pool.buffer, kv, fmt, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        create_engine(pool.buffer, kv, fmt, device="tpu")
    with pytest.raises(ValueError, match="read-only"):
        create_engine(memoryview(bytes(1 << 16)), kv, fmt)
    engine = create_engine(pool.buffer, kv, fmt)
    assert engine.backend == "cpu"
    engine.close()
    with pytest.raises(TransferError, match="closed"):
        engine.submit_load([ChunkLoad((0, 1), (0,))])
    assert not any(t.is_alive() for t in engine._threads)


class _RecordedHead:
    def __init__(self):
        self.dropped = 0

    def claim(self, sources):
        raise AssertionError("the CPU backend has no head starts to claim")

    def drop(self):
        self.dropped += 1


def test_the_cpu_backend_starts_no_head_and_drops_one_handed_to_it(engines, make_pool):
    """Head starts are a CUDA backend's (test_head_start_cuda.py); on the CPU
    a load copies everything itself and lets go of a head it was given."""
    pool = make_pool(1 << 20)
    kv = make_kv_caches("flash_nhd", layers=2, blocks=8, seed=1)
    fmt = ObjectFormat(detect_kv_layout(kv), chunk_tokens=32, storage=StorageFormat.CHUNKWISE)
    engine = engines(pool.buffer, kv, fmt)
    assert engine.start_head([(0,)]) is None
    head = _RecordedHead()
    loaded = engine.submit_load([ChunkLoad((0, 1), (0,))], head=head)
    assert loaded.wait_all(10) and loaded.error is None
    assert head.dropped == 1 and not loaded.head_start


def test_a_load_that_claims_its_head_says_so_on_its_handle(engines, make_pool):
    """``LoadHandle.head_start`` (what the head-start metric counts) is set
    exactly when the backend claimed the head for the load."""
    pool = make_pool(1 << 20)
    kv = make_kv_caches("flash_nhd", layers=2, blocks=8, seed=1)
    fmt = ObjectFormat(detect_kv_layout(kv), chunk_tokens=32, storage=StorageFormat.CHUNKWISE)
    engine = engines(pool.buffer, kv, fmt)
    claimed = []
    engine._claim_head = lambda head, job: claimed.append(head) or head  # as CUDA's, for matching sources
    loaded = engine.submit_load([ChunkLoad((0, 1), (0,))], head=_RecordedHead())
    assert loaded.wait_all(10) and loaded.error is None
    assert loaded.head_start and len(claimed) == 1
    plain = engine.submit_load([ChunkLoad((2, 3), (0,))])
    assert plain.wait_all(10) and not plain.head_start


# ------------------------------------------------------------- backend seam
def test_the_engine_base_imports_no_backend_and_the_backends_import_it():
    """The factory imports a backend by its kind; the base and the seam module
    import none, so no module of the engine and its backends imports another
    that imports it back."""
    import grimp

    graph = grimp.build_graph("maru_connector")
    for backend in ("cpu", "cuda"):
        module = f"maru_connector.transfer.{backend}"
        for base in ("maru_connector.transfer.engine", "maru_connector.transfer.backend"):
            assert graph.find_shortest_chain(importer=base, imported=module) is None, (base, module)
        assert graph.find_shortest_chain(importer=module, imported="maru_connector.transfer.engine")
    transfer = [m for m in graph.modules if m.startswith("maru_connector.transfer")]
    cycles = [(a, b) for a in transfer for b in transfer if a < b
              and graph.find_shortest_chain(importer=a, imported=b)
              and graph.find_shortest_chain(importer=b, imported=a)]
    assert cycles == []


def test_a_cpu_engine_is_built_without_importing_the_cuda_backend():
    code = (
        "import sys\n"
        "from kv_builders import make_kv_caches\n"
        "from maru_connector.transfer import TransferBackend, TransferEngine, create_engine\n"
        "kv = make_kv_caches('cpu', layers=2, blocks=8)\n"
        "buf = memoryview(bytearray(1 << 16))\n"
        "engine = create_engine(buf, kv, TransferEngine.detect(kv, 32, False), prefault=False)\n"
        "assert engine.backend is TransferBackend.CPU, engine.backend\n"
        "engine.close()\n"
        "assert 'maru_connector.transfer.cpu' in sys.modules\n"
        "assert 'maru_connector.transfer.cuda' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_the_backend_is_chosen_by_its_kind():
    assert TransferBackend.for_device("auto", on_cuda=False) is TransferBackend.CPU
    assert TransferBackend.for_device("auto", on_cuda=True) is TransferBackend.CUDA
    assert TransferBackend.for_device("cuda", on_cuda=True) is TransferBackend.CUDA
    assert TransferBackend.for_device(TransferBackend.CPU, on_cuda=False) is TransferBackend.CPU
    with pytest.raises(ValueError, match=r"device must be 'auto', 'cpu' or 'cuda', not 'tpu'"):
        TransferBackend.for_device("tpu", on_cuda=False)
    with pytest.raises(ValueError, match="KV cache is on a CUDA device"):
        TransferBackend.for_device("cpu", on_cuda=True)
    for kind in TransferBackend:  # every kind names an engine class of that kind
        module, name = BACKEND_CLASSES[kind]
        assert module.startswith("maru_connector.transfer.") and name.endswith("TransferEngine")
    assert backend_class(TransferBackend.CPU).backend is TransferBackend.CPU


def test_the_job_record_holds_every_field_a_backend_sets_and_nothing_else():
    job = TransferJob(LoadHandle(2, 0), [0, 1], [(0,)])
    assert (job.check, job.head, job.rest, job.ready, job.host_ids, job.check_state) == (None,) * 6
    assert not job.issue_failed and not job.beside_long_forward
    job.check_state = [0]  # a backend's own state goes in its field
    with pytest.raises(AttributeError):
        job.scratch = 1  # not an attribute of the backend's own making


# ----------------------------------------------------------- format seam
class PairwiseFormat:
    """A format the product does not have: two layers per object. The engine
    must move and verify it from the strategy alone."""

    storage = StorageFormat.CHUNKWISE  # stands in for a new enum value
    slot_format = None

    def objects_per_chunk(self, num_layers):
        assert num_layers % 2 == 0
        return num_layers // 2

    def layer_place(self, layer, layer_bytes):
        return layer // 2, (layer % 2) * layer_bytes

    def object_keys(self, chunk_keys, layers):
        return packed_layer_keys(chunk_keys, layers[::2])  # a pair is keyed by its first layer

    def describe(self, chunk, obj):
        return f"pair {obj} of chunk {chunk} of the load"


@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "scattered"])
def test_a_third_format_round_trips_and_verifies_through_its_strategy_alone(engines, make_pool, monkeypatch,
                                                                             adjacent):
    from maru_connector import formats
    from maru_connector.transfer import ChecksumMismatch, PayloadCheck

    monkeypatch.setitem(formats.STRATEGIES, StorageFormat.CHUNKWISE, PairwiseFormat())
    rng = random.Random(f"pairs{adjacent}")
    layers, blocks, bpc, chunks = 4, 16, 2, 3
    src = make_kv_caches("flash_hnd", layers=layers, blocks=blocks, seed=1)
    dst = make_kv_caches("flash_hnd", layers=layers, blocks=blocks, seed=2)
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, bpc * layout.block_size, StorageFormat.CHUNKWISE)
    assert fmt.objects_per_chunk == 2 and fmt.object_bytes == 2 * fmt.layer_bytes
    assert [tuple(fmt.objects_due(2, layer)) for layer in range(layers)] == [(), (0, 2), (), (1, 3)]
    pool = make_pool(1 << 20)
    offsets = place_objects(fmt, chunks, adjacent, rng, pool.map.size())
    src_ids, dst_ids = rng.sample(range(blocks), chunks * bpc), rng.sample(range(blocks), chunks * bpc)
    stored = engines(pool.buffer, src, fmt).submit_store(
        [ChunkStore(tuple(src_ids[c * bpc:(c + 1) * bpc]), offsets[c]) for c in range(chunks)])
    assert stored.wait(10) and stored.error is None and len(stored.checksums) == chunks * 2
    loader = engines(pool.buffer, dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, StorageFormat.CHUNKWISE))
    load = [ChunkLoad(tuple(dst_ids[c * bpc:(c + 1) * bpc]), offsets[c]) for c in range(chunks)]
    handle = loader.submit_load(load, check=PayloadCheck.of(stored.checksums))
    assert handle.wait_all(10) and handle.error is None
    for name in layout.layer_names:
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(block_bytes("flash_hnd", dst[name], d), block_bytes("flash_hnd", src[name], s))
    # A flipped byte in layer 3 of chunk 1 is pair 1 of chunk 1: layers 0-2 land, layer 3 never.
    at = fmt.layer_source(offsets[1], 3) + 5
    pool.buffer[at] ^= 0x01
    handle = loader.submit_load(load, check=PayloadCheck.of(stored.checksums))
    assert not handle.wait_all(10) and isinstance(handle.error, ChecksumMismatch)
    assert "pair 1 of chunk 1 of the load" in str(handle.error)
    assert [handle.wait_layer(i, timeout=10) for i in range(layers)] == [True, True, True, False]
