"""The batch slot-header check agrees with the one-object check, entry for entry.

``SlotHeaderCheck`` is what the index commits through and what a reader
checks its pinned objects with; ``Pool.read_slot_header(offset).names(key,
generation)`` (and the header's ``layout``) is the reference it must equal,
in either head state (pending: the index's check before it commits;
committed: a reader's). Hypothesis writes real entries, commits some, then
corrupts them byte by byte, and asks both with right and wrong keys,
generations, layouts and offsets.
"""

from __future__ import annotations

import os
import uuid
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maru_core.pool import Pool, SlotFormat, SlotHeader, SlotState
from maru_core.pool.commit_records import CommitRecords
from maru_core.pool.geometry import SLOT_HEADER_BYTES
from maru_core.pool.slot_check import SlotHeaderCheck

PAGE = 4096
PAGES = 64
CRC_SPAN = SLOT_HEADER_BYTES - 4  # the CRC32 closes each entry


@pytest.fixture(scope="module")
def pool():
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex}.pool"
    with Pool.create(path, 4 * 1024 * 1024 + PAGES * PAGE, page_size=PAGE) as p:
        yield p
    os.unlink(path)


def reference(pool: Pool, key: bytes, offset: int, generation: int, layout: int | None,
              state: SlotState = SlotState.COMMITTED) -> bool:  # fmt: skip
    g = pool.geometry
    if not (offset >= g.data_offset and (offset - g.data_offset) % g.page_size == 0
            and offset < g.data_offset + g.num_pages * g.page_size):  # fmt: skip
        return False
    header = pool.read_slot_header(offset, state)
    return header is not None and header.names(key, generation) and (layout is None or header.layout == layout)


headers = st.builds(
    SlotHeader,
    key=st.binary(min_size=16, max_size=16),
    generation=st.integers(1, 2**64 - 1),
    length=st.integers(1, 3 * PAGE),
    fmt=st.sampled_from(list(SlotFormat)),
    checksum=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    layout=st.integers(0, 2**64 - 1),
)
# (byte of the head entry, value) pairs written over it after the header
corruptions = st.lists(st.tuples(st.integers(0, SLOT_HEADER_BYTES - 1), st.integers(0, 255)), max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=headers,
    page=st.integers(0, PAGES - 4),
    corrupt=corruptions,
    ask_key=st.one_of(st.none(), st.binary(min_size=16, max_size=16)),
    ask_generation_delta=st.sampled_from([0, 0, 1]),
    ask_layout=st.one_of(st.none(), st.just("own"), st.integers(0, 2**64 - 1)),
    offset_delta=st.sampled_from([0, 0, 0, 1, -PAGE, 10**9]),
    reseal=st.booleans(),
    committed=st.booleans(),
    state=st.sampled_from([SlotState.PENDING, SlotState.COMMITTED]),
)
def test_batch_check_equals_the_one_object_check(
    pool, header, page, corrupt, ask_key, ask_generation_delta, ask_layout, offset_delta, reseal, committed, state
) -> None:
    g = pool.geometry
    offset = g.page_offset(page)
    pool.invalidate_slot(offset, 4 * PAGE)
    pool.write_slot_header(offset, header)
    if committed:
        CommitRecords(pool)([offset])
    entry = g.slot_header_offset(page)
    for at, value in corrupt:
        pool.buffer[entry + at] = value
    if reseal:  # fields that disagree under a valid CRC (a buggy writer, not a torn one)
        body = bytes(pool.buffer[entry : entry + CRC_SPAN])
        pool.buffer[entry + CRC_SPAN : entry + SLOT_HEADER_BYTES] = zlib.crc32(body).to_bytes(4, "little")
    key = header.key if ask_key is None else ask_key
    generation = (header.generation + ask_generation_delta) % 2**64
    layout = header.layout if ask_layout == "own" else ask_layout
    where = offset + offset_delta
    got = SlotHeaderCheck(pool, state)(key, np.array([where]), np.array([generation], dtype=np.uint64), layout=layout)
    assert bool(got[0]) == reference(pool, key, where, generation, layout, state)


def test_a_batch_answers_per_entry_and_refuses_keys_of_another_size(pool) -> None:
    g = pool.geometry
    written = [SlotHeader(bytes([i]) * 16, 7 + i, PAGE, layout=0xAB) for i in range(4)]
    offsets = [g.page_offset(10 * i) for i in range(4)]
    for offset, header in zip(offsets, written):
        pool.invalidate_slot(offset, PAGE)
        pool.write_slot_header(offset, header)
    keys = b"".join(h.key for h in written)
    generations = np.array([h.generation for h in written], dtype=np.uint64)
    check = SlotHeaderCheck(pool)
    # Written, not committed: a reader refuses them all; the index's pre-commit check accepts them.
    assert check(keys, np.array(offsets), generations).tolist() == [False] * 4
    assert SlotHeaderCheck(pool, SlotState.PENDING)(keys, np.array(offsets), generations).tolist() == [True] * 4
    CommitRecords(pool)(offsets)
    assert check(keys, np.array(offsets), generations, layout=0xAB).tolist() == [True] * 4
    assert check(keys, np.array(offsets), generations, layout=0xAC).tolist() == [False] * 4
    generations[2] += 1
    assert check(keys, np.array(offsets), generations).tolist() == [True, True, False, True]
    with pytest.raises(ValueError, match="16 bytes each"):
        check(keys[:-1], np.array(offsets), generations)


# (field offset in the entry, bytes written there) under a resealed CRC; offsets as in
# maru_core.pool.slots: state 4, format 5, checksum kind 6, generation 24, page count 40,
# payload checksum 44
INCONSISTENT = {
    "checksum kind 1 without a checksum": [(6, b"\x01"), (44, bytes(8))],
    "a checksum under kind 0": [(6, b"\x00"), (44, b"\x01" + bytes(7))],
    "an unknown checksum kind": [(6, b"\x07")],
    "an unknown format": [(5, b"\x63")],
    "a continuation, not a head": [(4, b"\x02")],
    "a head written, not committed": [(4, b"\x01")],
    "an unknown state": [(4, b"\x04")],
    "a page count that does not match the length": [(40, (9).to_bytes(4, "little"))],
    "generation 0": [(24, bytes(8))],
}


@pytest.mark.parametrize("fields", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_fields_that_disagree_under_a_valid_crc_are_refused_by_both(pool, fields) -> None:
    g = pool.geometry
    header = SlotHeader(b"k" * 16, 5, PAGE, checksum=3)
    offset = g.page_offset(30)
    pool.invalidate_slot(offset, PAGE)
    pool.write_slot_header(offset, header)
    CommitRecords(pool)([offset])
    entry = g.slot_header_offset(30)
    for at, raw in fields:
        pool.buffer[entry + at : entry + at + len(raw)] = raw
    body = bytes(pool.buffer[entry : entry + CRC_SPAN])
    pool.buffer[entry + CRC_SPAN : entry + SLOT_HEADER_BYTES] = zlib.crc32(body).to_bytes(4, "little")
    generation = int.from_bytes(pool.buffer[entry + 24 : entry + 32], "little")
    assert not reference(pool, header.key, offset, generation, None)
    assert not SlotHeaderCheck(pool)(header.key, np.array([offset]), np.array([generation], dtype=np.uint64))[0]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(st.integers(0, PAGES // 4 - 1), headers), min_size=1, max_size=8,
                      unique_by=lambda row: row[0]))
def test_stored_checksums_are_what_each_header_records(pool, batch) -> None:
    """The batch read of recorded payload checksums equals the one-object
    read, 0 standing for a header that records none."""
    g = pool.geometry  # objects four pages apart: none overlaps another (3 pages at most)
    offsets = [g.data_offset + 4 * slot * g.page_size for slot, _ in batch]
    for offset, (_, header) in zip(offsets, batch):
        pool.write_slot_header(offset, header)
    got = SlotHeaderCheck(pool).stored_checksums(np.array(offsets, dtype=np.int64))
    assert got.dtype == np.uint64
    assert got.tolist() == [pool.read_slot_header(o, SlotState.PENDING).checksum or 0 for o in offsets]
