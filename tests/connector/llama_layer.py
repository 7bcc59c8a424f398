"""A Llama decoder stack over vLLM-style paged KV, for CUDA tests and the TTFT
benchmark: real per-layer compute, no vLLM.

Each layer is what vLLM runs for Llama-3: RMSNorm, fused QKV projection,
RoPE, attention over the request's paged KV blocks (the new tokens' K and V
written into their slots first, as vLLM's attention op does), output
projection, RMSNorm, SwiGLU MLP, residuals, in bf16 on the GPU.

Two ways to run a forward, both calling the connector between pieces:

- eager: every op launched from Python;
- piecewise: as vLLM's piecewise CUDA graph mode splits a model, everything
  but attention is captured in CUDA graphs, one piece from one layer's
  attention to the next (output projection and MLP of layer ``i - 1``, norm,
  QKV and RoPE of layer ``i``). Attention, with the connector's
  ``wait_for_layer_load`` before it, runs eagerly between the pieces.

The KV cache is the ``packed_lbnhc`` layout (vLLM's default on CUDA): per
layer ``[blocks, kv_heads, block_size, 2 * head]`` logically, block-major
with the token dimension outside the head dimension physically.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Geometry:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head: int = 128
    ffn: int = 14336
    layers: int = 32
    vocab: int = 32768  # Llama-3's is 128256; only the last token's logits are computed
    rope_theta: float = 500000.0
    eps: float = 1e-5

    def scaled(self, **changes) -> "Geometry":
        return replace(self, **changes)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head * 2  # K and V, bf16


LLAMA3_8B = Geometry()
TINY = Geometry(hidden=256, heads=4, kv_heads=2, head=64, ffn=512, layers=4, vocab=1024)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def paged_kv_caches(geo: Geometry, blocks: int, block_size: int, device,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's CUDA KV cache: one backing buffer, one strided view per layer,
    filled with random bits (never zeros: they hide unwritten blocks)."""
    shape = (blocks, geo.kv_heads, block_size, 2 * geo.head)
    full = (geo.layers, blocks, block_size, geo.kv_heads, 2 * geo.head)
    backing = torch.empty(math.prod(full), dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random(backing, gen)
    per_layer = math.prod(full[1:])
    strides = (block_size * geo.kv_heads * 2 * geo.head, 2 * geo.head,
               geo.kv_heads * 2 * geo.head, 1)
    return {layer_name(i): torch.as_strided(backing, shape, strides, i * per_layer)
            for i in range(geo.layers)}


def fill_random(t: torch.Tensor, gen: torch.Generator | None = None) -> None:
    """Random finite bf16 values (random bits would include NaNs, which the
    attention would spread; the comparisons are bitwise either way)."""
    t.normal_(0, 1, generator=gen)


@dataclass
class Batch:
    """The tokens one forward computes: per request, its new tokens, their
    positions, the slots they are written to and the slots of its context.

    Built once per forward, as vLLM's attention metadata builder does: each
    layer's attention then only launches its kernels (a slot is ``block *
    block_size + offset``, a token row of a layer's cache viewed as rows).
    """

    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64: where each new token's K/V is written
    last_index: torch.Tensor  # [requests] int64: index of each request's last token
    seqs: list[tuple[int, int, torch.Tensor]]  # (first, count, slots of the whole context)
    context: torch.Tensor  # every request's context slots, one after the other
    cu_q: torch.Tensor  # [requests + 1] int32: where each request's new tokens start
    cu_k: torch.Tensor  # [requests + 1] int32: where each request's context starts
    max_q: int
    max_k: int
    _gathered: dict = field(default_factory=dict)  # one gather buffer per layer shape

    @classmethod
    def build(cls, requests: Sequence[tuple[Sequence[int], int, Sequence[int]]],
              block_size: int, device) -> "Batch":
        """``requests``: (new tokens, first position, block ids of the whole context)."""
        toks, pos, slots, last, seqs = [], [], [], [], []
        offsets = torch.arange(block_size, dtype=torch.int64, device=device)
        for new, start, block_ids in requests:
            first = len(toks)
            toks.extend(new)
            p = list(range(start, start + len(new)))
            pos.extend(p)
            slots.extend(block_ids[q // block_size] * block_size + q % block_size for q in p)
            last.append(len(toks) - 1)
            table = torch.tensor(block_ids, dtype=torch.int64, device=device)
            context = (table[:, None] * block_size + offsets).view(-1)[:start + len(new)]
            seqs.append((first, len(new), context))

        def t(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype, device=device)

        counts = [c for _, c, _ in seqs]
        lengths = [len(c) for _, _, c in seqs]
        return cls(t(toks), t(pos), t(slots), t(last), seqs,
                   torch.cat([c for _, _, c in seqs]),
                   t(list(itertools.accumulate(counts, initial=0)), torch.int32),
                   t(list(itertools.accumulate(lengths, initial=0)), torch.int32),
                   max(counts), max(lengths))

    def gathered(self, rows: torch.Tensor, head: int):
        """A buffer for the context's rows of one layer, reused by every
        layer, and its K and V halves: ``(buffer, k, v)``."""
        key = (rows.shape[1:], rows.dtype, rows.device)
        if key not in self._gathered:
            buf = rows.new_empty((len(self.context),) + tuple(rows.shape[1:]))
            self._gathered[key] = (buf, buf[..., :head], buf[..., head:])
        return self._gathered[key]


def token_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache ``[blocks, kv_heads, block_size, 2 * head]`` (token
    dimension outside the head dimension in memory) as one row per token
    slot, ``[blocks * block_size, kv_heads, 2 * head]``: a view, so writes
    land in the cache (``view`` raises rather than copy)."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.transpose(1, 2).view(blocks * block_size, heads, width)


class LlamaStack:
    """Weights of ``geo.layers`` layers (random, scaled to keep activations finite)."""

    def __init__(self, geo: Geometry, device, seed: int = 0, max_positions: int = 65536,
                 out_in: bool = True):
        self.geo = geo
        # projections stored [out, in] and applied by F.linear, as vLLM's
        # linear layers are; False: [in, out] applied by ``x @ w`` (before;
        # the same GPU time on the H200: bench/RESULTS.md)
        self.out_in = out_in
        self.device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        # bf16 as vLLM runs it on the GPU; float32 on the CPU, where bf16
        # matrix products are emulated and slow (the KV cache stays bf16)
        bf = self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32

        def w(rows, cols):  # a projection from ``rows`` features to ``cols``
            shape = (cols, rows) if out_in else (rows, cols)
            out = torch.empty(shape, dtype=bf, device=device)
            return out.normal_(0, 1 / math.sqrt(rows), generator=gen)

        q_out = (geo.heads + 2 * geo.kv_heads) * geo.head
        self.embed = torch.empty(geo.vocab, geo.hidden, dtype=bf, device=device)
        self.embed.normal_(0, 1, generator=gen)
        self.layers = [
            dict(ln1=torch.ones(geo.hidden, dtype=bf, device=device), wqkv=w(geo.hidden, q_out),
                 wo=w(geo.heads * geo.head, geo.hidden),
                 ln2=torch.ones(geo.hidden, dtype=bf, device=device),
                 w13=w(geo.hidden, 2 * geo.ffn), w2=w(geo.ffn, geo.hidden))
            for _ in range(geo.layers)
        ]
        self.norm = torch.ones(geo.hidden, dtype=bf, device=device)
        self.lm_head = w(geo.hidden, geo.vocab)
        inv = 1.0 / geo.rope_theta ** (torch.arange(0, geo.head, 2, device=device) / geo.head)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
        self.cos, self.sin = freqs.cos().to(bf), freqs.sin().to(bf)
        self._flash_gqa: bool | None = None
        # one flash-attention kernel per layer for the whole batch (CUDA);
        # off: one per request (the A/B of bench/forward_host.py)
        self.varlen = True

    # ---- pieces (everything but attention) --------------------------------
    def _linear(self, x, weight):
        return F.linear(x, weight) if self.out_in else x @ weight

    def _rms(self, x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, self.geo.eps)

    def _rope(self, x, positions):  # x: [n, heads, head]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def pre_attention(self, i: int, h: torch.Tensor, positions: torch.Tensor):
        """Norm, QKV projection and RoPE of layer ``i``: (q, kv) with kv packed
        as the cache holds it, ``[n, kv_heads, 2 * head]``."""
        g, p = self.geo, self.layers[i]
        qkv = self._linear(self._rms(h, p["ln1"]), p["wqkv"])
        q, k, v = qkv.split([g.heads * g.head, g.kv_heads * g.head, g.kv_heads * g.head], -1)
        q = self._rope(q.view(-1, g.heads, g.head), positions)
        k = self._rope(k.view(-1, g.kv_heads, g.head), positions)
        return q, torch.cat((k, v.view(-1, g.kv_heads, g.head)), dim=-1)

    def post_attention(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = self.layers[i]
        h = h + self._linear(attn, p["wo"])
        gate, up = self._linear(self._rms(h, p["ln2"]), p["w13"]).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate) * up, p["w2"])

    def logits(self, h: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        return self._linear(self._rms(h[last_index], self.norm), self.lm_head)

    # ---- attention (eager, between pieces) --------------------------------
    def attention(self, kv_cache: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                  batch: Batch, out: torch.Tensor) -> None:
        """``attend`` over a layer's cache as vLLM allocates it."""
        self.attend(token_rows(kv_cache), q, kv, batch, out)

    def attend(self, rows: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               batch: Batch, out: torch.Tensor) -> None:
        """Write the new tokens' K/V into their slots (``rows``: a layer's
        cache as token rows), then attend over each request's whole context,
        read back from its slots; into ``out``.

        On CUDA this is vLLM's attention op but for one gather: the cache
        write, a gather of every request's context, one variable-length
        flash-attention kernel for the whole batch (vLLM's reads the blocks
        in place), the output copy. Elsewhere (or with ``varlen`` off), per
        request, by the math path on the CPU."""
        g = self.geo
        rows.index_copy_(0, batch.slots, kv.to(rows.dtype))
        if q.is_cuda and self.varlen:
            buf, k, v = batch.gathered(rows, g.head)
            torch.index_select(rows, 0, batch.context, out=buf)
            o = torch.ops.aten._flash_attention_forward(
                q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, True, False,
                scale=1 / math.sqrt(g.head))[0]
            out.view_as(o).copy_(o)
            return
        for first, count, context in batch.seqs:
            ctx = rows.index_select(0, context).to(q.dtype)  # [context, kv_heads, 2 * head]
            k, v = ctx.transpose(0, 1).split(g.head, dim=-1)
            qs = q[first:first + count].transpose(0, 1)
            o = self._attend(qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
            out[first:first + count].view(count, g.heads, g.head).copy_(o[0].transpose(0, 1))

    def _attend(self, q, k, v):
        """Causal attention aligned bottom-right (the new tokens are the last
        of the context), grouped-query heads."""
        if q.is_cuda and self._flash_gqa is not False:
            try:
                out = torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, is_causal=True, scale=1 / math.sqrt(self.geo.head))[0]
                self._flash_gqa = True
                return out
            except RuntimeError:
                self._flash_gqa = False
        return reference_attention(q, k, v)


def reference_attention(q, k, v):
    """Bottom-right causal grouped-query attention by the math path."""
    n, s = q.shape[-2], k.shape[-2]
    mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


WaitFn = Callable[[str], None]


def _no_wait(name: str) -> None:
    return None


class EagerForward:
    """One forward, every op launched eagerly; ``wait(layer_name)`` before
    each layer's attention (the connector's ``wait_for_layer_load``)."""

    def __init__(self, model: LlamaStack, kv_caches: dict[str, torch.Tensor]):
        self.model = model
        self.rows = [token_rows(kv_caches[layer_name(i)]) for i in range(model.geo.layers)]

    def __call__(self, batch: Batch, wait: WaitFn = _no_wait) -> torch.Tensor:
        m, g = self.model, self.model.geo
        h = m.embed[batch.tokens]
        attn = torch.empty(len(batch.tokens), g.heads * g.head, dtype=h.dtype, device=h.device)
        for i in range(g.layers):
            q, kv = m.pre_attention(i, h, batch.positions)
            wait(layer_name(i))
            m.attend(self.rows[i], q, kv, batch, attn)
            h = m.post_attention(i, h, attn)
        return m.logits(h, batch.last_index)


class PiecewiseForward:
    """The forward of one batch shape as vLLM's piecewise CUDA graphs run it:
    ``layers + 1`` captured pieces, attention eager between them.

    Captured once for a batch (its token count and requests' last indices);
    later batches of the same shape are copied into the static inputs.
    """

    def __init__(self, model: LlamaStack, kv_caches: dict[str, torch.Tensor], batch: Batch):
        self.model = model
        g = model.geo
        self.rows = [token_rows(kv_caches[layer_name(i)]) for i in range(g.layers)]
        self.tokens = batch.tokens.clone()
        self.positions = batch.positions.clone()
        self.last_index = batch.last_index.clone()
        n = len(batch.tokens)
        self.attn = torch.zeros(n, g.heads * g.head, dtype=model.dtype, device=model.device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[tuple] = []
        self._capture()

    def _piece(self, i: int):
        m, g = self.model, self.model.geo
        if i == 0:
            h = m.embed[self.tokens]
        else:
            h = m.post_attention(i - 1, self.outputs[i - 1][0], self.attn)
        if i == g.layers:
            return (h, m.logits(h, self.last_index))
        q, kv = m.pre_attention(i, h, self.positions)
        return (h, q, kv)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (cuBLAS handles)
            for i in range(self.model.geo.layers + 1):
                self.outputs.append(self._piece(i))
        torch.cuda.current_stream().wait_stream(side)
        self.outputs = []
        for i in range(self.model.geo.layers + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._piece(i)
            self.graphs.append(graph)
            self.outputs.append(out)

    def __call__(self, batch: Batch, wait: WaitFn = _no_wait) -> torch.Tensor:
        m = self.model
        self.tokens.copy_(batch.tokens, non_blocking=True)
        self.positions.copy_(batch.positions, non_blocking=True)
        self.last_index.copy_(batch.last_index, non_blocking=True)
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < m.geo.layers:
                _, q, kv = self.outputs[i]
                wait(layer_name(i))
                m.attend(self.rows[i], q, kv, batch, self.attn)
        return self.outputs[-1][1]
