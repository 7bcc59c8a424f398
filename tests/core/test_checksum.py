"""Payload checksums: a batch on several threads gives each object's own checksum, in order."""

from __future__ import annotations

import os
import threading

import pytest

from maru_core.pool import checksum
from maru_core.pool.checksum import checksum_threads, payload_checksum, payload_checksums


def test_a_batch_on_threads_equals_one_checksum_per_object_in_order() -> None:
    blobs = [os.urandom(1 << 20) + bytes([i]) for i in range(6)]
    want = [payload_checksum(b) for b in blobs]
    assert payload_checksums(blobs, threads=1) == want
    assert payload_checksums(blobs, threads=4) == want
    assert len(set(want)) == 6


def test_a_batch_of_large_objects_runs_on_the_checksum_threads(monkeypatch) -> None:
    seen: set[str] = set()

    def recording(data):
        seen.add(threading.current_thread().name)
        return 7

    monkeypatch.setattr(checksum, "payload_checksum", recording)
    assert payload_checksums([bytes(1 << 20)] * 4, threads=2) == [7] * 4
    assert seen and all(name.startswith("maru-checksum") for name in seen)
    seen.clear()
    payload_checksums([bytes(4096)] * 4, threads=2)  # small objects: not worth a hand-off
    assert seen == {threading.current_thread().name}


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (7, 1), (16, 4), (64, 8)])
def test_threads_are_a_quarter_of_the_cores_from_one_to_eight(monkeypatch, cores: int, threads: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert checksum_threads() == threads
