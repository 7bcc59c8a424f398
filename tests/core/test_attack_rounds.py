"""``bench/attack_rounds.py`` reads rounds of the attack benchmark as one
verdict: the median of each attack's per-round ratios to its own baseline."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from attack_rounds import ratios, verdict  # noqa: E402


def _round(tmp_path, name: str, pairs: dict[str, tuple[float, float]]) -> str:
    results = {}
    for attack, (base, attacked) in pairs.items():
        results[f"alone#{attack}"] = {"heartbeat_p99_ms": base}
        results[attack] = {"heartbeat_p99_ms": attacked}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"results": results}))
    return str(path)


def test_each_attack_is_judged_against_its_own_baseline(tmp_path):
    path = _round(tmp_path, "one", {"pin_flood": (0.5, 1.5), "slowloris": (2.0, 1.0)})
    assert ratios(path) == {"pin_flood": 3.0, "slowloris": 0.5}


def test_the_verdict_is_the_median_of_the_rounds_not_their_worst_or_mean(tmp_path):
    # pin_flood: 3.0, 1.0, 1.5 -> median 1.5 (mean 1.83, worst 3.0); reserve_flood: 2.5, 2.2, 1.0 -> 2.2
    paths = [_round(tmp_path, "r1", {"pin_flood": (0.5, 1.5), "reserve_flood": (0.4, 1.0)}),
             _round(tmp_path, "r2", {"pin_flood": (1.0, 1.0), "reserve_flood": (0.5, 1.1)}),
             _round(tmp_path, "r3", {"pin_flood": (1.0, 1.5), "reserve_flood": (1.0, 1.0)})]
    text = verdict(paths)
    assert "pin_flood                          1.50  3.00 1.00 1.50" in text
    assert "reserve_flood                      2.20  2.50 2.20 1.00" in text
    assert text.endswith("1 of 2 attacks within 2x at the median of 3 rounds")


def test_an_attack_without_a_baseline_or_that_failed_is_left_out(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": {"pin_flood": {"heartbeat_p99_ms": 1.0},
                                            "alone#slowloris": {"heartbeat_p99_ms": 1.0},
                                            "slowloris": {"error": "index died"}}}))
    assert ratios(str(path)) == {}
