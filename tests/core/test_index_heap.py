"""The index gives back the memory of large requests once answered: a refused
request's frames (and its megabytes of keys and arrays) are not kept alive by
a reference cycle through its exception's traceback, and the heap glibc keeps
after large frames is trimmed (``maru_core.index.heap``), rate-limited.
A trimmer with a fake clock, a server on a thread of this process (to look
at its live objects), and a real index process (its VmRSS)."""

from __future__ import annotations

import gc
import platform
import sys
import time

import pytest

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.index.heap import HeapTrimmer, glibc_malloc_trim
from maru_core.index.launcher import ThreadedIndex
from maru_core.index.registry_types import QuotaExceeded
from maru_core.protocol import MAX_BATCH_KEYS
from maru_tools.index_process import IndexProcess

MIB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trimmer(**kwargs) -> tuple[HeapTrimmer, list[float], FakeClock]:
    clock, calls = FakeClock(), []
    heap = HeapTrimmer(64 * MIB, 1.0, MIB, 3.0, trim=lambda: calls.append(clock.now), clock=clock, **kwargs)
    return heap, calls, clock


def test_no_trim_below_the_threshold_one_once_it_is_crossed():
    heap, calls, clock = trimmer()
    assert not heap.trim_if_due()  # nothing freed yet
    heap.note(MIB)
    assert heap.trim_if_due() and calls == [100.0]  # the first one: no trim before it
    clock.now += 1.5
    heap.note(64 * MIB - 1)
    assert not heap.trim_if_due() and len(calls) == 1  # under 64 MiB, and 3 s have not passed
    heap.note(1)
    assert heap.trim_if_due() and calls == [100.0, 101.5]
    assert not heap.trim_if_due()  # nothing freed since


def test_at_most_one_trim_per_interval_however_much_is_freed():
    heap, calls, clock = trimmer()
    heap.note(64 * MIB)
    assert heap.trim_if_due()
    for _ in range(7):  # a flood: 448 MiB more within the interval
        clock.now += 0.125
        heap.note(64 * MIB)
        heap.trim_if_due()
    assert calls == [100.0]
    clock.now += 0.125  # one interval after the first
    assert heap.trim_if_due() and calls == [100.0, 101.0]


def test_what_the_last_large_frames_left_is_trimmed_once_settled():
    heap, calls, clock = trimmer()
    heap.note(64 * MIB)
    heap.trim_if_due()
    heap.note(4 * MIB)  # the flood's tail, after its last trim
    clock.now += 2.9
    assert not heap.trim_if_due()
    clock.now += 0.1
    assert heap.trim_if_due() and len(calls) == 2
    clock.now += 3.0  # the follow-up of a trim that counted frames
    assert heap.trim_if_due() and len(calls) == 3
    heap.note(MIB - 1)  # heartbeats' few bytes: never alone worth a trim
    clock.now += 100
    assert not heap.trim_if_due() and len(calls) == 3


def test_a_trim_is_followed_by_one_more_once_settled():
    """A request still under way at a trim (a large one runs in slices, the sweep between
    them) frees its megabytes after it: they are trimmed a settle time later, once."""
    heap, calls, clock = trimmer()
    heap.note(8 * MIB)
    assert heap.trim_if_due()
    for _ in range(11):  # nothing noted since: the sweep runs every 0.25 s
        clock.now += 0.25
        heap.trim_if_due()
    assert calls == [100.0]
    clock.now += 0.25
    assert heap.trim_if_due() and calls == [100.0, 103.0]
    clock.now += 60
    assert not heap.trim_if_due() and len(calls) == 2  # that one counted nothing: no more


def test_elsewhere_than_linux_there_is_no_trim(monkeypatch):
    import maru_core.index.heap as heap_module

    monkeypatch.setattr(heap_module.sys, "platform", "darwin")
    assert glibc_malloc_trim() is None
    heap = HeapTrimmer()
    heap.note(128 * MIB)
    assert not heap.enabled and not heap.trim_if_due()


@pytest.mark.parametrize("kwargs", [{"threshold_bytes": 0}, {"settle_bytes": 128 * MIB},
                                    {"interval_s": -1}, {"interval_s": 5.0}])  # fmt: skip
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        HeapTrimmer(**kwargs)


def test_glibc_malloc_trim_is_found_on_linux_glibc():
    assert sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc", "this test runs on Linux/glibc"
    trim = glibc_malloc_trim()
    assert trim is not None
    assert trim() in (0, 1)


def _one_large_reserve(client: IndexClient, first: int) -> None:
    keys = [(first + i).to_bytes(16, "little") for i in range(MAX_BATCH_KEYS)]
    client.reserve([(k, 1) for k in keys])


def test_a_refused_request_leaves_nothing_alive(make_pool):
    """Before, a reserve refused by a quota left a cycle (the exception, its traceback's
    frames, a frame's local naming the exception) that held its keys and arrays, 6 MB per
    2 MiB request, until the garbage collector's next pass: none came while the index idled."""
    pool = make_pool("test-heap", 256 * MIB, 4096)
    with ThreadedIndex(pool, max_lease_pool_fraction=0.5) as index:
        client = IndexClient(index.url, timeout_s=30, heartbeat=False)
        try:
            _one_large_reserve(client, 0)  # half the pool: the lease's quota
            gc.collect()
            gc.disable()  # what is left now stays until looked at
            try:
                for n in range(1, 4):
                    with pytest.raises(IndexRejected, match="max-lease-pool-fraction"):
                        _one_large_reserve(client, n * MAX_BATCH_KEYS)
                # type(), not isinstance(): a dead weak proxy among the objects raises on isinstance
                left = [o for o in gc.get_objects() if issubclass(type(o), QuotaExceeded)]
            finally:
                gc.enable()
            assert left == [], f"{len(left)} refusals still alive"
        finally:
            client.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_the_index_process_gives_back_a_burst_of_large_frames():
    """Ten 2 MiB reserves (one accepted, nine refused by the lease's quota): the index's
    resident memory is back within 7 MiB of where it was within a few seconds (3.5 MiB
    here: the reservations and a 1 MiB receive buffer). Before, 62 MiB stayed (the refused
    requests' cycles); without malloc_trim, 10.5 MiB (free heap glibc kept)."""
    with IndexProcess(pool_size="64Mi", extra_args=("--page-size", "4Ki")) as index:
        client = index.client(timeout_s=30)
        try:
            client.connect()
            time.sleep(0.5)  # the connection and lease settled
            before = _rss_mib(index.pid)
            for n in range(10):
                try:
                    _one_large_reserve(client, n * MAX_BATCH_KEYS)
                except IndexRejected as exc:
                    assert exc.error_type == "quota"
            peak = _rss_mib(index.pid)
            deadline, after = time.monotonic() + 8.0, peak
            while time.monotonic() < deadline and after - before > 7.0:
                time.sleep(0.25)
                after = _rss_mib(index.pid)
            assert after - before <= 7.0, (before, peak, after)
            assert client.heartbeat() > 0  # and it still answers
        finally:
            client.close()
