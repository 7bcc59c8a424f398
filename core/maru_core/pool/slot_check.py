"""Slot-header checks for a whole batch of objects at once.

Two places check many slot headers in one go: the index before it commits a
batch (the writer wrote each object's header), and a reader once its
retrieve pinned the objects of a load (each slot still holds the key and
generation it resolved, in the reader's layout). ``Pool.read_slot_header``
does that for one object in about 15 µs of Python: a commit of 8,000
objects spent 120 ms there, and a layerwise 16k-token hit (2,048 objects)
11-24 ms inside its time to first token. Here the head entries of a whole
batch are gathered from the slot-header table with one numpy take and
checked field by field, vectorised; only the CRC32 (which numpy cannot
compute) is one ``zlib.crc32`` call per entry, over bytes already gathered.

A pool file found shorter than the pool (something truncated it) passes no
object: reading its table or payload could kill the process with SIGBUS.

The checks are exactly those of ``read_slot_header(offset, state).names(key,
generation)`` (a property test holds the two against each other): magic,
head state, CRC, a known format and checksum kind, non-zero generation and
length, a page count that matches the length and stays inside the pool,
then the key and the generation; with ``layout``, the writer's layout
fingerprint too. The entry layout is the one ``maru_core.pool.slots``
documents.
"""

from __future__ import annotations

import zlib

import numpy as np

from maru_core.pool.geometry import SLOT_HEADER_BYTES
from maru_core.pool.slots import KEY_BYTES, SLOT_MAGIC, ChecksumKind, SlotFormat, SlotState
from maru_core.pool.truncation import missing_bytes

# magic 4s | state u8 | format u8 | checksum kind u8 | reserved u8 | key 16s | generation u64
# | length u64 | page count u32 | payload checksum u64 | layout u64 | crc32 u32 (of the first
# 60 bytes), little-endian
_ENTRY = np.dtype(
    [
        ("magic", "<u4"),
        ("state", "u1"),
        ("fmt", "u1"),
        ("checksum_kind", "u1"),
        ("reserved", "u1"),
        ("key0", "<u8"),
        ("key1", "<u8"),
        ("generation", "<u8"),
        ("length", "<u8"),
        ("pages", "<u4"),
        ("checksum", "<u8"),
        ("layout", "<u8"),
        ("crc", "<u4"),
    ]
)
_CRC_SPAN = 60
_MAGIC = int.from_bytes(SLOT_MAGIC, "little")
_FORMATS = np.array([int(f) for f in SlotFormat], dtype=np.uint8)
if _ENTRY.itemsize != SLOT_HEADER_BYTES:  # pragma: no cover - a layout edit gone wrong
    raise ImportError("the slot-header entry dtype is not SLOT_HEADER_BYTES long")


class SlotHeaderCheck:
    """``check(keys, offsets, generations, layout=None) -> bool array``:
    whether the slot header at each data ``offset`` of ``pool`` is a valid
    head in ``state`` naming the key (``keys`` packed, 16 bytes each) and the
    generation, and, when ``layout`` is given, whose writer recorded that
    layout fingerprint.

    The registry's ``commit`` takes it as ``verify`` with ``state`` pending
    (the writer's header, not yet committed); the connector checks a load's
    pinned objects with it in the default state, committed.
    """

    def __init__(self, pool, state: SlotState = SlotState.COMMITTED) -> None:
        self._pool = pool
        self._state = SlotState(state)

    def __call__(
        self, keys: bytes, offsets: np.ndarray, generations: np.ndarray, layout: int | None = None
    ) -> np.ndarray:
        g = self._pool.geometry
        offsets = np.asarray(offsets, dtype=np.int64)
        if len(keys) != KEY_BYTES * len(offsets):
            raise ValueError(f"{len(keys)} bytes of keys for {len(offsets)} offsets: keys are {KEY_BYTES} bytes each")
        if missing_bytes(self._pool):  # truncated (the index gives it its size back): nothing to read
            return np.zeros(len(offsets), dtype=bool)
        inside, pages = self._pages(offsets)
        entries = self._entries(pages)
        words = np.frombuffer(keys, dtype="<u8")
        ok = inside
        ok &= entries["magic"] == _MAGIC
        ok &= entries["state"] == self._state
        ok &= np.isin(entries["fmt"], _FORMATS)
        kind, checksum = entries["checksum_kind"], entries["checksum"]
        ok &= (((kind == ChecksumKind.NONE) & (checksum == 0)) | ((kind == ChecksumKind.XXH3_64) & (checksum != 0))
               | (kind == ChecksumKind.POSITION_SUM))  # the rule of slots.checksum_value_valid
        ok &= entries["key0"] == words[0::2]
        ok &= entries["key1"] == words[1::2]
        generation, length, count = entries["generation"], entries["length"], entries["pages"]
        ok &= generation == np.asarray(generations, dtype=np.uint64)
        ok &= (generation != 0) & (length != 0)
        page_size = np.uint64(g.page_size)
        ok &= count == length // page_size + (length % page_size != 0)  # ceil, without overflow
        ok &= pages + count <= g.num_pages
        if layout is not None:
            ok &= entries["layout"] == np.uint64(layout)
        if ok.any():
            ok[ok] = _crc_ok(entries[ok])
        return ok

    def formats_and_layouts(
        self, keys: bytes, offsets: np.ndarray, generations: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(this check of each object, the format byte and the layout fingerprint its head
        records): what the index says of an object it lists (zeros where the check fails)."""
        ok = self(keys, offsets, generations)
        fmt, layout = np.zeros(len(ok), dtype=np.uint8), np.zeros(len(ok), dtype=np.uint64)
        if ok.any():  # not truncated, so the table can be read
            _, pages = self._pages(np.asarray(offsets, dtype=np.int64)[ok])
            entries = self._entries(pages)
            fmt[ok], layout[ok] = entries["fmt"], entries["layout"]
        return ok, fmt, layout

    def stored_checksums(self, offsets: np.ndarray) -> np.ndarray:
        """The payload checksum the slot header at each data ``offset`` records
        (uint64; 0 where it records none), for offsets this check passed:
        ``read_slot_header(offset).checksum or 0`` for a whole batch."""
        return self.stored_checksums_and_kinds(offsets)[0]

    def stored_checksums_and_kinds(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``stored_checksums(offsets)``, each header's ``ChecksumKind`` as uint8)."""
        _, pages = self._pages(np.asarray(offsets, dtype=np.int64))
        entries = self._entries(pages)
        return entries["checksum"], entries["checksum_kind"]

    def _pages(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(whether each offset starts a data page of the pool, its page index or 0)."""
        g = self._pool.geometry
        pages = offsets - g.data_offset
        inside = (pages >= 0) & (pages % g.page_size == 0) & (pages < g.num_pages * g.page_size)
        pages //= g.page_size
        pages[~inside] = 0
        return inside, pages

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
