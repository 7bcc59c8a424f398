"""``bench/loop_steps.py`` counts each peer's long turns whatever their kind: a few
rare long steps, too few for any kind's p99, are what set a heartbeat's p99."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from loop_steps import StepTimer, long_turn_lines  # noqa: E402


def test_long_turns_are_counted_per_peer_with_the_three_longest() -> None:
    timer = StepTimer()
    attacker, honest = SimpleNamespace(peer_key="10.0.0.2"), SimpleNamespace(peer_key="10.0.0.1")
    for ms, label in ((0.4, "short"), (0.6, "a"), (1.5, "b"), (2.5, "place"), (0.7, "c")):
        timer._record(attacker, label, ms / 1000)
    timer._record(honest, "lookup", 0.3 / 1000)  # no long turn: no entry
    turns = timer.long_turns()
    assert list(turns) == ["10.0.0.2"]
    assert turns["10.0.0.2"] == {"over_0.5ms": 4, "over_1.0ms": 2, "over_2.0ms": 1,
                                 "longest": [(2.5, "place"), (1.5, "b"), (0.7, "c")]}  # fmt: skip
    assert len(timer.samples["short"]) == 1  # every turn still counts for its kind's percentiles
    assert "10.0.0.2" in long_turn_lines(turns) and "[4, 2, 1]" in long_turn_lines(turns)
