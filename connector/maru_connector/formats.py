"""One strategy per storage format: how a chunk's KV is cut into pool objects.

``maru_core.storage_format.StorageFormat`` names the formats; this module
holds, for each, the one object that answers every question whose answer
depends on the format, so no other module branches on it:

- how many objects a chunk has (``objects_per_chunk``);
- where a layer's extent sits: which object of its chunk and at which byte
  offset in it (``layer_place``); the object sizes, the per-layer pool
  sources, the payload-check pieces and the objects due when a layer lands
  all follow from this (``ObjectFormat``, ``transfer/plan.py``,
  ``transfer/checks.py``);
- the keys of a chunk's objects, chunk-major (``object_keys``);
- the slot header's format code (``slot_format``) and how a failure names
  an object (``describe``).

A new format: a value in ``StorageFormat`` (and ``SlotFormat``), one class
here, and its row in ``STRATEGIES``. Its objects must all be the same size
(the index hands out slots of one object size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from maru_core.keys import KEY_BYTES, packed_layer_keys
from maru_core.pool.slots import SlotFormat
from maru_core.storage_format import StorageFormat

__all__ = [
    "STRATEGIES",
    "ChunkwiseFormat",
    "LayerwiseFormat",
    "StorageStrategy",
    "configured_format",
    "strategy_for",
]


class StorageStrategy(Protocol):
    """What one storage format decides; see the module doc."""

    @property
    def storage(self) -> StorageFormat:
        """The format this strategy implements."""
        ...

    @property
    def slot_format(self) -> SlotFormat:
        """The format code written into its objects' slot headers."""
        ...

    def objects_per_chunk(self, num_layers: int) -> int:
        """Objects of one chunk of a model of ``num_layers`` layers."""
        ...

    def layer_place(self, layer: int, layer_bytes: int) -> tuple[int, int]:
        """``(object of the chunk, byte offset in it)`` of layer position
        ``layer``'s extent (``layer_bytes`` long)."""
        ...

    def object_keys(self, chunk_keys: Iterable[bytes], layers: Sequence[int]) -> bytes:
        """The keys of these chunks' objects, packed end to end: chunk-major,
        then object. ``layers``: the true index of each layer position."""
        ...

    def describe(self, chunk: int, obj: int) -> str:
        """Object ``obj`` of a load's chunk ``chunk``, for a failure message."""
        ...


class ChunkwiseFormat:
    """One object per chunk holding every layer, layer-major: layer ``i``'s
    extent at ``i * layer_bytes`` (fewest objects, one key per chunk)."""

    storage = StorageFormat.CHUNKWISE
    slot_format = SlotFormat.CHUNKWISE

    def objects_per_chunk(self, num_layers: int) -> int:
        return 1

    def layer_place(self, layer: int, layer_bytes: int) -> tuple[int, int]:
        return 0, layer * layer_bytes

    def object_keys(self, chunk_keys: Iterable[bytes], layers: Sequence[int]) -> bytes:
        keys = list(chunk_keys)
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * len(keys):
            raise ValueError(f"chunk keys must be {KEY_BYTES} bytes each")
        return packed

    def describe(self, chunk: int, obj: int) -> str:
        return f"the object of chunk {chunk} of the load"


class LayerwiseFormat:
    """One object per (chunk, layer) holding that layer's extent only, so each
    layer is stored, verified and loaded on its own."""

    storage = StorageFormat.LAYERWISE
    slot_format = SlotFormat.LAYERWISE

    def objects_per_chunk(self, num_layers: int) -> int:
        return num_layers

    def layer_place(self, layer: int, layer_bytes: int) -> tuple[int, int]:
        return layer, 0

    def object_keys(self, chunk_keys: Iterable[bytes], layers: Sequence[int]) -> bytes:
        return packed_layer_keys(chunk_keys, layers)

    def describe(self, chunk: int, obj: int) -> str:
        return f"the object of chunk {chunk}, layer {obj} of the load"


#: The strategy of each storage format.
STRATEGIES: dict[StorageFormat, StorageStrategy] = {
    StorageFormat.CHUNKWISE: ChunkwiseFormat(),
    StorageFormat.LAYERWISE: LayerwiseFormat(),
}


def strategy_for(storage: StorageFormat) -> StorageStrategy:
    """The strategy of ``storage``."""
    return STRATEGIES[storage]


class _FormatKnob(Protocol):
    """What ``configured_format`` reads of a ``MaruConfig`` (typed structurally:
    the config imports the transfer checks, which import this module)."""

    @property
    def fmt_name(self) -> str: ...


def configured_format(cfg: _FormatKnob) -> StorageFormat:
    """The storage format a ``MaruConfig`` asks for (``maru_use_layerwise``):
    the one place the connector reads it from its knobs."""
    return StorageFormat.parse(cfg.fmt_name)
