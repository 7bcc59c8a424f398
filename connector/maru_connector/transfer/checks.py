"""What a verified load checks, and where in the load each object is due.

A load's objects are numbered as their keys are sent (``resolve.py``):
chunk-major, then layer position; a chunkwise object is its chunk. The
bytes of one (chunk, layer) extent are a piece of one object, starting at
word ``layer * layer_bytes / 4`` of a chunkwise object and at word 0 of a
layerwise one, so each engine sums the pieces it received with
``maru_core.pool.checksum``'s global position weights and compares an
object's total once all its pieces are in:

- layerwise: an object is one layer, so every layer is checked on its own,
  before the layer is handed to anyone waiting for it;
- chunkwise: an object holds every layer, and its header records one
  checksum for all of them, so the objects are compared after the last
  layer: that layer's wait (the forward's last ``wait_for_layer_load``, a
  sync load's ``wait_all``, a parked load's release after every layer)
  returns only once every object is verified. An overlapped forward may
  have read the earlier layers by then: a mismatch fails the load in the
  same step, reported through the path for a load that fails after its
  release (the step is ``tainted``), so vLLM discards that step's token and
  its stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..object_format import ObjectFormat

__all__ = ["PayloadCheck", "checkable", "describe", "objects_due", "piece_of"]


@dataclass(frozen=True, eq=False)
class PayloadCheck:
    """``expected``: per object of the load (uint64), the checksum its slot
    header records; ``verify``: per object, whether the engine checks it
    (False: checked otherwise, e.g. an older writer's XXH3 over the pool)."""

    expected: np.ndarray
    verify: np.ndarray

    @classmethod
    def of(cls, expected, verify=None) -> "PayloadCheck":
        expected = np.ascontiguousarray(expected, dtype=np.uint64)  # a header field read is strided
        verify = np.ones(len(expected), dtype=bool) if verify is None else np.ascontiguousarray(verify, dtype=bool)
        if verify.shape != expected.shape:
            raise ValueError(f"{len(verify)} verify flags for {len(expected)} checksums")
        return cls(expected, verify)

    def __len__(self) -> int:
        return len(self.expected)


def checkable(fmt: ObjectFormat) -> bool:
    """Whether the engines can sum this format's pieces: every block extent and
    segment is whole 32-bit words (true of every layout vLLM uses)."""
    layout = fmt.layout
    return layout.segment_bytes % 4 == 0 and layout.block_bytes_per_layer % 4 == 0


def piece_of(fmt: ObjectFormat, chunk: int, layer: int) -> tuple[int, int]:
    """(object index, first word) of the extent of layer position ``layer`` of the
    load's chunk ``chunk``."""
    obj, offset = fmt.layer_places[layer]
    return chunk * fmt.objects_per_chunk + obj, offset // 4


def objects_due(fmt: ObjectFormat, num_chunks: int, layer: int) -> np.ndarray:
    """The objects whose every piece has arrived once layer ``layer`` has (layers
    land in true order): that layer's objects (layerwise), every object after
    the last layer (chunkwise), else none."""
    return fmt.objects_due(num_chunks, layer)


def describe(fmt: ObjectFormat, obj: int) -> str:
    """An object of a load, for a failure message."""
    return fmt.describe(obj)
