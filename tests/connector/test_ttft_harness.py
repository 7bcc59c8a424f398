"""The GPU TTFT benchmark's CPU mode, on tiny sizes: the harness drives the
real scheduler and worker halves against a real index process, every hit
loads bit-exact KV, and every figure it reports is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_mode_serves_bit_exact_hits_in_every_mode(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, p) for p in ("core", "connector", "tests/connector")]
        + [env.get("PYTHONPATH", "")])
    modes = ["sync", "sync_overlap", "async", "async_overlap"]
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ttft_gpu.py"), "--cpu",
           "--out", str(tmp_path), "--repeats", "1", "--formats", "chunkwise", "layerwise",
           "--modes", *modes, "--concurrency", "2", "--timeline", "256/async_overlap"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "ttft.json").read_text())
    assert [f["format"] for f in result["formats"]] == ["chunkwise", "layerwise"]
    for fmt in result["formats"]:
        assert set(fmt["hits"]) == {"256", "256+64"}
        for case, row in fmt["hits"].items():
            assert row["load_alone"]["verified"], (fmt["format"], case)
            for mode in modes:
                assert row[mode]["verified"], (fmt["format"], case, mode)
                assert len(row[mode]["ttft_s"]) == 1 and row[mode]["median_s"] > 0
            assert row["recompute_s"] > 0 and row["compute_alone_s"] > 0
        assert fmt["store_cost"]["store_s"] > 0 and fmt["store_cost"]["committed_after_s"] >= 0
        for count in ("sync/2", "async_overlap/2"):
            assert len(fmt["concurrency"][count]["ttft_s"]) == 2
            assert fmt["concurrency"][count]["verified"]
    assert "| 256+64 |" in run.stdout
    # the timeline of one case: its phases in the order a hit goes through them
    for fmt in result["formats"]:
        phases = fmt["hits"]["256"]["async_overlap"]["phases_ms"]
        order = ["lookup_answered", "load_submitted", "forward_started", "forward_queued",
                 "first_token"]
        assert [phases[k] for k in order] == sorted(phases[k] for k in order), phases
        # as in vLLM, the token reaches the host only after wait_for_save
        assert phases["first_token"] >= phases["forward_queued"] + phases["wait_for_save_ms"]
        assert "phases_ms" not in fmt["hits"]["256"]["sync"]


def test_paired_mode_serves_the_variants_in_turn_and_reports_per_round_ratios(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, p) for p in ("core", "connector", "tests/connector")]
        + [env.get("PYTHONPATH", "")])
    modes = ["sync_overlap", "sync_overlap_unverified"]
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ttft_gpu.py"), "--cpu", "--paired",
           "--out", str(tmp_path), "--repeats", "3", "--formats", "chunkwise", "--sizes", "256",
           "--modes", *modes, "--arms", "COPIES_AHEAD=0", "COPIES_AHEAD=2,HEAD_ONLY_ALWAYS=1",
           "--concurrency", "1"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "ttft.json").read_text())
    arms = ["COPIES_AHEAD=0", "COPIES_AHEAD=2,HEAD_ONLY_ALWAYS=1"]
    variants = [f"{m}@{arm}" for arm in arms for m in modes]
    assert result["args"]["columns"] == variants
    for row in result["formats"][0]["hits"].values():
        for v in variants:
            assert row[v]["verified"] and len(row[v]["ttft_s"]) == 3, v
        for arm in arms:
            paired = row["paired"][f"sync_overlap@{arm}"]
            ratios = sorted(a / b for a, b in zip(row[f"sync_overlap@{arm}"]["ttft_s"],
                                                  row[f"sync_overlap_unverified@{arm}"]["ttft_s"]))
            assert paired["ratios"] == ratios and paired["q1"] <= paired["median"] <= paired["q3"]
        assert set(row["paired"]) == {f"sync_overlap@{arm}" for arm in arms}
    assert f"sync_overlap@{arms[1]} / its unverified twin, paired over 3 rounds" in run.stdout
