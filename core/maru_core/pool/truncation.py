"""A pool file that something truncated: noticed, and given its size back.

A DAX device has a fixed size. A pool *file* (the embedded default, in
``/dev/shm``) can be shrunk with ``ftruncate`` by any process that holds it
open for writing, and every engine does: it maps the pool read-write to
store. Sealing (``F_SEAL_SHRINK``) would forbid it, but only a memfd can be
sealed, and a memfd lives only as long as some process holds it, while the
pool must outlive index restarts (no other process of the embedded default
lives longer than the index). So the index watches the file's size instead:

- ``missing_bytes``: how much of the pool lies past the file's end now;
- ``regrow``: the running index gives the file its size back at once (the
  lost bytes read as zeros, so no process dies of SIGBUS touching them
  later) and rewrites the pool header if it was cut; the caller drops the
  objects whose slot header or payload was in the lost range
  (``first_lost_page``);
- ``regrow_file``: an index starting over a truncated pool file does the same
  before it attaches, and ``drop_lost_objects`` clears the slot headers of
  the objects lost, so the restore never serves them.

What was in the lost range is gone: those objects become misses, never wrong
bytes. Everything before it is kept.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING

from .geometry import HEADER_REGION, SLOT_HEADER_BYTES, PoolGeometry
from .errors import PoolFormatError
from .header import parse_header
from .slots import SlotState

if TYPE_CHECKING:
    from .pool import Pool

__all__ = ["drop_lost_objects", "first_lost_page", "missing_bytes", "regrow", "regrow_file"]

log = logging.getLogger(__name__)


def missing_bytes(pool: "Pool") -> int:
    """Bytes of ``pool`` (a ``Pool``) past the end of its file now; 0 for a
    device (its size is fixed) and for a file of the pool's size or more."""
    st = os.fstat(pool.fileno())
    if not stat.S_ISREG(st.st_mode):
        return 0
    return max(0, pool.offset + pool.geometry.size - int(st.st_size))


def regrow(pool: "Pool") -> int | None:
    """Give ``pool``'s file its size back if it was truncated; return the first
    pool byte that was lost (None: nothing was). The header is rewritten if
    the cut reached it; the caller drops the objects lost (``first_lost_page``)."""
    missing = missing_bytes(pool)
    if not missing:
        return None
    lost_from: int = pool.geometry.size - missing
    os.ftruncate(pool.fileno(), pool.offset + pool.geometry.size)
    if lost_from < HEADER_REGION:
        pool.buffer[:HEADER_REGION] = pool.header.pack().ljust(HEADER_REGION, b"\0")
    return lost_from


def first_lost_page(geometry: PoolGeometry, lost_from: int) -> int:
    """The first data page whose object is lost once the pool's bytes from
    ``lost_from`` on were: its payload, or its slot header (the slot table
    lies before the data area: a cut there loses every object from the
    first entry it reached)."""
    if lost_from >= geometry.data_offset:
        return (lost_from - geometry.data_offset) // geometry.page_size
    return max(0, (lost_from - geometry.table_offset) // SLOT_HEADER_BYTES)


def regrow_file(path: str, offset: int = 0) -> int | None:
    """Before an index attaches the pool at ``offset`` of the regular file
    ``path``: if its header is intact and the file ends before the pool does,
    extend the file to the pool's size and return the first pool byte lost
    (None: the file is whole, not a regular file, or holds no readable header)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size - offset < HEADER_REGION:
            return None
        try:
            header = parse_header(os.pread(fd, HEADER_REGION, offset), path)
        except PoolFormatError:
            return None
        end = offset + header.geometry.size
        if header.region_offset != offset or st.st_size >= end:
            return None
        os.ftruncate(fd, end)
        return st.st_size - offset
    finally:
        os.close(fd)


def drop_lost_objects(pool: "Pool", lost_from: int) -> int:
    """Clear the slot headers of every object (committed or pending) whose
    payload reached pool byte ``lost_from`` (the slot table itself is whole:
    ``regrow_file`` found the header and the file ends in the data area, or
    the entries are zeros already); return how many."""
    first = first_lost_page(pool.geometry, lost_from)
    dropped = 0
    for state in (SlotState.COMMITTED, SlotState.PENDING):
        for offset, header in list(pool.iter_slot_headers(state)):
            page = (offset - pool.geometry.data_offset) // pool.geometry.page_size
            pages = -(-header.length // pool.geometry.page_size)
            if page + pages > first:
                pool.invalidate_slot(offset, header.length)
                dropped += 1
    return dropped
