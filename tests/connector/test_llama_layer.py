"""The benchmark's Llama stand-in on the CPU: its paged attention writes each
new token's K/V into the right block and offset, and attends exactly as
dense attention over the same (bf16-rounded) K/V would."""

from __future__ import annotations

import random

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
