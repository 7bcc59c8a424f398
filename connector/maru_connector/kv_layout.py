"""Detect the layout of vLLM's paged KV cache from tensor shapes and strides.

vLLM has changed how it lays out KV blocks between releases and between
attention backends. A connector that assumes a shape writes to wrong
addresses, so this module matches the tensors handed to
``KVConnectorBase_V1.register_kv_caches`` against the layouts it knows, by
shape *and* strides, and refuses anything else with an error that names what
it saw.

Whatever the layout, the bytes of one block of one layer are ``block_segments``
contiguous runs of ``segment_bytes`` bytes, ``segment_stride_bytes`` apart
(one run for packed layouts; K and V for kv-first layouts; one run per head for
head-outer layouts). Objects in the pool store those runs back to back, so
``block_bytes_per_layer = block_segments * segment_bytes``.

This module imports torch only: no vLLM, so the CUDA copy path runs where
vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

__all__ = [
    "KVCacheLayout",
    "SUPPORTED_LAYOUTS",
    "UnsupportedKVLayout",
    "detect_kv_layout",
    "parse_layer_index",
]


class UnsupportedKVLayout(ValueError):
    """The KV cache tensors match no supported layout; never guessed."""


# kind -> what it is, for error messages and docs.
SUPPORTED_LAYOUTS: Mapping[str, str] = {
    "cpu": "(num_blocks, kv_heads, block_size, 2*head_size) contiguous "
    "(vLLM CPU backend; vLLM >= 0.32 layout LBHNC)",
    "packed_lbnhc": "(num_blocks, kv_heads, block_size, 2*head_size) with "
    "block_size outside kv_heads in memory (vLLM >= 0.32 LBNHC, NHD)",
    "packed_blhnc": "(num_blocks, kv_heads, block_size, 2*head_size), "
    "layers interleaved per block (vLLM >= 0.32 BLHNC)",
    "packed_blnhc": "(num_blocks, kv_heads, block_size, 2*head_size), "
    "layers interleaved per block, NHD inside (vLLM >= 0.32 BLNHC)",
    "packed_lhbnc": "(num_blocks, kv_heads, block_size, 2*head_size) with "
    "kv_heads outermost (vLLM >= 0.32 LHBNC)",
    "packed_bhlnc": "(num_blocks, kv_heads, block_size, 2*head_size) with "
    "layers between heads and tokens (vLLM >= 0.32 BHLNC)",
    "flash_nhd": "(2, num_blocks, block_size, kv_heads, head_size) contiguous "
    "(flash-attention, NHD)",
    "flash_hnd": "(2, num_blocks, block_size, kv_heads, head_size) with HND "
    "stride order (0, 1, 3, 2, 4)",
    "flashinfer_nhd": "(num_blocks, 2, block_size, kv_heads, head_size) "
    "contiguous (FlashInfer, NHD)",
    "flashinfer_hnd": "(num_blocks, 2, block_size, kv_heads, head_size) with "
    "HND stride order (0, 1, 3, 2, 4)",
}


@dataclass(frozen=True)
class KVCacheLayout:
    """The layout of every layer's KV cache in one vLLM worker.

    Positions: the transfer API numbers layers ``0 .. num_layers-1`` in true
    model order; ``layer_names[i]`` is the vLLM layer at position ``i`` and
    ``layer_indices[i]`` its model layer index (equal to ``i`` unless the
    worker holds only some layers, e.g. a pipeline stage).
    """

    kind: str
    layer_names: tuple[str, ...]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_bytes_per_layer: int
    layer_indices: tuple[int, ...] = ()
    block_stride_bytes: int = 0
    block_segments: int = 1
    segment_bytes: int = 0
    segment_stride_bytes: int = 0
    # Byte distance between consecutive layers when every layer is a view of
    # one buffer at a constant stride (vLLM allocates it that way); else None.
    layer_stride_bytes: int | None = None
    _positions: Mapping[str, int] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.layer_indices:
            object.__setattr__(
                self, "layer_indices", tuple(range(len(self.layer_names)))
            )
        object.__setattr__(
            self, "_positions", {n: i for i, n in enumerate(self.layer_names)}
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def blocks_contiguous(self) -> bool:
        """True when adjacent blocks of a layer are adjacent in memory."""
        return (
            self.block_segments == 1
            and self.block_stride_bytes == self.block_bytes_per_layer
        )

    def position(self, layer_name: str) -> int:
        """Position (true layer order) of a vLLM layer name."""
        try:
            return self._positions[layer_name]
        except KeyError:
            raise KeyError(
                f"unknown KV cache layer {layer_name!r}; known layers are "
                f"{self.layer_names[:3]}... ({self.num_layers} in all)"
            ) from None

    def block_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """A uint8 view ``[num_blocks, block_segments, segment_bytes]`` of one
        layer's tensor: row ``b`` is block ``b``'s bytes in object order."""
        elem = kv_cache.element_size()
        flat = kv_cache.view(torch.uint8)
        return torch.as_strided(
            flat,
            (self.num_blocks, self.block_segments, self.segment_bytes),
            (self.block_stride_bytes, self.segment_stride_bytes, 1),
            kv_cache.storage_offset() * elem,
        )


# ---------------------------------------------------------------- layer names

_LAYERS_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def parse_layer_index(layer_name: str) -> int:
    """Model layer index of a vLLM attention layer name.

    ``model.layers.7.self_attn.attn`` -> 7. Names without a ``layers.N``
    component must hold exactly one integer component (vLLM's own rule).
    """
    match = _LAYERS_RE.search(layer_name)
    if match:
        return int(match.group(1))
    ints = [part for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise UnsupportedKVLayout(
            f"cannot find the layer index in KV cache layer name "
            f"{layer_name!r}: expected a 'layers.N' component or exactly one "
            "integer component, as in 'model.layers.0.self_attn.attn'"
        )
    return int(ints[0])


def _order_layers(names) -> tuple[tuple[str, ...], tuple[int, ...]]:
    indexed = sorted((parse_layer_index(n), n) for n in names)
    indices = [i for i, _ in indexed]
    dupes = sorted({i for i in indices if indices.count(i) > 1})
    if dupes:
        clash = [n for i, n in indexed if i == dupes[0]]
        raise UnsupportedKVLayout(
            f"KV cache layers {clash} share layer index {dupes[0]}; one KV "
            "cache per model layer is supported"
        )
    return tuple(n for _, n in indexed), tuple(indices)


# ------------------------------------------------------------------ matching


@dataclass(frozen=True)
class _Geometry:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    block_stride: int  # elements
    segments: int
    segment_elems: int
    segment_stride: int  # elements


def _strides_match(shape, strides, expected) -> bool:
    # Dimensions of size 1 have no meaningful stride.
    return all(n == 1 or s == e for n, s, e in zip(shape, strides, expected))


def _interleave(stride: int, unit: int) -> int:
    """How many layers share a stride of ``stride`` over a dense ``unit``."""
    return stride // unit if unit and stride % unit == 0 else 0


def _match_packed(kind: str, shape, st) -> _Geometry | None:
    """4-D ``[B, H, N, C]`` layouts, K and V packed into C (vLLM >= 0.32)."""
    if len(shape) != 4 or shape[3] % 2:
        return None
    nb, h, n, c = shape
    page = h * n * c
    if kind == "cpu":
        exp, seg, nseg, sstride = (page, n * c, c, 1), page, 1, 0
    elif kind == "packed_lbnhc":
        exp, seg, nseg, sstride = (page, c, h * c, 1), page, 1, 0
    elif kind in ("packed_blhnc", "packed_blnhc"):
        layers = _interleave(st[0], page)
        if layers < 2:
            return None
        inner = (n * c, c) if kind == "packed_blhnc" else (c, h * c)
        exp, seg, nseg, sstride = (layers * page, *inner, 1), page, 1, 0
    elif kind == "packed_lhbnc":
        exp = (n * c, nb * n * c, c, 1)
        seg, nseg, sstride = n * c, h, nb * n * c
    elif kind == "packed_bhlnc":
        layers = _interleave(st[1], n * c)
        if layers < 2:
            return None
        exp = (h * layers * n * c, layers * n * c, c, 1)
        seg, nseg, sstride = n * c, h, layers * n * c
    else:
        return None
    if not _strides_match(shape, st, exp):
        return None
    return _Geometry(nb, n, h, c // 2, exp[0], nseg, seg, sstride)


def _match_split(kind: str, shape, st) -> _Geometry | None:
    """5-D layouts with K and V in separate halves of a kv dimension of 2."""
    if len(shape) != 5:
        return None
    kv_first = kind.startswith("flash_")
    kv_dim, block_dim = (0, 1) if kv_first else (1, 0)
    if shape[kv_dim] != 2:
        return None
    nb, n, h, d = shape[block_dim], shape[2], shape[3], shape[4]
    half = n * h * d
    inner = (h * d, d, 1) if kind.endswith("_nhd") else (d, n * d, 1)
    if kv_first:
        exp = (nb * half, half, *inner)
        geo = _Geometry(nb, n, h, d, half, 2, half, nb * half)
    else:
        exp = (2 * half, half, *inner)
        geo = _Geometry(nb, n, h, d, 2 * half, 1, 2 * half, 0)
    return geo if _strides_match(shape, st, exp) else None


_MATCHERS: dict[str, Callable] = {
    kind: (_match_split if kind.startswith("flash") else _match_packed)
    for kind in SUPPORTED_LAYOUTS
}


def _classify(shape, strides) -> tuple[str, _Geometry]:
    found = []
    for kind, matcher in _MATCHERS.items():
        geo = matcher(kind, shape, strides)
        if geo is not None:
            if geo.segments == 1:  # one segment per block: the stride between segments means nothing
                geo = dataclasses.replace(geo, segment_stride=0)
            found.append((kind, geo))
    # Size-1 dimensions can make several layouts fit; they are the same bytes
    # when the geometry agrees, otherwise the tensor is truly ambiguous.
    if found and all(g == found[0][1] for _, g in found):
        return found[0]
    seen = f"shape {tuple(shape)} strides {tuple(strides)}"
    if found:
        raise UnsupportedKVLayout(
            f"KV cache tensor with {seen} is ambiguous: it fits "
            f"{[k for k, _ in found]} with different geometries; MaruCache cannot tell where "
            "its blocks lie, so it refuses to guess"
        )
    supported = "; ".join(f"{k}: {v}" for k, v in SUPPORTED_LAYOUTS.items())
    raise UnsupportedKVLayout(
        f"unsupported KV cache layout: {seen}. Supported layouts: {supported}"
    )


# ----------------------------------------------------------------- detection


def _common_layer_stride(tensors: list[torch.Tensor]) -> int | None:
    if len(tensors) < 2:
        return None
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    elem = first.element_size()
    if any(t.untyped_storage().data_ptr() != base for t in tensors):
        return None
    offsets = [t.storage_offset() * elem for t in tensors]
    stride = offsets[1] - offsets[0]
    if stride <= 0:
        return None
    for a, b in zip(offsets, offsets[1:]):
        if b - a != stride:
            return None
    return int(stride)


def detect_kv_layout(
    kv_caches: dict[str, torch.Tensor], block_size: int | None = None
) -> KVCacheLayout:
    """Detect the layout of the tensors vLLM hands to ``register_kv_caches``.

    Args:
        kv_caches: layer name -> that layer's KV cache tensor.
        block_size: vLLM's block size (tokens per block id the scheduler hands
            out). When the attention kernel splits a block into smaller kernel
            blocks (``tensor.shape[0]`` = ``num_blocks * ratio``), the kernel
            blocks are grouped back so block ids match the scheduler's.

    Raises:
        UnsupportedKVLayout: no tensors, a layout that is not supported, layers
            that disagree on layout, or layer names without a layer index.
    """
    if not kv_caches:
        raise UnsupportedKVLayout("no KV cache tensors were registered")
    names, indices = _order_layers(kv_caches)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    for name, t in zip(names, tensors):
        if (t.shape, t.stride(), t.dtype) != (first.shape, first.stride(), first.dtype):
            raise UnsupportedKVLayout(
                f"KV cache layers disagree: {names[0]!r} is {tuple(first.shape)} "
                f"strides {first.stride()} {first.dtype}, {name!r} is "
                f"{tuple(t.shape)} strides {t.stride()} {t.dtype}; all layers "
                "must share one layout"
            )
    kind, geo = _classify(tuple(first.shape), tuple(first.stride()))
    geo = _group_kernel_blocks(geo, kind, block_size)
    elem = first.element_size()
    seg_bytes = geo.segment_elems * elem
    return KVCacheLayout(
        kind=kind,
        layer_names=names,
        num_blocks=geo.num_blocks,
        block_size=geo.block_size,
        num_kv_heads=geo.num_kv_heads,
        head_size=geo.head_size,
        dtype=first.dtype,
        block_bytes_per_layer=geo.segments * seg_bytes,
        layer_indices=indices,
        block_stride_bytes=geo.block_stride * elem,
        block_segments=geo.segments,
        segment_bytes=seg_bytes,
        segment_stride_bytes=geo.segment_stride * elem,
        layer_stride_bytes=_common_layer_stride(tensors),
    )


def _group_kernel_blocks(geo: _Geometry, kind: str, block_size: int | None) -> _Geometry:
    if block_size is None or block_size == geo.block_size:
        return geo
    ratio, rest = divmod(block_size, geo.block_size)
    dense = geo.segments == 1 and geo.block_stride == geo.segment_elems
    if rest or geo.num_blocks % ratio or not dense:
        raise UnsupportedKVLayout(
            f"vLLM block size {block_size} is not a whole number of the "
            f"{kind} cache's dense {geo.block_size}-token kernel blocks "
            f"({geo.num_blocks} kernel blocks); set the KV cache block size "
            "to the kernel block size"
        )
    return _Geometry(
        geo.num_blocks // ratio, block_size, geo.num_kv_heads, geo.head_size,
        geo.block_stride * ratio, 1, geo.segment_elems * ratio, 0,
    )
