"""Payload checksums: a batch on several threads gives each object's own checksum, in order."""

from __future__ import annotations

import os
import subprocess
import sys
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


# -- the position-weighted sum: numpy against the definition -------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import numpy as np  # noqa: E402

from maru_core.pool.checksum import position_sum, position_sum_rows  # noqa: E402

# The compiled pass where numba is installed, and numpy's blocks always.
CPU_BACKENDS = ["numpy"] + (["numba"] if checksum.CPU_BACKEND == "numba" else [])


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request, monkeypatch):
    if request.param == "numba":
        checksum.warm_up()
    monkeypatch.setattr(checksum, "CPU_BACKEND", request.param)
    return request.param


def test_a_first_checksum_never_waits_for_the_compiler(monkeypatch) -> None:
    """Before ``warm_up`` the sums run on numpy; after it, on the compiled pass."""
    monkeypatch.setattr(checksum, "_compiled", {})
    data = os.urandom(1 << 16)
    want = checksum.position_sum(data)
    assert checksum._compiled == {}
    if checksum.CPU_BACKEND == "numba":
        checksum.warm_up()
        assert set(checksum._compiled) == {True, False} and checksum.position_sum(data) == want


def reference_position_sum(data: bytes, base_words: int = 0) -> int:
    """The definition, word by word: sum_j (base + j + 1) * w_j mod 2**64 over
    little-endian 32-bit words, the last one zero-padded."""
    data = bytes(data) + bytes(-len(data) % 4)
    total = 0
    for j in range(len(data) // 4):
        total += (base_words + j + 1) * int.from_bytes(data[4 * j : 4 * j + 4], "little")
    return total % 2**64


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=20_000), base=st.integers(0, 2**64 - 1), cut=st.integers(0, 5_000))
def test_the_cpu_sum_equals_the_definition_and_splits_at_any_word(cpu_backend, data: bytes, base: int,
                                                                  cut: int) -> None:
    assert position_sum(data, base) == reference_position_sum(data, base)
    # A piece starting at word w contributes the sum with base w: the pieces add up.
    cut = min(cut, len(data) // 4) * 4
    head, tail = data[:cut], data[cut:]
    assert (position_sum(head) + position_sum(tail, cut // 4)) % 2**64 == position_sum(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), words=st.integers(1, 300), gap=st.integers(0, 9), base=st.integers(0, 2**64 - 1),
       seed=st.integers(0, 2**32 - 1))
def test_rows_at_any_stride_sum_as_their_bytes_end_to_end(cpu_backend, rows: int, words: int, gap: int, base: int,
                                                          seed: int) -> None:
    backing = np.random.default_rng(seed).integers(0, 256, rows * (words + gap) * 4, dtype=np.uint8)
    strided = backing.reshape(rows, (words + gap) * 4)[:, : words * 4]  # rows of blocks in a larger cache
    assert position_sum_rows(strided, base) == reference_position_sum(strided.tobytes(), base)


def test_a_large_object_crosses_the_numpy_blocks_exactly(cpu_backend) -> None:
    data = os.urandom((3 << 20) + 10)  # three 1 MiB blocks and a ragged tail
    words = np.frombuffer(data + bytes(2), dtype="<u4").astype(object)
    want = int(sum((np.arange(1, words.size + 1, dtype=object) * words).tolist())) % 2**64
    assert position_sum(data) == want


def test_one_changed_word_anywhere_changes_the_sum(cpu_backend) -> None:
    data = bytearray(os.urandom(1 << 16))
    before = position_sum(data)
    for at in (0, 1, 4095, 40_000, len(data) - 1):
        data[at] ^= 0x80
        assert position_sum(data) != before
        data[at] ^= 0x80


def test_importing_the_connector_loads_no_numba():
    """vLLM's CPU worker scans every loaded module when it starts and fails on
    numba's objects: numba may load only when an engine warms up, after that."""
    code = ("import sys, maru_core.pool, maru_core.pool.checksum, maru_connector.connector, "
            "maru_connector.transfer; assert 'numba' not in sys.modules, 'numba was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
