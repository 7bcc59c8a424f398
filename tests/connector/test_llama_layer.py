"""The benchmark's Llama stand-in: its paged attention writes each new
token's K/V into the right block and offset, and attends exactly as dense
attention over the same (bf16-rounded) K/V would (on the CPU; on CUDA, the
batch-wide flash kernel against float64 math)."""

from __future__ import annotations

import random

import pytest
import torch

from llama_layer import TINY, Batch, LlamaStack, paged_kv_caches, reference_attention

BLOCK = 16


def _dense(model, q, k, v):
    g = model.geo
    return reference_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                               v.transpose(0, 1)[None])[0].transpose(0, 1).reshape(len(q), -1)


def test_paged_attention_writes_the_slots_and_equals_dense_attention():
    torch.manual_seed(0)
    geo = TINY.scaled(layers=1)
    model = LlamaStack(geo, "cpu")
    kv_cache = next(iter(paged_kv_caches(geo, 40, BLOCK, "cpu").values()))
    blocks = random.Random(1).sample(range(40), 12)  # not contiguous, not in order
    k_all, v_all = [], []
    for start, count in ((0, 150), (150, 7)):  # a prefill, then a few tokens on top of it
        batch = Batch.build([(list(range(count)), start, blocks)], BLOCK, "cpu")
        q = torch.randn(count, geo.heads, geo.head)
        kv = torch.randn(count, geo.kv_heads, 2 * geo.head)
        out = torch.zeros(count, geo.heads * geo.head)
        model.attention(kv_cache, q, kv, batch, out)

        for i, pos in enumerate(range(start, start + count)):  # the cache's own indexing
            block, offset = blocks[pos // BLOCK], pos % BLOCK
            assert torch.equal(kv_cache[block, :, offset], kv[i].to(kv_cache.dtype))
        rounded = kv.to(kv_cache.dtype).float()
        k_all.append(rounded[..., :geo.head])
        v_all.append(rounded[..., geo.head:])
        want = _dense(model, q, torch.cat(k_all), torch.cat(v_all))
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)


def test_a_batch_of_two_requests_attends_each_over_its_own_blocks():
    torch.manual_seed(1)
    geo = TINY.scaled(layers=1)
    model = LlamaStack(geo, "cpu")
    kv_cache = next(iter(paged_kv_caches(geo, 20, BLOCK, "cpu").values()))
    a_blocks, b_blocks = [3, 9, 1], [12, 0]
    batch = Batch.build([(list(range(40)), 0, a_blocks), (list(range(20)), 0, b_blocks)],
                        BLOCK, "cpu")
    q = torch.randn(60, geo.heads, geo.head)
    kv = torch.randn(60, geo.kv_heads, 2 * geo.head)
    out = torch.zeros(60, geo.heads * geo.head)
    model.attention(kv_cache, q, kv, batch, out)
    rounded = kv.to(kv_cache.dtype).float()
    for rows in (slice(0, 40), slice(40, 60)):
        want = _dense(model, q[rows], rounded[rows, :, :geo.head], rounded[rows, :, geo.head:])
        assert torch.allclose(out[rows], want, atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs an NVIDIA GPU; run on an H200: bench/RESULTS.md (CUDA tests)")
def test_the_batch_wide_flash_kernel_equals_dense_attention_per_request():
    """On CUDA one variable-length kernel attends for the whole batch: a
    prefill of 300 tokens and a one-token request over 1,000 cached ones,
    each over its own scattered blocks, as float64 math does."""
    torch.manual_seed(2)
    geo = TINY.scaled(layers=1, heads=8, kv_heads=2, head=128)
    model = LlamaStack(geo, "cuda")
    kv_cache = next(iter(paged_kv_caches(geo, 120, BLOCK, "cuda").values()))
    order = random.Random(3).sample(range(120), 120)
    a_blocks, b_blocks = order[:19], order[19:19 + 63]
    batch = Batch.build([(list(range(300)), 0, a_blocks), ([5], 1000, b_blocks)], BLOCK, "cuda")
    q = torch.randn(301, geo.heads, geo.head, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(301, geo.kv_heads, 2 * geo.head, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(301, geo.heads * geo.head, device="cuda", dtype=torch.bfloat16)
    model.attention(kv_cache, q, kv, batch, out)
    assert model.varlen, "the variable-length kernel was not used"
    rows = kv_cache.transpose(1, 2).reshape(-1, geo.kv_heads, 2 * geo.head).double()
    for (first, count, context) in batch.seqs:
        ctx = rows[context]
        want = _dense(model, q[first:first + count].double(), ctx[..., :geo.head],
                      ctx[..., geo.head:])
        got = out[first:first + count].double()
        err = float((got - want).norm() / want.norm())
        assert err < 2e-2, (first, count, err)
