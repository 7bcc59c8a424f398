"""The lookup service's batching and per-pass wait, over the counting fake index.

The end-to-end bound (a real index behind a slow proxy, vLLM's scheduler)
is ``tests/e2e/test_lookup_budget.py``; here, what it rests on: queued
lookups go out together, an index without ``match_prefixes`` still answers
them, a forgotten lookup is never sent, and the wait starts over each pass.
"""

from __future__ import annotations

import threading
import time

from maru_connector.lookup import LookupService
from maru_tools.cluster import wait_until

from fake_index import FakeIndex, Location


class Geometry:
    page_size, num_pages, data_offset = 4096, 4096, 0


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _index(committed: int = 4) -> FakeIndex:
    index = FakeIndex(Geometry())
    for i in range(committed):
        index.committed[key(i)] = Location(i * 4096, 4096, 1)
    return index


def _gate(index: FakeIndex) -> threading.Event:
    """Hold the index's next replies until the event is set (a slow index)."""
    gate = threading.Event()
    enter = index._enter

    def held(op):
        gate.wait(10)
        enter(op)

    index._enter = held
    return gate


def _queue_behind_a_slow_lookup(index, lookup, n):
    gate = _gate(index)
    keys = b"".join(key(i) for i in range(6))
    answers = [lookup.match(f"r{i}", [keys]) for i in range(n)]
    gate.set()
    return answers


def test_lookups_queued_while_one_is_out_go_in_one_round_trip_and_wait_one_timeout_per_pass():
    index = _index()
    lookup = LookupService(index.client, timeout_s=0.1)
    started = time.monotonic()
    assert _queue_behind_a_slow_lookup(index, lookup, 10) == [None] * 10
    assert time.monotonic() - started < 0.3  # one timeout for the pass, not ten
    wait_until(lambda: index.calls["match_prefixes"] == 1, 5)
    wait_until(lambda: all(q.future.done() for q in lookup._pending.values()), 5)
    lookup.end_pass()
    assert [lookup.match(f"r{i}", []) for i in range(10)] == [4] * 10
    assert dict(index.calls) == {"match_prefix": 1, "match_prefixes": 1}
    lookup.close()


def test_a_new_pass_waits_again_and_a_lone_lookup_on_a_healthy_index_is_answered_at_once():
    index = _index()
    lookup = LookupService(index.client, timeout_s=0.1)
    assert _queue_behind_a_slow_lookup(index, lookup, 2) == [None, None]
    keys = b"".join(key(i) for i in range(6))
    assert lookup.match("late", [keys]) is None  # the pass's wait is spent: no wait at all
    lookup.end_pass()
    wait_until(lambda: lookup.num_pending == 3 and all(q.future.done() for q in lookup._pending.values()), 5)
    assert lookup.match("next", [keys]) == 4  # a fresh pass: answered in it
    lookup.close()


def test_an_index_without_match_prefixes_answers_queued_lookups_one_list_at_a_time():
    index = _index()
    index.knows_match_prefixes = False
    lookup = LookupService(index.client, timeout_s=0.1)
    _queue_behind_a_slow_lookup(index, lookup, 3)
    wait_until(lambda: all(q.future.done() for q in lookup._pending.values()), 5)
    assert [lookup.match(f"r{i}", []) for i in range(3)] == [4] * 3
    assert dict(index.calls) == {"match_prefix": 3, "match_prefixes": 1}
    lookup.close()


def test_a_queued_lookup_of_a_forgotten_request_is_never_sent():
    index = _index()
    lookup = LookupService(index.client, timeout_s=0.05)
    gate = _gate(index)
    keys = b"".join(key(i) for i in range(6))
    assert lookup.match("out", [keys]) is None
    assert lookup.match("gone", [keys, keys]) is None  # queued behind "out"
    lookup.forget("gone")
    gate.set()
    wait_until(lambda: lookup._pending["out"].future.done(), 5)
    time.sleep(0.05)
    assert dict(index.calls) == {"match_prefix": 1}
    lookup.close()
