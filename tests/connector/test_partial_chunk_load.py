"""A load that begins inside its first chunk: vLLM's own prefix cache holds
that chunk's first blocks, named ``SKIP_BLOCK`` in the load. The engines
verify the whole object (CPU: the skipped head summed where it lies in the
pool; CUDA: the whole object staged and summed, the head not scattered),
write only the blocks after it, and leave every other block untouched; a
corrupted byte in the skipped head fails the load. The CUDA engine's
staging and scatters also run here on host memory, in every staging shape.

A load may also end inside its last chunk (a block alias named only that
chunk's first blocks): the blocks after it are likewise verified with their
object and not written, in every staging shape of the CUDA engine too.

The ``cuda`` cases need an NVIDIA GPU (``bench/verify_h200.sh`` runs them).
"""

from __future__ import annotations

import random

import pytest
import torch

from kv_builders import ALL_KINDS, block_bytes, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import (
    ChecksumMismatch,
    ChunkLoad,
    ChunkStore,
    PayloadCheck,
    TransferRequestError,
)
from maru_connector.transfer.plan import SKIP_BLOCK
from test_transfer_cuda import engines, pool  # noqa: F401 (fixtures)

ON_GPU = [pytest.mark.cuda,
          pytest.mark.skipif(not torch.cuda.is_available(), reason=(
              "needs an NVIDIA GPU; passed on an H100, recorded in bench/RESULTS.md (CUDA tests)"))]
CUDA = pytest.param("cuda", marks=ON_GPU)
DEVICES = ["cpu", CUDA]
# how the CUDA engine issues and stages the load: every path its scatters take
ISSUE = {"inline": {}, "copy_thread": {"inline_load_bytes": 0, "inline_head_fills": 0},
         "small_staging": {"staging_bytes": 0}, "layer_by_layer": {"copy_2d": False}}
DEVICE_ISSUES = [("cpu", "inline"), *(pytest.param("cuda", issue, marks=ON_GPU) for issue in ISSUE)]
BPC, CHUNKS, LAYERS, BLOCKS = 4, 3, 3, 32


def _stored(engines, pool, device, kind, layerwise, adjacent):
    """CHUNKS chunks stored from random blocks: (fmt, offsets, source KV, source ids, checksums)."""
    rng = random.Random(f"{kind}{layerwise}{device}{adjacent}")
    src = make_kv_caches(kind, layers=LAYERS, blocks=BLOCKS, seed=1, device=device)
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, BPC * layout.block_size, layerwise)
    size, per = fmt.object_bytes, fmt.objects_per_chunk
    slots = (list(range(3, 3 + CHUNKS * per)) if adjacent
             else rng.sample(range(pool.map.size() // size), CHUNKS * per))
    offsets = [tuple(slots[c * per + i] * size for i in range(per)) for c in range(CHUNKS)]
    src_ids = rng.sample(range(BLOCKS), CHUNKS * BPC)
    handle = engines(src, fmt).submit_store(
        [ChunkStore(tuple(src_ids[c * BPC:(c + 1) * BPC]), offsets[c]) for c in range(CHUNKS)])
    assert handle.wait(30), handle.error
    return fmt, offsets, src, src_ids, handle.checksums


def _load_chunks(dst_ids, offsets, skip):
    ids = [SKIP_BLOCK] * skip + dst_ids[skip:]
    return [ChunkLoad(tuple(ids[c * BPC:(c + 1) * BPC]), offsets[c]) for c in range(CHUNKS)]


def _loader(engines, fmt, device, **options):
    dst = make_kv_caches(fmt.layout.kind, layers=LAYERS, blocks=BLOCKS, seed=2, device=device)
    return engines(dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, fmt.layerwise), **options), dst


def _assert_only_written(fmt, kind, dst, src, before, written, *context):
    """Blocks ``written`` (destination -> source block) hold the stored KV of
    their source; every other block of ``dst`` is as it was (``before``)."""
    for name in fmt.layout.layer_names:
        for block in range(BLOCKS):
            want = src[name] if block in written else before[name]
            assert torch.equal(block_bytes(kind, dst[name], block),
                               block_bytes(kind, want, written.get(block, block))), (*context, name, block)


@pytest.mark.parametrize("device, issue", DEVICE_ISSUES)
@pytest.mark.parametrize("kind", ["cpu", "flash_hnd", "packed_lhbnc"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [False, True], ids=["scattered", "adjacent"])
@pytest.mark.parametrize("skip", [1, BPC - 1])
@pytest.mark.parametrize("verified", [True, False], ids=["verified", "unverified"])
def test_a_load_from_inside_its_first_chunk_writes_only_the_blocks_after_the_skipped_head(
        engines, pool, device, issue, kind, layerwise, adjacent, skip, verified):
    fmt, offsets, src, src_ids, checksums = _stored(engines, pool, device, kind, layerwise, adjacent)
    loader, dst = _loader(engines, fmt, device, **({} if device == "cpu" else ISSUE[issue]))
    before = {name: dst[name].clone() for name in fmt.layout.layer_names}
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    handle = loader.submit_load(_load_chunks(dst_ids, offsets, skip),
                                check=PayloadCheck.of(checksums) if verified else None)
    assert handle.wait_all(30) and handle.error is None and handle.done()
    written = dict(zip(dst_ids[skip:], src_ids[skip:]))
    assert handle.nbytes == len(written) * fmt.layout.block_bytes_per_layer * LAYERS
    _assert_only_written(fmt, kind, dst, src, before, written)


@pytest.mark.parametrize("device, issue", DEVICE_ISSUES)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_a_corrupted_byte_in_the_skipped_head_fails_the_verified_load(
        engines, pool, device, issue, layerwise, layer):
    fmt, offsets, _, _, checksums = _stored(engines, pool, device, "flash_hnd", layerwise, adjacent=False)
    skip = 2
    block = fmt.layout.block_bytes_per_layer
    pool.buffer[fmt.layer_source(offsets[0], layer) + block + block // 2] ^= 0x01  # in skipped block 1
    loader, _ = _loader(engines, fmt, device, **({} if device == "cpu" else ISSUE[issue]))
    handle = loader.submit_load(_load_chunks(list(range(CHUNKS * BPC)), offsets, skip),
                                check=PayloadCheck.of(checksums))
    due = layer if layerwise else LAYERS - 1  # a chunkwise object is checked whole, by the last layer
    handed = [handle.wait_layer_on_device(i, timeout=30) for i in range(LAYERS)]
    assert not handed[due]  # the forward never gets the layer of the corrupted object
    assert handle.wait_all(30) is False and isinstance(handle.error, ChecksumMismatch)


@pytest.mark.parametrize("device", DEVICES)
def test_a_head_start_s_fills_of_a_partial_first_chunk_are_verified_and_scattered_from_the_skip_on(
        engines, pool, device):
    """A head start (the CUDA engine's; none on the CPU) copies the load's
    first fills before its blocks exist; its scatters skip the head too."""
    fmt, offsets, src, src_ids, checksums = _stored(engines, pool, device, "flash_hnd", False, adjacent=True)
    loader, dst = _loader(engines, fmt, device)
    before = dst[fmt.layout.layer_names[0]].clone()
    head = loader.start_head(offsets)
    assert (head is not None) == (device == "cuda")
    dst_ids = list(range(CHUNKS * BPC))
    handle = loader.submit_load(_load_chunks(dst_ids, offsets, 1), head=head, check=PayloadCheck.of(checksums))
    assert handle.wait_all(30) and handle.error is None and handle.head_start == (device == "cuda")
    for name in fmt.layout.layer_names:
        assert torch.equal(block_bytes("flash_hnd", dst[name], 1), block_bytes("flash_hnd", src[name], src_ids[1]))
    name = fmt.layout.layer_names[0]
    assert torch.equal(block_bytes("flash_hnd", dst[name], 0), block_bytes("flash_hnd", before, 0))


def _host_cuda_engine(pool, dst, fmt, rows_cap: int, copy_2d: bool):
    """The CUDA engine's staging and scatters on host memory (its copy calls
    done with memmove, its streams and events stand-ins), so each way it
    stages a fill (one layer, a group layer-major, wide chunk-major rows) is
    scattered here as on the GPU."""
    from types import SimpleNamespace

    from maru_connector.transfer import cuda
    from test_verified_transfer import _fills_engine

    engine = _fills_engine(pool, fmt, rows_cap, copy_2d)
    engine.block_views = [fmt.layout.block_view(dst[name]) for name in fmt.layout.layer_names]
    engine._views, engine._head_buffer = {}, None
    engine._elem = cuda._widest_element(engine.block_views, fmt.layout.layer_stride_bytes)
    engine._wide_views = [v.view(engine._elem) for v in engine.block_views]
    engine._stacked = {} if cuda._evenly_spaced(engine.block_views, fmt.layout.layer_stride_bytes) else None
    engine.scatter_stream = SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
    engine._event = lambda: SimpleNamespace(record=lambda stream: None, query=lambda: True)
    engine._staging = SimpleNamespace(freed=lambda offset, event: None)
    return engine


@pytest.mark.parametrize("kind", ["cpu", "flash_hnd"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [False, True], ids=["scattered", "adjacent"])
@pytest.mark.parametrize("rows_cap", [1, 64])
@pytest.mark.parametrize("copy_2d", [True, False], ids=["2d", "rows"])
@pytest.mark.parametrize("skip, tail", [(1, 0), (BPC - 1, 0), (0, 1), (0, BPC - 1), (1, 2)])
def test_the_cuda_engine_s_scatters_leave_the_skipped_blocks_out_in_every_staging_shape(
        engines, pool, kind, layerwise, adjacent, rows_cap, copy_2d, skip, tail):
    from types import SimpleNamespace

    from maru_connector.transfer import LoadHandle
    from maru_connector.transfer.plan import layer_pieces

    fmt, offsets, src, src_ids, _ = _stored(engines, pool, "cpu", kind, layerwise, adjacent)
    dst = make_kv_caches(kind, layers=LAYERS, blocks=BLOCKS, seed=2)
    before = {name: dst[name].clone() for name in fmt.layout.layer_names}
    engine = _host_cuda_engine(pool, dst, fmt, rows_cap, copy_2d)
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    end = CHUNKS * BPC - tail
    ids = [SKIP_BLOCK] * skip + dst_ids[skip:end] + [SKIP_BLOCK] * tail
    job = SimpleNamespace(check=None, block_ids=ids, handle=LoadHandle(LAYERS, 0))
    staging = torch.empty(64 * fmt.layer_bytes * LAYERS, dtype=torch.uint8)
    shapes = set()
    for unit in engine._units(layer_pieces(fmt, [tuple(o) for o in offsets], rows_cap)):
        copied = engine._copy_unit(unit, 0, staging)
        shapes.add("wide" if copied[3] else f"{len(unit[0])} layer(s)")
        engine._scatter_unit(job, torch.tensor(ids), unit, copied)
    assert all(job.handle.layer_ready(i) for i in range(LAYERS))
    if rows_cap == 64 and adjacent and kind == "flash_hnd":  # evenly spaced layers: grouped fills
        assert shapes & {"wide", "2 layer(s)"}, shapes
    _assert_only_written(fmt, kind, dst, src, before, dict(zip(dst_ids[skip:end], src_ids[skip:end])), shapes)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("whole", [False, True], ids=["batches-shrink-at-the-end", "one-batch"])
@pytest.mark.parametrize("scatter_batches, beside_long_forward",
                         [(True, False), (False, False), (True, True)],
                         ids=["a-scatter-a-batch", "a-scatter-a-fill", "beside-a-long-forward"])
def test_a_verified_load_s_sum_batches_check_the_layers_they_complete(engines, pool, monkeypatch, layerwise, whole,
                                                                      scatter_batches, beside_long_forward):
    """A verified load's fills of single layers, summed a batch at a time
    (``_joins``) and scattered on the host,
    a batch in one scatter of its layers (``SCATTER_BATCHES``, unless the
    load is beside a long forward) or a scatter per fill: every block lands;
    layerwise, a batch's comparison is the check of each layer in it;
    chunkwise, of the last layer, and of every layer scattered with it; an
    object whose recorded checksum differs raises the flag of the check that
    covers it, and no other."""
    from collections import deque
    from types import SimpleNamespace

    from maru_connector.transfer import LoadHandle
    from maru_connector.transfer import cuda as cuda_engine
    from maru_connector.transfer.plan import layer_pieces

    monkeypatch.setattr(cuda_engine, "GROUP_BELOW_BYTES", 0)  # a layer a fill, as large layers are
    monkeypatch.setattr(cuda_engine, "SCATTER_BATCHES", scatter_batches)
    fmt, offsets, src, src_ids, checksums = _stored(engines, pool, "cpu", "flash_hnd", layerwise, True)
    dst = make_kv_caches("flash_hnd", layers=LAYERS, blocks=BLOCKS, seed=2)
    before = {name: dst[name].clone() for name in fmt.layout.layer_names}
    engine = _host_cuda_engine(pool, dst, fmt, 64, True)
    assert engine._stacked is not None  # evenly spaced layers: a batch can be one scatter
    scatters = []
    scatter_unit = engine._scatter_unit
    engine._scatter_unit = lambda job, ids, unit, *rest, **kw: (scatters.append(unit[0]),
                                                                 scatter_unit(job, ids, unit, *rest, **kw))
    staging = torch.empty(64 * fmt.layer_bytes * LAYERS, dtype=torch.uint8)
    engine._staging = SimpleNamespace(buffer=staging, freed=lambda offset, event: None)
    engine._compare_counter = torch.zeros(1, dtype=torch.int32)
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    n = len(checksums)
    expected = torch.tensor([c - (1 << 64) if c >= 1 << 63 else c for c in checksums], dtype=torch.int64)
    expected[n - 1] += 1  # the last object: the last chunk (chunkwise), its last layer (layerwise)
    flags = torch.full((LAYERS,), 7, dtype=torch.int32)
    job = SimpleNamespace(check=True, block_ids=dst_ids, handle=LoadHandle(LAYERS, 0),
                          beside_long_forward=beside_long_forward,
                          check_state=[torch.zeros(n, dtype=torch.int64), expected, torch.ones(n, dtype=torch.int64),
                                       flags, 0])
    fills, at = [], 0
    for unit in engine._units(layer_pieces(fmt, [tuple(o) for o in offsets], 64)):
        fills.append((unit, engine._copy_unit(unit, at, staging)))
        at += fills[-1][1][1]
    pending: deque = deque()
    sizes, left = [], at
    for fill in fills:  # as _issue_fills does
        pending.append(fill)
        left -= fill[1][1]
        if len(pending) > 1 and not engine._joins(job, pending, 1 << 62 if whole else left):
            sizes.append(len(pending) - 1)
            engine._scatter_fills(job, torch.tensor(dst_ids), [pending.popleft() for _ in range(len(pending) - 1)])
    sizes.append(len(pending))
    engine._scatter_fills(job, torch.tensor(dst_ids), list(pending))
    assert LAYERS == 3 and sizes == ([LAYERS] if whole else [1] * LAYERS)
    one_scatter = whole and scatter_batches and not beside_long_forward
    assert scatters == ([list(range(LAYERS))] if one_scatter else [[i] for i in range(LAYERS)])
    _assert_only_written(fmt, "flash_hnd", dst, src, before, dict(zip(dst_ids, src_ids)), sizes)
    checks = job.handle._checks
    checked = [c is not None for c in checks]
    assert checked == ([True] * LAYERS if layerwise or one_scatter else [False] * (LAYERS - 1) + [True])
    raised = [int(c[1][c[2]]) for c in checks if c is not None]
    if (layerwise or one_scatter) and whole:  # one comparison for all layers: every layer's check says mismatch
        assert raised == [1] * LAYERS
    else:  # the last layer's check covers the wrong object; the others none
        assert raised[-1] == 1 and set(raised[:-1]) <= {0}, raised


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("verified", [False, True], ids=["unverified", "verified"])
def test_a_load_issued_in_two_parts_after_a_head_start_lands_every_block(engines, pool, monkeypatch, layerwise,
                                                                        verified):
    """``_issue_fills`` itself on host memory, driven as ``_issue_here`` drives a load
    beside a long forward: a head start's fill copied before it, two fills issued on the
    submitting thread, the rest later on another. Every block lands, each layer's check
    passes; the head start's fill is scattered only once the rest is issued."""
    from types import SimpleNamespace

    from maru_connector.transfer import LoadHandle
    from maru_connector.transfer import cuda as cuda_engine
    from maru_connector.transfer.plan import layer_pieces

    monkeypatch.setattr(cuda_engine, "GROUP_BELOW_BYTES", 0)  # a layer a fill, as large layers are
    fmt, offsets, src, src_ids, checksums = _stored(engines, pool, "cpu", "flash_hnd", layerwise, True)
    dst = make_kv_caches("flash_hnd", layers=LAYERS, blocks=BLOCKS, seed=2)
    before = {name: dst[name].clone() for name in fmt.layout.layer_names}
    engine = _host_cuda_engine(pool, dst, fmt, 64, True)
    engine._staging = cuda_engine._StagingRing(64 * fmt.layer_bytes * LAYERS, "cpu")
    engine.load_stream = engine.scatter_stream = SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
    engine._device_ids = lambda job, stream: torch.tensor(job.block_ids)
    engine._release_head, engine.heads_used = (lambda head: None), 0
    engine._compare_counter = torch.zeros(1, dtype=torch.int32)
    sources = [tuple(o) for o in offsets]
    head_unit = next(engine._units(layer_pieces(fmt, sources, 64)))
    engine._head_buffer = torch.empty(engine._unit_bytes(head_unit), dtype=torch.uint8)
    head = SimpleNamespace(fills=[(head_unit, engine._copy_unit(head_unit, 0, engine._head_buffer))])
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    n = len(checksums)
    expected = torch.tensor([c - (1 << 64) if c >= 1 << 63 else c for c in checksums], dtype=torch.int64)
    state = [torch.zeros(n, dtype=torch.int64), expected, torch.ones(n, dtype=torch.int64),
             torch.zeros(LAYERS, dtype=torch.int32), 0]
    job = SimpleNamespace(check=True if verified else None, check_state=state if verified else None,
                          block_ids=dst_ids, handle=LoadHandle(LAYERS, 0), beside_long_forward=True,
                          ready=object(), head=head, offsets=sources)
    fills = engine._issue_fills(job)
    for done, _ in enumerate(fills, 1):  # as _issue_here: the head, then hand the rest over
        if done >= 2:
            break
    assert not job.handle.layer_ready(0)  # the head start's layer: scattered with the rest
    assert not any(job.handle.layer_ready(layer) for layer in range(1, LAYERS))
    for _ in fills:  # the rest, as the copy thread issues it
        pass
    assert all(job.handle.layer_ready(layer) for layer in range(LAYERS)) and job.handle.error is None
    _assert_only_written(fmt, "flash_hnd", dst, src, before, dict(zip(dst_ids, src_ids)))


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_blocks_only_lead_a_load_s_first_chunk(engines, pool, device):
    fmt, offsets, _, _, _ = _stored(engines, pool, device, "cpu", False, adjacent=False)
    loader, _ = _loader(engines, fmt, device)
    ids = list(range(CHUNKS * BPC))
    inside = [ChunkLoad((0, SKIP_BLOCK, 2, 3), offsets[0])]
    later = [ChunkLoad((0, 1, 2, 3), offsets[0]), ChunkLoad((SKIP_BLOCK, 5, 6, 7), offsets[1])]
    whole = [ChunkLoad((SKIP_BLOCK,) * BPC, offsets[0]), ChunkLoad(tuple(ids[BPC:2 * BPC]), offsets[1])]
    for chunks in (inside, later, whole):
        with pytest.raises(TransferRequestError):
            loader.submit_load(chunks)
    with pytest.raises(TransferRequestError):
        loader.submit_store([ChunkStore((SKIP_BLOCK, 1, 2, 3), offsets[0])])


def _tail_chunks(dst_ids, offsets, head, tail, chunks=CHUNKS):
    """A load of the first ``chunks`` chunks that leaves out ``head`` leading and ``tail`` trailing blocks."""
    n = chunks * BPC
    ids = [SKIP_BLOCK] * head + dst_ids[head:n - tail] + [SKIP_BLOCK] * tail
    return [ChunkLoad(tuple(ids[c * BPC:(c + 1) * BPC]), offsets[c]) for c in range(chunks)]


@pytest.mark.parametrize("device, issue", DEVICE_ISSUES)
@pytest.mark.parametrize("kind", ["cpu", "flash_hnd"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [False, True], ids=["scattered", "adjacent"])
@pytest.mark.parametrize("head, tail, chunks", [(0, 1, CHUNKS), (0, BPC - 1, CHUNKS), (1, 2, CHUNKS),
                                                (1, 1, 1), (0, BPC - 1, 1)])
@pytest.mark.parametrize("verified", [True, False], ids=["verified", "unverified"])
def test_a_load_that_ends_inside_its_last_chunk_writes_only_the_blocks_before_the_skipped_tail(
        engines, pool, device, issue, kind, layerwise, adjacent, head, tail, chunks, verified):
    fmt, offsets, src, src_ids, checksums = _stored(engines, pool, device, kind, layerwise, adjacent)
    loader, dst = _loader(engines, fmt, device, **({} if device == "cpu" else ISSUE[issue]))
    before = {name: dst[name].clone() for name in fmt.layout.layer_names}
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    per = fmt.objects_per_chunk
    check = PayloadCheck.of(checksums[:chunks * per]) if verified else None
    handle = loader.submit_load(_tail_chunks(dst_ids, offsets, head, tail, chunks), check=check)
    assert handle.wait_all(30) and handle.error is None and handle.done()
    end = chunks * BPC - tail
    written = dict(zip(dst_ids[head:end], src_ids[head:end]))
    assert handle.nbytes == len(written) * fmt.layout.block_bytes_per_layer * LAYERS
    _assert_only_written(fmt, kind, dst, src, before, written)


@pytest.mark.parametrize("device, issue", DEVICE_ISSUES)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_a_corrupted_byte_in_the_skipped_tail_fails_the_verified_load(engines, pool, device, issue, layerwise, layer):
    fmt, offsets, _, _, checksums = _stored(engines, pool, device, "flash_hnd", layerwise, adjacent=False)
    block = fmt.layout.block_bytes_per_layer
    last = fmt.layer_source(offsets[CHUNKS - 1], layer)
    pool.buffer[last + (BPC - 1) * block + block // 3] ^= 0x01  # in the last chunk's last block, left out
    loader, _ = _loader(engines, fmt, device, **({} if device == "cpu" else ISSUE[issue]))
    handle = loader.submit_load(_tail_chunks(list(range(CHUNKS * BPC)), offsets, 0, 2),
                                check=PayloadCheck.of(checksums))
    due = layer if layerwise else LAYERS - 1
    handed = [handle.wait_layer_on_device(i, timeout=30) for i in range(LAYERS)]
    assert not handed[due]
    assert handle.wait_all(30) is False and isinstance(handle.error, ChecksumMismatch)


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_blocks_only_trail_a_load_s_last_chunk_and_never_cover_a_chunk(engines, pool, device):
    fmt, offsets, _, _, _ = _stored(engines, pool, device, "cpu", False, adjacent=False)
    loader, _ = _loader(engines, fmt, device)
    not_last = [ChunkLoad((0, 1, 2, SKIP_BLOCK), offsets[0]), ChunkLoad((4, 5, 6, 7), offsets[1])]
    all_skipped = [ChunkLoad((0, 1, 2, 3), offsets[0]), ChunkLoad((SKIP_BLOCK,) * BPC, offsets[1])]
    head_meets_tail = [ChunkLoad((SKIP_BLOCK, SKIP_BLOCK, SKIP_BLOCK, SKIP_BLOCK), offsets[0])]
    for chunks in (not_last, all_skipped, head_meets_tail):
        with pytest.raises(TransferRequestError, match="block"):
            loader.submit_load(chunks)
