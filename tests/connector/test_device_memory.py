"""The GPU memory the CUDA transfer engine takes beside vLLM's KV cache.

vLLM sizes its KV cache before the connector's worker registers it, so the
engine's staging must fit in the headroom ``gpu_memory_utilization`` leaves;
``docs/connector.md`` ("GPU memory") gives the figure users size by. These
tests hold the engine to that figure: its arithmetic on the CPU, and what it
really allocates on a GPU.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from maru_connector.transfer.cuda import staging_sizes

MIB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs" / "connector.md"
# A Llama-3-8B-shaped chunk of 256 tokens: 8 KV heads of 128, K and V, bf16.
LLAMA_8B_LAYER_BYTES = 256 * 8 * 128 * 2 * 2


def test_the_documented_staging_is_what_the_engine_takes_for_llama_8b():
    ring, store, head = staging_sizes(SimpleNamespace(layer_bytes=LLAMA_8B_LAYER_BYTES))
    documented = re.search(r"takes (\d+) MiB of GPU memory", DOCS.read_text())
    assert documented, "docs/connector.md no longer states the connector's GPU memory"
    assert (ring + store + head) // MIB == int(documented.group(1))


def test_staging_holds_whole_layer_rows():
    ring, store, _ = staging_sizes(SimpleNamespace(layer_bytes=3 * MIB), staging_bytes=64 * MIB)
    assert store == 21 * 3 * MIB and ring == 2 * store  # 21 rows of 3 MiB fit in 64 MiB
    ring, store, _ = staging_sizes(SimpleNamespace(layer_bytes=100 * MIB), staging_bytes=64 * MIB)
    assert store == 100 * MIB  # a row larger than the budget still gets one


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; run on an H200: "
                    "bench/RESULTS.md (CUDA tests)")
def test_the_engine_allocates_what_it_declares():
    from kv_builders import make_kv_caches
    from maru_connector.transfer import create_engine
    from maru_connector.kv_layout import detect_kv_layout
    from maru_connector.object_format import ObjectFormat

    kv = make_kv_caches("flash_nhd", layers=4, blocks=64, heads=8, block_size=16, head_size=128,
                        dtype=torch.bfloat16, seed=0, device="cuda")
    fmt = ObjectFormat(detect_kv_layout(kv), 256, False)
    pool = mmap.mmap(-1, 64 * MIB, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = create_engine(memoryview(pool), kv, fmt)
    try:
        torch.cuda.synchronize()
        taken = torch.cuda.memory_allocated() - before
        declared = engine.device_bytes(with_head_start=False)
        assert declared <= taken <= declared + 4 * MIB  # checksum scratch and caches aside
        assert engine.device_bytes() == declared + staging_sizes(fmt)[2]
    finally:
        engine.close()
