"""The pool: create, attach, hand-off by descriptor, slot headers, and every refusal."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import uuid
import zlib

import pytest

from maru_core.pool import (
    ChecksumKind,
    DEFAULT_PAGE_SIZE,
    Backing,
    Pool,
    PoolCorrupt,
    PoolError,
    PoolExists,
    PoolForeign,
    PoolGeometry,
    PoolGeometryError,
    PoolNoSpace,
    PoolNotFound,
    PoolPermissionError,
    PoolRegionError,
    PoolSizeMismatch,
    PoolTooSmall,
    PoolVersionError,
    SlotFormat,
    SlotHeader,
    SlotState,
)
from maru_core.pool.commit_records import CommitRecords
from maru_core.pool.geometry import DATA_ALIGN, HEADER_REGION, SLOT_HEADER_BYTES
from maru_core.pool.header import HEADER_BYTES

MiB = 1024 * 1024
SIZE = 16 * MiB
PAGE = 64 * 1024


@pytest.fixture
def path():
    p = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    yield p
    for leftover in (p,):
        if os.path.exists(leftover):
            os.unlink(leftover)


@pytest.fixture
def pool(path):
    with Pool.create(path, SIZE, page_size=PAGE) as p:
        yield p


def _digest(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns


def _patch(path: str, offset: int, data: bytes, fix_crc: bool = False) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        if fix_crc:
            f.seek(0)
            body = f.read(HEADER_BYTES - 4)
            f.seek(HEADER_BYTES - 4)
            f.write(struct.pack("<I", zlib.crc32(body)))


# -- geometry and round trips --------------------------------------------------------------------


def test_create_lays_out_header_table_and_aligned_data(pool: Pool) -> None:
    g = pool.geometry
    assert (g.size, g.page_size, g.table_offset) == (SIZE, PAGE, HEADER_REGION)
    assert g.data_offset % DATA_ALIGN == 0
    assert g.data_offset >= g.table_offset + g.num_pages * SLOT_HEADER_BYTES
    assert g.data_offset + g.num_pages * g.page_size <= SIZE
    # Not one more page would fit.
    assert PoolGeometry.plan(SIZE, PAGE).num_pages == g.num_pages
    assert g.inconsistency() is None
    assert pool.backing is Backing.FILE
    assert pool.header.creator and pool.header.created_at > 0
    assert len(pool.buffer) == SIZE


def test_default_page_size_is_64k_and_the_table_is_a_thousandth_of_the_pool() -> None:
    assert DEFAULT_PAGE_SIZE == 64 * 1024
    g = PoolGeometry.plan(1 << 40)  # 1 TiB
    assert g.num_pages * SLOT_HEADER_BYTES <= (1 << 40) // 1000


def test_attach_sees_the_same_pool_and_shares_memory(pool: Pool, path: str) -> None:
    with Pool.attach(path, expected_size=SIZE) as other:
        assert other.geometry == pool.geometry
        assert other.header == pool.header
        offset = pool.geometry.page_offset(3)
        pool.view(offset, 5)[:] = b"hello"
        assert bytes(other.view(offset, 5)) == b"hello"
        other.buffer[offset] = ord("j")
        assert bytes(pool.view(offset, 5)) == b"jello"


def test_from_fd_keeps_its_own_descriptor(pool: Pool, path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    other = Pool.from_fd(fd)
    os.close(fd)  # the caller's copy: the pool has its own
    try:
        assert other.geometry.uuid == pool.geometry.uuid
        assert other.fileno() != fd
        os.fstat(other.fileno())
        other.view(pool.geometry.data_offset, 3)[:] = b"abc"
        assert bytes(pool.view(pool.geometry.data_offset, 3)) == b"abc"
        assert path in other.where
    finally:
        other.close()


def test_view_is_bounds_checked(pool: Pool) -> None:
    with pytest.raises(ValueError, match="outside the pool"):
        pool.view(SIZE - 4, 8)
    with pytest.raises(ValueError):
        pool.view(-1, 1)
    assert len(pool.view(SIZE - 4, 4)) == 4


def test_close_releases_the_descriptor_and_refuses_later_use(path: str) -> None:
    pool = Pool.create(path, SIZE)
    fd = pool.fileno()
    held = pool.view(pool.geometry.data_offset, 16)  # a view still exported
    pool.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(PoolError, match="closed"):
        pool.view(0, 1)
    held[:4] = b"safe"  # the mapping lives as long as the view
    pool.close()  # twice is fine


# -- create semantics -----------------------------------------------------------------------------


def test_create_refuses_an_existing_pool_unless_asked(pool: Pool, path: str) -> None:
    before = _digest(path)
    with pytest.raises(PoolExists, match="exist_ok=True"):
        Pool.create(path, SIZE, page_size=PAGE)
    assert _digest(path) == before
    with Pool.create(path, SIZE, page_size=PAGE, exist_ok=True) as again:
        assert again.geometry.uuid == pool.geometry.uuid
    assert _digest(path) == before


def test_exist_ok_refuses_another_geometry(pool: Pool, path: str) -> None:
    before = _digest(path)
    with pytest.raises(PoolExists, match="size"):
        Pool.create(path, 2 * SIZE, page_size=PAGE, exist_ok=True)
    with pytest.raises(PoolExists, match="page size"):
        Pool.create(path, SIZE, page_size=2 * PAGE, exist_ok=True)
    assert _digest(path) == before


def test_force_replaces_a_pool(pool: Pool, path: str) -> None:
    with Pool.create(path, SIZE, page_size=PAGE, force=True) as fresh:
        assert fresh.geometry.uuid != pool.geometry.uuid
    with Pool.attach(path) as attached:
        assert attached.geometry.uuid == fresh.geometry.uuid


def test_create_leaves_a_foreign_file_alone_unless_forced(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"precious data" * 1000)
    before = _digest(path)
    with pytest.raises(PoolExists, match="force=True"):
        Pool.create(path, SIZE)
    with pytest.raises(PoolExists):
        Pool.create(path, SIZE, exist_ok=True)
    assert _digest(path) == before
    with Pool.create(path, SIZE, force=True) as pool:
        assert pool.geometry.size == SIZE


def test_create_refuses_bad_arguments(path: str) -> None:
    with pytest.raises(PoolTooSmall, match="at least"):
        Pool.create(path, 1 * MiB)
    with pytest.raises(ValueError, match="power of two"):
        Pool.create(path, SIZE, page_size=3000)
    with pytest.raises(ValueError, match="size"):
        Pool.create(path, None)
    with pytest.raises(PoolNotFound, match="does not exist"):
        Pool.create(f"/dev/shm/no-such-dir-{uuid.uuid4().hex}/x.pool", SIZE)
    assert not os.path.exists(path)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f".{os.path.basename(path)}")]
    assert leftovers == []


def test_create_reports_a_full_filesystem(path: str) -> None:
    st = os.statvfs("/dev/shm")
    too_big = 2 * st.f_blocks * st.f_frsize
    with pytest.raises(PoolNoSpace, match="smaller"):
        Pool.create(path, too_big)
    assert not os.path.exists(path)


_CREATOR = """
import sys
from maru_core.pool import Pool
with Pool.create(sys.argv[1], int(sys.argv[2]), exist_ok=True) as pool:
    print(pool.geometry.uuid)
"""


def test_concurrent_creators_agree_on_one_pool(path: str) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _CREATOR, path, str(SIZE)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    uuids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(uuids) == 1
    with Pool.attach(path) as pool:
        assert uuids == {pool.geometry.uuid}


# -- attach refusals, each leaving the file untouched ---------------------------------------------


def test_attach_missing_path() -> None:
    with pytest.raises(PoolNotFound, match="create the pool"):
        Pool.attach(f"/dev/shm/maru-missing-{uuid.uuid4().hex}")
    with pytest.raises(PoolNotFound, match="directory"):
        Pool.attach("/dev/shm")


def _refused(path: str, error: type, match: str, **kwargs) -> None:
    before = _digest(path)
    with pytest.raises(error, match=match):
        Pool.attach(path, **kwargs)
    assert _digest(path) == before, "a refused attach changed the file"


def test_attach_refuses_an_unexpected_size(pool: Pool, path: str) -> None:
    _refused(path, PoolSizeMismatch, "expected", expected_size=SIZE * 2)


def test_attach_refuses_a_resized_pool(pool: Pool, path: str) -> None:
    os.truncate(path, SIZE + 4096)
    _refused(path, PoolSizeMismatch, "resized")


def test_attach_refuses_a_tiny_file(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"MARUPOOL")
    _refused(path, PoolTooSmall, "too small")


def test_attach_refuses_a_foreign_file(path: str) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(8 * MiB))
    _refused(path, PoolForeign, "not a MaruCache pool")


def test_attach_refuses_a_blank_file(path: str) -> None:
    os.truncate(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), 8 * MiB)
    _refused(path, PoolForeign, "all zeros")


def test_attach_refuses_an_unknown_version(pool: Pool, path: str) -> None:
    _patch(path, 8, struct.pack("<I", 99))
    _refused(path, PoolVersionError, "version 99.*one release apart")


def test_a_pool_of_the_previous_format_attaches_with_its_data(pool: Pool, path: str) -> None:
    """An index upgraded in place opens the pool its previous release made (format 1: no region
    offset, no flags); its committed bytes are read as they are."""
    geometry = pool.geometry
    pool.view(geometry.data_offset, 4)[:] = b"kept"
    pool.close()
    with open(path, "r+b") as f:
        body = bytearray(f.read(HEADER_BYTES - 4 - 12))  # format 2's body less its offset and flags
        body[8:12] = struct.pack("<I", 1)
        body[12:16] = struct.pack("<I", len(body) + 4)  # format 1's header bytes
        f.seek(0)
        f.write(bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))) + bytes(16))
    with Pool.attach(path) as old:
        assert old.geometry == geometry and old.header.version == 1 and old.header.region_offset == 0
        assert bytes(old.view(geometry.data_offset, 4)) == b"kept"


def test_attach_refuses_a_corrupt_header(pool: Pool, path: str) -> None:
    _patch(path, 60, b"\xff")  # inside the geometry fields, CRC left stale
    _refused(path, PoolCorrupt, "CRC")


def test_attach_refuses_an_inconsistent_geometry(pool: Pool, path: str) -> None:
    # page count one too many, with a valid CRC: only the geometry check can catch it
    _patch(path, 8 + 4 + 4 + 16 + 8 + 8, struct.pack("<Q", pool.geometry.num_pages + 1), fix_crc=True)
    _refused(path, PoolGeometryError, "num_pages")


def _attach_as(uid: int | None, path: str) -> str:
    """Try to attach ``path`` in a forked child running as ``uid``; return what it reports."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, try, report, leave without cleanup
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            try:
                Pool.attach(path).close()
                result = "attached"
            except PoolPermissionError as exc:
                result = f"refused: {exc}"
            os.write(write_end, result.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        result = f.read().decode()
    os.waitpid(pid, 0)
    return result


def test_attach_without_permission(pool: Pool, path: str) -> None:
    before = _digest(path)
    if os.getuid() == 0:
        result = _attach_as(65534, path)  # root opens anything: try as an unprivileged user
    else:
        os.chmod(path, 0)
        result = _attach_as(None, path)
    assert result.startswith("refused: no permission to open"), result
    assert "read-write access" in result
    assert _digest(path) == before


# -- DAX character devices ------------------------------------------------------------------------


def _fake_sysfs(tmp_path, device: str, size: int | None) -> str:
    rdev = os.stat(device).st_rdev
    node = tmp_path / "dev" / "char" / f"{os.major(rdev)}:{os.minor(rdev)}"
    node.mkdir(parents=True)
    if size is not None:
        (node / "size").write_text(f"{size}\n")
    return str(tmp_path)


def test_a_character_device_is_sized_from_sysfs_and_mapped_by_region(tmp_path) -> None:
    # /dev/zero maps like a DAX device (MAP_SHARED, no file size), but only from offset 0:
    # regions past a device's start are mapped in tests/core/test_pool_region.py, on a file.
    sysfs = _fake_sysfs(tmp_path, "/dev/zero", 8 * MiB)
    with Pool.create("/dev/zero", sysfs_root=sysfs) as pool:
        assert pool.backing is Backing.DAX
        assert (pool.offset, pool.geometry.size, len(pool.buffer)) == (0, 8 * MiB, 8 * MiB)
    with Pool.create("/dev/zero", 4 * MiB, sysfs_root=sysfs) as first:  # a region: the device is shared
        assert (first.offset, first.geometry.size, len(first.buffer)) == (0, 4 * MiB, 4 * MiB)
        assert first.header.region_offset == 0 and not first.header.spans_file
    with pytest.raises(PoolRegionError, match="would end at 10485760, past its end"):
        Pool.create("/dev/zero", 4 * MiB, offset=6 * MiB, sysfs_root=sysfs)
    with pytest.raises(PoolRegionError, match="past the end of /dev/zero"):
        Pool.create("/dev/zero", offset=8 * MiB, sysfs_root=sysfs)
    with pytest.raises(PoolRegionError, match="multiple of 2097152"):
        Pool.create("/dev/zero", 3 * MiB, sysfs_root=sysfs)  # DAX maps whole 2 MiB units
    # Each mapping of /dev/zero is new memory: what attach sees is a blank device.
    with pytest.raises(PoolForeign, match="all zeros"):
        Pool.attach("/dev/zero", sysfs_root=sysfs)


def test_a_character_device_without_a_size_is_refused(tmp_path) -> None:
    sysfs = _fake_sysfs(tmp_path, "/dev/zero", None)
    with pytest.raises(PoolForeign, match="DAX device"):
        Pool.attach("/dev/zero", sysfs_root=sysfs)


# -- slot headers ---------------------------------------------------------------------------------


def _header(key: bytes, generation: int, length: int) -> SlotHeader:
    return SlotHeader(key=key, generation=generation, length=length, fmt=SlotFormat.LAYERWISE)


def _write_committed(pool: Pool, offset: int, header: SlotHeader) -> None:
    """What a writer and then the index's commit do to a slot header."""
    pool.write_slot_header(offset, header)
    assert CommitRecords(pool)([offset]) == 1


def test_slot_header_round_trip(pool: Pool) -> None:
    g = pool.geometry
    offset = g.page_offset(4)
    assert pool.read_slot_header(offset) is None
    header = _header(b"A" * 16, 7, 3 * PAGE + 1)
    pool.write_slot_header(offset, header)
    # Written, not committed: no reader sees it, no restart rebuilds it.
    assert pool.read_slot_header(offset) is None and list(pool.iter_slot_headers()) == []
    assert pool.read_slot_header(offset, SlotState.PENDING) == header
    assert list(pool.iter_slot_headers(SlotState.PENDING)) == [(offset, header)]
    assert CommitRecords(pool)([offset]) == 1
    got = pool.read_slot_header(offset)
    assert got == header and got.names(b"A" * 16, 7) and not got.names(b"A" * 16, 8)
    assert list(pool.iter_slot_headers()) == [(offset, header)]
    assert pool.read_slot_header(offset, SlotState.PENDING) is None
    assert CommitRecords(pool)([offset]) == 0  # already committed: left alone


def test_only_the_marked_heads_of_a_batch_turn_committed(pool: Pool) -> None:
    g = pool.geometry
    headers = {g.page_offset(p): _header(bytes([p + 1]) * 16, p + 1, PAGE * 2) for p in (0, 2, 4, 6)}
    for offset, header in headers.items():
        pool.write_slot_header(offset, header)
    marked = [g.page_offset(2), g.page_offset(6)]
    assert CommitRecords(pool)(marked) == 2
    assert dict(pool.iter_slot_headers()) == {offset: headers[offset] for offset in marked}
    assert [o for o, _ in pool.iter_slot_headers(SlotState.PENDING)] == [g.page_offset(0), g.page_offset(4)]
    with pytest.raises(ValueError, match="data offsets"):
        CommitRecords(pool)([g.data_offset + 1])


def test_slot_headers_survive_reattach(pool: Pool, path: str) -> None:
    g = pool.geometry
    headers = {g.page_offset(p): _header(bytes([p]) * 16, p + 1, PAGE * 2) for p in (0, 2, 10, g.num_pages - 2)}
    for offset, header in headers.items():
        _write_committed(pool, offset, header)
    with Pool.attach(path) as other:
        assert dict(other.iter_slot_headers()) == headers


def test_an_overwritten_object_is_not_rebuilt(pool: Pool) -> None:
    g = pool.geometry
    old = _header(b"O" * 16, 1, 4 * PAGE)
    _write_committed(pool, g.page_offset(0), old)
    new = _header(b"N" * 16, 2, 2 * PAGE)
    _write_committed(pool, g.page_offset(2), new)  # takes over old's pages 2 and 3
    assert list(pool.iter_slot_headers()) == [(g.page_offset(2), new)]
    # The old head is still there, but the object is not intact.
    assert pool.read_slot_header(g.page_offset(0)) == old


def test_invalidate_slot_clears_an_older_object_before_data_is_written(pool: Pool) -> None:
    g = pool.geometry
    _write_committed(pool, g.page_offset(0), _header(b"O" * 16, 1, 4 * PAGE))
    pool.invalidate_slot(g.page_offset(3), PAGE)  # a new writer took page 3 and died mid-copy
    assert list(pool.iter_slot_headers()) == []


def test_a_corrupt_slot_header_reads_as_none(pool: Pool) -> None:
    g = pool.geometry
    offset = g.page_offset(1)
    _write_committed(pool, offset, _header(b"C" * 16, 3, 100))
    entry = g.slot_header_offset(1)
    pool.buffer[entry + 30] ^= 0xFF  # inside the generation, CRC now wrong
    assert pool.read_slot_header(offset) is None
    assert list(pool.iter_slot_headers()) == []


def test_slot_header_arguments_are_checked(pool: Pool) -> None:
    g = pool.geometry
    with pytest.raises(ValueError, match="not the start of a page"):
        pool.write_slot_header(g.data_offset + 1, _header(b"K" * 16, 1, 10))
    with pytest.raises(ValueError, match="runs past the end"):
        pool.write_slot_header(g.page_offset(g.num_pages - 1), _header(b"K" * 16, 1, 2 * PAGE))
    with pytest.raises(ValueError, match="16 bytes"):
        SlotHeader(key=b"short", generation=1, length=1)
    with pytest.raises(ValueError, match="generation"):
        SlotHeader(key=b"K" * 16, generation=0, length=1)
    with pytest.raises(ValueError, match="length"):
        SlotHeader(key=b"K" * 16, generation=1, length=0)


def test_a_key_that_contains_the_head_pattern_does_not_confuse_the_scan(pool: Pool) -> None:
    g = pool.geometry
    tricky = b"xMSLT\x03" + b"y" * 10
    _write_committed(pool, g.page_offset(5), _header(tricky, 9, PAGE * 3))
    assert list(pool.iter_slot_headers()) == [(g.page_offset(5), _header(tricky, 9, PAGE * 3))]


# -- payload checksums and layout fingerprints in slot headers ------------------------------------


def test_a_slot_header_carries_the_payload_checksum_and_the_layout(pool: Pool) -> None:
    g = pool.geometry
    offset = g.page_offset(3)
    pool.view(offset, 3 * PAGE)[:] = os.urandom(3 * PAGE)
    checksum = pool.payload_checksum(offset, 3 * PAGE)
    header = SlotHeader(key=b"P" * 16, generation=9, length=3 * PAGE, checksum=checksum, layout=2**64 - 1)
    _write_committed(pool, offset, header)
    assert pool.read_slot_header(offset) == header
    assert list(pool.iter_slot_headers()) == [(offset, header)]
    assert pool.payload_matches(offset, header)
    pool.buffer[offset + 2 * PAGE + 5] ^= 0x01  # one bit of the third page
    assert not pool.payload_matches(offset, header)
    # No checksum recorded: nothing vouches for the payload.
    assert not pool.payload_matches(offset, SlotHeader(key=b"P" * 16, generation=9, length=3 * PAGE))


def test_an_entry_from_before_checksums_reads_without_one(pool: Pool) -> None:
    # The checksum kind, checksum and layout were reserved zero bytes before.
    offset = pool.geometry.page_offset(1)
    _write_committed(pool, offset, _header(b"Z" * 16, 4, 100))
    header = pool.read_slot_header(offset)
    assert header is not None and header.checksum is None and header.layout == 0


def test_a_checksum_kind_without_a_checksum_is_not_a_valid_head(pool: Pool) -> None:
    g = pool.geometry
    offset = g.page_offset(1)
    _write_committed(pool, offset, _header(b"K" * 16, 4, 100))
    entry = g.slot_header_offset(1)
    body = bytearray(pool.buffer[entry : entry + 60])
    body[6] = 1  # says XXH3-64, but the checksum field is 0
    pool.buffer[entry : entry + 64] = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    assert pool.read_slot_header(offset) is None


@pytest.mark.parametrize("bad", [-1, 2**64, "1"])
@pytest.mark.parametrize("kind", [ChecksumKind.POSITION_SUM, ChecksumKind.XXH3_64])
def test_slot_header_checks_its_checksum(bad, kind) -> None:
    with pytest.raises(ValueError, match="checksum"):
        SlotHeader(key=b"K" * 16, generation=1, length=1, checksum=bad, checksum_kind=kind)


def test_a_position_sum_may_be_zero_an_xxh3_checksum_may_not(pool: Pool) -> None:
    offset = pool.geometry.page_offset(2)
    header = SlotHeader(key=b"K" * 16, generation=1, length=100, checksum=0)
    assert header.checksum_kind == ChecksumKind.POSITION_SUM
    _write_committed(pool, offset, header)
    assert pool.read_slot_header(offset) == header
    with pytest.raises(ValueError, match="checksum"):
        SlotHeader(key=b"K" * 16, generation=1, length=1, checksum=0, checksum_kind=ChecksumKind.XXH3_64)


def test_an_xxh3_entry_of_an_older_writer_is_still_checked_the_old_way(pool: Pool) -> None:
    pytest.importorskip("xxhash")
    offset = pool.geometry.page_offset(3)
    pool.view(offset, 2 * PAGE)[:] = os.urandom(2 * PAGE)
    old = pool.payload_checksum(offset, 2 * PAGE, ChecksumKind.XXH3_64)
    header = SlotHeader(b"X" * 16, 3, 2 * PAGE, checksum=old, checksum_kind=ChecksumKind.XXH3_64)
    _write_committed(pool, offset, header)
    read = pool.read_slot_header(offset)
    assert read == header and read.checksum_kind == ChecksumKind.XXH3_64
    assert pool.payload_matches(offset, read)
    pool.buffer[offset + PAGE + 1] ^= 0x04
    assert not pool.payload_matches(offset, read)
