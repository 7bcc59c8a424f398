"""Byte format of the objects that hold KV chunks in the pool.

A chunk is ``chunk_tokens`` tokens, i.e. ``blocks_per_chunk`` vLLM blocks. The
bytes of one block of one layer ("a block extent") are the block's segments
back to back, as ``KVCacheLayout.block_view`` yields them.

- layer extent: the ``blocks_per_chunk`` block extents of one layer of one
  chunk, in block order (``layer_bytes`` long).
- the storage format (``StorageFormat``) cuts a chunk's layer extents into
  objects; its strategy (``formats.py``) says where each extent sits, and
  everything below follows from that. Chunkwise (default): one object per
  chunk holding every layer, layer-major, so a layer's slice across several
  chunks is a strided piece (one row per chunk). Layerwise: one object per
  (chunk, layer), holding that layer extent only.

Objects hold raw KV bytes in the layout's own order, so only instances with
the same layout, dtype, block size and chunk size can share them; the key
namespace binds those.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from maru_core.storage_format import StorageFormat

from .formats import StorageStrategy, strategy_for
from .kv_layout import KVCacheLayout

__all__ = ["ObjectFormat"]


@dataclass(frozen=True)
class ObjectFormat:
    """How one worker's KV chunks are grouped into pool objects."""

    layout: KVCacheLayout
    chunk_tokens: int
    storage: StorageFormat

    def __post_init__(self) -> None:
        if isinstance(self.storage, bool):  # a layerwise flag, as older callers pass it
            object.__setattr__(self, "storage",
                               StorageFormat.LAYERWISE if self.storage else StorageFormat.CHUNKWISE)
        else:
            object.__setattr__(self, "storage", StorageFormat.parse(self.storage))
        bs = self.layout.block_size
        if self.chunk_tokens <= 0 or self.chunk_tokens % bs:
            raise ValueError(
                f"maru_kv_chunk_tokens={self.chunk_tokens} must be a positive "
                f"multiple of the KV cache block size {bs}"
            )

    @property
    def name(self) -> str:
        """The storage format as the key namespace spells it."""
        return self.storage.value

    @cached_property
    def strategy(self) -> StorageStrategy:
        """The storage format's answers (``formats.py``)."""
        return strategy_for(self.storage)

    @property
    def layerwise(self) -> bool:
        """One object per (chunk, layer): the flag the CUDA checksum kernel takes."""
        return self.storage is StorageFormat.LAYERWISE

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

    @cached_property
    def objects_per_chunk(self) -> int:
        """Objects of one chunk (the format's; 1 chunkwise, ``num_layers`` layerwise)."""
        return self.strategy.objects_per_chunk(self.num_layers)

    @property
    def object_bytes(self) -> int:
        """Size of one object (a format's objects are all the same size)."""
        return self.chunk_bytes // self.objects_per_chunk

    @property
    def chunk_bytes(self) -> int:
        """Bytes of every object of one chunk together."""
        return self.layer_bytes * self.num_layers

    @cached_property
    def layer_places(self) -> tuple[tuple[int, int], ...]:
        """Per layer position: (object of its chunk, byte offset in that object)."""
        return tuple(self.strategy.layer_place(layer, self.layer_bytes) for layer in range(self.num_layers))

    @cached_property
    def _due_at(self) -> tuple[tuple[int, ...], ...]:
        """Per layer position: the objects of a chunk whose last extent it is."""
        last = {obj: layer for layer, (obj, _) in enumerate(self.layer_places)}
        return tuple(tuple(sorted(obj for obj, at in last.items() if at == layer))
                     for layer in range(self.num_layers))

    def objects_due(self, num_chunks: int, layer: int) -> np.ndarray:
        """The objects of a load of ``num_chunks`` chunks (numbered chunk-major)
        whose every extent has arrived once layer ``layer`` has (layers land
        in true order)."""
        due = np.asarray(self._due_at[layer], dtype=np.int64)
        firsts = np.arange(num_chunks, dtype=np.int64) * self.objects_per_chunk
        return (firsts[:, None] + due[None, :]).ravel()

    def describe(self, obj: int) -> str:
        """Object ``obj`` of a load (numbered chunk-major), for a failure message."""
        chunk, which = divmod(obj, self.objects_per_chunk)
        return self.strategy.describe(chunk, which)

    def layer_extent(self, layer: int) -> tuple[int, int]:
        """``(offset, length)`` of layer ``layer``'s bytes inside its object.

        Chunkwise: the layer's slice of the chunk's object. Layerwise: the
        whole object (``(0, object_bytes)``), whatever the layer.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return self.layer_places[layer][1], self.layer_bytes

    def layer_source(self, sources: tuple[int, ...], layer: int) -> int:
        """Pool offset of layer ``layer``'s bytes of one chunk, given the
        chunk's object offsets (one per object of the chunk)."""
        obj, offset = self.layer_places[layer]
        return sources[obj] + offset
