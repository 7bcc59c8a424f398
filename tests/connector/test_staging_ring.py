"""The CUDA engine's staging ring, driven as its copy thread drives it, with
stand-in streams and events (the ring's logic runs on the CPU; the copies it
orders are covered by test_transfer_cuda.py on a GPU).

The property: no span is handed out while a fill whose scatter is not queued
still holds any of its bytes, and a span that reuses the bytes of a
scattered fill makes the load stream wait for that scatter's event.
"""

from hypothesis import given, settings, strategies as st

from maru_connector.transfer.cuda import _StagingRing

CAPACITY = 64


class Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def drive(loads: list[list[int]]):
    """Run loads of fills (sizes in bytes) through one ring the way
    ``_run_load`` does; check every span against what is still in use."""
    ring, stream = _StagingRing(CAPACITY, "cpu"), Stream()
    scattered: dict[int, tuple[int, int]] = {}  # event id -> span it freed
    live: list[tuple[int, int]] = []  # spans written, scatter not queued
    events = 0
    for fills in loads:
        ring.restart()
        pending = []
        for size in fills:
            offset = ring.take(size, stream)
            while offset is None:
                assert pending, "the ring refused a fill with nothing left to scatter"
                start, end = pending.pop(0)
                events += 1
                ring.freed(start, events)
                scattered[events] = (start, end)
                live.remove((start, end))
                offset = ring.take(size, stream)
            span = (offset, offset + size)
            assert 0 <= offset and span[1] <= CAPACITY
            for other in live:
                assert span[1] <= other[0] or other[1] <= span[0], (span, other)
            # every scattered span this one overlaps and was not yet waited for
            for event in stream.waited:
                scattered.pop(event, None)
            for event, other in scattered.items():
                assert span[1] <= other[0] or other[1] <= span[0], (
                    f"{span} reuses {other} without waiting for its scatter")
            live.append(span)
            pending.append(span)
        while pending:
            start, end = pending.pop(0)
            events += 1
            ring.freed(start, events)
            scattered[events] = (start, end)
            live.remove((start, end))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(1, CAPACITY // 2), min_size=1, max_size=12),
                min_size=1, max_size=6))
def test_no_span_overlaps_bytes_still_in_use(loads):
    drive(loads)


def test_a_small_load_s_fills_all_fit_without_waiting_for_a_scatter():
    # 1k tokens on 32 layers of 4 MiB, a 128 MiB ring: fills of 1, 2, 4, 8,
    # 16 layers, then 1 (units of 4 MiB). Two fixed halves of 64 MiB made the
    # third fill wait for the first one's scatter.
    ring, stream = _StagingRing(32, "cpu"), Stream()
    offsets = [ring.take(n, stream) for n in (1, 2, 4, 8, 16, 1)]
    assert offsets == [0, 1, 3, 7, 15, 31] and not stream.waited
    assert ring.take(1, stream) is None  # wraps onto the first fill: scatter it first
    ring.freed(0, "e0")
    assert ring.take(1, stream) == 0 and stream.waited == ["e0"]
    assert ring.take(2, stream) is None  # the second fill still holds bytes 1-2


def test_a_failed_load_s_unscattered_spans_are_dropped_at_the_next_load():
    ring, stream = _StagingRing(8, "cpu"), Stream()
    assert ring.take(4, stream) == 0 and ring.take(4, stream) == 4
    ring.restart()  # that load failed before queueing its scatters
    assert ring.take(8, stream) == 0 and not stream.waited
