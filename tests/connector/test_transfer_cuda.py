"""The transfer engine's CUDA backend: registered pool, shared load stream,
staging + scatter. Skipped where no CUDA device is present (CI); run on a GPU
machine, see bench/RESULTS.md."""

import mmap
import os
import random
import threading
import uuid

import pytest
import torch

from kv_builders import ALL_KINDS, block_bytes, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChunkLoad, ChunkStore, TransferError, create_engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; passed on an H200, recorded in bench/RESULTS.md (CUDA tests)"),
]


class ShmPool:
    def __init__(self, size):
        self.path = f"/dev/shm/maru-cuda-test-{uuid.uuid4().hex}"
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
def pool():
    p = ShmPool(32 << 20)
    yield p
    p.close()


@pytest.fixture
def engines(pool):
    made = []

    def make(kv, fmt, **options):
        made.append(create_engine(pool.buffer, kv, fmt, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _plan(fmt, chunks, rng, adjacent, pool_size):
    size, per = fmt.object_bytes, fmt.objects_per_chunk
    count = chunks * per
    if adjacent:
        starts = [i * size for i in range(count)]
        if fmt.layerwise:
            starts = [(l * chunks + c) * size for c in range(chunks) for l in range(per)]
    else:
        starts = [s * size for s in rng.sample(range(pool_size // size), count)]
    return [tuple(starts[c * per:(c + 1) * per]) for c in range(chunks)]


def _round_trip(engines, pool, kind, layerwise, adjacent, src_device="cuda", beside_long_forward=False,
                **options):
    rng = random.Random(f"{kind}{layerwise}{adjacent}")
    blocks, chunks, bpc = 24, 4, 2
    src = make_kv_caches(kind, layers=3, blocks=blocks, seed=1, device=src_device)
    dst = make_kv_caches(kind, layers=3, blocks=blocks, seed=2, device="cuda")
    before = {n: t.clone() for n, t in dst.items()}
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, bpc * layout.block_size, layerwise)
    src_ids = rng.sample(range(blocks), chunks * bpc)
    dst_ids = rng.sample(range(blocks), chunks * bpc)
    offsets = _plan(fmt, chunks, rng, adjacent, pool.map.size())
    storer = engines(src, fmt, **options)
    assert storer.backend == src_device
    st = storer.submit_store([ChunkStore(tuple(src_ids[c * bpc:(c + 1) * bpc]), offsets[c])
                              for c in range(chunks)])
    assert st.wait(30), st.error
    loader = engines(dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, layerwise),
                     **options)
    assert loader.backend == "cuda"
    h = loader.submit_load([ChunkLoad(tuple(dst_ids[c * bpc:(c + 1) * bpc]), offsets[c])
                            for c in range(chunks)], beside_long_forward=beside_long_forward)
    assert h.wait_all(30) and h.error is None and h.done()
    moved = dict(zip(dst_ids, src_ids))
    for name in layout.layer_names:
        for b in range(blocks):
            want = block_bytes(kind, src[name], moved[b]) if b in moved \
                else block_bytes(kind, before[name], b)
            assert torch.equal(block_bytes(kind, dst[name], b), want), (name, b)
    return loader


# Where a load is issued: all of it on the submitting thread, its first fill
# there and the rest on the copy thread (for its size, or because a long
# forward follows), or all of it on the copy thread.
ISSUE_PATHS = {
    "inline": {"inline_load_bytes": 1 << 30},
    "split": {"inline_load_bytes": 0, "inline_head_fills": 1},
    "split_beside_forward": {"inline_load_bytes": 1 << 30, "inline_head_fills": 1, "beside_long_forward": True},
    "copy_thread": {"inline_load_bytes": 0, "inline_head_fills": 0},
}


def _issue_options(issue: str) -> tuple[dict, dict]:
    """(engine options, submit_load options) of an issue path."""
    options = dict(ISSUE_PATHS[issue])
    return options, {"beside_long_forward": options.pop("beside_long_forward", False)}


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "scattered"])
@pytest.mark.parametrize("issue", list(ISSUE_PATHS))
def test_round_trip_on_gpu(engines, pool, kind, layerwise, adjacent, issue):
    _round_trip(engines, pool, kind, layerwise, adjacent, **ISSUE_PATHS[issue])


def test_a_load_issued_on_the_caller_s_thread_leaves_its_stream_and_device_alone(engines,
                                                                                pool):
    kv = make_kv_caches("packed_lbnhc", layers=2, blocks=8, seed=3, device="cuda")
    layout = detect_kv_layout(kv)
    fmt = ObjectFormat(layout, 2 * layout.block_size, False)
    engine = engines(kv, fmt)
    mine = torch.cuda.Stream()
    with torch.cuda.stream(mine):
        handle = engine.submit_load([ChunkLoad((0, 1), (0,))])
        assert handle.issued_at is not None  # issued before submit_load returned
        assert torch.cuda.current_stream() == mine
    assert handle.wait_all(30) and handle.error is None
    engine._inline_load_bytes = engine._inline_head_fills = 0  # now all on the copy thread
    queued = engine.submit_load([ChunkLoad((2, 3), (0,))])
    # issue_started_at, not issued_at: the copy thread stamps issued_at after
    # recording the last layer's event, which a small load may pass first.
    assert queued.wait_all(30) and queued.error is None and queued.issue_started_at is not None
    assert torch.equal(engine.block_views[0][2], engine.block_views[0][0])


def test_a_load_beside_a_long_forward_leaves_all_but_its_head_to_the_copy_thread(engines, pool):
    """A small load is issued whole on the submitting thread, unless the
    caller's forward computes much beside it: then only its first fills."""
    kv = make_kv_caches("packed_lbnhc", layers=8, blocks=8, seed=3, device="cuda")
    engine = engines(kv, ObjectFormat(detect_kv_layout(kv), 2 * detect_kv_layout(kv).block_size, False),
                     inline_head_fills=1)
    threads = []
    issue_fills = engine._issue_fills

    def recording(job):
        for fill in issue_fills(job):
            threads.append(threading.current_thread().name)
            yield fill

    engine._issue_fills = recording
    alone = engine.submit_load([ChunkLoad((0, 1), (0,))])
    assert alone.wait_all(30) and alone.error is None
    assert len(threads) > 1 and set(threads) == {threading.current_thread().name}
    threads.clear()
    beside = engine.submit_load([ChunkLoad((2, 3), (0,))], beside_long_forward=True)
    assert beside.wait_all(30) and beside.error is None
    assert threads[0] == threading.current_thread().name and set(threads[1:]) == {"maru-load"}
    assert all(torch.equal(v[2], v[0]) and torch.equal(v[3], v[1]) for v in engine.block_views)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_objects_written_on_cpu_load_on_gpu(engines, pool, layerwise):
    """Same object bytes on both backends: a CPU instance's store is a GPU
    instance's hit."""
    _round_trip(engines, pool, "cpu", layerwise, adjacent=True, src_device="cpu")


@pytest.mark.parametrize("copy_2d", [True, False], ids=["2d", "rows"])
def test_small_staging_splits_pieces_and_both_copy_paths(engines, pool, copy_2d):
    layout = detect_kv_layout(make_kv_caches("flash_hnd", layers=3, blocks=24))
    row = ObjectFormat(layout, 2 * layout.block_size, False).layer_bytes
    # Two chunk rows per staging buffer: each layer takes two pieces (both
    # buffers in turn), each a strided 2-D run of two rows.
    loader = _round_trip(engines, pool, "flash_hnd", False, True, staging_bytes=2 * row,
                         copy_2d=copy_2d)
    assert loader._rows_cap == 2
    assert (loader.copy_2d_backend != "rows") == copy_2d


def test_pool_is_registered_once_and_released(pool):
    kv = make_kv_caches("cpu", layers=2, blocks=8, device="cuda")
    fmt = ObjectFormat(detect_kv_layout(kv), 32, False)
    engine = create_engine(pool.buffer, kv, fmt)
    assert engine._registered and engine.pool.is_pinned()
    second = create_engine(pool.buffer, kv, fmt)
    assert not second._registered  # the first engine owns the registration
    second.close()
    assert engine.pool.is_pinned()
    view = engine.pool
    engine.close()
    assert not view.is_pinned()


def test_layers_land_in_order_and_device_wait_orders_the_stream(engines, pool):
    layers, blocks = 16, 64
    src = make_kv_caches("packed_lbnhc", layers=layers, blocks=blocks, heads=4, block_size=16,
                         head_size=64, seed=3, device="cuda")
    dst = make_kv_caches("packed_lbnhc", layers=layers, blocks=blocks, heads=4, block_size=16,
                         head_size=64, seed=4, device="cuda")
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, 4 * layout.block_size, False)
    chunks = blocks // 4
    assert chunks * fmt.object_bytes <= pool.map.size()
    ids = list(range(blocks))
    random.Random(5).shuffle(ids)
    plan = [(tuple(ids[c * 4:(c + 1) * 4]), (c * fmt.object_bytes,)) for c in range(chunks)]
    assert engines(src, fmt).submit_store([ChunkStore(*p) for p in plan]).wait(30)
    loader = engines(dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, False))
    handle = loader.submit_load([ChunkLoad(*p) for p in plan])
    names = layout.layer_names
    seen = 0
    while seen < layers:
        ready = [handle.layer_ready(i) for i in reversed(range(layers))][::-1]
        assert ready == sorted(ready, reverse=True)
        seen = sum(ready)
    for layer in range(layers):
        assert handle.wait_layer_on_device(layer, timeout=30)
        copy = dst[names[layer]].clone()  # queued on the current stream, after the wait
        torch.cuda.current_stream().synchronize()
        assert same_bytes(copy, src[names[layer]])


@pytest.mark.parametrize("bad", [1, 2])
def test_failed_copy_releases_waiters(engines, pool, bad):
    # Layer 1 alone, then layers 1-2 as one group (small layers load in
    # groups of 1, 2, 4, ...): the layers before the bad one still land.
    kv = make_kv_caches("cpu", layers=4, blocks=8, device="cuda")
    fmt = ObjectFormat(detect_kv_layout(kv), 16, True)
    engine = engines(kv, fmt)
    sources = [i * fmt.object_bytes for i in range(4)]
    sources[bad] = pool.map.size()  # past the end of the pool
    handle = engine.submit_load([ChunkLoad((3,), tuple(sources))])
    results = {}
    threads = [threading.Thread(target=lambda l=l: results.__setitem__(l, handle.wait_layer(l)))
               for l in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {layer: layer < bad for layer in range(4)}
    assert isinstance(handle.error, TransferError) and handle.done()
    good = engine.submit_load([ChunkLoad((3,), tuple(i * fmt.object_bytes for i in range(4)))])
    assert good.wait_all(30)


@pytest.mark.parametrize("issue", list(ISSUE_PATHS))
def test_eight_concurrent_loads_share_the_load_stream(engines, pool, issue):
    src = make_kv_caches("cpu", layers=4, blocks=64, seed=7, device="cuda")
    dst = make_kv_caches("cpu", layers=4, blocks=64, seed=8, device="cuda")
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, 4 * layout.block_size, True)
    plans = [(tuple(range(4 * c, 4 * c + 4)),
              tuple((c * 4 + l) * fmt.object_bytes for l in range(4))) for c in range(16)]
    assert engines(src, fmt).submit_store([ChunkStore(*p) for p in plans]).wait(30)
    engine_options, submit_options = _issue_options(issue)
    loader = engines(dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, True), **engine_options)
    handles = [None] * 8
    barrier = threading.Barrier(8)

    def request(i):
        barrier.wait()
        handles[i] = loader.submit_load([ChunkLoad(*plans[2 * i]), ChunkLoad(*plans[2 * i + 1])],
                                        **submit_options)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(h.wait_all(30) for h in handles)
    for name in layout.layer_names:
        assert same_bytes(dst[name], src[name])
    streams = {loader.load_stream.cuda_stream, loader.scatter_stream.cuda_stream}
    assert len(streams) == 2
