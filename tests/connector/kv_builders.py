"""Builders of KV cache tensors in every layout the transfer engine supports,
made the way vLLM makes them (one backing buffer, strided per-layer views),
and a layout-independent way to read one block's bytes. Needs torch only."""

from __future__ import annotations

import math
import random

import torch

# kind -> (logical per-layer shape, physical order of [L, *logical dims])
_PACKED_ORDER = {
    "cpu": (0, 1, 2, 3, 4),
    "packed_lbnhc": (0, 1, 3, 2, 4),
    "packed_lhbnc": (0, 2, 1, 3, 4),
    "packed_blhnc": (1, 0, 2, 3, 4),
    "packed_blnhc": (1, 0, 3, 2, 4),
    "packed_bhlnc": (1, 2, 0, 3, 4),
}
_SPLIT_ORDER = {
    "flash_nhd": (0, 1, 2, 3, 4, 5),
    "flash_hnd": (0, 1, 2, 4, 3, 5),
    "flashinfer_nhd": (0, 1, 2, 3, 4, 5),
    "flashinfer_hnd": (0, 1, 2, 4, 3, 5),
}
ALL_KINDS = tuple(_PACKED_ORDER) + tuple(_SPLIT_ORDER)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def logical_shape(kind, blocks, heads, block_size, head_size):
    if kind in _PACKED_ORDER:
        return (blocks, heads, block_size, 2 * head_size)
    if kind.startswith("flash_"):
        return (2, blocks, block_size, heads, head_size)
    return (blocks, 2, block_size, heads, head_size)


def _strides(shape, order):
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return strides


def make_kv_caches(kind, layers=3, blocks=12, heads=2, block_size=16, head_size=8,
                   dtype=torch.bfloat16, device="cpu", seed=0, shuffle=True):
    """Random KV caches, one strided view per layer of one backing buffer."""
    shape = logical_shape(kind, blocks, heads, block_size, head_size)
    order = _PACKED_ORDER.get(kind) or _SPLIT_ORDER[kind]
    full = (layers, *shape)
    strides = _strides(full, order)
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(full) * elem,), dtype=torch.uint8, generator=gen)
    backing = raw.to(device).view(dtype)
    views = {
        layer_name(i): torch.as_strided(backing, shape, strides[1:], i * strides[0])
        for i in range(layers)
    }
    if shuffle:  # never rely on dict order
        items = list(views.items())
        random.Random(seed).shuffle(items)
        views = dict(items)
    return views


def block_bytes(kind: str, tensor: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of logical block ``block`` of one layer, read by indexing."""
    if kind.startswith("flash_"):
        piece = tensor[:, block]
    else:
        piece = tensor[block]
    return piece.contiguous().view(torch.uint8).flatten().cpu()
