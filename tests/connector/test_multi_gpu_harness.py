"""The several-GPU harness (``bench/multi_gpu.py``): its plan of which
process runs on which GPU and loads which prefix, its argument checks, the
floor arithmetic and summaries, the KV fingerprint, and a whole run of both
experiments on the CPU (two processes, gloo, a real index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "bench")]

from multi_gpu_plan import (  # noqa: E402
    FLOOR_FACTOR, GB, PlanError, build_plan, check_room, check_shape, floor_s,
    pool_bytes_needed, resolve_collective, summarize_runs, table)

LLAMA = dict(heads=32, kv_heads=8, ffn=14336)


def test_tp_ranks_spread_over_gpus_and_each_loads_its_own_shard():
    plan = build_plan("tp", 4, 4)
    assert [p.device for p in plan.procs] == [0, 1, 2, 3]
    assert [(p.tp_rank, p.tp_size) for p in plan.procs] == [(r, 4) for r in range(4)]
    assert all(p.writes == (0,) and p.loads == {"tp": 0} for p in plan.procs)
    assert plan.collective == "nccl" and plan.num_prefixes == 1 and not plan.shares_devices


def test_two_ranks_on_one_gpu_share_device_zero_and_reduce_on_gloo():
    plan = build_plan("tp", 2, 1)
    assert [p.device for p in plan.procs] == [0, 0]
    assert plan.shares_devices and plan.collective == "gloo"
    assert build_plan("tp", 2, 1, collective="nccl").collective == "nccl"  # asked: tried first
    assert [p.device for p in build_plan("tp", 4, 2).procs] == [0, 1, 0, 1]


def test_engines_write_one_prefix_each_and_never_load_their_own_when_different():
    plan = build_plan("engines", 8, 8)
    assert plan.num_prefixes == 8 and plan.collective == "none"
    assert [p.writes for p in plan.procs] == [(i,) for i in range(8)]
    assert all(p.loads["same"] == 0 for p in plan.procs)
    different = [p.loads["different"] for p in plan.procs]
    assert sorted(different) == list(range(8))  # eight prefixes at once
    assert all(d != p.rank for d, p in zip(different, plan.procs))
    assert all((p.tp_rank, p.tp_size) == (0, 1) for p in plan.procs)


@pytest.mark.parametrize("experiment, processes, gpus, available, words", [
    ("tp", 2, 4, None, "exceeds --processes"),
    ("tp", 4, 3, None, "not a multiple of --gpus"),
    ("tp", 3, 3, None, "TP=3 does not divide"),
    ("tp", 16, 16, None, r"KV heads \(8\)"),
    ("engines", 8, 8, 1, "this machine has 1 CUDA device"),
    ("engines", 0, 1, None, "at least 1"),
    ("pipeline", 2, 2, None, "experiment must be one of"),
])
def test_bad_shapes_are_refused_saying_what_to_change(experiment, processes, gpus, available, words):
    with pytest.raises(PlanError, match=words):
        check_shape(experiment, processes, gpus, available_gpus=available, **LLAMA)


def test_shapes_that_fit_pass():
    check_shape("tp", 8, 8, available_gpus=8, **LLAMA)
    check_shape("tp", 2, 1, available_gpus=1, **LLAMA)
    check_shape("engines", 3, 3, **LLAMA)  # engines do not split the model


def test_collective_choice():
    assert resolve_collective("auto", 2, 2, "cuda") == "nccl"
    assert resolve_collective("auto", 2, 1, "cuda") == "gloo"
    assert resolve_collective("auto", 2, 1, "cpu") == "gloo"
    with pytest.raises(PlanError, match="needs CUDA"):
        resolve_collective("nccl", 2, 1, "cpu")
    with pytest.raises(PlanError, match="must be one of"):
        resolve_collective("mpi", 2, 2, "cuda")


def test_pool_holds_every_prefix_and_a_short_shm_is_refused_before_any_is_made():
    per_token = 32 * 2 * 8 * 128 * 2  # Llama-8B: 128 KiB of KV per token
    need = pool_bytes_needed(build_plan("engines", 8, 8), 16384, per_token)
    assert need >= 8 * (2 << 30) and need % (2 << 20) == 0
    assert pool_bytes_needed(build_plan("tp", 8, 8), 16384, per_token) < need / 4
    check_room(need, need)
    with pytest.raises(PlanError, match=r"needs 1[78]\.\d GiB but /dev/shm has 8\.0 GiB free"):
        check_room(need, 8 << 30)


def test_floor_adds_the_bytes_of_ranks_that_share_a_gpu():
    peak = 50.0  # GB/s
    one = floor_s({0: 10 * 10**9}, {0: peak})
    assert one == pytest.approx(0.2)
    assert floor_s({0: 5 * 10**9, 1: 5 * 10**9}, {0: peak, 1: peak}) == pytest.approx(0.1)
    assert floor_s({0: 5 * 10**9, 1: 5 * 10**9}, {0: peak, 1: 25.0}) == pytest.approx(0.2)
    assert floor_s({0: 10**9}, {}) is None  # no peak measured (CPU)


def report(rank, starts, firsts, peak=50.0, nbytes=10**9, verified=True, case="tp", loaded=None):
    times = [{"start": s, "loaded": (loaded or f)[i] if loaded else f, "first_token": f}
             for i, (s, f) in enumerate(zip(starts, firsts))]
    return {"rank": rank, "ok": True, "pinned_peak_gbps": peak,
            "runs": {case: {"sync": {"bytes": nbytes, "verified": verified, "times": times}}}}


def test_tp_summary_is_the_last_first_token_against_the_slowest_gpus_floor():
    plan = build_plan("tp", 2, 2)
    reports = [report(0, [10.0, 20.0, 30.0], [10.030, 20.025, 30.040]),
               report(1, [10.001, 20.0, 30.002], [10.031, 20.026, 30.041], peak=40.0)]
    s = summarize_runs(plan, reports, "tp", "sync")
    assert s["ttft_s"] == pytest.approx([0.031, 0.026, 0.041])
    assert s["median_ttft_s"] == pytest.approx(0.031)
    assert s["floor_s"] == pytest.approx(10**9 / (40.0 * GB))  # the slower GPU's
    assert s["ttft_over_floor"] == pytest.approx(0.031 / 0.025)
    assert s["within_target"] is (0.031 / 0.025 <= FLOOR_FACTOR)
    assert s["verified"] and "n_times_peak_gbps" not in s
    reports[1]["runs"]["tp"]["sync"]["verified"] = False
    assert not summarize_runs(plan, reports, "tp", "sync")["verified"]


def test_shared_gpu_floor_counts_both_ranks_bytes():
    plan = build_plan("tp", 2, 1)
    reports = [report(0, [0.0], [0.1]), report(1, [0.0], [0.1])]
    s = summarize_runs(plan, reports, "tp", "sync")
    assert s["floor_s"] == pytest.approx(2 * 10**9 / (50.0 * GB))


def test_engines_summary_against_n_peaks_and_n_floors():
    plan = build_plan("engines", 2, 2)
    reports = [report(r, [1.0], [1.2], nbytes=2 * 10**9, case="same", loaded=[1.1]) for r in (0, 1)]
    s = summarize_runs(plan, reports, "same", "sync")
    assert s["aggregate_gbps"] == pytest.approx(4 * 10**9 / 0.1 / GB)
    assert s["n_times_peak_gbps"] == pytest.approx(100.0)
    assert s["aggregate_over_n_peak"] == pytest.approx(0.4)
    assert s["one_hit_floor_s"] == pytest.approx(0.04)
    assert s["last_token_over_n_floors"] == pytest.approx(0.2 / 0.08)
    text = table([s], plan)
    assert "| same | sync | 200.0 ms |" in text and "| True |" in text


def test_fingerprint_sees_any_one_element_and_nothing_else():
    from multi_gpu_worker import fingerprint

    layers = [torch.randn(6, 2, 4, 8).to(torch.bfloat16) for _ in range(2)]
    same = [t.clone() for t in layers]
    assert fingerprint(layers, [1, 3, 4]) == fingerprint(same, [1, 3, 4])
    assert fingerprint(layers, [1, 3, 4]) != fingerprint(layers, [3, 1, 4])  # order counts
    flipped = same[1].view(torch.int16)
    flipped[3, 1, 2, 5] ^= 1  # one bit of one element of a loaded block
    assert fingerprint(same, [1, 3, 4])[0] == fingerprint(layers, [1, 3, 4])[0]
    assert fingerprint(same, [1, 3, 4])[1] != fingerprint(layers, [1, 3, 4])[1]
    assert fingerprint(same, [0, 2, 5]) == fingerprint(layers, [0, 2, 5])  # other blocks


def test_arguments_a_hit_cannot_have_are_refused():
    from multi_gpu import parse

    with pytest.raises(SystemExit):
        parse(["--experiment", "tp", "--processes", "2", "--tokens", "1000", "--out", "x"])
    args = parse(["--experiment", "tp", "--processes", "4", "--out", "x"])
    assert (args.gpus, args.tokens, args.cases, args.tag) == (4, 16384, ["tp"], "tp4_on_4gpu")


def test_one_failed_process_gives_the_others_a_grace_then_they_are_killed():
    import time

    from multi_gpu import watch

    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.monotonic()
    why = watch([waiting, failing], timeout=50, grace=1.0)
    assert time.monotonic() - start < 10
    assert waiting.returncode == -9 and failing.returncode == 3
    assert why == {0: "killed: rank 1 failed and this one did not finish within 1 s"}


def test_processes_past_the_timeout_are_killed():
    from multi_gpu import watch

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    assert watch([slow, done], timeout=2) == {0: "killed: the run passed --timeout 2 s"}
    assert slow.returncode == -9 and done.returncode == 0


def run_harness(tmp_path, *extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, p) for p in ("core", "connector", "tests/connector")]
        + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(ROOT, "bench", "multi_gpu.py"), "--cpu", "--tokens", "256",
           "--layers", "2", "--repeats", "1", "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_cpu_tp2_on_one_device_loads_each_ranks_own_shard_bit_exact(tmp_path):
    run = run_harness(tmp_path, "--experiment", "tp", "--processes", "2", "--gpus", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multi_gpu_tp2_on_1gpu_cpu.json").read_text())
    assert [r["collective"] for r in result["reports"]] == ["gloo (ranks share a GPU)"] * 2
    assert [(s["case"], s["mode"]) for s in result["summaries"]] == [("tp", "sync"), ("tp", "overlap")]
    # the loads check the payload against the writer's checksums, as the connector does
    assert all(r["runs"]["tp"][m]["payload_checked"] for r in result["reports"]
               for m in ("sync", "overlap"))
    for s in result["summaries"]:
        assert s["verified"] and s["median_ttft_s"] > 0 and len(s["ttft_s"]) == 1
        # each rank holds half the KV heads: half the bytes of the whole prefix
        assert set(s["bytes_by_rank"].values()) == {256 * 2 * 1 * 64 * 2 * 2}
    assert "| tp | sync |" in run.stdout and "PASSED" in run.stdout


def test_cpu_two_engines_load_one_prefix_and_two_prefixes_at_once(tmp_path):
    run = run_harness(tmp_path, "--experiment", "engines", "--processes", "2", "--gpus", "1",
                      "--modes", "sync")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multi_gpu_engines2_on_1gpu_cpu.json").read_text())
    assert [s["case"] for s in result["summaries"]] == ["same", "different"]
    assert all(s["verified"] for s in result["summaries"])
    loads = {r["rank"]: {c: v["sync"]["prefix"] for c, v in r["runs"].items()}
             for r in result["reports"]}
    assert loads == {0: {"same": 0, "different": 1}, 1: {"same": 0, "different": 0}}


def test_a_refused_plan_exits_2_before_any_index_starts(tmp_path):
    run = run_harness(tmp_path, "--experiment", "tp", "--processes", "2", "--gpus", "4")
    assert run.returncode == 2 and "exceeds --processes" in run.stdout
