"""The commit-time check of slot headers, for a whole batch at once.

Before the index makes a key visible it checks that the writer wrote the
object's slot header: a valid head entry naming the key and the generation
of its slot. ``Pool.read_slot_header`` does that for one object, in about
15 µs of Python; a commit of 8,000 objects spent 120 ms there. Here the head
entries of a whole batch are gathered from the slot-header table with one
numpy take and checked field by field, vectorised; only the CRC32 (which
numpy cannot compute) is one ``zlib.crc32`` call per entry, over bytes
already gathered.

The checks are exactly those of ``read_slot_header(offset).names(key,
generation)`` (the tests hold the two against each other): magic, head
state, CRC, a known format, non-zero generation and length, a page count
that matches the length and stays inside the pool, then the key and the
generation. The entry layout is the one ``maru_core.pool.slots`` documents.
"""

from __future__ import annotations

import zlib

import numpy as np

from maru_core.pool.geometry import SLOT_HEADER_BYTES
from maru_core.pool.slots import SLOT_MAGIC, SlotFormat, SlotState

# magic 4s | state u8 | format u8 | reserved u16 | key 16s | generation u64 | length u64
# | page count u32 | reserved 16 bytes | crc32 u32 (of the first 60 bytes), little-endian
_ENTRY = np.dtype(
    [
        ("magic", "<u4"),
        ("state", "u1"),
        ("fmt", "u1"),
        ("reserved", "<u2"),
        ("key0", "<u8"),
        ("key1", "<u8"),
        ("generation", "<u8"),
        ("length", "<u8"),
        ("pages", "<u4"),
        ("padding", "V16"),
        ("crc", "<u4"),
    ]
)
_CRC_SPAN = 60
_MAGIC = int.from_bytes(SLOT_MAGIC, "little")
_FORMATS = np.array([int(f) for f in SlotFormat], dtype=np.uint8)
if _ENTRY.itemsize != SLOT_HEADER_BYTES:  # pragma: no cover - a layout edit gone wrong
    raise ImportError("the slot-header entry dtype is not SLOT_HEADER_BYTES long")


class SlotHeaderCheck:
    """``check(keys, offsets, generations) -> bool array``: whether the slot
    header at each data ``offset`` of ``pool`` is a valid head naming the
    key (``keys`` packed, 16 bytes each) and the generation.

    The registry's ``commit`` takes it as ``verify``.
    """

    def __init__(self, pool) -> None:
        self._pool = pool

    def __call__(self, keys: bytes, offsets: np.ndarray, generations: np.ndarray) -> np.ndarray:
        g = self._pool.geometry
        offsets = np.asarray(offsets, dtype=np.int64)
        pages = offsets - g.data_offset
        inside = (pages >= 0) & (pages % g.page_size == 0) & (pages < g.num_pages * g.page_size)
        pages //= g.page_size
        pages[~inside] = 0
        entries = self._entries(pages)
        words = np.frombuffer(keys, dtype="<u8")
        ok = inside
        ok &= entries["magic"] == _MAGIC
        ok &= entries["state"] == SlotState.HEAD
        ok &= np.isin(entries["fmt"], _FORMATS)
        ok &= entries["key0"] == words[0::2]
        ok &= entries["key1"] == words[1::2]
        generation, length, count = entries["generation"], entries["length"], entries["pages"]
        ok &= generation == np.asarray(generations, dtype=np.uint64)
        ok &= (generation != 0) & (length != 0)
        page_size = np.uint64(g.page_size)
        ok &= count == length // page_size + (length % page_size != 0)  # ceil, without overflow
        ok &= pages + count <= g.num_pages
        if ok.any():
            ok[ok] = _crc_ok(entries[ok])
        return ok

    def _entries(self, pages: np.ndarray) -> np.ndarray:
        """Copies of the table entries of ``pages`` (the table view is dropped before returning,
        so the pool can be closed)."""
        g = self._pool.geometry
        table = np.frombuffer(self._pool.buffer, dtype=_ENTRY, count=g.num_pages, offset=g.table_offset)
        try:
            return table.take(pages)
        finally:
            del table


def _crc_ok(entries: np.ndarray) -> np.ndarray:
    """Whether each entry's CRC32 matches its first 60 bytes."""
    bodies = entries.view(np.uint8).reshape(-1, SLOT_HEADER_BYTES)[:, :_CRC_SPAN]
    crcs = np.fromiter(map(zlib.crc32, np.ascontiguousarray(bodies).view(f"V{_CRC_SPAN}").ravel().tolist()),
                       dtype=np.uint32, count=len(entries))  # fmt: skip
    return crcs == entries["crc"]
