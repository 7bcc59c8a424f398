"""The storage formats of KV objects in the pool: the one list every part
(keys, connector, operator, CRD) takes its names from."""

from __future__ import annotations

import enum


class StorageFormat(str, enum.Enum):
    """How a chunk's KV is cut into pool objects.

    ``CHUNKWISE``: one object per chunk, every layer in it (fewest objects,
    one index round trip per chunk). ``LAYERWISE``: one object per (chunk,
    layer), so each layer can be stored and loaded on its own.
    """

    CHUNKWISE = "chunkwise"
    LAYERWISE = "layerwise"

    @classmethod
    def parse(cls, value: object) -> "StorageFormat":
        """``value`` as a format, or a ValueError that lists the formats."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(f.value) for f in cls)
            raise ValueError(f"unknown storage format {value!r}: use one of {names}") from None
