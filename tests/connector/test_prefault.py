"""Pool pages mapped ahead of the first hit (CPU backend): after the
prefaulter ran, reading or writing every page of a fresh mapping takes no
page fault;
it stops between slices when asked, gives up quietly where the kernel
refuses, and the worker's knob turns it on and off."""

import ctypes
import errno
import mmap
import os
import resource
import uuid

import numpy as np
import pytest

from kv_builders import make_kv_caches
from maru_connector.config import PREFAULT_UNSET_MAX_BYTES, parse_config
from maru_connector.transfer import prefault
from maru_connector.transfer.prefault import PoolPrefaulter
from maru_connector.worker import open_resources
from maru_core.pool import Pool

PAGE = os.sysconf("SC_PAGE_SIZE")
SIZE = 32 << 20


@pytest.fixture
def shm_file():
    """A tmpfs file whose pages are all in memory (written through a mapping
    that is gone), as a pool's are once engines have stored into it."""
    path = f"/dev/shm/maru-prefault-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SIZE)
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED) as m:
        m.write(os.urandom(SIZE))
    yield fd
    os.close(fd)
    os.unlink(path)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def faults_touching_every_page(fd: int, prefaulted: bool, write: bool) -> tuple[int, int]:
    """(minor faults of this thread while it reads, or writes, one byte of
    every page of a fresh mapping; bytes the prefaulter populated first)."""
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED) as m:
        pages = np.frombuffer(m, dtype=np.uint8)
        populated = 0
        if prefaulted:
            filler = PoolPrefaulter(pages.ctypes.data, SIZE, slice_bytes=4 << 20)
            assert filler.wait(timeout=30)
            populated = filler.populated
        before = minor_faults()
        if write:
            pages[::PAGE] = 1  # a write only: no read fault before it
        else:
            int(pages[::PAGE].sum())
        faults = minor_faults() - before
        del pages
    return faults, populated


def test_a_prefaulted_mapping_reads_without_page_faults(shm_file):
    cold, _ = faults_touching_every_page(shm_file, prefaulted=False, write=False)
    warm, populated = faults_touching_every_page(shm_file, prefaulted=True, write=False)
    pages = SIZE // PAGE
    # The kernel maps up to 16 neighbouring pages per read fault
    # ("fault-around"), so a cold read of N pages takes about N / 16 faults.
    assert cold >= pages // 32, cold
    assert populated == SIZE
    assert warm <= 16, (warm, cold)


def test_a_prefaulted_mapping_is_written_without_page_faults(shm_file):
    """A store writes into the pool: mapped ahead, the pages are writable."""
    cold, _ = faults_touching_every_page(shm_file, prefaulted=False, write=True)
    warm, _ = faults_touching_every_page(shm_file, prefaulted=True, write=True)
    assert cold >= SIZE // PAGE // 2, cold  # one fault per page written
    assert warm <= 16, (warm, cold)


def test_stop_ends_it_between_slices(shm_file):
    with mmap.mmap(shm_file, SIZE, mmap.MAP_SHARED) as m:
        pages = np.frombuffer(m, dtype=np.uint8)
        filler = PoolPrefaulter(pages.ctypes.data, SIZE, slice_bytes=PAGE)
        filler.stop()
        assert filler.done and filler.populated < SIZE
        assert filler.populated % PAGE == 0
        del pages


def test_a_range_is_trimmed_to_whole_pages():
    buffer = np.zeros(3 * PAGE, dtype=np.uint8)
    start = buffer.ctypes.data + 1  # mid-page: its first partial page is left out
    filler = PoolPrefaulter(start, 2 * PAGE)
    assert filler.wait(timeout=10)
    assert filler.address % PAGE == 0 and filler.address >= start
    assert filler.address + filler.nbytes <= start + 2 * PAGE
    assert filler.populated == filler.nbytes


def test_a_kernel_that_refuses_ends_it_quietly(shm_file, monkeypatch, caplog):
    def refuse(address, nbytes, advice):
        ctypes.set_errno(errno.EINVAL)  # a kernel before 5.14
        return -1

    monkeypatch.setattr(prefault, "_madvise", refuse)
    with mmap.mmap(shm_file, SIZE, mmap.MAP_SHARED) as m:
        pages = np.frombuffer(m, dtype=np.uint8)
        with caplog.at_level("INFO", logger=prefault.logger.name):
            filler = PoolPrefaulter(pages.ctypes.data, SIZE)
            assert filler.wait(timeout=10)
        assert filler.populated == 0 and filler.error.errno == errno.EINVAL
        assert "hits fault them in" in caplog.text
        del pages


@pytest.mark.parametrize("knob, expected", [(None, True), (True, True), (False, False)])
def test_the_worker_knob_turns_it_on_and_off(knob, expected):
    path = f"/dev/shm/maru-prefault-worker-{uuid.uuid4().hex}"
    pool = Pool.create(path, 4 << 20, page_size=PAGE)
    try:
        raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": path,
               "maru_kv_chunk_tokens": 32}
        if knob is not None:
            raw["maru_prefault_pool"] = knob
        cfg = parse_config(raw, 16)
        kv = make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=16, head_size=8)
        res = open_resources(cfg, kv, 16)  # a 4 MiB pool: unset means on
        try:
            assert (res.engine.prefaulter is not None) is expected
            if expected:
                assert res.engine.prefaulter.wait(timeout=30)
                assert res.engine.prefaulter.populated == res.engine.pool_size
        finally:
            res.close()
        assert res.engine.prefaulter is None or res.engine.prefaulter.done
    finally:
        pool.close()
        os.unlink(path)


@pytest.mark.parametrize("knob, pool_bytes, expected", [
    (None, PREFAULT_UNSET_MAX_BYTES, True),
    (None, PREFAULT_UNSET_MAX_BYTES + 1, False),  # page tables of a huge pool: only when asked
    (True, PREFAULT_UNSET_MAX_BYTES + 1, True),
    (False, 1 << 20, False),
])
def test_unset_maps_pools_ahead_up_to_a_size(knob, pool_bytes, expected):
    raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/dev/shm/unused"}
    if knob is not None:
        raw["maru_prefault_pool"] = knob
    assert parse_config(raw).prefault_pool(pool_bytes) is expected
