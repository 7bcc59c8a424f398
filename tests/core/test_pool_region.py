"""Pools that are regions of one file (the stand-in for a DAX device the operator carves into regions)."""

from __future__ import annotations

import hashlib
import os
import struct
import uuid

import pytest

from maru_core.pool import (
    Pool,
    PoolExists,
    PoolNotFound,
    PoolOffsetMismatch,
    PoolRegionError,
    PoolSizeMismatch,
)
from maru_core.pool.geometry import DATA_ALIGN, HEADER_REGION
from maru_core.pool.header import HEADER_BYTES

MiB = 1024 * 1024
REGION = 8 * MiB
DEVICE = 3 * REGION  # three regions: [0, 8), [8, 16), [16, 24) MiB
PAGE = 64 * 1024


@pytest.fixture
def device():
    """A blank file of three regions, as a new DAX device reads."""
    path = f"/dev/shm/maru-test-region-{uuid.uuid4().hex}.dev"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, DEVICE)
    os.close(fd)
    yield path
    os.unlink(path)


def _read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_two_regions_of_one_file_are_two_pools_that_never_see_each_others_bytes(device) -> None:
    with Pool.create(device, REGION, PAGE) as first, Pool.create(device, REGION, PAGE, offset=REGION) as second:
        assert os.stat(device).st_size == DEVICE  # a region never resizes its file
        assert (first.offset, second.offset) == (0, REGION)
        assert first.geometry.uuid != second.geometry.uuid
        assert len(first.buffer) == len(second.buffer) == REGION  # each maps its region only
        # The second pool's header sits at the start of its region, recording its offset.
        assert _read(device, REGION, 8) == b"MARUPOOL"
        (recorded,) = struct.unpack_from("<Q", _read(device, REGION + HEADER_BYTES - 16, 8))
        assert recorded == REGION
        data = first.geometry.data_offset
        first.view(data, 5)[:] = b"first"
        second.view(data, 6)[:] = b"second"
        assert bytes(first.view(data, 6)) == b"first\0"
        assert _read(device, data, 5) == b"first"
        assert _read(device, REGION + data, 6) == b"second"
        with Pool.attach(device, offset=REGION) as again:  # size from the header
            assert again.geometry == second.geometry
            assert bytes(again.view(data, 6)) == b"second"
        with Pool.attach(device) as again:  # region 0 of a larger file: not a resized pool
            assert again.geometry == first.geometry and not again.header.spans_file


def test_from_fd_maps_the_region_at_its_offset(device) -> None:
    with Pool.create(device, REGION, PAGE, offset=2 * REGION) as created:
        fd = os.open(device, os.O_RDWR)
        try:
            with Pool.from_fd(fd, expected_size=REGION, offset=2 * REGION) as mapped:
                assert mapped.geometry.uuid == created.geometry.uuid and mapped.offset == 2 * REGION
                mapped.view(mapped.geometry.data_offset, 3)[:] = b"abc"
                assert bytes(created.view(created.geometry.data_offset, 3)) == b"abc"
        finally:
            os.close(fd)


def test_a_region_without_a_size_runs_to_the_end_of_its_file(device) -> None:
    with Pool.create(device, offset=REGION) as pool:
        assert (pool.offset, pool.geometry.size) == (REGION, DEVICE - REGION)


@pytest.mark.parametrize("offset", [4096, REGION + 512, -DATA_ALIGN, 1.5 * DATA_ALIGN])
def test_a_misaligned_offset_is_refused_with_the_nearest_aligned_ones(device, offset) -> None:
    before = _digest(device)
    for attempt in (lambda: Pool.create(device, REGION, offset=offset), lambda: Pool.attach(device, offset=offset)):
        with pytest.raises(ValueError, match="multiple of 2 MiB|non-negative whole number") as caught:
            attempt()
        if isinstance(offset, int) and offset > 0:
            below = offset - offset % DATA_ALIGN
            assert f"start the region at {below} or {below + DATA_ALIGN}" in str(caught.value)
    assert _digest(device) == before


def test_a_region_outside_its_file_is_refused_and_the_file_left_alone(device) -> None:
    before = _digest(device)
    with pytest.raises(PoolRegionError, match=f"would end at {DEVICE + REGION}, past its end"):
        Pool.create(device, 2 * REGION, PAGE, offset=2 * REGION)
    with pytest.raises(PoolRegionError, match="past the end"):
        Pool.create(device, REGION, PAGE, offset=DEVICE)
    with pytest.raises(PoolRegionError, match="no room for a pool header"):
        Pool.attach(device, offset=DEVICE + REGION)
    with pytest.raises(PoolNotFound, match="region of an existing"):
        Pool.create(device + ".missing", REGION, offset=REGION)
    assert _digest(device) == before and os.stat(device).st_size == DEVICE


def test_a_pool_found_at_another_offset_than_its_own_is_refused_not_reinterpreted(device) -> None:
    with Pool.create(device, REGION, PAGE, offset=REGION):
        pass
    # Its header and table copied to the next region, as a moved pool would read.
    with open(device, "r+b") as f:
        f.seek(REGION)
        head = f.read(DATA_ALIGN)
        f.seek(2 * REGION)
        f.write(head)
    before = _digest(device)
    message = f"at offset {2 * REGION} says the pool was created at offset {REGION}"
    with pytest.raises(PoolOffsetMismatch, match=message):
        Pool.attach(device, offset=2 * REGION)
    fd = os.open(device, os.O_RDWR)
    try:
        with pytest.raises(PoolOffsetMismatch, match=message):
            Pool.from_fd(fd, offset=2 * REGION)
    finally:
        os.close(fd)
    with pytest.raises(PoolExists, match="force=True"):
        Pool.create(device, REGION, PAGE, offset=2 * REGION, exist_ok=True)
    assert _digest(device) == before


def test_a_truncated_file_is_refused_where_the_region_no_longer_fits(device) -> None:
    with Pool.create(device, REGION, PAGE, offset=REGION):
        pass
    os.truncate(device, REGION + REGION // 2)
    with pytest.raises(PoolRegionError, match="truncated"):
        Pool.attach(device, offset=REGION)
    with pytest.raises(PoolSizeMismatch, match="expected"):
        Pool.attach(device, expected_size=2 * REGION, offset=REGION)


def test_existing_regions_are_reused_or_replaced_only_as_asked(device) -> None:
    with open(device, "r+b") as f:  # someone else's bytes in the second region
        f.seek(REGION)
        f.write(b"precious" * 512)
    before = _digest(device)
    with pytest.raises(PoolExists, match="force=True"):
        Pool.create(device, REGION, PAGE, offset=REGION)
    assert _digest(device) == before
    outside = _read(device, 0, REGION) + _read(device, 2 * REGION, REGION)
    with Pool.create(device, REGION, PAGE, offset=REGION, force=True) as forced:
        uuid_of_forced = forced.geometry.uuid
    assert _read(device, 0, REGION) + _read(device, 2 * REGION, REGION) == outside  # only the region changed
    with pytest.raises(PoolExists, match="exist_ok=True"):
        Pool.create(device, REGION, PAGE, offset=REGION)
    with Pool.create(device, REGION, PAGE, offset=REGION, exist_ok=True) as reused:
        assert reused.geometry.uuid == uuid_of_forced
    with pytest.raises(PoolExists, match="page size"):
        Pool.create(device, REGION, 2 * PAGE, offset=REGION, exist_ok=True)
    assert _read(device, REGION + HEADER_REGION - 8, 8) == bytes(8)  # the header's 4 KiB stay zero-padded
