"""A writer whose reservation lapsed, against a real index on loopback: its
late copy never lands in another writer's object, and a reader can tell."""

from __future__ import annotations

import time

import pytest

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.index.launcher import ThreadedIndex
from maru_core.pool import SlotHeader

TOKEN = "fence-token"
LENGTH = 256 * 1024


@pytest.fixture
def pool(make_pool):
    return make_pool("test-fence", 16 * 1024 * 1024, 64 * 1024)


@pytest.fixture
def index(pool):
    # Leases live (heartbeats); reservations lapse after 0.3 s; expiry runs every 0.5 s.
    with ThreadedIndex(pool, token=TOKEN, lease_ttl_s=2.0, reservation_ttl_s=0.3) as index:
        yield index


def fenced_pages(index: ThreadedIndex) -> int:
    return index.on_loop(lambda: index.service.server.registry.fenced_pages)


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def reservation_of(index: ThreadedIndex, key: bytes):
    return index.on_loop(lambda: index.service.server.registry.describe(key))


def test_a_late_copy_of_a_lapsed_writer_never_lands_in_another_object(index, pool):
    with IndexClient(index.url, token=TOKEN, client_name="slow") as slow, \
            IndexClient(index.url, token=TOKEN, client_name="fast") as fast:
        (lapsed,) = slow.reserve([(b"A" * 16, LENGTH)])
        deadline = time.monotonic() + 5
        while reservation_of(index, b"A" * 16) and time.monotonic() < deadline:
            time.sleep(0.05)  # the reservation lapses; both leases live
        assert reservation_of(index, b"A" * 16) is None

        (slot,) = fast.reserve([(b"B" * 16, LENGTH)])
        assert slot.offset != lapsed.offset  # the lapsed writer's pages are not handed out
        assert fenced_pages(index) == LENGTH // pool.geometry.page_size
        pool.view(slot.offset, LENGTH)[:] = b"\x42" * LENGTH
        header = SlotHeader(b"B" * 16, slot.generation, LENGTH, checksum=pool.payload_checksum(slot.offset, LENGTH))
        pool.write_slot_header(slot.offset, header)
        assert fast.commit([b"B" * 16]) == [True]

        pool.view(lapsed.offset, LENGTH)[:] = b"\xee" * LENGTH  # the slow writer copies late
        (location,) = fast.retrieve([b"B" * 16])
        assert pool.payload_matches(location.offset, pool.read_slot_header(location.offset))
        fast.unpin([b"B" * 16])

        assert slow.commit([b"A" * 16]) == [False]  # too late; and it is done with those pages
        assert fenced_pages(index) == 0


def test_a_writer_that_heartbeats_but_never_commits_holds_at_most_its_quota_and_only_for_a_while(pool):
    """Before, one lease could reserve the whole pool, never commit and keep its
    lease alive: every other writer got ``no_space`` for as long as it lived,
    its lapsed pages fenced until its lease ended. Now a lease holds at most
    its quota of pages (reserved or fenced), is told so by name, and a live
    writer's fence ends after ``max_fence_s``."""
    page = pool.geometry.page_size
    pages = pool.geometry.num_pages
    with ThreadedIndex(pool, token=TOKEN, reservation_ttl_s=0.3, max_lease_pool_fraction=0.5,
                       max_fence_s=1.0) as index, \
            IndexClient(index.url, token=TOKEN) as hog, IndexClient(index.url, token=TOKEN) as honest:
        grab = [(bytes([9]) + i.to_bytes(4, "little") + bytes(11), page) for i in range(pages)]
        slots = list(hog.reserve(grab))
        held = sum(slot is not None for slot in slots)
        assert held == pages // 2  # its quota, not the pool
        with pytest.raises(IndexRejected) as refused:
            hog.reserve([(bytes([8]) + bytes(15), page)])
        assert refused.value.error_type == "quota" and "--max-lease-pool-fraction" in str(refused.value)
        # The others still store in the half it cannot take.
        mine = [(bytes([7]) + i.to_bytes(4, "little") + bytes(11), page) for i in range(pages // 4)]
        assert all(slot is not None for slot in honest.reserve(mine))
        honest.abort([k for k, _ in mine])
        # Its reservations lapse and are fenced while it heartbeats, then freed.
        assert wait_until(lambda: fenced_pages(index) == held, 5.0)
        assert wait_until(lambda: fenced_pages(index) == 0, 5.0)
        hog.heartbeat()
        assert index.on_loop(lambda: index.service.server.registry.stats().leases) == 2
        assert all(slot is not None for slot in hog.reserve(grab[: pages // 2]))  # its quota is back
