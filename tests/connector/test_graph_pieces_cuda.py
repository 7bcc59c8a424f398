"""A hit loaded while the forward runs in CUDA graph pieces, as vLLM's
piecewise mode splits a model: everything but attention captured, the
connector's ``wait_for_layer_load`` before each layer's attention (between
graph replays), the copies overlapped with the forward. Afterwards the KV in
the paged blocks must equal, bit for bit, what the writer stored, and the
forward's logits must equal those of the same tokens computed eagerly on the
writer, whose KV was never copied. Skipped where no CUDA device is present
(CI); run on a GPU machine, see bench/RESULTS.md."""

from __future__ import annotations

import os
import random
import time
import uuid

import pytest
import torch

import vllm_shim

vllm_shim.install()

from fake_index import FakeIndex  # noqa: E402
from llama_layer import (  # noqa: E402
    Batch, EagerForward, Geometry, LlamaStack, PiecewiseForward, fill_random, paged_kv_caches,
)
from maru_core.keys import KeyNamespace, chunk_keys  # noqa: E402
from maru_core.pool import Pool  # noqa: E402

from maru_connector.config import parse_config  # noqa: E402
from maru_connector.metadata import LoadSpec, MaruConnectorMetadata, StoreSpec  # noqa: E402
from maru_connector.stats import open_stats  # noqa: E402
from maru_connector.transfer import TransferEngine, create_engine  # noqa: E402
from maru_connector.worker import MaruWorkerHalf, WorkerResources  # noqa: E402
from worker_env import finished, save  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; the CUDA tests passed on an H200: bench/RESULTS.md (CUDA tests)"),
]

GEO = Geometry(hidden=1024, heads=8, kv_heads=4, head=128, ffn=2048, layers=8, vocab=4096)
BLOCK, CHUNK = 16, 256
CACHED, NEW = 4096, 16  # 64 MiB of KV to load: the copies outlast the first layers
BLOCKS = 2 * (CACHED + NEW) // BLOCK + 16


@pytest.fixture(scope="module")
def model():
    return LlamaStack(GEO, "cuda", seed=3)


@pytest.fixture
def env():
    path = f"/dev/shm/maru-graph-test-{uuid.uuid4().hex}"
    pool = Pool.create(path, 256 << 20, page_size=1 << 20)
    index = FakeIndex(pool.geometry, pool)
    workers = []

    def worker(**knobs):
        raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": path,
               "maru_kv_chunk_tokens": CHUNK, **knobs}
        cfg = parse_config(raw, BLOCK)
        kv = paged_kv_caches(GEO, BLOCKS, BLOCK, "cuda", seed=len(workers) + 10)

        def resources(cfg, kv_caches, block_size):
            fmt = TransferEngine.detect(kv_caches, cfg.maru_kv_chunk_tokens,
                                        cfg.maru_use_layerwise, block_size)
            attached = Pool.attach(path)
            engine = create_engine(attached.buffer, kv_caches, fmt)
            return WorkerResources(attached, engine, index.client, open_stats(cfg, "worker"))

        half = MaruWorkerHalf(cfg, tp_rank=0, block_size=BLOCK, resources_factory=resources)
        half.register_kv_caches(kv)
        workers.append(half)
        return half, kv

    yield worker
    for half in workers:
        half.shutdown()
    pool.close()
    os.unlink(path)


def _chunk_blocks(blocks, chunks):
    per = CHUNK // BLOCK
    return tuple(tuple(blocks[c * per:(c + 1) * per]) for c in range(chunks))


def _store(model, writer, kv, tokens, blocks, keys):
    """The writer's prefill (eager, no connector), then its store of the prefix."""
    EagerForward(model, kv)(Batch.build([(tokens, 0, blocks)], BLOCK, "cuda"))
    chunks = CACHED // CHUNK
    meta = MaruConnectorMetadata(stores=[StoreSpec(
        req_id="w", keys_by_rank=(tuple(keys[:chunks]),), block_ids=_chunk_blocks(blocks, chunks))])
    writer.start_load_kv(meta)
    save(writer, meta)  # the copy, then the scheduler's verdict: committed
    assert writer.get_block_ids_with_load_errors() == set()


def _same_blocks(kv_a, blocks_a, kv_b, blocks_b):
    ia = torch.tensor(blocks_a, device="cuda")
    ib = torch.tensor(blocks_b, device="cuda")
    return all(torch.equal(kv_a[n].index_select(0, ia).view(torch.int16),
                           kv_b[n].index_select(0, ib).view(torch.int16)) for n in kv_a)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_overlapped_load_under_graph_pieces_is_bit_exact(model, env, is_async, layerwise):
    rng = random.Random(f"{is_async}{layerwise}")
    writer, kv_w = env(maru_use_layerwise=layerwise, maru_async_store=False)
    reader, kv_r = env(maru_use_layerwise=layerwise, maru_async_load=is_async,
                       maru_overlap_load_with_compute=True)
    tokens = [rng.randrange(1, GEO.vocab) for _ in range(CACHED + NEW)]
    ns = KeyNamespace(model="graph-test", dtype="bfloat16", kv_dtype="auto",
                      layout="cuda/packed", block_size=BLOCK, chunk_tokens=CHUNK,
                      fmt="layerwise" if layerwise else "chunkwise")
    keys = chunk_keys(ns, tokens)
    need = -(-(CACHED + NEW) // BLOCK)
    w_blocks = rng.sample(range(BLOCKS), need)
    r_blocks = rng.sample(range(BLOCKS), need)
    _store(model, writer, kv_w, tokens, w_blocks, keys)

    suffix = Batch.build([(tokens[CACHED:], CACHED, r_blocks)], BLOCK, "cuda")
    pieces = PiecewiseForward(model, kv_r, suffix)  # captured before any copy runs
    for t in kv_r.values():
        fill_random(t)  # no block of the reader holds the prefix before the load
    torch.cuda.synchronize()
    chunks = CACHED // CHUNK
    spec = LoadSpec(req_id="r", keys_by_rank=(tuple(keys[:chunks]),),
                    block_ids=_chunk_blocks(r_blocks, chunks), is_async=is_async)
    meta = MaruConnectorMetadata(loads=[spec])
    reader.start_load_kv(meta)
    if is_async:  # parked until the loader releases it (after its first layer landed)
        deadline = time.monotonic() + 30
        while "r" not in finished(reader)[1]:
            assert time.monotonic() < deadline
            time.sleep(0.0002)
        meta = MaruConnectorMetadata()
    waited = []

    def wait(name):
        waited.append(name)
        reader.wait_for_layer_load(name)

    logits = pieces(suffix, wait)
    reader.wait_for_save(meta)
    finished(reader, scheduled={"r"})
    torch.cuda.synchronize()

    assert waited == [f"model.layers.{i}.self_attn.attn" for i in range(GEO.layers)]
    assert reader.get_block_ids_with_load_errors() == set()
    per = CACHED // BLOCK
    assert _same_blocks(kv_w, w_blocks[:per], kv_r, r_blocks[:per])
    want = EagerForward(model, kv_w)(Batch.build([(tokens[CACHED:], CACHED, w_blocks)],
                                                 BLOCK, "cuda"))
    err = float((logits.float() - want.float()).norm() / want.float().norm())
    assert err < 1e-2, err
