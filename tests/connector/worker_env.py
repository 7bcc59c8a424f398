"""Worker halves on a real pool and the real CPU transfer engine, for unit tests.

Two workers (a "writer" and a "reader", as two vLLM engines would be) share
one pool in ``/dev/shm`` and one index; each has its own KV cache in vLLM's
CPU layout. The index is the in-memory fake of ``fake_index.py``.
"""

from __future__ import annotations

import os
import uuid

import torch
from maru_core.keys import KeyNamespace, chunk_keys
from maru_core.pool import Pool

from maru_connector.config import parse_config
from maru_connector.stats import open_stats
from maru_connector.metadata import LoadSpec, MaruConnectorMetadata, StoreSpec
from maru_tools.cluster import wait_until
from maru_connector.transfer import TransferEngine, create_engine
from maru_connector.worker import MaruWorkerHalf, WorkerResources

from fake_index import FakeIndex
from kv_builders import make_kv_caches

BLOCK = 16
CHUNK = 32  # two blocks per chunk
LAYERS = 4
BLOCKS = 32


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class WorkerEnv:
    """A pool, a fake index and a factory of worker halves bound to them."""

    def __init__(self) -> None:
        self.pool_path = f"/dev/shm/maru-connector-test-{uuid.uuid4().hex}"
        self.pool = Pool.create(self.pool_path, 16 * 1024 * 1024, page_size=4096)
        self.index = FakeIndex(self.pool.geometry, self.pool)
        self.workers: list[MaruWorkerHalf] = []
        self.ns = KeyNamespace(
            model="tiny", dtype="bfloat16", kv_dtype="auto", layout="cpu/test",
            block_size=BLOCK, chunk_tokens=CHUNK,
        )

    def worker(self, seed: int = 0, wrap_engine=None, dtype: torch.dtype = torch.bfloat16, handoff=None,
               report_settled_stores: bool = False, **knobs: object) -> tuple[MaruWorkerHalf, dict[str, torch.Tensor]]:
        raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": self.pool_path,
               "maru_kv_chunk_tokens": CHUNK, **knobs}
        cfg = parse_config(raw, BLOCK)
        kv = make_kv_caches("cpu", layers=LAYERS, blocks=BLOCKS, heads=2, block_size=BLOCK,
                            head_size=8, dtype=dtype, seed=seed, shuffle=False)

        def resources(cfg, kv_caches, block_size):
            fmt = TransferEngine.detect(kv_caches, cfg.maru_kv_chunk_tokens,
                                        cfg.maru_use_layerwise, block_size)
            pool = Pool.attach(self.pool_path)
            engine = create_engine(pool.buffer, kv_caches, fmt)
            if wrap_engine is not None:
                engine = wrap_engine(engine)
            return WorkerResources(pool, engine, self.index.client, open_stats(cfg, "worker"))

        half = MaruWorkerHalf(cfg, tp_rank=0, block_size=BLOCK, resources_factory=resources, handoff=handoff,
                              report_settled_stores=report_settled_stores)
        half.register_kv_caches(kv)
        self.workers.append(half)
        return half, kv

    def keys(self, tokens: list[int]) -> list[bytes]:
        return chunk_keys(self.ns, tokens)

    def close(self) -> None:
        for half in self.workers:
            half.shutdown()
        self.pool.close()
        os.unlink(self.pool_path)


def spec_blocks(first_block: int, num_chunks: int) -> tuple[tuple[int, ...], ...]:
    per = CHUNK // BLOCK
    return tuple(
        tuple(range(first_block + c * per, first_block + (c + 1) * per)) for c in range(num_chunks)
    )


def store_meta(req_id: str, keys: list[bytes], first_block: int) -> MaruConnectorMetadata:
    spec = StoreSpec(req_id=req_id, keys_by_rank=(tuple(keys),),
                     block_ids=spec_blocks(first_block, len(keys)))
    return MaruConnectorMetadata(stores=[spec])


def load_meta(req_id: str, keys: list[bytes], first_block: int, is_async: bool = False
              ) -> MaruConnectorMetadata:
    spec = LoadSpec(req_id=req_id, keys_by_rank=(tuple(keys),),
                    block_ids=spec_blocks(first_block, len(keys)), is_async=is_async)
    return MaruConnectorMetadata(loads=[spec])


def blocks_equal(kv_a, blocks_a, kv_b, blocks_b) -> bool:
    """Every layer's blocks ``blocks_a`` of ``kv_a`` equal ``blocks_b`` of ``kv_b``."""
    return all(
        same_bytes(kv_a[name][list(blocks_a)], kv_b[name][list(blocks_b)]) for name in kv_a
    )


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def save(half: MaruWorkerHalf, meta: MaruConnectorMetadata, commit: bool = True) -> None:
    """``wait_for_save`` of one step, then the scheduler's verdict on that
    step's stores, delivered with the next step as vLLM would."""
    half.wait_for_save(meta)
    half.wait_for_save(MaruConnectorMetadata(step=meta.step + 1, store_verdicts={meta.step: commit}))


def finished(half: MaruWorkerHalf, held=(), scheduled=()) -> tuple[set[str], set[str]]:
    """``get_finished`` of a step whose metadata names these held and scheduled
    requests: (finished sending, finished receiving)."""
    meta = MaruConnectorMetadata(held_req_ids=set(held), scheduled_req_ids=frozenset(scheduled))
    return half.get_finished(meta)[:2]


def report(half: MaruWorkerHalf, step: int = 0):
    """The worker's report on a step (``build_connector_worker_meta``)."""
    return half.build_worker_meta(MaruConnectorMetadata(step=step))


def wait_unpinned(env: WorkerEnv) -> None:
    """Every pin given back (loads unpin off the engine thread, shortly after their copies)."""
    wait_until(lambda: not +env.index.pins, 5.0, interval_s=0.01, what="every pin given back")


def step(half: MaruWorkerHalf, meta: MaruConnectorMetadata):
    """One engine step as vLLM's model runner drives the worker connector;
    returns the step's load errors and the worker's report."""
    half.handle_preemptions(meta)
    half.start_load_kv(meta)
    for i in range(LAYERS):
        half.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    save(half, meta)
    finished(half)
    return half.get_block_ids_with_load_errors(), report(half)
