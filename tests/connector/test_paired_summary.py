"""``bench/ttft_paired.py`` and ``bench/plot_paired.py`` compare each hit with
its own pair's sync hit, and pool runs row by row."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from plot_paired import pooled, table  # noqa: E402
from ttft_paired import summarise, summarise_store  # noqa: E402


def _served(sync, auto, park):
    return {"sync": {"ttft_s": sync}, "auto": {"ttft_s": auto}, "park": {"ttft_s": park}}


def test_ratios_are_per_pair_not_of_the_medians():
    # Medians 2.0 and 2.0, yet every async hit is 1.5 x its own pair's sync hit.
    row = summarise(_served([1.0, 2.0, 4.0], [1.5, 3.0, 2.0], [1.0, 2.0, 4.0]))
    assert row["auto"]["ratio"] == 1.5 and row["auto"]["faster"] == 1 and row["auto"]["pairs"] == 3
    assert row["park"]["ratio"] == 1.0 and row["park"]["ci95"] == (1.0, 1.0) and row["park"]["faster"] == 0
    low, high = row["auto"]["ci95"]
    assert 0.5 <= low <= 1.5 <= high


def test_a_miss_that_stores_is_compared_with_its_pair_that_does_not():
    row = summarise_store({"store": {"ttft_s": [1.1, 2.2, 0.9]}, "skip": {"ttft_s": [1.0, 2.0, 1.0]}})
    assert abs(row["ratio"] - 1.1) < 1e-9 and row["faster"] == 1 and row["pairs"] == 3
    assert abs(row["store_ms"] - 1100) < 1e-6 and abs(row["skip_ms"] - 1000) < 1e-6


def test_runs_pool_row_by_row(tmp_path):
    paths = []
    for i, sync in enumerate(([1.0, 1.0], [2.0])):
        run = {"results": {"mp-off": {"chunkwise": {
            "full-1024": _served(sync, [x * 1.1 for x in sync], sync),
            "busy": {"sync": {"hits_s": [9.0]}}, "loadavg": [1.0]}}}}
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    rows = pooled([str(p) for p in paths])
    assert list(rows) == ["mp-off chunkwise full-1024"]
    assert rows["mp-off chunkwise full-1024"]["sync"]["ttft_s"] == [1.0, 1.0, 2.0]
    assert "| mp-off chunkwise full-1024 | 3 |" in table(rows)


def test_the_verified_cost_plot_reads_each_run_s_pairs_and_arms(tmp_path, capsys, monkeypatch):
    """``bench/plot_verified_cost.py`` over two recorded GPU runs (round 13):
    the medians it plots are the ones their harness printed, a run's arm
    labels its points, and the plot is written."""
    import plot_verified_cost

    rounds = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results", "verify_h200", "round13")
    big = os.path.join(rounds, "lease4", "big", "ttft.json")
    armed = os.path.join(rounds, "lease4", "new3", "ttft_layerwise_paired", "ttft.json")
    rows = {(r[0], r[1]): r for r in plot_verified_cost.costs("big", big) + plot_verified_cost.costs("4k", armed)}
    printed = {("chunkwise 16384", "big"): 1.4, ("chunkwise 32768", "big"): 1.0, ("layerwise 32768", "big"): 0.4,
               ("layerwise 16384+2048", "big"): 1.4, ("layerwise 4096+512", "4k COPIES_AHEAD=2"): 3.9}
    for key, percent in printed.items():
        median, q1, q3 = rows[key][2:]
        assert round((median - 1) * 100, 1) == percent and q1 <= median <= q3, key
    out = tmp_path / "cost.png"
    monkeypatch.setattr(sys, "argv", ["plot_verified_cost.py", str(out), f"big={big}", f"4k={armed}"])
    plot_verified_cost.main()
    assert out.stat().st_size > 10_000 and "layerwise 4096: 4k COPIES_AHEAD=2 +1.5%" in capsys.readouterr().out
