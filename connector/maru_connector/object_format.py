"""Byte format of the objects that hold KV chunks in the pool.

A chunk is ``chunk_tokens`` tokens, i.e. ``blocks_per_chunk`` vLLM blocks. The
bytes of one block of one layer ("a block extent") are the block's segments
back to back, as ``KVCacheLayout.block_view`` yields them.

- layer extent: the ``blocks_per_chunk`` block extents of one layer of one
  chunk, in block order (``layer_bytes`` long).
- chunkwise (default): one object per chunk holding every layer, layer-major:
  layer ``i``'s extent is at ``i * layer_bytes``. A layer's slice across
  several chunks is therefore a strided piece (one row per chunk).
- layerwise: one object per (chunk, layer), holding that layer extent only.

Objects hold raw KV bytes in the layout's own order, so only instances with
the same layout, dtype, block size and chunk size can share them; the key
namespace binds those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

from .kv_layout import KVCacheLayout

__all__ = ["ObjectFormat"]


@dataclass(frozen=True)
class ObjectFormat:
    """How one worker's KV chunks are grouped into pool objects."""

    layout: KVCacheLayout
    chunk_tokens: int
    layerwise: bool

    def __post_init__(self) -> None:
        bs = self.layout.block_size
        if self.chunk_tokens <= 0 or self.chunk_tokens % bs:
            raise ValueError(
                f"maru_kv_chunk_tokens={self.chunk_tokens} must be a positive "
                f"multiple of the KV cache block size {bs}"
            )

    @property
    def name(self) -> str:
        """``"layerwise"`` or ``"chunkwise"``, as the key namespace spells it."""
        return "layerwise" if self.layerwise else "chunkwise"

    @cached_property
    def fingerprint(self) -> int:
        """A u64 naming how this worker's objects arrange their bytes: the KV layout
        it detected (kind, geometry, dtype, the true indices of its layers) and the
        object format. Written into every slot header; a reader refuses an object
        whose fingerprint is not its own, whatever the key says. Never 0."""
        lay = self.layout
        text = "|".join(
            str(part)
            for part in (
                lay.kind, lay.block_size, lay.num_kv_heads, lay.head_size, lay.dtype,
                lay.block_segments, lay.segment_bytes, ",".join(map(str, lay.layer_indices)),
                self.chunk_tokens, self.name,
            )
        )
        digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"maru.layout").digest()
        return int.from_bytes(digest, "little") or 1

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.layout.block_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one chunk."""
        return self.blocks_per_chunk * self.layout.block_bytes_per_layer

    @property
    def objects_per_chunk(self) -> int:
        """1 (chunkwise) or ``num_layers`` (layerwise)."""
        return self.num_layers if self.layerwise else 1

    @property
    def object_bytes(self) -> int:
        """Size of one object."""
        return self.layer_bytes if self.layerwise else self.layer_bytes * self.num_layers

    @property
    def chunk_bytes(self) -> int:
        """Bytes of every object of one chunk together."""
        return self.layer_bytes * self.num_layers

    def layer_extent(self, layer: int) -> tuple[int, int]:
        """``(offset, length)`` of layer ``layer``'s bytes inside its object.

        Chunkwise: the layer's slice of the chunk's object. Layerwise: the
        whole object (``(0, object_bytes)``), whatever the layer.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if self.layerwise:
            return 0, self.layer_bytes
        return layer * self.layer_bytes, self.layer_bytes

    def layer_source(self, sources: tuple[int, ...], layer: int) -> int:
        """Pool offset of layer ``layer``'s bytes of one chunk, given the
        chunk's object offsets (one for chunkwise, one per layer layerwise)."""
        if self.layerwise:
            return sources[layer]
        return sources[0] + self.layer_extent(layer)[0]
