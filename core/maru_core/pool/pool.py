"""``Pool``: one ``mmap(MAP_SHARED)`` of a DAX device or a tmpfs file, with its header and slot table.

A pool is a region of its file or device (``maru_core.pool.region``): the
whole file made for it, or ``size`` bytes from a 2 MiB-aligned ``offset`` of a
device (or file) shared with other pools. Its header sits at the region's
start and records the offset; the mapping covers the region only.

Attaching validates the header and never writes. Creating never destroys
data by surprise: an existing pool is reused only with ``exist_ok=True``
(and only when its geometry is the one asked for) and replaced only with
``force=True``; anything else found at the path is left alone. A new pool
file is built under a temporary name and linked into place atomically, so
a process attaching concurrently sees either no pool or a complete one.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import uuid as uuid_module
import weakref
from collections.abc import Callable, Iterator, Sequence

from maru_core.pool.checksum import payload_checksum, payload_checksums, xxh3_checksum
from maru_core.pool.device import SYSFS_ROOT, Backing, backing_size, open_rw
from maru_core.pool.errors import (
    PoolError,
    PoolExists,
    PoolFormatError,
    PoolNoSpace,
    PoolNotFound,
    PoolPermissionError,
    PoolSizeError,
    PoolTooSmall,
)
from maru_core.pool.geometry import (
    DEFAULT_PAGE_SIZE,
    HEADER_REGION,
    SLOT_HEADER_BYTES,
    PoolGeometry,
    check_page_size,
    check_region_offset,
)
from maru_core.pool.header import PoolHeader, parse_header
from maru_core.pool.region import check_region, locate, map_region
from maru_core.pool.slots import (
    HEAD_STATES,
    SLOT_MAGIC,
    ChecksumKind,
    SlotHeader,
    SlotState,
    continuation_of,
    pack_entry,
    unpack_head,
)

_HEAD_PATTERNS = {state: re.compile(re.escape(SLOT_MAGIC + bytes([state]))) for state in HEAD_STATES}
_ZERO_CHUNK = 64 * 1024 * 1024


def _is_blank(mapping: mmap.mmap) -> bool:
    return not any(mapping[:HEADER_REGION])


def _fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"descriptor {fd}"


class Pool:
    """A mapped pool. Build one with ``create``, ``attach`` or ``from_fd``."""

    def __init__(self, fd: int, mapping: mmap.mmap, header: PoolHeader, where: str, backing: Backing):
        self._fd = fd
        self._mmap = mapping
        self._buffer = memoryview(mapping)
        self._header = header
        self._where = where
        self._backing = backing
        self._closer = weakref.finalize(self, os.close, fd)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def attach(cls, path: str, expected_size: int | None = None, *, offset: int = 0,
               sysfs_root: str = SYSFS_ROOT) -> "Pool":  # fmt: skip
        """Map the existing pool at ``offset`` of ``path`` after validating its header.

        The pool's size comes from its header; ``expected_size``, when given,
        must equal it. ``offset`` (a multiple of 2 MiB, else ``ValueError``)
        must be the one the pool was created at (else ``PoolOffsetMismatch``).
        Never writes to the file or device. Raises a ``PoolError`` subclass
        that names the problem.
        """
        check_region_offset(offset)
        fd = open_rw(path)
        return cls._from_open_fd(fd, path, expected_size, offset, sysfs_root)

    @classmethod
    def from_fd(cls, fd: int, expected_size: int | None = None, *, offset: int = 0,
                sysfs_root: str = SYSFS_ROOT) -> "Pool":  # fmt: skip
        """Map the pool at ``offset`` of the file or device open at descriptor
        ``fd`` (e.g. received from the sidecar), as ``attach`` does.

        The pool keeps a duplicate of ``fd``; the caller may close its own.
        """
        check_region_offset(offset)
        return cls._from_open_fd(os.dup(fd), _fd_name(fd), expected_size, offset, sysfs_root)

    @classmethod
    def _from_open_fd(cls, fd: int, where: str, expected_size: int | None, offset: int, sysfs_root: str) -> "Pool":
        try:
            header, backing = locate(fd, where, offset, expected_size, sysfs_root)
            mapping = map_region(fd, offset, header.geometry.size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mapping, header, where, backing)

    @classmethod
    def create(
        cls,
        path: str,
        size: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        offset: int = 0,
        exist_ok: bool = False,
        force: bool = False,
        creator: str | None = None,
        mode: int = 0o600,
        preallocate: bool = True,
        sysfs_root: str = SYSFS_ROOT,
    ) -> "Pool":
        """Create a pool at ``path`` and return it mapped.

        ``path`` is a regular file to create (``size`` bytes; tmpfs under
        ``/dev/shm``) or a DAX device. ``offset`` (a multiple of 2 MiB) and
        ``size`` name the pool's region of a device or of an existing larger
        file; on a device ``size`` may be omitted (the pool then runs to the
        device's end). A region never extends a file, and is initialised in
        place without ``force`` when its first 4 KiB are blank (all zeros).
        ``page_size`` is a power of two from 4 KiB to 1 GiB. When something is
        already there: a pool of the same geometry is attached with
        ``exist_ok=True``; anything is replaced, destroying its contents, with
        ``force=True`` (a region: only that region); otherwise ``PoolExists``.
        ``preallocate`` reserves the file's memory now (tmpfs), so a full
        ``/dev/shm`` is a ``PoolNoSpace`` error here instead of a SIGBUS later.
        """
        check_page_size(page_size)
        check_region_offset(offset)
        if size is not None and (type(size) is not int or size <= 0):
            raise ValueError(f"size must be a positive number of bytes, got {size!r}")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if offset:
                raise PoolNotFound(
                    f"nothing at {path}: a pool at offset {offset} is a region of an existing device or "
                    "file; check the path, or create the file first"
                ) from None
            return cls._create_file(path, size, page_size, replace=False, exist_ok=exist_ok,
                                    creator=creator, mode=mode, preallocate=preallocate)  # fmt: skip
        except PermissionError:
            raise PoolPermissionError(f"no permission to look up {path}: fix the directory's permissions") from None
        if os.path.isdir(path):
            raise PoolNotFound(f"{path} is a directory; name a file inside it (e.g. {path}/marucache.pool)")
        in_place = not os.path.isfile(path) or offset > 0 or (size is not None and size < st.st_size)
        if in_place:  # a device, or a region of a larger file
            return cls._create_in_place(path, size, page_size, offset, exist_ok=exist_ok, force=force,
                                        creator=creator, preallocate=preallocate, sysfs_root=sysfs_root)  # fmt: skip
        if force:
            return cls._create_file(path, size or st.st_size, page_size, replace=True, exist_ok=False,
                                    creator=creator, mode=mode, preallocate=preallocate)  # fmt: skip
        return cls._reuse_existing(path, size, page_size, exist_ok, 0, sysfs_root)

    @classmethod
    def _reuse_existing(cls, path: str, size: int | None, page_size: int, exist_ok: bool, offset: int,
                        sysfs_root: str) -> "Pool":  # fmt: skip
        try:
            pool = cls.attach(path, offset=offset, sysfs_root=sysfs_root)
        except (PoolFormatError, PoolSizeError) as exc:
            raise PoolExists(
                f"{path} exists and holds no usable pool at offset {offset} ({exc}); "
                "pass force=True to replace it, destroying its contents"
            ) from exc
        problem = pool._mismatch(size, page_size)
        if problem or not exist_ok:
            pool.close()
            g = pool.geometry
            summary = (
                f"a pool already exists at {path}, offset {offset} ({g.size} bytes, {g.page_size}-byte pages, "
                f"uuid {g.uuid}, created by {pool.header.creator})"
            )
            advice = "pass exist_ok=True to attach it" if not problem else problem
            raise PoolExists(f"{summary}: {advice}, or force=True to replace it (destroys its objects)")
        return pool

    def _mismatch(self, size: int | None, page_size: int) -> str | None:
        g = self.geometry
        if size is not None and size != g.size:
            return f"its size is {g.size}, not the {size} asked for"
        if page_size != g.page_size:
            return f"its page size is {g.page_size}, not the {page_size} asked for"
        return None

    @classmethod
    def _create_file(cls, path: str, size: int | None, page_size: int, *, replace: bool, exist_ok: bool,
                     creator: str | None, mode: int, preallocate: bool) -> "Pool":  # fmt: skip
        if size is None:
            raise ValueError(f"creating a pool file at {path} needs its size in bytes")
        try:
            geometry = PoolGeometry.plan(size, page_size)
        except ValueError as exc:
            raise PoolTooSmall(str(exc)) from None
        directory, name = os.path.split(os.path.abspath(path))
        tmp = os.path.join(directory, f".{name}.{uuid_module.uuid4().hex[:12]}.creating")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileNotFoundError:
            raise PoolNotFound(f"directory {directory} does not exist: create it first") from None
        except PermissionError:
            raise PoolPermissionError(f"no permission to create files in {directory}") from None
        try:
            mapping = cls._initialise_file(fd, geometry, tmp, creator, preallocate)
            header = parse_header(mapping[:HEADER_REGION], path)
            published = cls._publish(tmp, path, replace)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        if published:
            return cls(fd, mapping, header, path, Backing.FILE)
        # Another process created the pool first: ours was never visible.
        mapping.close()
        os.close(fd)
        return cls._reuse_existing(path, size, page_size, exist_ok, 0, SYSFS_ROOT)

    @staticmethod
    def _initialise_file(fd: int, geometry: PoolGeometry, where: str, creator: str | None,
                         preallocate: bool) -> mmap.mmap:  # fmt: skip
        os.ftruncate(fd, geometry.size)
        if preallocate:
            _preallocate(fd, 0, geometry.size, where)
        mapping = map_region(fd, 0, geometry.size)
        # A new file reads as zeros: the slot table is empty. The header goes in last.
        header = PoolHeader.new(geometry, creator, spans_file=True)
        mapping[:HEADER_REGION] = header.pack().ljust(HEADER_REGION, b"\0")
        return mapping

    @staticmethod
    def _publish(tmp: str, path: str, replace: bool) -> bool:
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)
        return True

    @classmethod
    def _create_in_place(cls, path: str, size: int | None, page_size: int, offset: int, *, exist_ok: bool,
                         force: bool, creator: str | None, preallocate: bool, sysfs_root: str) -> "Pool":  # fmt: skip
        """A pool in the region ``[offset, offset + size)`` of an existing device or file, which keeps its size."""
        fd = open_rw(path)
        try:
            backing_bytes, backing = backing_size(fd, path, sysfs_root)
            region_size = size if size is not None else max(backing_bytes - offset, 0)
            check_region(path, offset, region_size, backing_bytes, backing)
            if preallocate and backing is Backing.FILE:
                _preallocate(fd, offset, region_size, path)
            mapping = map_region(fd, offset, region_size)
        except BaseException:
            os.close(fd)
            raise
        if not force and not _is_blank(mapping):
            mapping.close()
            os.close(fd)
            return cls._reuse_existing(path, size, page_size, exist_ok, offset, sysfs_root)
        try:
            geometry = PoolGeometry.plan(region_size, page_size)
            _zero(mapping, 0, geometry.data_offset)
            fresh = PoolHeader.new(geometry, creator, region_offset=offset)
            mapping[:HEADER_REGION] = fresh.pack().ljust(HEADER_REGION, b"\0")
            header = parse_header(mapping[:HEADER_REGION], path)
        except ValueError as exc:
            mapping.close()
            os.close(fd)
            raise PoolTooSmall(str(exc)) from None
        return cls(fd, mapping, header, path, backing)

    # -- the mapping ----------------------------------------------------------------------------

    @property
    def geometry(self) -> PoolGeometry:
        return self._header.geometry

    @property
    def header(self) -> PoolHeader:
        """The validated header: geometry, creation time and creator host."""
        return self._header

    @property
    def offset(self) -> int:
        """Where the pool starts in its file or device (0 unless it is a region of a shared device)."""
        return self._header.region_offset

    @property
    def where(self) -> str:
        """The path (or descriptor) the pool was mapped from, for messages."""
        return self._where

    @property
    def backing(self) -> Backing:
        return self._backing

    @property
    def buffer(self) -> memoryview:
        """A writable view of the whole mapping (offsets are from its start)."""
        self._check_open()
        return self._buffer

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def fileno(self) -> int:
        """The pool's own descriptor (valid until ``close``), e.g. to hand on over a Unix socket."""
        self._check_open()
        return self._fd

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at ``offset``; ``ValueError`` outside the mapping."""
        self._check_open()
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > self.geometry.size:
            raise ValueError(
                f"range [{offset}, {offset}+{length}) is outside the pool's {self.geometry.size} bytes"
            )
        return self._buffer[offset : offset + length]

    def _check_open(self) -> None:
        if self.closed:
            raise PoolError(f"the pool at {self._where} is closed")

    def close(self) -> None:
        """Unmap and close the descriptor. Views still held keep the memory
        mapped until they are released; using the pool afterwards raises."""
        if self.closed:
            return
        try:
            self._buffer.release()
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported: the mapping goes when the last view does
        self._closer()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.geometry
        return f"Pool({self._where!r}, offset={self.offset}, size={g.size}, page_size={g.page_size}, pages={g.num_pages}, uuid={g.uuid})"

    # -- slot headers ---------------------------------------------------------------------------

    def _object_pages(self, offset: int, length: int) -> tuple[int, int]:
        g = self.geometry
        page = g.page_index(offset)
        count = g.pages_for(length)
        if page + count > g.num_pages:
            raise ValueError(f"an object of {length} bytes at offset {offset} runs past the end of the pool")
        return page, count

    def write_slot_header(self, offset: int, header: SlotHeader) -> None:
        """Write the slot header of the object whose data starts at ``offset``, pending.

        Call it after the object's data is written and before ``commit``; the
        index marks it committed when it commits the key (pending, it is never
        restored nor read). The continuations go in first and the head last,
        so a torn write never leaves an intact-looking object.
        """
        self._check_open()
        page, count = self._object_pages(offset, header.length)
        head = pack_entry(header, SlotState.PENDING, count)
        start = self.geometry.slot_header_offset(page)
        if count > 1:
            self._buffer[start + SLOT_HEADER_BYTES : start + count * SLOT_HEADER_BYTES] = continuation_of(head) * (count - 1)
        self._buffer[start : start + SLOT_HEADER_BYTES] = head

    def invalidate_slot(self, offset: int, length: int) -> None:
        """Clear the slot headers of the pages of ``[offset, offset+length)``.

        A writer calls it before writing data into a reserved slot, so an
        older object whose pages it takes over can never be rebuilt from the
        table with half-overwritten data if the writer dies mid-copy.
        """
        self._check_open()
        page, count = self._object_pages(offset, length)
        start = self.geometry.slot_header_offset(page)
        self._buffer[start : start + count * SLOT_HEADER_BYTES] = bytes(count * SLOT_HEADER_BYTES)

    def read_slot_header(self, offset: int, state: SlotState = SlotState.COMMITTED) -> SlotHeader | None:
        """The slot header of the object at ``offset``, or ``None`` when the
        entry there is not a valid head in ``state`` (empty, torn, bad CRC,
        or, by default, not committed)."""
        self._check_open()
        page = self.geometry.page_index(offset)
        start = self.geometry.slot_header_offset(page)
        parsed = unpack_head(self._buffer[start : start + SLOT_HEADER_BYTES], self.geometry.page_size, state)
        if parsed is None or page + parsed[1] > self.geometry.num_pages:
            return None
        return parsed[0]

    def payload_checksum(self, offset: int, length: int, kind: int = ChecksumKind.POSITION_SUM) -> int:
        """The checksum (``maru_core.pool.checksum``, of ``kind``) of ``length`` bytes at
        ``offset``: what a writer records once its copy into them has completed."""
        view = self.view(offset, length)
        try:
            return _CHECKSUMS[kind](view)
        finally:
            view.release()

    def payload_checksums(self, offsets: Sequence[int], length: int,
                          kind: int = ChecksumKind.POSITION_SUM) -> list[int]:
        """``payload_checksum(offset, length, kind)`` of each offset, a batch on several
        threads where the machine has cores to spare (``payload_checksums``)."""
        views = [self.view(offset, length) for offset in offsets]
        try:
            return payload_checksums(views, function=_CHECKSUMS[kind])
        finally:
            for view in views:
                view.release()

    def payload_matches(self, offset: int, header: SlotHeader) -> bool:
        """Whether the object at ``offset`` still holds the bytes its ``header``'s checksum
        names (of the header's kind); ``False`` when the header carries no checksum
        (nothing to vouch for them)."""
        if header.checksum is None:
            return False
        return self.payload_checksum(offset, header.length, header.checksum_kind) == header.checksum

    def iter_slot_headers(self, state: SlotState = SlotState.COMMITTED) -> Iterator[tuple[int, SlotHeader]]:
        """``(offset, header)`` of every intact object whose head is in ``state``, in page order.

        Intact: a valid head whose continuations are all in place. The
        committed ones are what the index rebuilds itself from after a
        restart; pending ones were never committed (or their commit was never
        recorded) and are never rebuilt.
        """
        self._check_open()
        g = self.geometry
        table = self._buffer[g.table_offset : g.table_offset + g.num_pages * SLOT_HEADER_BYTES]
        for match in _HEAD_PATTERNS[state].finditer(table):
            pos = match.start()
            if pos % SLOT_HEADER_BYTES:
                continue  # the pattern inside a key or another field
            parsed = unpack_head(table[pos : pos + SLOT_HEADER_BYTES], g.page_size, state)
            if parsed is None:
                continue
            header, count = parsed
            page = pos // SLOT_HEADER_BYTES
            if page + count > g.num_pages:
                continue
            if count > 1:
                expected = continuation_of(bytes(table[pos : pos + SLOT_HEADER_BYTES])) * (count - 1)
                if table[pos + SLOT_HEADER_BYTES : pos + count * SLOT_HEADER_BYTES] != expected:
                    continue
            yield g.page_offset(page), header


def _preallocate(fd: int, offset: int, size: int, where: str) -> None:
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise PoolNoSpace(
                f"no room for a pool of {size} bytes in the filesystem of {where}: "
                "make the pool smaller or the filesystem larger (e.g. /dev/shm's size)"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _zero(mapping: mmap.mmap, start: int, end: int) -> None:
    zeros = bytes(min(_ZERO_CHUNK, end - start))
    for pos in range(start, end, len(zeros) or 1):
        n = min(len(zeros), end - pos)
        mapping[pos : pos + n] = zeros[:n]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# The function of each checksum kind a header can carry (keyed by the kind's
# number: a kind read from a header is a plain int).
_CHECKSUMS: dict[int, Callable[[memoryview], int]] = {
    ChecksumKind.POSITION_SUM: payload_checksum,
    ChecksumKind.XXH3_64: xxh3_checksum,
}
