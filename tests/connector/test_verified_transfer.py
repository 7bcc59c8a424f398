"""Verified loads through the transfer engines: the checksum each store computes
(CPU: over the bytes it wrote into the pool; CUDA: on the device, over its
staging) is bit for bit the numpy position sum of the object in the pool, and
a load checks the bytes it received against it before a layer is handed
out: a corrupted byte in the pool fails the load, and the layers it touches
are never returned by a wait.

The ``cuda`` cases need an NVIDIA GPU (``bench/verify_h200.sh`` runs them);
the device kernel's arithmetic is also checked here on the CPU (torch, and
Triton's interpreter)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import random
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from maru_core.pool.checksum import position_sum

from kv_builders import ALL_KINDS, block_bytes, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChecksumMismatch, ChunkLoad, ChunkStore, PayloadCheck
from maru_connector.transfer import device_checksum
from test_transfer_cuda import engines, pool  # noqa: F401 (fixtures)

ON_GPU = [pytest.mark.cuda,
          pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; run by bench/verify_h200.sh")]
CUDA = pytest.param("cuda", marks=ON_GPU)
DEVICES = ["cpu", CUDA]
BPC, CHUNKS, LAYERS, BLOCKS = 2, 4, 3, 24


def _stored(engines, pool, device, kind, layerwise, **options):
    """Objects stored by an engine on ``device``: (fmt, load plan, source KV, block map)."""
    rng = random.Random(f"{kind}{layerwise}{device}")
    src = make_kv_caches(kind, layers=LAYERS, blocks=BLOCKS, seed=1, device=device)
    layout = detect_kv_layout(src)
    fmt = ObjectFormat(layout, BPC * layout.block_size, layerwise)
    size, per = fmt.object_bytes, fmt.objects_per_chunk
    slots = rng.sample(range(pool.map.size() // size), CHUNKS * per)
    offsets = [tuple(slots[c * per + i] * size for i in range(per)) for c in range(CHUNKS)]
    src_ids = rng.sample(range(BLOCKS), CHUNKS * BPC)
    storer = engines(src, fmt, **options)
    handle = storer.submit_store([ChunkStore(tuple(src_ids[c * BPC:(c + 1) * BPC]), offsets[c])
                                  for c in range(CHUNKS)])
    assert handle.wait(30), handle.error
    return fmt, offsets, src, src_ids, handle


def _pool_sums(pool, fmt, offsets) -> list[int]:
    return [position_sum(pool.buffer[o:o + fmt.object_bytes]) for chunk in offsets for o in chunk]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_store_s_checksums_are_the_numpy_sums_of_its_objects_in_the_pool(engines, pool, device, kind,
                                                                           layerwise):
    fmt, offsets, _, _, handle = _stored(engines, pool, device, kind, layerwise)
    assert handle.checksums == _pool_sums(pool, fmt, offsets)


ISSUE = {"inline": {}, "copy_thread": {"inline_load_bytes": 0, "inline_head_fills": 0},
         "small_staging": {"staging_bytes": 0}}  # one chunk row per fill: a layer in several fills


def _loader(engines, fmt, device, seed=2, **options):
    dst = make_kv_caches(fmt.layout.kind, layers=LAYERS, blocks=BLOCKS, seed=seed, device=device)
    return engines(dst, ObjectFormat(detect_kv_layout(dst), fmt.chunk_tokens, fmt.layerwise), **options), dst


def _engine_options(device: str, issue: str) -> dict:
    return {} if device == "cpu" else dict(ISSUE[issue])


# (device, how the CUDA engine issues the load): the issue paths are the CUDA engine's
DEVICE_ISSUES = [("cpu", "inline"), *(pytest.param("cuda", issue, marks=ON_GPU) for issue in ISSUE)]


@pytest.mark.parametrize("device, issue", DEVICE_ISSUES)
@pytest.mark.parametrize("kind", ["cpu", "flash_hnd", "packed_lhbnc"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_verified_load_of_intact_objects_lands_every_byte(engines, pool, device, kind, layerwise, issue):
    fmt, offsets, src, src_ids, stored = _stored(engines, pool, device, kind, layerwise)
    loader, dst = _loader(engines, fmt, device, **_engine_options(device, issue))
    dst_ids = random.Random(7).sample(range(BLOCKS), CHUNKS * BPC)
    handle = loader.submit_load([ChunkLoad(tuple(dst_ids[c * BPC:(c + 1) * BPC]), offsets[c])
                                 for c in range(CHUNKS)], check=PayloadCheck.of(stored.checksums))
    assert handle.wait_all(30) and handle.error is None and handle.done()
    for name in fmt.layout.layer_names:
        for d, s in zip(dst_ids, src_ids):
            assert torch.equal(block_bytes(kind, dst[name], d), block_bytes(kind, src[name], s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("layer", [0, LAYERS - 1])
def test_a_corrupted_pool_byte_fails_the_verified_load_and_its_layer_is_never_handed_out(
        engines, pool, device, layerwise, layer):
    fmt, offsets, _, _, stored = _stored(engines, pool, device, "flash_hnd", layerwise)
    chunk = 2
    start, length = fmt.layer_extent(layer)
    at = fmt.layer_source(offsets[chunk], layer) + length // 2
    pool.buffer[at] ^= 0x01  # one bit of layer `layer` of chunk 2
    loader, _ = _loader(engines, fmt, device)
    handle = loader.submit_load([ChunkLoad(tuple(range(c * BPC, (c + 1) * BPC)), offsets[c])
                                 for c in range(CHUNKS)], check=PayloadCheck.of(stored.checksums))
    due = layer if layerwise else LAYERS - 1  # a chunkwise object is checked whole, by the last layer
    handed = [handle.wait_layer_on_device(i, timeout=30) for i in range(LAYERS)]
    assert not handed[due]  # the forward never gets the corrupted layer
    # The CPU engine checks layer by layer and stops at the first mismatch; the
    # CUDA engine checks per fill, and small layers share one (GROUP_BELOW_BYTES),
    # so it may refuse the layers before it too, and checks later layerwise
    # objects on their own.
    if device == "cpu":
        assert all(handed[:due]) and not any(handed[due:])
    assert not handle.wait_layer(due, timeout=30) and not handle.wait_all(30)
    assert isinstance(handle.error, ChecksumMismatch) and handle.done()
    # The engine goes on serving: the same load, verified, once the byte is back.
    pool.buffer[at] ^= 0x01
    again = loader.submit_load([ChunkLoad(tuple(range(c * BPC, (c + 1) * BPC)), offsets[c])
                                for c in range(CHUNKS)], check=PayloadCheck.of(stored.checksums))
    assert again.wait_all(30) and again.error is None


@pytest.mark.parametrize("device", DEVICES)
def test_objects_the_engine_is_told_not_to_check_are_not_checked(engines, pool, device):
    fmt, offsets, _, _, stored = _stored(engines, pool, device, "cpu", False)
    wrong = np.array(stored.checksums, dtype=np.uint64) + np.uint64(1)
    loader, _ = _loader(engines, fmt, device)
    chunks = [ChunkLoad(tuple(range(c * BPC, (c + 1) * BPC)), offsets[c]) for c in range(CHUNKS)]
    assert loader.submit_load(chunks, check=PayloadCheck.of(wrong, [False] * CHUNKS)).wait_all(30)
    assert not loader.submit_load(chunks, check=PayloadCheck.of(wrong, [False, True, False, False])).wait_all(30)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@ON_GPU[0]
@ON_GPU[1]
def test_a_head_start_s_fills_are_verified_like_the_load_s_own(engines, pool, layerwise):
    """Head starts are the CUDA engine's: a load's first fills copied ahead of it."""
    fmt, offsets, _, _, stored = _stored(engines, pool, "cuda", "flash_hnd", layerwise)
    pool.buffer[fmt.layer_source(offsets[0], 0) + 5] ^= 0x80  # in the head's first fill
    loader, _ = _loader(engines, fmt, "cuda")
    head = loader.start_head(offsets)
    assert head is not None
    handle = loader.submit_load([ChunkLoad(tuple(range(c * BPC, (c + 1) * BPC)), offsets[c])
                                 for c in range(CHUNKS)], head=head, check=PayloadCheck.of(stored.checksums))
    assert handle.head_start and not handle.wait_all(30) and isinstance(handle.error, ChecksumMismatch)


def _row_sums_reference(buf: np.ndarray, off, row_bytes, first_chunk, n_chunks, first_layer, n_layers,
                        chunk_major, layerwise, total_layers, num_objects) -> list[int]:
    want = [0] * num_objects
    for i in range(n_chunks * n_layers):
        r, k = divmod(i, n_layers) if chunk_major else divmod(i, n_chunks)[::-1]
        chunk, layer = first_chunk + r, first_layer + k
        obj = chunk * total_layers + layer if layerwise else chunk
        base = 0 if layerwise else layer * row_bytes // 4
        want[obj] += position_sum(buf[off + i * row_bytes: off + (i + 1) * row_bytes], base)
    return [w % 2**64 for w in want]


SHAPES = [  # (n_chunks, n_layers, row_bytes)
    (3, 2, 4 * 4099), (1, 1, 64), (64, 1, 1 << 20), (4, 4, 8 << 20),
]


def _check_row_sums(device: str, backend: str, shapes=SHAPES) -> None:
    rng = np.random.default_rng(5)
    for n_chunks, n_layers, row_bytes in shapes:
        for layerwise in (False, True):
            for chunk_major in (False, True):
                off, first_chunk, first_layer, total = 64, 1, 2, n_layers + 3
                host = rng.integers(0, 256, off + n_chunks * n_layers * row_bytes + 8, dtype=np.uint8)
                host[off:off + 64] = 0xFF  # words near 2**32: products and sums wrap
                objects = (first_chunk + n_chunks) * (total if layerwise else 1)
                want = _row_sums_reference(host, off, row_bytes, first_chunk, n_chunks, first_layer, n_layers,
                                           chunk_major, layerwise, total, objects)
                sums = torch.zeros(objects, dtype=torch.int64, device=device)
                device_checksum.add_row_sums(
                    sums, torch.from_numpy(host).to(device), off, row_bytes, first_chunk=first_chunk,
                    n_chunks=n_chunks, first_layer=first_layer, n_layers=n_layers, chunk_major=chunk_major,
                    layerwise=layerwise, total_layers=total, backend=backend)
                assert device_checksum.as_uint64(sums.cpu()) == want, (backend, n_chunks, n_layers, row_bytes)


@ON_GPU[0]
@ON_GPU[1]
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_device_sums_equal_numpy_bit_for_bit_on_the_gpu(backend):
    if backend == "triton" and device_checksum.BACKEND != "triton":
        pytest.fail("Triton is not installed on this GPU machine: verified loads would take torch's slower path")
    _check_row_sums("cuda", backend)


def test_the_device_sums_equal_numpy_with_torch_on_the_cpu():
    _check_row_sums("cpu", "torch", SHAPES[:3])


def _triton_for_the_interpreter() -> str:
    """The Triton that ``make setup`` puts beside the venv (never in it: vLLM's
    CPU build breaks when Triton is importable), or an installed one."""
    versions = pathlib.Path(__file__).parents[2] / "scripts" / "vllm_versions.sh"
    version = re.search(r"^TRITON_VERSION=(\S+)", versions.read_text(), re.M).group(1)
    target = pathlib.Path(sys.prefix) / f"triton-{version}"
    if (target / ".installed").exists():
        return str(target)
    if importlib.util.find_spec("triton") is not None:  # a GPU machine's own
        return ""
    pytest.fail(f"Triton {version} is not in {target}: run `make setup` (scripts/bootstrap.sh installs it)")


def test_the_triton_kernel_s_arithmetic_equals_numpy_in_triton_s_interpreter():
    """The kernel's sums and its fused comparison, run by Triton's interpreter
    on the CPU (the GPU runs the same source: bench/verify_h200.sh fused-ab)."""
    triton_path = _triton_for_the_interpreter()
    script = textwrap.dedent("""
        import test_verified_transfer as t
        t._check_row_sums("cpu", "triton", t.SHAPES[:2])
        t._check_compare("cpu", "triton", "cpu")
        print("same")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [triton_path, os.path.dirname(__file__),
                                                     os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]


class _HostCopies:
    """The CUDA engine's copy calls done with memmove on host memory."""

    @staticmethod
    def memcpy(dst, src, nbytes, kind, stream):
        ctypes.memmove(dst, src, nbytes)

    @staticmethod
    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


def _fills_engine(pool, fmt, rows_cap: int, copy_2d: bool):
    """A CUDA engine's planning and staging, on host memory: its fills (``_units``)
    copied by ``_copy_unit`` as on the GPU, so ``_sum_fills``' reading of a fill's
    rows can be checked without one."""
    from types import SimpleNamespace

    from maru_connector.transfer.cuda import CudaTransferEngine

    engine = object.__new__(CudaTransferEngine)
    engine.fmt, engine.layout = fmt, fmt.layout
    engine.pool = torch.frombuffer(pool.buffer, dtype=torch.uint8)
    engine.pool_size, engine._pool_ptr = engine.pool.numel(), engine.pool.data_ptr()
    engine._rows_cap, engine._stacked = rows_cap, {}
    engine._memcpy, engine._memcpy2d = _HostCopies.memcpy, _HostCopies.memcpy2d if copy_2d else None
    engine._event = lambda: SimpleNamespace(record=lambda stream: None)
    engine.load_stream = engine.scatter_stream = SimpleNamespace(cuda_stream=0)
    return engine


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("adjacent", [True, False], ids=["adjacent", "scattered"])
@pytest.mark.parametrize("rows_cap", [1, 3, 64])
@pytest.mark.parametrize("copy_2d", [True, False], ids=["2d", "rows"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "a-layer-a-fill"])
def test_the_cuda_engine_s_fills_sum_to_each_object_s_checksum(pool, monkeypatch, layerwise, adjacent, rows_cap,
                                                               copy_2d, grouped):
    """Every way the CUDA engine stages a load (one layer or a group of layers a
    fill, layer-major or as wide chunk-major rows, a layer over several fills)
    read by ``_sum_fills`` as rows of (chunk, layer), a fill at a time or in
    the batches a verified load's issue forms (``_joins``): the sums are each
    object's checksum in the pool. Staged on the host, summed with torch."""
    from collections import deque
    from types import SimpleNamespace

    from maru_connector.transfer import cuda as cuda_engine
    from maru_connector.transfer.plan import layer_pieces

    if not grouped:  # every layer its own fill, as large layers are
        monkeypatch.setattr(cuda_engine, "GROUP_BELOW_BYTES", 0)
    layout = detect_kv_layout(make_kv_caches("flash_hnd", layers=5, blocks=24))
    fmt = ObjectFormat(layout, BPC * layout.block_size, layerwise)
    chunks, per, size = 6, fmt.objects_per_chunk, fmt.object_bytes
    rng = random.Random(f"{layerwise}{adjacent}{rows_cap}")
    slots = list(range(chunks * per)) if adjacent else rng.sample(range(pool.map.size() // size - 1), chunks * per)
    offsets = [tuple(slots[c * per + i] * size for i in range(per)) for c in range(chunks)]
    pool.buffer[: chunks * per * size if adjacent else pool.map.size()] = os.urandom(
        chunks * per * size if adjacent else pool.map.size())
    engine = _fills_engine(pool, fmt, rows_cap, copy_2d)
    staging = torch.empty(64 * fmt.layer_bytes * fmt.num_layers, dtype=torch.uint8)
    engine._staging = SimpleNamespace(buffer=staging)
    want = [position_sum(pool.buffer[o:o + size]) for chunk in offsets for o in chunk]
    fills, at = [], 0
    for unit in engine._units(layer_pieces(fmt, offsets, rows_cap)):
        fills.append((unit, engine._copy_unit(unit, at, staging)))
        at += fills[-1][1][1]
    batches: list = []
    pending: deque = deque()
    left = sum(copied[1] for _, copied in fills)
    for fill in fills:  # as _issue_fills forms them
        pending.append(fill)
        left -= fill[1][1]
        if len(pending) > 1 and not engine._joins(SimpleNamespace(check=True, beside_long_forward=False),
                                                  pending, left):
            batches.append([pending.popleft() for _ in range(len(pending) - 1)])
    batches.append(list(pending))
    for one_by_one in (True, False):
        sums = torch.zeros(chunks * per, dtype=torch.int64)
        job = SimpleNamespace(check_state=[sums, None, None, None, 0])
        for batch in ([[fill] for fill in fills] if one_by_one else batches):
            engine._sum_fills(job, batch, None)
        assert device_checksum.as_uint64(sums) == want, (one_by_one, [len(b) for b in batches])
    if not grouped and rows_cap == 64 and adjacent:  # whole layers with the same runs, side by side
        # batches no larger than what is left to copy after them: 5 layers go as 2 + 1 + 1 + 1
        assert [len(b) for b in batches] == [2, 1, 1, 1], [len(b) for b in batches]


class _Event:
    """A device event, as a handle waits for it: done or not yet."""

    def __init__(self, done: bool) -> None:
        self.done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def test_a_wait_reads_a_layer_s_device_check_before_it_returns_the_layer():
    """The handle's side of a CUDA check, with stand-in events: a layer whose
    check is still running is not ready, a wait waits for the check, and a
    flag that says mismatch fails the load instead of returning the layer."""
    from maru_connector.transfer import LoadHandle

    handle = LoadHandle(3, 300)
    flags = torch.tensor([0, 1], dtype=torch.int32)
    running, failed = _Event(False), _Event(True)
    handle._mark_layer(0, None, (running, flags, 0, "layer 0"))
    handle._mark_layer(1, None, (failed, flags, 1, "layer 1"))
    handle._mark_layer(2)
    assert not handle.layer_ready(0) and handle.error is None  # its check is still running
    assert handle.wait_layer_on_device(0) and running.synchronized == 1
    assert not handle.wait_layer_on_device(1)
    assert isinstance(handle.error, ChecksumMismatch) and "layer 1" in str(handle.error)
    assert handle.done() and not handle.wait_all(1)


class _Flags:
    """Pinned flags as a wait reads them, counting the reads."""

    def __init__(self, values) -> None:
        self.values, self.reads = list(values), 0

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return self.values[index]


def test_a_check_seen_to_pass_is_not_waited_for_or_read_again():
    """The forward's wait for a layer waits for its check and reads its flag
    once; the step's later waits for the whole load (``wait_all``, ``done``,
    ``layer_ready``) do neither again for a layer that passed, and still
    fail the load on a layer whose check fails."""
    from maru_connector.transfer import LoadHandle

    handle = LoadHandle(3, 300)
    flags = _Flags([0, 0, 1])
    events = [_Event(False), _Event(False), _Event(True)]
    for layer in range(3):
        handle._mark_layer(layer, None, (events[layer], flags, layer, f"layer {layer}"))
    assert handle.wait_layer_on_device(0) and handle.wait_layer(1)
    assert (flags.reads, events[0].synchronized, events[1].synchronized) == (2, 1, 1)
    assert handle.layer_ready(0) and handle.layer_ready(1) and flags.reads == 2
    assert not handle.wait_all(1) and isinstance(handle.error, ChecksumMismatch) and "layer 2" in str(handle.error)
    assert (flags.reads, events[0].synchronized, events[1].synchronized) == (3, 1, 1)
    assert handle.done() and not handle.wait_layer(2)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_the_cuda_engine_compares_exactly_the_objects_due_at_each_fill(pool, layerwise):
    """``_due`` and the comparison it asks for (torch's, on host tensors): after
    a fill that completes layers, the objects of those layers (layerwise) or,
    after the last layer, every object (chunkwise); a wrong checksum raises
    the flag of that check only, and an object the engine is told not to
    check raises none."""
    from types import SimpleNamespace

    layout = detect_kv_layout(make_kv_caches("flash_hnd", layers=4, blocks=24))
    fmt = ObjectFormat(layout, BPC * layout.block_size, layerwise)
    engine = _fills_engine(pool, fmt, 64, True)
    engine._compare_counter = torch.zeros(1, dtype=torch.int32)
    chunks, nl = 3, fmt.num_layers
    objects = chunks * fmt.objects_per_chunk
    sums = torch.arange(objects, dtype=torch.int64) * 7 + 1
    wrong = 2 * nl + 1 if layerwise else 2  # chunk 2 (layer 1, layerwise)
    expected = sums.clone()
    expected[wrong] += 1
    verify = torch.ones(objects, dtype=torch.int64)

    def flags_after(layer_groups, verify):
        flags = torch.full((nl,), 7, dtype=torch.int32)
        job = SimpleNamespace(check_state=[sums, expected, verify, flags, 0])
        found = []
        for layers in layer_groups:
            due = engine._due(job, layers)
            if due is not None:
                device_checksum._torch_compare(sums, due[0])
            found.append(None if due is None else int(due[0].flag[0]))
        return found

    groups = [[0], [1, 2], [3]]
    if layerwise:
        assert flags_after(groups, verify) == [0, 1, 0]  # layer 1's objects are checked with layer 2's
    else:
        assert flags_after(groups, verify) == [None, None, 1]  # whole objects, once the last layer is in
    skip = verify.clone()
    skip[wrong] = 0
    assert all(f in (None, 0) for f in flags_after(groups, skip))


def _check_compare(device: str, backend: str, flag_device: str) -> None:
    """A fill summed and compared in one call: the flag says whether any due
    object's total differs from its expected checksum (skipping objects not
    to verify), for due sets of one column and of several, and the ticket
    counter is back at 0 after every call."""
    rng = np.random.default_rng(11)
    nl, chunks, row_bytes = 3, 4, 4 * 1031
    host = rng.integers(0, 256, chunks * nl * row_bytes, dtype=np.uint8)
    data = torch.from_numpy(host).to(device)
    truth = torch.zeros(chunks * nl, dtype=torch.int64, device=device)
    rows = dict(first_chunk=0, n_chunks=chunks, first_layer=0, n_layers=nl, chunk_major=False,
                layerwise=True, total_layers=nl)
    device_checksum.add_row_sums(truth, data, 0, row_bytes, backend="torch", **rows)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    pin = flag_device == "pinned"
    for first, cols in ((0, 1), (1, 2), (0, 3)):
        for wrong in (None, 1 * nl + first, 3 * nl + first + cols - 1, 2 * nl + (first + cols) % nl):
            for skip_wrong in (False, True):
                expected = truth.clone()
                verify = torch.ones_like(truth)
                if wrong is not None:
                    expected[wrong] += 1 << 40
                    if skip_wrong:
                        verify[wrong] = 0
                flag = torch.full((1,), 7, dtype=torch.int32, pin_memory=pin)
                compare = device_checksum.Compare(expected=expected, verify=verify, flags=flag, flag_index=0,
                                                  counter=counter, rows=chunks, stride=nl, first=first, cols=cols)
                sums = torch.zeros_like(truth)
                device_checksum.add_row_sums(sums, data, 0, row_bytes, compare=compare, backend=backend, **rows)
                if device == "cuda":
                    torch.cuda.synchronize()
                due = wrong is not None and first <= wrong % nl < first + cols and not skip_wrong
                assert int(flag[0]) == int(due), (backend, first, cols, wrong, skip_wrong)
                assert torch.equal(sums, truth) and int(counter[0]) == 0


def test_the_sum_and_compare_of_a_fill_flags_exactly_a_due_mismatch_with_torch_on_the_cpu():
    _check_compare("cpu", "torch", "cpu")


@ON_GPU[0]
@ON_GPU[1]
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_sum_and_compare_of_a_fill_flags_exactly_a_due_mismatch_on_the_gpu(backend):
    """The fused kernel writes its flag straight into pinned host memory."""
    if backend == "triton" and not device_checksum.FUSED_COMPARE:
        pytest.fail("the fused comparison is off on this GPU: every verified fill takes torch's compare")
    _check_compare("cuda", backend, "pinned")


@ON_GPU[0]
@ON_GPU[1]
def test_warmed_up_variants_launch_through_the_driver_and_sum_as_numpy(monkeypatch):
    """After warm-up every variant of both formats is launched through the
    CUDA driver directly, and those launches sum and compare bit for bit as
    numpy; a pointer that is not 16-byte aligned (another variant of
    Triton's) goes through Triton's launch, with the same sums."""
    from maru_connector.transfer.direct_launch import DirectLaunch

    if device_checksum.BACKEND != "triton" or not device_checksum.FUSED_COMPARE:
        pytest.fail("no Triton or no fused comparison on this GPU: verified loads would take torch's slower path")
    for layerwise in (False, True):
        device_checksum.warm_up(torch.device("cuda", 0), layerwise)
    assert sorted(device_checksum._DIRECT) == [(0, c, lw, cmp) for c in (False, True) for lw in (False, True)
                                               for cmp in (False, True)]
    launched = {True: 0, False: 0}
    real = DirectLaunch.__call__

    def counted(self, grid, stream, args):
        done = real(self, grid, stream, args)
        launched[done] += 1
        return done

    monkeypatch.setattr(DirectLaunch, "__call__", counted)
    _check_row_sums("cuda", "triton")
    _check_compare("cuda", "triton", "pinned")
    assert launched[True] > 0 and launched[False] == 0, launched

    host = np.random.default_rng(3).integers(0, 256, 4 + 2 * 3 * 4096, dtype=np.uint8)
    unaligned = torch.from_numpy(host).cuda()[4:]
    rows = dict(first_chunk=0, n_chunks=2, first_layer=0, n_layers=3, chunk_major=False, layerwise=True,
                total_layers=3)
    sums = {b: torch.zeros(6, dtype=torch.int64, device="cuda") for b in ("triton", "torch")}
    for backend, total in sums.items():
        device_checksum.add_row_sums(total, unaligned, 0, 4096, backend=backend, **rows)
    assert launched[False] == 1 and torch.equal(sums["triton"], sums["torch"])

