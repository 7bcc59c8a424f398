"""Several requests' loads in flight at once: each request gets its own bytes, layer by layer.

The forward of a step that resumes several requests reads layer ``i`` of every
one of them as soon as ``wait_for_layer_load`` for layer ``i`` returns, while
later layers may still be copying. Each layer of each request is compared with
the writer's blocks at that moment, for both object formats and every load mode.
"""

from __future__ import annotations

import time

import pytest

from maru_connector.metadata import LoadSpec, MaruConnectorMetadata, StoreSpec

from worker_env import (BLOCK, CHUNK, LAYERS, WorkerEnv, finished, report, same_bytes, save, spec_blocks, tokens,
                        wait_unpinned)

LAYER = "model.layers.{}.self_attn.attn"
CHUNKS = (1, 2, 3)  # three requests of different lengths, as vLLM batches them


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _store_requests(env, writer):
    """Store three requests' chunks in one step; return (req_id, keys, writer block, reader block, chunks)."""
    requests, stores = [], []
    writer_block, reader_block = 0, 16
    for i, n in enumerate(CHUNKS):
        keys = env.keys(tokens(n * CHUNK, start=1000 * (i + 1)))
        stores.append(StoreSpec(req_id=f"w{i}", keys_by_rank=(tuple(keys),),
                                block_ids=spec_blocks(writer_block, n)))
        requests.append((f"r{i}", keys, writer_block, reader_block, n))
        per = CHUNK // BLOCK
        writer_block += per * n
        reader_block += per * n
    save(writer, MaruConnectorMetadata(stores=stores))
    return requests


def _wait_released(reader, req_ids, timeout=10.0):
    released: set[str] = set()
    deadline = time.monotonic() + timeout
    while released != req_ids:
        assert time.monotonic() < deadline, f"released only {released}"
        _, recving = finished(reader)
        assert not reader.get_block_ids_with_load_errors()
        released |= recving
        time.sleep(0.001)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "overlap"])
def test_each_layer_of_each_request_holds_its_own_bytes_when_the_forward_reads_it(
    env, layerwise, async_load, overlap
):
    writer, kv_w = env.worker(seed=1, maru_use_layerwise=layerwise, maru_async_store=False)
    knobs = {"maru_overlap_release_after_layers": 1} if overlap else {}
    reader, kv_r = env.worker(seed=2, maru_use_layerwise=layerwise, maru_async_load=async_load,
                              maru_overlap_load_with_compute=overlap, **knobs)
    requests = _store_requests(env, writer)
    per = CHUNK // BLOCK
    meta = MaruConnectorMetadata(loads=[
        LoadSpec(req_id=r, keys_by_rank=(tuple(k),), block_ids=spec_blocks(b, n), is_async=async_load)
        for r, k, _, b, n in requests
    ])
    reader.handle_preemptions(meta)
    reader.start_load_kv(meta)
    if async_load:  # the forward that reads them runs in a later step
        _wait_released(reader, {r for r, *_ in requests})
        meta = MaruConnectorMetadata()
        reader.start_load_kv(meta)

    wrong = []
    for i in reversed(range(LAYERS)):  # the forward may walk layers in any order
        name = LAYER.format(i)
        reader.wait_for_layer_load(name)
        for req_id, _, w0, r0, n in requests:
            if not same_bytes(kv_w[name][w0:w0 + per * n], kv_r[name][r0:r0 + per * n]):
                wrong.append((req_id, i))
    save(reader, meta)

    assert wrong == []
    wait_unpinned(env)  # async: the loader unpins last
