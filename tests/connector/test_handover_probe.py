"""``bench/handover_probe.py`` reads a load's hand-over from its event log:
the submitter's last unlock, the copy thread's lock and first copy, and the
collections that ran meanwhile."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from handover_probe import loads, report  # noqa: E402

MS = 1_000_000
ENGINE, COPY = 1, 2


def _partial_load(t0: int, load: int, verified: bool) -> list[tuple]:
    meta = {"verified": verified, "partial": True, "bytes": 1 << 29}
    return [
        (t0, ENGINE, "hit", None, {"tag": "p1", "arm": "as shipped"}),
        (t0, ENGINE, "issue_here", load, meta),
        (t0 + 1 * MS, ENGINE, "lock", load, t0 + 1 * MS),
        (t0 + 1 * MS, COPY, "run_load", load, meta),
        (t0 + 2 * MS, ENGINE, "copy", load, None),
        (t0 + 3 * MS, ENGINE, "unlock", load, None),
        (t0 + 3 * MS, ENGINE, "issue_here_end", load, None),
        (t0 + 4 * MS, ENGINE, "wait", load, 0),
        (t0 + 4 * MS, COPY, "gc_start", None, 2),
        (t0 + 6 * MS, COPY, "gc_stop", None, 2),
        (t0 + 7 * MS, COPY, "lock", load, t0 + 1 * MS),
        (t0 + 8 * MS, COPY, "copy", load, None),
        (t0 + 9 * MS, COPY, "mark", load, 0),
        (t0 + 10 * MS, ENGINE, "waited", load, 0),
        (t0 + 11 * MS, COPY, "run_load_end", load, None),
    ]


def test_a_hand_over_is_read_from_the_threads_steps():
    (load,) = loads(_partial_load(0, 7, verified=True))
    assert load["verified"] and load["partial"]
    assert load["released"] == 3.0  # the submitter's unlock, not the copy thread's lock
    assert load["copy_thread_took"] == 1.0
    assert load["copy_thread_asked_lock"] == 1.0 and load["copy_thread_locked"] == 7.0
    assert load["copy_thread_first_copy"] == 8.0  # the copy thread's, not the inline one at 2
    assert (load["layer0_marked"], load["wait0"], load["waited0"]) == (9.0, 4.0, 10.0)
    assert load["gc"] == [{"from": 4.0, "ms": 2.0, "gen": 2, "thread": "other"}]


def test_the_report_leaves_out_each_groups_first_load():
    events = _partial_load(0, 1, verified=True) + _partial_load(20 * MS, 2, verified=True)
    line = report(loads(events))
    assert line.startswith("partial verified (as shipped): 1 loads")
    assert "hand-over (release to the copy thread's first copy) median 5.00" in line
