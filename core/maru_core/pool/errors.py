"""Errors of the pool: each names the problem and what to change."""

from __future__ import annotations


class PoolError(Exception):
    """A pool could not be created, attached or used as asked."""


class PoolNotFound(PoolError):
    """No file or device at the path given."""


class PoolPermissionError(PoolError):
    """The file or device exists but this process may not open it read-write."""


class PoolExists(PoolError):
    """``Pool.create`` found something at the path and was not told it may reuse or replace it."""


class PoolSizeError(PoolError):
    """The pool's size is wrong for what was asked."""


class PoolSizeMismatch(PoolSizeError):
    """The pool's size differs from the size expected, or from its file or device."""


class PoolTooSmall(PoolSizeError):
    """The size leaves no room for the header, the slot table and one page."""


class PoolNoSpace(PoolSizeError):
    """The filesystem cannot hold a pool of the size asked."""


class PoolRegionError(PoolSizeError):
    """The region asked for (offset, size) does not lie inside the file or device."""


class PoolFormatError(PoolError):
    """The bytes at the start of the file or device are not a usable pool header."""


class PoolForeign(PoolFormatError):
    """No pool magic: the file or device holds something else, or was never initialised."""


class PoolVersionError(PoolFormatError):
    """A pool of a format version this code does not know."""


class PoolCorrupt(PoolFormatError):
    """The header's CRC does not match its contents."""


class PoolGeometryError(PoolFormatError):
    """The header's geometry is inconsistent (offsets, page size or page count)."""


class PoolOffsetMismatch(PoolFormatError):
    """The header found at a region's start records another region offset: the
    pool was created at another offset of its device (or its bytes were moved)."""
