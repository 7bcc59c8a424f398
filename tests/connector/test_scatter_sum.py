"""The fused scatter (``transfer/scatter_sum.py``): a load's fill copied from
device staging into vLLM's paged blocks by one kernel that, for a verified
load, also sums the bytes it copies and compares the objects the fill
completes.

The kernel runs in Triton's interpreter on the CPU (every KV layout, both
staging orders, a layer and a group of layers, blocks left out at both
ends; and the CUDA engine's own plan of every way it stages a load, with a
corrupted byte caught by exactly the comparison due for it), and on the GPU
(the same checks, the driver's launch, a round trip with and without it)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kv_builders import ALL_KINDS, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChunkStore, PayloadCheck, create_engine, device_checksum, scatter_sum
from maru_connector.transfer.plan import SKIP_BLOCK, layer_pieces
from test_transfer_cuda import ShmPool, _round_trip, engines, pool  # noqa: F401 (fixtures)
from test_verified_transfer import _fills_engine, _triton_for_the_interpreter

ON_GPU = [pytest.mark.cuda,
          pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; run by bench/run_h200.sh")]
BPC = 2


def _layers(kv: dict, layout) -> list[torch.Tensor]:
    """Each layer's block view, in layer order (as the engines hold them)."""
    return [layout.block_view(kv[name]) for name in layout.layer_names]


def _check_kernel(device: str, kinds=ALL_KINDS) -> None:
    """For each layout, format, staging order, a fill of one layer or two and
    one on 16 bytes or not (the kernel's two units):
    the written blocks hold the staged bytes, every other block is as it
    was, and the sums are torch's (``device_checksum``) of the staged rows."""
    from maru_connector.transfer.cuda import _evenly_spaced

    gen = torch.Generator().manual_seed(11)
    for kind in kinds:
        kv = make_kv_caches(kind, layers=3, blocks=12, block_size=4, seed=3, device=device)
        layout = detect_kv_layout(kv)
        views = _layers(kv, layout)
        evenly = _evenly_spaced(views, layout.layer_stride_bytes)
        target = scatter_sum.ScatterTarget.of(views, layout, BPC, evenly)
        assert target is not None, kind
        bpl = layout.block_bytes_per_layer
        for layerwise in (False, True):
            for count in (1, 2) if evenly else (1,):
                for interleaved, offset in [(0, 8), (0, 16)] + ([(3, 16)] if count > 1 else []):
                    # the load's blocks 2-7 (chunks 1-3); its first and last are left out
                    ids = torch.tensor(random.Random(f"{kind}{count}").sample(range(12), 8), device=device)
                    ids[2] = ids[7] = SKIP_BLOCK
                    by_layer = torch.randint(0, 256, (count, 6, bpl), generator=gen, dtype=torch.uint8)
                    staged = (by_layer.view(count, 3, BPC, bpl).transpose(0, 1) if interleaved else by_layer)
                    staging = torch.cat([torch.zeros(offset, dtype=torch.uint8), staged.reshape(-1)]).to(device)
                    before = [v.clone() for v in views]
                    sums = torch.zeros(4 * 3 if layerwise else 4, dtype=torch.int64, device=device)
                    fill = scatter_sum.Fill(staging, offset, 1, count, 2, 6, interleaved, 1, 5)
                    scatter_sum.scatter(target, fill, ids, sums=sums, layerwise=layerwise, total_layers=3)
                    want = torch.zeros_like(sums, device="cpu")
                    device_checksum.add_row_sums(want, by_layer.reshape(-1), 0, BPC * bpl, first_chunk=1,
                                                 n_chunks=3, first_layer=1, n_layers=count, chunk_major=False,
                                                 layerwise=layerwise, total_layers=3, backend="torch")
                    case = (kind, layerwise, count, interleaved, offset)
                    assert torch.equal(sums.cpu(), want), case
                    for k, view in enumerate(views):
                        for block in range(12):
                            written = [b for b in range(1, 5) if int(ids[2 + b]) == block] if 1 <= k <= count else []
                            source = by_layer[k - 1, written[0]] if written else before[k][block].reshape(-1)
                            assert torch.equal(view[block].reshape(-1).cpu(), source.cpu()), (*case, k, block)


def _check_engine(kind: str, layerwise: bool, rows_cap: int, grouped: bool) -> None:
    """The CUDA engine's fills (``_units``, ``_copy_unit``: a layer or a group
    a fill, layer-major or as wide chunk-major rows, a layer over several
    fills), staged on the host and scattered by ``_scatter_fills`` through
    the fused kernel: every block lands as stored, the blocks left out are
    untouched, the sums are the stored checksums and no comparison fails;
    then a byte corrupted in the pool is flagged by the comparison due for
    its object, and only by it."""
    from maru_connector.transfer import cuda as cuda_engine
    from maru_connector.transfer.cuda import _evenly_spaced

    pool = ShmPool(8 << 20)
    try:
        blocks, chunks = 24, 5
        rng = random.Random(f"{kind}{layerwise}{rows_cap}{grouped}")
        src = make_kv_caches(kind, layers=5, blocks=blocks, seed=1)
        layout = detect_kv_layout(src)
        fmt = ObjectFormat(layout, BPC * layout.block_size, layerwise)
        size, per = fmt.object_bytes, fmt.objects_per_chunk
        if rows_cap == 64:  # side by side: chunkwise layers staged as wide chunk-major rows
            slots = [l * chunks + c if layerwise else c for c in range(chunks) for l in range(per)]
        else:
            slots = rng.sample(range(pool.map.size() // size), chunks * per)
        offsets = [tuple(slots[c * per + i] * size for i in range(per)) for c in range(chunks)]
        src_ids = rng.sample(range(blocks), chunks * BPC)
        storer = create_engine(pool.buffer, src, fmt)
        stored = storer.submit_store([ChunkStore(tuple(src_ids[c * BPC:(c + 1) * BPC]), offsets[c])
                                      for c in range(chunks)])
        assert stored.wait(30), stored.error
        storer.close()
        for corrupt in (None, rng.randrange(chunks * per)):
            if corrupt is not None:
                at = offsets[corrupt // per][corrupt % per] + rng.randrange(size)
                pool.buffer[at] ^= 0x5A
            dst = make_kv_caches(kind, layers=5, blocks=blocks, seed=2)
            views = _layers(dst, layout)
            before = [v.clone() for v in views]
            engine = _fills_engine(pool, fmt, rows_cap, copy_2d=True)
            evenly = _evenly_spaced(views, layout.layer_stride_bytes)
            engine._stacked = {} if evenly else None
            engine.block_views, engine.device, engine._head_buffer = views, torch.device("cpu"), None
            engine._scatter_target = scatter_sum.ScatterTarget.of(views, layout, BPC, evenly)
            engine._compare_counter = torch.zeros(1, dtype=torch.int32)
            engine.scatter_stream = SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
            staging = torch.empty(chunks * fmt.layer_bytes * fmt.num_layers, dtype=torch.uint8)
            engine._staging = SimpleNamespace(buffer=staging, freed=lambda start, event: None)
            dst_ids = rng.sample(range(blocks), chunks * BPC)
            dst_ids[0] = dst_ids[-1] = SKIP_BLOCK  # a load that begins and ends inside a chunk
            marked: dict[int, tuple] = {}
            n = chunks * per
            check = PayloadCheck.of(np.array(stored.checksums, dtype=np.uint64))
            job = SimpleNamespace(
                check=check, block_ids=dst_ids, beside_long_forward=False,
                check_state=[torch.zeros(n, dtype=torch.int64), torch.from_numpy(check.expected.view(np.int64)),
                             torch.ones(n, dtype=torch.int64), torch.zeros(5, dtype=torch.int32), 0],
                handle=SimpleNamespace(_mark_layer=lambda layer, event, due: marked.__setitem__(layer, due)))
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(cuda_engine, "FUSED_SCATTER", True)
                if not grouped:
                    patch.setattr(cuda_engine, "GROUP_BELOW_BYTES", 0)
                at = 0
                ids = torch.tensor(dst_ids)
                for unit in engine._units(layer_pieces(fmt, offsets, rows_cap)):
                    copied = engine._copy_unit(unit, at, staging)
                    at += copied[1]
                    engine._scatter_fills(job, ids, [(unit, copied)])
            sums, flags, compared = job.check_state[0], job.check_state[3], job.check_state[4]
            case = (kind, layerwise, rows_cap, grouped, corrupt)
            assert sorted(marked) == list(range(5)), case
            if corrupt is None:
                assert device_checksum.as_uint64(sums) == list(stored.checksums), case
                assert flags[:compared].tolist() == [0] * compared and compared > 0, case
                moved = dict(zip(dst_ids, src_ids))
                for k, view in enumerate(views):
                    source = _layers(src, layout)[k]
                    for block in range(blocks):
                        want = source[moved[block]] if block in moved else before[k][block]
                        assert torch.equal(view[block], want), (*case, k, block)
                continue
            # the corrupted object's comparison: its layer's (layerwise), the last (chunkwise)
            layer = corrupt % per if layerwise else fmt.num_layers - 1
            flagged = [i for i in range(compared) if flags[i]]
            assert len(flagged) == 1 and marked[layer][2] == flagged[0], (case, flagged, marked[layer])
    finally:
        pool.close()


def _interpret(script: str) -> None:
    """Run ``script`` (with this module importable as ``t``) under Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [_triton_for_the_interpreter(), os.path.dirname(__file__),
                                                     os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run([sys.executable, "-c", "import test_scatter_sum as t\n" + textwrap.dedent(script)
                           + "\nprint('same')"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-4000:]


def test_the_kernel_scatters_and_sums_as_torch_in_triton_s_interpreter():
    _interpret("""
        import torch
        from maru_connector.transfer import scatter_sum
        for layerwise in (False, True):
            assert scatter_sum.warm_up(torch.device("cpu"), layerwise)
        t._check_kernel("cpu")
    """)


def test_the_cuda_engine_s_fused_scatter_lands_every_fill_and_flags_a_corrupted_byte_in_the_interpreter():
    _interpret("""
        for kind in ("flash_hnd", "packed_blhnc", "flashinfer_nhd"):
            for layerwise in (False, True):
                for rows_cap in (1, 3, 64):
                    t._check_engine(kind, layerwise, rows_cap, grouped=rows_cap != 1)
    """)


@ON_GPU[0]
@ON_GPU[1]
def test_the_kernel_scatters_and_sums_as_torch_on_the_gpu():
    for layerwise in (False, True):
        assert scatter_sum.warm_up(torch.device("cuda", 0), layerwise)
    _check_kernel("cuda")


@ON_GPU[0]
@ON_GPU[1]
def test_a_cuda_engine_scatters_through_the_driver_with_its_checked_variants(engines, pool, monkeypatch):
    """An engine made on the GPU has the fused scatter on, each variant
    launched through the driver, and a verified and an unverified load land
    every byte through it."""
    from maru_connector.transfer import cuda as cuda_engine
    from maru_connector.transfer.direct_launch import DirectLaunch

    monkeypatch.setattr(cuda_engine, "FUSED_SCATTER", True)
    launched = {True: 0, False: 0}
    real = DirectLaunch.__call__

    def counted(self, grid, stream, args):
        done = real(self, grid, stream, args)
        launched[done] += 1
        return done

    monkeypatch.setattr(DirectLaunch, "__call__", counted)
    for layerwise in (False, True):
        loader = _round_trip(engines, pool, "flash_hnd", layerwise, adjacent=False)
        assert loader._fused_scatter()
        assert {key[1:] for key in scatter_sum._DIRECT if key[0] == 0} >= {
            (with_sum, compare, layerwise and with_sum, unit) for with_sum, compare in ((False, False), (True, False),
                                                                                     (True, True)) for unit in (1, 4)}
    assert launched[True] > 0 and launched[False] == 0, launched


@ON_GPU[0]
@ON_GPU[1]
@pytest.mark.parametrize("kind", ["flash_hnd", "packed_blhnc", "flashinfer_nhd"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_round_trip_with_torch_s_scatter_on_gpu(engines, pool, monkeypatch, kind, layerwise):
    """The engine before the fused scatter (``FUSED_SCATTER`` off), kept for the A/B and for a
    machine where the kernel cannot run, still lands every byte."""
    from maru_connector.transfer import cuda as cuda_engine

    monkeypatch.setattr(cuda_engine, "FUSED_SCATTER", False)
    loader = _round_trip(engines, pool, kind, layerwise, adjacent=False)
    assert not loader._fused_scatter()
