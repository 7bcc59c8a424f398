"""The extent allocator: best fit, coalescing, no run handed out twice, checked against a page bitmap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from maru_core.index.allocator import AllocatorError, ExtentAllocator


def test_allocations_are_disjoint_and_fill_the_pool() -> None:
    alloc = ExtentAllocator(100)
    runs = [(alloc.allocate(10), 10) for _ in range(10)]
    assert sorted(s for s, _ in runs) == list(range(0, 100, 10))
    assert alloc.free_pages == 0 and alloc.allocate(1) is None


def test_best_fit_takes_the_smallest_extent_that_fits() -> None:
    alloc = ExtentAllocator(100)
    for start, count in [(0, 10), (15, 5), (30, 20), (60, 40)]:
        assert alloc.allocate_at(start, count)
    # free extents now: [10,15) 5 pages, [20,30) 10 pages, [50,60) 10 pages
    assert alloc.allocate(4) == 10  # the 5-page hole, not a 10-page one
    assert alloc.allocate(6) == 20  # lowest of the two 10-page holes
    assert alloc.allocate(11) is None
    assert alloc.largest_free == 10


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = ExtentAllocator(30)
    a, b, c = alloc.allocate(10), alloc.allocate(10), alloc.allocate(10)
    alloc.free(a, 10)
    alloc.free(c, 10)
    assert alloc.extent_count == 2
    alloc.free(b, 10)
    assert list(alloc.extents()) == [(0, 30)]
    assert alloc.fragmentation() == 0.0


def test_double_free_and_out_of_range_are_errors() -> None:
    alloc = ExtentAllocator(20)
    start = alloc.allocate(5)
    alloc.free(start, 5)
    with pytest.raises(AllocatorError, match="already"):
        alloc.free(start, 5)
    with pytest.raises(AllocatorError, match="outside"):
        alloc.free(18, 5)
    with pytest.raises(ValueError):
        alloc.allocate(0)


def test_free_runs_merges_adjacent_runs_first() -> None:
    alloc = ExtentAllocator(100)
    starts = [alloc.allocate(10) for _ in range(10)]
    alloc.free_runs(np.array(starts[2:6][::-1]), np.array([10] * 4))
    assert (20, 40) in list(alloc.extents())
    with pytest.raises(AllocatorError, match="overlap"):
        alloc.free_runs(np.array([60, 65]), np.array([10, 10]))


def test_from_occupied_frees_exactly_the_gaps() -> None:
    alloc = ExtentAllocator.from_occupied(100, np.array([0, 20, 50]), np.array([5, 10, 50]))
    assert list(alloc.extents()) == [(5, 15), (30, 20)]
    assert alloc.free_pages == 35
    with pytest.raises(AllocatorError):
        ExtentAllocator.from_occupied(100, np.array([0, 3]), np.array([5, 5]))


def test_allocate_at_refuses_pages_in_use() -> None:
    alloc = ExtentAllocator(50)
    assert alloc.allocate_at(10, 10)
    assert not alloc.allocate_at(15, 10)
    assert not alloc.allocate_at(5, 6)
    assert alloc.allocate_at(5, 5)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocations and frees, checked against a bitmap of pages in use."""

    @initialize(num_pages=st.integers(1, 300))
    def start(self, num_pages: int) -> None:
        self.alloc = ExtentAllocator(num_pages)
        self.used = np.zeros(num_pages, dtype=bool)
        self.runs: list[tuple[int, int]] = []

    @rule(count=st.integers(1, 40))
    def allocate(self, count: int) -> None:
        fitting = sorted((c, s) for s, c in self.alloc.extents() if c >= count)
        start = self.alloc.allocate(count)
        if start is None:
            assert not fitting, "an extent was large enough, yet allocate refused"
            return
        assert start == fitting[0][1], "not the best fit (smallest extent, lowest address)"
        assert not self.used[start : start + count].any(), "pages handed out twice"
        assert start + count <= len(self.used)
        self.used[start : start + count] = True
        self.runs.append((start, count))

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def free(self, data) -> None:
        start, count = self.runs.pop(data.draw(st.integers(0, len(self.runs) - 1)))
        self.alloc.free(start, count)
        self.used[start : start + count] = False

    @precondition(lambda self: len(self.runs) >= 2)
    @rule(data=st.data())
    def free_many(self, data) -> None:
        k = data.draw(st.integers(2, len(self.runs)))
        chosen = [self.runs.pop(data.draw(st.integers(0, len(self.runs) - 1))) for _ in range(k)]
        self.alloc.free_runs(np.array([s for s, _ in chosen]), np.array([c for _, c in chosen]))
        for s, c in chosen:
            self.used[s : s + c] = False

    @invariant()
    def free_extents_are_exactly_the_unused_pages(self) -> None:
        free = np.ones(len(self.used), dtype=bool)
        free[self.used] = False
        covered = np.zeros(len(self.used), dtype=bool)
        previous_end = -1
        for start, count in self.alloc.extents():
            assert start > previous_end, "two free extents touch or overlap: not coalesced"
            covered[start : start + count] = True
            previous_end = start + count
        assert (covered == free).all()
        assert self.alloc.free_pages == int(free.sum())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
